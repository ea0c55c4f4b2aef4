"""Compaction after tree acceptance: the accepted path's KV to the front, and the hidden gather
(`graphdraft.kernels.kv_move`; every layer in one launch: `graphdraft.kernels.tree_kv_move`)."""

from __future__ import annotations

import pytest
import torch

from graphdraft.kernels.kv_move import (
    gather_accepted_hidden,
    gather_accepted_hidden_ref,
    move_accepted_kv,
    move_accepted_kv_ref,
)
from graphdraft.kernels.tree_kv_move import kv_pointer_table, move_accepted_kv_all

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def move_all_layers(ks, vs, req_to_page, *rows):
    """`move_accepted_kv_all` over the layers' pointer table (one launch)."""
    move_accepted_kv_all(ks, vs, kv_pointer_table(ks, vs), req_to_page, *rows)


MOVES = [move_accepted_kv, move_accepted_kv_ref, move_all_layers]


def _pool(layers, slots, hkv, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(slots, hkv, d, generator=g).to(dtype).to(DEV) for _ in range(layers)]
    vs = [torch.randn(slots, hkv, d, generator=g).to(dtype).to(DEV) for _ in range(layers)]
    return ks, vs


def _slot(table, req, pos, page_size):
    return int(table[req, pos // page_size]) * page_size + pos % page_size


def _expected(ks, vs, table, req, plen, path, alen, page_size):
    """Serial semantics from a snapshot: new[L + d] = old[L + path[d]], d = 1..alen-1."""
    want_k = [t.clone() for t in ks]
    want_v = [t.clone() for t in vs]
    for r in range(len(req)):
        for d in range(1, int(alen[r])):
            s = _slot(table, int(req[r]), int(plen[r]) + int(path[r, d]), page_size)
            t = _slot(table, int(req[r]), int(plen[r]) + d, page_size)
            for w, o in zip(want_k + want_v, ks + vs, strict=True):
                w[t] = o[s]
    return want_k, want_v


@pytest.mark.parametrize("fn", MOVES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_overlapping_path(fn, page_size):
    """Path [0, 2, 3]: 2 -> 1 and 3 -> 2, slot L+2 is read and written."""
    max_pages = 64 // page_size
    table = torch.zeros(3, max_pages, dtype=torch.int32)
    table[1] = torch.randperm(max_pages)[:max_pages] + 1      # pages 1.. in a shuffled order
    slots = (max_pages + 1) * page_size
    ks, vs = _pool(2, slots, 2, 8, 0)
    req = torch.tensor([1], device=DEV)
    plen = torch.tensor([14], device=DEV, dtype=torch.int32)  # crosses a 16-page boundary at 16
    path = torch.tensor([[0, 2, 3, -1]], device=DEV)
    alen = torch.tensor([3], dtype=torch.int32, device=DEV)
    old_k = [t.clone() for t in ks]
    want_k, want_v = _expected(ks, vs, table, [1], [14], path.cpu(), [3], page_size)
    fn(ks, vs, table.to(DEV), req, plen, path, alen, page_size)
    s = lambda p: _slot(table, 1, p, page_size)  # noqa: E731
    assert torch.equal(ks[0][s(15)], old_k[0][s(16)])
    assert torch.equal(ks[0][s(16)], old_k[0][s(17)])
    assert torch.equal(ks[1][s(14)], old_k[1][s(14)])         # root untouched
    for a, b in zip(ks + vs, want_k + want_v, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("page_size", [1, 16])
def test_random_paths_match_reference_and_serial(page_size):
    bs, P, n = 5, 4, 9
    max_pages = 80 // page_size
    g = torch.Generator().manual_seed(page_size)
    table = torch.zeros(bs + 2, max_pages, dtype=torch.int32)
    perm = torch.randperm((bs + 1) * max_pages, generator=g) + 1
    for r in range(1, bs + 2):
        table[r] = perm[(r - 1) * max_pages: r * max_pages]
    slots = ((bs + 1) * max_pages + 1) * page_size
    req = torch.tensor([3, 1, 0, 5, 2])                        # row 2: a padded row (dummy slot 0)
    plen = torch.randint(0, 60, (bs,), generator=g)
    path = torch.full((bs, P), -1, dtype=torch.int64)
    alen = torch.randint(1, P + 1, (bs,), generator=g, dtype=torch.int32)
    alen[2] = 1
    for r in range(bs):
        nodes = sorted(torch.randperm(n - 1, generator=g)[: P - 1].add(1).tolist())
        path[r, 0] = 0
        path[r, 1:int(alen[r])] = torch.tensor(nodes[: int(alen[r]) - 1], dtype=torch.int64)
    results = []
    for fn in MOVES:
        ks, vs = _pool(3, slots, 2, 16, 1, dtype=torch.bfloat16)
        want_k, want_v = _expected(ks, vs, table, req.tolist(), plen.tolist(), path, alen, page_size)
        fn(ks, vs, table.to(DEV), req.to(DEV), plen.to(DEV), path.to(DEV), alen.to(DEV), page_size)
        for a, b in zip(ks + vs, want_k + want_v, strict=True):
            assert torch.equal(a, b)
        results.append(ks + vs)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def test_chain_path_moves_nothing():
    """Chain acceptance is already at the front: every src == dst, no byte changes."""
    table = torch.arange(1, 9, dtype=torch.int32).view(2, 4).to(DEV)
    ks, vs = _pool(1, 9 * 4, 1, 4, 3)
    before = [t.clone() for t in ks + vs]
    move_accepted_kv(ks, vs, table, torch.tensor([1], device=DEV), torch.tensor([2], device=DEV),
                     torch.tensor([[0, 1, 2, 3]], device=DEV),
                     torch.tensor([4], dtype=torch.int32, device=DEV), 4)
    for a, b in zip(ks + vs, before, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fn", [gather_accepted_hidden, gather_accepted_hidden_ref])
def test_hidden_gather(fn):
    bs, n, P, w = 3, 6, 4, 40
    aux = torch.randn(bs * n, w, device=DEV)
    path = torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1], [0, 1, 4, 5]], device=DEV)
    alen = torch.tensor([3, 1, 4], dtype=torch.int32, device=DEV)
    out = torch.full((bs * P, w), float("nan"), device=DEV)
    fn(aux, path, alen, n, out, **({"block": 16} if fn is gather_accepted_hidden else {}))
    rows = [0, 2, 3, 3, 6, 6, 6, 6, 12, 13, 16, 17]
    assert torch.equal(out, aux[rows])


def test_bad_inputs_named():
    table = torch.zeros(2, 4, dtype=torch.int32, device=DEV)
    ks, vs = _pool(2, 16, 1, 4, 0)
    one = torch.ones(1, dtype=torch.int64, device=DEV)
    path = torch.zeros(1, 3, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="v_layers"):
        move_accepted_kv(ks, vs[:1], table, one, one, path, one, 4)
    with pytest.raises(ValueError, match="req_to_page"):
        move_accepted_kv(ks, vs, table.long(), one, one, path, one, 4)
    with pytest.raises(ValueError, match="accept_len"):
        move_accepted_kv(ks, vs, table, one, one, path, one.float(), 4)
    with pytest.raises(ValueError, match=r"k_layers\[1\]"):
        move_accepted_kv([ks[0], ks[1].transpose(1, 2)], vs, table, one, one, path, one, 4)
    with pytest.raises(ValueError, match="hid_c"):
        gather_accepted_hidden(torch.zeros(4, 8, device=DEV), path, one, 4,
                               torch.zeros(2, 8, device=DEV))


def test_all_layers_table_checked():
    table = torch.zeros(2, 4, dtype=torch.int32, device=DEV)
    ks, vs = _pool(2, 16, 1, 4, 0)
    one = torch.ones(1, dtype=torch.int64, device=DEV)
    path = torch.zeros(1, 3, dtype=torch.int64, device=DEV)
    ptrs = kv_pointer_table(ks, vs)
    assert ptrs.tolist() == [t.data_ptr() for t in ks + vs]
    with pytest.raises(ValueError, match="table"):
        move_accepted_kv_all(ks, vs, ptrs[:3], table, one, one, path, one, 4)
    with pytest.raises(ValueError, match="slot stride"):
        spaced = torch.zeros(32, 1, 4, device=DEV)[::2]       # slot stride 8, not 4
        move_accepted_kv_all(ks, [vs[0], spaced], ptrs, table, one, one, path, one, 4)
