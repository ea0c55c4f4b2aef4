"""Compiling a schedule's Triton kernels in worker processes, into Triton's on-disk cache.

A cold `Engine.capture_graphs` spends most of its time in Triton's compiler, one kernel after
another in one process (`kernels.warmup.precompile_engine`: each captured forward once per size
bucket). Here that work is split over worker processes first, one compile per distinct
specialization key; the main process then runs no precompile pass: each size's one warm-up
before its capture loads the kernels from the cache instead of compiling them.

How a worker finds the keys: a Triton kernel is compiled per specialization key (constexprs,
launch options, argument dtypes, value / alignment specialization:
`warmup.specialization_key`), never per layer or weight value. A worker therefore builds an
engine of the SAME shapes (`WorkerSpec`: the target's and head's `ModelConfig`, dtype,
`RuntimeConfig` with its `KernelConfig` and the engine's KV page count, the draft vocab's size)
with random weights and only as many target layers as the code paths need
(`reduced_target_config`: layer 0 runs without a residual input, every later layer with one;
2 layers, the EAGLE-3 aux ids mapped onto them), and runs every (forward, batch size) task of
the precompile (`tasks_of`: each captured forward at one size per bucket,
`buckets.representative_sizes`) as a dry run (`warmup.KeyRecorder(launch=False)`: each
launch's key is recorded, no kernel runs, nothing compiles). Every worker runs the same
tasks in the same order, so all see the same distinct keys in the same order; worker i of n
keeps the arguments of the j-th new key for j % n == i and then compiles exactly those with
Triton's `JITFunction.warmup` (compile without launching, the recorded arguments: the same
key). No key is compiled twice, and the work splits per kernel, not per forward (one forward
at one size needs about half of all the schedule's kernels). `tests/test_precompile_workers.py`
checks on the CPU that a reduced engine launches exactly the keys of the full one, kernel by
kernel, and that the workers' shares together are exactly the keys the forwards launch over
the whole schedule.

Device memory: a worker holds its reduced engine (`worker_bytes` counts about 7 GB at the 8B
shape, with a 3 GiB margin);
no more workers start than the free memory holds (`memory_cap`, 4 GiB left to this process).

Processes: `sys.executable -m graphdraft.kernels.precompile_workers SPEC OUT` (a fresh
interpreter, so nothing of the caller's `__main__` re-runs, which a multiprocessing spawn would
do), with the caller's environment and `TRITON_CACHE_DIR` set to the caller's cache
(`capture.cache_dir()`: the user's `TRITON_CACHE_DIR` or Triton's default). The main process
waits (its engine's forwards run no dry pass: a skipped kernel leaves its outputs unwritten,
which only a throw-away engine may read). A tqdm bar counts compiled keys over all processes.
A worker that fails (exit status, timeout) raises `PrecompileWorkerError` with its log's tail;
`precompile_engine` logs it and compiles the rest in-process. Triton writes each cache file to
a temporary folder and renames it into place, the group file (what a lookup reads first) last,
so a killed worker leaves no entry that a later lookup would load half-written.

Warm caches: once a precompile finished (with workers or without), a marker file
`graphdraft-precompiled-<fingerprint>.json` in the cache folder (the fingerprint covers the
spec, the tasks, torch / triton versions, the GPU, the kernel sources and the TRITON_* /
GRAPHDRAFT_* environment) makes later runs skip the workers and the in-process precompile
pass (`warmup.precompile_engine`): capture's one warm-up per size loads each kernel from the
cache at its first launch. A stale marker only costs time: those warm-ups compile what is
missing. Without a marker the workers run and load what the cache has.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from capture import cache_dir
from graphdraft.config import ModelConfig, RuntimeConfig

__all__ = ["PrecompileWorkerError", "Task", "WorkerReport", "WorkerSpec", "compile_share",
           "default_workers", "engine_spec", "is_warm", "mark_warm", "memory_cap",
           "reduced_target_config",
           "run_workers", "tasks_of", "worker_bytes"]

logger = logging.getLogger(__name__)

MAX_DEFAULT_WORKERS = 16
ENV = "GRAPHDRAFT_PRECOMPILE_WORKERS"
WORKER_TIMEOUT_S = 600.0
_MARKER = "graphdraft-precompiled-{}.json"

Task = tuple[str, str, int]
"""(owner "engine" | "drafter", attribute of its `CapturedForward`, batch size)."""


class PrecompileWorkerError(RuntimeError):
    """A precompile worker process failed (its exit status and log tail are in the message)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to rebuild an engine whose kernels are the main engine's."""

    target: ModelConfig
    """The target's shape with the fewest layers (`reduced_target_config`)."""
    head: ModelConfig | None
    hot_tokens: int | None
    """Length of the head's draft->target id map (`hot_token_ids`), None without one."""
    runtime: RuntimeConfig
    """The engine's config (its `num_kv_pages` fixed: the KV pool keeps the engine's shape)."""
    dtype: str
    device: str
    cache_dir: str
    tasks: tuple[Task, ...] = ()
    share: tuple[int, int] = (0, 1)
    """(i, n): this worker compiles the j-th distinct key of the tasks' dry run for j % n == i."""


@dataclass
class WorkerReport:
    """What the worker phase did: worker processes, tasks (each worker dry-runs them all),
    `keys`: distinct specialization keys of the tasks, `compiled`: keys each worker compiled
    (built or loaded from the cache), `built`: kernels Triton's compiler built in the workers
    per (owner, attribute, bs) of the task that first launched the key, wall seconds of the
    phase and of each worker, why none ran if so."""

    workers: int = 0
    tasks: int = 0
    keys: int = 0
    compiled: list[int] = field(default_factory=list)
    built: dict[Task, int] = field(default_factory=dict)
    pass_built: int | None = None
    """Kernels this process built in `precompile_engine`'s in-process pass when it ran after
    a skipped worker phase (set by `precompile_engine`); None: no pass (the workers compiled
    every key, or a warm cache)."""
    wall_s: float = 0.0
    worker_wall_s: list[float] = field(default_factory=list)
    worker_startup_s: list[float] = field(default_factory=list)
    """Per worker: seconds to start (imports, CUDA, building its engine) before its dry run."""
    worker_plan_s: list[float] = field(default_factory=list)
    """Per worker: seconds of its dry run (finding the keys)."""
    skipped: str | None = None

    @property
    def total_built(self) -> int:
        return sum(self.built.values())


def default_workers(cfg: RuntimeConfig) -> int:
    """`cfg.precompile_workers`, or for None: the env var GRAPHDRAFT_PRECOMPILE_WORKERS (an int
    >= 0; anything else: ValueError naming it) if set, else min(16, CPU count) on CUDA (the
    main process only waits meanwhile); 0 on a CPU or under data parallelism."""
    n = getattr(cfg, "precompile_workers", None)
    if n is not None:
        return n
    if not str(cfg.device).startswith("cuda") or cfg.dp_size > 1:
        return 0
    env = os.environ.get(ENV, "").strip()
    if env:
        if not env.isdigit():
            raise ValueError(f"{ENV}: expected an int >= 0, got {env!r}")
        return int(env)
    return min(MAX_DEFAULT_WORKERS, os.cpu_count() or 1)


def reduced_target_config(mc: ModelConfig) -> ModelConfig:
    """`mc` with 2 layers (or fewer if it has fewer): layer 0 (no residual input) and one later
    layer (with one) launch every kernel variant the full stack does. The EAGLE-3 aux ids map
    onto them (id 0 stays 0, every other id becomes 1), so the aux width `k * H` is unchanged."""
    n = min(mc.num_hidden_layers, 2)
    ids = tuple(min(i, n - 1) for i in mc.aux_layer_ids())
    return dataclasses.replace(mc, num_hidden_layers=n, aux_hidden_state_layer_ids=ids)


def engine_spec(engine) -> tuple[WorkerSpec | None, str]:
    """The worker spec of `engine` (no tasks yet), or None and the reason when a worker cannot
    rebuild it: a caller's drafter, tensor or data parallelism, a model that is not the
    built-in Llama target / EAGLE-3 head."""
    from graphdraft.models.eagle3 import Eagle3DraftHead
    from graphdraft.models.llama import LlamaForCausalLM
    from graphdraft.runtime.drafter import EagleDrafter

    target = getattr(engine, "target", None)
    if type(target) is not LlamaForCausalLM or target.tp is not None or target.dp is not None:
        return None, "the target is not a plain LlamaForCausalLM (tensor / data parallel?)"
    if getattr(engine, "dp", None) is not None:
        return None, "data parallelism"
    drafter = getattr(engine, "drafter", None)
    head = None
    if drafter is not None:
        if type(drafter) is not EagleDrafter:
            return None, f"a caller's drafter ({type(drafter).__name__})"
        head = drafter.head
        if type(head) is not Eagle3DraftHead or head.tp is not None or head.dp is not None:
            return None, "the draft head is not a plain Eagle3DraftHead"
    cfg = engine.cfg
    hot = getattr(head, "hot_token_ids", None) if head is not None else None
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    spec = WorkerSpec(target=reduced_target_config(target.config),
                      head=head.config if head is not None else None,
                      hot_tokens=int(hot.shape[0]) if hot is not None else None,
                      runtime=cfg, dtype=cfg.dtype, device=str(device),
                      cache_dir=str(cache_dir()))
    return spec, ""


WORKER_OVERHEAD_BYTES = 3 << 30
"""A worker's device memory beyond its weights and KV pools: CUDA context, activations, the
allocator's slack, cuBLAS workspaces (a generous bound)."""


def _param_bytes(module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def worker_bytes(engine, spec: WorkerSpec) -> int:
    """Device memory one worker's engine takes (`spec`'s reduced target: the full target's
    bytes less the dropped layers; the head without the shared embedding; the KV pools at the
    reduced layer count; `WORKER_OVERHEAD_BYTES`)."""
    target = engine.target
    layers = len(target.layers)
    per_layer = _param_bytes(target.layers[0]) if layers else 0
    total = _param_bytes(target) - (layers - spec.target.num_hidden_layers) * per_layer
    drafter = getattr(engine, "drafter", None)
    if drafter is not None:
        shared = {target.embed_tokens.data_ptr()}
        total += sum(t.numel() * t.element_size() for t in drafter.head.parameters()
                     if t.data_ptr() not in shared)
        total += drafter.kv_pool.nbytes()
    total += engine.kv.nbytes() * spec.target.num_hidden_layers // max(layers, 1)
    return total + WORKER_OVERHEAD_BYTES


def memory_cap(engine, spec: WorkerSpec, workers: int) -> int:
    """`workers`, at most as many as the free device memory holds (`worker_bytes` each, 4 GiB
    left to this process's capture); unchanged without CUDA."""
    if not torch.cuda.is_available() or not spec.device.startswith("cuda"):
        return workers
    free, _ = torch.cuda.mem_get_info(torch.device(spec.device))
    fits = max(0, (free - (4 << 30)) // worker_bytes(engine, spec))
    return min(workers, int(fits))


def tasks_of(engine) -> list[Task]:
    """Every (owner, attribute, bs) the engine's precompile runs: each active captured forward
    of the engine and its drafter at its representative sizes (`precompile_engine`'s choice)."""
    from graphdraft.kernels.buckets import representative_sizes
    from graphdraft.kernels.warmup import captured_forwards

    n = int(getattr(engine.cfg, "spec_num_tokens", 1))
    kc = getattr(engine.cfg, "kernels", None)
    out: list[Task] = []
    owners = [("engine", engine)]
    if getattr(engine, "drafter", None) is not None:
        owners.append(("drafter", engine.drafter))
    for owner_name, owner in owners:
        for attr, f in captured_forwards(owner).items():
            if not getattr(f, "active", True):
                continue
            for bs in representative_sizes(f.batch_sizes, (1, n), kernels=kc):
                out.append((owner_name, attr, bs))
    return out


def compile_share(engine, tasks: Sequence[Task], share: tuple[int, int] = (0, 1),
                  on_plan=None, on_done=None) -> dict:
    """Dry-run each task's forward (owner, attribute, bs) under a `KeyRecorder(launch=False)` of
    every kernel (`warmup.all_kernels`), the engine's and drafter's buffers reset to neutral
    rows before and after each; keep the j-th distinct key for `j % n == i` (`share` (i, n));
    then compile the kept keys (`kernel.warmup` with the recorded arguments: Triton's compile, no
    launch). `on_plan(kept, total)` after the dry run, `on_done()` after each compile.
    Returns {"keys": distinct keys, "compiled": [(kernel, key, task)], "built": {task: n},
    "plan_s": seconds of the dry run}: the builds (cache misses, `capture.compiles`) counted
    per task that first launched the key. A throw-away engine only: skipped kernels leave
    their float outputs unwritten and zero their integer arguments (`zero_ints`)."""
    from capture.compiles import triton_builds
    from graphdraft.kernels.warmup import KeyRecorder, all_kernels

    i, n = share
    if not (isinstance(n, int) and isinstance(i, int) and n >= 1 and 0 <= i < n):
        raise ValueError(f"share: expected (i, n) with 0 <= i < n, got {share!r}")
    owners = {"engine": engine, "drafter": getattr(engine, "drafter", None)}
    resets = [getattr(o, "_reset_neutral", None) for o in owners.values() if o is not None]
    resets = [r for r in resets if r is not None]
    t0 = time.perf_counter()
    rec = KeyRecorder(all_kernels(), launch=False, keep=lambda j: j % n == i, zero_ints=True)
    with torch.inference_mode(), torch.no_grad(), rec:
        for task in tasks:
            owner, attr, bs = task
            for r in resets:
                r()
            rec.context = task
            getattr(owners[owner], attr)._forward(bs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for r in resets:
        r()
    plan_s = time.perf_counter() - t0
    if on_plan is not None:
        on_plan(len(rec.kept), rec.total())
    built: dict[Task, int] = {}
    compiled = []
    for name, key, args, kwargs, grid, task in rec.kept:
        b0 = triton_builds()
        build_launcher(rec.kernels[name].warmup(*args, grid=grid, **kwargs))
        built[task] = built.get(task, 0) + triton_builds() - b0
        compiled.append((name, key, task))
        if on_done is not None:
            on_done()
    rec.kept.clear()  # the recorded arguments (activations) are not kept alive
    return {"keys": rec.total(), "compiled": compiled, "built": built, "plan_s": plan_s}


def build_launcher(compiled) -> bool:
    """Build (and leave in Triton's on-disk cache) the host launcher of a kernel `warmup` just
    compiled. Triton 3.6 generates a C launcher per argument signature and builds it with the
    system compiler at a kernel's first launch (`CudaLauncher`: `compile_module_from_src`,
    cached by its source), not at `warmup`: the 2026-12-04 H200 run spent 8.5 s of the main
    process's capture warm-ups on those builds after the workers had compiled every kernel
    (2.0 s warm). `CompiledKernel._init_handles()` loads the module and makes the launcher
    here. Returns whether it ran (False: no such hook, e.g. the interpreter, or it failed:
    the first launch then builds it, as before)."""
    init = getattr(compiled, "_init_handles", None)
    if not callable(init):
        return False
    try:
        init()
    except Exception as exc:  # a private Triton hook: never fail the worker over it
        logger.debug("launcher build skipped: %s", exc)
        return False
    return True


# ------------------------------------------------------------------ the worker process
def build_engine(spec: WorkerSpec):
    """The worker's engine: random weights of the spec's shapes on its device."""
    from graphdraft.config import resolve_dtype
    from graphdraft.models.layers import init_random_
    from graphdraft.models.llama import LlamaForCausalLM
    from graphdraft.models.random_models import random_model_pair
    from graphdraft.serving.engine import Engine

    dtype = resolve_dtype(spec.dtype)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if spec.head is None:
        with device:
            target = LlamaForCausalLM(spec.target, dtype)
            init_random_(target, 0, std=0.02)
        target.to(device)
        return Engine(target, spec.runtime)
    hot = None
    if spec.hot_tokens is not None:
        hot = torch.randperm(spec.target.vocab_size,
                             generator=torch.Generator().manual_seed(0))[: spec.hot_tokens]
    target, head = random_model_pair(spec.target, spec.head, dtype, 0, std=0.02,
                                     hot_token_ids=hot, device=device)
    return Engine(target, spec.runtime, head)


def worker_main(spec_path: Path, out_path: Path) -> int:
    """One worker: build the engine of `spec_path` (a pickled `WorkerSpec`), compile its share
    of the tasks' keys (`compile_share`), append to `out_path.progress` a line `keys K` (its
    share's size) after the dry run and a line `1` per compiled key, write `out_path` (JSON:
    builds per task, keys, seconds)."""
    t0 = time.perf_counter()
    with open(spec_path, "rb") as fh:
        spec: WorkerSpec = pickle.load(fh)
    from capture.compiles import install_triton_counter

    install_triton_counter()
    engine = build_engine(spec)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the fp32 draws of the random init: not kept reserved
    t_built = time.perf_counter()
    progress = Path(str(out_path) + ".progress")

    def line(text: str) -> None:
        with open(progress, "a") as fh:
            fh.write(text + "\n")

    res = compile_share(engine, spec.tasks, spec.share,
                        on_plan=lambda kept, total: line(f"keys {kept}"),
                        on_done=lambda: line("1"))
    data = {"built": [[*t, k] for t, k in res["built"].items()], "keys": res["keys"],
            "compiled": len(res["compiled"]), "startup_s": round(t_built - t0, 3),
            "plan_s": round(res["plan_s"], 3), "wall_s": round(time.perf_counter() - t0, 3)}
    tmp = Path(str(out_path) + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(out_path)
    return 0


# ------------------------------------------------------------------ the main process
def _fingerprint(spec: WorkerSpec, tasks: Sequence[Task]) -> str:
    """What decides which kernels a precompile of `spec` compiles (see the module docstring)."""
    import triton

    kdir = Path(__file__).resolve().parent
    src = hashlib.sha256()
    for p in sorted(kdir.glob("*.py")):
        src.update(p.name.encode())
        src.update(p.read_bytes())
    dev = ""
    if torch.cuda.is_available() and spec.device.startswith("cuda"):
        d = torch.device(spec.device)
        dev = f"{torch.cuda.get_device_name(d)} {torch.cuda.get_device_capability(d)}"
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(("TRITON_", "GRAPHDRAFT_")))
    shape = dataclasses.replace(spec, cache_dir="", device="", tasks=(),
                                runtime=spec.runtime.replace(precompile_workers=None))
    parts = [repr(shape), repr(sorted(tasks)),
             torch.__version__, triton.__version__, dev, src.hexdigest(), repr(env)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _marker(spec: WorkerSpec, tasks: Sequence[Task]) -> Path:
    return Path(spec.cache_dir) / _MARKER.format(_fingerprint(spec, tasks))


def is_warm(engine) -> bool:
    """The warm-cache marker of `engine` (`mark_warm`) is in Triton's cache folder: an earlier
    precompile of this engine shape finished there."""
    spec, _ = engine_spec(engine)
    tasks = tasks_of(engine)
    return spec is not None and bool(tasks) and _marker(spec, tasks).exists()


def mark_warm(engine) -> Path | None:
    """Write the warm-cache marker of `engine` (after its precompile finished); None when no
    worker could rebuild it, nothing is captured, or the cache folder is not writable."""
    spec, _ = engine_spec(engine)
    tasks = tasks_of(engine)
    if spec is None or not tasks:
        return None
    path = _marker(spec, tasks)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"tasks": len(tasks), "time": time.time()}))
        tmp.replace(path)
    except OSError as e:
        logger.debug("precompile marker not written: %s", e)
        return None
    return path


def _launch(spec_path: Path, out_path: Path, log_path: Path, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "graphdraft.kernels.precompile_workers", str(spec_path),
           str(out_path)]
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def _env(spec: WorkerSpec) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=spec.cache_dir, PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parents[2])  # the folder holding graphdraft/
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in paths if p != root])
    return env


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"


def _read_progress(out: Path) -> tuple[int | None, int]:
    """A worker's progress file: (its share's key count once announced, keys compiled)."""
    try:
        lines = Path(str(out) + ".progress").read_text().splitlines()
    except OSError:
        return None, 0
    share = next((int(x.split()[1]) for x in lines if x.startswith("keys ")), None)
    return share, sum(1 for x in lines if x == "1")


def run_workers(engine, workers: int, *, progress: bool = True,
                timeout_s: float = WORKER_TIMEOUT_S) -> WorkerReport:
    """Compile `engine`'s schedule kernels into Triton's cache with `workers` processes, each
    a share of the distinct keys (module docstring); return what they did. No processes
    (`report.skipped` says why) when `workers` is 0, nothing is to be captured, the engine
    cannot be rebuilt, fewer than 2 workers fit in the free GPU memory (one would compile
    everything serially, as this process does), or the marker says the cache is warm.
    Raises PrecompileWorkerError when a worker fails (the others are stopped); ValueError
    for `workers < 0`."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"precompile_workers: expected an int >= 0, got {workers!r}")
    report = WorkerReport()
    if workers == 0:
        report.skipped = "precompile_workers=0"
        return report
    tasks = tasks_of(engine)
    spec, why = engine_spec(engine)
    if not tasks:
        report.skipped = "nothing to capture"
    elif spec is None:
        report.skipped = why
    elif _marker(spec, tasks).exists():
        report.skipped = "Triton cache warm for this engine (marker found)"
    if report.skipped:
        logger.info("precompile workers: none (%s)", report.skipped)
        return report
    fit = memory_cap(engine, spec, workers)
    if fit < workers:
        logger.info("precompile workers: %d instead of %d (free GPU memory for ~%.1f GiB each)",
                    fit, workers, worker_bytes(engine, spec) / (1 << 30))
    if fit < 2:
        report.skipped = ("one worker only" if fit else "not enough free GPU memory for a worker")
        logger.info("precompile workers: none (%s)", report.skipped)
        return report
    report.workers, report.tasks = fit, len(tasks)
    t0 = time.perf_counter()
    env = _env(spec)
    procs: list[tuple[subprocess.Popen, Path, Path, Path]] = []
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - a declared dependency
        tqdm = None
    bar = tqdm(total=None, desc=f"JIT warm-up ({fit} workers)", unit="kernel") \
        if progress and tqdm is not None else None

    def update() -> None:
        if bar is None:
            return
        states = [_read_progress(out) for _, out, _, _ in procs]
        if all(k is not None for k, _ in states) and bar.total is None:
            bar.total = sum(k for k, _ in states)
        bar.n = sum(c for _, c in states)
        bar.refresh()

    with tempfile.TemporaryDirectory(prefix="graphdraft-precompile-") as tmp:
        try:
            for i in range(fit):
                sp, out, log = (Path(tmp) / f"spec{i}.pkl", Path(tmp) / f"out{i}.json",
                                Path(tmp) / f"log{i}.txt")
                with open(sp, "wb") as fh:
                    pickle.dump(dataclasses.replace(spec, tasks=tuple(tasks), share=(i, fit)), fh)
                procs.append((_launch(sp, out, log, env), out, log, sp))
            logger.info("precompile: the keys of %d tasks over %d worker processes",
                        len(tasks), fit)
            deadline = time.monotonic() + timeout_s
            pending = list(range(len(procs)))
            while pending:
                for j in list(pending):
                    p, out, log, _ = procs[j]
                    rc = p.poll()
                    if rc is None:
                        continue
                    pending.remove(j)
                    if rc != 0 or not out.exists():
                        raise PrecompileWorkerError(
                            f"precompile worker {j + 1} failed (exit status {rc}); its log "
                            f"ends:\n{_tail(log)}")
                    data = json.loads(out.read_text())
                    for owner, attr, bs, n in data["built"]:
                        t = (owner, attr, int(bs))
                        report.built[t] = report.built.get(t, 0) + int(n)
                    report.keys = max(report.keys, int(data.get("keys", 0)))
                    report.compiled.append(int(data.get("compiled", 0)))
                    report.worker_wall_s.append(float(data["wall_s"]))
                    report.worker_startup_s.append(float(data["startup_s"]))
                    report.worker_plan_s.append(float(data.get("plan_s", 0.0)))
                update()
                if pending and time.monotonic() > deadline:
                    raise PrecompileWorkerError(
                        f"precompile workers {[j + 1 for j in pending]} did not finish within "
                        f"{timeout_s:.0f} s; the log of worker {pending[0] + 1} ends:\n"
                        f"{_tail(procs[pending[0]][2])}")
                if pending:
                    time.sleep(0.02)
        finally:
            for p, *_ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if bar is not None:
                bar.close()
    report.wall_s = time.perf_counter() - t0
    logger.info("precompile workers: %d processes, %d keys of %d tasks, %d kernels built, "
                "%.2f s", report.workers, report.keys, report.tasks, report.total_built,
                report.wall_s)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m graphdraft.kernels.precompile_workers SPEC.pkl OUT.json",
              file=sys.stderr)
        return 2
    return worker_main(Path(args[0]), Path(args[1]))


if __name__ == "__main__":
    sys.exit(main())
