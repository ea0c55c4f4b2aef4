"""How long after the kernel before it does a CUDA graph's first kernel start? (GPU only, a probe.)

`python3 -m perf.studies.graph_start_probe --out DIR`

Run 4 of the fourth session (perf/RESULTS.md) found the bs 128 draft graph starting 4.3 us
after the staging kernel ended, against 1.3-1.5 us at bs 1-64. This probe times that gap on
synthetic graphs, all starting with the same tiny kernel: chains of tiny kernels of several
lengths (does the gap grow with the node count?) and a tiny kernel followed by cuBLAS matmuls
of the draft head's first-step and multi-step shapes at bs 64 and 128 (does the kind of kernel
inside matter?). Each call is one eager tiny kernel then one replay, back to back behind a
sleep kernel so that the host is far ahead of the GPU (the gap is the GPU's, not the host's);
the gap is read off the profiler's GPU timeline (`bench.trace_calls`), median over calls.
It also prints the read-only bandwidth of `torch.sum` beside the copy bandwidth the floors use.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from perf.launches import GRAPH_LAUNCH_HOST, trace_calls
from perf.timing import copy_bandwidth, median_us, write_json

CALLS = 12


def _graph(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()  # warm-up (cuBLAS handles, workspaces)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    torch.cuda.synchronize()
    return g


def start_gap_us(g: torch.cuda.CUDAGraph, pre: Callable[[], None], calls: int = CALLS) -> dict:
    """Median gap (us) from the end of `pre`'s GPU work to the graph's first GPU op, and of
    the graph's GPU span; the last call's timeline."""
    def call() -> None:
        pre()
        g.replay()

    # ~10 ms of sleep first: the host queues every call before the GPU runs them
    per_call = trace_calls(call, calls=calls, host_ahead_cycles=20_000_000)
    gaps, spans = [], []
    for c in per_call:
        tl = c["timeline"]
        graph = [op for op in tl if op[0].startswith("graph:")]
        outside = [op for op in tl if op not in graph and op[0] != GRAPH_LAUNCH_HOST]
        if outside and graph:
            gaps.append(graph[0][1] - max(op[2] for op in outside))
            spans.append(graph[0][2] - graph[0][1])
    return {"gap_us": statistics.median(gaps) if gaps else None,
            "graph_span_us": statistics.median(spans) if spans else None,
            "timeline": per_call[-1]["timeline"] if per_call else []}


def read_bandwidth(sizes_mb: tuple[int, ...] = (32, 256, 1024)) -> dict[int, float]:
    """Bytes per second a bf16 `torch.sum` reads, per tensor size (MB); a side figure for the
    floors, which use the copy bandwidth."""
    out = {}
    for mb in sizes_mb:
        x = torch.randn(mb * 2**20 // 2, device="cuda", dtype=torch.bfloat16)
        out[mb] = x.numel() * 2 / (median_us(lambda x=x: x.sum(dtype=torch.float32),
                                             device="cuda", warmup=3, reps=20) * 1e-6)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="perf/out")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_start_probe: no CUDA device")
        return 0
    dev, dt = "cuda", torch.bfloat16
    tiny = torch.zeros(1024, device=dev)

    def pre() -> None:
        tiny.add_(1.0)

    def chain(n: int) -> Callable[[], None]:
        def body() -> None:
            for _ in range(n):
                tiny.mul_(1.0)
        return body

    w = {k: torch.randn(n, k_, device=dev, dtype=dt) * 0.01
         for k, (n, k_) in {"fc": (4096, 12288), "qkv": (6144, 8192), "o": (4096, 4096)}.items()}

    def matmuls(rows: int, which: tuple[str, ...]) -> Callable[[], None]:
        xs = {k: torch.randn(rows, w[k].shape[1], device=dev, dtype=dt) for k in which}

        def body() -> None:
            tiny.mul_(1.0)
            for k in which:
                torch.matmul(xs[k], w[k].t())
        return body

    variants: dict[str, Callable[[], None]] = {f"tiny x{n}": chain(n) for n in (8, 36, 57, 120)}
    for rows in (64, 128, 256, 512):
        variants[f"tiny + fc,qkv,o matmuls M={rows}"] = matmuls(rows, ("fc", "qkv", "o"))
        variants[f"tiny + o matmul M={rows}"] = matmuls(rows, ("o",))
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {},
              "read_bw": read_bandwidth(), "copy_bw": copy_bandwidth()}
    print(f"[graph_start] copy bandwidth {report['copy_bw'] / 1e12:.2f} TB/s (read + written); "
          "read-only (torch.sum): " + ", ".join(f"{mb} MB {bw / 1e12:.2f} TB/s"
                                                for mb, bw in report["read_bw"].items()))
    for name, body in variants.items():
        res = start_gap_us(_graph(body), pre)
        report["variants"][name] = res
        print(f"[graph_start] {name:36s} gap {res['gap_us']:.2f} us, graph span "
              f"{res['graph_span_us']:.1f} us; timeline "
              + ", ".join(f"{n[:28]} {t0:.1f}-{t1:.1f}" for n, t0, t1 in res["timeline"]
                          if n != GRAPH_LAUNCH_HOST), flush=True)
    write_json(a.out, "graph_start_probe.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
