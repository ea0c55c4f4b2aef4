"""Small-M matmuls of the 8B-shaped draft step: cuBLAS (`F.linear`) vs the Triton split-K GEMV.

Each shape's weights are rotated among enough copies (> 4x the 60 MB L2) that every
call reads its weights from HBM; the record holds both medians and their share of
the copy bandwidth measured in the same run. It decides whether
`graphdraft.kernels.gemv.linear_small_m` should replace cuBLAS for draft steps.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from graphdraft.kernels.gemv import linear_small_m
from perf.bench import median_us

SHAPES = {"qkv": (6144, 8192), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (32000, 4096)}


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("name", list(SHAPES))
def test_gemv_vs_cublas(name: str, m: int, benchmark: Any, device_info: dict[str, Any]) -> None:
    n, k = SHAPES[name]
    copies = max(2, -(-(256 << 20) // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    assert (linear_small_m(x, ws[0]) - F.linear(x, ws[0])).abs().max() < 0.05
    cyc_a, cyc_b = itertools.cycle(ws), itertools.cycle(ws)
    cublas = median_us(lambda: F.linear(x, next(cyc_a)), warmup=copies, reps=60)
    triton_ = median_us(lambda: linear_small_m(x, next(cyc_b), out=out), warmup=copies, reps=60)
    floor = n * k * 2 / device_info["copy_bw"] * 1e6  # weights read once, as DESIGN.md counts
    info = {"gemv_shape": name, "m": m, "cublas_us": cublas, "triton_gemv_us": triton_,
            "weights_floor_us": floor, "cublas_bw_share": floor / cublas,
            "triton_bw_share": floor / triton_}
    benchmark.extra_info.update(info)
    print(f"\n[perf] gemv {name} m={m}: cuBLAS {cublas:.1f} us ({floor / cublas:.0%} of copy bw), "
          f"triton {triton_:.1f} us ({floor / triton_:.0%})")
    del ws
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
