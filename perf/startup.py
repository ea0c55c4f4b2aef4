"""Start-up from a checkpoint on disk: the weights read while the kernels compile, against
reading them first.

    python3 -m perf.startup --out DIR [--max-bs 64] [--repeats 2] [--tmp DIR]

The parent writes the Llama-3.1-8B-shaped pair (`perf.models_8b.build_pair`, random bf16
weights, about 16 GB in 5 GB shards, as a Hugging Face export is) into a temporary folder
under `--tmp`, flushes it to disk, then runs fresh subprocesses, alternated, `--repeats`
times each:

  overlap     `open_model_pair` -> `Engine` ->
              `engine.start_precompile(meanwhile=weights.read)` (the read beside the
              compile phase's plan and workers) -> `engine.capture_graphs()` (the CLI's way)
  sequential  `load_model_pair` -> `Engine` -> `engine.capture_graphs()`

each with an empty `TRITON_CACHE_DIR` and the checkpoint's pages dropped from the page cache
first (`posix_fadvise(DONTNEED)` on every file: read from the disk as on a fresh machine;
`page_cache_dropped` says whether the call was accepted). The engine: `cuda_graph_max_bs` =
`max_running_requests` = `--max-bs`, `max_context_len` 1024, the default precompile workers.

Per run: `open_s` (configs, headers, modules built), `read_s` (the tensors), `engine_s`,
`start_and_read_s` (overlap: the phase's start and the read beside it), `capture_s`,
`total_s` (from the first open to the last capture), `process_wall_s`. Writes
`DIR/startup.json`: `cold_overlap_s`, `cold_sequential_s` (medians of `total_s`), `overlap_over_sequential`, `read_s` (median of
the sequential runs' read), `checkpoint_gb`, `runs`. Needs CUDA and about 40 GB of disk;
a few minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("overlap", "sequential")


def child(mode: str, ckpt: Path, max_bs: int, result: Path, device: str = "cuda",
          dtype: str = "bfloat16", max_context_len: int = 1024) -> None:
    """One start-up in this process (`TRITON_CACHE_DIR` set by the parent, empty)."""
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    from graphdraft.config import RuntimeConfig
    from graphdraft.io.checkpoint import load_model_pair, open_model_pair
    from graphdraft.serving.engine import Engine
    from graphdraft.startup.warmup import worker_report

    cfg = RuntimeConfig(cuda_graph_max_bs=max_bs, max_running_requests=max_bs,
                        max_context_len=max_context_len, device=device, dtype=dtype)
    target_dir, head_dir = ckpt / "target", ckpt / "eagle3"
    t0 = time.perf_counter()
    out = {"mode": mode}
    if mode == "overlap":
        target, head, _, weights = open_model_pair(target_dir, head_dir, cfg.dtype, cfg.device)
        t1 = time.perf_counter()
        engine = Engine(target, cfg, head)
        t2 = time.perf_counter()
        out["started"] = engine.start_precompile(meanwhile=weights.read)
        sync()
        t4 = time.perf_counter()
        out.update(open_s=t1 - t0, engine_s=t2 - t1, read_s=weights.read_s,
                   start_and_read_s=t4 - t2)
    else:
        target, head, _ = load_model_pair(target_dir, head_dir, cfg.dtype, cfg.device)
        sync()
        t1 = time.perf_counter()
        engine = Engine(target, cfg, head)
        t4 = time.perf_counter()
        out.update(read_s=t1 - t0, engine_s=t4 - t1)
    engine.capture_graphs()
    sync()
    t5 = time.perf_counter()
    out.update(capture_s=t5 - t4, total_s=t5 - t0)
    report = worker_report(engine)
    if report is not None:
        out["worker_phase"] = {"workers": report.workers, "keys": report.keys,
                               "built": report.total_built, "wall_s": report.wall_s,
                               "skipped": report.skipped}
    result.write_text(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in out.items()}))


def write_checkpoint(root: Path) -> float:
    """The 8B-shaped pair as checkpoints `root/target`, `root/eagle3`, flushed to disk;
    returns their size in GB."""
    import torch

    from graphdraft.io.checkpoint import save_eagle3_head, save_target
    from perf.models_8b import build_pair

    target, head = build_pair("cuda")
    save_target(target, root / "target", max_shard_bytes=5 * 10**9)
    save_eagle3_head(head, root / "eagle3")  # shares the target's embedding: not stored
    del target, head
    torch.cuda.empty_cache()
    files = sorted(root.rglob("*.safetensors"))
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return sum(f.stat().st_size for f in files) / 1e9


def drop_page_cache(root: Path) -> bool:
    """Ask the kernel to drop the checkpoint's (clean) pages; whether every call was accepted."""
    ok = hasattr(os, "posix_fadvise")
    for f in sorted(root.rglob("*.safetensors")) if ok else []:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def _spawn(mode: str, ckpt: Path, max_bs: int, work: Path, tag: str, timeout_s: float) -> dict:
    cache = work / f"triton-{tag}"
    cache.mkdir()
    result = work / f"{tag}.json"
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    env.pop("GRAPHDRAFT_PRECOMPILE_WORKERS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    dropped = drop_page_cache(ckpt)
    cmd = [sys.executable, "-m", "perf.startup", "--child", mode, "--ckpt", str(ckpt),
           "--max-bs", str(max_bs), "--result", str(result)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=root, timeout=timeout_s, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"start-up run {tag} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    data = json.loads(result.read_text())
    data.update(process_wall_s=round(wall, 2), page_cache_dropped=dropped)
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for startup.json")
    ap.add_argument("--max-bs", type=int, default=64, help="the schedule's top")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternated")
    ap.add_argument("--tmp", type=Path, default=None,
                    help="where the checkpoint is written (default: the system's temp folder)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per subprocess")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.ckpt, a.max_bs, a.result)
        return 0
    if a.out is None:
        ap.error("--out: expected a folder for startup.json")
    if a.repeats < 1:
        ap.error(f"--repeats: expected an int >= 1, got {a.repeats}")
    import torch

    if not torch.cuda.is_available():
        print("perf.startup: needs CUDA", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="graphdraft-startup-", dir=a.tmp) as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        gb = write_checkpoint(work / "ckpt")
        print(f"checkpoint: {gb:.1f} GB written in {time.perf_counter() - t0:.1f} s", flush=True)
        runs = {}
        for i in range(a.repeats):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                tag = f"{mode}-{i + 1}"
                runs[tag] = r = _spawn(mode, work / "ckpt", a.max_bs, work, tag, a.timeout)
                print(f"{tag:<13} total {r['total_s']:6.2f} s: read {r['read_s']:5.2f}, "
                      f"capture {r['capture_s']:5.2f} (process {r['process_wall_s']:.1f} s)",
                      flush=True)
    med = {m: statistics.median(r["total_s"] for r in runs.values() if r["mode"] == m)
           for m in MODES}
    res = {"max_bs": a.max_bs, "checkpoint_gb": round(gb, 2),
           "cold_overlap_s": round(med["overlap"], 3),
           "cold_sequential_s": round(med["sequential"], 3),
           "overlap_over_sequential": round(med["overlap"] / med["sequential"], 3),
           "read_s": round(statistics.median(r["read_s"] for r in runs.values()
                                             if r["mode"] == "sequential"), 3),
           "runs": runs}
    (a.out / "startup.json").write_text(json.dumps(res, indent=1))
    print(f"cold start from disk, schedule to {a.max_bs}: weights read while compiling "
          f"{res['cold_overlap_s']:.2f} s, read then compile {res['cold_sequential_s']:.2f} s "
          f"({res['overlap_over_sequential']:.2f}x); the read alone {res['read_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
