"""Staging a decode batch's draft inputs (copies + padding in one launch) vs the torch path."""

from __future__ import annotations

import pytest
import torch

from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.gemv import gemv_config
from graphdraft.kernels.stage_inputs import stage_decode_inputs, stage_decode_inputs_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _buffers(max_bs, n, kh, seed):
    g = torch.Generator().manual_seed(seed)
    t = max_bs * n

    def r(*shape, dtype=torch.int64):
        return torch.randint(-5, 50, shape, generator=g, dtype=dtype).to(DEV)
    return dict(accept=r(max_bs, dtype=torch.int32), first_ids=r(t),
                first_hidden=torch.randn(t, kh, generator=g).to(DEV),
                seq_lens=r(max_bs, dtype=torch.int32), req=r(max_bs),
                extend_lens=r(max_bs, dtype=torch.int32), input_ids=r(t), positions=r(t),
                out_cache_loc=r(t))


@pytest.mark.parametrize("bs,pbs,kh", [(1, 1, 40), (3, 4, 40), (5, 8, 40), (0, 2, 40),
                                       (3, 4, 4100)])  # 4100: three column blocks per row
def test_matches_torch_path(bs, pbs, kh):
    n, max_bs = 4, 10
    got, ref = _buffers(max_bs, n, kh, 1), _buffers(max_bs, n, kh, 1)
    g = torch.Generator().manual_seed(2)
    accept = torch.randint(0, n + 1, (bs,), generator=g, dtype=torch.int32).to(DEV)
    tokens = torch.randint(0, 99, (bs * n,), generator=g).to(DEV)
    hidden_big = torch.randn(bs * n, kh + 8, generator=g).to(DEV)
    hidden = hidden_big[:, 3:3 + kh]  # strided rows
    stage_decode_inputs(bs, pbs, n, accept, tokens, hidden, **got)
    stage_decode_inputs_ref(bs, pbs, n, accept, tokens, hidden, **ref)
    for name in got:
        assert torch.equal(got[name], ref[name]), name
    assert (got["accept"][bs:pbs] == 1).all() and (got["req"][bs:pbs] == 0).all()
    assert (got["first_hidden"][bs * n:pbs * n] == 0).all()
    assert torch.equal(got["first_ids"][pbs * n:], ref["first_ids"][pbs * n:])  # untouched


@pytest.mark.parametrize("fn", [stage_decode_inputs, stage_decode_inputs_ref])
@pytest.mark.parametrize("bs,pbs", [(1, 1), (3, 4)])
def test_hidden_already_in_the_buffer(fn, bs, pbs):
    """hidden_states = first_hidden[:bs*N]: rows kept as written, padded rows zeroed, the
    other writes as with a separate source tensor."""
    n, kh, max_bs = 4, 40, 10
    got, ref = _buffers(max_bs, n, kh, 4), _buffers(max_bs, n, kh, 4)
    g = torch.Generator().manual_seed(5)
    accept = torch.randint(1, n + 1, (bs,), generator=g, dtype=torch.int32).to(DEV)
    tokens = torch.randint(0, 99, (bs * n,), generator=g).to(DEV)
    written = torch.randn(bs * n, kh, generator=g).to(DEV)
    got["first_hidden"][: bs * n] = written  # the target wrote its hidden states in place
    fn(bs, pbs, n, accept, tokens, got["first_hidden"][: bs * n], **got)
    stage_decode_inputs_ref(bs, pbs, n, accept, tokens, written.clone(), **ref)
    for name in got:
        assert torch.equal(got[name], ref[name]), name


def test_hidden_overlapping_the_buffer_elsewhere_is_refused():
    n, kh = 4, 8
    bufs = _buffers(4, n, kh, 6)
    before = {k: v.clone() for k, v in bufs.items()}
    for fn in (stage_decode_inputs, stage_decode_inputs_ref):
        with pytest.raises(ValueError, match="hidden_states: expected a tensor apart"):
            fn(2, 2, n, torch.ones(2, dtype=torch.int32, device=DEV),
               torch.zeros(8, dtype=torch.int64, device=DEV), bufs["first_hidden"][4:12], **bufs)
    for k, v in bufs.items():
        assert torch.equal(v, before[k]), k


def test_bad_shapes_write_nothing():
    n, kh = 4, 8
    bufs = _buffers(4, n, kh, 3)
    before = {k: v.clone() for k, v in bufs.items()}
    with pytest.raises(ValueError, match="hidden_states"):
        stage_decode_inputs(2, 2, n, torch.ones(2, dtype=torch.int32), torch.zeros(8, dtype=torch.int64),
                            torch.zeros(8, kh + 1), **bufs)
    with pytest.raises(ValueError, match="pbs"):
        stage_decode_inputs(3, 2, n, torch.ones(3, dtype=torch.int32), torch.zeros(12, dtype=torch.int64),
                            torch.zeros(12, kh), **bufs)
    for k, v in bufs.items():
        assert torch.equal(v, before[k]), k


def test_gemv_tiles_uniform():
    """`gemv_tiles="uniform"` (env GRAPHDRAFT_GEMV_TILES) gives M == 1 the M > 1 tiles; M > 1
    keeps them either way."""
    wide = gemv_config(1, 4096, 4096, kernels=KernelConfig())
    uniform = KernelConfig.from_env({"GRAPHDRAFT_GEMV_TILES": "uniform"})
    assert gemv_config(1, 4096, 4096, kernels=uniform) == gemv_config(4, 4096, 4096) != wide
    assert gemv_config(4, 4096, 4096, kernels=uniform) == gemv_config(4, 4096, 4096)
