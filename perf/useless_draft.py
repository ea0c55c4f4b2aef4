"""The useless draft at the Llama-3.1-8B shape (issue #42, item 4): `python3 -m perf.useless_draft
--out DIR [--tag 2026-12-06] [--deadline-s 240]` (`make perf-useless OUT=DIR`), or `--tiny` on
the CPU (tiny random pair, a check that it runs end to end: its timings mean nothing).

A head whose drafts are never accepted: the 8B-shaped target and its EAGLE-3 head both with
random bf16 weights (perf/models_8b.py `build_pair`; no accept control, no peaking): the
head's argmax over its 32000 hot tokens matches the target's over 128256 by chance only, so
every verify accepts one token a row (each row's `accept_mean` is the check: 1.00). Two
Engines over the same weights, S = 3, greedy, prompts of PROMPT_LEN random tokens, CUDA graphs:
target-only (no drafter) and speculative with the default adaptive policy (captured k = 0, 1,
3, its cost table measured after capture, the deferred draft KV of `RuntimeConfig`'s default).
Per batch size the speculative engine serves two cells over the same requests: `adaptive` (one
`SpeculationPolicy` object for the whole bs: its estimator and online costs carry over between
blocks) and `k0` (always k = 0: the k = 0 cycle's own cost, the policy's probes left out).

Steady decode: every row decoding; the adaptive policy first gets WARMUP steps (its docstring
bounds the settling at 20 observed cycles at bs 1), then REPS rounds; a round times each
speculative cell (adaptive, k0; their order alternating by round) right after a target-only
block of its own, each block after `lead` untimed steps of its engine. A block is
`block_steps(bs)` `step()` calls; tokens/s = tokens emitted over the block's CUDA-event span
(host loop and copies included). `ratio` = median over rounds of adaptive / the target-only
block just before it (adjacent blocks: clock drift cancels); `k0_ratio` likewise.

Equal contexts: a useless draft commits one token a row a cycle whatever k, so each engine's
contexts grow one token a step; the target-only engine takes as many steps as the speculative
one (a block and its lead per speculative cell), so every pair of blocks starts at the same
context (`context_gap`: the largest difference of the two engines' mean context at a pair's
start, tokens; 0 unless a row accepted a draft). Timing one target-only block per round
against two speculative ones (the 2026-12-06d run) let the speculative rows' contexts run
ahead by up to 2 x (block + lead) tokens a round: at large bs, where the KV reads are a large
part of a step, that gap alone made the k = 0 cycle look slower than it is (per-round ratios
falling round after round; perf/RESULTS.md).

Rows (`run_rows`): `bs`, `regime` "useless", `adaptive_tps`, `target_only_tps`, `ratio`,
`k0_tps`, `k0_ratio`, `k_histogram` (draft lengths of the adaptive cell's timed cycles),
`k_histogram_warmup`, `accept_mean` (tokens per decode row in its timed blocks), `probes` /
`probe_interval` (the policy's at the end), `alpha`, `alpha_lower`, `kv_rebuilds` (deferred
draft-KV rebuilds replayed during the timed blocks), `context_gap`, `per_round`, `block`, `reps`.
Goal (issue #42): ratio >= 0.99 at every bs.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from graphdraft.serving.engine import Engine
from graphdraft.serving.policy import SpeculationPolicy
from graphdraft.serving.verify import SamplingParams
from perf.policy import _abort_all, _reach_decode, runtime, timed_block
from perf.timing import write_json

__all__ = ["BATCH_SIZES", "block_steps", "main", "run_rows"]

BATCH_SIZES = (1, 8, 64, 128, 256)
PROMPT_LEN = 512      # the measured context
STEPS = 3
WARMUP = 40           # adaptive steps before the first timed block (settling: <= 22 at bs 1)
REPS = 8              # rounds (each ratio: the median of its per-round ratios)
ROWS_PER_BLOCK = 256  # decode rows a block at least, within MIN_BLOCK..MAX_BLOCK steps (bs 1: 64,
MAX_BLOCK, MIN_BLOCK = 64, 32  # bs >= 8: 32; perf/policy.py saw blocks of 6 steps spread 0.92-1.05)
GOAL = 0.99


def block_steps(bs: int) -> int:
    """Steps per timed block: ROWS_PER_BLOCK decode rows, within MIN_BLOCK..MAX_BLOCK."""
    return min(MAX_BLOCK, max(MIN_BLOCK, -(-ROWS_PER_BLOCK // bs)))


def lead_steps(bs: int) -> int:
    """Untimed steps of a cell right before each of its blocks (its own steady state)."""
    return max(3, block_steps(bs) // 4)


def _new_tokens(bs: int, warmup: int, reps: int, cells: int) -> int:
    """Tokens a request of an engine timing `cells` blocks a round must be allowed: one a step (a
    useless draft accepts nothing: every cycle commits one token a row, whatever its k), 1.25x
    and 16 for slack (a request that finishes early is counted: `finished_early`); its KV
    pages are reserved for them at admission."""
    steps = warmup + cells * reps * (block_steps(bs) + lead_steps(bs))
    return int(1.25 * steps) + 16


def _pages(sizes: tuple[int, ...], prompt_len: int, warmup: int, reps: int, cells: int) -> int:
    """KV pages (of 16) for the widest bs x its requests' context, `cells` blocks a round."""
    ctx = {b: prompt_len + _new_tokens(b, warmup, reps, cells) + 2 * (STEPS + 1) for b in sizes}
    return max(b * -(-c // 16) for b, c in ctx.items()) + 2 * max(sizes) + 8


def _tiny_pair(device: str):
    """A tiny random target / head pair (the `--tiny` CPU check)."""
    from graphdraft.config import ModelConfig
    from graphdraft.models.random_models import random_model_pair

    tc = ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=128, num_hidden_layers=4, vocab_size=97,
                     max_position_embeddings=4096, rope_theta=10000.0,
                     aux_hidden_state_layer_ids=(0, 1, 2))
    hc = tc.replace(num_hidden_layers=1, intermediate_size=96)
    return random_model_pair(tc, hc, torch.float32, 0, std=0.5, device=device)


class _Setup:
    """The two engines for batch sizes up to `max(bs_list)` (graphs at each bs)."""

    def __init__(self, bs_list: tuple[int, ...], device: str, prompt_len: int, warmup: int,
                 reps: int, pair=None, seed: int = 0) -> None:
        if pair is None:
            from perf.models_8b import build_pair
            pair = build_pair(device, seed=seed)
        self.target, self.head = pair
        sizes = tuple(sorted(set(bs_list)))
        ctx = prompt_len + max(_new_tokens(b, warmup, reps, 2) for b in sizes) + 2 * (STEPS + 1)
        dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"
        self.cfg = runtime(max(sizes), sizes, ctx, device=device, dtype=dtype,
                           pages=_pages(sizes, prompt_len, warmup, reps, 2))
        base_cfg = self.cfg.replace(speculative_policy="fixed")  # as many steps as `spec`
        t0 = time.perf_counter()
        self.base = Engine(self.target, base_cfg)
        self.base.capture_graphs(progress=False)
        self.spec = Engine(self.target, self.cfg, self.head)
        self.spec.capture_graphs(progress=False)
        self.capture_s = time.perf_counter() - t0
        self.costs = self.spec.policy.costs  # the capture-time table (analytic on a CPU)


def _rebuilds(spec: Engine) -> int:
    """Replays and eager runs of the deferred draft-KV rebuild so far (0 without one)."""
    f = spec.graph_registry.get("draft_kv_rebuild")
    if f is None:
        return 0
    return int(sum(f.stats.replays.values()) + sum(f.stats.eager.values()))


def _mean_context(engine: Engine) -> float:
    """Mean context (prompt + output tokens) of the engine's running requests, drained."""
    engine.drain()
    return sum(len(r.prompt) + len(r.output) for r in engine.running) / max(len(engine.running), 1)


def _level_contexts(base: Engine, spec: Engine) -> None:
    """Step the engine whose rows are behind (the prefill steps of the two may differ: a
    speculative decode row takes N tokens of a mixed step's budget) until the mean contexts
    agree to within one token (one token a row a step in steady decode, drafts useless)."""
    for _ in range(64):
        d = _mean_context(spec) - _mean_context(base)
        if abs(d) < 1:
            return
        (base if d > 0 else spec).step()


def _measure_bs(s: _Setup, bs: int, prompt_len: int, warmup: int, reps: int,
                rng: torch.Generator) -> dict[str, Any]:
    """One row (module docstring)."""
    vocab = s.target.config.vocab_size
    prompts = torch.randint(0, vocab, (bs, prompt_len), generator=rng).tolist()
    base, spec = s.base, s.spec
    reqs = []
    for p in prompts:
        for eng in (base, spec):
            reqs.append(eng.add_request(p, SamplingParams(
                max_new_tokens=_new_tokens(bs, warmup, reps, 2), ignore_eos=True)))
    adaptive = SpeculationPolicy("adaptive", STEPS, type(s.costs)(s.costs.measured()),
                                 steps=list(spec.steps))
    k0 = SpeculationPolicy("fixed", 0, steps=[0])
    spec.set_policy(adaptive)
    _reach_decode(base, bs)
    _reach_decode(spec, bs)
    for _ in range(warmup):
        spec.step()
        base.step()
    _level_contexts(base, spec)
    warm_k = Counter(k for _, k in list(spec.policy_history)[-warmup:])
    blk, lead = block_steps(bs), lead_steps(bs)
    blocks: dict[str, list[dict[str, Any]]] = {"target_only": [], "adaptive": [], "k0": []}
    rebuilds, gap = 0, 0.0
    paired: dict[str, list[dict[str, Any]]] = {"adaptive": [], "k0": []}  # target-only blocks
    for rep in range(reps):
        for name in (("adaptive", "k0") if rep % 2 == 0 else ("k0", "adaptive")):
            spec.set_policy(adaptive if name == "adaptive" else k0)
            gap = max(gap, abs(_mean_context(spec) - _mean_context(base)))
            for _ in range(lead):
                base.step()
            paired[name].append(timed_block(base, blk))
            blocks["target_only"].append(paired[name][-1])
            for _ in range(lead):
                spec.step()
            before = _rebuilds(spec)
            blocks[name].append(timed_block(spec, blk))
            if name == "adaptive":
                rebuilds += _rebuilds(spec) - before
    spec.set_policy(adaptive)
    finished_early = sum(r.finished for r in reqs)  # a block with fewer rows: must be 0
    _abort_all(base)
    _abort_all(spec)
    tps = {name: statistics.median(b["tps"] for b in bl) for name, bl in blocks.items()}
    per_round = [a["tps"] / t["tps"] for a, t in zip(blocks["adaptive"], paired["adaptive"],
                                                      strict=True)]
    k0_round = [a["tps"] / t["tps"] for a, t in zip(blocks["k0"], paired["k0"], strict=True)]
    timed_k = Counter(k for b in blocks["adaptive"] for k in b["ks"])
    rows = sum(b["acc_rows"] for b in blocks["adaptive"])
    st = adaptive.stats()
    return {"bs": bs, "regime": "useless", "adaptive_tps": tps["adaptive"],
            "target_only_tps": tps["target_only"], "ratio": statistics.median(per_round),
            "k0_tps": tps["k0"], "k0_ratio": statistics.median(k0_round),
            "k_histogram": dict(sorted(timed_k.items())),
            "k_histogram_warmup": dict(sorted(warm_k.items())),
            "accept_mean": sum(b["acc_tok"] for b in blocks["adaptive"]) / max(rows, 1),
            "probes": st["probes"], "probe_interval": adaptive.probe_interval(bs),
            "alpha": st["alpha"], "alpha_lower": adaptive.estimator.lower_bound(),
            "kv_rebuilds": rebuilds, "deferred_draft_kv": s.cfg.deferred_draft_kv,
            "context_gap": gap,
            "per_round": per_round, "k0_per_round": k0_round, "block": blk, "lead": lead,
            "reps": reps, "prompt_len": prompt_len, "finished_early": finished_early,
            "goal_met": statistics.median(per_round) >= GOAL and not finished_early}


def run_rows(bs_list: tuple[int, ...] = BATCH_SIZES, deadline_s: float = 240.0, *,
             device: str = "cuda", pair=None, prompt_len: int = PROMPT_LEN,
             warmup: int = WARMUP, reps: int = REPS, info: dict | None = None) -> list[dict]:
    """The useless-draft rows (module docstring), one per bs of `bs_list` in that order; a bs
    not started within `deadline_s` seconds of the call (engine builds and captures
    included) is left out (named in `info["skipped_bs"]` when `info` is given, with the
    capture time and the cost table). `pair` (target, head): instead of the 8B-shaped pair
    (`--tiny`); `device` "cpu" runs the engines eagerly (timings meaningless)."""
    t0 = time.perf_counter()
    if not bs_list or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bs_list):
        raise ValueError(f"bs_list: expected batch sizes >= 1, got {bs_list!r}")
    if not deadline_s > 0:
        raise ValueError(f"deadline_s: expected seconds > 0, got {deadline_s!r}")
    s = _Setup(tuple(bs_list), device, prompt_len, warmup, reps, pair)
    rng = torch.Generator().manual_seed(1234)
    rows, skipped = [], []
    for bs in bs_list:
        if time.perf_counter() - t0 > deadline_s:
            skipped.append(bs)
            print(f"[useless] bs {bs}: skipped (deadline {deadline_s:.0f}s)", flush=True)
            continue
        row = _measure_bs(s, bs, prompt_len, warmup, reps, rng)
        rows.append(row)
        print(f"[useless] bs {bs}: adaptive {row['adaptive_tps']:.0f} tok/s, target-only "
              f"{row['target_only_tps']:.0f}, ratio {row['ratio']:.4f} (k0 {row['k0_ratio']:.4f}), "
              f"k {row['k_histogram']}, accept {row['accept_mean']:.3f}", flush=True)
    if info is not None:
        measured = {}
        for (b, k), ms in sorted(s.costs.measured().items()):
            measured.setdefault(k, {})[b] = ms
        info.update({"skipped_bs": skipped, "capture_s": s.capture_s, "cost_ms": measured,
                     "cost_source": s.spec.cost_source, "wall_s": time.perf_counter() - t0})
    del s
    if device != "cpu":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    from perf.real import card_name

    ap = argparse.ArgumentParser(prog="python -m perf.useless_draft", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="perf/out", help="folder for <tag>-<card>-useless.json")
    ap.add_argument("--tag", default=datetime.date.today().isoformat())
    ap.add_argument("--deadline-s", type=float, default=240.0)
    ap.add_argument("--bs", default=",".join(map(str, BATCH_SIZES)))
    ap.add_argument("--tiny", action="store_true",
                    help="tiny random pair on the CPU (a check; timings meaningless)")
    a = ap.parse_args(argv)
    try:
        bs_list = tuple(int(x) for x in a.bs.split(","))
    except ValueError:
        ap.error(f"--bs: expected comma-separated ints, got {a.bs!r}")
    info: dict[str, Any] = {}
    if a.tiny:  # short blocks: a check that every step runs, not a measurement
        global MAX_BLOCK, MIN_BLOCK
        MAX_BLOCK, MIN_BLOCK = 8, 4
        rows = run_rows(bs_list if a.bs != ",".join(map(str, BATCH_SIZES)) else (1, 2, 4),
                        a.deadline_s, device="cpu", pair=_tiny_pair("cpu"), prompt_len=16,
                        warmup=6, reps=2, info=info)
        device = "cpu"
    else:
        if not torch.cuda.is_available():
            ap.error("a CUDA device is needed (or --tiny on the CPU)")
        rows = run_rows(bs_list, a.deadline_s, info=info)
        device = "cuda"
    card = card_name(device)
    doc = {"device": torch.cuda.get_device_name() if card != "cpu" else "cpu (timings meaningless)",
           "card": card, "torch": torch.__version__, "tiny": a.tiny,
           "head": "random bf16 weights against the random target (drafts never accepted)",
           "goal": f"ratio >= {GOAL} at every bs",
           "goals_met": all(r["goal_met"] for r in rows) and not info.get("skipped_bs"),
           **info, "rows": rows}
    path = write_json(Path(a.out), f"{a.tag}-{card}-useless.json", doc)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
