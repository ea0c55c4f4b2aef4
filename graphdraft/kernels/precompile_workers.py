"""Compiling a schedule's Triton kernels in worker processes, into Triton's on-disk cache.

A cold `Engine.capture_graphs` spends most of its time in Triton's compiler, one kernel after
another in one process (`kernels.warmup.precompile_engine`: each captured forward once per size
bucket). Here that work is spread over worker processes first, one compile per distinct
specialization key; the main process then runs no precompile pass: each size's warm-up before
its capture loads the kernels from the cache instead of compiling them.

The plan (this process). A Triton kernel is compiled per specialization key (constexprs,
launch options, argument dtypes, value / alignment specialization:
`warmup.specialization_key`), never per layer or weight value. `plan_keys` therefore builds a
throw-away engine of the SAME shapes (`WorkerSpec`: the target's and head's `ModelConfig`,
dtype, `RuntimeConfig` with its `KernelConfig` and the engine's KV page count, the draft
vocab's size) with random weights and only as many target layers as the code paths need
(`reduced_target_config`: layer 0 runs without a residual input, every later layer with one;
2 layers, the EAGLE-3 aux ids mapped onto them), and dry-runs every (forward, batch size) task
(`tasks_of`: each captured forward at one size per bucket, `buckets.representative_sizes`,
then a few eager prefill steps, `prefill_probes`, so the first requests compile nothing)
under `warmup.KeyRecorder(launch=False)`: each launch's key is recorded, no kernel runs.
Each distinct key becomes one `PlanEntry`: the kernel's name and its first launch's arguments
as data (`encode_arg`: a tensor as its dtype and 16-byte alignment, scalars as they are).
`tests/test_precompile_workers.py` checks on the CPU that a reduced engine launches exactly the
keys of the full one, kernel by kernel, and that the decoded arguments (`decode_arg`: tensors
become Triton's `MockTensor`s of that dtype and alignment) give every entry's key back.

The workers. A server process, forked from this one (`_launch`: torch, Triton and the kernel
modules are imported already, and nothing of the caller's `__main__` re-runs, which a
multiprocessing spawn would do; without `os.fork`, the command
`python -m graphdraft.kernels.precompile_workers DIR N` in a fresh interpreter), starts while
this process plans and forks N workers (`server_main`). Neither touches CUDA, so forking a
process that uses it is safe (as for a DataLoader's workers). Each waits for `DIR/plan.json`
(the compile target), then takes entries in plan order as the plan streams in (`plan_keys`
hands out each task's keys as soon as its dry run fixed their order: `DIR/plan.<c>.json`,
then `DIR/plan.end`; the workers compile while the rest is planned), each by creating
`DIR/claims/<j>` exclusively (no entry compiled twice, none idle while work is left), and compiles it with Triton's `JITFunction.warmup` (compile
without a launch: the same key) and its host launcher (`build_launcher`). No worker builds an
engine or opens a CUDA context: Triton's compile target, device and stream come with the plan
(`_use_target`; 16 workers initialising CUDA side by side took 2.2 s each), and a kernel's
launcher is built without loading its module. This process takes entries too while it waits. A tqdm
bar counts compiled keys over all processes; the worker processes get the caller's
environment with `TRITON_CACHE_DIR` set to the caller's cache (`capture.cache_dir()`: the
user's `TRITON_CACHE_DIR` or Triton's default). A worker that fails (exit status, timeout)
raises `PrecompileWorkerError` with its log's tail; `precompile_engine` logs it and compiles the
rest in-process. Triton writes each cache file to a temporary folder and renames it into
place, the group file (what a lookup reads first) last, so a killed worker leaves no entry
that a later lookup would load half-written. Several engines (the demo's target-only and
speculative ones) share one worker phase: their keys are planned together, none twice.

Warm caches: once a precompile finished (with workers or without), a marker file
`graphdraft-precompiled-<fingerprint>.json` in the cache folder (the fingerprint covers the
spec with its kernel settings, the tasks, torch / triton versions, the GPU, the kernel
sources and the TRITON_* environment) makes later runs skip the workers and the in-process precompile
pass (`warmup.precompile_engine`): capture's warm-ups load each kernel from the cache at its
first launch. A stale marker only costs time: those warm-ups compile what is missing.
Without a marker the workers run and load what the cache has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from capture import cache_dir
from graphdraft.config import ModelConfig, RuntimeConfig
from graphdraft.kernels import compiler_key

__all__ = ["CompilePhase", "LAUNCHER_CFLAGS", "PlanEntry", "PrecompileWorkerError", "Task", "WorkerReport", "WorkerSpec",
           "build_launcher", "compile_entry", "cost_cache_path", "current_target", "decode_arg", "default_workers", "encode_arg",
           "engine_spec", "is_warm", "mark_warm", "warmup_tasks", "memory_cap", "plan_bytes", "plan_keys",
           "PREFILL", "prefill_probes", "probe_prefill", "quick_launcher_builds", "reduced_target_config", "run_workers", "start_workers", "tasks_of"]

logger = logging.getLogger(__name__)

MAX_DEFAULT_WORKERS = 16
ENV = "GRAPHDRAFT_PRECOMPILE_WORKERS"
WORKER_TIMEOUT_S = 600.0
_MARKER = "graphdraft-precompiled-{}.json"
_PLAN = "plan.json"
_CHUNK = "plan.{}.json"
_PLAN_END = "plan.end"
_SPAWNED_ENV = "GRAPHDRAFT_WORKER_SPAWNED"
_FORKED = False
"""True in a process `_fork` made (its inherited objects stay frozen: `_fork`)."""

Task = tuple[str, str, int]
"""(owner "engine" | "drafter", attribute of its `CapturedForward`, batch size), or
("engine", PREFILL, tokens): one eager prefill step of that many prompt tokens
(`probe_prefill`)."""

PREFILL = "prefill"
"""A task's attribute for an eager prefill step (no captured forward): `prefill_probes`."""

_HEAVY_FIRST = ("extend_attention", "decode_attention", "gemv", "tree_", "rope", "norm")
"""Kernel modules in the order their keys go into the plan (the longest compiles first, so
the last compile to start is a short one); the other modules follow."""


class PrecompileWorkerError(RuntimeError):
    """A precompile worker process failed (its exit status and log tail are in the message)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What the plan's throw-away engine needs to launch the main engine's kernels."""

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


@dataclass(frozen=True)
class PlanEntry:
    """One distinct specialization key of the plan: `kernel` (`warmup.all_kernels()` name),
    its first launch's arguments as JSON data (`encode_arg`), and the first capture task that
    launches it (engine index among the planned engines, then the `Task`; a prefill probe's
    where no capture does)."""

    kernel: str
    args: list
    kwargs: dict
    engine: int
    task: Task

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "args": self.args, "kwargs": self.kwargs,
                "engine": self.engine, "task": list(self.task)}

    @classmethod
    def from_json(cls, d: dict) -> PlanEntry:
        owner, attr, bs = d["task"]
        return cls(d["kernel"], d["args"], d["kwargs"], int(d["engine"]), (owner, attr, int(bs)))


@dataclass
class WorkerReport:
    """What the worker phase did: worker processes, tasks (over every planned engine),
    `keys`: distinct specialization keys of the plan, `compiled`: keys each worker compiled
    (built or loaded from the cache; this process's share is `compiled_here`), `built`:
    kernels Triton's compiler built per (engine index, owner, attribute, bs) of the task that
    first launched the key, wall seconds of the phase, of the plan and of each worker, why
    none ran if so."""

    workers: int = 0
    tasks: int = 0
    keys: int = 0
    compiled: list[int] = field(default_factory=list)
    compiled_here: int = 0
    built_here: int = 0
    """Of `built`: the kernels this process's compiler built in the phase."""
    built: dict[tuple[int, str, str, int], int] = field(default_factory=dict)
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


def _param_bytes(module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def plan_bytes(engine, spec: WorkerSpec) -> int:
    """Device memory the plan's throw-away engine takes (`spec`'s reduced target: the full
    target's bytes less the dropped layers; the head without the shared embedding; the KV
    pools at the reduced layer count; `PLAN_OVERHEAD_BYTES`)."""
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
    return total + PLAN_OVERHEAD_BYTES


WORKER_CONTEXT_BYTES = 1 << 30
"""A worker's device memory: its CUDA context and the modules it loads (a generous bound)."""

PLAN_OVERHEAD_BYTES = 3 << 30
"""The plan's throw-away engine beyond its weights and KV pools: activations, the allocator's
slack, cuBLAS workspaces (a generous bound)."""


def memory_cap(engine, spec: WorkerSpec, workers: int) -> int:
    """`workers`, at most as many as the free device memory holds once the plan's
    throw-away engine (`plan_bytes`) and 4 GiB for this process's capture are set aside
    (`WORKER_CONTEXT_BYTES` each); 0 when the throw-away engine does not fit. Unchanged
    without CUDA."""
    if not torch.cuda.is_available() or not spec.device.startswith("cuda"):
        return workers
    free, _ = torch.cuda.mem_get_info(torch.device(spec.device))
    left = free - (4 << 30) - plan_bytes(engine, spec)
    return min(workers, max(0, int(left // WORKER_CONTEXT_BYTES)))


def tasks_of(engine) -> list[Task]:
    """Every (owner, attribute, bs) the engine's precompile runs: each active captured forward
    of the engine and its drafter at its representative sizes (`precompile_engine`'s choice),
    in the order `capture_graphs` captures them (`engine.capture_sequence()` where it has
    one; each forward's sizes largest first), then its prefill probes (`prefill_probes`:
    what the first requests' eager prefill launches, compiled beside the capture instead of
    at the first request). Empty when nothing is captured."""
    from graphdraft.kernels.buckets import representative_sizes
    from graphdraft.kernels.warmup import captured_forwards

    n = int(getattr(engine.cfg, "spec_num_tokens", 1))
    kc = getattr(engine.cfg, "kernels", None)
    seq = getattr(engine, "capture_sequence", None)
    rank = {id(f): i for i, f in enumerate(seq())} if callable(seq) else {}
    out: list[tuple[int, Task]] = []
    owners = [("engine", engine)]
    if getattr(engine, "drafter", None) is not None:
        owners.append(("drafter", engine.drafter))
    for owner_name, owner in owners:
        for attr, f in captured_forwards(owner).items():
            if not getattr(f, "active", True):
                continue
            for bs in representative_sizes(f.batch_sizes, (1, n), kernels=kc):
                out.append((rank.get(id(f), len(rank)), (owner_name, attr, bs)))
    if not out:
        return []
    tasks = [t for _, t in sorted(out, key=lambda x: x[0])]
    if not callable(getattr(engine, "add_request", None)):  # not a serving engine
        return tasks
    return tasks + [("engine", PREFILL, t) for t in prefill_probes(engine)]


def _prefill_row_cap(engine) -> int:
    """The longest prompt `engine` accepts with one new token (`Engine.check_request`)."""
    return max(1, engine.cfg.max_context_len - 1 - engine._lookahead())


def prefill_probes(engine) -> list[int]:
    """Prompt tokens of the prefill steps the plan dry-runs (`probe_prefill`): one row whose
    length picks each extend-attention tile case of ragged rows
    (`extend_attention.RAGGED_TILE_CASES` over the target's grouped heads: 4 and 32 tokens
    for 4 heads a kv head; split KV), and a full chunk (`max_num_batched_tokens` over rows of
    the longest prompt: few KV splits or one). What a prefill launches depends on its tokens only through such buckets (the tile
    and splits, GEMV or cuBLAS by rows): a chunk of another bucket compiles its kernels at
    its first use."""
    import triton

    from graphdraft.kernels.extend_attention import RAGGED_TILE_CASES

    cfg, mc = engine.cfg, engine.target.config
    g_pad = triton.next_power_of_2(max(1, mc.num_attention_heads // mc.num_key_value_heads))
    cap = _prefill_row_cap(engine)
    rows = max(1, min(cfg.max_running_requests, cfg.max_num_batched_tokens // cap or 1))
    full = min(cfg.max_num_batched_tokens, rows * cap)
    return sorted({min(max(1, case // g_pad), cap, full) for case in RAGGED_TILE_CASES} | {full})


def probe_prefill(engine, tokens: int) -> None:
    """One engine step that prefills `tokens` prompt tokens (rows of at most the longest
    prompt, one new token each), then the engine as before: the requests aborted, the step
    retired (`Engine.drain`; an aborted row is skipped). Under `KeyRecorder(launch=False)`
    this records the keys an eager prefill launches (its host code reads no device value);
    on a live engine it is a warm-up prefill."""
    from graphdraft.serving.verify import SamplingParams

    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens: expected an int >= 1, got {tokens!r}")
    if engine.has_work:
        raise RuntimeError("probe_prefill: expected an idle engine (requests would be mixed in)")
    cap = _prefill_row_cap(engine)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    reqs = []
    try:
        while tokens > 0:
            n = min(cap, tokens)
            reqs.append(engine.add_request([1] * n, params))
            tokens -= n
        engine.step()
    finally:
        for r in reqs:
            engine.abort(r)
        engine.drain()


def probe_prefill_dry(engine, tokens: int, rec) -> None:
    """`probe_prefill` under a dry-run `KeyRecorder(zero_ints=True)` `rec`: the engine's
    host-written inputs are spared from the zeroing (its host code indexes with them)."""
    from graphdraft.kernels.warmup import storages

    rec.spare = storages(*vars(engine.inputs).values())
    try:
        probe_prefill(engine, tokens)
    finally:
        rec.spare = frozenset()


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


# ------------------------------------------------------------------ the plan
def encode_arg(v):
    """A launch argument as JSON data: a tensor as {"tensor": dtype name, "aligned": its
    pointer % 16 == 0} (all Triton's key reads of it), None / bool / int / float / str as
    they are. TypeError for anything else (the key could not be rebuilt from it)."""
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype).removeprefix("torch."), "aligned": v.data_ptr() % 16 == 0}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"precompile plan: cannot encode a launch argument of type "
                    f"{type(v).__name__} ({v!r})")


def decode_arg(v):
    """`encode_arg`'s inverse for Triton's key: a tensor becomes a `MockTensor` of its dtype
    whose `data_ptr()` has its alignment (0 or 8); scalars stay."""
    if isinstance(v, dict):
        return _MockPointer(getattr(torch, v["tensor"]), bool(v["aligned"]))
    return v


class _MockPointer:
    """Stands for a tensor in `JITFunction.warmup` (Triton's `MockTensor` with a chosen
    alignment): Triton reads a pointer argument's dtype and `data_ptr() % 16` for its key."""

    def __init__(self, dtype: torch.dtype, aligned: bool) -> None:
        self.dtype = dtype
        self.shape = [1]
        self._ptr = 0 if aligned else 8

    def data_ptr(self) -> int:
        return self._ptr

    @staticmethod
    def ptr_range() -> int:
        return 0

    @staticmethod
    def stride() -> tuple[int, ...]:
        return (1,)


def _heavy_rank(kernel_name: str) -> int:
    mod = kernel_name.split(".", 1)[0]
    return next((i for i, p in enumerate(_HEAVY_FIRST) if mod.startswith(p)), len(_HEAVY_FIRST))


_PLAN_NOW = _HEAVY_FIRST.index("tree_")
"""A prefill probe's keys of the modules before this rank (attention, GEMV: the longest
compiles) go into the plan at once; its lighter keys wait for a capture that launches them."""


def plan_keys(plans: Sequence[tuple[int, WorkerSpec, Sequence[Task]]], emit=None, event=None
              ) -> tuple[list[PlanEntry], int, dict[tuple[int, Task], list[int]]]:
    """Dry-run each (engine index, spec, tasks) on a throw-away engine of the spec
    (`build_engine`, freed after) under one `KeyRecorder(launch=False, zero_ints=True)` of
    every kernel (`warmup.all_kernels`), the engine's and drafter's buffers reset to neutral
    rows before each task; return one `PlanEntry` per distinct key over all of them (its
    first launch's arguments, `encode_arg`), the key count, and per (engine index, task) the
    positions of the entries it launches (what a capture of that task waits for when it
    overlaps the compiles).

    The order is fixed as the dry runs go, and `emit(batch)` (if given) gets each batch of
    entries at once, so workers compile while the rest is planned: an engine's prefill
    probes run first and their attention / GEMV keys (the longest compiles) lead; then each
    capture task in capture order adds the keys it launches that are not planned yet
    (heavy kernels first), the probes' lighter keys among them; the probes' keys no capture
    launches come last. Each entry's `task` is the first capture task that launches it (the
    one whose capture warms it up: `CompilePhase.first_tasks`), else its probe. `event(name)`
    (if given) marks the plan's steps: "engine" (a throw-away engine built), "probes" (its
    prefill probes dry-run)."""
    from graphdraft.kernels.warmup import KeyRecorder, all_kernels

    rec = KeyRecorder(all_kernels(), launch=False, keep=lambda j: True, zero_ints=True)
    entries: list[PlanEntry] = []
    keys: list[tuple[str, tuple]] = []
    held: list[tuple[PlanEntry, tuple[str, tuple]]] = []

    def release(batch: list[tuple[PlanEntry, tuple[str, tuple]]]) -> None:
        batch = sorted(batch, key=lambda x: _heavy_rank(x[0].kernel))  # stable
        for entry, key in batch:
            entries.append(entry)
            keys.append(key)
        if emit is not None and batch:
            emit([entry for entry, _ in batch])

    first_capture: dict[tuple[str, tuple], tuple[int, Task]] = {}
    for index, spec, tasks in plans:
        device = torch.device(spec.device)
        ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        order = [t for t in tasks if t[1] == PREFILL] + [t for t in tasks if t[1] != PREFILL]
        with ctx:
            engine = build_engine(spec)
            if event is not None:
                event("engine")
            probes_left = sum(t[1] == PREFILL for t in order)
            owners = {"engine": engine, "drafter": getattr(engine, "drafter", None)}
            resets = [getattr(o, "_reset_neutral", None) for o in owners.values() if o is not None]
            resets = [r for r in resets if r is not None]
            with torch.inference_mode(), torch.no_grad(), rec:
                for task in order:
                    owner, attr, bs = task
                    for r in resets:
                        r()
                    rec.context = (index, task)
                    if attr == PREFILL:
                        probe_prefill_dry(engine, bs, rec)
                    else:
                        getattr(owners[owner], attr)._forward(bs)
                    new = [(PlanEntry(name, [encode_arg(a) for a in args],
                                      {k: encode_arg(v) for k, v in kwargs.items()}, i, t),
                            (name, key))
                           for name, key, args, kwargs, _grid, (i, t) in rec.kept]
                    rec.kept.clear()  # the recorded arguments (activations) are not kept alive
                    if attr == PREFILL:
                        held += [x for x in new if _heavy_rank(x[0].kernel) >= _PLAN_NOW]
                        release([x for x in new if _heavy_rank(x[0].kernel) < _PLAN_NOW])
                        probes_left -= 1
                        if event is not None and not probes_left:
                            event("probes")
                        continue
                    for _, key in new:
                        first_capture.setdefault(key, (index, task))
                    launched = [x for x in held if (index, task) in rec.where[x[1][0]][x[1][1]]]
                    held = [x for x in held if x not in launched]
                    for _, key in launched:
                        first_capture.setdefault(key, (index, task))
                    release(new + launched)
            if device.type == "cuda":
                torch.cuda.synchronize()
        del engine, owners, resets
        if device.type == "cuda":
            torch.cuda.empty_cache()
    release(held)
    rank = {(i, t): r for r, (i, t) in enumerate(
        (i, t) for i, _, ts in plans for t in ts if t[1] != PREFILL)}
    for j, key in enumerate(keys):  # a key a probe launched first: the capture that warms it up
        first = first_capture.get(key)
        if first is None:
            capture = [c for c in rec.where[key[0]][key[1]] if c in rank]
            first = min(capture, key=rank.__getitem__) if capture else None
        if first is not None and (entries[j].engine, entries[j].task) != first:
            entries[j] = dataclasses.replace(entries[j], engine=first[0], task=first[1])
    needs: dict[tuple[int, Task], list[int]] = {}
    for pos, (name, key) in enumerate(keys):
        for c in rec.where[name][key]:
            needs.setdefault(c, []).append(pos)
    return entries, rec.total(), needs


def compile_entry(kernels: dict, entry: PlanEntry, load: bool = True) -> tuple[int, float]:
    """Compile one plan entry (`JITFunction.warmup` with its decoded arguments: Triton's
    compile, no launch) and build its host launcher (`build_launcher(load=...)`); return the
    kernels Triton's compiler built (0: loaded from the cache) and the launcher's seconds."""
    from capture.compiles import triton_builds

    b0 = triton_builds()
    kernel = kernels[entry.kernel]
    compiled = kernel.warmup(*[decode_arg(a) for a in entry.args], grid=(1,),
                             **{k: decode_arg(v) for k, v in entry.kwargs.items()})
    t0 = time.perf_counter()
    build_launcher(compiled, load=load)
    return triton_builds() - b0, time.perf_counter() - t0


def _claim(workdir: Path, j: int) -> bool:
    """Take entry j: create `claims/<j>` exclusively (False: another process has it)."""
    try:
        os.close(os.open(workdir / "claims" / str(j), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _mark_done(workdir: Path, j: int) -> None:
    """Entry j is compiled (`done/<j>`; what a gate of the main process waits for)."""
    with contextlib.suppress(OSError):
        (workdir / "done").mkdir(exist_ok=True)
        (workdir / "done" / str(j)).touch()


def _take_and_compile(workdir: Path, kernels: dict, entries: Sequence[PlanEntry],
                      built: dict, seconds: list, *, among: Sequence[int] | None = None,
                      on_done=None, stop_after: int | None = None, load: bool = True) -> int:
    """Claim and compile entries (`among`, default all, in plan order) until none is left
    (or `stop_after` compiled): each is marked done (`_mark_done`), its builds added to
    `built[j]`, `[kernel, seconds, start, launcher seconds]` to `seconds`, then `on_done(j)`.
    Returns how many this process compiled."""
    done = 0
    for j in range(len(entries)) if among is None else among:
        if stop_after is not None and done >= stop_after:
            break
        if not _claim(workdir, j):
            continue
        entry = entries[j]
        t0, wall = time.perf_counter(), time.time()
        n, launcher_s = compile_entry(kernels, entry, load=load)
        seconds.append([entry.kernel, round(time.perf_counter() - t0, 3), round(wall, 4),
                        round(launcher_s, 3)])
        built[j] = built.get(j, 0) + n
        _mark_done(workdir, j)
        done += 1
        if on_done is not None:
            on_done(j)
    return done


def build_launcher(compiled, load: bool = True) -> bool:
    """Build (and leave in Triton's on-disk cache) the host launcher of a kernel `warmup` just
    compiled. Triton 3.6 generates a C launcher per argument signature and builds it with the
    system compiler at a kernel's first launch (`CudaLauncher`: `compile_module_from_src`,
    cached by its source), not at `warmup`: the 2026-12-04 H200 run spent 8.5 s of the main
    process's capture warm-ups on those builds after the workers had compiled every kernel
    (2.0 s warm). `load`: `CompiledKernel._init_handles()` (builds the launcher and loads the
    module into this process's CUDA context); else only the launcher
    (`driver.active.launcher_cls`: no CUDA context needed, what a worker does). Returns whether
    it ran (False: no such hook, e.g. the interpreter, or it failed: the first launch then
    builds it, as before)."""
    try:
        if load:
            init = getattr(compiled, "_init_handles", None)
            if not callable(init):
                return False
            init()
        else:
            from triton.runtime import driver

            src, metadata = getattr(compiled, "src", None), getattr(compiled, "metadata", None)
            if src is None or metadata is None:
                return False
            driver.active.launcher_cls(src, metadata)
    except Exception as exc:  # a private Triton hook: never fail the worker over it
        logger.debug("launcher build skipped: %s", exc)
        return False
    return True


LAUNCHER_CFLAGS = ("-O1",)
"""Appended to the C compiler's flags of Triton's builds in a worker (each kernel's host
launcher; the last -O wins over Triton's -O3). The 8B pair's 26 keys build 19 distinct
launchers: 3.7-4.0 s of gcc against 6.9 s of the kernels' own compiles (Triton 3.6, a CPU
host, one at a time); at -O1 they build in 0.73x the time (2.8-2.9 s), and a launch's host
cost in the launcher's C code is unchanged (1.86 against 1.88 us with 13 tensor arguments
and a no-op driver; -O0 builds in 0.47x but costs 1.95 us). perf/RESULTS.md 2026-12-05f."""


def quick_launcher_builds(flags: Sequence[str] = LAUNCHER_CFLAGS) -> bool:
    """In this process, Triton's C builds (`triton.runtime.build._build`, a private function:
    its `ccflags`) get `flags` appended; for the worker processes only (every C module they
    build is a launcher of a kernel they compiled). False (nothing changed) where Triton has
    no such function or argument; a build impl the user set (`knobs.build.impl`) is Triton's
    to call and gets no flags. Called again, it wraps Triton's function anew with `flags`."""
    try:
        from triton.runtime import build
    except ImportError:
        return False
    original = getattr(build, "_build", None)
    if original is None:
        return False
    original = getattr(original, "_graphdraft_original", original)  # called before: re-wrap
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return False
    if "ccflags" not in params:
        return False
    at = params.index("ccflags")

    @functools.wraps(original)
    def _build(*args, **kwargs):
        if "ccflags" in kwargs:
            kwargs["ccflags"] = [*(kwargs["ccflags"] or []), *flags]
        elif len(args) > at:
            args = (*args[:at], [*(args[at] or []), *flags], *args[at + 1:])
        else:
            kwargs["ccflags"] = list(flags)
        return original(*args, **kwargs)

    _build._graphdraft_original = original
    build._build = _build
    return True


def current_target() -> list | None:
    """Triton's compile target of this process's current device as JSON data
    ([backend, arch, warp_size]); None without a GPU driver (the interpreter)."""
    try:
        from triton.runtime import driver

        t = driver.active.get_current_target()
        return [t.backend, t.arch, t.warp_size]
    except Exception:  # no GPU driver: the workers then initialise CUDA themselves
        return None


def _use_target(target: list | None, device: str) -> bool:
    """Point Triton's driver at `target` and `device` without a CUDA context: the compile
    target, the current device and stream it asks for are answered from the plan, so a worker
    never initialises CUDA (16 workers initialising CUDA side by side took 2.2 s each on the
    H200). False (nothing changed) without a target or where the driver differs."""
    if target is None or not device.startswith("cuda"):
        return False
    try:
        from triton.backends.compiler import GPUTarget
        from triton.runtime import driver

        active = driver.active
        if not all(hasattr(active, a) for a in ("get_current_target", "get_current_device",
                                                  "get_current_stream", "launcher_cls")):
            return False
        index = torch.device(device).index or 0
        tgt = GPUTarget(target[0], target[1], target[2])
        active.get_current_target = lambda: tgt
        active.get_current_device = lambda: index
        active.get_current_stream = lambda *_: 0
    except Exception as exc:
        logger.debug("compile target not set from the plan: %s", exc)
        return False
    return True


def build_engine(spec: WorkerSpec):
    """The plan's throw-away engine: random weights of the spec's shapes on its device (the
    caller picks the current device)."""
    from graphdraft.config import resolve_dtype
    from graphdraft.models.layers import init_random_
    from graphdraft.models.llama import LlamaForCausalLM
    from graphdraft.models.random_models import random_model_pair
    from graphdraft.serving.engine import Engine

    dtype = resolve_dtype(spec.dtype)
    device = torch.device(spec.device)
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


# ------------------------------------------------------------------ the worker process
def _read_chunks(workdir: Path, entries: list[PlanEntry], chunks: int) -> int:
    """Append the plan chunks `plan.<c>.json` from `chunks` on that exist to `entries`;
    returns the chunk count read so far."""
    while (path := workdir / _CHUNK.format(chunks)).exists():
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
    from capture.compiles import install_triton_counter
    from graphdraft.kernels.warmup import all_kernels

    install_triton_counter()
    quick_launcher_builds()
    kernels = all_kernels()
    t_imported = time.time()
    plan_path, end_path, parent = workdir / _PLAN, workdir / _PLAN_END, os.getppid()
    while not plan_path.exists():
        if time.time() - t_imported > timeout_s or os.getppid() != parent:
            return 3
        time.sleep(0.005)
    plan = json.loads(plan_path.read_text())
    no_context = _use_target(plan.get("target"), plan["device"])
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
        n = _take_and_compile(workdir, kernels, entries, built, seconds, on_done=line,
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
    _write_atomic(out, data)
    return 0


def server_main(workdir: Path, n: int) -> int:
    """The worker processes' parent: import torch, Triton and every kernel module once, then
    fork `n` workers (`worker_main`, log `workdir/log<i>.txt`; nothing here touched CUDA, so
    each child initialises its own) and wait for them. A worker that fails stops the others;
    `workdir/failed.json` names it and its exit status, and this process exits 1. It stops
    them and exits 3 when its parent (the planning process) is gone."""
    compiler_key.prefetch()  # beside the imports below; joined before the forks
    from capture.compiles import install_triton_counter
    from graphdraft.kernels.warmup import all_kernels

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
    env = sorted((k, v) for k, v in os.environ.items()  # the GRAPHDRAFT_ kernel knobs are in
                 if k.startswith("TRITON_") and k != "TRITON_CACHE_DIR")  # the spec's config
    shape = dataclasses.replace(spec, cache_dir="", device="",
                                runtime=spec.runtime.replace(precompile_workers=None))
    parts = [repr(shape), repr(sorted(tasks)),
             torch.__version__, triton.__version__, dev, src.hexdigest(), repr(env)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def cost_cache_path(engine) -> Path | None:
    """Where `Engine.measure_costs(cache=True)` keeps the capture-time cycle costs of `engine`:
    `graphdraft-costs-<fingerprint>.json` beside the warm marker, the fingerprint the marker's
    (shapes, tasks, versions, GPU, environment) with every source of the package; None when
    no worker could rebuild the engine or nothing is captured."""
    found = _engine_marker(engine)
    if found is None:
        return None
    spec, tasks, _ = found
    src = hashlib.sha256(_fingerprint(spec, tasks).encode())
    root = Path(__file__).resolve().parents[1]
    for p in sorted(root.rglob("*.py")):
        src.update(str(p.relative_to(root)).encode())
        src.update(p.read_bytes())
    return Path(spec.cache_dir) / f"graphdraft-costs-{src.hexdigest()[:24]}.json"


def _marker(spec: WorkerSpec, tasks: Sequence[Task]) -> Path:
    return Path(spec.cache_dir) / _MARKER.format(_fingerprint(spec, tasks))


def _engine_marker(engine) -> tuple[WorkerSpec, list[Task], Path] | None:
    """`engine`'s spec, tasks and warm-marker path; None when no worker could rebuild it or
    nothing is captured."""
    spec, _ = engine_spec(engine)
    tasks = tasks_of(engine)
    if spec is None or not tasks:
        return None
    return spec, tasks, _marker(spec, tasks)


def is_warm(engine) -> bool:
    """The warm-cache marker of `engine` (`mark_warm`) is in Triton's cache folder: an earlier
    precompile of this engine shape finished there."""
    found = _engine_marker(engine)
    return found is not None and found[2].exists()


def warmup_tasks(engine) -> list[Task] | None:
    """The tasks whose capture must warm up first, from `engine`'s warm marker: those that
    first launch a kernel in capture order (`CompilePhase.first_tasks`; any other size only
    launches kernels an earlier warm-up loaded). None: no marker, or one without that list
    (every bucket warms up)."""
    found = _engine_marker(engine)
    if found is None:
        return None
    try:
        listed = json.loads(found[2].read_text()).get("warmup")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(listed, list):
        return None
    return [(str(o), str(a), int(bs)) for o, a, bs in listed]


def mark_warm(engine, warmup: Sequence[Task] | None = None) -> Path | None:
    """Write the warm-cache marker of `engine` (after its precompile finished), with the
    tasks that must warm up before their capture (`warmup_tasks`; None: not known, every
    bucket warms up); None when no worker could rebuild it, nothing is captured, or the cache
    folder is not writable."""
    found = _engine_marker(engine)
    if found is None:
        return None
    _, tasks, path = found
    data = {"tasks": len(tasks), "time": time.time()}
    if warmup is not None:
        data["warmup"] = [list(t) for t in warmup]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as e:
        logger.debug("precompile marker not written: %s", e)
        return None
    return path


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


def _launch(workdir: Path, n: int, log_path: Path, env: dict):
    """Start the worker server (`server_main`: `n` workers) in a session of its own (a
    timeout kills the whole group). Forked from this process where it can (torch, Triton and
    the kernels are imported already: a fresh interpreter spent 3-4 s importing them on the
    H200 machine; the server and its workers never touch CUDA, so a fork of a process that
    uses CUDA is safe, as for a DataLoader's workers); else a fresh interpreter
    (`python -m graphdraft.kernels.precompile_workers DIR N`) with the environment `env`."""
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
    cmd = [sys.executable, "-m", "graphdraft.kernels.precompile_workers", str(workdir), str(n)]
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    """Kill the server and its workers (its process group), then reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait()


def _write_atomic(path: Path, data) -> None:
    """`path` holds JSON `data` whole or not at all (a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _read_progress(out: Path) -> int:
    """A worker's progress file: keys compiled so far."""
    try:
        return Path(str(out) + ".progress").read_text().count("1\n")
    except OSError:
        return 0


def run_workers(engines, workers: int, *, progress: bool = True,
                timeout_s: float = WORKER_TIMEOUT_S) -> WorkerReport:
    """Compile the schedule kernels of `engines` (an engine or a sequence of them) into
    Triton's cache with `workers` processes and this one (module docstring), and wait for
    them: `start_workers(...)` then `CompilePhase.finish()`. Returns what they did."""
    report, phase = start_workers(engines, workers, progress=progress, timeout_s=timeout_s)
    return report if phase is None else phase.finish()


def start_workers(engines, workers: int, *, progress: bool = True,
                  timeout_s: float = WORKER_TIMEOUT_S
                  ) -> tuple[WorkerReport, CompilePhase | None]:
    """Start the worker phase for `engines` (an engine or a sequence of them): fork the
    worker server, plan the keys here meanwhile (`plan_keys`), hand the plan out. Returns the
    report and the running `CompilePhase` (its `gate(index, task)` waits for one task's
    kernels, `finish()` for all of them), or the report and None with `report.skipped`
    saying why no worker runs: `workers` is 0, nothing is to be captured, an engine cannot
    be rebuilt, fewer than 2 workers fit in the free GPU memory (one would compile everything
    serially, as this process does), or every engine's marker says the cache is warm
    (engines whose marker exists are left out). Raises PrecompileWorkerError when the plan
    fails (the server is stopped); ValueError for `workers < 0`."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"precompile_workers: expected an int >= 0, got {workers!r}")
    engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    report = WorkerReport()
    if workers == 0:
        report.skipped = "precompile_workers=0"
        return report, None
    plans: list[tuple[int, WorkerSpec, list[Task]]] = []
    for index, e in enumerate(engines):
        tasks = tasks_of(e)
        spec, why = engine_spec(e)
        if not tasks:
            continue
        if spec is None:
            report.skipped = why
            break
        if not _marker(spec, tasks).exists():
            plans.append((index, spec, tasks))
    if report.skipped is None and not plans:
        report.skipped = ("nothing to capture" if not any(tasks_of(e) for e in engines)
                          else "Triton cache warm for this engine (marker found)")
    if report.skipped:
        logger.info("precompile workers: none (%s)", report.skipped)
        return report, None
    spec0 = plans[0][1]
    fit = min(memory_cap(engines[i], s, workers) for i, s, _ in plans)
    if fit < workers:
        logger.info("precompile workers: %d instead of %d (free GPU memory)", fit, workers)
    if fit < 2:
        report.skipped = ("one worker only" if fit else "not enough free GPU memory for a worker")
        logger.info("precompile workers: none (%s)", report.skipped)
        return report, None
    report.workers, report.tasks = fit, sum(len(t) for *_, t in plans)
    t0, report.t0_wall = time.perf_counter(), time.time()

    def event(name: str, n: int = 0) -> None:
        report.plan_events.append([name, round(time.time() - report.t0_wall, 4), n])

    # a worker killed mid-write may leave a file behind the folder's removal: not an error
    tmp = tempfile.TemporaryDirectory(prefix="graphdraft-precompile-", ignore_cleanup_errors=True)
    workdir = Path(tmp.name)
    (workdir / "claims").mkdir()
    (workdir / "done").mkdir()
    server = None
    try:
        server = _launch(workdir, fit, workdir / "server.txt", _env(spec0))  # it forks workers
        tp = time.perf_counter()
        event("server")

        def header() -> None:  # Triton's driver starts (on a cold cache it builds a C helper)
            _write_atomic(workdir / _PLAN, {"device": spec0.device, "target": current_target()})
            event("header")

        # the header beside the plan's first steps (the throw-away engine, the first probe):
        # the workers need it only with the first entries; its failure is the plan's
        header_written = run_beside(header, "graphdraft-plan-header")
        chunks = []

        def emit(batch: list[PlanEntry]) -> None:  # the workers start on it at once
            header_written()
            _write_atomic(workdir / _CHUNK.format(len(chunks)),
                          {"entries": [x.to_json() for x in batch]})
            chunks.append(len(batch))
            event("emit", len(batch))

        try:
            entries, report.keys, needs = plan_keys(plans, emit=emit, event=event)
            header_written()
        except Exception as e:
            raise PrecompileWorkerError(f"precompile plan failed: {type(e).__name__}: {e}") \
                from e
        _write_atomic(workdir / _PLAN_END, {"chunks": len(chunks), "entries": len(entries)})
        report.plan_s = time.perf_counter() - tp
        event("end", len(entries))
    except BaseException:
        if server is not None:
            _kill(server)
        tmp.cleanup()
        raise
    logger.info("precompile: %d keys of %d tasks over %d worker processes and this one",
                len(entries), report.tasks, fit)
    order = {index: [t for t in tasks if t[1] != PREFILL] for index, _, tasks in plans}
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
        from capture.compiles import triton_builds
        from graphdraft.kernels.warmup import all_kernels

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
        return sorted(out, key=lambda t: (t[0], t[1], -t[2]))

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
            n = self._here + sum(_read_progress(out) for out in self._outs)
            if n > self._bar.n:
                self._bar.update(n - self._bar.n)

    def _help(self, among: Sequence[int] | None = None) -> bool:
        """Claim and compile one entry (of `among` if given); whether it compiled one."""
        n = _take_and_compile(self._workdir, self._kernels, self._entries, self._built,
                              self.report.compile_s, among=among, on_done=self._done.add,
                              stop_after=1)
        self._here += n
        return n > 0

    def gate(self, index: int, task: Task) -> None:
        """Return once every kernel of `task` (of engine `index`) is compiled, compiling its
        unclaimed ones here meanwhile (only those: a kernel of a later capture compiled here
        kept this gate shut 0.3 s after its own were done, H200 2026-12-05e); at once when the
        phase has stalled."""
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
        from capture.compiles import triton_builds

        report, workdir = self.report, self._workdir
        try:
            while (rc := self._server.poll()) is None:
                if not self._help():
                    time.sleep(0.005)
                self._tick()
                if time.monotonic() > self._deadline:
                    raise PrecompileWorkerError(
                        f"precompile workers did not finish within {self._timeout_s:.0f} s; "
                        f"the log of worker 1 ends:\n{_tail(workdir / 'log0.txt')}")
            if rc != 0:
                failed = workdir / "failed.json"
                if failed.exists():
                    f = json.loads(failed.read_text())
                    log = workdir / "log{}.txt".format(f["worker"])
                    raise PrecompileWorkerError(
                        f"precompile worker {f['worker'] + 1} failed (exit status {f['status']}); "
                        f"its log ends:\n{_tail(log)}")
                raise PrecompileWorkerError(
                    f"precompile workers failed (exit status {rc}); the log ends:\n"
                    f"{_tail(workdir / 'server.txt')}")
            for i, out in enumerate(self._outs):
                if not out.exists():
                    raise PrecompileWorkerError(
                        f"precompile worker {i + 1} wrote no result; its log ends:\n"
                        f"{_tail(workdir / f'log{i}.txt')}")
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
        _kill(self._server)
        if self._bar is not None:
            self._bar.close()
        self._tmp.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or not args[1].isdigit() or int(args[1]) < 1:
        print("usage: python -m graphdraft.kernels.precompile_workers WORKDIR WORKERS",
              file=sys.stderr)
        return 2
    return server_main(Path(args[0]), int(args[1]))


if __name__ == "__main__":
    sys.exit(main())
