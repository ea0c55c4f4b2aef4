"""kernels/tree_slots.py (the tree cycle's rows in and out) and kernels/tree_first_inputs.py
(the first draft step's inputs): each kernel (TRITON_INTERPRET=1 on the CPU) writes what its
torch path writes, and the torch path what the module doc's rule says, row by row."""

from __future__ import annotations

import os

import pytest
import torch

from graphdraft.kernels.cache_loc import kv_slots
from graphdraft.kernels.tree_first_inputs import first_inputs, first_inputs_ref
from graphdraft.kernels.tree_slots import load_rows, load_rows_ref, store_rows, store_rows_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
NF = 6


def _world(seed: int, slots: int = 7, n: int = 5, page: int = 4):
    g = torch.Generator().manual_seed(seed)
    tables = [torch.randint(-1, 60, (slots + 1, n), generator=g).to(DEV) for _ in range(NF)]
    done = (torch.rand(slots, generator=g) < 0.3).int().to(DEV)
    vcl = torch.randint(0, 40, (slots,), generator=g, dtype=torch.int32).to(DEV)
    req_to_page = torch.randint(0, 30, (slots, 16), generator=g, dtype=torch.int32).to(DEV)
    temp = torch.rand(slots, generator=g).to(DEV)
    top_k = torch.randint(0, 9, (slots,), generator=g, dtype=torch.int32).to(DEV)
    return g, tables, done, vcl, req_to_page, temp, top_k, page


def _load(fn, bs, n, world, slot_rows, with_io):
    g, tables, done, vcl, req_to_page, temp, top_k, page = world
    out = [torch.full((bs, n), -7, dtype=torch.int64, device=DEV) for _ in range(NF + 2)]
    live = torch.zeros(bs, dtype=torch.bool, device=DEV)
    req, plen = (torch.full((bs,), -7, dtype=torch.int64, device=DEV) for _ in range(2))
    cols = [torch.zeros(bs, device=DEV), torch.zeros(bs, dtype=torch.int64, device=DEV)]
    v_loc = torch.full((bs * n,), -7, dtype=torch.int64, device=DEV)
    v_seq = torch.zeros(bs, dtype=torch.int32, device=DEV)
    io = dict(columns=[(temp, cols[0]), (top_k, cols[1])],
              verify=(req_to_page, page, v_loc, v_seq)) if with_io else {}
    fn(slot_rows, done, vcl, [t[:-1] for t in tables], out[:NF], out[NF], out[NF + 1], live,
       req, plen, **io)
    return [*out, live, req, plen, *cols, v_loc, v_seq]


@pytest.mark.parametrize("with_io", [False, True])
def test_load_ref_is_the_rule(with_io):
    world = _world(1)
    _, tables, done, vcl, req_to_page, temp, top_k, page = world
    slot_rows = torch.tensor([3, 0, 6, 1, 2, 5]).to(DEV)
    got = _load(load_rows_ref, 6, 5, world, slot_rows, with_io)
    for r, s in enumerate(slot_rows.tolist()):
        live = s > 0 and int(done[s]) == 0
        q = s if live else 0
        L = int(vcl[q]) if live else 0
        assert (bool(got[NF + 2][r]), int(got[NF + 3][r]), int(got[NF + 4][r])) == (live, q, L)
        for f in range(NF):
            assert torch.equal(got[f][r], tables[f][q])
        assert torch.equal(got[NF][r], L + tables[2][q])
        assert got[NF + 1][r].tolist() == [r * 5 + i for i in range(5)]
        if with_io:
            assert float(got[NF + 5][r]) == float(temp[q]) and int(got[NF + 6][r]) == int(top_k[q])
            want = kv_slots(req_to_page, torch.tensor(q, device=DEV),
                            torch.arange(L, L + 5, device=DEV), page)
            assert torch.equal(got[NF + 7][r * 5:(r + 1) * 5], want)
            assert int(got[NF + 8][r]) == L + 5


@pytest.mark.skipif(not TRITON, reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_io", [False, True])
def test_load_kernel_is_the_torch_path(seed, with_io):
    world = _world(seed, n=6)
    slot_rows = torch.randint(0, 7, (5,), generator=world[0]).to(DEV)
    want = _load(load_rows_ref, 5, 6, world, slot_rows, with_io)
    got = _load(load_rows, 5, 6, world, slot_rows, with_io)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("fn", [store_rows_ref, store_rows] if TRITON else [store_rows_ref])
def test_store_keeps_slot_zero(fn):
    _, tables, *_ = _world(4)
    rows = [torch.randint(100, 200, (4, 5), generator=torch.Generator().manual_seed(f)).to(DEV)
            for f in range(NF)]
    req = torch.tensor([2, 0, 5, 0]).to(DEV)
    want = [t.clone() for t in tables]
    for f in range(NF):
        want[f][2], want[f][5] = rows[f][0], rows[f][2]
    got = [t.clone() for t in tables]
    fn(rows, req, got)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a[:-1], b[:-1])          # the spare row: the torch path's bin


def _first(fn, seed):
    g = torch.Generator().manual_seed(seed)
    bs, p, page = 4, 3, 4
    req = torch.tensor([1, 0, 3, 2]).to(DEV)
    L = torch.randint(0, 50, (bs,), generator=g).to(DEV)
    acc = torch.tensor([0, 1, 3, 5], dtype=torch.int32).to(DEV)      # clamped into 1..P
    table = torch.randint(0, 20, (4, 16), generator=g, dtype=torch.int32).to(DEV)
    outs = [torch.full((bs * p,), -7, dtype=torch.int64, device=DEV),
            torch.full((bs * p,), -7, dtype=torch.int64, device=DEV),
            torch.full((bs,), -7, dtype=torch.int64, device=DEV),
            torch.zeros(bs, dtype=torch.int32, device=DEV)]
    fn(req, L, acc, table, page, p, *outs)
    return (req, L, acc, table, page, p), outs


def test_first_inputs_ref_is_the_rule():
    (req, L, acc, table, page, p), (pos, loc, gather, prefix) = _first(first_inputs_ref, 0)
    a = acc.clamp(1, p)
    for r in range(4):
        assert pos[r * p:(r + 1) * p].tolist() == [int(L[r]) + d for d in range(p)]
        assert torch.equal(loc[r * p:(r + 1) * p], kv_slots(table, req[r], pos[r * p:(r + 1) * p],
                                                            page))
        assert int(gather[r]) == r * p + int(a[r]) - 1 and int(prefix[r]) == int(L[r] + a[r])


@pytest.mark.skipif(not TRITON, reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("seed", range(3))
def test_first_inputs_kernel_is_the_torch_path(seed):
    _, want = _first(first_inputs_ref, seed)
    _, got = _first(first_inputs, seed)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_bad_arguments_named():
    world = _world(0)
    slot_rows = torch.tensor([1, 2]).to(DEV)
    with pytest.raises(ValueError, match="tables"):
        load_rows_ref(slot_rows, world[2], world[3], world[1][:3], [], None, None, None, None,
                      None)
    with pytest.raises(ValueError, match="prefix"):
        (req, L, acc, table, page, p), outs = _first(first_inputs_ref, 0)
        first_inputs_ref(req, L, acc, table, page, p, *outs[:3], outs[3].long())
