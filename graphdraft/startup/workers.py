"""The precompile worker processes: a server forked from the planning process, and its workers.

A server process, forked from the planning process (`launch_server`: torch, Triton and the
kernel modules are imported already, and nothing of the caller's `__main__` re-runs, which a
multiprocessing spawn would do; without `os.fork`, the command
`python -m graphdraft.startup.workers DIR N` in a fresh interpreter), starts while that
process plans and forks N workers (`server_main`). Neither touches CUDA, so forking a process
that uses it is safe (as for a DataLoader's workers). Each worker waits for `DIR/plan.json`
(the compile target), then takes entries in plan order as the plan streams in
(`DIR/plan.<c>.json`, then `DIR/plan.end`; the workers compile while the rest is planned),
each by a claim (`compile.claim`), and compiles it (`compile.compile_entry`). A worker's
progress is a line per compiled key in `out<i>.json.progress`, its report `out<i>.json`.
The worker processes get the caller's environment with `TRITON_CACHE_DIR` set to the
caller's cache (`worker_env`). Triton writes each cache file to a temporary folder and renames
it into place, the group file (what a lookup reads first) last, so a killed worker leaves no
entry that a later lookup would load half-written.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

from capture.compiles import install_triton_counter
from graphdraft.kernels import compiler_key
from graphdraft.kernels.keys import all_kernels
from graphdraft.startup.compile import quick_launcher_builds, take_and_compile, use_target
from graphdraft.startup.entries import PlanEntry
from graphdraft.startup.spec import WorkerSpec

__all__ = ["PLAN", "PLAN_CHUNK", "PLAN_END", "WORKER_TIMEOUT_S", "kill_server", "launch_server",
           "main", "read_progress", "server_main", "tail", "worker_env", "worker_main",
           "write_atomic"]

WORKER_TIMEOUT_S = 600.0
PLAN = "plan.json"
"""The plan's header in the phase's folder: the compile target and device."""
PLAN_CHUNK = "plan.{}.json"
"""The plan's c-th chunk of entries."""
PLAN_END = "plan.end"
"""Written after the last chunk: the chunk and entry counts."""
_SPAWNED_ENV = "GRAPHDRAFT_WORKER_SPAWNED"
_FORKED = False
"""True in a process `_fork` made (its inherited objects stay frozen: `_fork`)."""


def _read_chunks(workdir: Path, entries: list[PlanEntry], chunks: int) -> int:
    """Append the plan chunks `plan.<c>.json` from `chunks` on that exist to `entries`;
    returns the chunk count read so far."""
    while (path := workdir / PLAN_CHUNK.format(chunks)).exists():
        entries += [PlanEntry.from_json(d) for d in json.loads(path.read_text())["entries"]]
        chunks += 1
    return chunks


def worker_main(workdir: Path, index: int, timeout_s: float = WORKER_TIMEOUT_S) -> int:
    """Worker `index`: import the kernels, wait for `workdir/plan.json` (the compile target),
    then claim and compile entries as the plan's chunks arrive (`plan.<c>.json`, in order)
    until `plan.end` says every chunk is out and none is left, appending a line `1` per
    compiled key to `out<index>.json.progress`; then write `out<index>.json` (JSON: builds
    per entry index, keys compiled, seconds). Exits 3 when no plan comes within `timeout_s`
    or its parent is gone."""
    spawned = float(os.environ.get(_SPAWNED_ENV) or time.time())
    install_triton_counter()
    quick_launcher_builds()
    kernels = all_kernels()
    t_imported = time.time()
    plan_path, end_path, parent = workdir / PLAN, workdir / PLAN_END, os.getppid()
    while not plan_path.exists():
        if time.time() - t_imported > timeout_s or os.getppid() != parent:
            return 3
        time.sleep(0.005)
    plan = json.loads(plan_path.read_text())
    no_context = use_target(plan.get("target"), plan["device"])
    if not no_context and plan["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(plan["device"]))
    t_ready = time.time()
    out = workdir / f"out{index}.json"
    progress = Path(str(out) + ".progress")

    def line(_j: int) -> None:
        with open(progress, "a") as fh:
            fh.write("1\n")

    built: dict = {}
    seconds: list = []
    entries: list[PlanEntry] = []
    chunks = tried = compiled = 0
    while True:
        total = json.loads(end_path.read_text())["chunks"] if end_path.exists() else None
        chunks = _read_chunks(workdir, entries, chunks)
        n = take_and_compile(workdir, kernels, entries, built, seconds, on_done=line,
                             among=range(tried, len(entries)), load=not no_context)
        compiled, tried = compiled + n, len(entries)
        if total is not None and chunks >= total:
            break  # every chunk read (the end marker comes after the last) and claimed
        if n == 0:
            if time.time() - t_ready > timeout_s or os.getppid() != parent:
                return 3
            time.sleep(0.002)
    data = {"built": [[j, n] for j, n in built.items()], "compiled": compiled,
            "seconds": seconds,
            "startup_s": round(t_ready - spawned, 3),
            "plan_wait_s": round(t_ready - t_imported, 3),
            "ready_at": round(t_ready, 4),
            "wall_s": round(time.time() - spawned, 3)}
    write_atomic(out, data)
    return 0


def server_main(workdir: Path, n: int) -> int:
    """The worker processes' parent: import torch, Triton and every kernel module once, then
    fork `n` workers (`worker_main`, log `workdir/log<i>.txt`; nothing here touched CUDA, so
    each child initialises its own) and wait for them. A worker that fails stops the others;
    `workdir/failed.json` names it and its exit status, and this process exits 1. It stops
    them and exits 3 when its parent (the planning process) is gone."""
    compiler_key.prefetch()  # beside the imports; joined before the forks
    install_triton_counter()
    all_kernels()  # every kernel module imported before the forks: the workers share it
    compiler_key.wait()  # and Triton's compiler key: no worker hashes it again
    main_pid = os.getppid()
    children: dict[int, int] = {}
    for i in range(n):
        pid = _fork(workdir / f"log{i}.txt", lambda i=i: worker_main(workdir, i))
        children[pid] = i

    def stop_all() -> None:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    failed: tuple[int, int] | None = None
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            if pid not in children:  # not a worker (a child this process had before)
                continue
            i = children.pop(pid)
            rc = os.waitstatus_to_exitcode(status)
            if rc != 0 and failed is None:
                failed = (i, rc)
                stop_all()
        elif os.getppid() != main_pid:
            stop_all()
            return 3
        else:
            time.sleep(0.01)
    if failed is not None:
        (workdir / "failed.json").write_text(json.dumps({"worker": failed[0],
                                                         "status": failed[1]}))
        return 1
    return 0


def worker_env(spec: WorkerSpec) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=spec.cache_dir, PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parents[2])  # the folder holding graphdraft/
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in paths if p != root])
    return env


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"


def _fork(log_path: Path, run) -> int:
    """Fork; the child writes stdout and stderr to `log_path`, runs `run()` and exits with its
    status (1 and the traceback in the log if it raises); returns the child's pid.

    Every object alive at the fork is frozen out of the child's garbage collector
    (`gc.freeze`): unreachable cycles the parent had not collected yet may hold CUDA tensors,
    whose destructor in a forked child aborts it (the CUDA allocator after a fork); the child
    leaves through `os._exit`, so no inherited object is ever freed there."""
    global _FORKED
    gc.freeze()
    try:
        pid = os.fork()
    except BaseException:
        if not _FORKED:
            gc.unfreeze()
        raise
    if pid:
        if not _FORKED:  # the main process collects as before; a forked one never unfreezes
            gc.unfreeze()
        return pid
    _FORKED = True
    rc = 1
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        rc = run()
    except BaseException:  # noqa: BLE001 - reported in its log, never raised in a fork
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


class _Forked:
    """A forked child process with `subprocess.Popen`'s poll / wait / kill / pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None and self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def launch_server(workdir: Path, n: int, log_path: Path, env: dict):
    """Start the worker server (`server_main`: `n` workers) in a session of its own (a
    timeout kills the whole group). Forked from this process where it can (torch, Triton and
    the kernels are imported already: a fresh interpreter spent seconds importing them on the
    H200 machine, perf/RESULTS.md "Figures moved out of the code"; the server and its workers
    never touch CUDA, so a fork of a process that uses CUDA is safe, as for a DataLoader's
    workers); else a fresh interpreter
    (`python -m graphdraft.startup.workers DIR N`) with the environment `env`."""
    env = dict(env, **{_SPAWNED_ENV: repr(time.time())})
    if hasattr(os, "fork"):
        compiler_key.wait()  # the server and its workers inherit the key (`compiler_key`)
        import warnings

        with warnings.catch_warnings():  # "multi-threaded process: fork may deadlock": the
            warnings.simplefilter("ignore", DeprecationWarning)  # child takes no lock of theirs

            def serve() -> int:
                os.setsid()
                os.environ.update(env)
                return server_main(workdir, n)

            return _Forked(_fork(log_path, serve))
    cmd = [sys.executable, "-m", "graphdraft.startup.workers", str(workdir), str(n)]
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def kill_server(proc: subprocess.Popen) -> None:
    """Kill the server and its workers (its process group), then reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait()


def write_atomic(path: Path, data) -> None:
    """`path` holds JSON `data` whole or not at all (a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def read_progress(out: Path) -> int:
    """A worker's progress file: keys compiled so far."""
    try:
        return Path(str(out) + ".progress").read_text().count("1\n")
    except OSError:
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or not args[1].isdigit() or int(args[1]) < 1:
        print("usage: python -m graphdraft.startup.workers WORKDIR WORKERS",
              file=sys.stderr)
        return 2
    return server_main(Path(args[0]), int(args[1]))


if __name__ == "__main__":
    sys.exit(main())
