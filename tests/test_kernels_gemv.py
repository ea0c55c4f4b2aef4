"""Split-K small-M GEMV vs its fp32 reference (interpreter on CPU; real sizes on the GPU)."""

from __future__ import annotations

import pytest
import torch

from graphdraft.kernels.gemv import gemv_plan, linear_small_m, linear_small_m_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("m,n,k", [(1, 40, 300), (3, 130, 1100), (16, 64, 128), (5, 7, 2200)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_matches_reference(m, n, k, dtype, tol):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    w = torch.randn(n, k, generator=g).to(dtype).to(DEV)
    out = linear_small_m(x, w)
    assert not out.isnan().any()
    assert _rel(out, linear_small_m_ref(x, w)) < tol


def test_split_k_exercised_and_deterministic():
    _, split, _ = gemv_plan(2, 40, 2200)
    assert split > 1
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 2200, generator=g).to(DEV), torch.randn(40, 2200, generator=g).to(DEV)
    a, b = linear_small_m(x, w), linear_small_m(x, w)
    assert torch.equal(a, b)


def test_strided_rows_and_out_view():
    g = torch.Generator().manual_seed(1)
    big = torch.randn(4, 600, generator=g).to(DEV)
    x = big[:, 100:356]  # row stride 600
    w = torch.randn(24, 256, generator=g).to(DEV)
    out_big = torch.full((4, 50), float("nan"), device=DEV)
    out = linear_small_m(x, w, out=out_big[:, 10:34])
    assert _rel(out, x @ w.T) < 1e-5
    assert out_big[:, :10].isnan().all() and out_big[:, 34:].isnan().all()


@pytest.mark.parametrize("bad,name", [
    (lambda x, w: (x[None], w), "x"), (lambda x, w: (torch.randn(17, 8).to(DEV), w), "x"),
    (lambda x, w: (x, w[:, :4]), "w"), (lambda x, w: (x, w.double()), "w"),
])
def test_bad_input(bad, name):
    x, w = torch.randn(2, 8).to(DEV), torch.randn(3, 8).to(DEV)
    with pytest.raises(ValueError, match=name):
        linear_small_m(*bad(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 8192), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (32000, 4096)])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_draft_head_shapes(m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    assert _rel(linear_small_m(x, w), linear_small_m_ref(x, w)) < 1e-2
