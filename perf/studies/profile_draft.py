"""Where a draft call's time goes: per-kernel GPU time of one decode `run` (GPU only).

`python3 -m perf.studies.profile_draft --out DIR [--bs 1,8] [--kv 512]`

For each bs: the 8B-shaped head (page size 16), one drafter per variant (`--variants`,
default all; `name:KNOB=V+mod.KNOB=V` also sets module knobs of `kernels.gemv` / `kernels.mod`
for that variant, e.g. `gemv:GEMV_PDL=0+pdl.ENABLED=0`), each with its graphs captured: "cublas" (`ops.SMALL_M_MAX = 0`: cuBLAS for
every matmul), "gemv" (the Triton GEMV kernels with their fused epilogues, `gemv_config`'s
swept tiles) and "gemv-uniform-tiles" (the same kernels, M = 1 given the M > 1 tiles:
`GRAPHDRAFT_GEMV_TILES=uniform`). Prints and writes (`profile_draft.json`):
  - the graph-replay time of a whole `run` (CUDA events, median) against the floor;
  - a torch.profiler kernel table of the eager path (same kernels as the graphs:
    name, launches and GPU us per call), with the sum of kernel time, and the same
    table of the graph replay when the profiler reports the kernels inside graphs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from graphdraft import ops
from graphdraft.kernels import gemv
from perf.bench import refresh_info, time_forwards
from perf.draft_group import build_group, fill_decode_batch
from perf.floors import floor_info
from perf.models_8b import LLAMA31_8B_HEAD, build_head
from perf.timing import copy_bandwidth, forced_eager, write_json

CALLS = 5


def kernel_table(fn, calls: int = CALLS) -> list[dict]:
    """GPU kernels (and memcpy/memset) run by `calls` calls of `fn`: per call launches and us."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            a = agg[e.name]
            a[0] += 1
            a[1] += e.time_range.elapsed_us()
    rows = [{"kernel": k, "launches": v[0] / calls, "us": v[1] / calls} for k, v in agg.items()]
    return sorted(rows, key=lambda r: -r["us"])


def after_l2_flush_us(fn, reps: int = 20, flush_bytes: int = 512 << 20) -> float:
    """Median GPU span of `fn` when each call follows a `flush_bytes` write (as a target
    forward between two draft calls streams its weights through L2)."""
    buf = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps + 2):
        buf.fill_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[2:])


def kernel_knobs(spec: str) -> dict:
    """`"GEMV_PDL=0+pdl.ENABLED=0"` -> `{(module, name): value}`: module-level knobs of
    `graphdraft.kernels.gemv` (bare names), `graphdraft.kernels.<module>` or `graphdraft.ops`
    (`ops.NAME`); ints, 0 / "none" for a False / None knob."""
    out = {}
    for item in filter(None, spec.split("+")):
        k, _, v = item.partition("=")
        mod_name, _, name = k.rpartition(".")
        mod = importlib.import_module("graphdraft.ops" if mod_name == "ops"
                                      else f"graphdraft.kernels.{mod_name or 'gemv'}")
        if not name.isupper() or not hasattr(mod, name):
            raise SystemExit(f"--variants: {k!r} is not a knob of {mod.__name__}")
        cur = getattr(mod, name)
        out[(mod, name)] = (None if v.lower() == "none" else bool(int(v)) if isinstance(cur, bool)
                            else int(v))
    return out


def print_table(title: str, rows: list[dict], top: int = 40) -> None:
    total = sum(r["us"] for r in rows)
    launches = sum(r["launches"] for r in rows)
    print(f"\n[profile] {title}: {launches:.0f} GPU ops per call, {total:.1f} us of kernel time")
    for r in rows[:top]:
        print(f"  {r['us']:8.1f} us  x{r['launches']:4.1f}  {r['kernel'][:110]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="perf/out")
    p.add_argument("--bs", default="1,8")
    p.add_argument("--kv", type=int, default=512)
    p.add_argument("--variants", default="cublas,gemv,gemv-uniform-tiles")
    a = p.parse_args(argv)
    sizes = tuple(int(b) for b in a.bs.split(","))
    bw = copy_bandwidth("cuda")
    head = build_head(LLAMA31_8B_HEAD, "cuda")
    report: dict = {"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "kv": a.kv, "runs": {}}
    labels = a.variants.split(",")
    knobs = {label: kernel_knobs(label.partition(":")[2]) for label in labels}
    bad = sorted({lb.partition(":")[0] for lb in labels} - {"cublas", "gemv", "gemv-uniform-tiles"})
    if bad:
        p.error(f"--variants: expected names from cublas, gemv, gemv-uniform-tiles; got {bad}")
    saved_tiles = os.environ.get(gemv.TILES_ENV)
    for label in labels:
        name = label.partition(":")[0]
        small_m = 0 if name == "cublas" else ops.SMALL_M_MAX
        tiles = "uniform" if name == "gemv-uniform-tiles" else ""
        saved, ops.SMALL_M_MAX = ops.SMALL_M_MAX, small_m
        saved_knobs = {k: getattr(*k) for k in knobs[label]}
        for (mod, name), v in knobs[label].items():
            setattr(mod, name, v)
        os.environ[gemv.TILES_ENV] = tiles  # read at every call: the graphs capture it
        try:
            group = build_group(head, 16, a.kv, sizes)
            d = group.drafter
            for bs in sizes:
                batch = fill_decode_batch(group, bs)
                fl = floor_info(LLAMA31_8B_HEAD, bs, a.kv, bw)
                with torch.inference_mode():
                    def run(d=d, batch=batch):
                        return d.run(*batch.args)
                    times = time_forwards("graph", d, batch, warmup=5, reps=30)
                    graph_us = times["graph_run_us"]
                    after_flush_us = after_l2_flush_us(run)
                    drafts = run().tolist()
                    refresh = refresh_info(d, batch, reps=30)
                    graph_rows = kernel_table(run)
                    with forced_eager():
                        eager_rows = kernel_table(run)
                key = f"{label}-bs{bs}"
                report["runs"][key] = {"drafts": drafts, "graph_run_us": graph_us,
                                       "after_l2_flush_us": after_flush_us,
                                       **{k: times[k] for k in ("graph_decode_us",
                                                                "graph_first_us",
                                                                "graph_multi_us")},
                                       **{k: refresh.get(k) for k in (
                                           "refresh_events_us", "refresh_gpu_us",
                                           "refresh_timeline", "refresh_gpu_in_place_us",
                                           "refresh_in_place_timeline")},
                                       **fl,
                                       "eager_kernels": eager_rows, "graph_kernels": graph_rows}
                print(f"\n[profile] {key}: after an L2 flush {after_flush_us:.1f} us")
                print(f"[profile] {key}: graph run {graph_us:.1f} us (decode replay "
                      f"{times['graph_decode_us']:.1f}: multi {times['graph_multi_us']:.1f}; refresh "
                      f"{refresh.get('refresh_gpu_us') or 0:.1f} on the GPU "
                      f"({refresh.get('refresh_gpu_in_place_us') or 0:.1f} in place), "
                      f"{refresh['refresh_events_us']:.1f} with host), floor {fl['floor_us']:.1f} us "
                      f"-> {graph_us / fl['floor_us']:.2f}x", flush=True)
                for name, tl in (("copy", refresh.get("refresh_timeline", [])),
                                 ("in place", refresh.get("refresh_in_place_timeline", []))):
                    print(f"[profile] {key} timeline ({name}): "
                          + ", ".join(f"{n[:24]} {t0:.1f}-{t1:.1f}" for n, t0, t1 in tl))
                print_table(f"{key} eager kernels", eager_rows)
                print_table(f"{key} graph-replay kernels", graph_rows, top=12)
            group = d = None
            torch.cuda.empty_cache()
        finally:
            ops.SMALL_M_MAX = saved
            for (mod, name), v in saved_knobs.items():
                setattr(mod, name, v)
            if saved_tiles is None:
                os.environ.pop(gemv.TILES_ENV, None)
            else:
                os.environ[gemv.TILES_ENV] = saved_tiles
    for bs in sizes:  # the variants compute the same function: report any draft that differs
        runs = {k: r["drafts"] for k, r in report["runs"].items() if k.endswith(f"-bs{bs}")}
        first = next(iter(runs.values()))
        same = [k for k, d in runs.items() if d == first]
        print(f"[profile] bs {bs}: drafts identical across {len(same)} of {len(runs)} variants"
              + ("" if len(same) == len(runs) else f" (differ: {sorted(set(runs) - set(same))})"))
    write_json(a.out, "profile_draft.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
