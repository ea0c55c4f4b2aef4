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
