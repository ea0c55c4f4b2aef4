"""Start-up cost: capturing the 8B-shaped engine's CUDA graphs on a fresh machine and warm.

    python3 -m perf.capture --out DIR [--max-bs 64,160]

For each schedule top (`--max-bs`, default 64 and 160) a fresh subprocess with an empty
temporary `TRITON_CACHE_DIR` builds the Llama-3.1-8B-shaped target and its EAGLE-3 head
(`perf.models_8b.build_pair`, random weights), an `Engine` (`cuda_graph_max_bs` =
`max_running_requests` = the top, `max_context_len` 1024: a small KV pool) and times
`engine.capture_graphs()` (target verify + draft decode + multi-step, the default schedule);
then a second subprocess does the same with that cache warm. Per run: capture seconds, Triton
compiles counted in the process (`capture.triton_compiles`: new kernel specializations) and
new entries of the on-disk cache, and per captured forward of the engine (every
`CapturedForward` attribute of the engine and its drafter, found generically) its sizes,
seconds, compiles per size and pool MiB.

Writes `DIR/capture.json`: `cold_s`, `warm_s`, `triton_compiles_cold`, `sizes`, `pool_mib`,
`per_forward` for the schedule to 64 (the issue's goals: cold <= 5 s, warm <= 2 s,
<= 30 compiles), and `runs` with every run (`cold-64`, `warm-64`, `cold-160`, `warm-160`,
and `cold-64-parallel-precompile`: `capture_graphs(parallel_precompile=True)`, the JIT warm-up
in two threads, in its own empty cache; a failure there is recorded, not fatal).
Prints a table. Needs CUDA; about a minute per run on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOALS = {"cold_s": 5.0, "warm_s": 2.0, "triton_compiles_cold": 30}
_MiB = float(1 << 20)


def child(max_bs: int, result: Path, precompile: str = "serial") -> None:
    """One run in this process (TRITON_CACHE_DIR already set by the parent): times
    `engine.capture_graphs()` (its JIT warm-up `precompile_engine` included; `precompile`
    "parallel": that warm-up in two threads)."""
    import torch

    from capture import cache_dir, cache_entries, triton_compiles
    from graphdraft.config import RuntimeConfig
    from graphdraft.kernels.warmup import captured_forwards
    from graphdraft.serving.engine import Engine
    from perf.models_8b import build_pair

    t_start = time.perf_counter()
    triton_compiles()  # install the counting hook before any kernel runs
    target, head = build_pair("cuda")
    cfg = RuntimeConfig(cuda_graph_max_bs=max_bs, max_running_requests=max_bs,
                        max_context_len=1024, device="cuda")
    engine = Engine(target, cfg, head)
    torch.cuda.synchronize()
    t_built = time.perf_counter()
    c0, e0 = triton_compiles(), cache_entries()
    t0 = time.perf_counter()
    engine.capture_graphs(parallel_precompile=precompile == "parallel")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    owners = [engine] + ([engine.drafter] if getattr(engine, "drafter", None) is not None else [])
    per_forward = {}
    for attr, f in captured_forwards(*owners).items():
        st = f.stats
        per_forward[f.name] = {
            "attribute": attr,
            "sizes": f.captured_sizes,
            "capture_s": round(st.total_capture_seconds, 4),
            "precompile_s": round(st.total_precompile_seconds, 4),
            "compiles": st.total_compiles,
            "compiles_per_size": {str(bs): n for bs, n in sorted(st.compiles.items())},
            "capture_s_per_size": {str(bs): round(s, 4) for bs, s in sorted(st.capture_seconds.items())},
            "pool_mib": round(st.total_pool_bytes / _MiB, 2),
            "summary": st.summary(),
        }
    data = {
        "max_bs": max_bs,
        "precompile": precompile,
        "precompile_s": round(sum(v["precompile_s"] for v in per_forward.values()), 4),
        "capture_s": round(seconds, 4),
        "build_s": round(t_built - t_start, 2),
        "triton_compiles": triton_compiles() - c0,
        "cache_entries_new": cache_entries() - e0,
        "cache_dir": str(cache_dir()),
        "sizes": sorted({bs for v in per_forward.values() for bs in v["sizes"]}),
        "pool_mib": round(sum(v["pool_mib"] for v in per_forward.values()), 2),
        "per_forward": per_forward,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
    }
    result.write_text(json.dumps(data, indent=1))


def _spawn(max_bs: int, cache: Path, result: Path, timeout_s: float,
           precompile: str = "serial") -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "perf.capture", "--child", str(max_bs), "--result", str(result),
           "--precompile", precompile]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=root, timeout=timeout_s, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"capture run max_bs={max_bs} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    data = json.loads(result.read_text())
    data["process_wall_s"] = round(wall, 2)
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for capture.json")
    ap.add_argument("--max-bs", default="64,160", help="schedule tops, comma-separated (first: the headline)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per subprocess")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--precompile", default="serial", choices=("serial", "parallel"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        child(args.child, args.result, args.precompile)
        return 0
    if args.out is None:
        ap.error("--out DIR is required")
    tops = [int(x) for x in args.max_bs.split(",") if x.strip()]
    if not tops or min(tops) < 1:
        ap.error(f"--max-bs: expected positive ints, got {args.max_bs!r}")
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="graphdraft-capture-") as tmp:
        for top in tops:
            cache = Path(tmp) / f"triton-cache-{top}"
            cache.mkdir()
            for kind in ("cold", "warm"):
                runs[f"{kind}-{top}"] = _spawn(top, cache, Path(tmp) / f"{kind}-{top}.json",
                                               args.timeout)
                r = runs[f"{kind}-{top}"]
                print(f"{kind}-{top}: capture {r['capture_s']:.2f}s, {r['triton_compiles']} "
                      f"compiles, {r['cache_entries_new']} new cache entries", flush=True)
            if top == tops[0]:  # the threaded precompile, cold, in its own empty cache
                pcache = Path(tmp) / f"triton-cache-{top}-parallel"
                pcache.mkdir()
                try:
                    r = _spawn(top, pcache, Path(tmp) / f"parallel-{top}.json", args.timeout,
                               "parallel")
                    print(f"cold-{top}-parallel-precompile: {r['capture_s']:.2f}s "
                          f"(precompile {r['precompile_s']:.2f}s), {r['triton_compiles']} compiles",
                          flush=True)
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # reported, not fatal
                    r = {"error": str(e)[-4000:]}
                    print(f"cold-{top}-parallel-precompile failed: {str(e)[:400]}", flush=True)
                runs[f"cold-{top}-parallel-precompile"] = r
    head_cold, head_warm = runs[f"cold-{tops[0]}"], runs[f"warm-{tops[0]}"]
    out = {
        "max_bs": tops[0],
        "cold_s": head_cold["capture_s"],
        "warm_s": head_warm["capture_s"],
        "triton_compiles_cold": head_cold["triton_compiles"],
        "cache_entries_cold": head_cold["cache_entries_new"],
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
    print(f"\n{'run':<10} {'capture s':>9} {'compiles':>8} {'cache +':>7} {'pool MiB':>8}  per forward "
          "(capture s / compiles)")
    for name, r in runs.items():
        if "error" in r:
            print(f"{name:<10} failed (see capture.json)")
            continue
        fw = ", ".join(f"{k} {v['capture_s']:.2f}/{v['compiles']}" for k, v in r["per_forward"].items())
        print(f"{name:<10} {r['capture_s']:>9.2f} {r['triton_compiles']:>8} "
              f"{r['cache_entries_new']:>7} {r['pool_mib']:>8.1f}  {fw}")
    print(f"goals (schedule to {tops[0]}): cold <= {GOALS['cold_s']} s, warm <= {GOALS['warm_s']} s, "
          f"<= {GOALS['triton_compiles_cold']} compiles cold; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
