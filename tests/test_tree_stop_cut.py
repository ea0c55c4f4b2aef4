"""kernels/tree_stop_cut.py: the tree cycle's stop-id / max_new cut, its kernel and torch
path against a per-row loop of the rule (module doc)."""

from __future__ import annotations

import os

import pytest
import torch

from graphdraft.kernels.accept import FINISH_LENGTH, FINISH_STOP
from graphdraft.kernels.tree_stop_cut import stop_cut, stop_cut_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _case(seed: int, bs: int, p: int, w: int, slots: int = 6):
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(0, 9, (bs, p), generator=g)
    acc = torch.randint(1, p + 1, (bs,), generator=g).int()
    req = torch.randint(0, slots, (bs,), generator=g)
    live = torch.rand(bs, generator=g) < 0.8
    stop_ids = torch.randint(0, 9, (slots, w), generator=g)
    stop_ids[torch.rand(slots, w, generator=g) < 0.5] = -1            # unused columns
    max_new = torch.randint(1, 12, (slots,), generator=g).int()
    emitted = torch.randint(0, 12, (slots,), generator=g).int()        # room may be <= 0
    return [t.to(DEV) for t in (out, acc, req, live, stop_ids, max_new, emitted)]


def _loop(out, acc, req, live, stop_ids, max_new, emitted):
    """The rule row by row: (accept, finish, accept_len after)."""
    p = out.shape[1]
    rows = []
    for r in range(out.shape[0]):
        a, s = int(acc[r]), int(req[r])
        stops = {int(x) for x in stop_ids[s]} - {-1}
        room = int(max_new[s]) - int(emitted[s])
        js = next((d for d in range(a) if int(out[r, d]) in stops), p)
        jl = next((d for d in range(a) if d + 1 >= room), p)
        cut = min(a, min(js, jl) + 1)
        fin = FINISH_STOP if js < p and js <= jl else (FINISH_LENGTH if jl < p else 0)
        rows.append((cut, fin, cut) if bool(live[r]) else (0, 0, a))
    return rows


def _run(fn, args):
    out, acc, req, live, stop_ids, max_new, emitted = args
    bs = out.shape[0]
    acc = acc.clone()
    a, f, e = (torch.full((bs,), 7, dtype=torch.int32, device=DEV) for _ in range(3))
    fn(out, acc, req, live, stop_ids, max_new, emitted, a, f, e)
    assert e.eq(0).all()
    return list(zip(a.tolist(), f.tolist(), acc.tolist(), strict=True))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("p,w", [(1, 1), (3, 2), (8, 5)])
def test_ref_is_the_rule(seed, p, w):
    args = _case(seed, 24, p, w)
    assert _run(stop_cut_ref, args) == _loop(*args)


@pytest.mark.skipif(not TRITON, reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("p,w", [(1, 1), (8, 5), (5, 3)])
def test_kernel_is_the_rule(seed, p, w):
    args = _case(seed, 24, p, w)
    assert _run(stop_cut, args) == _loop(*args)


def test_stop_wins_over_length_at_one_position():
    out = torch.tensor([[4, 5, 6]], device=DEV)
    args = [out, torch.tensor([3], dtype=torch.int32, device=DEV),
            torch.tensor([1], device=DEV), torch.tensor([True], device=DEV),
            torch.tensor([[-1], [5]], device=DEV), torch.tensor([0, 4], dtype=torch.int32, device=DEV),
            torch.tensor([0, 2], dtype=torch.int32, device=DEV)]      # room 2: length at d = 1
    assert _run(stop_cut_ref, args) == [(2, FINISH_STOP, 2)]
    if TRITON:
        assert _run(stop_cut, args) == [(2, FINISH_STOP, 2)]


def test_bad_arguments_named():
    args = _case(0, 4, 3, 2)
    a, f, e = (torch.zeros(4, dtype=torch.int32, device=DEV) for _ in range(3))
    with pytest.raises(ValueError, match="accept_len"):
        stop_cut_ref(args[0], args[1].long(), *args[2:], a, f, e)
    with pytest.raises(ValueError, match="live"):
        stop_cut_ref(*args[:3], args[3].int(), *args[4:], a, f, e)


@pytest.mark.parametrize("fn", [stop_cut_ref, stop_cut] if TRITON else [stop_cut_ref])
def test_logit_rows_are_the_path_nodes_verify_rows(fn):
    args = _case(3, 5, 4, 2)
    idx = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1], [0, 1, 3, 6], [0, 4, -1, -1],
                        [0, 1, 2, -1]], device=DEV)
    rows = torch.full((5, 4), -9, dtype=torch.int64, device=DEV)
    a, f, e = (torch.zeros(5, dtype=torch.int32, device=DEV) for _ in range(3))
    fn(*args[:1], args[1].clone(), *args[2:], a, f, e, rows=(idx, 7, rows))
    assert torch.equal(rows, idx.clamp(min=0) + 7 * torch.arange(5, device=DEV).unsqueeze(1))
    with pytest.raises(ValueError, match="logit_rows"):
        fn(*args[:1], args[1].clone(), *args[2:], a, f, e, rows=(idx, 7, rows[:, :3]))
