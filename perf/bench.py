"""One case of the draft benchmark measured: eager vs graph replay, refresh, capture stats.

The harness around it, one module per concern: `cases` (benchmark points), `floors` (HBM
floors), `timing` (CUDA-event medians, copy bandwidth, JSON), `draft_group` (drafter set-up
and decode batches), `compile_baseline` (the torch.compile drafter), `launches` (work outside
the graph launches, from a profiler trace), `models_8b` (8B-shaped models).

Nothing here needs a GPU: on a CPU device the same code paths run (graphs are
off there and times come from the host clock), which `tests/test_perf_smoke.py`
uses to check the harness without one.

A *group* is one `(page_size, kv_len)` set-up: a drafter whose graphs are
captured once for every bs the group's cases need, its own shuffled page table,
KV pool (filled with random values) and input buffers, and, built on first use,
the torch.compile baseline drafter over the same buffers.
"""


from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from graphdraft.runtime.drafter import EagleDrafter
from perf.draft_group import DecodeBatch, DraftGroup, activate
from perf.launches import profile_launches
from perf.timing import forced_eager, median_us, sync


def time_forwards(prefix: str, d: EagleDrafter, batch: DecodeBatch, **kw: Any) -> dict[str, float]:
    """Median us of `run` (whole draft call), of the decode forward (first step + multi-step,
    one replay) and of the multi-step forward alone, `{prefix}_{run,decode,multi}_us`, and
    `{prefix}_first_us` = decode - multi."""
    bs, args = batch.ctx.bs, batch.args
    fns = {"run": lambda: d.run(*args), "decode": lambda: d.decode_graphs.run(bs),
           "multi": lambda: d.multi_step_graphs.run(bs)}
    res = {f"{prefix}_{k}_us": median_us(fn, device=d.cfg.device, **kw) for k, fn in fns.items()}
    res[f"{prefix}_first_us"] = res[f"{prefix}_decode_us"] - res[f"{prefix}_multi_us"]
    return res


def time_refresh_us(d: EagleDrafter, args: tuple[Any, ...], *, warmup: int = 3,
                    reps: int = 20, **run_kw: Any) -> list[float]:
    """Per `d.run(*args, **run_kw)` call (decode batch, `reps` calls back to back after
    `warmup`): the call's GPU span minus the span of its decode forward, both from CUDA events
    recorded in the same call (around the call, and just before and after
    `decode_graphs.run`). What is left is the work between replays: the staging launch, the
    output copy and any gap the host leaves the GPU. CPU: the same with the host clock."""
    cuda = torch.device(d.cfg.device).type == "cuda"

    def mark() -> Any:
        if not cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def span_us(a: Any, b: Any) -> float:
        return a.elapsed_time(b) * 1e3 if cuda else (b - a) * 1e6

    inner: list[tuple[Any, Any]] = []
    forward = d.decode_graphs.run

    def timed_forward(bs: int, *a: Any, **k: Any) -> Any:
        start = mark()
        out = forward(bs, *a, **k)
        inner.append((start, mark()))
        return out

    d.decode_graphs.run = timed_forward  # an instance attribute: shadows the method
    try:
        for _ in range(warmup):
            d.run(*args, **run_kw)
        sync(d.cfg.device)
        inner.clear()
        outer = []
        for _ in range(reps):
            start = mark()
            d.run(*args, **run_kw)
            outer.append((start, mark()))
        sync(d.cfg.device)
    finally:
        del d.decode_graphs.run
    if len(inner) != reps:
        raise RuntimeError(f"expected one decode forward per draft call, got {len(inner)} in {reps}")
    return [span_us(*o) - span_us(*i) for o, i in zip(outer, inner, strict=True)]


def refresh_info(d: EagleDrafter, batch: DecodeBatch, *, warmup: int = 3, reps: int = 20,
                 profile: bool = True) -> dict[str, Any]:
    """The time the work outside the decode replay adds to a `d.run` call, two ways: as the
    API's default (`batch.args`: hidden states copied in, drafts copied out) and in place
    (`in_place_args` and `copy_output=False`: the target's hidden states already in the
    drafter's buffer, the drafts returned as its view, as the bundled Engine runs it).
    Keys: `refresh_events{,_in_place}_us` (`time_refresh_us` medians); on CUDA with
    `profile`, `profile_launches`'s keys for the default path and `refresh_gpu_in_place_us`,
    `refresh_launches_in_place`, `refresh_in_place_timeline` (measured after the event
    timings; `launches_error` when the profiler fails)."""
    in_place, no_copy = in_place_args(d, batch), {"copy_output": False}
    res: dict[str, Any] = {
        "refresh_events_us": statistics.median(time_refresh_us(d, batch.args, warmup=warmup,
                                                               reps=reps)),
        "refresh_events_in_place_us": statistics.median(time_refresh_us(
            d, in_place, warmup=warmup, reps=reps, **no_copy))}
    if profile and torch.device(d.cfg.device).type == "cuda":
        try:
            res.update(profile_launches(lambda: d.run(*batch.args), device=d.cfg.device))
            place = profile_launches(lambda: d.run(*in_place, **no_copy), device=d.cfg.device)
            res["refresh_gpu_in_place_us"] = place["refresh_gpu_us"]
            res["refresh_launches_in_place"] = place["refresh_launches"]
            res["refresh_in_place_timeline"] = place["refresh_timeline"]
        except Exception as e:  # noqa: BLE001 - a failed count is a result, not a crash
            res["launches_error"] = f"{type(e).__name__}: {e}"[:300]
    return res


def in_place_args(d: EagleDrafter, batch: DecodeBatch) -> tuple[Any, ...]:
    """`batch.args` with the hidden states written into `d.decode_hidden_buffer(bs)` and
    that view passed (a target writing there saves `run` the hidden copy)."""
    ctx, hidden, tokens, accept = batch.args
    view = d.decode_hidden_buffer(ctx.bs)
    view.copy_(hidden)
    return ctx, view, tokens, accept


def capture_info(d: EagleDrafter, bs: int) -> dict[str, float]:
    """Capture seconds and pool bytes of both graphs at `bs`, and of the whole group."""
    fs, ms = d.decode_graphs.stats, d.multi_step_graphs.stats
    return {"capture_s": fs.capture_seconds.get(bs, 0.0) + ms.capture_seconds.get(bs, 0.0),
            "pool_bytes": fs.pool_bytes.get(bs, 0) + ms.pool_bytes.get(bs, 0),
            "group_capture_s": fs.total_capture_seconds + ms.total_capture_seconds,
            "group_pool_bytes": fs.total_pool_bytes + ms.total_pool_bytes}


@torch.inference_mode()
def measure_case(group: DraftGroup, batch: DecodeBatch, *, warmup: int = 3, reps: int = 20,
                 eager_reps: int = 8, profile: bool = True) -> dict[str, Any]:
    """Eager and graph-replay times of one decode batch (before any reduce-overhead
    `measure_compiled`).

    Keys: `{eager,graph}_{run,decode,multi,first}_us` (`time_forwards`), `eager_equals_graph`
    (bit-identical `run` outputs), `graph_replayed`, capture stats, `in_place_equals_copy`
    (the same drafts with the hidden states already in the drafter's buffer,
    `in_place_args`, and the drafts returned as its view); the time the work outside the decode replay adds to a call, three
    ways: `refresh_diff_us` = `graph_run_us - graph_decode_us` (medians timed apart) and
    `refresh_info`'s CUDA events inside each call (host gaps and the two extra event
    records included) and, on CUDA with `profile`, GPU timeline of profiled calls with
    `profile_launches`'s counts of the work one `run` issues outside its graph launch
    (measured last, after every timing). Keeps the graph output in `group.reference[bs]`.
    """
    d, bs = group.drafter, batch.ctx.bs
    if group.graphs_stale:
        raise RuntimeError("graph replay after the torch.compile baseline ran in this group: "
                           "cudagraph trees freed the cuBLAS workspace the graphs use")
    activate(d)
    d.validate(*batch.args)  # once: the timed calls skip it (validate_inputs=False)
    res: dict[str, Any] = {}
    with forced_eager():
        res.update(time_forwards("eager", d, batch, warmup=1, reps=eager_reps))
        eager_out = d.run(*batch.args)
    replays = d.decode_graphs.stats.total_replays
    res.update(time_forwards("graph", d, batch, warmup=warmup, reps=reps))
    graph_out = d.run(*batch.args)
    res["graph_replayed"] = d.decode_graphs.stats.total_replays > replays
    res["eager_equals_graph"] = bool(torch.equal(eager_out, graph_out))
    res["in_place_equals_copy"] = bool(torch.equal(
        d.run(*in_place_args(d, batch), copy_output=False), graph_out))
    res["refresh_diff_us"] = res["graph_run_us"] - res["graph_decode_us"]
    res.update(capture_info(d, bs))
    group.reference[bs] = graph_out
    res.update(refresh_info(d, batch, warmup=warmup, reps=reps, profile=profile))
    return res

