"""Work a call issues outside its graph launches, read off a torch.profiler trace."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from perf.timing import sync

LAUNCHES_ENV = "GRAPHDRAFT_PERF_LAUNCHES"
CALL_MARK = "graphdraft_perf_call"
"""The `record_function` name around each profiled call."""
LAUNCH_APIS = ("cudaLaunch", "cuLaunch", "cudaMemcpy", "cuMemcpy", "cudaMemset", "cuMemset")
"""Host API calls that put one kernel, copy or memset on a stream (runtime and driver API:
Triton launches through `cuLaunchKernel[Ex]`)."""
GRAPH_LAUNCH_APIS = ("cudaGraphLaunch", "cuGraphLaunch")
GRAPH_LAUNCH_HOST = "graph launch (host)"
"""The timeline's name for a host graph-launch API call."""
_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def _api_event(e: dict[str, Any]) -> bool:
    cat = str(e.get("cat", "")).lower()
    return e.get("ph") == "X" and cat in ("cuda_runtime", "cuda_driver")


def count_launches(events: Sequence[dict[str, Any]], mark: str = CALL_MARK) -> list[dict[str, Any]]:
    """Per `record_function(mark)` span of a chrome trace (`traceEvents`), in time order, the
    CUDA work the host issued inside it:

    `launches`: host API calls in `LAUNCH_APIS` (kernel launches, memcpys, memsets) made
    outside graph launches; `graph_launches`: `cudaGraphLaunch` calls; `gpu_outside` /
    `gpu_inside`: GPU kernels, copies and memsets correlated with a non-graph / a graph
    launch (the profiler may miss GPU records, never host API records, so `launches` is
    the count to trust); `ops`: name -> count of the `gpu_outside` work;
    `refresh_gpu_us`: the call's GPU span minus its graph work's span; `timeline`:
    `[name, start, end]` us from the call's first GPU op, of the outside work, of the
    graph work (`"graph: <its first op>"`) and of the host's graph-launch API calls
    (`GRAPH_LAUNCH_HOST`, negative when the host ran ahead of the GPU).
    Raises ValueError when the trace has no span named `mark`.
    """
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                   if e.get("ph") == "X" and e.get("name") == mark
                   and not str(e.get("cat", "")).lower().startswith("gpu"))
    if not spans:
        raise ValueError(f"no {mark!r} spans in the profiler trace")
    calls: list[dict[str, Any]] = [{"launches": 0, "graph_launches": 0, "gpu_outside": 0,
                                    "gpu_inside": 0, "ops": Counter()} for _ in spans]
    bounds: list[dict[bool, list[float]]] = [{} for _ in spans]  # is graph -> [first start, last end]
    outside: list[list[list]] = [[] for _ in spans]
    graph_api: list[list[list]] = [[] for _ in spans]  # host graph-launch calls
    first_graph_op: list[tuple[float, str]] = [(float("inf"), "?") for _ in spans]

    def span_of(ts: float) -> int | None:
        for i, (lo, hi) in enumerate(spans):
            if lo <= ts <= hi:
                return i
        return None

    by_corr: dict[Any, tuple[int, bool]] = {}  # correlation id -> (span, is a graph launch)
    for e in events:
        if not _api_event(e):
            continue
        i = span_of(float(e.get("ts", -1.0)))
        name = str(e.get("name", ""))
        if i is None:
            continue
        graph = name.startswith(GRAPH_LAUNCH_APIS)
        if graph:
            calls[i]["graph_launches"] += 1
            t0 = float(e["ts"])
            graph_api[i].append([GRAPH_LAUNCH_HOST, t0, t0 + float(e.get("dur", 0.0))])
        elif name.startswith(LAUNCH_APIS):
            calls[i]["launches"] += 1
        else:
            continue
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            by_corr[corr] = (i, graph)
    for e in events:
        if e.get("ph") != "X" or str(e.get("cat", "")).lower() not in _GPU_CATS:
            continue
        hit = by_corr.get((e.get("args") or {}).get("correlation"))
        if hit is None:
            continue
        i, graph = hit
        t0 = float(e["ts"])
        t1 = t0 + float(e.get("dur", 0.0))
        b = bounds[i].setdefault(graph, [t0, t1])
        b[0], b[1] = min(b[0], t0), max(b[1], t1)
        if not graph:
            outside[i].append([str(e.get("name", "?"))[:60], t0, t1])
        if graph:
            calls[i]["gpu_inside"] += 1
            if t0 < first_graph_op[i][0]:
                first_graph_op[i] = (t0, str(e.get("name", "?"))[:40])
        else:
            calls[i]["gpu_outside"] += 1
            calls[i]["ops"][str(e.get("name", "?"))[:100]] += 1
    for c, b, out, api, first in zip(calls, bounds, outside, graph_api, first_graph_op,
                                     strict=True):
        c["ops"] = dict(sorted(c["ops"].items()))
        c["refresh_gpu_us"], c["timeline"] = None, []
        if b:
            lo = min(v[0] for v in b.values())
            ops = out + api + ([[f"graph: {first[1]}", *b[True]]] if True in b else [])
            c["timeline"] = [[n, round(t0 - lo, 2), round(t1 - lo, 2)] for n, t0, t1 in sorted(
                ops, key=lambda o: o[1])]
        if len(b) == 2:
            lo, hi = min(b[True][0], b[False][0]), max(b[True][1], b[False][1])
            c["refresh_gpu_us"] = (hi - lo) - (b[True][1] - b[True][0])
    return calls


def launches_enabled(env: dict[str, str] | None = None) -> bool:
    """`GRAPHDRAFT_PERF_LAUNCHES=0` skips the profiler pass of every case."""
    return (os.environ if env is None else env).get(LAUNCHES_ENV, "1").strip() != "0"


def trace_calls(fn: Callable[[], Any], *, calls: int = 5, device: str | torch.device = "cuda",
                host_ahead_cycles: int = 0) -> list[dict[str, Any]]:
    """Run `fn` once, then `calls` times under torch.profiler, each inside a
    `record_function(CALL_MARK)` span; returns `count_launches` of the trace (one dict per
    call). `host_ahead_cycles` > 0 (CUDA) first queues a sleep kernel of that many cycles, so
    that the host issues every call before the GPU runs them."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()
    sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=activities) as prof:
            if cuda and host_ahead_cycles:
                torch.cuda._sleep(host_ahead_cycles)
            for _ in range(calls):
                with record_function(CALL_MARK):
                    fn()
            sync(device)
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return count_launches(events)


def profile_launches(fn: Callable[[], Any], *, calls: int = 5,
                     device: str | torch.device = "cuda") -> dict[str, Any]:
    """Run `fn` (one draft call) `calls` times under torch.profiler and count the work it
    issues outside graph launches (`trace_calls`); report the last call's counts.

    Keys: `refresh_launches`, `graph_launches`, `refresh_gpu_ops`, `graph_gpu_ops`,
    `refresh_ops` (name -> count), `launch_counts_stable` (every profiled call issued the
    same host launches), `refresh_gpu_us` (median over the calls; None without GPU
    records), `refresh_timeline` (the last call's `timeline`). On a CPU device only host ops are traced and the counts are 0.
    """
    per_call = trace_calls(fn, calls=calls, device=device)
    last = per_call[-1]
    gaps = [c["refresh_gpu_us"] for c in per_call if c["refresh_gpu_us"] is not None]
    return {"refresh_launches": last["launches"], "graph_launches": last["graph_launches"],
            "refresh_gpu_ops": last["gpu_outside"], "graph_gpu_ops": last["gpu_inside"],
            "refresh_ops": last["ops"],
            "refresh_gpu_us": statistics.median(gaps) if gaps else None,
            "refresh_timeline": last["timeline"],
            "launch_counts_stable": len({(c["launches"], c["graph_launches"]) for c in per_call})
            == 1}

