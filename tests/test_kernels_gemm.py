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
    from graphdraft.kernels.config import KernelConfig

    for bad in (((("cpu", 64, 48), "cublaslt"),), (((64, 48, 64, 1), "cublaslt"),),
                ((("cpu", 64, 48, 64), "cublas"),),
                ((("cpu", 64, 48, 64), (64, 16, 32, 2, 1, 4, 2, True)),),
                [(("cpu", 64, 48, 64), "cublaslt")]):
        with pytest.raises(ValueError, match="gemm_routes"):
            KernelConfig(backend="triton", gemm_routes=bad)


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


# ------------------------------------------------------------------ ops.linear's dispatch
def test_gemm_config_buckets_and_bounds():
    from graphdraft.kernels import buckets
    from graphdraft.kernels.config import TORCH, TRITON

    tile = GemmConfig(128, 16, 32, 2, True, 4, 2)
    t = (128, 16, 32, 2, True, 4, 2, False)
    TRITON = TRITON.replace(gemm_routes=((("cpu", 64, 48, 64), t), (("cpu", 128, 48, 64), t),
                                         (("cpu", 256, 64, 64), gemm_mod.CUBLASLT),
                                         (("Some GPU", 512, 48, 64), t)))
    assert [buckets.gemm_m_bucket(m) for m in (33, 65, 128, 129, 256, 1024)] == [
        64, 128, 128, 256, 256, 1024]
    with pytest.raises(ValueError, match="m: expected"):
        buckets.gemm_m_bucket(1025)
    assert buckets.gemm_config(40, 48, 64, "cpu", kernels=TRITON) == tile
    assert buckets.gemm_config(32, 48, 64, "cpu", kernels=TRITON) is None  # the GEMV's rows
    assert buckets.gemm_config(129, 48, 64, "cpu", kernels=TRITON) is None  # no tile at 256
    assert buckets.gemm_config(40, 48, 128, "cpu", kernels=TRITON) is None  # another shape
    assert buckets.gemm_config(40, 48, 64, "cpu", kernels=TORCH) is None
    assert buckets.gemm_config(40, 48, 64, "cpu") is None  # the default config: the torch path
    assert buckets.gemm_config(40, 48, 64, "cpu", kernels=TRITON.replace(gemm_max_m=0)) is None
    # row buckets: the gemm bucket where it has tiles, cuBLAS elsewhere
    assert buckets.gemm_config(129, 64, 64, "cpu", kernels=TRITON) == gemm_mod.CUBLASLT
    assert buckets.gemm_config(129, 64, 64, "Some GPU", kernels=TRITON) is None  # another card
    assert buckets.gemm_config(300, 48, 64, "Some GPU", kernels=TRITON) == tile
    assert buckets.row_bucket(100, kernels=TRITON) == buckets.row_bucket(128, kernels=TRITON)
    assert buckets.row_bucket(40, kernels=TRITON)[0] == ("gemm", 64)
    assert buckets.row_bucket(100, kernels=TRITON)[0] == ("gemm", 128)
    assert buckets.row_bucket(129, kernels=TRITON)[0] == ("cublas",)  # cuBLASLt: no compile
    assert buckets.row_bucket(40, kernels=TORCH)[0] == ("cublas",)


@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_ops_linear_runs_the_listed_tile_within_rounding_of_f_linear(monkeypatch, act):
    """`ops.linear` at rows above the GEMV's: `kernels.gemm` for a listed (bucket, N, K), the
    same values as the torch path within bf16 rounding (act applied first, as cuBLAS's path
    does); an unlisted shape stays on cuBLAS."""
    from graphdraft import ops
    from graphdraft.kernels import gemv
    from graphdraft.kernels.config import TRITON

    TRITON = TRITON.replace(gemm_routes=((("cpu", 64, 48, 64), (64, 16, 32, 2, True, 4, 2, True)),
                                         (("cpu", 128, 48, 64), gemm_mod.CUBLASLT)))
    calls = []
    real = gemm_mod.gemm
    monkeypatch.setattr(gemm_mod, "gemm", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 128 if act else 64, generator=g).bfloat16()
    w = (torch.randn(48, 64, generator=g) * 0.1).bfloat16()
    got = ops.linear(x, w, act=act, kernels=TRITON)
    assert len(calls) == 1 and calls[0].tma
    ref = gemv.linear_ref(x, w, act=act)
    exact = ops.apply_act(x, act, kernels=TRITON).float() @ w.float().T  # the input it read
    assert (got.float() - exact).abs().max() <= exact.abs().max() * 2 ** -7
    assert _rel(got, ref) < 2e-2  # ref's activation rounds on its own (silu_mul_ref)
    ops.linear(x[:, :64], torch.randn(40, 64).bfloat16(), kernels=TRITON)  # not listed
    ops.linear(x[:, :64].float(), w.float(), kernels=TRITON)  # fp32: cuBLAS
    assert len(calls) == 1
    x100 = torch.randn(100, 64, generator=g).bfloat16()  # bucket 128: cuBLASLt, F.linear's values
    assert torch.equal(ops.linear(x100, w, kernels=TRITON), torch.nn.functional.linear(x100, w))
    assert len(calls) == 1


def test_shipped_routes_are_valid_and_keyed_by_their_card():
    """The default `gemm_routes` (measured on an H100 SXM) parse as routes and never apply on
    another card (here the CPU's "cpu")."""
    from graphdraft.kernels import buckets
    from graphdraft.kernels.config import GEMM_ROUTES, TRITON

    assert TRITON.gemm_routes == GEMM_ROUTES and GEMM_ROUTES
    for (card, bucket, n, k), route in GEMM_ROUTES:
        assert card.startswith("NVIDIA ") and bucket in buckets.GEMM_M_BUCKETS
        want = route if isinstance(route, str) else GemmConfig(*route)
        assert buckets.gemm_config(bucket, n, k, card, kernels=TRITON) == want
        assert buckets.gemm_config(bucket, n, k, "cpu", kernels=TRITON) is None


@pytest.mark.gpu
@pytest.mark.parametrize("m", [40, 100, 128, 200])
def test_gpu_ops_linear_down_proj_within_rounding_of_f_linear(m):
    """The 8B down_proj through `ops.linear` on the Triton path (its shipped route on this
    card where it has one: cuBLASLt up to 128 rows on an H100) equals F.linear's values
    within bf16 rounding, eagerly and replayed."""
    from graphdraft import ops
    from graphdraft.kernels.config import TRITON
    from graphdraft.kernels.gemv import silu_mul_ref

    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 2 * 14336, device="cuda", generator=g).bfloat16()
    w = (torch.randn(4096, 14336, device="cuda", generator=g) * 0.02).bfloat16()
    got = ops.linear(x, w, act="silu_mul", kernels=TRITON)
    a = ops.apply_act(x, "silu_mul", kernels=TRITON)
    exact = a.float() @ w.float().T
    assert (got.float() - exact).abs().max() <= exact.abs().max() * 2 ** -7
    assert _rel(got, torch.nn.functional.linear(silu_mul_ref(x), w)) < 1e-2
    out = torch.empty_like(got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(ops.linear(x, w, act="silu_mul", kernels=TRITON))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)
