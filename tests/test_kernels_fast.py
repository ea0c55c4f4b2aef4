"""Fast-path Triton kernels against their torch references.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set by conftest), tiny shapes.
GPU (`gpu` marker): the same comparisons at Llama-3.1-8B draft sizes, plus CUDA-graph capture.

Note: the interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest
even), so bf16 results on CPU may differ from the reference by one bf16 ulp.
"""

from __future__ import annotations

import math

import pytest
import torch

from graphdraft import ops
from graphdraft.kernels.argmax import argmax_with_map, argmax_with_map_ref
from graphdraft.kernels.config import TORCH, TRITON
from graphdraft.kernels.decode_attention import (
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from graphdraft.kernels.norm import rms_norm, rms_norm_cat, rms_norm_ref
from graphdraft.kernels.rope import rope_and_store_kv, rope_and_store_kv_ref
from graphdraft.runtime.kv_cache import kv_slot

HAS_CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.bfloat16]
# bf16: two bf16 ulps (2 * 2**-8 relative): the interpreter truncates each rounding.
TOL = {torch.float32: dict(rtol=1e-5, atol=2e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])  # NaN never passes


# --------------------------------------------------------------------------- attention


def _paged_setup(
    lens: list[int], reqs: list[int], Hq: int, Hkv: int, D: int, page_size: int,
    dtype: torch.dtype, device: str = "cpu", max_reqs: int = 5, max_len: int = 80, seed: int = 0,
):
    """Cache full of NaN except the positions some row may read; shuffled pages, page 0 unused."""
    g = torch.Generator().manual_seed(seed)
    pages_per_req = math.ceil(max_len / page_size) + 1  # page table wider than needed
    num_pages = max_reqs * pages_per_req + 1
    req_to_page = (torch.randperm(num_pages - 1, generator=g)[: max_reqs * pages_per_req] + 1)
    req_to_page = req_to_page.view(max_reqs, pages_per_req).to(torch.int32)
    k_cache = torch.full((num_pages * page_size, Hkv, D), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    need: dict[int, int] = {}
    for r, n in zip(reqs, lens, strict=True):
        need[r] = max(need.get(r, 0), n)
    for r, n in need.items():
        pos = torch.arange(n)
        slots = kv_slot(req_to_page, r, pos, page_size)
        k_cache[slots] = torch.randn(n, Hkv, D, generator=g).to(dtype)
        v_cache[slots] = torch.randn(n, Hkv, D, generator=g).to(dtype)
    q = torch.randn(len(lens), Hq, D, generator=g).to(dtype)
    to = lambda t: t.to(device)
    return (to(q), to(k_cache), to(v_cache), to(torch.tensor(reqs, dtype=torch.int32)),
            to(torch.tensor(lens, dtype=torch.int32)), to(req_to_page))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_attention_matches_reference(dtype, page_size, group):
    small = TRITON.replace(decode_block_n=16)  # several blocks and splits at lens <= 70
    Hkv, D = 2, (16 if group == 4 else 32)
    lens, reqs = [70, 1, 33, 16, 17], [2, 0, 4, 2, 1]  # two rows of one request, page edges
    q, kc, vc, req, kv_lens, r2p = _paged_setup(lens, reqs, group * Hkv, Hkv, D, page_size, dtype)
    scale = D**-0.5
    ref = paged_decode_attention_ref(q, kc, vc, req, kv_lens, r2p, page_size, scale, max_kv_len=80)
    assert not ref.isnan().any()
    for splits in (None, 1, 3):
        out = paged_decode_attention(q, kc, vc, req, kv_lens, r2p, page_size, scale, max_kv_len=80,
                                     num_splits=splits, kernels=small)
        assert out.shape == q.shape and out.dtype == dtype
        _close(out, ref, dtype)


def test_decode_attention_strided_views_int64_and_short_max_len():
    """q and out as views of wider buffers, int64 request ids, kv_lens above max_kv_len."""
    dtype, page_size, Hq, Hkv, D = torch.float32, 4, 4, 2, 16
    lens, reqs = [70, 5, 38], [1, 3, 0]
    q, kc, vc, req, kv_lens, r2p = _paged_setup(lens, reqs, Hq, Hkv, D, page_size, dtype, seed=1)
    fused = torch.randn(3, (Hq + 2 * Hkv) * D)
    q_view = fused[:, : Hq * D].view(3, Hq, D)
    q_view.copy_(q)
    out_buf = torch.full((3, Hq * D + 8), 7.0)
    out = out_buf[:, 8:].view(3, Hq, D)
    ref = paged_decode_attention_ref(q, kc, vc, req, kv_lens, r2p, page_size, 0.3, max_kv_len=70)
    # max_kv_len=40 < 70: the last split must still cover the tail.
    res = paged_decode_attention(q_view, kc, vc, req.long(), kv_lens, r2p, page_size, 0.3,
                                 max_kv_len=40, out=out, num_splits=2)
    assert res is out
    _close(out, ref, dtype)
    assert (out_buf[:, :8] == 7.0).all()


def test_decode_attention_many_splits():
    """More than 16 active splits: the combine kernel's loop over split blocks."""
    args = _paged_setup([1100, 9], [1, 0], 2, 1, 16, 16, torch.float32, max_reqs=2, max_len=1152, seed=2)
    ref = paged_decode_attention_ref(*args, 16, 0.25, max_kv_len=1152)
    _close(paged_decode_attention(*args, 16, 0.25, max_kv_len=1152, num_splits=18), ref, torch.float32)


def test_decode_attention_default_splits():
    cpu = torch.device("cpu")
    assert default_num_splits(1, 8, 4096, cpu) == 33  # 2 programs per SM
    assert default_num_splits(8, 8, 4096, cpu) == 16  # chunks of <= 256 positions
    assert default_num_splits(1, 8, 100, cpu) == 2  # capped by blocks of max_kv_len
    assert default_num_splits(32, 8, 1 << 17, cpu) == 9  # capped at ~16 programs per SM
    assert default_num_splits(64, 8, 4096, cpu) == 1
    # BLOCK_N from the config (`decode_block_n`): the cap by blocks of max_kv_len follows it
    assert default_num_splits(1, 8, 100, cpu, kernels=TRITON.replace(decode_block_n=16)) == 7


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_decode_attention_gathers_q_rows(dtype, splits, B):
    """q_index: row t's query read from q[q_index[t]] inside the kernel, the same bytes as an
    index_select before it."""
    small = TRITON.replace(decode_block_n=16)
    g = torch.Generator().manual_seed(B)
    lens = torch.randint(1, 71, (B,), generator=g).tolist()
    reqs = torch.randint(0, 5, (B,), generator=g).tolist()
    q, kc, vc, req, kv_lens, r2p = _paged_setup(lens, reqs, 4, 2, 16, 4, dtype, seed=B)
    rows = 2 * B + 1
    idx = torch.randperm(rows, generator=g)[:B]
    q_all = torch.randn(rows, 4, 16, generator=g).to(dtype)
    q_all[idx] = q
    args = (kc, vc, req, kv_lens, r2p, 4, 0.25)
    for index in (idx, idx.to(torch.int32)):
        out = paged_decode_attention(q_all, *args, max_kv_len=80, num_splits=splits, q_index=index,
                                     kernels=small)
        assert out.shape == q.shape
        assert torch.equal(out, paged_decode_attention(q, *args, max_kv_len=80, num_splits=splits,
                                                       kernels=small))
    ref = paged_decode_attention_ref(q_all, *args, max_kv_len=80, q_index=idx)
    _close(out, ref, dtype)
    assert torch.equal(ops.paged_attention(q_all, *args, 80, q_index=idx),
                       ops.paged_attention(q, *args, 80))
    assert torch.equal(ops.paged_attention(q_all, *args, 80, q_index=idx, kernels=TRITON),
                       paged_decode_attention(q, *args, max_kv_len=80))


def test_decode_attention_bad_q_index():
    q, kc, vc, req, kv_lens, r2p = _paged_setup([3, 5], [0, 1], 4, 2, 16, 1, torch.float32)
    args = (kc, vc, req, kv_lens, r2p, 1, 0.25)
    idx = torch.tensor([3, 1])
    out = torch.full((2, 4, 16), 7.0)
    for bad in (idx.float(), idx[None], idx.to("meta"), torch.arange(4)[::2]):
        with pytest.raises(ValueError, match="^q_index: "):
            paged_decode_attention(q.repeat(2, 1, 1), *args, max_kv_len=8, q_index=bad, out=out)
    with pytest.raises(ValueError, match="^req_pool_indices: "):  # 3 rows, 2 requests
        paged_decode_attention(q, *args, max_kv_len=8, q_index=torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match="^out: "):
        paged_decode_attention(q.repeat(2, 1, 1), *args, max_kv_len=8, q_index=idx,
                               out=torch.empty(4, 4, 16))
    assert (out == 7.0).all()  # nothing written


def test_decode_attention_bad_inputs():
    q, kc, vc, req, kv_lens, r2p = _paged_setup([3], [0], 4, 2, 16, 1, torch.float32)
    args = (q, kc, vc, req, kv_lens, r2p, 1, 0.25)
    with pytest.raises(ValueError, match="k_cache"):
        paged_decode_attention(q, kc.bfloat16(), *args[2:], max_kv_len=8)
    with pytest.raises(ValueError, match="req_to_page"):
        paged_decode_attention(*args[:5], r2p.long(), 1, 0.25, max_kv_len=8)
    with pytest.raises(ValueError, match="kv_lens"):
        paged_decode_attention(*args[:4], kv_lens.float(), r2p, 1, 0.25, max_kv_len=8)
    with pytest.raises(ValueError, match="q"):
        paged_decode_attention(q[0], *args[1:], max_kv_len=8)


# --------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype):
    M, N = 5, 100
    x_buf = torch.randn(M, N + 12).to(dtype)
    x = x_buf[:, 4 : 4 + N]  # strided rows
    w = torch.randn(N).to(dtype)
    _close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)

    r = torch.randn(M, N).to(dtype)
    out, h = rms_norm(x, w, 1e-5, residual=r)
    out_ref, h_ref = rms_norm_ref(x, w, 1e-5, residual=r)
    _close(out, out_ref, dtype)
    _close(h, h_ref, dtype)
    if dtype == torch.float32:
        assert torch.equal(h, h_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_cat_matches_two_norms(dtype):
    a_buf, b = torch.randn(3, 90).to(dtype), torch.randn(3, 80).to(dtype)
    a = a_buf[:, 5:85]  # strided rows
    wa, wb = torch.randn(80).to(dtype), torch.randn(80).to(dtype)
    out = rms_norm_cat(a, wa, 1e-6, b, wb, 1e-5)
    ref = torch.cat([rms_norm_ref(a, wa, 1e-6), rms_norm_ref(b, wb, 1e-5)], dim=-1)
    assert out.shape == (3, 160)
    _close(out, ref, dtype)
    with pytest.raises(ValueError, match="b"):
        rms_norm_cat(a, wa, 1e-6, b[:2], wb, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_rms_norm_cat_gathers_a_rows(dtype, M, index_dtype):
    """a_index: the first input's rows gathered from a table inside the kernel, the same bytes
    as an index_select before it."""
    g = torch.Generator().manual_seed(M)
    table_buf = torch.randn(50, 90, generator=g).to(dtype)
    table = table_buf[:, 5:85]  # strided rows
    b = torch.randn(M, 80, generator=g).to(dtype)
    wa, wb = torch.randn(80, generator=g).to(dtype), torch.randn(80, generator=g).to(dtype)
    idx = torch.randint(0, 50, (M,), generator=g)
    idx[-1] = idx[0]  # a repeated row
    out = rms_norm_cat(table, wa, 1e-6, b, wb, 1e-5, a_index=idx.to(index_dtype))
    assert torch.equal(out, rms_norm_cat(table.index_select(0, idx), wa, 1e-6, b, wb, 1e-5))
    ref = torch.cat([rms_norm_ref(table[idx], wa, 1e-6), rms_norm_ref(b, wb, 1e-5)], dim=-1)
    _close(out, ref, dtype)
    assert torch.equal(ops.rms_norm_cat(table, wa, 1e-6, b, wb, 1e-5, a_index=idx)[0],
                       ops.rms_norm_cat(table[idx], wa, 1e-6, b, wb, 1e-5)[0])
    _close(ops.rms_norm_cat(table, wa, 1e-6, b, wb, 1e-5, a_index=idx, kernels=TRITON)[0], ref,
           dtype)


def test_rms_norm_cat_bad_a_index():
    table, b, w = torch.randn(50, 16), torch.randn(3, 16), torch.randn(16)
    idx = torch.tensor([1, 2, 3])
    for bad in (idx.float(), idx[:2], idx[None], idx.to("meta"), torch.arange(6)[::2]):
        with pytest.raises(ValueError, match="a_index"):
            rms_norm_cat(table, w, 1e-6, b, w, 1e-6, a_index=bad)
    with pytest.raises(ValueError, match="b"):
        rms_norm_cat(table, w, 1e-6, torch.randn(3, 8), w[:8], 1e-6, a_index=idx)


def test_rms_norm_in_place_residual_and_out():
    x, w = torch.randn(3, 64), torch.randn(64)
    r = torch.randn(3, 64)
    out_ref, h_ref = rms_norm_ref(x, w, 1e-6, residual=r)
    out = torch.empty(3, 64)
    res = rms_norm(x, w, 1e-6, residual=r, out=out, residual_out=r)  # h overwrites residual
    assert res[0] is out and res[1] is r
    _close(out, out_ref, torch.float32)
    assert torch.equal(r, h_ref)


def test_rms_norm_empty_and_bad_inputs():
    w = torch.randn(32)
    out = rms_norm(torch.empty(0, 32), w, 1e-6)
    assert out.shape == (0, 32)
    out, h = rms_norm(torch.empty(0, 32), w, 1e-6, residual=torch.empty(0, 32))
    assert out.shape == h.shape == (0, 32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 32), torch.randn(16), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 32), w.bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(torch.randn(2, 32), w, 1e-6, residual=torch.randn(3, 32))
    with pytest.raises(ValueError, match="x"):
        rms_norm(torch.randn(2, 32).long(), w, 1e-6)


# --------------------------------------------------------------------------- rope


def _rope_inputs(T, Hq, Hkv, D, dtype, device="cpu", max_pos=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_slots = 2 * T + 30
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    pos = torch.randint(0, max_pos, (T,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1)
    loc = torch.randperm(num_slots, generator=g)[:T]
    k_cache = torch.randn(num_slots, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, Hkv, D, generator=g).to(dtype)
    to = lambda t: t.to(device)
    return to(qkv), to(pos), to(cos_sin), to(k_cache), to(v_cache), to(loc)


def _split_qkv(qkv, Hq, Hkv, D):
    T = qkv.shape[0]
    return (qkv[:, : Hq * D].view(T, Hq, D), qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D),
            qkv[:, (Hq + Hkv) * D :].view(T, Hkv, D))


def _check_rope(T, Hq, Hkv, D, dtype, device="cpu"):
    qkv, pos, cs, kc, vc, loc = _rope_inputs(T, Hq, Hkv, D, dtype, device)
    qkv2, kc2, vc2 = qkv.clone(), kc.clone(), vc.clone()
    rope_and_store_kv(*_split_qkv(qkv, Hq, Hkv, D), pos, cs, kc, vc, loc)
    rope_and_store_kv_ref(*_split_qkv(qkv2, Hq, Hkv, D), pos, cs, kc2, vc2, loc)
    _close(qkv, qkv2, dtype)  # q rotated in place, k and v untouched
    assert torch.equal(qkv[:, Hq * D :], qkv2[:, Hq * D :])
    _close(kc, kc2, dtype)
    assert torch.equal(vc, vc2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 1, 32), (6, 2, 16), (3, 3, 24)])
def test_rope_and_store_kv_matches_reference(dtype, Hq, Hkv, D):
    _check_rope(5, Hq, Hkv, D, dtype)


def test_early_loads_off_and_on_agree():
    """`KernelConfig.pdl_early_loads` off (metadata loaded after the PDL wait, as before) and on
    (before it; the interpreter's default): RoPE + KV store and attention over several splits
    with gathered query rows and its combine give the same bits, which match the reference."""
    q, kc, vc, req, kv_lens, r2p = _paged_setup([70, 3, 41], [1, 0, 4], 4, 2, 16, 4,
                                                torch.float32, seed=5)
    idx = torch.tensor([2, 0, 1])
    qkv, pos, cs, kc2, vc2, loc = _rope_inputs(4, 4, 2, 16, torch.float32)
    outs = []
    for early in (False, True):
        kernels = TRITON.replace(pdl_early_loads=early, decode_block_n=16)
        att = paged_decode_attention(q[idx.argsort()], kc, vc, req, kv_lens, r2p, 4, 0.25,
                                     max_kv_len=80, num_splits=3, q_index=idx, kernels=kernels)
        x, k_out, v_out = qkv.clone(), kc2.clone(), vc2.clone()
        rope_and_store_kv(*_split_qkv(x, 4, 2, 16), pos, cs, k_out, v_out, loc, kernels=kernels)
        outs.append((att, x, k_out, v_out))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    _close(outs[1][0], paged_decode_attention_ref(q, kc, vc, req, kv_lens, r2p, 4, 0.25,
                                                  max_kv_len=80), torch.float32)


def test_rope_bad_inputs():
    qkv, pos, cs, kc, vc, loc = _rope_inputs(3, 4, 2, 16, torch.float32)
    q, k, v = _split_qkv(qkv, 4, 2, 16)
    with pytest.raises(ValueError, match="positions"):
        rope_and_store_kv(q, k, v, pos.float(), cs, kc, vc, loc)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rope_and_store_kv(q, k, v, pos, cs.bfloat16(), kc, vc, loc)
    with pytest.raises(ValueError, match="k_cache"):
        rope_and_store_kv(q, k, v, pos, cs, kc[:, :1], vc, loc)
    with pytest.raises(ValueError, match="out_cache_loc"):
        rope_and_store_kv(q, k, v, pos, cs, kc, vc, loc[:2])


# --------------------------------------------------------------------------- argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [None, 1, 3, 8])
def test_argmax_matches_reference(dtype, splits):
    g = torch.Generator().manual_seed(0)
    B, V = 4, 3000
    buf = torch.randn(B, V + 5, generator=g).to(dtype)
    x = buf[:, 5:]  # row stride != V
    x[1] = 0.0  # all tied -> 0
    x[2, 7] = x[2, 2999] = 50.0  # tie across chunks -> 7
    x[2, 3] = float("nan")  # NaN never wins
    x[3, 1500] = x[3, 1501] = float("inf")
    hot = torch.randperm(V, generator=g)
    expected = torch.tensor([int(x[0].float().argmax()), 0, 7, 1500])
    assert torch.equal(argmax_with_map_ref(x), expected)
    assert torch.equal(argmax_with_map(x, num_splits=splits), expected)
    out = torch.empty(B, dtype=torch.int64)
    res = argmax_with_map(x, hot, out=out, num_splits=splits)
    assert res is out and torch.equal(out, hot[expected])
    assert torch.equal(argmax_with_map_ref(x, hot), hot[expected])
    for fn in (argmax_with_map, argmax_with_map_ref):  # a strided int32 column gets a copy
        cols = torch.full((B, 3), -7, dtype=torch.int32)
        fn(x, hot, num_splits=splits, tokens_out=cols[:, 1])
        assert torch.equal(cols[:, 1], hot[expected].int()) and (cols[:, [0, 2]] == -7).all()


def test_argmax_nan_and_inf_rows():
    x = torch.full((3, 70), float("nan"))
    x[1, 9] = x[1, 40] = float("-inf")
    x[2, 33] = float("-inf")
    x[2, 60] = -1e30
    for splits in (1, 3):
        got = argmax_with_map(x, num_splits=splits)
        assert torch.equal(got, argmax_with_map_ref(x))
        assert got.tolist() == [0, 0, 60]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_torch_path_and_kernel_agree_on_nan(dtype):
    """One semantics for `ops.argmax_with_map` on both paths (`argmax.argmax_with_map_torch`
    and the kernels): NaN is never the max (plain `torch.argmax` picks it), an all-NaN or
    NaN/-inf row gives 0, ties give the first index."""
    x = torch.randn(5, 70, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[0, 5] = float("nan")
    x[0, 11] = 100.0
    x[1] = float("nan")
    x[2] = float("nan")
    x[2, 40] = float("-inf")
    x[3, 20] = x[3, 50] = 100.0
    x[3, 10] = float("nan")
    x[4, 69] = float("nan")
    hot = torch.randperm(1000, generator=torch.Generator().manual_seed(4))[:70]
    want = torch.tensor([11, 0, 0, 20, int(torch.nan_to_num(x[4].float(), nan=-1e9).argmax())])
    assert int(torch.argmax(x[0])) == 5  # the old torch path: NaN won
    for kernels in (TORCH, TRITON):
        for splits_logits in (x, x[:, :64]):  # one and several argmax blocks
            n = splits_logits.shape[1]
            w = want if n == 70 else argmax_with_map_ref(splits_logits)
            got = ops.argmax_with_map(splits_logits, kernels=kernels)
            assert torch.equal(got, w), kernels.backend
        assert torch.equal(ops.argmax_with_map(x, hot, kernels=kernels), hot[want])
    assert torch.equal(ops.argmax_with_map(x.double(), kernels=TORCH), want)  # any float dtype


def test_argmax_empty_and_bad_inputs():
    assert argmax_with_map(torch.empty(0, 10)).shape == (0,)
    with pytest.raises(ValueError, match="logits"):
        argmax_with_map(torch.randn(4, 10).long())
    with pytest.raises(ValueError, match="hot_token_ids"):
        argmax_with_map(torch.randn(4, 10), torch.arange(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        argmax_with_map(torch.randn(4, 10), out=torch.empty(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="^tokens_out: "):
        argmax_with_map(torch.randn(4, 10), tokens_out=torch.empty(3, dtype=torch.int32))


# --------------------------------------------------------------------------- GPU, realistic sizes

gpu = pytest.mark.gpu
skip_no_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@gpu
@skip_no_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpu_decode_attention(dtype, T):
    g = torch.Generator().manual_seed(T)
    lens = torch.randint(1, 4097, (T,), generator=g).tolist()
    lens[0] = 4096
    reqs = [i % 40 for i in range(T)]
    args = _paged_setup(lens, reqs, 32, 8, 128, 16, dtype, "cuda", max_reqs=40, max_len=4096, seed=T)
    ref = paged_decode_attention_ref(*args, 16, 128**-0.5, max_kv_len=4096)
    for splits in (None, 1, 7):
        _close(paged_decode_attention(*args, 16, 128**-0.5, max_kv_len=4096, num_splits=splits), ref, dtype)


@gpu
@skip_no_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rms_norm_and_rope(dtype):
    for M, N in ((1, 4096), (64, 4096), (7, 14336)):
        x, r, w = (torch.randn(*shape, device="cuda").to(dtype) for shape in ((M, N), (M, N), (N,)))
        _close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), dtype)
        out, h = rms_norm(x, w, 1e-5, residual=r)
        out_ref, h_ref = rms_norm_ref(x, w, 1e-5, residual=r)
        _close(out, out_ref, dtype)
        assert torch.equal(h, h_ref)
        _close(rms_norm_cat(x, w, 1e-5, r, w, 1e-6),
               torch.cat([rms_norm_ref(x, w, 1e-5), rms_norm_ref(r, w, 1e-6)], -1), dtype)
    for T in (1, 64):
        _check_rope(T, 32, 8, 128, dtype, "cuda")


@gpu
@skip_no_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_argmax(dtype):
    for B, V in ((1, 32000), (64, 32000), (3, 128256)):
        x = torch.randn(B, V, device="cuda").to(dtype)
        x[:, V // 3] = x[:, V - 1] = 100.0
        hot = torch.randperm(V, device="cuda")
        got = argmax_with_map(x, hot)
        assert torch.equal(got, argmax_with_map_ref(x, hot))
        assert (got == hot[V // 3]).all()


@gpu
@skip_no_cuda
def test_gpu_cuda_graph_capture():
    """Attention (split path) + argmax capture and replay with new lengths, identical to eager."""
    dtype, T = torch.bfloat16, 4
    q, kc, vc, req, kv_lens, r2p = _paged_setup([900, 1, 300, 17], [0, 1, 2, 3], 32, 8, 128, 16, dtype,
                                                "cuda", max_reqs=4, max_len=2048)
    out = torch.empty_like(q)
    ids = torch.empty(T, dtype=torch.int64, device="cuda")
    w = torch.randn(32 * 128, 1000, device="cuda", dtype=dtype)

    def step():
        paged_decode_attention(q, kc, vc, req, kv_lens, r2p, 16, 128**-0.5, max_kv_len=2048, out=out)
        argmax_with_map(out.view(T, -1) @ w, out=ids)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    kv_lens.copy_(torch.tensor([800, 1, 250, 16], dtype=torch.int32))  # new lengths, same graph
    graph.replay()
    torch.cuda.synchronize()
    got_out, got_ids = out.clone(), ids.clone()
    step()
    assert torch.equal(got_out, out) and torch.equal(got_ids, ids)
    ref = paged_decode_attention_ref(q, kc, vc, req, kv_lens, r2p, 16, 128**-0.5, max_kv_len=2048)
    _close(got_out, ref, dtype)
