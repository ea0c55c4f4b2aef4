"""Start-up cost: capturing the 8B-shaped engine's CUDA graphs on a fresh machine and warm.

    python3 -m perf.capture --out DIR [--max-bs 64,160] [--workers N]

For each schedule top (`--max-bs`, default 64 and 160) a fresh subprocess with an empty
temporary `TRITON_CACHE_DIR` builds the Llama-3.1-8B-shaped target and its EAGLE-3 head
(`perf.models_8b.build_pair`, random weights), an `Engine` (`cuda_graph_max_bs` =
`max_running_requests` = the top, `max_context_len` 1024: a small KV pool) and times
`engine.capture_graphs()` (the default configuration: cycle graphs per draft length and the
draft multi-step, the cost table timed at the end) with the default precompile workers
(`--workers`, default: `RuntimeConfig.precompile_workers` None: `config.PRECOMPILE_WORKERS_DEFAULT`); then a
second subprocess does the same with that cache warm (`--warm-repeats` times, default 3:
`warm_s` is the median), and for the first top, alternated with those, the same with every
bucket warmed up (the marker's list of first-launch sizes hidden: `warm_every_bucket_s`, the
A/B of the minimal warm-up set on one instance). For the first top also a cold run with
`precompile_workers=0` (everything compiled in the one process, in its own empty cache).

Per run: capture seconds, the worker phase (processes, wall seconds, each worker's wall
seconds), kernels Triton's compiler built in this process (`GraphStats.built`: cache misses)
and in the workers (`GraphStats.worker_built`), specializations loaded or built in this
process (`capture.triton_compiles`), new entries of the on-disk cache, and per captured forward
(`graphdraft.startup.forwards.forwards`: its key `[family, k]`) its sizes, seconds, compiles
and pool MiB.

Writes `DIR/capture.json`: `cold_s`, `warm_s`, `triton_compiles_cold` (kernels built anywhere,
this process and its workers, for the cold run with workers), `sizes`, `pool_mib`,
`per_forward` for the schedule to the first top (the issue's goals: cold <= 5 s, warm <= 2 s,
<= 30 compiles), the in-process cold run's `cold_inprocess_s` / `triton_compiles_cold_inprocess`,
the worker phase, and `runs` with every run (`cold-64-inprocess`, `cold-64`, `warm-64`,
`cold-160`, `warm-160`). Also `census_keys` (the distinct Triton keys of the schedule: the
plan's dry run, `perf/compile_census.py`), `plan_s`, `compiled_here_in_phase`,
`longest_compiles`, `host` (`host_info`: CPU model, count and a Python loop's seconds,
since hosts differ), and per run a `breakdown` of capture_graphs' seconds (precompile and its
worker phase; per captured size the warm-up runs, the capture itself and the first replay
that uploads and times it; the cost table's timing; counts of graphs, warm-up runs and cost
replays): `warm_breakdown` says where a warm start goes. The cold run's phase timeline
(`WorkerReport.timeline()`): `plan_events`, `worker_ready_s`, `timeline` ([kernel, start,
seconds, its launcher's build seconds] since the phase began), `gate_waits`, and
`compile_s_sum` / `launcher_s_sum` (every compile's seconds, and of them the host launchers'
C builds). Prints the tables. Needs CUDA; well
under a minute per run on an H200.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOALS = {"cold_s": 5.0, "warm_s": 2.0, "triton_compiles_cold": 30}
_MiB = float(1 << 20)


def child(max_bs: int, result: Path, workers: int | None = None) -> None:
    """One run in this process (TRITON_CACHE_DIR already set by the parent): times
    `engine.capture_graphs(precompile_workers=workers)` (None: the config's default)."""
    import torch

    from capture import cache_dir, cache_entries, triton_compiles
    from capture.compiles import builds_counted, triton_builds
    from graphdraft.config import RuntimeConfig
    from graphdraft.serving.engine import CAPTURE_COST_REPLAYS, Engine
    from graphdraft.startup.forwards import forwards
    from graphdraft.startup.spec import default_workers
    from graphdraft.startup.warmup import worker_report
    from perf.models_8b import build_pair

    t_start = time.perf_counter()
    triton_compiles()  # install the counting hooks before any kernel runs
    target, head = build_pair("cuda")
    cfg = RuntimeConfig(cuda_graph_max_bs=max_bs, max_running_requests=max_bs,
                        max_context_len=1024, device="cuda", precompile_workers=workers)
    engine = Engine(target, cfg, head)
    torch.cuda.synchronize()
    t_built = time.perf_counter()
    c0, b0, e0 = triton_compiles(), triton_builds(), cache_entries()
    prof_dir = os.environ.get("GRAPHDRAFT_CAPTURE_PROFILE")  # `--profile DIR`
    prof = None
    if prof_dir:
        import cProfile

        prof = cProfile.Profile()
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    engine.capture_graphs()
    torch.cuda.synchronize()
    if prof is not None:
        import io
        import pstats

        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(60)
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
        Path(prof_dir).mkdir(parents=True, exist_ok=True)
        (Path(prof_dir) / f"{result.stem}.txt").write_text(buf.getvalue())
    seconds = time.perf_counter() - t0
    per_forward = {}
    warm = {"warmup_s": 0.0, "record_s": 0.0, "replay_timing_s": 0.0, "warmup_runs": 0,
            "graphs": 0}
    for key, f in forwards(engine):
        st = f.stats
        # per size: warm-up (`warmup_iters` eager runs; eager_seconds is the last one), the
        # capture itself, its first replay (uploads the graph; replay_seconds)
        w = sum(st.eager_seconds.values()) * f.warmup_iters
        r = sum(st.replay_seconds.values())
        warm["warmup_s"] += w
        warm["replay_timing_s"] += r
        warm["record_s"] += max(0.0, st.total_capture_seconds - w - r)
        warm["warmup_runs"] += f.warmup_iters * len(st.eager_seconds)  # warmed-up sizes
        warm["graphs"] += len(f.captured_sizes)
        per_forward[f.name] = {
            "key": list(key),
            "sizes": f.captured_sizes,
            "capture_s": round(st.total_capture_seconds, 4),
            "precompile_s": round(st.total_precompile_seconds, 4),
            "compiles": st.total_compiles,
            "built": st.total_built,
            "worker_built": st.total_worker_built,
            "compiles_per_size": {str(bs): n for bs, n in sorted(st.compiles.items())},
            "capture_s_per_size": {str(bs): round(s, 4) for bs, s in sorted(st.capture_seconds.items())},
            "pool_mib": round(st.total_pool_bytes / _MiB, 2),
            "summary": st.summary(),
        }
    rep = worker_report(engine)
    phases = dict(getattr(engine, "capture_phases", {}))
    costs = getattr(engine.policy, "costs", None)
    cost_cells = len(costs.measured()) if hasattr(costs, "measured") else 0
    breakdown = {  # seconds per phase of capture_graphs (the warm run's "where it goes")
        "precompile_s": round(phases.get("precompile_s", 0.0), 3),
        "worker_phase_s": round(rep.wall_s, 3) if rep is not None else 0.0,
        "capture_s": round(phases.get("capture_s", 0.0), 3),
        "capture_warmup_s": round(warm["warmup_s"], 3),
        "capture_record_s": round(warm["record_s"], 3),
        "capture_replay_timing_s": round(warm["replay_timing_s"], 3),
        "cost_table_s": round(phases.get("costs_s", 0.0), 3),
        "compile_tail_s": round(phases.get("compile_tail_s", 0.0), 3),
        "other_s": round(seconds - sum(phases.values()), 3) if phases else None,
        "graphs": warm["graphs"],
        "warmup_runs": warm["warmup_runs"],
        "cost_cells": cost_cells,
        # measure_costs: warmup 0, CAPTURE_COST_REPLAYS each; none when the table was cached
        "cost_replays": 0 if engine.cost_source == "cached" else CAPTURE_COST_REPLAYS * cost_cells,
        "cost_source": engine.cost_source,
    }
    built_here = triton_builds() - b0  # this process's builds, its worker-phase share included
    worker_built = (rep.total_built - rep.built_here) if rep is not None else 0
    new_entries = cache_entries() - e0
    data = {
        "max_bs": max_bs,
        "workers_asked": default_workers(engine.cfg),
        "workers": rep.workers if rep is not None else 0,
        "workers_skipped": rep.skipped if rep is not None else "precompile_workers=0",
        "worker_phase_s": round(rep.wall_s, 3) if rep is not None else 0.0,
        "worker_wall_s": rep.worker_wall_s if rep is not None else [],
        "worker_startup_s": rep.worker_startup_s if rep is not None else [],
        "worker_tasks": rep.tasks if rep is not None else 0,
        "worker_plan_wait_s": rep.worker_plan_wait_s if rep is not None else [],
        "worker_compiled": rep.compiled if rep is not None else [],
        "plan_s": round(rep.plan_s, 3) if rep is not None else 0.0,
        # the ten longest compiles of the phase ([kernel, seconds]: the critical path's part)
        "longest_compiles": [x[:2] for x in sorted(rep.compile_s, key=lambda x: -x[1])[:10]]
        if rep else [],
        # of every compile's seconds in the phase, those of the host launchers' C builds
        "compile_s_sum": round(sum(x[1] for x in rep.compile_s), 3) if rep else 0.0,
        "launcher_s_sum": round(sum(x[3] for x in rep.compile_s if len(x) > 3), 3) if rep else 0.0,
        # the phase's timeline (seconds since it began): the plan's events, each worker's
        # start, every compile [kernel, start, seconds], each capture gate that waited
        "plan_events": rep.plan_events if rep is not None else [],
        "worker_ready_s": rep.worker_ready_s if rep is not None else [],
        "timeline": rep.timeline() if rep is not None else [],
        "gate_waits": rep.gate_waits if rep is not None else [],
        "compiled_here_in_phase": rep.compiled_here if rep is not None else 0,
        "built_here_in_phase": rep.built_here if rep is not None else 0,
        # distinct specialization keys of the schedule (the workers' dry run; = the census
        # total, `perf/compile_census.py`); 0 without a worker phase
        "census_keys": rep.keys if rep is not None else 0,
        "pass_built": rep.pass_built if rep is not None else None,
        "breakdown": breakdown,
        "precompile_s": round(sum(v["precompile_s"] for v in per_forward.values()), 4),
        "capture_s": round(seconds, 4),
        "build_s": round(t_built - t_start, 2),
        "triton_compiles": triton_compiles() - c0,
        "built_here": built_here,
        "built_in_workers": worker_built,
        "builds_counted": builds_counted(),
        # kernels Triton compiled anywhere for this capture (without the listener: new entries)
        "triton_compiles_total": (built_here + worker_built) if builds_counted() else new_entries,
        "cache_entries_new": new_entries,
        "cache_dir": str(cache_dir()),
        "sizes": sorted({bs for v in per_forward.values() for bs in v["sizes"]}),
        "pool_mib": round(sum(v["pool_mib"] for v in per_forward.values()), 2),
        "per_forward": per_forward,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
    }
    result.write_text(json.dumps(data, indent=1))


def timeline_lines(out: dict) -> str:
    """The cold run's phase as text: the plan's events, the workers' start, the compiles by
    start (kernel, start, end) and the gates that waited, in seconds since the phase began."""
    lines = [f"\ncold phase timeline (s since it began; plan {out.get('plan_s', 0.0):.2f} s):"]
    ev = out.get("plan_events") or []
    emits = [t for name, t, _ in ev if name == "emit"]
    marks = {name: t for name, t, _ in ev if name != "emit"}
    ready = out.get("worker_ready_s") or []
    lines.append(f"  server {marks.get('server', float('nan')):.2f}, header "
                 f"{marks.get('header', float('nan')):.2f}, workers ready "
                 f"{min(ready, default=float('nan')):.2f}-{max(ready, default=float('nan')):.2f}, "
                 f"engine {marks.get('engine', float('nan')):.2f}, probes "
                 f"{marks.get('probes', float('nan')):.2f}, first emit {min(emits, default=float('nan')):.2f}, "
                 f"{len(emits)} emits, plan end {marks.get('end', float('nan')):.2f}")
    if out.get("compile_s_sum"):
        lines.append(f"  compiles: {out['compile_s_sum']:.2f} s in all (every process), of it the "
                     f"host launchers' C builds {out.get('launcher_s_sum', 0.0):.2f} s")
    for kernel, start, sec, *launcher in out.get("timeline") or []:
        lines.append(f"  {start:6.2f} -> {start + sec:6.2f}  {kernel}"
                     + (f" (launcher {launcher[0]:.2f})" if launcher else ""))
    for index, task, start, waited in out.get("gate_waits") or []:
        lines.append(f"  gate {index} {'/'.join(map(str, task))}: {start:.2f} + {waited:.2f}")
    return "\n".join(lines)


def _spawn(max_bs: int, cache: Path, result: Path, timeout_s: float,
           workers: int | None = None) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    env.pop("GRAPHDRAFT_PRECOMPILE_WORKERS", None)  # the run's own count (or the default)
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "perf.capture", "--child", str(max_bs), "--result", str(result)]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=root, timeout=timeout_s, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"capture run max_bs={max_bs} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    data = json.loads(result.read_text())
    data["process_wall_s"] = round(wall, 2)
    return data


@contextlib.contextmanager
def _every_bucket_warmup(cache: Path):
    """While active, the warm markers in `cache` hold no list of the sizes that must warm
    up (`startup.marker.warmup_tasks`), so a warm start warms up every bucket; yields
    how many markers had one. Restored after."""
    saved = {}
    for marker in cache.glob("graphdraft-precompiled-*.json"):
        data = json.loads(marker.read_text())
        if "warmup" in data:
            saved[marker] = marker.read_text()
            marker.write_text(json.dumps({k: v for k, v in data.items() if k != "warmup"}))
    try:
        yield len(saved)
    finally:
        for marker, text in saved.items():
            marker.write_text(text)


def host_info(loops: int = 3) -> dict:
    """The host the runs ran on: CPU model and count, and `python_loop_s`, the median seconds
    of a fixed pure-Python loop (2e6 iterations). Start-up is mostly host work (compiles,
    launches under capture), and hosts of one GPU kind differ by 2x: this says which."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    times = []
    for _ in range(loops):
        t0 = time.perf_counter()
        acc = 0
        for i in range(2_000_000):
            acc += i & 7
        times.append(time.perf_counter() - t0)
    return {"cpu_model": model, "cpu_count": os.cpu_count(),
            "python_loop_s": round(statistics.median(times), 4)}


def _capture_seconds(runs: dict, name: str) -> list[float]:
    """capture_s of run `name` and its repeats (`name-r2`, ...) that did not fail."""
    return [r["capture_s"] for k, r in runs.items()
            if (k == name or re.fullmatch(re.escape(name) + r"-r\d+", k)) and "error" not in r]


def _row(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name:<18} failed (see capture.json)"
    return (f"{name:<18} {r['workers']:>7} {r['capture_s']:>9.2f} {r['worker_phase_s']:>8.2f} "
            f"{r['built_here']:>10} {r['built_in_workers']:>9} {r['cache_entries_new']:>7} "
            f"{r['pool_mib']:>8.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for capture.json")
    ap.add_argument("--max-bs", default="64,160", help="schedule tops, comma-separated (first: the headline)")
    ap.add_argument("--workers", type=int, default=None,
                    help="precompile workers of the cold runs (default: the config's default)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per subprocess")
    ap.add_argument("--warm-repeats", type=int, default=3,
                    help="warm runs per top (the median is warm_s), alternated with the "
                         "every-bucket A/B run for the first top")
    ap.add_argument("--skip-inprocess", action="store_true",
                    help="no cold run with precompile_workers=0 (about 30 s on an H200)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="folder for a cProfile of each run's capture_graphs (a diagnostic: "
                         "it slows the runs)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        child(args.child, args.result, args.workers)
        return 0
    if args.out is None:
        ap.error("--out DIR is required")
    if args.workers is not None and args.workers < 0:
        ap.error(f"--workers: expected an int >= 0, got {args.workers}")
    tops = [int(x) for x in args.max_bs.split(",") if x.strip()]
    if not tops or min(tops) < 1:
        ap.error(f"--max-bs: expected positive ints, got {args.max_bs!r}")
    if args.warm_repeats < 1:
        ap.error(f"--warm-repeats: expected an int >= 1, got {args.warm_repeats}")
    runs: dict[str, dict] = {}
    if args.profile is not None:
        os.environ["GRAPHDRAFT_CAPTURE_PROFILE"] = str(args.profile.resolve())

    def run(name: str, top: int, cache: Path, workers: int | None, required: bool) -> None:
        try:
            runs[name] = _spawn(top, cache, cache.parent / f"{name}.json", args.timeout, workers)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            if required:
                raise
            runs[name] = {"error": str(e)[-4000:]}  # reported, not fatal
            print(f"{name} failed: {str(e)[:400]}", flush=True)
            return
        r = runs[name]
        print(f"{name}: capture {r['capture_s']:.2f}s ({r['workers']} workers, phase "
              f"{r['worker_phase_s']:.2f}s), built {r['built_here']} here + "
              f"{r['built_in_workers']} in workers, {r['cache_entries_new']} new cache entries",
              flush=True)

    with tempfile.TemporaryDirectory(prefix="graphdraft-capture-") as tmp:
        for top in tops:
            if top == tops[0] and not args.skip_inprocess:  # all in one process, own cache
                solo = Path(tmp) / f"triton-cache-{top}-inprocess"
                solo.mkdir()
                run(f"cold-{top}-inprocess", top, solo, 0, required=False)
            cache = Path(tmp) / f"triton-cache-{top}"
            cache.mkdir()
            run(f"cold-{top}", top, cache, args.workers, required=True)
            for i in range(args.warm_repeats):  # alternated: the A/B sees the same drift
                sfx = "" if i == 0 else f"-r{i + 1}"
                run(f"warm-{top}{sfx}", top, cache, args.workers, required=True)
                if top == tops[0]:  # A/B in one run: the same warm start, every bucket warmed up
                    with _every_bucket_warmup(cache) as stripped:
                        if stripped:
                            run(f"warm-{top}-every-bucket{sfx}", top, cache, args.workers,
                                required=False)
    head_cold, head_warm = runs[f"cold-{tops[0]}"], runs[f"warm-{tops[0]}"]
    warm_s = _capture_seconds(runs, f"warm-{tops[0]}")
    every_s = _capture_seconds(runs, f"warm-{tops[0]}-every-bucket")
    solo = runs.get(f"cold-{tops[0]}-inprocess", {})
    out = {
        "max_bs": tops[0],
        "host": host_info(),
        "cold_s": head_cold["capture_s"],
        # the median of the `--warm-repeats` warm runs (each in `warm_s_runs`)
        "warm_s": statistics.median(warm_s),
        "warm_s_runs": warm_s,
        # the same warm start with every bucket warmed up (the marker's list hidden): A/B
        "warm_every_bucket_s": statistics.median(every_s) if every_s else None,
        "warm_every_bucket_s_runs": every_s,
        "triton_compiles_cold": head_cold["triton_compiles_total"],
        "triton_compiles_cold_here": head_cold["built_here"],
        "triton_compiles_cold_workers": head_cold["built_in_workers"],
        "cache_entries_cold": head_cold["cache_entries_new"],
        "workers": head_cold["workers"],
        "worker_phase_s": head_cold["worker_phase_s"],
        "worker_wall_s": head_cold["worker_wall_s"],
        "worker_startup_s": head_cold.get("worker_startup_s", []),
        "worker_plan_wait_s": head_cold.get("worker_plan_wait_s", []),
        "worker_compiled": head_cold.get("worker_compiled", []),
        "plan_s": head_cold.get("plan_s", 0.0),
        "compiled_here_in_phase": head_cold.get("compiled_here_in_phase", 0),
        "longest_compiles": head_cold.get("longest_compiles", []),
        "compile_s_sum": head_cold.get("compile_s_sum", 0.0),
        "launcher_s_sum": head_cold.get("launcher_s_sum", 0.0),
        "plan_events": head_cold.get("plan_events", []),
        "worker_ready_s": head_cold.get("worker_ready_s", []),
        "timeline": head_cold.get("timeline", []),
        "gate_waits": head_cold.get("gate_waits", []),
        # distinct Triton keys the schedule needs (the compile census), and what the warm run
        # loaded in-process (the same keys, when nothing is missing)
        "census_keys": head_cold.get("census_keys", 0),
        "census_keys_loaded_warm": head_warm.get("triton_compiles"),
        "warm_breakdown": head_warm.get("breakdown", {}),
        "cold_breakdown": head_cold.get("breakdown", {}),
        "cold_inprocess_s": solo.get("capture_s"),
        # whole subprocess: interpreter start, imports, 8B weights built on the GPU, capture
        "cold_process_wall_s": head_cold.get("process_wall_s"),
        "warm_process_wall_s": head_warm.get("process_wall_s"),
        "cold_build_s": head_cold.get("build_s"),
        "triton_compiles_cold_inprocess": solo.get("triton_compiles_total"),
        "sizes": head_cold["sizes"],
        "pool_mib": head_cold["pool_mib"],
        "per_forward": {name: {k: v for k, v in f.items() if k != "summary"}
                        for name, f in head_cold["per_forward"].items()},
        "goals": GOALS,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "capture.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"\n{'run':<18} {'workers':>7} {'capture s':>9} {'phase s':>8} {'built here':>10} "
          f"{'workers +':>9} {'cache +':>7} {'pool MiB':>8}")
    for name, r in runs.items():
        print(_row(name, r))
    print(f"\nper forward (cold, to {tops[0]}): capture s / compiles loaded or built / "
          "built here / built in workers")
    for k, v in head_cold["per_forward"].items():
        print(f"  {k:<20} {v['capture_s']:>6.2f} / {v['compiles']:>3} / {v['built']:>3} / "
              f"{v['worker_built']:>3}  sizes {v['sizes']}")
    print("\nwhere capture_graphs' seconds go (s): precompile (worker phase) / capture: warm-up, "
          "record, replay timing / cost table / wait for the phase's end / other; graphs, warm-up runs, "
          "cost replays")
    for name, r in runs.items():
        b = r.get("breakdown")
        if not b:
            continue
        print(f"  {name:<18} {b['precompile_s']:>5.2f} ({b['worker_phase_s']:>5.2f}) / "
              f"{b['capture_s']:>5.2f}: {b['capture_warmup_s']:>5.2f} {b['capture_record_s']:>5.2f} "
              f"{b['capture_replay_timing_s']:>5.2f} / {b['cost_table_s']:>5.2f} / "
              f"{b.get('compile_tail_s', 0.0):>5.2f} / "
              f"{b['other_s'] if b['other_s'] is not None else float('nan'):>5.2f}; "
              f"{b['graphs']} graphs, {b['warmup_runs']} warm-ups, {b['cost_replays']} cost replays")
    print(timeline_lines(out))
    print(f"census: {out['census_keys']} distinct keys (the plan's dry run), "
          f"{out['census_keys_loaded_warm']} loaded by the warm run")
    print(f"goals (schedule to {tops[0]}): cold <= {GOALS['cold_s']} s, warm <= {GOALS['warm_s']} s, "
          f"<= {GOALS['triton_compiles_cold']} compiles cold; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
