"""Small-M matmuls of the 8B-shaped draft step: cuBLAS (`F.linear`) vs the Triton split-K GEMV.

Each shape's weights are rotated among enough copies (> 4x the 60 MB L2) that every
call reads its weights from HBM, and the calls are timed as one CUDA graph of
back-to-back calls (as the draft graphs run them: the Python launch cost of an eager
call, larger than these kernels, stays out); the record holds both medians and their
share of the copy bandwidth measured in the same run. `perf.studies.gemv_sweep` tunes the tiles.
The pytest-benchmark stats time one synchronized Triton GEMV call (host launch included).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from graphdraft.kernels.gemv import linear_small_m
from perf.models_8b import DRAFT_STEP_MATMULS
from perf.timing import graph_time_us

SHAPES = {name: (n, k) for name, (n, k, _, _) in DRAFT_STEP_MATMULS.items() if name != "fc"}
"""The draft step's five matmuls (N, K), as the sweep names them (fc runs once per call)."""


@pytest.mark.parametrize("m", [1, 4, 16, 32, 64])
@pytest.mark.parametrize("name", list(SHAPES))
def test_gemv_vs_cublas(name: str, m: int, benchmark: Any, device_info: dict[str, Any]) -> None:
    n, k = SHAPES[name]
    copies = max(2, -(-(256 << 20) // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    got, ref = linear_small_m(x, ws[0]).float(), F.linear(x, ws[0]).float()
    assert (got - ref).norm() / ref.norm() < 1e-2  # bf16 outputs up to ~12: 1 ulp is 0.0625
    cublas = graph_time_us(lambda i: F.linear(x, ws[i % copies]), copies)
    triton_ = graph_time_us(lambda i: linear_small_m(x, ws[i % copies], out=out), copies)
    floor = n * k * 2 / device_info["copy_bw"] * 1e6  # weights read once (the weights-only floor)
    info = {"gemv_shape": name, "m": m, "cublas_us": cublas, "triton_gemv_us": triton_,
            "weights_floor_us": floor, "cublas_bw_share": floor / cublas,
            "triton_bw_share": floor / triton_}
    benchmark.extra_info.update(info)
    print(f"\n[perf] gemv {name} m={m}: cuBLAS {cublas:.1f} us ({floor / cublas:.0%} of copy bw), "
          f"triton {triton_:.1f} us ({floor / triton_:.0%})")

    def call() -> None:
        linear_small_m(x, ws[0], out=out)
        torch.cuda.synchronize()

    benchmark.pedantic(call, rounds=20, warmup_rounds=2, iterations=1)
    ws.clear()
