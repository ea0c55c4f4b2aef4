"""Evaluate a trained byte-level pair: the numbers of `graphdraft/assets/MODEL_CARD.md`.

- the target's held-out next-byte loss: 64 evenly spaced windows of the held-out documents
  (`graphdraft.train.data`), each `max_position_embeddings + 1` bytes long (257 for the
  shipped pair), the checkpoint's (bf16) weights computed in float32 (`train.eval_target`);
- the head's mean accept length: greedy, 3 draft steps (N = 4 tokens per verify at most),
  float32, through `graphdraft.serving.engine.Engine` (torch kernel path), held-out prompts of 96
  bytes (`data.heldout_prompts`), 64 new tokens each, all prompts in one batch; for 16
  prompts and for the first 4 of them (the setting of `tests/test_trained_pair.py`, which
  calls `mean_accept_length` and `runtime_config` from here).

`python -m graphdraft.train evaluate --dir DIR [--baseline DIR]` prints both and writes
`DIR/evaluation.json`. The default device is the CPU, as in the test and the model card;
held-out documents depend on the Python version's standard library, so compare pairs
evaluated by the same interpreter (`--baseline graphdraft/assets` does that in one run).
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from graphdraft.config import RuntimeConfig
from graphdraft.io.checkpoint import load_model_pair
from graphdraft.serving.verify import SamplingParams

EVAL_NAME = "evaluation.json"
DRAFT_STEPS = 3
PROMPT_BYTES = 96
NEW_TOKENS = 64
PROMPT_COUNTS = (16, 4)
HELDOUT_WINDOWS = 64


def runtime_config(max_running_requests: int, *, steps: int = DRAFT_STEPS,
                   max_context_len: int = 256, device: str = "cpu") -> RuntimeConfig:
    """The evaluation's (and the trained-pair test's) runtime: float32, torch kernel path, a
    fixed draft length (the accept length measured is the head's at `steps`)."""
    return RuntimeConfig(speculative_num_steps=steps, page_size=16,
                         max_running_requests=max_running_requests, max_context_len=max_context_len,
                         max_num_batched_tokens=512, cuda_graph_max_bs=max_running_requests,
                         dtype="float32", device=device, kernel_backend="torch",
                         speculative_policy="fixed")


def prompt_ids(count: int, length: int = PROMPT_BYTES) -> list[list[int]]:
    """Token ids of the first `count` held-out prompts of `length` bytes."""
    from graphdraft.io.bytes_tokenizer import ByteTokenizer
    from graphdraft.io.corpus import heldout_prompts

    tok = ByteTokenizer()
    texts = heldout_prompts(count, length)
    if len(texts) != count:
        raise ValueError(f"only {len(texts)} held-out prompts of {length} bytes, asked for {count}")
    return [tok.encode(t) for t in texts]


@torch.no_grad()
def mean_accept_length(target, head, prompts: list[list[int]], *, steps: int = DRAFT_STEPS,
                       new_tokens: int = NEW_TOKENS, device: str | None = None) -> float:
    """Greedy mean accept length (tokens per verify) of `head` drafting for `target` through
    `Engine`, every prompt in one batch. Models in float32 on `device` (default: theirs)."""
    from graphdraft.serving.engine import Engine

    device = device or str(target.embed_tokens.device)
    ctx = min(256, target.config.max_position_embeddings)
    eng = Engine(target, runtime_config(len(prompts), steps=steps, max_context_len=ctx,
                                        device=device), head)
    eng.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    return eng.stats.mean_accept_length


def heldout_ids() -> torch.Tensor:
    """The held-out documents, concatenated as `data.load_corpus().heldout` (reads only them)."""
    from graphdraft.train.data import _concat, documents, is_held_out

    return _concat([d for _, d in documents(is_held_out)])


def heldout_target_loss(target, windows: int = HELDOUT_WINDOWS,
                        ids: torch.Tensor | None = None) -> dict:
    """Held-out next-byte loss / bits per byte / top-1 of `target` (`train.eval_target`)."""
    from graphdraft.train.data import eval_windows
    from graphdraft.train.train import eval_target

    ids = heldout_ids() if ids is None else ids
    w = eval_windows(ids, windows, target.config.max_position_embeddings + 1)
    return eval_target(target, w.to(target.embed_tokens.device))


def evaluate_pair(d: str | Path, *, device: str = "cpu",
                  prompt_counts: tuple[int, ...] = PROMPT_COUNTS, prompt_bytes: int = PROMPT_BYTES,
                  new_tokens: int = NEW_TOKENS, windows: int = HELDOUT_WINDOWS,
                  ids: torch.Tensor | None = None,
                  prompts: list[list[int]] | None = None) -> dict:
    """Evaluate `d/target` + `d/eagle3` (float32 on `device`) -> a JSON-able dict.

    `prompts`: at least max(prompt_counts) held-out prompts (default: read them); count n
    takes the first n, which are exactly `prompt_ids(n)`."""
    d = Path(d)
    t0 = time.perf_counter()
    prompts = prompts if prompts is not None else prompt_ids(max(prompt_counts), prompt_bytes)
    target, head, _ = load_model_pair(d / "target", d / "eagle3", torch.float32, device)
    loss = heldout_target_loss(target, windows, ids)
    accept = {}
    for n in prompt_counts:
        accept[f"{n}_prompts"] = mean_accept_length(target, head, prompts[:n],
                                                    new_tokens=new_tokens, device=device)
    return {"dir": str(d), "target_heldout": loss, "mean_accept_length": accept,
            "seconds": round(time.perf_counter() - t0, 1)}


def describe(result: dict) -> str:
    t, a = result["target_heldout"], result["mean_accept_length"]
    accept = ", ".join(f"{v:.2f} ({k.replace('_', ' ')})" for k, v in a.items())
    return (f"{result['dir']}: target held-out loss {t['loss']:.4f} nats/byte "
            f"({t['bits_per_byte']:.3f} bits/byte, top-1 {100 * t['top1_accuracy']:.1f} %); "
            f"head mean accept length {accept}")


def evaluate(d: str | Path, *, baseline: str | Path | None = None,
             json_path: str | Path | None = None, device: str = "cpu",
             prompt_counts: tuple[int, ...] = PROMPT_COUNTS, prompt_bytes: int = PROMPT_BYTES,
             new_tokens: int = NEW_TOKENS, windows: int = HELDOUT_WINDOWS) -> dict:
    """Evaluate the pair in `d` (and `baseline`'s, the same way), print, write JSON."""
    ids = heldout_ids()
    prompts = prompt_ids(max(prompt_counts), prompt_bytes)
    kw = dict(device=device, prompt_counts=prompt_counts, prompt_bytes=prompt_bytes,
              new_tokens=new_tokens, windows=windows, ids=ids, prompts=prompts)
    summary = {"setting": {"device": device, "dtype": "float32", "draft_steps": DRAFT_STEPS,
                           "prompt_bytes": prompt_bytes, "new_tokens": new_tokens,
                           "prompt_counts": list(prompt_counts), "heldout_windows": windows,
                           "heldout_bytes": ids.numel(), "python": platform.python_version(),
                           "torch": torch.__version__},
               "pair": evaluate_pair(d, **kw)}
    print(f"evaluate {describe(summary['pair'])}", flush=True)
    path = Path(json_path) if json_path is not None else Path(d) / EVAL_NAME
    path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")  # before the baseline
    if baseline is not None:
        summary["baseline"] = evaluate_pair(baseline, **kw)
        print(f"baseline {describe(summary['baseline'])}", flush=True)
        path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}", flush=True)
    return summary
