"""Prefill probes: the eager prefill steps a precompile runs so the first requests compile nothing.

A captured forward covers decode; a served batch's first requests also run eager prefill
steps, whose kernels depend on the prompt tokens only through buckets (the extend attention's
tile case and KV splits, GEMV or cuBLAS by rows). `prefill_probes(engine)` picks one step per
bucket, `probe_prefill(engine, tokens)` runs one (a warm-up on a live engine, a key census
under a dry-run `KeyRecorder`: `probe_prefill_dry`).
"""

from __future__ import annotations

import triton

from graphdraft.kernels.extend_attention import RAGGED_TILE_CASES
from graphdraft.kernels.keys import storages
from graphdraft.sampling import SamplingParams

__all__ = ["prefill_probes", "prefill_row_cap", "probe_prefill", "probe_prefill_dry"]


def prefill_row_cap(engine) -> int:
    """The longest prompt `engine` accepts with one new token (`Engine.check_request`)."""
    return max(1, engine.cfg.max_context_len - 1 - engine.lookahead)


def prefill_probes(engine) -> list[int]:
    """Prompt tokens of the prefill steps the plan dry-runs (`probe_prefill`): one row whose
    length picks each extend-attention tile case of ragged rows
    (`extend_attention.RAGGED_TILE_CASES` over the target's grouped heads: 4 and 32 tokens
    for 4 heads a kv head; split KV), and a full chunk (`max_num_batched_tokens` over rows of
    the longest prompt: few KV splits or one). What a prefill launches depends on its tokens
    only through such buckets (the tile and splits, GEMV or cuBLAS by rows): a chunk of
    another bucket compiles its kernels at its first use."""
    cfg, mc = engine.cfg, engine.target.config
    g_pad = triton.next_power_of_2(max(1, mc.num_attention_heads // mc.num_key_value_heads))
    cap = prefill_row_cap(engine)
    rows = max(1, min(cfg.max_running_requests, cfg.max_num_batched_tokens // cap or 1))
    full = min(cfg.max_num_batched_tokens, rows * cap)
    return sorted({min(max(1, case // g_pad), cap, full) for case in RAGGED_TILE_CASES} | {full})


def probe_prefill(engine, tokens: int) -> None:
    """One engine step that prefills `tokens` prompt tokens (rows of at most the longest
    prompt, one new token each), then the engine as before: the requests aborted, the step
    retired (`Engine.drain`; an aborted row is skipped). Under `KeyRecorder(launch=False)`
    this records the keys an eager prefill launches (its host code reads no device value);
    on a live engine it is a warm-up prefill."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens: expected an int >= 1, got {tokens!r}")
    if engine.has_work:
        raise RuntimeError("probe_prefill: expected an idle engine (requests would be mixed in)")
    cap = prefill_row_cap(engine)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    reqs = []
    try:
        while tokens > 0:
            n = min(cap, tokens)
            reqs.append(engine.add_request([1] * n, params))
            tokens -= n
        engine.step()
    finally:
        for r in reqs:
            engine.abort(r)
        engine.drain()


def probe_prefill_dry(engine, tokens: int, rec) -> None:
    """`probe_prefill` under a dry-run `KeyRecorder(zero_ints=True)` `rec`: the engine's
    host-written inputs are spared from the zeroing (its host code indexes with them)."""
    rec.spare = storages(*vars(engine.inputs).values())
    try:
        probe_prefill(engine, tokens)
    finally:
        rec.spare = frozenset()
