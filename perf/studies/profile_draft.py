"""Where a draft call's time goes: per-kernel GPU time of one decode `run` (GPU only).

`python3 -m perf.studies.profile_draft --out DIR [--bs 1,8] [--kv 512]`

For each bs: the 8B-shaped head (page size 16), one drafter per variant (`--variants`,
default all; `name:field=V+field=V` also sets `KernelConfig` fields for that variant, values
as their environment variables take them, e.g. `gemv:gemv_pdl=0+pdl=0`), each with its graphs
captured under its own `RuntimeConfig.kernels`: "cublas" (`small_m_max=0`: cuBLAS for every
matmul), "gemv" (the Triton GEMV kernels with their fused epilogues, `gemv_config`'s swept
tiles) and "gemv-uniform-tiles" (the same kernels, M = 1 given the M > 1 tiles:
`gemv_tiles="uniform"`, env `GRAPHDRAFT_GEMV_TILES=uniform`). Prints and writes (`profile_draft.json`):
  - the graph-replay time of a whole `run` (CUDA events, median) against the floor;
  - a torch.profiler kernel table of the eager path (same kernels as the graphs:
    name, launches and GPU us per call), with the sum of kernel time, and the same
    table of the graph replay when the profiler reports the kernels inside graphs.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from graphdraft.kernels.config import ENV_VARS, KernelConfig
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
    """`"gemv_pdl=0+pdl=0"` -> `{"gemv_pdl": False, "pdl": False}`: `KernelConfig` fields,
    each value parsed as its environment variable's (`kernels/config.ENV_VARS`)."""
    out = {}
    for item in filter(None, spec.split("+")):
        k, _, v = item.partition("=")
        if k not in ENV_VARS:
            raise SystemExit(f"--variants: {k!r} is not a KernelConfig field ({sorted(ENV_VARS)})")
        var, parse = ENV_VARS[k]
        try:
            out[k] = parse(v)
        except ValueError:
            raise SystemExit(f"--variants: {k}={v!r} does not parse (as {var} would)") from None
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
    base = KernelConfig.from_env()
    for label in labels:
        name = label.partition(":")[0]
        variant = {"cublas": {"small_m_max": 0}, "gemv-uniform-tiles": {"gemv_tiles": "uniform"}}
        kernels = base.replace(**(variant.get(name, {}) | knobs[label]))
        # one drafter (and its graphs) per variant, under its own kernel settings
        group = build_group(head, 16, a.kv, sizes, kernels=kernels)
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
