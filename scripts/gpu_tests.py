"""Run the `gpu`-marked tests in several pytest processes at once on one GPU.

Most of a cold `make test-gpu` is Triton compiling on the host (one core per process), not
GPU work, so shards finish in about 1/N of the time. The tests are collected once
(`pytest --collect-only -m gpu`), dealt round-robin to `--shards` processes (neighbouring
parametrizations of one heavy test land in different shards), and each shard's output goes to
`--log-dir/shard<i>.txt`. Exit code: 0 when every shard passed (or had nothing to run), else
the first failing shard's code. Timing-sensitive checks do not belong in `gpu` tests (they are
`make perf`'s), so sharing the GPU changes no result.

Usage (from the repo root): `python3 scripts/gpu_tests.py --shards 3 [--log-dir DIR] [-- pytest args]`
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]


def collect(extra: list[str]) -> list[str]:
    """Node ids of the selected `gpu` tests (empty when none)."""
    out = subprocess.run(PYTEST + ["--collect-only", "-q", "-m", "gpu", *extra, "tests"],
                         cwd=ROOT, capture_output=True, text=True)
    if out.returncode not in (0, 5):  # 5: nothing collected
        sys.stdout.write(out.stdout + out.stderr)
        raise SystemExit(out.returncode)
    return [line.strip() for line in out.stdout.splitlines() if "::" in line and " " not in line.strip()]


def deal(nodes: list[str], shards: int) -> list[list[str]]:
    """Round-robin over the collected order: `[shards][...]` node ids, none empty."""
    parts = [nodes[i::shards] for i in range(shards)]
    return [p for p in parts if p]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=3, help="pytest processes at once (>= 1)")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "perf" / "out" / "gpu-tests")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    a = ap.parse_args(argv)
    if a.shards < 1:
        ap.error(f"--shards: expected an integer >= 1, got {a.shards}")
    nodes = collect(a.pytest_args)
    if not nodes:
        print("no gpu tests collected")
        return 0
    a.log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = []
    for i, part in enumerate(deal(nodes, a.shards)):
        log = open(a.log_dir / f"shard{i}.txt", "w")  # noqa: SIM115 (closed below)
        cmd = PYTEST + ["-q", "-rfE", "-m", "gpu", *a.pytest_args, *part]
        procs.append((i, len(part), log, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                                          stderr=subprocess.STDOUT)))
    rc = 0
    for i, n, log, p in procs:
        code = p.wait()
        log.close()
        lines = (a.log_dir / f"shard{i}.txt").read_text().splitlines()
        tail = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))] + lines[-1:]
        print(f"shard {i} ({n} tests): exit {code}")
        for ln in tail:
            print(f"  {ln}")
        if code != 0 and rc == 0:
            rc = code
    print(f"gpu tests: {len(nodes)} in {len(procs)} shards, exit {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
