"""Command line: `python -m graphdraft demo [flags]`.

Flags follow the serving ecosystem's names (`--speculative-num-steps`,
`--cuda-graph-max-bs`, `--enforce-eager`, ...). The demo loads a model pair, serves a
batch of prompts with speculative decoding and with the target alone, and prints
tokens/s, the speed-up, the mean accept length and how many forwards replayed a CUDA graph.

Model pairs: by default the trained byte-level pair shipped in `graphdraft/assets/`
(a small Llama target and its EAGLE-3 head, trained on the Python standard library's
sources; prompts are held-out stdlib files, see `graphdraft/assets/MODEL_CARD.md`);
`--target DIR --draft DIR` for other checkpoints; `--random-models` for a random-weight
pair (drafts are then almost never accepted).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path

import torch

from graphdraft.config import ModelConfig, RuntimeConfig, default_device
from graphdraft.eagle3 import Eagle3DraftHead
from graphdraft.engine import Engine, EngineStats
from graphdraft.llama import LlamaForCausalLM
from graphdraft.random_models import random_model_pair
from graphdraft.verify import SamplingParams

log = logging.getLogger("graphdraft")


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    d = RuntimeConfig.__dataclass_fields__
    p.add_argument("--speculative-num-steps", type=int, default=d["speculative_num_steps"].default)
    p.add_argument("--page-size", type=int, default=d["page_size"].default)
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--max-context-len", type=int, default=None,
                   help="default: 1024, capped at the target's max_position_embeddings")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--cuda-graph-max-bs", type=int, default=16)
    p.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None)
    p.add_argument("--enforce-eager", action="store_true",
                   help="turn every CUDA graph off (also: GRAPHDRAFT_EAGER=1)")
    p.add_argument("--dtype", default=None,
                   help="float32 | bfloat16 | float16 (default: float32; bf16 for --target on a GPU)")
    p.add_argument("--device", default=default_device())
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "triton", "torch"])


DEFAULT_MAX_CONTEXT_LEN = 1024
ASSETS = Path(__file__).resolve().parent / "assets"
SHIPPED_TARGET, SHIPPED_DRAFT = ASSETS / "target", ASSETS / "eagle3"


def shipped_pair_available() -> bool:
    return all((d / "config.json").is_file() and (d / "model.safetensors").is_file()
               for d in (SHIPPED_TARGET, SHIPPED_DRAFT))


def runtime_from_args(a: argparse.Namespace) -> RuntimeConfig:
    # The small shipped / random pairs run in float32, where "greedy output identical to
    # target-only" is an exact check; real checkpoints default to bf16 on a GPU.
    user_ckpt = getattr(a, "target", None) is not None
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") and user_ckpt else "float32")
    max_context_len = a.max_context_len if a.max_context_len is not None else (
        DEFAULT_MAX_CONTEXT_LEN)
    return RuntimeConfig(
        speculative_num_steps=a.speculative_num_steps, page_size=a.page_size,
        max_running_requests=a.max_running_requests, max_context_len=max_context_len,
        max_num_batched_tokens=a.max_num_batched_tokens,
        cuda_graph_max_bs=min(a.cuda_graph_max_bs, a.max_running_requests),
        cuda_graph_bs=tuple(a.cuda_graph_bs) if a.cuda_graph_bs else None,
        enforce_eager=a.enforce_eager, dtype=dtype, device=a.device, kernel_backend=a.kernel_backend)


def default_model_pair(cfg: RuntimeConfig, seed: int) -> tuple[LlamaForCausalLM, Eagle3DraftHead]:
    """A small random-weight Llama and EAGLE-3 head (the drafts are rarely accepted)."""
    tc = ModelConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                     intermediate_size=688, num_hidden_layers=6, vocab_size=1024,
                     max_position_embeddings=max(2048, cfg.max_context_len), rope_theta=10000.0)
    target, head = random_model_pair(tc, tc.replace(num_hidden_layers=1), cfg.torch_dtype, seed,
                                     std=0.1)
    return target.to(cfg.device), head.to(cfg.device)


def _serve(engine: Engine, prompts: list[list[int]], params: SamplingParams, label: str):
    """Timed `generate` after an untimed run of the same work: Triton compiles a kernel for
    every new specialisation of its arguments on first use (prefill chunks, mixed batches),
    which a shorter warm-up leaves inside the timed run (seen on an H200: 0.15x)."""
    engine.generate(prompts, params)
    engine.stats = EngineStats()  # accept lengths of the timed run only
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, progress=True)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(o) for o in outs)
    print(f"{label:>22}: {tokens} tokens in {dt:.2f} s = {tokens / dt:,.1f} tokens/s")
    return outs, tokens / dt


SAMPLE_PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "A recipe for bread: first,",
    "In speculative decoding, a small draft model",
    "The capital of France is",
    "Once upon a time, in a village by the sea,",
    "import numpy as np\n\n# compute the mean of each column\n",
    "Photosynthesis converts light energy into",
]


class _Bytes:
    """The byte tokenizer behind the `tokenizers` calls the demo makes (`encode(t).ids`, `decode`)."""

    def __init__(self) -> None:
        from graphdraft.bytes_tokenizer import ByteTokenizer
        self.tok = ByteTokenizer()

    def encode(self, text: str):
        return argparse.Namespace(ids=self.tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, errors="replace")


def load_tokenizer(path: str, config: dict | None = None):
    """The byte tokenizer when `config` says `graphdraft_tokenizer: "bytes"`; else a
    `tokenizers` tokenizer from `path/tokenizer.json`; else None."""
    from graphdraft.bytes_tokenizer import CONFIG_KEY
    if config is not None and config.get(CONFIG_KEY) == "bytes":
        return _Bytes()
    file = Path(path) / "tokenizer.json"
    if not file.exists():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print("tokenizer.json found but the `tokenizers` package is missing: random prompts")
        return None
    return Tokenizer.from_file(str(file))


def demo(a: argparse.Namespace) -> int:
    cfg = runtime_from_args(a)
    if cfg.device == "cpu":
        print("no CUDA device: running eagerly on the CPU (graphs need a GPU)")
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    tokenizer, eos, stops = None, None, ()
    if (a.target or a.draft) and a.random_models:
        raise ValueError("--random-models: expected no --target/--draft with it")
    if a.target or a.draft:
        if not (a.target and a.draft):
            raise ValueError("--target and --draft: expected both checkpoint directories")
        target_dir, draft_dir = a.target, a.draft
    elif not a.random_models and shipped_pair_available():
        target_dir, draft_dir = str(SHIPPED_TARGET), str(SHIPPED_DRAFT)
    else:
        target_dir = draft_dir = None
        if not a.random_models:
            print(f"no shipped model pair in {ASSETS}: using random weights")
    if target_dir is not None:
        from graphdraft.checkpoint import load_model_pair
        target, head, info = load_model_pair(target_dir, draft_dir, cfg.torch_dtype, cfg.device)
        print(f"model pair: {target_dir} + {draft_dir}")
        stops = tuple(info.eos_token_ids)
        eos = stops[0] if stops else None
        tokenizer = load_tokenizer(target_dir, info.extras.raw)
        if a.max_context_len is None:  # the default, capped at what the target was built for
            cap = min(DEFAULT_MAX_CONTEXT_LEN, target.config.max_position_embeddings)
            cfg = cfg.replace(max_context_len=cap)
    else:
        target, head = default_model_pair(cfg, a.seed)
        print("model pair: random weights (acceptance is not meaningful for them)")
    vocab = target.config.vocab_size
    if isinstance(tokenizer, _Bytes):
        from graphdraft.train.data import heldout_prompts
        texts = heldout_prompts(a.num_prompts, a.prompt_bytes)
        if not texts:
            raise ValueError("no held-out standard-library text found for prompts")
        texts = [texts[i % len(texts)] for i in range(a.num_prompts)]
        prompts = [tokenizer.tok.encode(t) for t in texts]
        print(f"prompts: {len(prompts)} x {a.prompt_bytes} bytes of held-out stdlib sources")
    elif tokenizer is not None:
        texts = [SAMPLE_PROMPTS[i % len(SAMPLE_PROMPTS)] for i in range(a.num_prompts)]
        prompts = [tokenizer.encode(t).ids for t in texts]
    else:
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 64))]
                   for _ in range(a.num_prompts)]
    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                            seed=a.seed, stop_token_ids=stops, ignore_eos=eos is None)

    base = Engine(target, cfg, eos_token_id=eos)
    spec = Engine(target, cfg, head, eos_token_id=eos)
    for eng, name in ((base, "target-only"), (spec, "speculative")):
        t0 = time.perf_counter()
        eng.capture_graphs()
        if cfg.device.startswith("cuda") and not cfg.enforce_eager:
            print(f"captured {name} graphs in {time.perf_counter() - t0:.1f} s")
    base_out, base_tps = _serve(base, prompts, params, "target-only decoding")
    spec_out, spec_tps = _serve(spec, prompts, params, "speculative decoding")
    if tokenizer is not None:
        print(f"sample: {tokenizer.decode(prompts[0])!r} -> {tokenizer.decode(spec_out[0])!r}")
    st = spec.stats
    print(f"mean accept length: {st.mean_accept_length:.2f} tokens per verify "
          f"(N = {cfg.spec_num_tokens})")
    print(f"speed-up over target-only: {spec_tps / base_tps:.2f}x")
    for name, (replays, eager) in spec.graph_summary().items():
        print(f"{name:>18}: {replays} graph replays, {eager} eager runs")
    return report_greedy_match(base_out, spec_out, cfg.torch_dtype) if params.greedy else 0


def report_greedy_match(base_out: list[list[int]], spec_out: list[list[int]],
                        dtype: torch.dtype) -> int:
    """Print whether speculative greedy outputs equal target-only ones; the exit code: 1 for a
    difference in float32/float64 (exactness is checkable there), else 0."""
    same = base_out == spec_out
    print(f"greedy outputs identical to target-only: {same}")
    if same:
        return 0
    n_same = sum(b == s for b, s in zip(base_out, spec_out, strict=True))
    r = next(i for i, (b, s) in enumerate(zip(base_out, spec_out, strict=True)) if b != s)
    k = next((j for j, (x, y) in enumerate(zip(base_out[r], spec_out[r], strict=False)) if x != y),
             min(len(base_out[r]), len(spec_out[r])))
    print(f"  {n_same}/{len(base_out)} requests identical; request {r} differs from token {k}")
    if dtype in (torch.float32, torch.float64):
        return 1
    print(f"  expected in {str(dtype).removeprefix('torch.')}: the target's verify forward "
          "(N tokens per row) and its decode forward (one per row) round their matmuls "
          "differently, so near-tied greedy picks can differ; --dtype float32 makes this "
          "check exact")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphdraft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="serve a batch of prompts with speculative decoding")
    add_runtime_flags(d)
    d.add_argument("--target", default=None, help="Hugging Face Llama checkpoint directory")
    d.add_argument("--draft", default=None, help="EAGLE-3 head checkpoint directory")
    d.add_argument("--random-models", action="store_true",
                   help="a random-weight pair instead of the shipped trained one")
    d.add_argument("--prompt-bytes", type=int, default=128,
                   help="prompt length for the byte-level pair (held-out stdlib text)")
    d.add_argument("--num-prompts", type=int, default=8)
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("-v", "--verbose", action="store_true")
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return demo(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
