"""The candidate GEMM of `perf/studies/verify_gemm.py` against torch, under the Triton
interpreter: ragged rows, columns and K (clamped reads, masked stores, the K tail), grouped
program order, fp32 in IEEE precision and bf16, so a GPU run of the study times a correct
kernel."""

from __future__ import annotations

import pytest
import torch

from perf.studies.verify_gemm import GemmConfig, configs, gemm


@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (37, 70, 96), (64, 128, 80), (130, 50, 33)])
@pytest.mark.parametrize("group", [1, 3])
def test_gemm_equals_torch(m, n, k, group):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    cfg = GemmConfig(block_m=32, block_n=32, block_k=32, group_m=group)
    torch.testing.assert_close(gemm(x, w, cfg), x @ w.T, rtol=1e-5, atol=1e-4)
    xb, wb = x.bfloat16(), w.bfloat16()
    got = gemm(xb, wb, cfg)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), xb.float() @ wb.float().T, rtol=2e-2, atol=5e-2)


def test_gemm_writes_into_a_strided_out_and_rejects_bad_shapes():
    x, w = torch.randn(5, 32), torch.randn(16, 32)
    big = torch.full((5, 40), 7.0)
    gemm(x, w, GemmConfig(32, 32, 32, 1), out=big[:, 4:20])
    torch.testing.assert_close(big[:, 4:20], x @ w.T, rtol=1e-5, atol=1e-4)
    assert (big[:, :4] == 7).all() and (big[:, 20:] == 7).all()
    with pytest.raises(ValueError, match="x, w"):
        gemm(x, torch.randn(16, 31))


def test_configs_fit_the_rows():
    assert all(c.block_m == 64 for c in configs(64))
    assert {c.block_m for c in configs(256)} == {64, 128}
