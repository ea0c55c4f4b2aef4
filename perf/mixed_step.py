"""Host time of a prefill / mixed step against a decode cycle, offline (one Engine, one process).

`python -m perf.mixed_step --out DIR` (GPU): builds the Engine `graphdraft serve` builds (the
shipped pair unless --target / --draft after --; default flags `--max-running-requests 128`),
then per concurrency c (`--levels`) `--reps` closed loops (`perf.serve.closed_loop_offline`,
admission "immediate": nearly every step after a finish admits, i.e. is a mixed step) of
`--requests` requests of `--max-tokens` tokens over the HumanEval prompts, after one warm-up
loop. Each row: output tok/s, steps, decode cycles, mixed steps, and the mean host time of a
mixed step and of every other step (`Engine.step()` wall time, which includes any wait for the
device: a host sync inside a mixed step shows here), medians over the repetitions. Then one
loop at the first level under the torch profiler: how many host syncs and copies the loop
issued (cudaStreamSynchronize, pageable H2D copies, cudaMemcpyAsync, pin_memory calls,
kernel launches) per step. Writes `DIR/<--name>` (JSON) and prints the rows. `--tiny`: a CPU
check of the script (levels 2, 4 requests, 4 tokens; no figure). Last, per level one more loop
with a wall-clock timer around each phase of a step (`PHASES`: admission, the mixed step's
write_batch, target forward, acceptance, draft, commit, the retirement's wait): host ms per
mixed step and per other step ("phases").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PROFILE_KEYS = {"cudaStreamSynchronize": "stream_syncs",
                "Memcpy HtoD (Pageable -> Device)": "pageable_h2d",
                "cudaMemcpyAsync": "memcpy_calls", "aten::pin_memory": "pin_memory",
                "cudaLaunchKernel": "launch_kernel", "cuLaunchKernelEx": "launch_kernel_ex",
                "cudaGraphLaunch": "graph_launches", "cudaEventSynchronize": "event_syncs"}


def measure(engine, prompts, params, c: int, n: int, reps: int) -> dict:
    """Median over `reps` closed loops of c requests in the system, n requests each."""
    import torch

    from perf.serve import closed_loop_offline

    runs = []
    for rep in range(reps):
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = closed_loop_offline(engine, prompts, params, c, n, offset=rep * n)
        wall = time.perf_counter() - t0
        decode = r["steps"] - r["mixed_steps"]
        runs.append(r | {"tps": r["tokens"] / wall,
                         "mixed_step_ms": 1e3 * r["prefill_step_s"] / max(1, r["mixed_steps"]),
                         "other_step_ms": 1e3 * (r["step_s"] - r["prefill_step_s"]) / max(1, decode)})
    row = {"concurrency": c, "requests": n}
    for key in ("tps", "mixed_step_ms", "other_step_ms", "steps", "mixed_steps", "decode_cycles"):
        row[key] = round(statistics.median(x[key] for x in runs), 3)
    return row


PHASES = (
    # (name, owner path, attribute): host wall time of each call, inclusive of what it calls
    ("plan_step (admission)", "graphdraft.serving.engine:Engine", "plan_step"),
    ("launch", "graphdraft.serving.engine:Engine", "launch"),
    ("retire (waits for the step before)", "graphdraft.serving.engine:Engine", "retire_launched"),
    ("mixed", "graphdraft.serving.cycles.chain:ChainMode", "mixed"),
    ("write_batch", "graphdraft.serving.cycles.chain", "write_batch"),
    ("prepare (decode rows)", "graphdraft.serving.cycles.base:DecodeMode", "prepare"),
    ("target_forward", "graphdraft.serving.cycles.base:DecodeMode", "target_forward"),
    ("accept", "graphdraft.serving.cycles.base:DecodeMode", "accept"),
    ("draft_mixed", "graphdraft.runtime.drafter:EagleDrafter", "draft_mixed"),
    ("draft_mixed_padded", "graphdraft.runtime.drafter:EagleDrafter", "draft_mixed_padded"),
    ("draft first step", "graphdraft.runtime.drafter:EagleDrafter", "_mixed_first"),
    ("draft ids / accepted staging", "graphdraft.runtime.drafter:EagleDrafter",
     "_prepare_mixed_ids"),
    ("commit", "graphdraft.serving.cycles.base:DecodeMode", "commit"),
)


def phase_times(engine, prompts, params, c: int, n: int) -> dict:
    """Host ms per mixed step (and per other step) of each phase in `PHASES` over one closed
    loop (wrappers installed for the loop only; a phase of a step counts when it ran)."""
    import importlib

    from perf.serve import closed_loop_offline

    totals: dict[str, list[float]] = {name: [0.0, 0.0] for name, _, _ in PHASES}
    kind = {"mixed": False}
    saved = []
    for name, where, attr in PHASES:
        module, _, cls = where.partition(":")
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        orig = getattr(owner, attr)

        def timed(*args, _orig=orig, _name=name, **kw):
            t0 = time.perf_counter()
            try:
                return _orig(*args, **kw)
            finally:
                totals[_name][1 if kind["mixed"] else 0] += time.perf_counter() - t0
        saved.append((owner, attr, orig))
        setattr(owner, attr, timed)
    step = engine.step
    counts = [0, 0]

    def classified_step():
        kind["mixed"] = bool(engine.waiting) or any(r.prefilling for r in engine.running)
        counts[kind["mixed"]] += 1
        return step()
    engine.step = classified_step
    try:
        closed_loop_offline(engine, prompts, params, c, n)
    finally:
        engine.step = step
        for owner, attr, orig in saved:
            setattr(owner, attr, orig)
    return {"concurrency": c, "requests": n, "mixed_steps": counts[1], "other_steps": counts[0],
            "mixed_ms": {k: round(1e3 * v[1] / max(1, counts[1]), 3) for k, v in totals.items()},
            "other_ms": {k: round(1e3 * v[0] / max(1, counts[0]), 3) for k, v in totals.items()}}


def profile_counts(engine, prompts, params, c: int, n: int) -> dict:
    """Host syncs, copies and launches of one closed loop (torch profiler), per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from perf.serve import closed_loop_offline

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = closed_loop_offline(engine, prompts, params, c, n)
        torch.cuda.synchronize()
    counts = {v: 0 for v in PROFILE_KEYS.values()}
    for e in prof.key_averages():
        if e.key in PROFILE_KEYS:
            counts[PROFILE_KEYS[e.key]] += e.count
    return {"concurrency": c, "requests": n, "steps": r["steps"],
            "mixed_steps": r["mixed_steps"], **counts}


def write_cprofile(engine, prompts, params, c: int, n: int, path: Path, top: int = 70) -> None:
    """One closed loop under cProfile; `path` gets the `top` functions by own time, then by
    cumulative time (host time: where the Python of a step goes)."""
    import cProfile
    import io
    import pstats

    from perf.serve import closed_loop_offline

    prof = cProfile.Profile()
    prof.runcall(closed_loop_offline, engine, prompts, params, c, n)
    buf = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(buf.getvalue())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="perf/out")
    p.add_argument("--name", default="mixed_step.json")
    p.add_argument("--levels", default="8,32,128")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tiny", action="store_true", help="a CPU check of the script")
    p.add_argument("--cprofile", metavar="TXT", help="also one closed loop at the largest level "
                   "under cProfile: the top functions by own and by cumulative time into TXT")
    p.add_argument("server_flags", nargs=argparse.REMAINDER,
                   help="after --: `graphdraft serve` flags for the Engine")
    a = p.parse_args(argv)
    flags = [f for f in a.server_flags if f != "--"]
    if a.tiny:
        a.levels, a.requests, a.reps, a.max_tokens, a.prompt_tokens = "2", 4, 1, 4, 16
        flags = ["--device", "cpu", "--max-running-requests", "4", *flags]
    elif not flags:
        flags = ["--max-running-requests", "128"]
    levels = [int(x) for x in a.levels.split(",")]

    from graphdraft.io.tokenizer import load_tokenizer
    from graphdraft.serving.cli import build_parser
    from graphdraft.serving.cli.models import SHIPPED_TARGET
    from graphdraft.serving.cli.serve import build_engine
    from graphdraft.serving.verify import SamplingParams
    from perf.serve import PROMPTS, closed_loop_offline, load_prompts

    engine, _ = build_engine(build_parser().parse_args(["serve", *flags]))
    target = next((flags[i + 1] for i, f in enumerate(flags) if f == "--target"),
                  str(SHIPPED_TARGET))
    prompts = load_prompts(load_tokenizer(target), Path(PROMPTS), a.prompt_tokens)
    params = SamplingParams(max_new_tokens=a.max_tokens, ignore_eos=True)
    closed_loop_offline(engine, prompts, params, max(levels), a.requests)  # warm-up
    report = {"flags": flags, "max_tokens": a.max_tokens, "prompt_tokens": a.prompt_tokens,
              "rows": []}
    for c in levels:
        row = measure(engine, prompts, params, c, a.requests, a.reps)
        report["rows"].append(row)
        print(f"c={c:>3}: {row['tps']:>9,.0f} tok/s; mixed step {row['mixed_step_ms']:.2f} ms "
              f"host ({row['mixed_steps']} of {row['steps']} steps), other step "
              f"{row['other_step_ms']:.2f} ms", flush=True)
    report["phases"] = [phase_times(engine, prompts, params, c, a.requests) for c in levels]
    for ph in report["phases"]:
        print(f"c={ph['concurrency']:>3} phases, host ms per mixed step ({ph['mixed_steps']}) / "
              "per other step: " + "; ".join(
                  f"{k} {ph['mixed_ms'][k]:.2f} / {ph['other_ms'][k]:.2f}" for k in ph["mixed_ms"]),
              flush=True)
    if a.cprofile:
        write_cprofile(engine, prompts, params, max(levels), a.requests, Path(a.cprofile))
    if engine.device.type == "cuda":
        import torch
        report["device"] = torch.cuda.get_device_name()
        report["profile"] = profile_counts(engine, prompts, params, levels[0], 32)
        print("profile:", report["profile"], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / a.name).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
