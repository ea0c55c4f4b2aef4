"""Kernels that write their results straight into the drafter's persistent buffers (instead of
a copy launch after them): the written bytes equal the copied ones, on the Triton and torch
paths, and bad destinations raise before anything is written."""

from __future__ import annotations

import pytest
import torch

from graphdraft import ops
from graphdraft.kernels.cache_loc import (
    compute_out_cache_loc_uniform,
    compute_out_cache_loc_uniform_ref,
)
from graphdraft.kernels.config import TORCH, TRITON
from graphdraft.kernels.gemv import gemv_config, linear_small_m_argmax, linear_small_m_residual_norm
from graphdraft.kernels.keys import KeyRecorder

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _lm_inputs(m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, k = 300, 64
    x = torch.randn(m, k, generator=g).to(DEV)
    w = torch.randn(n, k, generator=g).to(DEV)
    hot = torch.randperm(1000, generator=g)[:n].to(DEV)
    return x, w, hot


@pytest.mark.parametrize("m", [1, 3, 40])  # 40: above small_m_max (cuBLAS + Triton argmax)
@pytest.mark.parametrize("use_triton", [True, False])
def test_linear_argmax_writes_ids_and_a_strided_token_column(m, use_triton):
    x, w, hot = _lm_inputs(m, seed=m)
    logits_ref, ids_ref = ops.linear_argmax(x, w, hot, kernels=TRITON if use_triton else TORCH)
    table = torch.full((m, 4), -1, dtype=torch.int32, device=DEV)  # like next_tokens [bs, S + 1]
    ids_out = torch.full((m,), -1, dtype=torch.int64, device=DEV)
    logits, ids = ops.linear_argmax(x, w, hot, ids_out=ids_out, tokens_out=table[:, 2],
                                    kernels=TRITON if use_triton else TORCH)
    assert ids.data_ptr() == ids_out.data_ptr()
    assert torch.equal(logits, logits_ref) and torch.equal(ids_out, ids_ref)
    assert torch.equal(table[:, 2], ids_ref.to(torch.int32))
    keep = torch.ones(4, dtype=torch.bool)
    keep[2] = False
    assert torch.equal(table[:, keep], torch.full((m, 3), -1, dtype=torch.int32, device=DEV))


def test_argmax_bad_destinations_named():
    x, w, hot = _lm_inputs(2)
    with pytest.raises(ValueError, match="ids_out"):
        linear_small_m_argmax(x, w, hot, ids_out=torch.zeros(2, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="tokens_out"):
        linear_small_m_argmax(x, w, hot, tokens_out=torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="tokens_out"):
        ops.linear_argmax(x, w, hot, tokens_out=torch.zeros(2, device=DEV))


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("use_triton", [True, False])
def test_residual_norm_writes_h_out(split, use_triton):
    g = torch.Generator().manual_seed(split)
    m, k, n = 2, 512, 96
    x = torch.randn(m, k, generator=g).to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEV)
    res = torch.randn(m, n, generator=g).to(DEV)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(DEV)
    if use_triton:
        cfg = gemv_config(m, n, k, block_k=128, split=split)
        ref_out, ref_h = linear_small_m_residual_norm(x, w, res, nw, 1e-5, config=cfg)
        dst = torch.full((m + 1, n), 7.0, device=DEV)
        out, h = linear_small_m_residual_norm(x, w, res, nw, 1e-5, h_out=dst[:m], config=cfg)
    else:
        ref_out, ref_h = ops.linear_residual_rms_norm(x, w, res, nw, 1e-5)
        dst = torch.full((m + 1, n), 7.0, device=DEV)
        out, h = ops.linear_residual_rms_norm(x, w, res, nw, 1e-5, h_out=dst[:m])
    assert h.data_ptr() == dst.data_ptr()
    assert torch.equal(out, ref_out) and torch.equal(dst[:m], ref_h)
    assert torch.equal(dst[m], torch.full((n,), 7.0, device=DEV))  # nothing past it


@pytest.mark.parametrize("act", [None, "silu_mul"])
@pytest.mark.parametrize("use_triton", [True, False])
def test_residual_norm_above_small_m_writes_h_out(act, use_triton):
    """40 rows (cuBLAS; on the Triton path silu_mul and the norm are Triton kernels and the norm
    writes h straight into h_out): the same values as without h_out, nothing past it."""
    assert 40 > TRITON.small_m_max
    g = torch.Generator().manual_seed(40)
    m, k, n = 40, 64, 96
    x = torch.randn(m, 2 * k if act else k, generator=g).to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEV)
    res = torch.randn(m, n, generator=g).to(DEV)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(DEV)
    ref_out, ref_h = ops.linear_residual_rms_norm(x, w, res, nw, 1e-5, act=act,
                                                  kernels=TRITON if use_triton else TORCH)
    dst = torch.full((m + 1, n), 7.0, device=DEV)
    out, h = ops.linear_residual_rms_norm(x, w, res, nw, 1e-5, act=act, h_out=dst[:m],
                                          kernels=TRITON if use_triton else TORCH)
    assert h.data_ptr() == dst.data_ptr()
    assert torch.equal(out, ref_out) and torch.equal(dst[:m], ref_h)
    assert torch.equal(dst[m], torch.full((n,), 7.0, device=DEV))
    torch_out, torch_h = ops.linear_residual_rms_norm(x, w, res, nw, 1e-5, act=act)
    assert torch.allclose(ref_h, torch_h, atol=1e-4) and torch.allclose(ref_out, torch_out, atol=1e-4)


def test_residual_norm_bad_h_out_named():
    x, w = torch.randn(2, 8).to(DEV), torch.randn(3, 8).to(DEV)
    res, nw = torch.randn(2, 3).to(DEV), torch.ones(3).to(DEV)
    with pytest.raises(ValueError, match="h_out"):
        linear_small_m_residual_norm(x, w, res, nw, 1e-5, h_out=torch.empty(2, 4, device=DEV))


@pytest.mark.parametrize("use_triton", [True, False])
def test_uniform_cache_loc_writes_first_position_and_seq_len(use_triton):
    g = torch.Generator().manual_seed(5)
    rtp = torch.randint(1, 500, (6, 8), generator=g, dtype=torch.int32).to(DEV)
    rtp[0] = 0
    reqs = torch.tensor([3, 1, 5], device=DEV)
    starts = torch.tensor([4, 0, 17], device=DEV)
    length, bs = 3, 3
    locs = torch.zeros(length * bs, dtype=torch.int64, device=DEV)
    pos = torch.full((bs,), -1, dtype=torch.int64, device=DEV)
    seq = torch.full((bs,), -1, dtype=torch.int32, device=DEV)
    ops.out_cache_loc_uniform(locs, reqs, starts, rtp, 4, length, positions_out=pos,
                              seq_lens_out=seq, kernels=TRITON if use_triton else TORCH)
    expected = compute_out_cache_loc_uniform_ref(torch.zeros_like(locs), reqs, starts, rtp, 4, length,
                                                 out_stride_req=1, out_stride_tok=bs)
    assert torch.equal(locs, expected)
    assert torch.equal(pos, starts) and torch.equal(seq, (starts + 1).to(torch.int32))


def test_uniform_cache_loc_bad_first_outputs_write_nothing():
    rtp = torch.ones(4, 4, dtype=torch.int32, device=DEV)
    reqs = torch.tensor([1, 2], device=DEV)
    starts = torch.tensor([0, 3], device=DEV)
    locs = torch.full((4,), -5, dtype=torch.int64, device=DEV)
    pos = torch.full((2,), -5, dtype=torch.int64, device=DEV)
    for kw, name in (({"positions_out": pos}, "both or neither"),
                     ({"positions_out": pos, "seq_lens_out": torch.zeros(2, dtype=torch.int64,
                                                                         device=DEV)}, "seq_lens_out"),
                     ({"positions_out": pos[:1], "seq_lens_out": torch.zeros(2, dtype=torch.int32,
                                                                             device=DEV)}, "positions_out")):
        with pytest.raises(ValueError, match=name):
            compute_out_cache_loc_uniform(locs, reqs, starts, rtp, 4, 2, out_stride_req=1,
                                          out_stride_tok=2, **kw)
    assert torch.equal(locs, torch.full_like(locs, -5)) and torch.equal(pos, torch.full_like(pos, -5))


@pytest.mark.parametrize("bad", ["ids_out", "tokens_out", "hidden_out"])
def test_head_forward_rejects_bad_destinations_before_writing_kv(bad):
    from tests.drafter_harness import make_setup

    s = make_setup(steps=2, page_size=4)
    d, head = s.drafter, s.head
    t = 3
    ids = torch.tensor([5, 9, 2])
    positions = torch.tensor([0, 1, 2])
    hidden = torch.randn(t, head.config.hidden_size).to(head.dtype)
    locs = torch.tensor([5, 6, 7])
    kv = d.kv_pool.layer(0)
    before = [c.clone() for c in kv]
    meta = d.backend.bind_metadata(torch.tensor([1, 1, 1]), torch.tensor([1, 2, 3], dtype=torch.int32))
    wrong = {"ids_out": torch.zeros(t, dtype=torch.int32),
             "tokens_out": torch.zeros(t + 1, dtype=torch.int32),
             "hidden_out": torch.zeros(t, head.config.hidden_size + 1, dtype=head.dtype)}
    with pytest.raises(ValueError, match=bad):
        head(ids, positions, hidden, locs, kv, d.backend, meta, **{bad: wrong[bad]})
    assert all(torch.equal(a, b) for a, b in zip(kv, before, strict=True))


def _norm_inputs(m: int, rows: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k, n = 512, 96
    x = torch.randn(m, k, generator=g).to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.1).to(DEV)
    res = torch.randn(rows or m, n, generator=g).to(DEV)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(DEV)
    return x, w, res, nw, gemv_config(m, n, k, block_k=128, split=4)


@pytest.mark.parametrize("m", [1, 3, 6])
def test_norm_in_the_gemv_launch_equals_its_own_launch(m):
    from graphdraft.kernels import gemv

    x, w, res, nw, cfg = _norm_inputs(m, seed=m)
    last_program = TRITON.replace(finish_norm_max_m=16)  # the GEMV's last program runs it
    norm_launch = {"norm": gemv._sum_residual_norm_kernel}
    with KeyRecorder(norm_launch) as rec:
        fused = [linear_small_m_residual_norm(x, w, res, nw, 1e-5, config=cfg,
                                              kernels=last_program) for _ in range(2)]
    assert rec.launches["norm"] == 0
    assert int(gemv._counter(w)) == 0  # reset by the last program, ready for the next launch
    with KeyRecorder(norm_launch) as rec:  # a second launch
        separate = linear_small_m_residual_norm(x, w, res, nw, 1e-5, config=cfg,
                                                kernels=TRITON.replace(finish_norm_max_m=0))
    assert rec.launches["norm"] == 1
    for got in fused:
        assert all(torch.equal(a, b) for a, b in zip(got, separate, strict=True))


@pytest.mark.parametrize("m", [1, 6])
def test_residual_index_reads_the_gathered_rows(m):
    x, w, res, nw, cfg = _norm_inputs(m, rows=9, seed=10 + m)
    index = torch.tensor([8, 0, 3, 3, 5, 1][:m], device=DEV)
    got = linear_small_m_residual_norm(x, w, res, nw, 1e-5, residual_index=index, config=cfg)
    ref = linear_small_m_residual_norm(x, w, res.index_select(0, index), nw, 1e-5, config=cfg)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    with pytest.raises(ValueError, match="residual_index"):
        linear_small_m_residual_norm(x, w, res, nw, 1e-5, residual_index=index.float(), config=cfg)
