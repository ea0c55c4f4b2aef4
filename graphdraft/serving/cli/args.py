"""The command line's parser: flags, their checks, and errors that name the flag typed.

Every user error ends the same way: one line on stderr, `graphdraft <command>: error: <flag>:
<what was expected>, got <what came>`, exit code 2, no traceback. argparse's own errors
(unknown flag, bad value, abbreviation) go through `Parser.error`; errors found later (a
config value the runtime rejects, a checkpoint that does not load) are raised as
`CliError`, or as the library's ValueError, whose leading config-field name `translate`
turns into the flag (`max_context_len: ...` -> `--max-context-len: ...`).
"""

from __future__ import annotations

import argparse
import json
import math
import re

import torch

from graphdraft.config import RuntimeConfig, default_device
from graphdraft.sampling import flag_fields


class CliError(Exception):
    """A user error found after parsing; its message names the flag (one line, exit 2)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after every flag's help; the description printed as written."""


class Parser(argparse.ArgumentParser):
    """No abbreviations; `error` prints one line (no usage block) and exits 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D401 (argparse's name)
        self.exit(2, f"{self.prog}: error: {message}\n")


# ---------------------------------------------------------------------------------------
# Value types: argparse reports their ArgumentTypeError as "argument --flag: <message>"
# ---------------------------------------------------------------------------------------
def int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an int >= {lo}, got {text!r}")
        return value
    parse.__name__ = f"int >= {lo}"
    return parse


def policy_arg(text: str) -> str:
    """`--speculative-policy`: 'adaptive' or 'fixed' (`policy.check_speculative_policy`)."""
    from graphdraft.serving.policy import POLICY_MODES

    if text not in POLICY_MODES:
        raise argparse.ArgumentTypeError(f"expected one of {list(POLICY_MODES)}, got {text!r}")
    return text


policy_arg.__name__ = "speculative policy"


def float_in(lo: float, hi: float, *, lo_open: bool = False, what: str = ""):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = (value > lo if lo_open else value >= lo) and value <= hi
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    parse.__name__ = what
    return parse


def device_arg(text: str) -> str:
    """'cpu', 'cuda' or 'cuda:N', where such a device exists."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"expected 'cpu', 'cuda' or 'cuda:N', got {text!r}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU build of torch" if torch.version.cuda is None else "no GPU visible"
            raise argparse.ArgumentTypeError(
                f"expected 'cpu': no CUDA device is available here ({build}), got {text!r}")
        if index and int(index) >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"expected cuda:0..cuda:{torch.cuda.device_count() - 1}, got {text!r}")
    return text


# ---------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------
DEFAULT_MAX_CONTEXT_LEN = 1024
LOG_LEVELS = ("debug", "info", "warning", "error")

FIELD_FLAGS = {
    "speculative_num_steps": "--speculative-num-steps",
    "speculative_policy": "--speculative-policy",
    "speculative_eagle_topk": "--speculative-eagle-topk",
    "speculative_num_draft_tokens": "--speculative-num-draft-tokens",
    "speculative_algorithm": "--speculative-algorithm",
    "ngram_min": "--ngram-min",
    "ngram_max": "--ngram-max",
    "page_size": "--page-size",
    "max_running_requests": "--max-running-requests",
    "max_context_len": "--max-context-len",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "cuda_graph_max_bs": "--cuda-graph-max-bs",
    "cuda_graph_bs": "--cuda-graph-bs",
    "dtype": "--dtype",
    "device": "--device",
    "kernel_backend": "--kernel-backend",
    "kv_cache_memory_gb": "--kv-cache-memory-gb",
    "precompile_workers": "--precompile-workers",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty",
    "frequency_penalty": "--frequency-penalty",
    "presence_penalty": "--presence-penalty",
    "logit_bias": "--logit-bias",
    "prompt_logprobs": "--prompt-logprobs",
    "logprobs": "--logprobs",
    "include_stop_str_in_output": "--include-stop-str-in-output",
}
"""Config / SamplingParams field -> the flag that sets it (error messages name the flag)."""


def translate(message: str) -> str:
    """A library error message with every config field it names (`params.` included: the
    Engine's request checks) replaced by its flag."""
    return re.sub(r"\b(?:params\.)?(" + "|".join(FIELD_FLAGS) + r")\b",
                  lambda m: FIELD_FLAGS[m.group(1)], message)


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    d = RuntimeConfig.__dataclass_fields__
    g = p.add_argument_group("runtime")
    g.add_argument("--speculative-num-steps", type=int_at_least(1),
                   default=d["speculative_num_steps"].default,
                   help="draft tokens proposed per verify (chain length S; N = S + 1 verified)")
    g.add_argument("--speculative-policy", type=policy_arg, default=d["speculative_policy"].default,
                   help="draft steps per cycle: 'adaptive' picks 0 (target-only), 1 or S per "
                        "batch size from measured cycle costs and the running accept rate; "
                        "'fixed' always drafts S")
    g.add_argument("--speculative-eagle-topk", type=int_at_least(1),
                   default=d["speculative_eagle_topk"].default,
                   help="beams per draft step: 1 drafts a chain; k > 1 drafts a tree of "
                        "--speculative-num-draft-tokens nodes verified at once (fixed policy)")
    g.add_argument("--speculative-num-draft-tokens", type=int_at_least(2), default=None,
                   help="tree nodes verified per request, root included (None: S + 1); "
                        "2..1 + k + (S-1)*k^2 and <= 64; with topk 1 only S + 1")
    g.add_argument("--speculative-algorithm", choices=["eagle3", "ngram"],
                   default=d["speculative_algorithm"].default,
                   help="what drafts: 'eagle3' the EAGLE-3 head; 'ngram' prompt lookup (the "
                        "tokens that followed the last earlier occurrence of the request's last "
                        "n tokens; the target alone is loaded, no head)")
    g.add_argument("--ngram-min", type=int_at_least(1), default=d["ngram_min"].default,
                   help="shortest suffix the n-gram drafter matches")
    g.add_argument("--ngram-max", type=int_at_least(1), default=d["ngram_max"].default,
                   help="longest suffix the n-gram drafter tries first (<= 64)")
    g.add_argument("--page-size", type=int_at_least(1), default=d["page_size"].default,
                   help="tokens per KV-cache page")
    g.add_argument("--max-running-requests", type=int_at_least(1), default=16,
                   help="request slots (the largest batch)")
    g.add_argument("--max-context-len", type=int_at_least(2), default=None,
                   help=f"longest prompt + output + look-ahead (None: {DEFAULT_MAX_CONTEXT_LEN}, "
                        "capped at the target's max_position_embeddings)")
    g.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=2048,
                   help="token budget of one forward (chunked-prefill size)")
    g.add_argument("--kv-cache-memory-gb", type=float_in(0, math.inf, lo_open=True,
                                                         what="a number of GB > 0"),
                   default=d["kv_cache_memory_gb"].default,
                   help="budget of the target's KV pool (GB, 1e9 bytes)")
    g.add_argument("--cuda-graph-max-bs", type=int_at_least(1), default=None,
                   help="largest captured batch size (None: --max-running-requests); "
                        "must not exceed --max-running-requests")
    g.add_argument("--cuda-graph-bs", type=int_at_least(1), nargs="+", default=None,
                   help="explicit captured batch sizes, ascending (None: 1, 2, 4, 8, 16, 24, ...)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="turn every CUDA graph off (also: GRAPHDRAFT_EAGER=1)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="model dtype (None: float32; bfloat16 for --target on a GPU)")
    g.add_argument("--device", type=device_arg, default=default_device(),
                   help="'cpu', 'cuda' or 'cuda:N'")
    g.add_argument("--kernel-backend", default="auto", choices=["auto", "triton", "torch"],
                   help="Triton kernels, plain torch, or auto (Triton on CUDA)")
    g.add_argument("--precompile-workers", type=int_at_least(0), default=None,
                   help="processes compiling the Triton kernels before capture (0: in this "
                        f"process; unset: {RuntimeConfig.precompile_workers_default})")
    g.add_argument("--dp-size", type=int_at_least(1), default=d["dp_size"].default,
                   help="data-parallel attention ranks (generate; start one process per rank "
                        "with torchrun --nproc-per-node N: gloo on CPU, NCCL on CUDA)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", default=None,
                   help="Hugging Face Llama checkpoint directory (None: the shipped pair)")
    g.add_argument("--draft", default=None,
                   help="EAGLE-3 head checkpoint directory (with --target)")
    g.add_argument("--random-models", action="store_true",
                   help="a random-weight pair instead of the shipped trained one")


def json_field(f):
    """A flag whose value is JSON converted by the sampling field `f` (`f.convert`), e.g.
    `--logit-bias '{"50256": -100}'`."""
    def parse(text: str):
        try:
            return f.validate(json.loads(text))
        except (json.JSONDecodeError, ValueError) as e:
            raise argparse.ArgumentTypeError(f"expected {f.expected} as JSON, got {text!r}"
                                             ) from e
    parse.__name__ = f"JSON {f.name}"
    return parse


def sampling_flag_values(a: argparse.Namespace) -> dict:
    """The sampling flags' values by `SamplingParams` field name (every field with a flag)."""
    return {f.name: getattr(a, f.flag[2:].replace("-", "_")) for f in flag_fields()}


def add_sampling_flags(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """One flag per sampling field with a `flag` (`graphdraft.sampling.SAMPLING_FIELDS`: type,
    range, default and help from the record; `max_new_tokens` the command's default), then
    `--seed` (the Engine's seed, not a per-request field)."""
    g = p.add_argument_group("sampling")
    for f in flag_fields():
        r = f.range
        if f.convert is not None:  # a structured value (logit_bias): JSON, checked by the field
            kind = json_field(f)
        else:
            kind = (int_at_least(int(r.lo)) if f.integer else
                    float_in(r.lo, r.hi, lo_open=r.lo_open, what=f"a number {f.expected}"))
        default = max_new_tokens if f.name == "max_new_tokens" else f.default
        g.add_argument(f.flag, type=kind, default=default, help=f.help)
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the models' random weights and the requests' samplers")


def add_output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--metrics-json", default=None, metavar="PATH",
                   help="write the serving metrics (Engine.metrics_snapshot()) as JSON to PATH")
    g.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                   help="level of the 'graphdraft' and 'capture' loggers (debug: tracebacks too)")
    g.add_argument("--quiet", action="store_true",
                   help="no progress bars (CUDA-graph capture, serving)")


def check_conflicts(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Reject flag combinations that contradict each other (nothing is capped silently)."""
    if a.cuda_graph_max_bs is not None and a.cuda_graph_max_bs > a.max_running_requests:
        p.error(f"argument --cuda-graph-max-bs: expected <= --max-running-requests "
                f"({a.max_running_requests}), got {a.cuda_graph_max_bs}")
    if a.random_models and (a.target or a.draft):
        p.error("argument --random-models: expected no --target / --draft with it")
    if getattr(a, "speculative_algorithm", "eagle3") == "ngram":
        if a.draft:
            p.error("argument --draft: expected none with --speculative-algorithm ngram (it "
                    "drafts by lookup, without a head)")
        if getattr(a, "speculative_eagle_topk", 1) != 1:
            p.error("argument --speculative-eagle-topk: expected 1 with --speculative-algorithm "
                    "ngram (tree drafting needs the EAGLE-3 head)")
    elif bool(a.target) != bool(a.draft):
        given, missing = ("--target", "--draft") if a.target else ("--draft", "--target")
        p.error(f"argument {missing}: expected with {given} (a target and its EAGLE-3 head)")
    if getattr(a, "ngram_max", 1) < getattr(a, "ngram_min", 1):
        p.error(f"argument --ngram-max: expected >= --ngram-min ({a.ngram_min}), got "
                f"{a.ngram_max}")
    if getattr(a, "dp_size", 1) > 1 and getattr(a, "command", None) == "demo":
        p.error("argument --dp-size: expected 1 for demo (generate serves data-parallel)")
    if getattr(a, "temperature", None) == 0:
        if a.top_p != 1.0:
            p.error("argument --top-p: has no effect when greedy; expected --temperature > 0")
        if a.top_k != 0:
            p.error("argument --top-k: has no effect when greedy; expected --temperature > 0")
        if getattr(a, "min_p", 0.0) != 0:
            p.error("argument --min-p: has no effect when greedy; expected --temperature > 0")
