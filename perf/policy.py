"""Speculation policy end to end at the Llama-3.1-8B shape: `python3 -m perf.policy --out DIR`.

One process, one H200 (issue #21, "Measured"): the 8B-shaped target with random bf16 weights
and its EAGLE-3 head (perf/models_8b.py), S = 3, greedy, prompts of PROMPT_LEN random tokens.
Two Engines over the same weights: target-only (no drafter: the baseline), and speculative
with the adaptive policy's captured draft lengths K = {0, 1, 3} (one cycle graph per
(padded bs, k); its cost table measured after capture). The speculative engine serves these
cells over the same requests: `k0` (always k = 0: target-only decode plus the draft's KV-only
step, deferred by default and written in batches of `RuntimeConfig.deferred_draft_kv` cycles:
what the adaptive policy pays when it stops speculating; a head that is never accepted, p = 0,
is `perf/useless_draft.py`'s benchmark), and per regime p `fixed`
(always 3 drafts: `SpeculationPolicy("fixed", 3)`, the same k = 3 graphs) and `adaptive` (its
own adaptive policy over its own copy of the capture-time costs, corrected online from its own
cycles, and its own estimator).

Method (drift cancels): the cells are measured INTERLEAVED. Per round (REPS rounds), for each
group of cells (k0; fixed@p and adaptive@p for each p) one timed block of the target-only
engine, then one block of each cell of the group, the group's order reversed every other round
(REPS even: each cell runs first as often as second). Each timed block follows `lead_steps(bs)`
untimed steps of its own cell (a lead-in), so that the GPU's clocks and power state at the
block's start are the cell's own steady state, not the previous block's: the 04e run measured
adaptive 0.961x fixed at bs 64 p = 0.9 with both running k = 3 in every cycle, and adaptive
0.973x target-only at bs 256 p = 0.2 running k = 0 throughout, each time right after a fixed
k = 3 block (the heaviest load). Each speculative cell continues from its own
saved state between its blocks (`Engine.state_snapshot` / `restore_state` and the host's
outputs: `_snapshot` / `_restore`), and its policy object carries over, so its estimator and
online costs keep learning across its blocks; the target-only engine keeps one state per
group the same way (so its contexts grow one token a step, as the k = 0 cells' do). Each
ratio is the median over rounds of the ratio of adjacent blocks (adaptive / the target-only
block before its group; adaptive / fixed of the same round), so a slow GPU clock or thermal
drift (3-6 % between two measurements minutes apart on the H200) cancels. A block is
`block_steps(bs)` steps: ROWS_PER_BLOCK decode rows (bs 1: 64 cycles, 320 timed cycles a
cell), at least MIN_BLOCK, so that the realized accept is near its expectation.

Accept-rate regimes: random weights accept nothing, so the benchmark mixes the drafts
(`graphdraft.kernels.accept_control`, inside the cycle graph through `Engine.draft_hook`, after
drafting and before the commit): each draft equals the target's own greedy token at its position
with probability p, else another token. The oracle is the greedy continuation a target-only run
of the same prompts emitted (then put back to the decode start for its timed blocks). The control only
holds while the speculative engine's greedy text equals the oracle: a random-weight target
has bf16 near ties everywhere (a k + 1 token verify rounds differently and flips them; the
first H200 run departed on every request, and every regime measured accept ~1). So the 8B
target is made peaked (`perf.models_8b.make_peaked_`): lm_head rows = a fixed permutation of
the embedding rows x PEAK_SCALE, residual branches x PEAK_RESIDUAL_SCALE, so that argmax after
token t is perm[t] by a wide margin; same shapes, bytes and work. Each batch size checks it:
`departed_from_oracle` (requests whose speculative text left the oracle: must be 0) and
`oracle_follows_perm` (fraction of the oracle's tokens equal to perm of the one before);
`fixed_accept` against `expected_accept` = (1 - p^(S+1)) / (1 - p) (p = 0.9: 3.44).
`--no-peak` runs the plain random target with its residual branches x `--residual-scale`.

The adaptive policy starts fresh in each cell (prior alpha 0.7) and has WARMUP steps to
settle before its first block: `adaptive_k` counts the draft lengths of the timed cycles only
(`adaptive_k_warmup` those of the warm-up), `adaptive_alpha` its estimate at the end,
`adaptive_online_cost_ms` its online costs, `best_k_at_p` / `best_k_at_p_online` the k the
capture-time / its online costs prefer at the true rate p (the KV-read term left out). The
cells' common start state marks no draft ready (`start_state`: the prefill's drafts were
drafted outside the accept control).

Per (bs, regime): tokens/s = tokens emitted over the CUDA-event span of a block of `step()`
calls in steady decode (every row decoding; host loop and copies included; nothing in flight
before or after the block), median of the REPS blocks. Writes `DIR/<date>-h200-policy.json`
(rows `bs`, `regime`, `p`, `target_only_tps`, `fixed_tps`, `adaptive_tps`, `adaptive_k`
{k: timed cycles}, `k0_tps`, accept means, the checks above, the ratios and their per-round
values), the same as `DIR/policy.json`, and prints a table.
Goals (issue #21): adaptive >= 0.98 x target-only and >= 0.97 x fixed in every cell.
"""

from __future__ import annotations

import argparse
import datetime
import random
import re
import statistics
import time
from collections import Counter
from typing import Any

import torch

from graphdraft import ops
from graphdraft.config import RuntimeConfig
from graphdraft.serving.engine import Engine
from graphdraft.serving.policy import (
    AcceptRateEstimator,
    CostTable,
    SpeculationPolicy,
    expected_tokens,
)
from graphdraft.serving.verify import SamplingParams
from perf.models_8b import damp_residual_branches_, make_peaked_
from perf.timing import write_json

__all__ = ["damp_residual_branches_", "main", "measure", "table"]

BATCH_SIZES = (1, 8, 32, 64, 128, 256)
REGIMES = (0.9, 0.6, 0.2)
PROMPT_LEN = 32
ORACLE_NEW = 64        # at least this many greedy tokens of oracle per request (more where the
                       # cells need it: `_plan`)
STEPS = 3
WARMUP = 12            # steps before each cell's first timed block (the adaptive estimate
                       # settles: at bs 1 one row a step; tests/test_policy_perf.py checks it)
BLOCK = None           # steps per timed block; None: `block_steps(bs)`
ROWS_PER_BLOCK = 64    # block_steps: enough decode rows a block that the realized accept is
MIN_BLOCK = 12         # near its expectation (bs 1: 64 cycles, 320 timed cycles a cell);
                       # 12: at bs >= 128 blocks of 6 steps spread 0.92-1.05 (2026-12-04d)
REPS = 6               # rounds of blocks (each ratio: the median of its REPS per-round ratios;
                       # even: the group order alternates)
SEED = 1234            # accept_control's Philox key
RESIDUAL_SCALE = 0.01  # --no-peak: o_proj / down_proj of the 8B target scaled (module docstring)


def block_steps(bs: int) -> int:
    """Steps per timed block at this bs: ROWS_PER_BLOCK decode rows, at least MIN_BLOCK."""
    return max(MIN_BLOCK, -(-ROWS_PER_BLOCK // bs))


def lead_steps(bs: int) -> int:
    """Untimed steps of a cell right before each of its timed blocks (module docstring)."""
    return max(3, block_steps(bs) // 4)


def cell_steps(bs: int, block: int | None = None, reps: int = REPS) -> int:
    """Steps a cell runs after its warm-up: `reps` times a lead-in and a timed block."""
    return reps * ((block if block is not None else block_steps(bs)) + lead_steps(bs))


def runtime(max_bs: int, sizes: tuple[int, ...], ctx: int, *, policy: str = "adaptive",
            device: str = "cuda", dtype: str = "bfloat16", pages: int | None = None
            ) -> RuntimeConfig:
    """Slots of up to `ctx` tokens; `pages` KV pages in all (None: every slot full)."""
    cfg = RuntimeConfig(speculative_num_steps=STEPS, page_size=16, max_running_requests=max_bs,
                        max_context_len=-(-ctx // 16) * 16, max_num_batched_tokens=8192,
                        cuda_graph_max_bs=max_bs, cuda_graph_bs=sizes, dtype=dtype,
                        device=device, speculative_policy=policy)
    full = cfg.max_running_requests * cfg.max_pages_per_req
    return cfg.replace(num_kv_pages=full if pages is None else min(pages, full))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _decoding(engine: Engine, bs: int) -> bool:
    return len(engine.running) == bs and all(not r.prefilling for r in engine.running)


def _reach_decode(engine: Engine, bs: int) -> None:
    for _ in range(1000):
        if _decoding(engine, bs):
            return
        engine.step()
    raise RuntimeError("requests did not reach decode")


def _abort_all(engine: Engine) -> None:
    for r in list(engine.running) + list(engine.waiting):
        engine.abort(r)
    engine.drain()
    _sync(engine.device)


def timed_block(engine: Engine, steps: int) -> dict[str, Any]:
    """One timed block: `steps` calls of `step()` from an empty pipeline, drained after.
    tokens/s = tokens emitted over the CUDA-event span of the block (host loop and copies
    included), the accepted tokens and decode rows, and the draft lengths of its cycles in
    order (`ks`)."""
    engine.drain()
    _sync(engine.device)
    cuda = engine.device.type == "cuda"
    emitted0, tok0, rows0 = (engine.stats.emitted_tokens, engine.stats.accepted_tokens,
                             engine.stats.decode_rows)
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if cuda:
        end.record()
    engine.drain()
    _sync(engine.device)
    ms = start.elapsed_time(end) if cuda else (time.perf_counter() - t0) * 1e3
    return {"tps": (engine.stats.emitted_tokens - emitted0) / ms * 1e3,
            "acc_tok": engine.stats.accepted_tokens - tok0,
            "acc_rows": engine.stats.decode_rows - rows0,
            "ks": [k for _, k in list(engine.policy_history)[-steps:]]}


def _snapshot(engine: Engine, reqs: list) -> tuple:
    """The engine's decode state now (nothing in flight): device tables and the host's
    outputs, last tokens and drafts ready of `reqs`."""
    engine.drain()
    _sync(engine.device)
    return engine.state_snapshot(), [(list(r.output), r.last_verified, r.drafts_ready)
                                     for r in reqs]


def _restore(engine: Engine, reqs: list, snap: tuple) -> None:
    """Put `reqs` back where `_snapshot` saw them (device state, and the host's outputs), so
    each cell continues from its own state whatever the other cells did in between."""
    engine.drain()
    device_state, host = snap
    engine.restore_state(device_state)
    for r, (out, last, ready) in zip(reqs, host, strict=True):
        r.output[:] = out
        r.last_verified, r.drafts_ready = last, ready
    _sync(engine.device)


def start_state(spec: Engine, reqs: list) -> tuple:
    """The speculative cells' common start: every request decoding, no drafts counted. The
    prefill step drafts with `drafter.run` outside the cycle graph, where `Engine.draft_hook`
    (the accept control) does not reach: those drafts are the head's own, not the regime's,
    and the first cycle of each cell verifies them. With `drafts_ready` 0 that verify is no
    observation (before: counted, it dragged the adaptive estimate at bs 128 p = 0.6 from
    0.6 to 0.28 with a whole batch of rejections)."""
    snap = _snapshot(spec, reqs)
    return snap[0], [(out, last, 0) for out, last, _ in snap[1]]


def best_k_at(costs, steps: list[int], bs: int, p: float) -> int:
    """The k the adaptive policy's cost table prefers at a known match rate p (its `best`
    with an estimate pinned at p; the KV-read term the Engine adds is left out)."""
    est = AcceptRateEstimator(prior_alpha=min(max(p, 1e-6), 1.0), prior_weight=1e9, decay=1.0)
    return SpeculationPolicy("adaptive", STEPS, costs, steps=steps, estimator=est).best(bs)


def make_hook(engine: Engine, oracle: torch.Tensor, p: torch.Tensor):
    """`Engine.draft_hook`: the accept-rate control over the cycle's drafts (capturable)."""
    vocab = engine.target.config.vocab_size
    slots = engine.inputs.req_pool_indices
    positions = engine.drafter.bufs.write_start
    kernels = engine.cfg.kernels

    def hook(bs: int, next_tokens: torch.Tensor) -> None:
        ops.accept_control(next_tokens, slots[:bs], positions[:bs], oracle, p, SEED, vocab,
                           kernels=kernels)

    return hook


def _plan(batch_sizes, regimes, prompt_len, oracle_new, warmup, block, reps):
    """Per bs: steps per block, the oracle length (what the fastest regime's cells emit,
    +15%) and the context a request needs (every step emitting S + 1 tokens); and the KV
    pages of the largest bs x context."""
    plan = {}
    for bs in batch_sizes:
        blk = block if block is not None else block_steps(bs)
        steps = warmup + cell_steps(bs, blk, reps) + 2
        fast = max(expected_tokens(min(max(p, 0.0), 1.0), STEPS) for p in regimes)
        oracle = max(oracle_new, int(1.15 * steps * fast) + 8)
        # target-only: one token a step, per group of cells its own state (`measure`)
        base_new = max(oracle, warmup + cell_steps(bs, blk, reps)) + 8
        ctx = prompt_len + max(steps * (STEPS + 1), base_new) + 2 * (STEPS + 1) + 8
        plan[bs] = {"block": blk, "oracle_new": oracle, "base_new": base_new, "ctx": ctx}
    return plan


def measure(batch_sizes: tuple[int, ...] = BATCH_SIZES, regimes: tuple[float, ...] = REGIMES,
            *, seed: int = 0, pair: tuple | None = None, device: str = "cuda",
            dtype: str = "bfloat16", prompt_len: int = PROMPT_LEN,
            oracle_new: int = ORACLE_NEW, warmup: int = WARMUP, block: int | None = BLOCK,
            reps: int = REPS, budget_s: float | None = None,
            on_progress=None, residual_scale: float = RESIDUAL_SCALE,
            peak: bool = True) -> dict[str, Any]:
    """The rows of the module docstring. `pair`: (target, head) instead of the 8B-shaped pair
    (the CPU smoke test passes tiny models; its timings mean nothing). `peak`: make the target
    peaked in place (`make_peaked_`, whichever pair); False: the 8B target's residual
    branches scaled by `residual_scale` (a given pair is left alone). `block`: steps per
    timed block (None: `block_steps(bs)`). `budget_s`: a batch size is skipped (listed in
    `skipped_bs`) once this many seconds have passed since the start; `on_progress(data)`:
    called with the result so far after each batch size (the caller writes it, so a run cut
    short still leaves its rows)."""
    t_start = time.perf_counter()
    dev = torch.device(device)
    perm = None
    if pair is None:
        from perf.models_8b import build_pair
        pair = build_pair(device, seed=seed)
        if not peak and residual_scale != 1.0:
            damp_residual_branches_(pair[0], residual_scale)
    target, head = pair
    if peak:
        perm = make_peaked_(target, seed=seed + 17).tolist()
    sizes = tuple(sorted(batch_sizes))
    max_bs = max(sizes)
    plan = _plan(batch_sizes, regimes, prompt_len, oracle_new, warmup, block, reps)
    ctx = max(c["ctx"] for c in plan.values())
    pages = max(bs * -(-c["ctx"] // 16) for bs, c in plan.items()) + 2 * max_bs + 8
    cfg = runtime(max_bs, sizes, ctx, device=device, dtype=dtype, pages=pages)
    timing = {}
    t0 = time.perf_counter()
    base = Engine(target, cfg.replace(speculative_policy="fixed"))
    base.capture_graphs(progress=False)
    timing["capture_target_only_s"] = time.perf_counter() - t0
    spec = Engine(target, cfg, head)
    oracle = torch.full((cfg.max_running_requests + 1, cfg.max_context_len), -1,
                        dtype=torch.int32, device=dev)
    p_dev = torch.ones(1, dtype=torch.float32, device=dev)
    spec.draft_hook = make_hook(spec, oracle, p_dev)  # before capture: the graphs hold it
    t0 = time.perf_counter()
    spec.capture_graphs(progress=False)
    timing["capture_spec_s"] = time.perf_counter() - t0
    costs = spec.policy.costs
    capture_costs = costs.measured()
    steps = list(spec.steps)
    vocab = target.config.vocab_size
    rng = random.Random(seed)
    rows, skipped = [], []

    def result() -> dict[str, Any]:
        measured = {}
        for (b, k), ms in sorted(capture_costs.items()):
            measured.setdefault(k, {})[b] = ms
        goals = {"adaptive_ge_0.98_target_only": all(r["adaptive_over_target_only"] >= 0.98
                                                     for r in rows),
                 "adaptive_ge_0.97_fixed": all(r["adaptive_over_fixed"] >= 0.97 for r in rows),
                 # the accept-rate control held: the speculative text is the oracle's, and
                 # the measured accept length rises with p at every bs
                 "no_departures": all(r.get("departed_from_oracle", 0) == 0 for r in rows),
                 "accept_rises_with_p": all(_rises(rows, b) for b in {r["bs"] for r in rows})}
        gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (timings meaningless)"
        return {"gpu": gpu, "torch": torch.__version__, "prompt_len": prompt_len,
                "steps": STEPS, "captured_steps": steps, "cost_source": spec.cost_source,
                "cost_ms": measured, "regimes": list(regimes), "warmup": warmup,
                "block": {bs: c["block"] for bs, c in plan.items()}, "reps": reps,
                "lead_in": {bs: lead_steps(bs) for bs in plan},
                "method": "interleaved blocks, each after a lead-in of its own cell, group order "
                          "alternating by round; ratios = median of per-round ratios of "
                          "adjacent blocks",
                "target": "peaked" if peak else "random",
                "residual_scale": residual_scale if not peak else None, **timing,
                "rows": list(rows), "goals": goals,
                "skipped_bs": list(skipped), "wall_s": time.perf_counter() - t_start}

    for bs in batch_sizes:
        if budget_s is not None and time.perf_counter() - t_start > budget_s:
            skipped.append(bs)
            print(f"[policy] bs {bs}: skipped (time budget {budget_s:.0f}s spent)", flush=True)
            continue
        blk, onew = plan[bs]["block"], plan[bs]["oracle_new"]
        prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(bs)]
        # target-only: its greedy continuation (the oracle), then back to the decode start
        reqs = [base.add_request(p, SamplingParams(max_new_tokens=plan[bs]["base_new"],
                                                   ignore_eos=True)) for p in prompts]
        _reach_decode(base, bs)
        base_start = _snapshot(base, reqs)
        while min(len(r.output) for r in reqs) < onew:
            base.step()
        base.drain()
        text = [p + r.output for p, r in zip(prompts, reqs, strict=True)]
        _restore(base, reqs, base_start)
        follows = None
        if perm is not None:  # the peaked target's greedy text: t -> perm[t]
            pairs = [(t[i], t[i + 1]) for t in text for i in range(prompt_len - 1, len(t) - 1)]
            follows = sum(perm[a] == b for a, b in pairs) / max(len(pairs), 1)
        # the speculative engine over the same prompts; oracle rows by slot
        budget = plan[bs]["ctx"] - prompt_len - 2 * (STEPS + 1) - 1
        sreqs = [spec.add_request(p, SamplingParams(max_new_tokens=budget, ignore_eos=True))
                 for p in prompts]
        spec.set_policy(SpeculationPolicy("fixed", STEPS, steps=steps))
        spec.step()  # admits every request (slots known), prefills; no decode cycle yet
        oracle.fill_(-1)
        for r, t in zip(sreqs, text, strict=True):
            oracle[r.slot, : len(t)] = torch.tensor(t, dtype=torch.int32)
        _reach_decode(spec, bs)
        start = start_state(spec, sreqs)
        # the cells: (name, p, policy); each continues from its own state between its blocks
        cells = [("k0", None, SpeculationPolicy("fixed", 0, steps=[0]))]
        for p in regimes:
            cells.append((f"fixed@{p}", p, SpeculationPolicy("fixed", STEPS, steps=steps)))
            cells.append((f"adaptive@{p}", p, SpeculationPolicy(
                "adaptive", STEPS, CostTable(capture_costs), steps=steps)))
        state = {name: start for name, _, _ in cells}
        # every timed cycle's device time per cell, k and phase (the Engine's CycleTimer reads,
        # as its policy's `observe_cost` receives them): a diagnostic of the online costs
        samples: dict[str, dict[str, dict[int, list[float]]]] = {}
        phase = ["warmup"]
        for name, _, pol in cells:
            samples[name] = {"warmup": {}, "lead": {}, "timed": {}}
            pol.observe_cost = _logging_observe_cost(pol.observe_cost, samples[name], phase)
        groups = [["k0"]] + [[f"fixed@{p}", f"adaptive@{p}"] for p in regimes]
        policy_of = {name: (p, pol) for name, p, pol in cells}
        blocks: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in cells}
        tgt_before: dict[str, list[float]] = {g[0]: [] for g in groups}  # per group, per round
        warm_k: dict[str, Counter] = {}
        for _ in range(warmup):
            base.step()
        # target-only: per group its own state, which advances one token a step as the k = 0
        # cells do (one shared state would run 4x as far, at longer contexts)
        base_state = {g[0]: _snapshot(base, reqs) for g in groups}
        lead = lead_steps(bs)
        for rep in range(reps):
            for g in groups:
                # a target-only block right before each group: its ratios use adjacent blocks
                _restore(base, reqs, base_state[g[0]])
                for _ in range(lead):
                    base.step()
                tgt_before[g[0]].append(timed_block(base, blk)["tps"])
                base_state[g[0]] = _snapshot(base, reqs)
                for name in (g if rep % 2 == 0 else g[::-1]):
                    p, pol = policy_of[name]
                    _restore(spec, sreqs, state[name])
                    p_dev.fill_(1.0 if p is None else p)
                    spec.set_policy(pol)
                    if rep == 0:
                        phase[0] = "warmup"
                        for _ in range(warmup if name != "k0" else 2):
                            spec.step()
                        spec.drain()
                        warm_k[name] = Counter(k for _, k in list(spec.policy_history)[
                            -(warmup if name != "k0" else 2):])
                    phase[0] = "lead"
                    for _ in range(lead):
                        spec.step()
                    phase[0] = "timed"  # (the lead-in's last cycle is retired in the block)
                    blocks[name].append(timed_block(spec, blk))
                    state[name] = _snapshot(spec, sreqs)

        def tps(bl: list[dict[str, Any]]) -> float:
            return statistics.median(b["tps"] for b in bl)

        def ratio(bl: list[dict[str, Any]], den: list[float]) -> tuple[float, list[float]]:
            rs = [b["tps"] / d for b, d in zip(bl, den, strict=True)]
            return statistics.median(rs), rs

        def accept(bl: list[dict[str, Any]]) -> float:
            rows_ = sum(b["acc_rows"] for b in bl)
            return sum(b["acc_tok"] for b in bl) / rows_ if rows_ else 0.0

        all_tgt = [t for g in groups for t in tgt_before[g[0]]]
        k0_ratio, k0_rs = ratio(blocks["k0"], tgt_before["k0"])
        for p in regimes:
            fx, ad = f"fixed@{p}", f"adaptive@{p}"
            pol = policy_of[ad][1]
            ad_t, ad_rs = ratio(blocks[ad], tgt_before[fx])
            ad_f_rs = [a["tps"] / f["tps"] for a, f in zip(blocks[ad], blocks[fx], strict=True)]
            ad_f = statistics.median(ad_f_rs)
            seq = [k for b in blocks[ad] for k in b["ks"]]  # the timed cycles' k, in order
            ks = Counter(seq)
            online = {}
            for (b_, k), ms in sorted(pol.costs.online().items()):
                online.setdefault(k, {})[b_] = round(ms, 4)
            cell = {"bs": bs, "regime": f"p={p}", "p": p,
                    "target_only_tps": statistics.median(all_tgt),
                    "expected_accept": expected_tokens(min(max(p, 0.0), 1.0), STEPS),
                    "fixed_tps": tps(blocks[fx]), "adaptive_tps": tps(blocks[ad]),
                    "adaptive_k": dict(sorted(ks.items())),
                    "adaptive_k_warmup": dict(sorted(warm_k[ad].items())),
                    "adaptive_alpha": pol.estimator.alpha, "adaptive_probes": pol.stats()["probes"],
                    "adaptive_online_cost_ms": online,
                    "best_k_at_p": best_k_at(CostTable(capture_costs), steps, bs, p),
                    "best_k_at_p_online": best_k_at(pol.costs, steps, bs, p),
                    "oracle_follows_perm": follows, "k0_tps": tps(blocks["k0"]),
                    "fixed_accept": accept(blocks[fx]), "adaptive_accept": accept(blocks[ad]),
                    "adaptive_over_target_only": ad_t, "adaptive_over_fixed": ad_f,
                    "k0_over_target_only": k0_ratio,
                    "adaptive_over_target_only_reps": ad_rs, "k0_over_target_only_reps": k0_rs,
                    "adaptive_over_fixed_reps": ad_f_rs,
                    "fixed_over_target_only_reps": [f["tps"] / t for f, t in
                                                    zip(blocks[fx], tgt_before[fx], strict=True)],
                    "adaptive_k_sequence": _runs(seq),
                    "cycle_ms_samples": {c: samples[c] for c in (fx, ad)},
                    "cycle_ms_median": {c: {ph: {k: round(statistics.median(v), 3)
                                                 for k, v in sorted(samples[c][ph].items())}
                                            for ph in samples[c]} for c in (fx, ad)},
                    "adaptive_cost_refreshes": pol.stats().get("cost_refreshes", 0),
                    "cycles_per_cell": blk * reps, "block": blk, "lead_in": lead}
            rows.append(cell)
            print(f"[policy] bs {bs:>3} p {p}: target-only {cell['target_only_tps']:.0f} fixed "
                  f"{cell['fixed_tps']:.0f} (accept {cell['fixed_accept']:.2f} of "
                  f"{cell['expected_accept']:.2f}) adaptive {cell['adaptive_tps']:.0f} (k {dict(ks)}, "
                  f"alpha {pol.estimator.alpha:.2f}, best k {cell['best_k_at_p']}/"
                  f"{cell['best_k_at_p_online']}) k0 {cell['k0_tps']:.0f} tok/s; ad/target "
                  f"{ad_t:.3f} ad/fixed {ad_f:.3f} k0/target {k0_ratio:.3f}", flush=True)
        spec.drain()
        departed = exhausted = 0
        for name, _, _ in cells:  # every cell's text against the oracle
            for out, t in zip((h[0] for h in state[name][1]), text, strict=True):
                m = min(len(out), len(t) - prompt_len)
                departed += out[:m] != t[prompt_len: prompt_len + m]
                exhausted += len(out) > len(t) - prompt_len
        for cell in rows[-len(regimes):]:
            cell["departed_from_oracle"] = departed  # (request, cell) pairs that departed
            cell["oracle_exhausted"] = exhausted  # (request, cell) pairs that outran the
            # oracle (raise ORACLE_NEW: their later drafts were the head's own, mostly rejected)
        if departed:
            print(f"[policy] bs {bs}: {departed} (request, cell) greedy texts departed from the "
                  "target-only oracle (bf16 near ties); their later drafts mostly rejected")
        _abort_all(spec)
        _abort_all(base)
        if on_progress is not None:
            on_progress(result())
    return result()


def _logging_observe_cost(observe_cost, log: dict[str, dict[int, list[float]]], phase: list[str]):
    """Wrap a policy's `observe_cost`: each cycle's ms also lands in log[phase[0]][k]."""

    def wrapped(padded_bs: int, k: int, ms: float, extra_ms: float = 0.0) -> None:
        log[phase[0]].setdefault(k, []).append(round(float(ms), 3))
        observe_cost(padded_bs, k, ms, extra_ms)

    return wrapped


def _runs(ks: list[int]) -> str:
    """Run-length form of a k sequence: "3x12 1x1 3x47"."""
    out: list[list[int]] = []
    for k in ks:
        if out and out[-1][0] == k:
            out[-1][1] += 1
        else:
            out.append([k, 1])
    return " ".join(f"{k}x{n}" for k, n in out)


def _rises(rows: list[dict[str, Any]], bs: int) -> bool:
    """fixed_accept strictly rises with p over this bs's cells."""
    acc = [r["fixed_accept"] for r in sorted((r for r in rows if r["bs"] == bs),
                                             key=lambda r: r["p"])]
    return all(a < b for a, b in zip(acc, acc[1:], strict=False))


def table(data: dict[str, Any]) -> str:
    out = ["| bs | regime | target-only tok/s | fixed S=3 | adaptive | adaptive k (timed) | "
           "best k | k0 | ad/target | ad/fixed | k0/target | fixed accept (expected) | departed |",
           "|" + "---|" * 13]
    for r in data["rows"]:
        out.append(f"| {r['bs']} | {r['regime']} | {r['target_only_tps']:.0f} | "
                   f"{r['fixed_tps']:.0f} | {r['adaptive_tps']:.0f} | {r['adaptive_k']} | "
                   f"{r['best_k_at_p']} | {r['k0_tps']:.0f} | {r['adaptive_over_target_only']:.3f} | "
                   f"{r['adaptive_over_fixed']:.3f} | {r['k0_over_target_only']:.3f} | "
                   f"{r['fixed_accept']:.2f} "
                   f"({r['expected_accept']:.2f}) | {r.get('departed_from_oracle', '-')} |")
    return "\n".join(out)


def output_name(device_name: str) -> str:
    """`<date>-h200-policy.json` (UTC date; the GPU's short name)."""
    short = "h200" if "H200" in device_name else (
        re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu")
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}-{short}-policy.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="perf/runs", help="folder of the JSON")
    p.add_argument("--bs", default=",".join(map(str, BATCH_SIZES)),
                   help="comma-separated batch sizes")
    p.add_argument("--regimes", default=",".join(map(str, REGIMES)),
                   help="comma-separated draft match probabilities p")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="skip the remaining batch sizes after this many seconds (the run must "
                        "end within 4 minutes on one H200; about 130 s expected)")
    p.add_argument("--no-peak", action="store_true",
                   help="the plain random target (not made peaked: its greedy text departs "
                        "from the oracle on bf16 near ties)")
    p.add_argument("--residual-scale", type=float, default=RESIDUAL_SCALE,
                   help="with --no-peak: scale of the 8B target's o_proj / down_proj weights")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("perf.policy needs a CUDA GPU")
        return 2
    name = output_name(torch.cuda.get_device_name())
    data = measure(tuple(int(x) for x in a.bs.split(",")),
                   tuple(float(x) for x in a.regimes.split(",")), budget_s=a.budget_s,
                   residual_scale=a.residual_scale, peak=not a.no_peak,
                   on_progress=lambda d: write_json(a.out, name, d))
    path = write_json(a.out, name, data)
    write_json(a.out, "policy.json", data)  # the same rows under a fixed name
    print(table(data))
    print(f"goals: {data['goals']}  wall {data['wall_s']:.0f}s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
