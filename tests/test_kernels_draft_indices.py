"""First-step decode indices: the one-launch Triton kernel vs the drafter's torch path."""

from __future__ import annotations

import pytest
import torch

from graphdraft.kernels.draft_indices import decode_draft_indices, decode_draft_indices_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _outs(bs):
    return (torch.full((bs,), -7, dtype=torch.int64, device=DEV),
            torch.full((bs,), -7, dtype=torch.int32, device=DEV),
            torch.full((bs,), -7, dtype=torch.int64, device=DEV))


@pytest.mark.parametrize("bs,n,offset", [(1, 4, 0), (7, 4, 0), (5, 2, 9), (300, 5, 3)])
def test_matches_torch_path(bs, n, offset):
    g = torch.Generator().manual_seed(bs * 10 + n)
    accept = torch.randint(0, n + 1, (bs,), generator=g, dtype=torch.int32).to(DEV)
    accept[0] = 0  # accept length 0 clamps to 1 for the gather and the seq len
    seq = torch.randint(1, 40, (bs,), generator=g, dtype=torch.int32).to(DEV)
    seq[-1] = 1  # seq - N + a' < 1 clamps to 1
    req = torch.randperm(bs + 3, generator=g)[:bs].to(DEV)
    valid = torch.randint(0, 100, (bs + 3,), generator=g, dtype=torch.int32).to(DEV)
    got, ref = _outs(bs), _outs(bs)
    decode_draft_indices(accept, seq, req, valid, n, offset, *got)
    decode_draft_indices_ref(accept, seq, req, valid, n, offset, *ref)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    assert int(got[0][0]) == offset + 0 * n - 1 + 1


def test_bad_dtype_named():
    bs = 2
    z32 = torch.zeros(bs, dtype=torch.int32, device=DEV)
    gather, seq, ws = _outs(bs)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_draft_indices(z32, z32, z32.long(), z32, 4, 0, gather, seq.long(), ws)
    with pytest.raises(ValueError, match="gather_ids"):
        decode_draft_indices(z32, z32, z32.long(), z32, 4, 0, gather[:1], seq, ws)


@pytest.mark.parametrize("tok_dtype", [torch.int32, torch.int64])
def test_last_token_into_a_strided_column(tok_dtype):
    bs, n, offset = 6, 4, 5
    g = torch.Generator().manual_seed(3)
    accept = torch.randint(0, n + 1, (bs,), generator=g, dtype=torch.int32).to(DEV)
    seq = torch.randint(4, 40, (bs,), generator=g, dtype=torch.int32).to(DEV)
    req = torch.arange(1, bs + 1, device=DEV)
    valid = torch.randint(0, 30, (bs + 1,), generator=g, dtype=torch.int32).to(DEV)
    tokens = torch.randint(0, 1000, (offset + bs * n + 3,), generator=g, dtype=tok_dtype).to(DEV)
    results = []
    for fn in (decode_draft_indices, decode_draft_indices_ref):
        table = torch.full((bs, n), -1, dtype=torch.int32, device=DEV)  # like next_tokens
        outs = _outs(bs)
        fn(accept, seq, req, valid, n, offset, *outs, tokens, table[:, 0])
        assert torch.equal(table[:, 1:], torch.full_like(table[:, 1:], -1))  # other columns kept
        assert torch.equal(table[:, 0].long(), tokens.long()[outs[0]])
        results.append(table)
    assert torch.equal(results[0], results[1])


def test_last_token_bad_input_writes_nothing():
    bs = 2
    z32 = torch.zeros(bs, dtype=torch.int32, device=DEV)
    gather, seq, ws = _outs(bs)
    last = torch.full((bs,), -7, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="tokens"):  # too short for offset + bs * n
        decode_draft_indices(z32, z32, z32.long(), z32, 4, 0, gather, seq, ws,
                             torch.zeros(5, dtype=torch.int64, device=DEV), last)
    with pytest.raises(ValueError, match="both or neither"):
        decode_draft_indices(z32, z32, z32.long(), z32, 4, 0, gather, seq, ws, None, last)
    assert torch.equal(gather, torch.full_like(gather, -7)) and torch.equal(last, torch.full_like(last, -7))
