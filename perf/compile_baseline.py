"""The torch.compile baseline drafter.

The baseline (`Baseline`, chosen by `GRAPHDRAFT_PERF_COMPILE`) is a torch-path
drafter (`kernel_backend="torch"`) whose two forwards are compiled:

- "compile+graph" (default): `torch.compile(fn, dynamic=False, fullgraph=False)`
  (inductor, default mode, no cudagraphs), the compiled forwards captured in
  graphdraft's own CUDA graphs (`CapturedForward`, its own pool; the compile runs
  on each bs's first warm-up call), as SGLang runs torch.compile inside its own
  graph runner;
- "reduce-overhead": `torch.compile(mode="reduce-overhead", dynamic=False)`,
  torch's cudagraph trees (which skip graphs that mutate inputs: the multi-step's
  in-place buffer writes); "reduce-overhead-dynamic" the same with automatic
  dynamic shapes.

Order inside a group: every graph measurement first, then the compiled baseline.
For reduce-overhead this order is required: cudagraph trees clear PyTorch's
cached cuBLAS workspaces before they warm up or record; graphs that baked in the
workspace cuBLAS held at capture then replay into freed memory (seen on an
H200: an illegal memory access on the next replay), so `DraftGroup.graphs_stale`
is set once a reduce-overhead baseline exists. With compile+graph every graph is
captured by `CapturedForward`, which gives each capture a workspace of its own
pool, and nothing frees it: the drafter's graphs stay valid.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from capture import CapturedForward
from graphdraft.runtime.buffers import InputBuffers
from graphdraft.runtime.drafter import EagleDrafter
from perf.bench import time_forwards
from perf.draft_group import DecodeBatch, DraftGroup, activate
from perf.timing import sync

Forward = Callable[[int], Any]
Compiler = Callable[[Forward], Forward]


COMPILE_GRAPH = "compile+graph"
REDUCE_OVERHEAD = "reduce-overhead"
REDUCE_OVERHEAD_DYNAMIC = "reduce-overhead-dynamic"
COMPILE_ENV = "GRAPHDRAFT_PERF_COMPILE"


@dataclass(frozen=True)
class Baseline:
    """How the torch.compile baseline drafter is built (module docstring)."""

    mode: str
    """The label in the records and the report's column headers."""
    compiler: Compiler
    """Wraps each of the two forwards, `forward(bs) -> compiled forward(bs)`."""
    own_graphs: bool
    """True: capture the compiled forwards in `CapturedForward` graphs (compile+graph).
    False: call them through disabled `CapturedForward`s (reduce-overhead's cudagraph
    trees do the graphing)."""

    @property
    def stales_graphs(self) -> bool:
        """Whether building it invalidates the drafter's captured graphs (reduce-overhead)."""
        return not self.own_graphs


def _raise_recompile_limit(limit: int = 64) -> None:
    """Static shapes compile once per bs (and per graph-break resume function)."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), limit))


def inductor(fn: Forward) -> Forward:
    """`torch.compile(fn, dynamic=False, fullgraph=False)`: inductor kernels, default mode
    (no cudagraphs); `bs` is specialized, so each bs compiles on its first call."""
    _raise_recompile_limit()
    return torch.compile(fn, dynamic=False, fullgraph=False)


def reduce_overhead(fn: Forward, dynamic: bool | None = None) -> Forward:
    """`torch.compile(mode="reduce-overhead")`; each call starts a new cudagraph-trees step.

    `dynamic=None` (torch's default, automatic dynamic): the first bs compiles static,
    the second recompiles with a symbolic bs that every later bs reuses (cudagraph
    trees still record one graph per bs), so a group costs two compiles per forward.
    `dynamic=False`: one static compile per bs, the best case at several times the
    compile time.
    """
    _raise_recompile_limit()
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=False, dynamic=dynamic)

    def step(bs: int) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(bs)

    return step


BASELINES: dict[str, Baseline] = {
    COMPILE_GRAPH: Baseline(COMPILE_GRAPH, inductor, own_graphs=True),
    REDUCE_OVERHEAD: Baseline(REDUCE_OVERHEAD, functools.partial(reduce_overhead, dynamic=False),
                              own_graphs=False),
    REDUCE_OVERHEAD_DYNAMIC: Baseline(REDUCE_OVERHEAD_DYNAMIC, reduce_overhead, own_graphs=False),
}
_BASELINE_ALIASES = {"": COMPILE_GRAPH, "1": COMPILE_GRAPH, "graph": COMPILE_GRAPH,
                     "static": REDUCE_OVERHEAD, "dynamic": REDUCE_OVERHEAD_DYNAMIC}


def baseline_from_env(env: dict[str, str] | None = None) -> Baseline | None:
    """The baseline `GRAPHDRAFT_PERF_COMPILE` names: unset/"compile+graph" (default),
    "reduce-overhead", "reduce-overhead-dynamic", or "0" for none. ("static" and
    "dynamic", the reduce-overhead variants' old names, still work.) Anything else
    raises ValueError: a typo must not silently measure another baseline."""
    raw = (os.environ if env is None else env).get(COMPILE_ENV, "").strip().lower()
    if raw in ("0", "off", "none", "false", "no"):
        return None
    mode = _BASELINE_ALIASES.get(raw, raw)
    if mode not in BASELINES:
        raise ValueError(f"{COMPILE_ENV}={raw!r}: expected one of {sorted(BASELINES)} or '0'")
    return BASELINES[mode]


def mark_static(drafter: EagleDrafter) -> None:
    """Mark every persistent tensor the drafter reads or writes as a static address, so
    cudagraph trees neither copy it in per replay nor skip graphs that mutate it."""
    tensors = [getattr(drafter.bufs, f.name) for f in fields(drafter.bufs)]
    tensors += [getattr(drafter.inputs, f.name) for f in fields(drafter.inputs)]
    tensors += [drafter.states.valid_cache_lengths, drafter.req_to_page,
                *drafter.kv_pool.k, *drafter.kv_pool.v]
    for t in tensors:
        torch._dynamo.mark_static_address(t)


@contextlib.contextmanager
def preserved_inputs(inputs: InputBuffers) -> Iterator[None]:
    """Restore every `InputBuffers` tensor on exit (a capture resets them to neutral rows,
    and the group's buffers hold the batch being measured)."""
    saved = {f.name: getattr(inputs, f.name).clone() for f in fields(inputs)}
    try:
        yield
    finally:
        for name, t in saved.items():
            getattr(inputs, name).copy_(t)


def _dynamo_counts() -> tuple[int, int]:
    """(FX graphs compiled, graph breaks) so far, from dynamo's counters."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def build_baseline(group: DraftGroup, baseline: Baseline) -> EagleDrafter:
    """A torch-path drafter over the group's buffers whose two forwards are
    `baseline.compiler(...)` of its own `_decode` / `_multi_step`.

    compile+graph: both wrapped in enabled `CapturedForward`s over the drafter's schedule
    and a graph pool of its own, and captured here for every bs of the group (three
    warm-up calls per bs first: the compile, then steady calls), the group's input
    buffers restored afterwards. reduce-overhead: wrapped in disabled ones, every
    persistent buffer marked static. Fills `group.baseline_info`. Leaves the shared head
    on the group drafter's kernel backend.
    """
    d = group.drafter
    t0, (graphs0, breaks0) = time.perf_counter(), _dynamo_counts()
    cfg = group.cfg.replace(kernel_backend="torch", enforce_eager=not baseline.own_graphs)
    base = EagleDrafter(d.head, cfg, req_to_page=group.pages.req_to_page, input_buffers=group.inputs,
                        runtime_states=group.states, kv_pool=group.kv_pool)
    try:
        activate(base)  # compile (and capture) the torch path, not the group drafter's
        if not baseline.own_graphs:
            mark_static(base)
        forwards = {"decode_graphs": ("compiled_decode", base._decode, True),
                    "multi_step_graphs": ("compiled_multi_step", base._multi_step, base.S > 1)}
        for attr, (name, fn, enabled) in forwards.items():
            setattr(base, attr, CapturedForward(
                name, baseline.compiler(fn), base.schedule, pool=base.graph_pool,
                enabled=baseline.own_graphs and enabled, warmup_iters=3))
        if baseline.own_graphs:
            with preserved_inputs(group.inputs):
                base.capture_graphs()  # resets the inputs to neutral rows, warms up, captures
            sync(cfg.device)
    finally:
        activate(d)
    graphs1, breaks1 = _dynamo_counts()
    group.baseline_info = {"compile_group_s": time.perf_counter() - t0,
                           "compile_fx_graphs": graphs1 - graphs0,
                           "compile_graph_breaks": breaks1 - breaks0}
    return base


def _counter(group: str, key: str) -> int:
    from torch._dynamo.utils import counters
    return int(counters[group][key])


def _forward_counts(d: EagleDrafter) -> tuple[int, int]:
    """(graph replays, eager calls) of both forwards so far."""
    fs, ms = d.decode_graphs.stats, d.multi_step_graphs.stats
    return fs.total_replays + ms.total_replays, fs.total_eager + ms.total_eager


@torch.inference_mode()
def measure_compiled(group: DraftGroup, batch: DecodeBatch, baseline: Baseline, *,
                     warmup: int = 3, reps: int = 20) -> dict[str, Any]:
    """The baseline's times and set-up cost at this bs; `{"compile_error": ...}` instead when
    building, compiling, capturing or running it raises (a failed build is kept in
    `group.baseline_error` and returned for every later case of the group).

    Keys: `compile_{run,decode,multi,first}_us` medians; `compile_s`, the seconds to make this
    bs ready (compile+graph: this bs's warm-up calls, where it compiles, and capture of
    both forwards; reduce-overhead, or a bs left uncaptured: the first three `run`
    calls: compile, cudagraph-trees warm-up, record); `compile_case_fx_graphs`, FX
    graphs dynamo compiled during this case's calls; `compile_agreement`, the share of
    drafts equal to the graph drafter's. compile+graph also: `compile_graph_replayed`
    (every forward call of this case replayed a graph, per the `CapturedForward`
    stats), `compile_replays`, `compile_eager_forwards`, `compile_pool_bytes`,
    `compile_dropped` (sizes whose capture ran out of memory) and `group.baseline_info`.
    reduce-overhead also: `compile_cudagraph_skips`; it leaves the group's graphs stale
    (module docstring).
    """
    dev = group.cfg.device
    if group.baseline_error is not None:
        return {"compile_error": group.baseline_error}
    try:
        if group.baseline is None:
            group.graphs_stale = group.graphs_stale or baseline.stales_graphs
            try:
                group.baseline = build_baseline(group, baseline)
            except Exception as e:
                group.baseline_error = f"{type(e).__name__}: {e}"[:500]
                raise
        base = group.baseline
        activate(base)
        skips = _counter("inductor", "cudagraph_skips")
        counts, fx_graphs = _forward_counts(base), _dynamo_counts()[0]
        t0 = time.perf_counter()
        for _ in range(3):  # reduce-overhead: compile at this bs, cudagraph-trees warm-up, record
            out = base.run(*batch.args)
        sync(dev)
        first_calls_s = time.perf_counter() - t0
        res: dict[str, Any] = {"compile_s": first_calls_s}
        res.update(time_forwards("compile", base, batch, warmup=warmup, reps=reps))
        res["compile_case_fx_graphs"] = _dynamo_counts()[0] - fx_graphs
        if baseline.own_graphs:
            bs = batch.ctx.bs
            fs, ms = base.decode_graphs.stats, base.multi_step_graphs.stats
            replays, eager = (b - a for a, b in zip(counts, _forward_counts(base), strict=True))
            if bs in fs.capture_seconds:
                res["compile_s"] = fs.capture_seconds[bs] + ms.capture_seconds.get(bs, 0.0)
            res.update(compile_graph_replayed=eager == 0 and replays > 0,
                       compile_replays=replays, compile_eager_forwards=eager,
                       compile_pool_bytes=fs.total_pool_bytes + ms.total_pool_bytes,
                       compile_dropped=sorted(set(fs.dropped) | set(ms.dropped)),
                       **group.baseline_info)
        else:
            res["compile_cudagraph_skips"] = _counter("inductor", "cudagraph_skips") - skips
        reference = group.reference.get(batch.ctx.bs)
        if reference is not None:
            res["compile_agreement"] = float((out[:, 1:] == reference[:, 1:]).float().mean())
        return res
    except Exception as e:  # noqa: BLE001 - a failed baseline is a result, not a crash
        return {"compile_error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        activate(group.drafter)

