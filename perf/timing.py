"""Timing helpers: CUDA-event medians, copy bandwidth, JSON output, forced eager."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from capture import EAGER_ENV


def time_us(fn: Callable[[], Any], *, warmup: int = 3, reps: int = 20,
            device: str | torch.device = "cuda",
            setup: Callable[[], Any] | None = None) -> list[float]:
    """Per-call times (us) of `reps` calls after `warmup` calls; `setup` (e.g. restoring a
    state the call consumes) runs before each call, outside its timing.

    CUDA: an event pair around each call, calls issued back to back (as a serving
    loop issues them), so a call's time is its GPU span, or its host time where
    the host is the bottleneck. CPU: the host clock around each call.
    """
    prep = setup if setup is not None else (lambda: None)
    for _ in range(warmup):
        prep()
        fn()
    if torch.device(device).type != "cuda":
        out = []
        for _ in range(reps):
            prep()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        prep()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in events]


def write_json(out_dir: str | Path, name: str, data: Any) -> Path:
    """Write `data` as indented JSON to `out_dir/name` (the folder made if missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(data, indent=1))
    return path


def median_us(fn: Callable[[], Any], **kw: Any) -> float:
    return statistics.median(time_us(fn, **kw))


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str | torch.device = "cuda", nbytes: int = 2 << 30,
                   reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s: (read + written) / median copy time."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t = median_us(lambda: dst.copy_(src), warmup=3, reps=reps, device=device)
    return 2 * nbytes / (t * 1e-6)


@contextlib.contextmanager
def forced_eager(on: bool = True) -> Iterator[None]:
    """Set `GRAPHDRAFT_EAGER=1` (read on every `CapturedForward.run`) inside the block."""
    old = os.environ.get(EAGER_ENV)
    if on:
        os.environ[EAGER_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(EAGER_ENV, None)
        else:
            os.environ[EAGER_ENV] = old


def graph_time_us(fn: Callable[[int], object], calls: int, reps: int = 7) -> float:
    """Median per-call time of a CUDA graph holding `fn(0..calls-1)`."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del g
    return statistics.median(times)
