"""Mid-M GEMM (`graphdraft.kernels.gemm`: swap-AB tiles, a K split summed by each tile's last
program) against torch: the interpreter on CPU at small ragged shapes, the 8B projections on
the GPU."""

from __future__ import annotations

import pytest
import torch

from graphdraft.kernels import gemm as gemm_mod
from graphdraft.kernels.gemm import GemmConfig, gemm, gemm_ref


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


CONFIGS = [GemmConfig(32, 32, 32, 1, True, 4, 2), GemmConfig(32, 16, 16, 3, True, 4, 2),
           GemmConfig(16, 32, 32, 2, False, 4, 2), GemmConfig(64, 16, 32, 4, False, 4, 2),
           GemmConfig(32, 16, 32, 1, True, 4, 2, tma=True),
           GemmConfig(16, 32, 16, 3, False, 4, 2, tma=True)]


@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (37, 70, 96), (70, 33, 160), (130, 50, 104)])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}"
                         f"s{c.split}{'swap' if c.swap_ab else ''}{'tma' if c.tma else ''}")
def test_fp32_equals_torch(m, n, k, cfg):
    """Ragged rows (clamped reads, masked stores), a K that is not a BLOCK_K multiple (the
    masked tail), splits with the last program's sum."""
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    torch.testing.assert_close(gemm(x, w, cfg), x @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("cfg", CONFIGS[:2])
def test_bf16_within_rounding_of_f_linear(cfg):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 128, generator=g).bfloat16()
    w = torch.randn(48, 128, generator=g).bfloat16()
    got = gemm(x, w, cfg)
    assert got.dtype == torch.bfloat16
    exact = x.float() @ w.float().T  # both round this once
    assert (got.float() - exact).abs().max() <= exact.abs().max() * 2 ** -7
    assert _rel(got, gemm_ref(x, w)) < 1e-2


def test_split_is_deterministic_and_leaves_its_counters_at_zero():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(20, 256, generator=g), torch.randn(40, 256, generator=g)
    cfg = GemmConfig(32, 16, 32, 4, True, 4, 2)
    a, b = gemm(x, w, cfg), gemm(x, w, cfg)
    assert torch.equal(a, b)
    counters = gemm_mod._counters(w, 3)  # 1 row tile x 3 column tiles
    assert counters.shape == (3,) and not counters.any()


def test_strided_rows_and_out_view():
    g = torch.Generator().manual_seed(5)
    big = torch.randn(6, 300, generator=g)
    x = big[:, 100:228]  # row stride 300
    w = torch.randn(24, 128, generator=g)
    for tma in (False, True):
        out_big = torch.full((6, 40), float("nan"))
        out = gemm(x, w, GemmConfig(16, 16, 32, 2, True, 4, 2, tma=tma), out=out_big[:, 8:32])
        torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)
        assert out_big[:, :8].isnan().all() and out_big[:, 32:].isnan().all()


def test_bad_inputs_are_named():
    x, w = torch.randn(4, 32), torch.randn(8, 32)
    cfg = GemmConfig(16, 16, 16)
    with pytest.raises(ValueError, match="w"):
        gemm(x, torch.randn(8, 31), cfg)
    with pytest.raises(ValueError, match="w"):
        gemm(x, w.bfloat16(), cfg)
    with pytest.raises(ValueError, match="x"):
        gemm(x.T, w, cfg)
    with pytest.raises(ValueError, match="out"):
        gemm(x, w, cfg, out=torch.empty(4, 9))
    with pytest.raises(ValueError, match="TMA"):
        gemm(torch.randn(4, 33)[:, :32], w, GemmConfig(16, 16, 16, tma=True))  # row stride 33
    with pytest.raises(ValueError, match="block_n"):
        GemmConfig(16, 24)
    with pytest.raises(ValueError, match="split"):
        GemmConfig(16, 16, split=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [128, 256, 512])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096)])
@pytest.mark.parametrize("cfg", [GemmConfig(128, 64, 128, 2, True, 4, 3),
                                 GemmConfig(256, 128, 64, 3, True, 8, 3),
                                 GemmConfig(128, 128, 64, 1, False, 8, 4),
                                 GemmConfig(128, 128, 64, 2, False, 8, 4, tma=True),
                                 GemmConfig(128, 64, 128, 1, True, 4, 4, tma=True)],
                         ids=["swap128s2", "swap256s3", "plain128", "tma128s2", "tmaswap128"])
def test_gpu_8b_projections_within_rounding_of_f_linear(m, n, k, cfg):
    """Every 8B projection at the verify / decode row counts: within bf16 rounding of cuBLAS
    (both against the fp32 product), deterministic across calls and under graph replay."""
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    got, ref = gemm(x, w, cfg), torch.nn.functional.linear(x, w)
    exact = x.float() @ w.float().T
    scale = exact.abs().max()
    assert (got.float() - exact).abs().max() <= scale * 2 ** -7
    assert _rel(got, ref) < 5e-3
    out = torch.empty_like(got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(x, w, cfg, out=out)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)
