"""Compiling what a batch-size schedule needs before capture, and checking what it compiles.

`precompile_engine(engine)` runs every captured forward of an engine (and of its drafter) once
at one batch size per bucket of compiled variants (`buckets.representative_sizes`), before
`capture_graphs` warms up and captures each size: the Triton kernels of every bucket are
compiled there, with a progress bar (`progress=False` or the logger level silences it), and
capture then compiles nothing new. The counts land in each forward's `GraphStats.compiles`
(and `built`: the ones Triton's compiler built here, not loaded from its cache). With
`workers=N` the kernels are compiled first by N worker processes into Triton's on-disk cache,
each distinct specialization key once (`kernels.precompile_workers`; their builds in
`GraphStats.worker_built`, the phase in `worker_report(engine)`), and no in-process pass
follows. `start_precompile(engines, workers=N)` starts that phase for one or several engines
(one plan) and returns once it runs: their captures adopt it, each bucket's first capture
waiting for its own kernels; the weights may be read beside it (`meanwhile`).

`specialization_key(kernel, *args, **kwargs)` is the key Triton's JIT caches a compiled
kernel under for a launch with these arguments (its constexprs and launch options, and for
every other argument its type with Triton's value specialization: 1, divisible by 16,
16-byte aligned), computed on the host the way Triton's launcher does; `KeyRecorder` records
it for every launch of the given kernels. They run under the interpreter too, so the CPU
tests can check that the sizes of one bucket launch under one key.

Triton's cache stays where Triton puts it: `TRITON_CACHE_DIR` when set, else Triton's
default (`capture.compiles.cache_dir`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import pkgutil
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from capture import CapturedForward
from graphdraft.kernels.buckets import representative_sizes

__all__ = ["KeyRecorder", "all_kernels", "captured_forwards", "finish_precompile", "kernels",
           "precompile_engine", "precompile_running", "specialization_key", "start_precompile",
           "worker_report"]

logger = logging.getLogger(__name__)

_KERNEL_MODULES = ("argmax", "cache_loc", "draft_indices", "gemv", "norm", "rope", "stage_inputs")


def _module_kernels(mod_names) -> dict[str, object]:
    out = {}
    for mod_name in mod_names:
        mod = importlib.import_module(f"graphdraft.kernels.{mod_name}")
        for name, obj in vars(mod).items():
            if name.startswith("_") and "_kernel" in name and hasattr(obj, "run") and hasattr(obj, "fn"):
                out[f"{mod_name}.{name}"] = obj
    return out


def kernels() -> dict[str, object]:
    """The launched `@triton.jit` kernels of the draft chain's kernel modules (not attention),
    by `module.name`."""
    return _module_kernels(_KERNEL_MODULES)


def all_kernels() -> dict[str, object]:
    """The launched `@triton.jit` kernels (`_..._kernel`) of every module of
    `graphdraft.kernels`, attention's included, by `module.name`."""
    import graphdraft.kernels as pkg

    return _module_kernels(sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)))


def _params(kernel) -> list:
    """Triton's per-parameter metadata (KernelParam), also for the interpreter's functions."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return params
    from triton.runtime.jit import KernelParam  # interpreter: rebuild from the jit arguments

    kw = getattr(kernel, "kwargs", {}) or {}
    dns = set(kw.get("do_not_specialize") or ())
    dns_oa = set(kw.get("do_not_specialize_on_alignment") or ())
    return [KernelParam(i, p, i in dns or p.name in dns, i in dns_oa or p.name in dns_oa)
            for i, p in enumerate(inspect.signature(kernel.fn).parameters.values())]


def _specialize(v, is_const: bool, specialize: bool, align: bool) -> tuple:
    """Triton's (type, specialization) of one argument: its own native function where the
    installed triton has it, else the same rules in Python (ints: 1 -> constexpr, a multiple
    of 16 -> "D"; pointers: 16-byte aligned -> "D"; none of it under do_not_specialize)."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        native_specialize_impl = None
    if native_specialize_impl is not None:
        try:
            return tuple(native_specialize_impl(BaseBackend, v, is_const, specialize, align))
        except TypeError:  # another signature in this triton: the same rules in Python
            pass
    if v is None:
        return ("constexpr", None)
    if isinstance(v, bool):
        return ("u1", None)
    if isinstance(v, int):
        ty = "i32" if -2**31 <= v < 2**31 else ("u64" if v >= 2**63 else "i64")
        if not specialize:
            return (ty, None)
        return ("constexpr", 1) if v == 1 else (ty, "D" if v % 16 == 0 else "")
    if isinstance(v, float):
        return ("fp32", None)
    if hasattr(v, "data_ptr"):
        ty = f"*{'k' if is_const else ''}{v.dtype}"
        return (ty, ("D" if v.data_ptr() % 16 == 0 else "") if specialize and align else None)
    return (type(v).__name__, repr(v))


def specialization_key(kernel, *args, **kwargs) -> tuple:
    """The JIT cache key of launching `kernel` with these arguments: a tuple of
    `(name, ("constexpr", value) | (type, specialization))` per parameter, then the sorted
    launch options (num_warps, launch_pdl, ...). Two launches with equal keys run one
    compiled kernel."""
    params = _params(kernel)
    names = {p.name for p in params}
    sig = inspect.signature(kernel.fn)
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    spec = []
    for p in params:
        v = bound.arguments[p.name]
        if p.is_constexpr:
            spec.append((p.name, ("constexpr", v)))
        else:
            spec.append((p.name, _specialize(v, p.is_const, not p.do_not_specialize,
                                             not p.do_not_specialize_on_alignment)))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    return tuple(spec) + options


def _zero_int_tensors(args, kwargs, spare: frozenset = frozenset()) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.numel() and not (a.is_floating_point()
                                                             or a.is_complex()):
            if a.untyped_storage().data_ptr() not in spare:
                a.zero_()


class KeyRecorder(contextlib.AbstractContextManager):
    """Record `specialization_key` of every launch of `kernels` (default: `kernels()`) while
    active: `keys[name]` is the set of distinct keys, `launches[name]` the launch count,
    `where[name][key]` the contexts (`context`, set by the caller, e.g. (forward, bs)) that
    launched it. A diagnostic (it costs host time per launch), not for serving.

    `launch=False` (a dry run): record the key and skip the launch itself (outputs keep
    whatever the buffers held). For a census of the keys a forward launches at shapes too
    large for the interpreter, and for the precompile workers' plan; valid for forwards whose
    host code reads no device values (captured forwards: no host syncs), which is what
    `tests/test_compile_census.py` checks against real launches.

    `zero_ints` (with `launch=False`, on a throw-away engine): every integer tensor argument
    of a skipped launch is zeroed instead, so what the kernel would have written (token ids,
    indices, lengths) is 0 rather than stale memory when later torch ops index with it (a
    device-side bounds assert would end the process); the keys do not depend on values.
    `spare` (storage pointers, `storages(...)`): tensors never zeroed, the host-written inputs
    later host-side torch ops index with (an eager prefill's extend lengths).

    `order` lists the distinct `(name, key)` in the order first launched; `keep(index)`
    (index in `order`) True keeps that first launch's arguments in `kept` as
    `(name, key, args, kwargs, grid, context)`: `kernel.warmup(*args, grid=grid, **kwargs)`
    (Triton's compile without a launch) then compiles exactly that key
    (`precompile_workers.plan_keys`)."""

    def __init__(self, kernels_by_name: dict[str, object] | None = None, *,
                 launch: bool = True, keep=None, zero_ints: bool = False) -> None:
        self.kernels = dict(kernels_by_name) if kernels_by_name is not None else kernels()
        self.keys: dict[str, set] = defaultdict(set)
        self.launches: dict[str, int] = defaultdict(int)
        self.where: dict[str, dict] = defaultdict(lambda: defaultdict(set))
        self.order: list[tuple[str, tuple]] = []
        self.kept: list[tuple] = []
        self.launch = launch
        self.keep = keep
        self.zero_ints = zero_ints
        self.spare: frozenset = frozenset()
        self.context: object = None
        self._saved: list[tuple[object, object]] = []

    def __enter__(self) -> KeyRecorder:
        for name, k in self.kernels.items():
            run = k.run  # the bound method (or an outer recorder's wrapper)

            def wrapped(*args, _run=run, _k=k, _name=name, grid, warmup, **kwargs):
                key = specialization_key(_k, *args, **kwargs)
                if key not in self.keys[_name]:
                    if self.keep is not None and self.keep(len(self.order)):
                        self.kept.append((_name, key, args, kwargs, grid, self.context))
                    self.order.append((_name, key))
                self.keys[_name].add(key)
                self.launches[_name] += 1
                if self.context is not None:
                    self.where[_name][key].add(self.context)
                if not self.launch and not warmup:
                    if self.zero_ints:
                        _zero_int_tensors(args, kwargs, self.spare)
                    return None
                return _run(*args, grid=grid, warmup=warmup, **kwargs)

            self._saved.append((k, k.__dict__.get("run")))
            k.run = wrapped
        return self

    def __exit__(self, *exc) -> None:
        for k, prev in reversed(self._saved):
            if prev is None:
                del k.run
            else:
                k.run = prev
        self._saved.clear()

    def total(self) -> int:
        """Distinct keys over all kernels: the compiles these launches need on a GPU."""
        return sum(len(v) for v in self.keys.values())


def storages(*tensors: torch.Tensor) -> frozenset:
    """The storage pointers of `tensors` (`KeyRecorder.spare`)."""
    return frozenset(t.untyped_storage().data_ptr() for t in tensors)


def captured_forwards(*owners: object) -> dict[str, CapturedForward]:
    """Every `CapturedForward` attribute of the given objects (e.g. an engine and its
    drafter), by attribute name (`verify_graphs`, `decode_graphs`, ...), in discovery order."""
    out: dict[str, CapturedForward] = {}
    for o in owners:
        for name, v in vars(o).items():
            if isinstance(v, CapturedForward) and all(v is not w for w in out.values()):
                out[name] = v
    return out


def _forwards_of(engine) -> Iterator[tuple[object, dict[str, CapturedForward]]]:
    yield engine, captured_forwards(engine)
    drafter = getattr(engine, "drafter", None)
    if drafter is not None:
        yield drafter, captured_forwards(drafter)


_REPORTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def worker_report(engine):
    """The `precompile_workers.WorkerReport` of `engine`'s last `precompile_engine` (None:
    it asked for no workers, or they failed and the warm-up ran in this process)."""
    try:
        return _REPORTS.get(engine)
    except TypeError:  # not weak-referenceable
        return None


def _run_workers(engines: list, workers: int, progress: bool):
    """The worker phase over `engines` (`precompile_workers.run_workers`); a failed worker is
    logged and the in-process warm-up compiles the rest (None). Worker builds land in each
    engine's `GraphStats.worker_built`; every engine gets the report (`worker_report`)."""
    from graphdraft.kernels import precompile_workers as pw

    for e in engines:
        with contextlib.suppress(TypeError):
            _REPORTS.pop(e, None)  # this call's report or none
    try:
        report = pw.run_workers(engines, workers, progress=progress)
    except pw.PrecompileWorkerError as e:
        logger.warning("%s\nJIT warm-up: compiling in this process instead", e)
        return None
    for index, engine in enumerate(engines):
        _count_worker_builds(engine, report, index)
        with contextlib.suppress(TypeError):
            _REPORTS[engine] = report
    return report


def _count_worker_builds(engine, report, index: int) -> None:
    """Add the kernels the workers built for engine `index`'s capture tasks to each forward's
    `GraphStats.worker_built` (a prefill probe's builds belong to no captured forward: they
    stay in the report's totals only)."""
    from graphdraft.kernels.precompile_workers import PREFILL

    owners = {"engine": engine, "drafter": getattr(engine, "drafter", None)}
    for (owner, attr, bs), n in report.built_of(index).items():
        if attr != PREFILL:
            getattr(owners[owner], attr).stats.worker_built[bs] += n


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
        from graphdraft.kernels import precompile_workers as pw

        if not self._ended:
            self._ended = True
            if abort:
                self.phase.close()
                return None
            try:
                self._report = self.phase.finish()
            except pw.PrecompileWorkerError as e:
                logger.warning("%s\nJIT warm-up: the captures compile what the workers left", e)
        return self._report


_PHASES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""engine -> (its running `_SharedPhase`, its index in the phase's plan)."""


def start_precompile(engines, *, workers: int, progress: bool = True,
                     meanwhile: Callable[[], object] | None = None) -> bool:
    """Start one worker phase for `engines` (an engine or several: one plan, each key
    compiled once) and return once it runs; each engine's `capture_graphs` then adopts it:
    each bucket's first capture waits for its own kernels, and the capture's end
    (`finish_precompile`) waits for the phase. The phase reads none of the engines'
    weights (its plan and workers run throw-away engines of the same shapes), so they may
    be read meanwhile: `meanwhile` (e.g. `PendingWeights.read` of
    `checkpoint.open_model_pair`) runs in a thread from the start, beside the plan and the
    workers, and this returns once it is done too; its exception is raised here, the phase
    stopped. Engines whose cache is warm (their marker) are left out. False: no phase (no
    workers, a warm cache, a skip or a failed plan: `worker_report` or the log says which;
    `meanwhile` still runs); each capture then precompiles as usual."""
    engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    for e in engines:
        if e in _PHASES:
            raise RuntimeError("start_precompile: a compile phase already runs for this engine")
    from graphdraft.kernels.precompile_workers import run_beside

    joined = run_beside(meanwhile, "graphdraft-meanwhile") if meanwhile is not None else None
    try:
        started = _start_phase(engines, workers, progress)
    finally:
        try:
            if joined is not None:
                joined()  # its exception stops the phase
        except BaseException:
            for e in engines:
                finish_precompile(e, abort=True)
            raise
    return started


def _start_phase(engines: list, workers: int, progress: bool) -> bool:
    """`start_precompile` without `meanwhile`."""
    from graphdraft.kernels import precompile_workers as pw

    if not workers:
        return False
    for e in engines:
        with contextlib.suppress(TypeError):
            _REPORTS.pop(e, None)
    warm = [pw.is_warm(e) for e in engines]
    try:
        report, phase = pw.start_workers(engines, workers, progress=progress)
    except pw.PrecompileWorkerError as e:
        logger.warning("%s\nJIT warm-up: compiling in this process instead", e)
        return False
    if phase is None:
        return _without_phase(engines, report)
    shared = _SharedPhase(phase)
    adopted = False
    for index, engine in enumerate(engines):
        first = phase.first_tasks(index)
        if warm[index] or not first:  # not in the plan: its capture runs as without a phase
            continue
        owners = list(_forwards_of(engine))
        for owner, fw in owners:
            name = "engine" if owner is engine else "drafter"
            for attr, f in fw.items():
                f.before_capture = (lambda bs, _i=index, _t=(name, attr):
                                    phase.gate(_i, (*_t, bs)))
        _PHASES[engine] = (shared, index)
        _only_warm(engine, owners, first)
        adopted = True
    if not adopted:  # no capture gates on it (warm, or nothing to compile): stop it now
        report.skipped = "no capture needs it (warm caches or no Triton kernel to compile)"
        phase.close()
        return _without_phase(engines, report)
    # an engine dropped before its capture ends the phase: stop the workers, then the folder
    weakref.finalize(shared, phase.close)
    return True


def _without_phase(engines: list, report) -> bool:
    """No phase for `engines`: `report` (its `skipped` says why) is their `worker_report`;
    False, `_start_phase`'s answer."""
    for e in engines:
        with contextlib.suppress(TypeError):
            _REPORTS[e] = report
    return False


def _only_warm(engine, owners, tasks) -> None:
    """One warm-up (`warmup_iters` 1) for exactly the sizes of `tasks` (those that first
    launch a kernel in capture order), none for the others."""
    for owner, fw in owners:
        name = "engine" if owner is engine else "drafter"
        for attr, f in fw.items():
            f.warmup_iters = min(f.warmup_iters, 1)
            f.warmup_sizes = {bs for o, a, bs in tasks if (o, a) == (name, attr)}


def finish_precompile(engine, abort: bool = False):
    """End `engine`'s part of the worker phase `start_precompile` (or
    `precompile_engine(overlap=True)`) left running for its capture: wait for the phase
    (`CompilePhase.finish`; `abort`: stop it), put its builds for this engine into the
    forwards' `GraphStats.worker_built` and the report in `worker_report`, write the warm
    marker. A failed worker is logged (the capture compiled what it lacked). Returns the
    report, None without a phase, after an abort or a failure."""
    from graphdraft.kernels import precompile_workers as pw

    entry = _PHASES.pop(engine, None)
    for _, fw in _forwards_of(engine):
        for f in fw.values():
            f.before_capture = None
    if entry is None:
        return None
    shared, index = entry
    report = shared.finish(abort)
    if report is None:
        return None
    _count_worker_builds(engine, report, index)
    with contextlib.suppress(TypeError):
        _REPORTS[engine] = report
    pw.mark_warm(engine, warmup=shared.phase.first_tasks(index))
    return report


def precompile_running(engine) -> bool:
    """Whether a worker phase started for `engine` (`start_precompile`) awaits its capture."""
    return engine in _PHASES


def precompile_engine(engine, *, progress: bool = True, parallel: bool = False,
                      workers: int = 0, overlap: bool = False) -> dict[str, int]:
    """Run each captured forward of `engine` and `engine.drafter` once per size bucket of its
    schedule (`representative_sizes` with rows per request 1 and `engine.cfg.spec_num_tokens`),
    so `capture_graphs` compiles nothing more; return the compiles counted per forward.

    Call it inside `Engine.capture_graphs`, after the static inputs are padded (the warm-up
    forwards read them, as capture's own warm-up does). The drafter's buffers are reset to
    neutral values before and after (`_reset_neutral`, as its capture does).

    `parallel`: the engine's forwards and the drafter's run in two threads, so one compiles
    while the other launches or compiles (Triton's compiler releases the GIL in its C++
    passes and in ptxas). Their launches go to each forward's side stream; the draft
    forwards may then read target hidden states mid-write: finite values either way, and no
    index buffer is written by the other owner's forwards. Only compiling is the point.

    `workers`: first compile in that many worker processes into Triton's on-disk cache, each
    distinct key once (`precompile_workers.run_workers`; 0: not); the pass above is then
    skipped. A failed worker is logged and this process compiles the rest in the pass.
    After a complete precompile a marker in the cache lets later runs of the same engine shape
    skip the workers and the pass.

    Every forward precompiled here then warms up once per size bucket before its capture
    (`warmup_iters` at most 1, `warmup_sizes` the representative sizes: the largest of each
    bucket, captured first): that run loads the bucket's kernels (compiled by now) and does
    the lazy initialisation outside a capture; the bucket's smaller sizes launch the same
    kernels and are captured without one.

    `overlap` (with `workers`): the worker phase is only started here, and this returns at
    once: the capture then runs beside the compiles, each bucket's first capture waiting
    for its own kernels; the caller ends the phase with `finish_precompile(engine)` after
    its captures (`Engine.capture_graphs` does).

    No pass (returns {}) when the workers compiled every key (a complete worker phase), or
    for a warm cache (`precompile_workers.is_warm`: the marker an earlier complete precompile
    of this engine shape wrote, `mark_warm`; then no workers either): the one warm-up per
    bucket before its capture loads the kernels from the cache (and compiles one the cache
    lacks: `GraphStats.built` counts it there).
    """
    if engine in _PHASES:  # `start_precompile` ran: this capture adopts its phase
        return {}
    n = int(getattr(engine.cfg, "spec_num_tokens", 1))
    kc = getattr(engine.cfg, "kernels", None)  # the settings the forwards launch under
    owners = list(_forwards_of(engine))
    resets = [getattr(o, "_reset_neutral", None) for o, _ in owners if o is not engine]
    resets = [r for r in resets if r is not None]
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def work(forwards: dict[str, CapturedForward]) -> dict[str, int]:
        if device is not None:
            torch.cuda.set_device(device)  # the current device is per thread
        out = {}
        with torch.inference_mode():  # per thread too
            for f in forwards.values():
                sizes = representative_sizes(f.batch_sizes, (1, n), kernels=kc)
                out[f.name] = f.precompile(sizes, progress=progress)
        return out

    from graphdraft.kernels import precompile_workers as pw

    if not workers:
        with contextlib.suppress(TypeError):
            _REPORTS.pop(engine, None)
    warm = pw.is_warm(engine)

    def one_warmup() -> None:  # compiled (or in the cache): one warm-up per bucket loads them
        _only_warm(engine, owners, pw.tasks_of(engine))

    if workers and overlap:  # a skip's report (e.g. the warm marker) is in worker_report
        if start_precompile([engine], workers=workers, progress=progress):
            return {}  # warm-ups: the first tasks only
        report = None
    else:
        report = _run_workers([engine], workers, progress) if workers else None
    compiled = report is not None and report.skipped is None

    if warm or compiled:  # every key is in the cache: the capture warm-ups load them
        first = pw.warmup_tasks(engine) if warm else None
        if first is not None:  # the marker knows which captures first launch a kernel
            _only_warm(engine, owners, first)
        else:
            one_warmup()
        if compiled:
            pw.mark_warm(engine)
        logger.info("JIT warm-up: no in-process pass (%s); each bucket's one warm-up before its "
                    "capture loads its kernels from Triton's cache",
                    "the workers compiled every key" if compiled else
                    "Triton cache warm for this engine shape: marker found")
        return {}
    from capture.compiles import triton_builds

    b0 = triton_builds()
    for r in resets:
        r()
    counts: dict[str, int] = {}
    if parallel and len(owners) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(owners), thread_name_prefix="jit-warmup") as pool:
            for part in pool.map(work, [fw for _, fw in owners]):
                counts.update(part)
    else:
        for _, fw in owners:
            counts.update(work(fw))
    if device is not None:
        torch.cuda.synchronize()
    for r in resets:
        r()
    if report is not None:
        report.pass_built = triton_builds() - b0
    one_warmup()
    pw.mark_warm(engine)
    logger.info("JIT warm-up: %s", ", ".join(f"{k} {v} compiles" for k, v in counts.items()))
    return counts

