"""Small-M GEMV (plain, silu_mul input, argmax and residual+norm epilogues) vs torch references
(interpreter on CPU; real sizes on the GPU)."""

from __future__ import annotations

import pytest
import torch

from graphdraft import ops
from graphdraft.kernels.argmax import argmax_with_map_ref
from graphdraft.kernels.config import TORCH, TRITON
from graphdraft.kernels.fused_inputs import SplitK
from graphdraft.kernels.gemv import (
    gemv_config,
    linear_small_m,
    linear_small_m_argmax,
    linear_small_m_partials,
    linear_small_m_ref,
    linear_small_m_residual_norm,
)
from graphdraft.kernels.norm import rms_norm_cat, rms_norm_ref
from graphdraft.kernels.rope import rope_and_store_kv, rope_and_store_kv_partials
from graphdraft.runtime.kv_cache import kv_slot

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("m,n,k", [(1, 40, 300), (3, 130, 1100), (16, 64, 128), (5, 7, 2200),
                                   (17, 48, 300), (64, 40, 260)])  # 32- and 64-row tiles
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
    (lambda x, w: (x[None], w), "x"), (lambda x, w: (torch.randn(65, 8).to(DEV), w), "x"),
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


@pytest.mark.parametrize("m", [1, 4, 20])
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


# Each row count with both values of dtype, activation and split, and every pair of values of
# those three: 8 cases, not the 32 of the full product.
@pytest.mark.parametrize("m,dtype,act,split", [
    (1, torch.float32, None, 1), (1, torch.bfloat16, "silu_mul", 4),
    (3, torch.float32, "silu_mul", 4), (3, torch.bfloat16, None, 1),
    (16, torch.float32, None, 4), (16, torch.bfloat16, "silu_mul", 1),
    (40, torch.float32, "silu_mul", 1), (40, torch.bfloat16, None, 4)])
def test_residual_norm_gathers_residual_rows(dtype, m, act, split):
    """residual_index: row m adds residual[residual_index[m]], read inside the norm kernel: the
    same bytes as an index_select before it; the torch path gathers the same way."""
    g = torch.Generator().manual_seed(m * 7 + split + (act is None))
    k, n = 512, 96
    x = torch.randn(m, 2 * k if act else k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype).to(DEV)
    res_buf = torch.randn(2 * m + 1, n + 8, generator=g).to(dtype).to(DEV)
    res = res_buf[:, 4: 4 + n]  # strided rows
    idx = torch.randint(0, 2 * m + 1, (m,), generator=g).to(DEV)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(DEV)
    cfg = gemv_config(m, n, k, block_k=128, split=split)
    assert cfg.split == split
    for index in (idx, idx.to(torch.int32)):
        out, h = linear_small_m_residual_norm(x, w, res, nw, 1e-5, act=act, config=cfg,
                                              residual_index=index)
        out2, h2 = linear_small_m_residual_norm(x, w, res.index_select(0, idx), nw, 1e-5, act=act,
                                                config=cfg)
        assert torch.equal(out, out2) and torch.equal(h, h2)
    ref_out, ref_h = ops.linear_residual_rms_norm(x, w, res, nw, 1e-5, act=act, residual_index=idx)
    gathered = ops.linear_residual_rms_norm(x, w, res[idx], nw, 1e-5, act=act)
    assert torch.equal(ref_out, gathered[0]) and torch.equal(ref_h, gathered[1])
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: the interpreter truncates
    assert _rel(h, ref_h) < tol and _rel(out, ref_out) < tol
    got = ops.linear_residual_rms_norm(x, w, res, nw, 1e-5, act=act, residual_index=idx,
                                       kernels=TRITON)  # the default config
    assert _rel(got[0], ref_out) < tol and _rel(got[1], ref_h) < tol


def test_residual_norm_bad_residual_index():
    x, w, nw = torch.randn(2, 8).to(DEV), torch.randn(3, 8).to(DEV), torch.ones(3).to(DEV)
    res, idx = torch.randn(5, 3).to(DEV), torch.tensor([4, 0]).to(DEV)
    for bad in (idx.float(), idx[:1], idx[None], idx.to("meta"), torch.arange(4).to(DEV)[::2]):
        with pytest.raises(ValueError, match="^residual_index: "):
            linear_small_m_residual_norm(x, w, res, nw, 1e-5, residual_index=bad)
    for bad in (res[:, :2], res.bfloat16(), res[0]):
        with pytest.raises(ValueError, match="^residual: "):
            linear_small_m_residual_norm(x, w, bad, nw, 1e-5, residual_index=idx)


def test_residual_norm_bad_input():
    x, w = torch.randn(2, 8).to(DEV), torch.randn(3, 8).to(DEV)
    with pytest.raises(ValueError, match="residual"):
        linear_small_m_residual_norm(x, w, torch.randn(2, 4).to(DEV), torch.ones(3).to(DEV), 1e-5)
    with pytest.raises(ValueError, match="norm_weight"):
        linear_small_m_residual_norm(x, w, torch.randn(2, 3).to(DEV), torch.ones(4).to(DEV), 1e-5)
    with pytest.raises(ValueError, match="act"):
        linear_small_m(x, w, act="gelu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 33])
@pytest.mark.parametrize("split", [1, 3])
def test_partials_sum_to_linear_small_m(dtype, m, split):
    g = torch.Generator().manual_seed(m + 10 * split)
    x = torch.randn(m, 384, generator=g).to(dtype).to(DEV)
    w = torch.randn(80, 384, generator=g).to(dtype).to(DEV)
    cfg = gemv_config(m, 80, 384, block_k=128, split=split)
    assert cfg.split == split
    sk = linear_small_m_partials(x, w, config=cfg)
    assert isinstance(sk, SplitK) and sk.dtype == dtype and sk.shape == (m, 80)
    ws = sk.partials
    assert ws.shape == (split, m, 80) and ws.dtype == torch.float32 and ws.is_contiguous()
    y = linear_small_m(x, w, config=cfg)
    if dtype == torch.float32 or DEV == "cuda":  # the interpreter truncates fp32 -> bf16
        assert torch.equal(sk.sum(), y)
    assert _rel(sk.sum(), y) < 1e-2
    assert _rel(ws.sum(0), linear_small_m_ref(x.float(), w.float())) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("gather", [False, True])
def test_rms_norm_cat_sums_partials(dtype, m, split, gather):
    """b as a GEMV's split partials: the same out and b (written to b_out), byte for byte, as
    linear_small_m followed by rms_norm_cat; close to the torch path."""
    g = torch.Generator().manual_seed(m + 10 * split + gather)
    n = 80
    x = torch.randn(m, 384, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, 384, generator=g) * 0.1).to(dtype).to(DEV)
    a = torch.randn(20 if gather else m, n, generator=g).to(dtype).to(DEV)
    wa, wb = (1 + 0.1 * torch.randn(2, n, generator=g)).to(dtype).to(DEV)
    idx = torch.randint(0, 20, (m,), generator=g).to(DEV) if gather else None
    cfg = gemv_config(m, n, 384, block_k=128, split=split)
    ws = linear_small_m_partials(x, w, config=cfg)
    b_out = torch.full((m, n + 4), float("nan"), dtype=dtype, device=DEV)[:, 2: 2 + n]
    out = rms_norm_cat(a, wa, 1e-6, ws, wb, 1e-5, a_index=idx, b_out=b_out)
    b = linear_small_m(x, w, config=cfg)
    assert torch.equal(b_out, b)
    assert torch.equal(out, rms_norm_cat(a, wa, 1e-6, b, wb, 1e-5, a_index=idx))
    b_ref = torch.empty(m, n, dtype=dtype, device=DEV)
    ref, b_sum = ops.rms_norm_cat(a, wa, 1e-6, ws, wb, 1e-5, a_index=idx, b_out=b_ref,
                                  kernels=TORCH)
    assert b_sum is b_ref
    assert _rel(b_out, b_ref) < 1e-2 and _rel(out, ref) < 1e-2
    got, b_got = ops.rms_norm_cat(a, wa, 1e-6, ws, wb, 1e-5, a_index=idx, kernels=TRITON)
    assert torch.equal(got, out) and torch.equal(b_got, b)  # b_out allocated by the op
    got, b_got = ops.rms_norm_cat(a, wa, 1e-6, b, wb, 1e-5, a_index=idx, kernels=TRITON)
    assert torch.equal(got, out) and b_got is b  # a plain b comes back as is


def test_rms_norm_cat_bad_partials():
    ws, a, w = SplitK(torch.randn(2, 3, 16), torch.float32), torch.randn(3, 16), torch.randn(16)
    b_out = torch.full((3, 16), float("nan"))
    p = ws.partials
    for bad in (p.bfloat16(), p.transpose(1, 2).contiguous().transpose(1, 2), p.to("meta"),
                p[:, :, :8]):
        with pytest.raises(ValueError, match="^b: "):
            rms_norm_cat(a, w, 1e-6, SplitK(bad, torch.float32), w, 1e-6, b_out=b_out)
    with pytest.raises(ValueError, match="^b: "):  # partials of a product in another dtype
        rms_norm_cat(a, w, 1e-6, SplitK(p, torch.bfloat16), w, 1e-6, b_out=b_out)
    for bad in (None, b_out.bfloat16(), b_out[:2], b_out.t()):
        with pytest.raises(ValueError, match="^b_out: "):
            rms_norm_cat(a, w, 1e-6, ws, w, 1e-6, b_out=bad)
    with pytest.raises(ValueError, match="^b_out: "):
        rms_norm_cat(a, w, 1e-6, a, w, 1e-6, b_out=b_out)
    with pytest.raises(ValueError, match="^b_out: "):
        ops.rms_norm_cat(a, w, 1e-6, ws, w, 1e-6, b_out=b_out[:2], kernels=TRITON)
    with pytest.raises(ValueError, match="^b: "):  # b's rows do not match a's
        rms_norm_cat(torch.randn(4, 16), w, 1e-6, ws, w, 1e-6, b_out=b_out)
    with pytest.raises(ValueError, match="^a_index: "):
        rms_norm_cat(a, w, 1e-6, ws, w, 1e-6, a_index=torch.zeros(3), b_out=b_out)
    assert b_out.isnan().all()  # nothing written


def _qkv_rope_inputs(t, hq, hkv, d, dtype, split, seed):
    g = torch.Generator().manual_seed(seed)
    n, k, slots = (hq + 2 * hkv) * d, 384, 40
    x = torch.randn(t, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype).to(DEV)
    cfg = gemv_config(t, n, k, block_k=64, split=split)
    assert cfg.split == split
    pos = torch.randint(0, 64, (t,), generator=g).to(DEV)
    loc = torch.randperm(slots, generator=g)[:t].to(DEV)
    caches = tuple(torch.randn(slots, hkv, d, generator=g).to(dtype).to(DEV) for _ in range(2))
    cos_sin = ops.rope_cos_sin_cache(d, 64, 10000.0, device=DEV)
    return x, w, cfg, pos, loc, caches, cos_sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (3, 1, 8)])
def test_rope_sums_qkv_partials(dtype, t, split, hq, hkv, d):
    """qkv as the GEMV's split partials: the same rotated q and KV cache, byte for byte, as
    linear_small_m followed by rope_and_store_kv on its views; close to the torch path."""
    x, w, cfg, pos, loc, caches, cos_sin = _qkv_rope_inputs(t, hq, hkv, d, dtype, split,
                                                            seed=t + 10 * split + hq)
    qkv = linear_small_m(x, w, config=cfg)
    q, k, v = qkv.view(t, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    kc, vc = (c.clone() for c in caches)
    rope_and_store_kv(q, k, v, pos, cos_sin, kc, vc, loc)

    ws = linear_small_m_partials(x, w, config=cfg)
    kc2, vc2 = (c.clone() for c in caches)
    q_buf = torch.full((t, hq, d + 2), float("nan"), dtype=dtype, device=DEV)
    q2 = rope_and_store_kv_partials(ws, pos, cos_sin, kc2, vc2, loc, q_out=q_buf[:, :, 1: 1 + d])
    assert q2.data_ptr() == q_buf[:, :, 1:].data_ptr()
    assert q_buf[:, :, 0].isnan().all() and q_buf[:, :, -1].isnan().all()
    assert torch.equal(q2, q) and torch.equal(kc2, kc) and torch.equal(vc2, vc)

    kc3, vc3 = (c.clone() for c in caches)
    q3 = ops.rope_and_store_qkv(ws, pos, cos_sin, kc3, vc3, loc, kernels=TORCH)
    assert _rel(q2, q3) < 1e-2 and _rel(kc2, kc3) < 1e-2 and _rel(vc2, vc3) < 1e-2
    kc4, vc4 = (c.clone() for c in caches)
    q4 = ops.rope_and_store_qkv(ws, pos, cos_sin, kc4, vc4, loc, kernels=TRITON)
    assert torch.equal(q4, q2) and torch.equal(kc4, kc2) and torch.equal(vc4, vc2)
    kc5, vc5 = (c.clone() for c in caches)  # a plain qkv: the views' RoPE, q a view of qkv
    q5 = ops.rope_and_store_qkv(linear_small_m(x, w, config=cfg), pos, cos_sin, kc5, vc5, loc, kernels=TRITON)
    assert torch.equal(q5, q2) and torch.equal(kc5, kc2) and torch.equal(vc5, vc2)


def test_rope_partials_bad_input():
    x, w, cfg, pos, loc, (kc, vc), cos_sin = _qkv_rope_inputs(3, 4, 2, 16, torch.float32, 2, 0)
    ws = linear_small_m_partials(x, w, config=cfg)
    kc0, vc0 = kc.clone(), vc.clone()
    p = ws.partials
    for bad in (p.bfloat16(), p[:, :, :-16], p[:, :, :-1], p[0], p.transpose(0, 1)):
        with pytest.raises(ValueError, match="^qkv: "):
            rope_and_store_kv_partials(SplitK(bad, p.dtype), pos, cos_sin, kc, vc, loc)
    for bad in (p, SplitK(p, torch.bfloat16)):  # a tensor; partials of a bf16 product
        with pytest.raises(ValueError, match="^qkv: "):
            rope_and_store_kv_partials(bad, pos, cos_sin, kc, vc, loc)
    for bad in (torch.empty(3, 4, 16, dtype=torch.bfloat16), torch.empty(3, 3, 16),
                torch.empty(3, 16, 4).transpose(1, 2)):
        with pytest.raises(ValueError, match="^q_out: "):
            rope_and_store_kv_partials(ws, pos, cos_sin, kc, vc, loc, q_out=bad)
    with pytest.raises(ValueError, match="^k_cache: "):
        rope_and_store_kv_partials(ws, pos, cos_sin, kc[0], vc, loc)
    for bad in (vc.bfloat16(), vc[:, :1]):  # Hkv, D and the dtype are k_cache's
        with pytest.raises(ValueError, match="^v_cache: "):
            rope_and_store_kv_partials(ws, pos, cos_sin, kc, bad, loc)
    with pytest.raises(ValueError, match="^positions: "):
        rope_and_store_kv_partials(ws, pos[:2], cos_sin, kc, vc, loc)
    with pytest.raises(ValueError, match="^out_cache_loc: "):
        rope_and_store_kv_partials(ws, pos, cos_sin, kc, vc, loc.float())
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)  # nothing written


SWAP_AB, NO_SWAP = TRITON, TRITON.replace(gemv_swap_ab=False)
"""M > 1 GEMVs as `w @ x^T` (`KernelConfig.gemv_swap_ab`, the default) or as `x @ w^T`."""


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("kc", [SWAP_AB, NO_SWAP], ids=["swap", "no_swap"])
def test_swap_ab_every_mode_matches_reference(dtype, tol, m, split, kc):
    """With `gemv_swap_ab` on or off the rows, partials, silu_mul input, residual + RMSNorm and
    argmax modes all equal their references (M == 1 keeps its CUDA-core form)."""
    g = torch.Generator().manual_seed(m * 10 + split)
    k, n = 384, 96
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    gu = torch.randn(m, 2 * k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype).to(DEV)
    cfg = gemv_config(m, n, k, block_k=64, split=split)
    assert _rel(linear_small_m(x, w, config=cfg, kernels=kc), linear_small_m_ref(x, w)) < tol
    parts = linear_small_m_partials(x, w, config=cfg, kernels=kc).partials
    assert _rel(parts.sum(0), x.float() @ w.float().T) < tol
    assert _rel(linear_small_m(gu, w, act="silu_mul", config=cfg, kernels=kc),
                linear_small_m_ref(gu, w, act="silu_mul")) < tol
    res = torch.randn(m, n, generator=g).to(dtype).to(DEV)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(DEV)
    out, h = linear_small_m_residual_norm(x, w, res, nw, 1e-5, config=cfg, kernels=kc)
    ref_out, ref_h = rms_norm_ref(linear_small_m_ref(x, w), nw, 1e-5, residual=res)
    assert _rel(h, ref_h) < tol and _rel(out, ref_out) < tol
    logits, ids = linear_small_m_argmax(x, w, kernels=kc)
    assert torch.equal(ids, argmax_with_map_ref(logits))
    assert _rel(logits, linear_small_m_ref(x, w)) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 8192), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (32000, 4096)])
@pytest.mark.parametrize("m", [1, 4, 16, 32, 64])
@pytest.mark.parametrize("swap", [False, True])
def test_gpu_draft_head_shapes(m, n, k, swap):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    kc = SWAP_AB if swap else NO_SWAP
    assert _rel(linear_small_m(x, w, kernels=kc), linear_small_m_ref(x, w)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 32])
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


# --------------------------------------------------------------------------- the draft head


def _head_setup(dtype, seed):
    """A tiny head on the Triton path, a paged KV cache with history, a backend."""
    from graphdraft.config import ModelConfig
    from graphdraft.models.attention import PagedAttentionBackend
    from graphdraft.models.eagle3 import Eagle3DraftHead
    from graphdraft.models.layers import init_random_

    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=48, vocab_size=97, draft_vocab_size=53,
                      max_position_embeddings=64, rope_theta=10000.0, num_aux_hidden_states=3)
    g = torch.Generator().manual_seed(seed)
    head = Eagle3DraftHead(cfg, dtype, hot_token_ids=torch.randperm(97, generator=g)[:53])
    init_random_(head, seed, std=0.3)
    page_size, max_reqs, pages_per_req = 4, 3, 8
    req_to_page = (torch.randperm(max_reqs * pages_per_req, generator=g) + 1).to(torch.int32)
    req_to_page = req_to_page.view(max_reqs, pages_per_req)
    slots = (max_reqs * pages_per_req + 1) * page_size
    kv = tuple(torch.randn(slots, 2, 8, generator=g).to(dtype) for _ in range(2))
    backend = PagedAttentionBackend(req_to_page, page_size, page_size * pages_per_req,
                                    kernels=TRITON)
    return head, kv, backend, g


def _slots(backend, reqs, positions):
    r2p, ps = backend.req_to_page, backend.page_size
    return kv_slot(r2p, reqs, positions, ps)


def _unfused_triton_forward(head, input_ids, positions, hidden, loc, kv, backend, meta, gather,
                            kernels):
    """The head's Triton GEMV-path forward before the launch fusions, op by op (GEMV tiles of
    `kernels`): the oracle the fused forward must equal bit for bit."""
    from graphdraft.kernels.decode_attention import paged_decode_attention
    from graphdraft.kernels.norm import rms_norm_cat
    from graphdraft.kernels.rope import rope_and_store_kv

    layer, cfg = head.midlayer, head.config
    attn, mlp = layer.self_attn, layer.mlp
    embeds = head.embed_tokens.index_select(0, input_ids)
    if hidden.shape[-1] != cfg.hidden_size:
        hidden = linear_small_m(hidden, head.fc, kernels=kernels)
    x = rms_norm_cat(embeds, layer.input_layernorm.weight, layer.input_layernorm.eps, hidden,
                     layer.hidden_norm.weight, layer.hidden_norm.eps)
    qkv = linear_small_m(x, attn.qkv_proj, kernels=kernels)
    t, hq, hkv, d = qkv.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    rope_and_store_kv(q, k, v, positions, head.cos_sin, kv[0], kv[1], loc)
    residual = hidden
    if gather is not None:
        q, residual = q.index_select(0, gather), hidden.index_select(0, gather)
    b = q.shape[0]
    o = paged_decode_attention(q, kv[0], kv[1], meta.req_pool_indices[:b], meta.kv_lens[:b],
                               backend.req_to_page, backend.page_size, attn.sm_scale,
                               max_kv_len=backend.max_context_len)
    post, final = layer.post_attention_layernorm, head.norm
    normed, residual = linear_small_m_residual_norm(o.reshape(b, -1), attn.o_proj, residual,
                                                    post.weight, post.eps, kernels=kernels)
    normed, prenorm = linear_small_m_residual_norm(
        linear_small_m(normed, mlp.gate_up_proj, kernels=kernels), mlp.down_proj, residual,
        final.weight, final.eps, act="silu_mul", kernels=kernels)
    logits, ids = linear_small_m_argmax(normed, head.lm_head, head.hot_token_ids, kernels=kernels)
    return ids, prenorm, logits


def _forced_splits(split):
    """The Triton path with every GEMV but the argmax one (split 1 by design) split `split`
    ways over BLOCK_K = 16 (`KernelConfig.gemv_split` / `gemv_block_k`)."""
    return TRITON.replace(gemv_split=split, gemv_block_k=16)


def test_forced_splits_reach_every_gemv_but_the_argmax():
    kc = _forced_splits(3)
    assert gemv_config(2, 80, 384, kernels=kc).split == 3
    assert gemv_config(2, 80, 384, kernels=kc).block_k == 16
    assert gemv_config(2, 80, 384, max_split=1, kernels=kc) == gemv_config(2, 80, 384,
                                                                            max_split=1)


def test_forced_stages_reach_every_gemv():
    """`KernelConfig.gemv_num_stages` sets the stages of M == 1 and M > 1 tiles (and of the
    argmax one); an explicit `num_stages` argument still wins."""
    kc = TRITON.replace(gemv_num_stages=2)
    for m in (1, 4, 32):
        assert gemv_config(m, 4096, 4096).num_stages in (3, 4)
        assert gemv_config(m, 4096, 4096, kernels=kc).num_stages == 2
        assert gemv_config(m, 4096, 4096, max_split=1, kernels=kc).num_stages == 2
        assert gemv_config(m, 4096, 4096, num_stages=4, kernels=kc).num_stages == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("bs", [1, 2])
def test_head_triton_forward_equals_unfused_ops(dtype, split, bs):
    """First step (fc, 3 tokens per row, gathered rows) then a later step (M = bs): the fused
    Triton forward writes the same KV and returns the same ids, hidden and logits, byte for byte,
    as the unfused ops; and stays close to the torch path."""
    from graphdraft.models.attention import AttentionMetadata, PagedAttentionBackend

    kc = _forced_splits(split)
    head, kv, backend, g = _head_setup(dtype, seed=bs * 10 + split)
    reqs = torch.tensor([1, 2][:bs])
    starts = torch.tensor([5, 2][:bs])  # history below these positions is random KV
    n = 3
    positions = (starts[:, None] + torch.arange(n)).reshape(-1)
    req_of_token = reqs.repeat_interleave(n)
    loc = _slots(backend, req_of_token, positions)
    ids = torch.randint(0, 97, (bs * n,), generator=g)
    hidden = torch.randn(bs * n, 96, generator=g).to(dtype)
    gather = torch.arange(bs) * n + (n - 1)
    meta = AttentionMetadata(reqs, (starts + n).to(torch.int32))
    nxt_pos = starts + n
    nxt_meta = AttentionMetadata(reqs, (starts + n + 1).to(torch.int32))
    nxt_loc = _slots(backend, reqs, nxt_pos)

    outs = {}
    for name in ("fused", "unfused", "torch"):  # the later step teacher-forced with fused's ids
        cache = tuple(c.clone() for c in kv)
        if name == "unfused":
            def step(*args):
                return _unfused_triton_forward(head, *args, kernels=kc)
        else:
            head.set_kernels(kc if name == "fused" else TORCH)
            backend = PagedAttentionBackend(backend.req_to_page, backend.page_size,
                                            backend.max_context_len, kernels=head.kernels)

            def step(*args):
                out = head(*args)
                return out.ids, out.hidden, out.logits
        first = step(ids, positions, hidden, loc, cache, backend, meta, gather)
        later_ids = outs["fused"][0] if outs else first[0]
        later = step(later_ids, nxt_pos, first[1], nxt_loc, cache, backend, nxt_meta, None)
        outs[name] = (*first, *later, *cache)
    for got, want in zip(outs["fused"], outs["unfused"], strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for got, want in zip(outs["fused"], outs["torch"], strict=True):
        if got.is_floating_point():
            assert _rel(got, want) < tol


def test_every_mode_of_a_tile_launches_one_compiled_kernel():
    """Plain, split-K partials (split 3 and 4), argmax and the residual + norm second launch
    (with and without a residual index) of one tile share one specialization key of the GEMV
    (the modes and the split are runtime arguments; unused pointers get typed placeholders);
    the finisher (FINISH, here up to 4 rows: `finish_norm_max_m`) is one more, whatever its
    split and residual index. Recorded with the launch options a GPU gets (a dry run: keys
    only)."""
    from graphdraft.kernels.config import default as default_kernels
    from perf.compile_census import gpu_dry_keys

    kc = default_kernels().replace(finish_norm_max_m=4)

    g = torch.Generator().manual_seed(0)
    n, k = 64, 1024
    w, nw = torch.randn(n, k, generator=g), torch.ones(n)

    def calls():
        for m in (2, 4, 8):
            x, res = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
            idx = torch.arange(m)
            for split in (3, 4):
                cfg = gemv_config(m, n, k, split=split)
                linear_small_m_partials(x, w, config=cfg)
                for index in (None, idx):
                    linear_small_m_residual_norm(x, w, res, nw, 1e-5, residual_index=index,
                                                 config=cfg, kernels=kc)
            one = gemv_config(m, n, k, split=1)
            linear_small_m(x, w, config=one)
            linear_small_m_argmax(x, w, config=one)

    rec = gpu_dry_keys(calls)
    keys = rec.keys["gemv._gemv_kernel"]
    finish = [key for key in keys if ("FINISH", ("constexpr", True)) in key]
    assert len(keys) == 2 and len(finish) == 1
    assert len(rec.keys["gemv._sum_residual_norm_kernel"]) == 1

