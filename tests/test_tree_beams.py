"""kernels/tree_beams.py: one beam level in one launch (Triton, under TRITON_INTERPRET=1 on the
CPU) against its torch path (`beam_first_ref` / `beam_decode_ref`, the beams' torch path):
the same tokens, candidates, parents, ancestors, windows, hidden rows and setup, the scores
equal up to the log-softmax's last bits."""

from __future__ import annotations

import os

import pytest
import torch

from graphdraft.kernels.tree_beams import beam_decode, beam_decode_ref, beam_first, beam_first_ref
from graphdraft.runtime.beams import BeamState
from graphdraft.runtime.tree import TreeSpec

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not TRITON, reason="the Triton kernel needs CUDA or "
                                "TRITON_INTERPRET=1")
INTS = ("beam_tok", "beam_cand", "parent_beam", "anc", "cand_tok", "cand_parent")
FLOATS = ("beam_score", "cand_score")


def _clone(st: BeamState) -> BeamState:
    return BeamState(**{f: getattr(st, f).clone() for f in INTS + FLOATS})


def _same(a: BeamState, b: BeamState, what: str) -> None:
    for f in INTS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f"{what}: {f}"
    for f in FLOATS:
        torch.testing.assert_close(getattr(a, f), getattr(b, f), rtol=1e-5, atol=1e-5,
                                   equal_nan=True, msg=f"{what}: {f}")


def _logits(g: torch.Generator, rows: int, vd: int, kind: str) -> torch.Tensor:
    if kind == "ties":      # few distinct values: equal log-probs, the lower index first
        return torch.randint(0, 3, (rows, vd), generator=g).float()
    x = torch.randn(rows, vd, generator=g) * 3
    if kind == "nan":       # a NaN row: every log-prob NaN, ranked as -inf (the lowest ids)
        x[0, 1] = float("nan")
    return x


def _level(spec, j, st_ref, st_tri, lg, opts_ref, opts_tri, block):
    if j == 0:
        beam_first_ref(spec, lg, st_ref, **opts_ref)
        beam_first(spec, lg, st_tri, block=block, **opts_tri)
    else:
        beam_decode_ref(spec, j, lg, st_ref, **opts_ref)
        beam_decode(spec, j, lg, st_tri, block=block, **opts_tri)


@pytest.mark.parametrize("spec,bs,vd,block,kind", [
    (TreeSpec(4, 2, 6), 3, 40, 16, "plain"),       # chunked vocab (3 chunks, the last partial)
    (TreeSpec(4, 3, 10), 2, 37, 64, "plain"),      # k = 3: re-rank over 9 candidates
    (TreeSpec(3, 2, 5), 2, 24, 8, "ties"),
    (TreeSpec(3, 4, 12), 1, 50, 4096, "nan"),
    (TreeSpec(1, 2, 3), 2, 30, 16, "plain"),       # one level: no decode step, no ancestors
])
@pytest.mark.parametrize("extras", [False, True], ids=["tables", "all"])
def test_levels_match_the_torch_path(spec, bs, vd, block, kind, extras):
    g = torch.Generator().manual_seed(vd * 7 + bs)
    k, h, lv = spec.topk, 12, max(spec.steps - 1, 1)
    st = BeamState.allocate(spec, bs, DEV)
    for f in INTS + FLOATS:          # junk everywhere: what a level does not write stays
        t = getattr(st, f)
        t.copy_(torch.randint(-5, 50, t.shape, generator=g).to(t.dtype))
    hot = torch.randperm(3 * vd, generator=g)[:vd].to(DEV) if extras else None
    temp = torch.tensor([0.0, 0.7, 1.3, 0.0][:bs]).to(DEV) if extras else None
    hid_a = torch.randn(bs * k, h, generator=g).to(DEV)
    hid_b = torch.randn(bs * k, h, generator=g).to(DEV)
    win = torch.randint(-1, 9, (bs * k, lv), generator=g, dtype=torch.int32).to(DEV)
    req = torch.randint(0, 7, (bs,), generator=g).to(DEV)
    prefix = torch.randint(1, 90, (bs,), generator=g).to(DEV)
    setup_bufs = [torch.full((bs * k,), -3, dtype=torch.int64, device=DEV),
                  torch.full((bs * k,), -3, dtype=torch.int32, device=DEV),
                  torch.full((lv + 1, bs * k + 2), -3, dtype=torch.int64, device=DEV)]
    bufs = {"ref": [t.clone() for t in (hid_a, hid_b, win, *setup_bufs)],
            "tri": [t.clone() for t in (hid_a, hid_b, win, *setup_bufs)]}
    st_ref, st_tri = _clone(st), _clone(st)
    for j in range(spec.steps):
        rows = bs if j == 0 else bs * k
        lg = _logits(g, rows, vd, kind if j < 2 else "plain").to(DEV)
        opts = {}
        for side, (a, b, w, breq, blen, spos) in bufs.items():
            o = dict(hot=hot, temperature=temp, scratch_base=11)
            if extras:
                o.update(window=w)
                if j == 0:
                    o.update(hid_src=a[:bs], hid_dst=b, setup=(req, prefix, breq, blen, spos))
                else:
                    o.update(hid_src=a, hid_dst=b)
            opts[side] = o
        _level(spec, j, st_ref, st_tri, lg, opts["ref"], opts["tri"], block)
        _same(st_ref, st_tri, f"level {j}")
        for x, y in zip(bufs["ref"], bufs["tri"], strict=True):
            assert torch.equal(x, y), f"level {j}: extras"
        st_tri = _clone(st_ref)                # the next level from the same tables
        for side in ("ref", "tri"):            # the next step's hidden: this step's output
            bufs[side][0], bufs[side][1] = bufs[side][1], bufs[side][0]


def test_kernel_rejects_bad_arguments():
    spec = TreeSpec(3, 2, 5)
    st = BeamState.allocate(spec, 2, DEV)
    lg = torch.randn(2, 20, device=DEV)
    with pytest.raises(ValueError, match="logits"):
        beam_first(spec, lg[:1], st)
    with pytest.raises(ValueError, match="speculative_eagle_topk"):
        beam_first(TreeSpec(3), lg, BeamState.allocate(TreeSpec(3), 2, DEV))
    with pytest.raises(ValueError, match="hid_dst"):
        h = torch.zeros(4, 8, device=DEV)
        beam_decode(spec, 1, torch.randn(4, 20, device=DEV), st, hid_src=h, hid_dst=h)
    with pytest.raises(ValueError, match="window"):
        beam_first(spec, lg, st, window=torch.zeros(4, 2, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="j"):
        beam_decode(spec, 3, torch.randn(4, 20, device=DEV), st)
