"""Small-M GEMV (plain, silu_mul input, argmax and residual+norm epilogues) vs torch references
(interpreter on CPU; real sizes on the GPU)."""

from __future__ import annotations

import pytest
import torch

from graphdraft.kernels.argmax import argmax_with_map_ref
from graphdraft.kernels.gemv import (
    gemv_config,
    linear_small_m,
    linear_small_m_argmax,
    linear_small_m_ref,
    linear_small_m_residual_norm,
)
from graphdraft.kernels.norm import rms_norm_ref

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
    assert gemv_config(2, 40, 2200).split > 1
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


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("split", [1, 3])
def test_silu_mul_input(m, split):
    g = torch.Generator().manual_seed(m + 10 * split)
    gate_up = torch.randn(m, 2 * 384, generator=g).to(DEV)
    w = torch.randn(24, 384, generator=g).to(DEV)
    cfg = gemv_config(m, 24, 384, block_k=128, split=split)
    assert cfg.split == split
    out = linear_small_m(gate_up, w, act="silu_mul", config=cfg)
    ref = (torch.nn.functional.silu(gate_up[:, :384]) * gate_up[:, 384:]) @ w.T
    assert _rel(out, ref) < 1e-5
    assert _rel(out, linear_small_m_ref(gate_up, w, act="silu_mul")) < 1e-5


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("hot", [False, True])
def test_argmax_epilogue(m, hot):
    g = torch.Generator().manual_seed(m + hot)
    n, k = 300, 64
    x = torch.randn(m, k, generator=g).to(DEV)
    w = torch.randn(n, k, generator=g).to(DEV)
    w[7] = w[250]  # an exact tie across blocks: the lower index must win
    x[0] = w[250] * 3  # row 0's max is the tie
    hot_ids = torch.randperm(1000, generator=g)[:n].to(DEV) if hot else None
    logits, ids = linear_small_m_argmax(x, w, hot_ids, config=gemv_config(m, n, k, block_n=64,
                                                                          max_split=1))
    assert torch.equal(logits, linear_small_m(x, w, config=gemv_config(m, n, k, block_n=64,
                                                                      max_split=1)))
    assert torch.equal(ids, argmax_with_map_ref(logits, hot_ids))
    assert int(argmax_with_map_ref(logits)[0]) == 7


def test_argmax_epilogue_nan_never_wins():
    x = torch.ones(1, 8).to(DEV)
    w = torch.randn(70, 8, generator=torch.Generator().manual_seed(3)).to(DEV)
    w[5] = float("nan")
    _, ids = linear_small_m_argmax(x, w)
    assert torch.equal(ids, argmax_with_map_ref(x @ w.T))
    assert int(ids[0]) != 5


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("act", [None, "silu_mul"])
@pytest.mark.parametrize("split", [1, 4])
def test_residual_norm_epilogue(m, act, split):
    g = torch.Generator().manual_seed(m * 7 + split)
    k, n = 512, 96
    x = torch.randn(m, 2 * k if act else k, generator=g).to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEV)
    res = torch.randn(m, n, generator=g).to(DEV)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(DEV)
    cfg = gemv_config(m, n, k, block_k=128, split=split)
    assert cfg.split == split
    out, h = linear_small_m_residual_norm(x, w, res, nw, 1e-5, act=act, config=cfg)
    y = linear_small_m_ref(x, w, act=act)
    ref_out, ref_h = rms_norm_ref(y, nw, 1e-5, residual=res)
    assert _rel(h, ref_h) < 1e-5 and _rel(out, ref_out) < 1e-5


def test_residual_norm_bad_input():
    x, w = torch.randn(2, 8).to(DEV), torch.randn(3, 8).to(DEV)
    with pytest.raises(ValueError, match="residual"):
        linear_small_m_residual_norm(x, w, torch.randn(2, 4).to(DEV), torch.ones(3).to(DEV), 1e-5)
    with pytest.raises(ValueError, match="norm_weight"):
        linear_small_m_residual_norm(x, w, torch.randn(2, 3).to(DEV), torch.ones(4).to(DEV), 1e-5)
    with pytest.raises(ValueError, match="act"):
        linear_small_m(x, w, act="gelu")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 8192), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (32000, 4096)])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_draft_head_shapes(m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    assert _rel(linear_small_m(x, w), linear_small_m_ref(x, w)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_gpu_fused_epilogues_at_head_shapes(m):
    g = torch.Generator(device="cuda").manual_seed(m)
    bf = torch.bfloat16
    gate_up = torch.randn(m, 2 * 14336, device="cuda", generator=g).to(bf)
    down = (torch.randn(4096, 14336, device="cuda", generator=g) * 0.02).to(bf)
    res = torch.randn(m, 4096, device="cuda", generator=g).to(bf)
    nw = torch.ones(4096, device="cuda", dtype=bf)
    out, h = linear_small_m_residual_norm(gate_up, down, res, nw, 1e-5, act="silu_mul")
    ref_out, ref_h = rms_norm_ref(linear_small_m_ref(gate_up, down, act="silu_mul"), nw, 1e-5,
                                  residual=res)
    assert _rel(h, ref_h) < 1e-2 and _rel(out, ref_out) < 1e-2
    lm = (torch.randn(32000, 4096, device="cuda", generator=g) * 0.02).to(bf)
    hot = torch.randperm(128256, device="cuda", generator=g)[:32000]
    logits, ids = linear_small_m_argmax(out, lm, hot)
    assert torch.equal(ids, argmax_with_map_ref(logits, hot))
    assert _rel(logits, linear_small_m_ref(out, lm)) < 1e-2
