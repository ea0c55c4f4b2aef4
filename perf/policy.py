"""Speculation policy end to end at the Llama-3.1-8B shape: `python3 -m perf.policy --out DIR`.

One process, one H200 (issue #21, "Measured"): the 8B-shaped target with random bf16 weights
and its EAGLE-3 head (perf/models_8b.py), S = 3, greedy, prompts of PROMPT_LEN random tokens.
Two Engines over the same weights: target-only (no drafter: the baseline), and speculative
with the adaptive policy's captured draft lengths K = {0, 1, 3} (one cycle graph per
(padded bs, k); its cost table measured after capture). The speculative engine serves three
policies over the same requests, one after the other: `fixed` (always 3 drafts: the policy
swapped for `SpeculationPolicy("fixed", 3)`, the same k = 3 graphs), `adaptive` (a fresh
adaptive policy per cell over the measured costs) and `k0` (always k = 0: the draft's first
step kept, what the adaptive policy pays when it stops speculating).

Accept-rate regimes: random weights accept nothing, so the benchmark mixes the drafts
(`graphdraft.kernels.accept_control`, inside the cycle graph through `Engine.draft_hook`, after
drafting and before the commit): each draft equals the target's own greedy token at its position
with probability p, else another token. The oracle is the greedy continuation a target-only run
of the same prompts emitted (that run is also the target-only measurement). Where the
speculative engine's greedy text departs from it (bf16 numerics of a k + 1 token verify can
flip a near tie) later drafts of that request are mostly rejected: `*_accept` reports the mean
accept length each cell really had, `departed_from_oracle` the requests that departed. To
keep near ties rare, the 8B target's residual branches (every layer's o_proj and down_proj)
are scaled by RESIDUAL_SCALE after the random draw: same shapes, same work, but the hidden
state (and so the argmax) barely moves with the rounding differences of another verify width.

Per (bs, regime): tokens/s = tokens emitted over the CUDA-event span of a block of `step()`
calls in steady decode (every row decoding; host loop and copies included; nothing in flight
before or after the block), median of REPS blocks after WARMUP steps. Writes
`DIR/<date>-h200-policy.json` (rows `bs`, `regime`, `p`, `target_only_tps`, `fixed_tps`,
`adaptive_tps`, `adaptive_k` {k: cycles}, `k0_tps`, accept means, ratios) and prints a table.
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
from graphdraft.serving.policy import SpeculationPolicy
from graphdraft.serving.verify import SamplingParams
from perf.timing import write_json

BATCH_SIZES = (1, 8, 32, 64, 128, 256)
REGIMES = (0.9, 0.6, 0.2)
PROMPT_LEN = 32
ORACLE_NEW = 400       # greedy tokens the target-only run records per request
STEPS = 3
WARMUP = 6             # steps before each cell's timed blocks (the adaptive estimate settles)
BLOCK = 5              # steps per timed block
REPS = 3               # timed blocks per cell (median)
SEED = 1234            # accept_control's Philox key
RESIDUAL_SCALE = 0.01  # o_proj / down_proj of the 8B target scaled (module docstring)


@torch.no_grad()
def damp_residual_branches_(target: torch.nn.Module, scale: float) -> None:
    """Scale every layer's o_proj and down_proj weights in place (module docstring)."""
    for name, p in target.named_parameters():
        if name.endswith(("self_attn.o_proj", "mlp.down_proj")):
            p.mul_(scale)


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
        ks.update(k for _, k in list(engine.policy_history)[-block:])
    return {"tps": statistics.median(tps), "accept": acc_tok / acc_rows if acc_rows else 0.0,
            "k": dict(sorted(ks.items()))}


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
            on_progress=None, residual_scale: float = RESIDUAL_SCALE) -> dict[str, Any]:
    """The rows of the module docstring. `pair`: (target, head) instead of the 8B-shaped pair
    (the CPU smoke test passes tiny models; its timings mean nothing). `budget_s`: a batch
    size is skipped (listed in `skipped_bs`) once this many seconds have passed since the
    start; `on_progress(data)`: called with the result so far after each batch size (the
    caller writes it, so a run cut short still leaves its rows)."""
    t_start = time.perf_counter()
    dev = torch.device(device)
    if pair is None:
        from perf.models_8b import build_pair
        pair = build_pair(device, seed=seed)
        if residual_scale != 1.0:
            damp_residual_branches_(pair[0], residual_scale)
    target, head = pair
    sizes = tuple(sorted(batch_sizes))
    max_bs = max(sizes)
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
                 "adaptive_ge_0.97_fixed": all(r["adaptive_over_fixed"] >= 0.97 for r in rows)}
        gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (timings meaningless)"
        return {"gpu": gpu, "torch": torch.__version__, "prompt_len": prompt_len,
                "steps": STEPS, "captured_steps": steps, "cost_source": spec.cost_source,
                "cost_ms": measured, "regimes": list(regimes), "warmup": warmup,
                "block": block, "reps": reps, "residual_scale": residual_scale, **timing, "rows": list(rows), "goals": goals,
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
        # the speculative engine over the same prompts; oracle rows by slot
        budget = cfg.max_context_len - prompt_len - 2 * (STEPS + 1) - 1
        sreqs = [spec.add_request(p, SamplingParams(max_new_tokens=budget, ignore_eos=True))
                 for p in prompts]
        spec.step()  # admits every request (slots known), prefills; no decode cycle yet
        oracle.fill_(-1)
        for r, t in zip(sreqs, text, strict=True):
            oracle[r.slot, : len(t)] = torch.tensor(t, dtype=torch.int32)
        _reach_decode(spec, bs)
        k0 = None
        for p in regimes:
            p_dev.fill_(p)
            cell = {"bs": bs, "regime": f"p={p}", "p": p, "target_only_tps": tgt["tps"]}
            spec.set_policy(SpeculationPolicy("fixed", STEPS, steps=steps))
            fx = timed_tps(spec, warmup=warmup, block=block, reps=reps)
            spec.set_policy(SpeculationPolicy("adaptive", STEPS, costs, steps=steps))
            ad = timed_tps(spec, warmup=warmup, block=block, reps=reps)
            if k0 is None:  # k = 0 cycles: the same at every p (nothing verified)
                spec.set_policy(SpeculationPolicy("fixed", 0, steps=[0]))
                k0 = timed_tps(spec, warmup=2, block=block, reps=reps)
            cell.update({
                "fixed_tps": fx["tps"], "adaptive_tps": ad["tps"], "adaptive_k": ad["k"],
                "k0_tps": k0["tps"], "fixed_accept": fx["accept"],
                "adaptive_accept": ad["accept"],
                "adaptive_over_target_only": ad["tps"] / tgt["tps"],
                "adaptive_over_fixed": ad["tps"] / fx["tps"],
                "k0_over_target_only": k0["tps"] / tgt["tps"]})
            rows.append(cell)
            print(f"[policy] bs {bs:>3} p {p}: target-only {tgt['tps']:.0f} fixed {fx['tps']:.0f} "
                  f"(accept {fx['accept']:.2f}) adaptive {ad['tps']:.0f} (k {ad['k']}) "
                  f"k0 {k0['tps']:.0f} tok/s", flush=True)
        spec.drain()
        departed = 0
        for r, t in zip(sreqs, text, strict=True):
            m = min(len(r.output), len(t) - prompt_len)
            departed += r.output[:m] != t[prompt_len: prompt_len + m]
        for cell in rows[-len(regimes):]:
            cell["departed_from_oracle"] = departed
        if departed:
            print(f"[policy] bs {bs}: {departed}/{bs} requests' greedy text departed from the "
                  "target-only oracle (bf16 near ties); their later drafts mostly rejected")
        _abort_all(spec)
        if on_progress is not None:
            on_progress(result())
    return result()


def table(data: dict[str, Any]) -> str:
    out = ["| bs | regime | target-only tok/s | fixed S=3 | adaptive | adaptive k | k0 | "
           "ad/target | ad/fixed | fixed accept |", "|" + "---|" * 10]
    for r in data["rows"]:
        out.append(f"| {r['bs']} | {r['regime']} | {r['target_only_tps']:.0f} | "
                   f"{r['fixed_tps']:.0f} | {r['adaptive_tps']:.0f} | {r['adaptive_k']} | "
                   f"{r['k0_tps']:.0f} | {r['adaptive_over_target_only']:.3f} | "
                   f"{r['adaptive_over_fixed']:.3f} | {r['fixed_accept']:.2f} |")
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
    p.add_argument("--residual-scale", type=float, default=RESIDUAL_SCALE,
                   help="scale of the 8B target's o_proj / down_proj weights (1: as drawn)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("perf.policy needs a CUDA GPU")
        return 2
    name = output_name(torch.cuda.get_device_name())
    data = measure(tuple(int(x) for x in a.bs.split(",")),
                   tuple(float(x) for x in a.regimes.split(",")), budget_s=a.budget_s,
                   residual_scale=a.residual_scale,
                   on_progress=lambda d: write_json(a.out, name, d))
    path = write_json(a.out, name, data)
    print(table(data))
    print(f"goals: {data['goals']}  wall {data['wall_s']:.0f}s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
