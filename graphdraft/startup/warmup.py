"""Compiling what a batch-size schedule needs before capture: in this process, or by workers.

`precompile_engine(engine)` runs every captured forward of an engine (`forwards.forwards`:
its drafter's included) once at one batch size per bucket of compiled variants
(`buckets.representative_sizes`), before `capture_graphs` warms up and captures each size:
the Triton kernels of every bucket are compiled there, with a progress bar (`progress=False`
or the logger level silences it), and capture then compiles nothing new. The counts land in
each forward's `GraphStats.compiles` (and `built`: the ones Triton's compiler built here, not
loaded from its cache). With `workers=N` the kernels are compiled first by N worker processes
into Triton's on-disk cache, each distinct specialization key once (`phase.run_workers`; their
builds in `GraphStats.worker_built`, the phase in `worker_report(engine)`), and no in-process
pass follows. `start_precompile(engines, workers=N)` starts that phase for one or several
engines (one plan) and returns once it runs: their captures adopt it, each bucket's first
capture waiting for its own kernels; the weights may be read beside it (`meanwhile`).

Triton's cache stays where Triton puts it: `TRITON_CACHE_DIR` when set, else Triton's
default (`capture.compiles.cache_dir`).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Sequence

import torch

from capture import CapturedForward
from capture.compiles import triton_builds
from graphdraft.kernels.buckets import representative_sizes
from graphdraft.startup.forwards import (
    PREFILL,
    ForwardKey,
    Task,
    forwards,
    owner_resets,
    tasks_of,
)
from graphdraft.startup.marker import is_warm, mark_warm, warmup_tasks
from graphdraft.startup.phase import PrecompileWorkerError, WorkerReport, run_beside, run_workers
from graphdraft.startup.phase import start_workers as _start_workers

__all__ = ["finish_precompile", "precompile_engine", "precompile_running", "start_precompile",
           "worker_report"]

logger = logging.getLogger(__name__)

_REPORTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def worker_report(engine) -> WorkerReport | None:
    """The `phase.WorkerReport` of `engine`'s last `precompile_engine` (None: it asked for no
    workers, or they failed and the warm-up ran in this process)."""
    try:
        return _REPORTS.get(engine)
    except TypeError:  # not weak-referenceable
        return None


def _set_report(engine, report: WorkerReport | None) -> None:
    """`report` as `engine`'s `worker_report` (None: none)."""
    with contextlib.suppress(TypeError):
        if report is None:
            _REPORTS.pop(engine, None)
        else:
            _REPORTS[engine] = report


def _run_workers(engines: list, workers: int, progress: bool, factory: str | None):
    """The worker phase over `engines` (`phase.run_workers`); a failed worker is logged and
    the in-process warm-up compiles the rest (None). Worker builds land in each engine's
    `GraphStats.worker_built`; every engine gets the report (`worker_report`)."""
    for e in engines:
        _set_report(e, None)  # this call's report or none
    try:
        report = run_workers(engines, workers, progress=progress, factory=factory)
    except PrecompileWorkerError as e:
        logger.warning("%s\nJIT warm-up: compiling in this process instead", e)
        return None
    for index, engine in enumerate(engines):
        _count_worker_builds(engine, report, index)
        _set_report(engine, report)
    return report


def _count_worker_builds(engine, report: WorkerReport, index: int) -> None:
    """Add the kernels the workers built for engine `index`'s capture tasks to each forward's
    `GraphStats.worker_built` (a prefill probe's builds belong to no captured forward: they
    stay in the report's totals only)."""
    by_key = dict(forwards(engine))
    for (family, k, bs), n in report.built_of(index).items():
        if family != PREFILL:
            by_key[(family, k)].stats.worker_built[bs] += n


class _SharedPhase:
    """One running `CompilePhase` over one or more engines (`start_precompile`): each
    engine's captures gate on its own index; the first `finish` waits for the phase, the
    others take its outcome."""

    def __init__(self, phase) -> None:
        self.phase = phase
        self._ended = False
        self._report = None

    def finish(self, abort: bool = False):
        """The phase's report (None: aborted, or a worker failed: logged once)."""
        if not self._ended:
            self._ended = True
            if abort:
                self.phase.close()
                return None
            try:
                self._report = self.phase.finish()
            except PrecompileWorkerError as e:
                logger.warning("%s\nJIT warm-up: the captures compile what the workers left", e)
        return self._report


_PHASES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""engine -> (its running `_SharedPhase`, its index in the phase's plan)."""


def start_precompile(engines, *, workers: int, progress: bool = True,
                     meanwhile: Callable[[], object] | None = None,
                     factory: str | None = None) -> bool:
    """Start one worker phase for `engines` (an engine or several: one plan, each key
    compiled once) and return once it runs; each engine's `capture_graphs` then adopts it:
    each bucket's first capture waits for its own kernels, and the capture's end
    (`finish_precompile`) waits for the phase. The phase reads none of the engines'
    weights (its plan and workers run throw-away engines of the same shapes, built by
    `factory`: "module:function", None: each engine's class; `spec.engine_spec`), so they
    may be read meanwhile: `meanwhile` (e.g. `PendingWeights.read` of
    `checkpoint.open_model_pair`) runs in a thread from the start, beside the plan and the
    workers, and this returns once it is done too; its exception is raised here, the phase
    stopped. Engines whose cache is warm (their marker) are left out. False: no phase (no
    workers, a warm cache, a skip or a failed plan: `worker_report` or the log says which;
    `meanwhile` still runs); each capture then precompiles as usual."""
    engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    for e in engines:
        if e in _PHASES:
            raise RuntimeError("start_precompile: a compile phase already runs for this engine")
    joined = run_beside(meanwhile, "graphdraft-meanwhile") if meanwhile is not None else None
    try:
        started = _start_phase(engines, workers, progress, factory)
    finally:
        try:
            if joined is not None:
                joined()  # its exception stops the phase
        except BaseException:
            for e in engines:
                finish_precompile(e, abort=True)
            raise
    return started


def _adopt(engine, index: int, phase, shared: _SharedPhase) -> None:
    """`engine`'s captures adopt the running phase: each forward's capture first waits for
    its task's kernels (`CompilePhase.gate`); only the first tasks warm up."""
    for key, f in forwards(engine):
        f.before_capture = (lambda bs, _i=index, _k=key: phase.gate(_i, (*_k, bs)))
    _PHASES[engine] = (shared, index)
    _only_warm(engine, phase.first_tasks(index))


def _start_phase(engines: list, workers: int, progress: bool, factory: str | None) -> bool:
    """`start_precompile` without `meanwhile`."""
    if not workers:
        return False
    for e in engines:
        _set_report(e, None)
    warm = [is_warm(e) for e in engines]
    try:
        report, phase = _start_workers(engines, workers, progress=progress, factory=factory)
    except PrecompileWorkerError as e:
        logger.warning("%s\nJIT warm-up: compiling in this process instead", e)
        return False
    if phase is None:
        return _without_phase(engines, report)
    shared = _SharedPhase(phase)
    adopted = False
    for index, engine in enumerate(engines):
        if warm[index] or not phase.first_tasks(index):  # not in the plan: captured as usual
            continue
        _adopt(engine, index, phase, shared)
        adopted = True
    if not adopted:  # no capture gates on it (warm, or nothing to compile): stop it now
        report.skipped = "no capture needs it (warm caches or no Triton kernel to compile)"
        phase.close()
        return _without_phase(engines, report)
    # an engine dropped before its capture ends the phase: stop the workers, then the folder
    weakref.finalize(shared, phase.close)
    return True


def _without_phase(engines: list, report: WorkerReport) -> bool:
    """No phase for `engines`: `report` (its `skipped` says why) is their `worker_report`;
    False, `_start_phase`'s answer."""
    for e in engines:
        _set_report(e, report)
    return False


def _only_warm(engine, tasks: Sequence[Task]) -> None:
    """One warm-up (`warmup_iters` 1) for exactly the sizes of `tasks` (those that first
    launch a kernel in capture order), none for the others."""
    for key, f in forwards(engine):
        f.warmup_iters = min(f.warmup_iters, 1)
        f.warmup_sizes = {bs for family, k, bs in tasks if (family, k) == key}


def finish_precompile(engine, abort: bool = False) -> WorkerReport | None:
    """End `engine`'s part of the worker phase `start_precompile` (or
    `precompile_engine(overlap=True)`) left running for its capture: wait for the phase
    (`CompilePhase.finish`; `abort`: stop it), put its builds for this engine into the
    forwards' `GraphStats.worker_built` and the report in `worker_report`, write the warm
    marker. A failed worker is logged (the capture compiled what it lacked). Returns the
    report, None without a phase, after an abort or a failure."""
    entry = _PHASES.pop(engine, None)
    for _, f in forwards(engine):
        f.before_capture = None
    if entry is None:
        return None
    shared, index = entry
    report = shared.finish(abort)
    if report is None:
        return None
    _count_worker_builds(engine, report, index)
    _set_report(engine, report)
    mark_warm(engine, warmup=shared.phase.first_tasks(index))
    return report


def precompile_running(engine) -> bool:
    """Whether a worker phase started for `engine` (`start_precompile`) awaits its capture."""
    return engine in _PHASES


def _owner_groups(engine) -> list[list[tuple[ForwardKey, CapturedForward]]]:
    """`forwards(engine)` split into the drafter's (its graph registry, `drafter.graphs()`)
    and the others: each group writes only its owner's buffers. Empty groups left out."""
    drafter = getattr(engine, "drafter", None)
    mine = {id(f) for f in drafter.graphs().forwards()} if drafter is not None else set()
    groups = [[kf for kf in forwards(engine) if id(kf[1]) not in mine],
              [kf for kf in forwards(engine) if id(kf[1]) in mine]]
    return [g for g in groups if g]


def _in_process_pass(engine, progress: bool, parallel: bool) -> dict[str, int]:
    """Each forward once per size bucket, in this process (the engine's and the drafter's
    in two threads with `parallel`); the drafter's buffers neutral before and after."""
    n = int(getattr(engine.cfg, "spec_num_tokens", 1))
    kc = getattr(engine.cfg, "kernels", None)  # the settings the forwards launch under
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def work(group: list[tuple[ForwardKey, CapturedForward]]) -> dict[str, int]:
        if device is not None:
            torch.cuda.set_device(device)  # the current device is per thread
        out = {}
        with torch.inference_mode():  # per thread too
            for _, f in group:
                sizes = representative_sizes(f.batch_sizes, (1, n), kernels=kc)
                out[f.name] = f.precompile(sizes, progress=progress)
        return out

    resets = owner_resets(engine, include_engine=False)
    for r in resets:
        r()
    groups = _owner_groups(engine) if parallel else [forwards(engine)]
    counts: dict[str, int] = {}
    if len(groups) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(groups), thread_name_prefix="jit-warmup") as pool:
            for part in pool.map(work, groups):
                counts.update(part)
    else:
        counts.update(work(groups[0]) if groups else {})
    if device is not None:
        torch.cuda.synchronize()
    for r in resets:
        r()
    return counts


def _load_from_cache(engine, warm: bool, compiled: bool) -> dict[str, int]:
    """Every key is in the cache (a warm marker, or a complete worker phase): no in-process
    pass; each bucket's one warm-up before its capture loads its kernels."""
    first = warmup_tasks(engine) if warm else None
    _only_warm(engine, first if first is not None else tasks_of(engine))
    if compiled:
        mark_warm(engine)
    logger.info("JIT warm-up: no in-process pass (%s); each bucket's one warm-up before its "
                "capture loads its kernels from Triton's cache",
                "the workers compiled every key" if compiled else
                "Triton cache warm for this engine shape: marker found")
    return {}


def precompile_engine(engine, *, progress: bool = True, parallel: bool = False,
                      workers: int = 0, overlap: bool = False,
                      factory: str | None = None) -> dict[str, int]:
    """Run each captured forward of `engine` (`forwards`: its drafter's included) once per
    size bucket of its schedule (`representative_sizes` with rows per request 1 and
    `engine.cfg.spec_num_tokens`), so `capture_graphs` compiles nothing more; return the
    compiles counted per forward. Call it inside `Engine.capture_graphs`, after the static
    inputs are padded (the warm-up forwards read them, as capture's own warm-up does). The
    drafter's buffers are reset to neutral values before and after (`_reset_neutral`).

    `parallel`: the engine's forwards and the drafter's run in two threads, so one compiles
    while the other launches or compiles (Triton's compiler releases the GIL in its C++
    passes and in ptxas); the draft forwards may then read target hidden states mid-write:
    finite values either way, and no index buffer is written by the other owner's forwards.

    `workers`: first compile in that many worker processes into Triton's on-disk cache, each
    distinct key once (`phase.run_workers`, the throw-away engines built by `factory`; 0:
    not); the pass above is then skipped. A failed worker is logged and this process
    compiles the rest in the pass. `overlap` (with `workers`): the phase is only started
    here (`start_precompile`) and this returns at once; the caller ends it with
    `finish_precompile(engine)` after its captures (`Engine.capture_graphs` does).

    Every forward precompiled here then warms up once per size bucket before its capture
    (`warmup_iters` at most 1, `warmup_sizes` the representative sizes). No pass (returns {})
    when the workers compiled every key, or for a warm cache (`marker.is_warm`; then no
    workers either): that one warm-up loads the kernels from the cache (and compiles one the
    cache lacks: `GraphStats.built` counts it there)."""
    if engine in _PHASES:  # `start_precompile` ran: this capture adopts its phase
        return {}
    if not workers:
        _set_report(engine, None)
    warm = is_warm(engine)
    if workers and overlap:  # a skip's report (e.g. the warm marker) is in worker_report
        if start_precompile([engine], workers=workers, progress=progress, factory=factory):
            return {}  # warm-ups: the first tasks only
        report = None
    else:
        report = _run_workers([engine], workers, progress, factory) if workers else None
    compiled = report is not None and report.skipped is None
    if warm or compiled:
        return _load_from_cache(engine, warm, compiled)
    b0 = triton_builds()
    counts = _in_process_pass(engine, progress, parallel)
    if report is not None:
        report.pass_built = triton_builds() - b0
    _only_warm(engine, tasks_of(engine))
    mark_warm(engine)
    logger.info("JIT warm-up: %s", ", ".join(f"{k} {v} compiles" for k, v in counts.items()))
    return counts
