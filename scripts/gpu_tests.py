"""Run the `gpu`-marked tests in several pytest processes at once on one GPU.

Most of a cold `make test-gpu` is Triton compiling on the host (one core per process), not
GPU work, so shards finish in about 1/N of the time. The tests are collected once
(`pytest --collect-only -m gpu`), dealt round-robin to `--shards` processes (neighbouring
parametrizations of one heavy test land in different shards), and each shard's output goes to
`--log-dir/shard<i>.txt`. Exit code: 0 when every shard passed (or had nothing to run), else
the first failing shard's code. Timing-sensitive checks do not belong in `gpu` tests (they are
`make perf`'s), so sharing the GPU changes no result.

Each shard also writes `shard<i>.trace` as it goes (`scripts/gpu_trace.py`: every test's start
and outcome, each failure's report), so a shard that dies mid-run (a CUDA device-side assert
aborts the process before pytest prints its reports) still says which test it died in. Then
the tests a dead shard never started run in a fresh process (`shard<i>-rest.txt`), and up to
`--alone` failed or fatal tests run again each in a process of its own: "fails alone" or
"passes alone" (then it failed only after the tests before it in its shard).

Usage (from the repo root): `python3 scripts/gpu_tests.py --shards 3 [--log-dir DIR] [-- pytest args]`
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent  # gpu_trace.py, the plugin each shard loads
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


def read_trace(path: Path) -> tuple[list[str], dict[str, str]]:
    """A shard's trace (`gpu_trace`): the started node ids in order, and each one's outcome
    (a failed phase wins over a later one)."""
    started, outcome = [], {}
    for line in path.read_text().splitlines() if path.exists() else []:
        word, _, node = line.partition(" ")
        if word == "start":
            started.append(node)
        elif word in ("passed", "failed", "skipped") and outcome.get(node) != "failed":
            outcome[node] = word
    return started, outcome


def _run(nodes: list[str], log: Path, trace: Path | None, extra: list[str]) -> subprocess.Popen:
    """One pytest process over `nodes`, its output to `log` (and its trace to `trace`)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(SCRIPTS)]))
    if trace is not None:
        trace.unlink(missing_ok=True)
        env["GRAPHDRAFT_TEST_TRACE"] = str(trace)
    cmd = PYTEST + ["-p", "gpu_trace", "-q", "-rfE", "-m", "gpu", *extra, *nodes]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _report(i: int, n: int, code: int, log: Path) -> None:
    lines = log.read_text().splitlines()
    tail = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))] + lines[-1:]
    print(f"shard {i} ({n} tests): exit {code}")
    for ln in tail:
        print(f"  {ln}")


def follow_up(parts: list[list[str]], log_dir: Path, extra: list[str], alone: int) -> None:
    """After failing shards: a dead shard's tests it never started, in a fresh process; then up
    to `alone` failed or fatal tests each in a process of its own (reports only: the run has
    failed already)."""
    bad = []
    for i, part in enumerate(parts):
        started, outcome = read_trace(log_dir / f"shard{i}.trace")
        bad += [n for n in started if outcome.get(n, "failed") == "failed"]
        dead = [n for n in started if n not in outcome]
        rest = [n for n in part if n not in started]
        if dead:
            print(f"shard {i}: the process died in {dead[-1]}")
        if dead and rest:
            log = log_dir / f"shard{i}-rest.txt"
            code = _run(rest, log, log_dir / f"shard{i}-rest.trace", extra).wait()
            _report(i, len(rest), code, log)
            started, outcome = read_trace(log_dir / f"shard{i}-rest.trace")
            bad += [n for n in started if outcome.get(n, "failed") == "failed"]
    for j, node in enumerate(bad[:alone]):
        code = _run([node], log_dir / f"alone{j}.txt", None, extra).wait()
        print(f"alone: {node}: {'passes alone' if code == 0 else f'fails alone (exit {code})'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=3, help="pytest processes at once (>= 1)")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "perf" / "out" / "gpu-tests")
    ap.add_argument("--alone", type=int, default=3,
                    help="failed or fatal tests to run again each in its own process")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    a = ap.parse_args(argv)
    if a.shards < 1:
        ap.error(f"--shards: expected an integer >= 1, got {a.shards}")
    if a.alone < 0:
        ap.error(f"--alone: expected an integer >= 0, got {a.alone}")
    nodes = collect(a.pytest_args)
    if not nodes:
        print("no gpu tests collected")
        return 0
    a.log_dir.mkdir(parents=True, exist_ok=True)
    parts = deal(nodes, a.shards)
    procs = [_run(part, a.log_dir / f"shard{i}.txt", a.log_dir / f"shard{i}.trace",
                  a.pytest_args) for i, part in enumerate(parts)]
    rc = 0
    for i, (part, p) in enumerate(zip(parts, procs, strict=True)):
        code = p.wait()
        _report(i, len(part), code, a.log_dir / f"shard{i}.txt")
        rc = rc or code
    if rc:
        follow_up(parts, a.log_dir, a.pytest_args, a.alone)
    print(f"gpu tests: {len(nodes)} in {len(procs)} shards, exit {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
