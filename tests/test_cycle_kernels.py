"""The cycle's prepare and commit + pack kernels == their torch references (every write)."""

from __future__ import annotations

import pytest
import torch

from graphdraft import ops
from graphdraft.kernels.config import TORCH, TRITON
from graphdraft.kernels.keys import KeyRecorder, all_kernels

R, S, P, PS, CTX, V = 7, 3, 6, 4, 24, 50


def _tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    done = torch.randint(0, 2, (R,), generator=g, dtype=torch.int32)
    done[0] = 0
    vcl = torch.randint(0, CTX - 2, (R,), generator=g, dtype=torch.int32)
    vcl[0] = 0
    last = torch.randint(0, V, (R,), generator=g)
    drafts = torch.randint(0, V, (R, S), generator=g)
    drafts[3, 1] = V + 2  # a bad id
    vcl[4] = CTX - 1      # past the context with N tokens
    done[1] = done[3] = done[4] = 0
    table = torch.randint(1, 40, (R, P), generator=g, dtype=torch.int32)
    table[0] = 0
    last[0] = 0  # slot 0 is neutral (the engine keeps it so)
    drafts[0] = 0
    return dict(done=done, vcl=vcl, last_token=last, drafts=drafts, req_to_page=table)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_prepare_matches_reference(n):
    slot_rows = torch.tensor([1, 0, 3, 4, 2, 5, 6, 0])
    rows = slot_rows.shape[0]
    outs = []
    for kc in (TRITON, TORCH):
        t = _tables(1)
        o = dict(input_ids=torch.full((rows * n,), -7), positions=torch.full((rows * n,), -7),
                 out_cache_loc=torch.full((rows * n,), -7), req=torch.full((rows,), -7),
                 seq_lens=torch.full((rows,), -7, dtype=torch.int32),
                 extend_lens=torch.full((rows,), -7, dtype=torch.int32),
                 err=torch.full((rows,), -7, dtype=torch.int32))
        ops.prepare_rows(slot_rows, n, page_size=PS, max_context_len=CTX, vocab=V, kernels=kc,
                         **t, **o)
        outs.append(o)
    for k in outs[0]:
        assert torch.equal(outs[0][k], outs[1][k]), k
    o = outs[0]
    assert o["req"][1] == 0 and o["req"][7] == 0  # padded rows: the dummy slot
    # slot 3's bad draft (column 1) is an input only when n > 2; slot 4 runs past the context
    assert int(o["err"][2]) == (1 if n > 2 else 0)
    assert int(o["err"][3]) == (2 if n > 1 else 0) and (int(o["req"][3]) == 0) == (n > 1)
    assert int(o["err"][0]) == 0 and int(o["seq_lens"][0]) == int(_tables(1)["vcl"][1]) + n


def _commit_both(prefill, with_next):
    """commit_pack on the Triton and the torch path over the same tables -> (n, nrow, outs)."""
    rows, n = 5, (1 if prefill else 4)
    nrow = 4
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, V, (rows, n), generator=g)
    nxt = torch.randint(0, V, (rows, S + 1), generator=g, dtype=torch.int32) if with_next else None
    accept = torch.tensor([1, 0, n, 2 if n > 1 else 1, 0], dtype=torch.int32)
    finish = torch.tensor([0, 0, 1, 2, 0], dtype=torch.int32)
    err = torch.tensor([0, 1, 0, 0, 2], dtype=torch.int32)
    req = torch.tensor([2, 0 if not prefill else 5, 1, 3, 0 if not prefill else 6])
    seq_lens = torch.tensor([9, 8, 7, 6, 5], dtype=torch.int32)
    outs = []
    for kc in (TRITON, TORCH):
        t = _tables(3)
        t.pop("req_to_page")
        t["emitted"] = torch.randint(0, 5, (R,), generator=torch.Generator().manual_seed(4),
                                     dtype=torch.int32)
        t["emitted"][0] = 0
        pack = torch.full((rows, nrow + 3), -7, dtype=torch.int32)
        ops.commit_pack(tokens, nxt, accept=accept, finish=finish, err=err, req=req,
                        seq_lens=seq_lens, pack=pack, prefill=prefill, kernels=kc, **t)
        outs.append(dict(t, pack=pack))
    return n, nrow, outs


@pytest.mark.parametrize("prefill,with_next", [(False, True), (False, False), (True, True)])
def test_commit_pack_matches_reference(prefill, with_next):
    n, nrow, outs = _commit_both(prefill, with_next)
    for k in outs[0]:
        assert torch.equal(outs[0][k], outs[1][k]), k
    o = outs[0]
    assert o["pack"][2, nrow] == n and o["pack"][2, nrow + 1] == 1 and o["pack"][1, nrow + 2] == 1


def test_commit_pack_one_key_for_cycle_and_prefill():
    """The cycle's commit and the prefill's (its `prefill` flag is a runtime argument) launch
    one compiled variant."""
    name = "cycle_kernels._commit_pack_kernel"
    with KeyRecorder({name: all_kernels()[name]}) as rec:
        _commit_both(False, True)
        _commit_both(True, True)
    assert rec.launches[name] == 2 and len(rec.keys[name]) == 1
