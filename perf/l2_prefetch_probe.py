"""Does an L2 prefetch on a side stream make the next GEMV faster? (GPU only, a probe.)

`python3 -m perf.l2_prefetch_probe --out DIR`

One CUDA graph per variant (`gemv_sweep.graph_time_us`), replayed; each rep runs, on the main stream, a gate_up-sized
GEMV (235 MB: HBM-bound, flushes L2), a chain of small kernels (about the non-matmul work
between two draft GEMVs) and an o_proj-sized GEMV `[4096, 4096]` whose weight rotates over
copies (never L2-resident from a previous rep). A variant forks a side stream after the big
GEMV and prefetches the first `nbytes` of the o_proj weight into L2 while the small chain
runs, joining after the o_proj GEMV. Reported per rep: the whole rep, and the o_proj GEMV
and the small chain alone (CUDA events inside the graph are not allowed, so each part is
timed as its own graph variant: rep - rep without the o GEMV, etc.). Prefetch instructions:
  line<S>   `prefetch.global.L2 [a]` every S bytes
  bulk<S>   `cp.async.bulk.prefetch.L2.global [a], S` (sm_90) every S bytes
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from graphdraft.kernels.gemv import linear_small_m
from perf.bench import copy_bandwidth, write_json
from perf.gemv_sweep import graph_time_us

REPS = 20


@triton.jit
def _prefetch_kernel(base_ptr, nbytes, sink_ptr, BLOCK: tl.constexpr, STRIDE: tl.constexpr,
                     LAST: tl.constexpr, ASM: tl.constexpr):
    """Item i of program p: one prefetch instruction (ASM) at byte `(p * BLOCK + i) * STRIDE`,
    clamped to `nbytes - LAST`."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * (BLOCK * STRIDE) + tl.arange(0, BLOCK).to(tl.int64) * STRIDE
    offs = tl.minimum(offs, nbytes - LAST)
    r = tl.inline_asm_elementwise(ASM, "=r,l", [base_ptr + offs], dtype=tl.int32, is_pure=False,
                                  pack=1)
    tl.store(sink_ptr + tl.arange(0, BLOCK), r, mask=r != 0)


def prefetch_asm(mode: str) -> tuple[str, int, int]:
    """(PTX, stride, bytes the last item covers) of `line<S>` / `bulk<S>`."""
    stride = int(mode[4:])
    if mode.startswith("bulk"):
        return f"cp.async.bulk.prefetch.L2.global [$1], {stride};\n\tmov.u32 $0, 0;", stride, stride
    return "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", stride, 1


def prefetch(w: torch.Tensor, nbytes: int, mode: str, programs: int, sink: torch.Tensor) -> None:
    asm, stride, last = prefetch_asm(mode)
    n_items = triton.cdiv(nbytes, stride)
    block = triton.next_power_of_2(triton.cdiv(n_items, programs))
    grid = (triton.cdiv(n_items, block),)
    _prefetch_kernel[grid](w.view(-1).view(torch.uint8), nbytes, sink, BLOCK=block, STRIDE=stride,
                           LAST=last, ASM=asm, num_warps=4)


def small_chain(buf: torch.Tensor, n: int) -> None:
    """`n` dependent tiny kernels (each ~2 us in a graph, like norms / RoPE / argmax stage 2)."""
    for _ in range(n):
        buf.mul_(1.0001)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="perf/out")
    p.add_argument("--small", type=int, default=6, help="small kernels between the GEMVs")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    bw = copy_bandwidth("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    g = torch.Generator(device=dev).manual_seed(0)
    big = [torch.randn(28672, 4096, device=dev, generator=g).to(torch.bfloat16) for _ in range(2)]
    o_w = [torch.randn(4096, 4096, device=dev, generator=g).to(torch.bfloat16) for _ in range(4)]
    x_big = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    x_o = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    buf = torch.ones(4096, device=dev)
    sink = torch.zeros(4096, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream(dev)
    o_bytes = o_w[0].numel() * 2

    def rep_fn(i: int, *, o_gemv: bool, chain: bool, mode: str | None, nbytes: int, programs: int):
        linear_small_m(x_big, big[i % 2])
        w = o_w[i % 4]
        if mode:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefetch(w, nbytes, mode, programs, sink)
        if chain:
            small_chain(buf, a.small)
        if o_gemv:
            linear_small_m(x_o, w)
        if mode:
            torch.cuda.current_stream().wait_stream(side)

    def time_variant(**kw) -> float:
        return graph_time_us(lambda i: rep_fn(i, **kw), REPS, reps=10)

    base = dict(mode=None, nbytes=0, programs=0)
    rows = {"gemv_only": time_variant(o_gemv=False, chain=False, **base),
            "gemv+chain": time_variant(o_gemv=False, chain=True, **base),
            "gemv+chain+o": time_variant(o_gemv=True, chain=True, **base)}
    for mode in ("line128", "line32", "bulk4096", "bulk16384"):
        for nbytes in (16 << 20, o_bytes):
            for programs in (32, 132):
                key = f"{mode}-{nbytes >> 20}MiB-{programs}p"
                rows[key] = time_variant(o_gemv=True, chain=True, mode=mode, nbytes=nbytes,
                                         programs=programs)
                rows[key + "-no-o"] = time_variant(o_gemv=False, chain=True, mode=mode,
                                                   nbytes=nbytes, programs=programs)
    ref = rows["gemv+chain+o"]
    print(f"[l2 probe] copy bw {bw / 1e12:.2f} TB/s, L2 {l2 / 2**20:.0f} MiB, o_proj {o_bytes / 2**20:.1f} "
          f"MiB (floor {o_bytes / bw * 1e6:.1f} us), {a.small} small kernels")
    print(f"  big GEMV alone {rows['gemv_only']:.1f} us; + chain {rows['gemv+chain']:.1f}; "
          f"+ o GEMV {ref:.1f} (o GEMV {ref - rows['gemv+chain']:.1f} us)")
    for k, v in rows.items():
        if k.endswith("-no-o") or k in ("gemv_only", "gemv+chain", "gemv+chain+o"):
            continue
        no_o = rows[k + "-no-o"]
        print(f"  {k:24s} rep {v:7.1f} us ({v - ref:+6.1f} vs no prefetch); o GEMV {v - no_o:5.1f} us; "
              f"chain with prefetch {no_o - rows['gemv_only']:5.1f} us (alone "
              f"{rows['gemv+chain'] - rows['gemv_only']:.1f})")
    write_json(a.out, "l2_prefetch_probe.json",
               {"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "l2_bytes": l2, "reps": REPS,
                "small_kernels": a.small, "us_per_rep": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
