"""Speculation policy end to end at the Llama-3.1-8B shape: `python3 -m perf.policy --out DIR`.

One process, one H200 (issue #21, "Measured"): the 8B-shaped target with random bf16 weights
and its EAGLE-3 head (perf/models_8b.py), S = 3, greedy, prompts of PROMPT_LEN random tokens.
Two Engines over the same weights: target-only (no drafter: the baseline), and speculative
with the adaptive policy's captured draft lengths K = {0, 1, 3} (one cycle graph per
(padded bs, k); its cost table measured after capture). The speculative engine serves three
policies over the same requests, one after the other: `fixed` (always 3 drafts: the policy
swapped for `SpeculationPolicy("fixed", 3)`, the same k = 3 graphs), `adaptive` (a fresh
adaptive policy per cell over the measured costs) and `k0` (always k = 0: target-only decode
plus the draft's KV-only step, what the adaptive policy pays when it stops speculating).

Accept-rate regimes: random weights accept nothing, so the benchmark mixes the drafts
(`graphdraft.kernels.accept_control`, inside the cycle graph through `Engine.draft_hook`, after
drafting and before the commit): each draft equals the target's own greedy token at its position
with probability p, else another token. The oracle is the greedy continuation a target-only run
of the same prompts emitted (that run is also the target-only measurement). The control only
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
settle: `adaptive_k` counts the draft lengths of the timed cycles only (`adaptive_k_warmup`
those of the warm-up), `adaptive_alpha` its estimate at the end, `best_k_at_p` the k its
cost table prefers at the true rate p (the KV-read term left out).

Per (bs, regime): tokens/s = tokens emitted over the CUDA-event span of a block of `step()`
calls in steady decode (every row decoding; host loop and copies included; nothing in flight
before or after the block), median of REPS blocks after WARMUP steps. Writes
`DIR/<date>-h200-policy.json` (rows `bs`, `regime`, `p`, `target_only_tps`, `fixed_tps`,
`adaptive_tps`, `adaptive_k` {k: timed cycles}, `k0_tps`, accept means, the checks above,
ratios) and prints a table.
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

from graphdraft.config import RuntimeConfig
from graphdraft.kernels.accept_control import accept_control
from graphdraft.serving.engine import Engine
from graphdraft.serving.policy import AcceptRateEstimator, SpeculationPolicy, expected_tokens
from graphdraft.serving.verify import SamplingParams
from perf.models_8b import damp_residual_branches_, make_peaked_
from perf.timing import write_json

__all__ = ["damp_residual_branches_", "main", "measure", "table"]

BATCH_SIZES = (1, 8, 32, 64, 128, 256)
REGIMES = (0.9, 0.6, 0.2)
PROMPT_LEN = 32
ORACLE_NEW = 480       # greedy tokens the target-only run records per request (the cells
                       # emit about 390 at WARMUP 12; `oracle_exhausted` counts overruns)
STEPS = 3
WARMUP = 12            # steps before each cell's timed blocks (the adaptive estimate settles:
                       # at bs 1 one row a step; tests/test_policy_perf.py checks it)
BLOCK = 5              # steps per timed block
REPS = 3               # timed blocks per cell (median)
SEED = 1234            # accept_control's Philox key
RESIDUAL_SCALE = 0.01  # --no-peak: o_proj / down_proj of the 8B target scaled (module docstring)


def runtime(max_bs: int, sizes: tuple[int, ...], ctx: int, *, policy: str = "adaptive",
            device: str = "cuda", dtype: str = "bfloat16") -> RuntimeConfig:
    """Every slot holds `ctx` tokens (no request waits for pages)."""
    cfg = RuntimeConfig(speculative_num_steps=STEPS, page_size=16, max_running_requests=max_bs,
                        max_context_len=-(-ctx // 16) * 16, max_num_batched_tokens=8192,
                        cuda_graph_max_bs=max_bs, cuda_graph_bs=sizes, dtype=dtype,
                        device=device, speculative_policy=policy)
    return cfg.replace(num_kv_pages=cfg.max_running_requests * cfg.max_pages_per_req)


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


def timed_tps(engine: Engine, *, warmup: int = WARMUP, block: int = BLOCK,
              reps: int = REPS) -> dict[str, Any]:
    """Median tokens/s over `reps` blocks of `block` steps after `warmup` steps, with the
    mean accept length and the draft lengths chosen during the blocks."""
    for _ in range(warmup):
        engine.step()
    warm = Counter(k for _, k in list(engine.policy_history)[-warmup:]) if warmup else Counter()
    tps, acc_tok, acc_rows, ks = [], 0, 0, Counter()
    cuda = engine.device.type == "cuda"
    for _ in range(reps):
        engine.drain()
        _sync(engine.device)
        emitted0, tok0, rows0 = (engine.stats.emitted_tokens, engine.stats.accepted_tokens,
                                 engine.stats.decode_rows)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(block):
            engine.step()
        if cuda:
            end.record()
        engine.drain()
        _sync(engine.device)
        ms = start.elapsed_time(end) if cuda else (time.perf_counter() - t0) * 1e3
        tps.append((engine.stats.emitted_tokens - emitted0) / ms * 1e3)
        acc_tok += engine.stats.accepted_tokens - tok0
        acc_rows += engine.stats.decode_rows - rows0
        ks.update(k for _, k in list(engine.policy_history)[-block:])  # this block's cycles
    return {"tps": statistics.median(tps), "accept": acc_tok / acc_rows if acc_rows else 0.0,
            "k": dict(sorted(ks.items())), "k_warmup": dict(sorted(warm.items()))}


def _snapshot(engine: Engine, reqs: list) -> tuple:
    """The engine's decode state now (nothing in flight): device tables and the host's
    output lengths, last tokens and drafts ready of `reqs`."""
    engine.drain()
    _sync(engine.device)
    return engine.state_snapshot(), [(len(r.output), r.last_verified, r.drafts_ready)
                                     for r in reqs]


def _restore(engine: Engine, reqs: list, snap: tuple) -> None:
    """Put `reqs` back where `_snapshot` saw them (device state, and the host's outputs cut
    back), so the next timed cell starts at the same context lengths."""
    engine.drain()
    device_state, host = snap
    engine.restore_state(device_state)
    for r, (n, last, ready) in zip(reqs, host, strict=True):
        del r.output[n:]
        r.last_verified, r.drafts_ready = last, ready
    _sync(engine.device)


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

    def hook(bs: int, next_tokens: torch.Tensor) -> None:
        accept_control(next_tokens, slots[:bs], positions[:bs], oracle, p, SEED, vocab)

    return hook


def measure(batch_sizes: tuple[int, ...] = BATCH_SIZES, regimes: tuple[float, ...] = REGIMES,
            *, seed: int = 0, pair: tuple | None = None, device: str = "cuda",
            dtype: str = "bfloat16", prompt_len: int = PROMPT_LEN,
            oracle_new: int = ORACLE_NEW, warmup: int = WARMUP, block: int = BLOCK,
            reps: int = REPS, budget_s: float | None = None,
            on_progress=None, residual_scale: float = RESIDUAL_SCALE,
            peak: bool = True) -> dict[str, Any]:
    """The rows of the module docstring. `pair`: (target, head) instead of the 8B-shaped pair
    (the CPU smoke test passes tiny models; its timings mean nothing). `peak`: make the target
    peaked in place (`make_peaked_`, whichever pair); False: the 8B target's residual
    branches scaled by `residual_scale` (a given pair is left alone). `budget_s`: a batch
    size is skipped (listed in `skipped_bs`) once this many seconds have passed since the
    start; `on_progress(data)`: called with the result so far after each batch size (the
    caller writes it, so a run cut short still leaves its rows)."""
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
    # the oracle covers what a request is expected to emit over its cells (+15%)
    need = sum(2 * (warmup + block * reps) * expected_tokens(min(max(p, 0.0), 1.0), STEPS)
               for p in regimes) + 2 + block * reps + 2
    oracle_new = max(oracle_new, int(1.15 * need) + 1)
    # what one request can emit over every cell (at most S + 1 tokens a step), or the oracle
    cells = len(regimes) * 2 * (warmup + block * reps) * (STEPS + 1) + (2 + block * reps) + 8
    ctx = prompt_len + max(cells, oracle_new) + 2 * (STEPS + 1) + 8
    cfg = runtime(max_bs, sizes, ctx, device=device, dtype=dtype)
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
    steps = list(spec.steps)
    vocab = target.config.vocab_size
    rng = random.Random(seed)
    rows, skipped = [], []

    def result() -> dict[str, Any]:
        measured = {}
        for (b, k), ms in sorted(costs.measured().items()):
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
                "block": block, "reps": reps, "target": "peaked" if peak else "random",
                "residual_scale": residual_scale if not peak else None, **timing,
                "rows": list(rows), "goals": goals,
                "skipped_bs": list(skipped), "wall_s": time.perf_counter() - t_start}

    for bs in batch_sizes:
        if budget_s is not None and time.perf_counter() - t_start > budget_s:
            skipped.append(bs)
            print(f"[policy] bs {bs}: skipped (time budget {budget_s:.0f}s spent)", flush=True)
            continue
        prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(bs)]
        # target-only: its timing, then the rest of its greedy continuation (the oracle)
        reqs = [base.add_request(p, SamplingParams(max_new_tokens=oracle_new, ignore_eos=True))
                for p in prompts]
        _reach_decode(base, bs)
        tgt = timed_tps(base, warmup=warmup, block=block, reps=reps)
        while base.has_work:
            base.step()
        text = [p + r.output for p, r in zip(prompts, reqs, strict=True)]
        follows = None
        if perm is not None:  # the peaked target's greedy text: t -> perm[t]
            pairs = [(t[i], t[i + 1]) for t in text for i in range(prompt_len - 1, len(t) - 1)]
            follows = sum(perm[a] == b for a, b in pairs) / max(len(pairs), 1)
        # the speculative engine over the same prompts; oracle rows by slot
        budget = cfg.max_context_len - prompt_len - 2 * (STEPS + 1) - 1
        sreqs = [spec.add_request(p, SamplingParams(max_new_tokens=budget, ignore_eos=True))
                 for p in prompts]
        spec.step()  # admits every request (slots known), prefills; no decode cycle yet
        oracle.fill_(-1)
        for r, t in zip(sreqs, text, strict=True):
            oracle[r.slot, : len(t)] = torch.tensor(t, dtype=torch.int32)
        _reach_decode(spec, bs)
        # every cell starts from the same decode state (the contexts target-only was timed
        # at): device state by `state_snapshot`, the host's outputs cut back to it
        start = _snapshot(spec, sreqs)
        k0 = None
        for p in regimes:
            p_dev.fill_(p)
            cell = {"bs": bs, "regime": f"p={p}", "p": p, "target_only_tps": tgt["tps"],
                    "expected_accept": expected_tokens(min(max(p, 0.0), 1.0), STEPS)}
            if k0 is None:  # k = 0 cycles: the same at every p (nothing verified)
                _restore(spec, sreqs, start)
                spec.set_policy(SpeculationPolicy("fixed", 0, steps=[0]))
                k0 = timed_tps(spec, warmup=2, block=block, reps=reps)
            _restore(spec, sreqs, start)
            spec.set_policy(SpeculationPolicy("fixed", STEPS, steps=steps))
            fx = timed_tps(spec, warmup=warmup, block=block, reps=reps)
            _restore(spec, sreqs, start)
            spec.set_policy(SpeculationPolicy("adaptive", STEPS, costs, steps=steps))
            ad = timed_tps(spec, warmup=warmup, block=block, reps=reps)
            alpha = spec.policy.estimator.alpha
            cell.update({
                "fixed_tps": fx["tps"], "adaptive_tps": ad["tps"], "adaptive_k": ad["k"],
                "adaptive_k_warmup": ad["k_warmup"], "adaptive_alpha": alpha,
                "best_k_at_p": best_k_at(costs, steps, bs, p), "oracle_follows_perm": follows,
                "k0_tps": k0["tps"], "fixed_accept": fx["accept"],
                "adaptive_accept": ad["accept"],
                "adaptive_over_target_only": ad["tps"] / tgt["tps"],
                "adaptive_over_fixed": ad["tps"] / fx["tps"],
                "k0_over_target_only": k0["tps"] / tgt["tps"]})
            rows.append(cell)
            print(f"[policy] bs {bs:>3} p {p}: target-only {tgt['tps']:.0f} fixed {fx['tps']:.0f} "
                  f"(accept {fx['accept']:.2f} of {cell['expected_accept']:.2f}) adaptive "
                  f"{ad['tps']:.0f} (k {ad['k']}, alpha {alpha:.2f}, best k {cell['best_k_at_p']}) "
                  f"k0 {k0['tps']:.0f} tok/s", flush=True)
        spec.drain()
        departed = exhausted = 0
        for r, t in zip(sreqs, text, strict=True):
            m = min(len(r.output), len(t) - prompt_len)
            departed += r.output[:m] != t[prompt_len: prompt_len + m]
            exhausted += len(r.output) > len(t) - prompt_len
        for cell in rows[-len(regimes):]:
            cell["departed_from_oracle"] = departed
            cell["oracle_exhausted"] = exhausted  # requests that outran the oracle (raise
            # ORACLE_NEW: their later drafts were the head's own, mostly rejected)
        if departed:
            print(f"[policy] bs {bs}: {departed}/{bs} requests' greedy text departed from the "
                  "target-only oracle (bf16 near ties); their later drafts mostly rejected")
        _abort_all(spec)
        if on_progress is not None:
            on_progress(result())
    return result()


def _rises(rows: list[dict[str, Any]], bs: int) -> bool:
    """fixed_accept strictly rises with p over this bs's cells."""
    acc = [r["fixed_accept"] for r in sorted((r for r in rows if r["bs"] == bs),
                                             key=lambda r: r["p"])]
    return all(a < b for a, b in zip(acc, acc[1:], strict=False))


def table(data: dict[str, Any]) -> str:
    out = ["| bs | regime | target-only tok/s | fixed S=3 | adaptive | adaptive k (timed) | "
           "best k | k0 | ad/target | ad/fixed | fixed accept (expected) | departed |",
           "|" + "---|" * 12]
    for r in data["rows"]:
        out.append(f"| {r['bs']} | {r['regime']} | {r['target_only_tps']:.0f} | "
                   f"{r['fixed_tps']:.0f} | {r['adaptive_tps']:.0f} | {r['adaptive_k']} | "
                   f"{r['best_k_at_p']} | {r['k0_tps']:.0f} | {r['adaptive_over_target_only']:.3f} | "
                   f"{r['adaptive_over_fixed']:.3f} | {r['fixed_accept']:.2f} "
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
    p.add_argument("--budget-s", type=float, default=180.0,
                   help="skip the remaining batch sizes after this many seconds (the run must "
                        "end within 4 minutes on one H200)")
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
    print(table(data))
    print(f"goals: {data['goals']}  wall {data['wall_s']:.0f}s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
