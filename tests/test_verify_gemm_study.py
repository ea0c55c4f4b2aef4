"""The candidate GEMM of `perf/studies/verify_gemm.py` against torch, under the Triton
interpreter: ragged rows, columns and K (clamped reads, masked stores, the K tail), grouped
program order, fp32 in IEEE precision and bf16, so a GPU run of the study times a correct
kernel."""

from __future__ import annotations

import pytest
import torch

from perf.studies.verify_gemm import GemmConfig, configs, gemm, gemm_swiglu, sweep


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


@pytest.mark.parametrize("m,i,k", [(3, 40, 64), (70, 32, 48)])
def test_gemm_swiglu_equals_linear_then_silu_mul(m, i, k):
    g = torch.Generator().manual_seed(m + i + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(2 * i, k, generator=g)
    y = x @ w.T
    ref = torch.nn.functional.silu(y[:, :i]) * y[:, i:]
    got = gemm_swiglu(x, w, GemmConfig(32, 32, 32, 2))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"\[2I, K\]"):
        gemm_swiglu(x, w[1:])


def test_sweep_records_errors_and_picks_the_fastest_correct_config(monkeypatch):
    x, w = torch.randn(8, 32), torch.randn(16, 32)
    ref = x @ w.T
    good = GemmConfig(32, 32, 32, 1)

    def run(i, cfg):
        if cfg.block_n == 64:
            raise RuntimeError("out of resources")
        return gemm(x, w, cfg) + (1.0 if cfg.group_m == 8 else 0.0)  # group 8: wrong

    import perf.timing

    times = iter([5.0, 3.0])
    monkeypatch.setattr(perf.timing, "graph_time_us", lambda fn, calls: next(times))
    recs, best, cut = sweep(run, ref, [good, GemmConfig(32, 64, 32, 1),
                                       GemmConfig(32, 32, 32, 8)], 2, float("inf"))
    assert not cut and "error" in recs[1] and recs[2]["rel_err"] > 1e-2
    assert best["config"]["group_m"] == 1 and best["us"] == 5.0
