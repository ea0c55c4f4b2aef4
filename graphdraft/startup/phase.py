"""The precompile worker phase: plan in this process while worker processes compile the entries.

`start_workers(engines, N)` forks the worker server (`workers.launch_server`), plans the keys
here meanwhile (`plan.plan_keys`, handed out chunk by chunk) and returns the running
`CompilePhase`: this process compiles entries too while it waits; `gate(index, task)` waits
for one capture task's kernels (a capture overlapping the phase calls it before warming up
that size), `finish()` for all of them, filling the `WorkerReport`. A tqdm bar counts compiled
keys over all processes. A worker that fails (exit status, timeout) raises
`PrecompileWorkerError` with its log's tail; the warm-up (`warmup.precompile_engine`) logs
it and compiles the rest in-process. Several engines (the demo's target-only and speculative
ones) share one worker phase: their keys are planned together, none twice.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from capture.compiles import triton_builds
from graphdraft.kernels.keys import all_kernels
from graphdraft.startup.compile import current_target, take_and_compile
from graphdraft.startup.entries import PlanEntry
from graphdraft.startup.forwards import PREFILL, Task, task_order, tasks_of
from graphdraft.startup.marker import marker_path
from graphdraft.startup.plan import plan_keys
from graphdraft.startup.spec import WorkerSpec, engine_spec, memory_cap
from graphdraft.startup.workers import (
    PLAN,
    PLAN_CHUNK,
    PLAN_END,
    WORKER_TIMEOUT_S,
    kill_server,
    launch_server,
    read_progress,
    tail,
    worker_env,
    write_atomic,
)

__all__ = ["CompilePhase", "PrecompileWorkerError", "WorkerReport", "run_beside", "run_workers",
           "start_workers"]

logger = logging.getLogger(__name__)


class PrecompileWorkerError(RuntimeError):
    """A precompile worker process failed (its exit status and log tail are in the message)."""


@dataclass
class WorkerReport:
    """What the worker phase did: worker processes, tasks (over every planned engine),
    `keys`: distinct specialization keys of the plan, `compiled`: keys each worker compiled
    (built or loaded from the cache; this process's share is `compiled_here`), `built`:
    kernels Triton's compiler built per (engine index, family, k, bs) of the task that first
    launched the key, wall seconds of the phase, of the plan and of each worker, why
    none ran if so."""

    workers: int = 0
    tasks: int = 0
    keys: int = 0
    compiled: list[int] = field(default_factory=list)
    compiled_here: int = 0
    built_here: int = 0
    """Of `built`: the kernels this process's compiler built in the phase."""
    built: dict[tuple[int, str, int | None, int], int] = field(default_factory=dict)
    pass_built: int | None = None
    """Kernels this process built in `precompile_engine`'s in-process pass when it ran after
    a skipped worker phase (set by `precompile_engine`); None: no pass (the workers compiled
    every key, or a warm cache)."""
    wall_s: float = 0.0
    plan_s: float = 0.0
    """Seconds this process spent building the throw-away engines and dry-running the tasks."""
    worker_wall_s: list[float] = field(default_factory=list)
    """Per worker: seconds from its spawn to its exit report."""
    worker_startup_s: list[float] = field(default_factory=list)
    """Per worker: seconds from its spawn until it had imported everything and read the
    plan's header (its compile target; the entries stream in after)."""
    worker_plan_wait_s: list[float] = field(default_factory=list)
    """Per worker: seconds it waited for the plan's header after its imports."""
    compile_s: list[list] = field(default_factory=list)
    """`[kernel, seconds, start, launcher seconds]` of every compiled entry, in every process
    (a load from the cache is fast); `start`: wall-clock time (`time.time()`) it began; the
    last: of the seconds, its host launcher's build (`build_launcher`, a C compile)."""
    t0_wall: float = 0.0
    """Wall-clock time (`time.time()`) the phase started: `timeline()`'s zero."""
    plan_events: list[list] = field(default_factory=list)
    """`[event, seconds since t0_wall, entries]` of the plan: "server" (the worker server
    forked), "header" (the compile target written), "engine" (a throw-away engine built),
    "probes" (its prefill probes dry-run), "emit" (a chunk of entries handed out), "end"
    (every chunk out)."""
    worker_ready_s: list[float] = field(default_factory=list)
    """Per worker: seconds since `t0_wall` when it read the plan's header."""
    gate_waits: list[list] = field(default_factory=list)
    """`[engine index, task, seconds since t0_wall it began, seconds waited]` of each capture
    gate (`CompilePhase.gate`) that waited."""
    skipped: str | None = None

    def timeline(self) -> list[list]:
        """`[kernel, start, seconds, launcher seconds]` of every compiled entry, `start` in
        seconds since the phase began (`t0_wall`), sorted by start: where the phase's time
        went (the launcher's build is part of the seconds)."""
        rows = [[k, round(t - self.t0_wall, 3), sec, *rest[:1]] for k, sec, t, *rest in
                (x for x in self.compile_s if len(x) >= 3)]
        return sorted(rows, key=lambda r: r[1])

    @property
    def total_built(self) -> int:
        return sum(self.built.values())

    def built_of(self, engine_index: int) -> dict[Task, int]:
        """`built` of one engine, by its tasks."""
        return {t[1:]: n for t, n in self.built.items() if t[0] == engine_index}


def run_beside(fn, name: str):
    """Start `fn()` in a daemon thread `name`; returns `join()`, which waits for it and raises
    what it raised."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # raised by join(), in the caller's thread
            failed.append(e)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()

    def join() -> None:
        thread.join()
        if failed:
            raise failed[0]

    return join


def run_workers(engines, workers: int, *, progress: bool = True,
                timeout_s: float = WORKER_TIMEOUT_S, factory: str | None = None) -> WorkerReport:
    """Compile the schedule kernels of `engines` (an engine or a sequence of them) into
    Triton's cache with `workers` processes and this one (module docstring), and wait for
    them: `start_workers(...)` then `CompilePhase.finish()`. Returns what they did."""
    report, phase = start_workers(engines, workers, progress=progress, timeout_s=timeout_s,
                                  factory=factory)
    return report if phase is None else phase.finish()


def _plans(engines: list, report: WorkerReport, factory: str | None
           ) -> list[tuple[int, WorkerSpec, list[Task]]]:
    """(engine index, spec, tasks) of each engine to plan: those with something to capture
    and no warm marker. Sets `report.skipped` when none is, or an engine cannot be rebuilt."""
    plans: list[tuple[int, WorkerSpec, list[Task]]] = []
    for index, e in enumerate(engines):
        tasks = tasks_of(e)
        spec, why = engine_spec(e, factory)
        if not tasks:
            continue
        if spec is None:
            report.skipped = why
            break
        if not marker_path(spec, tasks).exists():
            plans.append((index, spec, tasks))
    if report.skipped is None and not plans:
        report.skipped = ("nothing to capture" if not any(tasks_of(e) for e in engines)
                          else "Triton cache warm for this engine (marker found)")
    return plans


def _fitting_workers(engines: list, plans, workers: int, report: WorkerReport) -> int:
    """`workers`, at most as many as the free GPU memory holds (`spec.memory_cap`); 0 with
    `report.skipped` set when fewer than 2 fit (one would compile everything serially, as this
    process does)."""
    fit = min(memory_cap(engines[i], s, workers) for i, s, _ in plans)
    if fit < workers:
        logger.info("precompile workers: %d instead of %d (free GPU memory)", fit, workers)
    if fit < 2:
        report.skipped = ("one worker only" if fit else "not enough free GPU memory for a worker")
        return 0
    return fit


def _plan_beside_workers(workdir: Path, plans, fit: int, report: WorkerReport):
    """Fork the worker server, then plan here, handing the plan out as it grows (the header
    with the compile target beside the plan's first steps). Returns (server, entries,
    needs); on any failure the server is stopped (PrecompileWorkerError for the plan's)."""

    def event(name: str, n: int = 0) -> None:
        report.plan_events.append([name, round(time.time() - report.t0_wall, 4), n])

    server = None
    try:
        server = launch_server(workdir, fit, workdir / "server.txt", worker_env(plans[0][1]))
        tp = time.perf_counter()
        event("server")

        def header() -> None:  # Triton's driver starts (on a cold cache it builds a C helper)
            write_atomic(workdir / PLAN, {"device": plans[0][1].device, "target": current_target()})
            event("header")

        # the header beside the plan's first steps (the throw-away engine, the first probe):
        # the workers need it only with the first entries; its failure is the plan's
        header_written = run_beside(header, "graphdraft-plan-header")
        chunks = []

        def emit(batch: list[PlanEntry]) -> None:  # the workers start on it at once
            header_written()
            write_atomic(workdir / PLAN_CHUNK.format(len(chunks)),
                         {"entries": [x.to_json() for x in batch]})
            chunks.append(len(batch))
            event("emit", len(batch))

        try:
            entries, report.keys, needs = plan_keys(plans, emit=emit, event=event)
            header_written()
        except Exception as e:
            raise PrecompileWorkerError(f"precompile plan failed: {type(e).__name__}: {e}") \
                from e
        write_atomic(workdir / PLAN_END, {"chunks": len(chunks), "entries": len(entries)})
        report.plan_s = time.perf_counter() - tp
        event("end", len(entries))
    except BaseException:
        if server is not None:
            kill_server(server)
        raise
    return server, entries, needs


def start_workers(engines, workers: int, *, progress: bool = True,
                  timeout_s: float = WORKER_TIMEOUT_S, factory: str | None = None
                  ) -> tuple[WorkerReport, CompilePhase | None]:
    """Start the worker phase for `engines` (an engine or a sequence of them): fork the
    worker server, plan the keys here meanwhile (`plan_keys`), hand the plan out. Returns the
    report and the running `CompilePhase` (its `gate(index, task)` waits for one task's
    kernels, `finish()` for all of them), or the report and None with `report.skipped`
    saying why no worker runs: `workers` is 0, nothing is to be captured, an engine cannot
    be rebuilt, fewer than 2 workers fit in the free GPU memory (one would compile everything
    serially, as this process does), or every engine's marker says the cache is warm
    (engines whose marker exists are left out). `factory`: the engine factory the plan's
    throw-away engines are built with (`spec.engine_spec`). Raises PrecompileWorkerError when
    the plan fails (the server is stopped); ValueError for `workers < 0`."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"precompile_workers: expected an int >= 0, got {workers!r}")
    engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    report = WorkerReport()
    if workers == 0:
        report.skipped = "precompile_workers=0"
        return report, None
    plans = _plans(engines, report, factory)
    fit = _fitting_workers(engines, plans, workers, report) if not report.skipped else 0
    if not fit:
        logger.info("precompile workers: none (%s)", report.skipped)
        return report, None
    report.workers, report.tasks = fit, sum(len(t) for *_, t in plans)
    t0, report.t0_wall = time.perf_counter(), time.time()
    # a worker killed mid-write may leave a file behind the folder's removal: not an error
    tmp = tempfile.TemporaryDirectory(prefix="graphdraft-precompile-", ignore_cleanup_errors=True)
    workdir = Path(tmp.name)
    (workdir / "claims").mkdir()
    (workdir / "done").mkdir()
    try:
        server, entries, needs = _plan_beside_workers(workdir, plans, fit, report)
    except BaseException:
        tmp.cleanup()
        raise
    logger.info("precompile: %d keys of %d tasks over %d worker processes and this one",
                len(entries), report.tasks, fit)
    order = {index: [t for t in tasks if t[0] != PREFILL] for index, _, tasks in plans}
    return report, CompilePhase(report, tmp, server, entries, needs, order, progress=progress,
                                timeout_s=timeout_s, t0=t0)


class CompilePhase:
    """A running worker phase (`start_workers`). This process compiles entries too while it
    waits: `gate(index, task)` returns once every kernel that task launches is compiled (a
    capture overlapping the phase calls it before warming up that size); `finish()` waits
    for every worker, fills the report and ends the phase (raises PrecompileWorkerError for a
    failed or late worker). After a worker failed or the time ran out, gates stop waiting
    (the capture's own launches compile what is missing) and `finish` raises."""

    def __init__(self, report: WorkerReport, tmp, server, entries: list[PlanEntry],
                 needs: dict, order: dict[int, list[Task]], *, progress: bool,
                 timeout_s: float, t0: float) -> None:
        self.report, self._tmp, self._server = report, tmp, server
        self._workdir = Path(tmp.name)
        self._entries, self._needs, self._order = entries, needs, order
        self._kernels = all_kernels()
        self._outs = [self._workdir / f"out{i}.json" for i in range(report.workers)]
        self._timeout_s, self._t0 = timeout_s, t0
        self._deadline = time.monotonic() + timeout_s
        self._here, self._b0 = 0, triton_builds()
        self._done: set[int] = set()
        self._built: dict[int, int] = {}  # per entry index, this process and the workers
        self._bar = None
        if progress:
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=len(entries), desc=f"JIT compile ({report.workers} "
                                 "workers)", unit="kernel")
            except ImportError:  # pragma: no cover - a declared dependency
                pass
        self.gate_wait_s = 0.0
        """Seconds the gates waited for kernels (this process's own compiles included)."""
        self._closed = False

    def first_tasks(self, index: int = 0) -> list[Task]:
        """The capture tasks of engine `index` that launch some kernel none of its earlier
        captures (in capture order) launched: only their captures need a warm-up before (it
        loads those kernels into this process); every other task launches kernels loaded by
        then. Per engine, as if planned alone: the marker keeps them for a warm start of
        that engine by itself."""
        seen: set[int] = set()
        out = []
        for task in self._order.get(index, ()):
            needed = self._needs.get((index, task), ())
            if not seen.issuperset(needed):
                out.append(task)
                seen.update(needed)
        return sorted(out, key=task_order)

    def _is_done(self, j: int) -> bool:
        if j not in self._done and (self._workdir / "done" / str(j)).exists():
            self._done.add(j)
        return j in self._done

    def _stalled(self) -> bool:
        """The server ended (every worker exited: nothing more will come from them) or the
        time ran out."""
        return self._server.poll() is not None or time.monotonic() > self._deadline

    def _tick(self) -> None:
        if self._bar is not None:
            n = self._here + sum(read_progress(out) for out in self._outs)
            if n > self._bar.n:
                self._bar.update(n - self._bar.n)

    def _help(self, among: Sequence[int] | None = None) -> bool:
        """Claim and compile one entry (of `among` if given); whether it compiled one."""
        n = take_and_compile(self._workdir, self._kernels, self._entries, self._built,
                              self.report.compile_s, among=among, on_done=self._done.add,
                              stop_after=1)
        self._here += n
        return n > 0

    def gate(self, index: int, task: Task) -> None:
        """Return once every kernel of `task` (of engine `index`) is compiled, compiling its
        unclaimed ones here meanwhile (only those: a kernel of a later capture compiled here
        kept this gate shut after its own were done, perf/RESULTS.md 2026-12-05e); at once
        when the phase has stalled."""
        if self._closed:
            return
        t, wall = time.perf_counter(), time.time()
        needed = self._needs.get((index, task), ())
        while True:
            missing = [j for j in needed if not self._is_done(j)]
            if not missing or self._stalled():
                break
            if not self._help(missing):
                time.sleep(0.002)
            self._tick()
        waited = time.perf_counter() - t
        self.gate_wait_s += waited
        if waited > 0.001:
            self.report.gate_waits.append([index, list(task),
                                           round(wall - self.report.t0_wall, 3), round(waited, 3)])

    def finish(self) -> WorkerReport:
        """Wait for the workers (compiling entries here meanwhile), then fill and return the
        report; the phase's folder is removed. PrecompileWorkerError for a failed worker or
        one still running after the timeout (the server is stopped)."""
        report, workdir = self.report, self._workdir
        try:
            while (rc := self._server.poll()) is None:
                if not self._help():
                    time.sleep(0.005)
                self._tick()
                if time.monotonic() > self._deadline:
                    raise PrecompileWorkerError(
                        f"precompile workers did not finish within {self._timeout_s:.0f} s; "
                        f"the log of worker 1 ends:\n{tail(workdir / 'log0.txt')}")
            if rc != 0:
                failed = workdir / "failed.json"
                if failed.exists():
                    f = json.loads(failed.read_text())
                    log = workdir / "log{}.txt".format(f["worker"])
                    raise PrecompileWorkerError(
                        f"precompile worker {f['worker'] + 1} failed (exit status {f['status']}); "
                        f"its log ends:\n{tail(log)}")
                raise PrecompileWorkerError(
                    f"precompile workers failed (exit status {rc}); the log ends:\n"
                    f"{tail(workdir / 'server.txt')}")
            for i, out in enumerate(self._outs):
                if not out.exists():
                    raise PrecompileWorkerError(
                        f"precompile worker {i + 1} wrote no result; its log ends:\n"
                        f"{tail(workdir / f'log{i}.txt')}")
                data = json.loads(out.read_text())
                for j, n in data["built"]:
                    self._built[int(j)] = self._built.get(int(j), 0) + int(n)
                report.compiled.append(int(data.get("compiled", 0)))
                report.worker_wall_s.append(float(data["wall_s"]))
                report.worker_startup_s.append(float(data["startup_s"]))
                report.worker_plan_wait_s.append(float(data.get("plan_wait_s", 0.0)))
                if "ready_at" in data:
                    report.worker_ready_s.append(round(data["ready_at"] - report.t0_wall, 3))
                report.compile_s.extend(data.get("seconds", []))
            # what no worker took (none should be left: a worker exits once all are claimed)
            while self._help():
                pass
            report.compiled_here, report.built_here = self._here, triton_builds() - self._b0
            for j, n in self._built.items():  # by the task each entry belongs to
                k = (self._entries[j].engine, *self._entries[j].task)
                report.built[k] = report.built.get(k, 0) + n
        finally:
            self.close()
        report.wall_s = time.perf_counter() - self._t0
        logger.info("precompile workers: %d processes, %d keys of %d tasks, %d kernels built, "
                    "%.2f s (plan %.2f s)", report.workers, report.keys, report.tasks,
                    report.total_built, report.wall_s, report.plan_s)
        return report

    def close(self) -> None:
        """Stop the server and its workers (if still running) and remove the phase's folder."""
        if self._closed:
            return
        self._closed = True
        kill_server(self._server)
        if self._bar is not None:
            self._bar.close()
        self._tmp.cleanup()
