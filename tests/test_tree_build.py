"""Tree configuration, beams -> candidate store, and the tree build (`runtime.tree`,
`runtime.beams`, `kernels.tree_build`).

Candidate stores come from `graphdraft.runtime.beams` fed random draft logits with ties (few distinct
values), certain tokens (p = 1.0), -inf and NaN, so the invariants are checked on stores the
drafter can produce. The Triton kernel (interpreter on CPU) must write what the torch version
writes.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphdraft.kernels.argmax import argmax_with_map, argmax_with_map_ref
from graphdraft.kernels.tree_build import TreeBuffers, build_tree, build_tree_ref
from graphdraft.runtime.beams import BeamState, decode_step, first_step
from graphdraft.runtime.tree import TreeSpec, score_key, scratch_slots

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FIELDS = ("tokens", "parents", "depths", "positions", "mask", "first_child", "next_sibling",
          "retrieve_index", "cand_node")


# ---------------------------------------------------------------- configuration


def test_spec_sizes():
    s = TreeSpec(5, 4, 8)
    assert (s.M, s.P, s.n) == (4 + 4 * 16, 6, 8)
    assert TreeSpec(3).num_draft_tokens == 4 and TreeSpec(3).P == 4
    assert TreeSpec(3, 4, 16).P == 4
    assert TreeSpec(7, 2, 4).P == 4  # n bounds the path
    assert scratch_slots(TreeSpec(5, 4, 8), 256) == 256 * 4 * 4
    rows = torch.tensor([[0], [3]])
    s = TreeSpec(3, 2, 6)
    assert s.scratch_slot(100, rows, torch.tensor([[0, 1]]), 2).tolist() == [[101, 103], [113, 115]]
    assert s.depth_of(torch.arange(s.M)).tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]


@pytest.mark.parametrize("kwargs,field,hint", [
    (dict(steps=3, topk=1, num_draft_tokens=8), "speculative_num_draft_tokens", "= 4"),
    (dict(steps=3, topk=2, num_draft_tokens=1), "speculative_num_draft_tokens", ">= 2"),
    (dict(steps=2, topk=2, num_draft_tokens=8), "speculative_num_draft_tokens", "<= 1 + topk"),
    (dict(steps=5, topk=8, num_draft_tokens=65), "speculative_num_draft_tokens", "<= 64"),
    (dict(steps=0, topk=2, num_draft_tokens=4), "speculative_num_steps", ">= 1"),
    (dict(steps=3, topk=0, num_draft_tokens=4), "speculative_eagle_topk", ">= 1"),
    (dict(steps=3, topk=True, num_draft_tokens=4), "speculative_eagle_topk", "int"),
    (dict(steps=3, topk=2, num_draft_tokens=4.0), "speculative_num_draft_tokens", "int"),
])
def test_spec_rejects(kwargs, field, hint):
    with pytest.raises(ValueError, match=field) as e:
        TreeSpec(**kwargs)
    assert hint in str(e.value)


def test_spec_edges_accepted():
    assert TreeSpec(2, 2, 7).n == 7          # n - 1 == M
    assert TreeSpec(5, 8, 64).n == 64
    assert TreeSpec(1, 3, 4).M == 3          # one level: a star


def test_score_key_order():
    s = torch.tensor([-1.0, float("nan"), -1.0, 0.0, -0.0, float("-inf"), -3.0])
    key = score_key(s)
    order = torch.argsort(key, descending=True).tolist()
    assert order == [3, 4, 0, 2, 6, 1, 5]  # 0 and -0 tie (lower index first); NaN == -inf


# ---------------------------------------------------------------- beams


def _logits(g, rows, vocab, kind):
    if kind == "ties":
        return torch.randint(0, 3, (rows, vocab), generator=g).float()
    x = torch.randn(rows, vocab, generator=g)
    if kind == "certain":      # p = 1.0 for one token in some rows (log-prob exactly 0)
        hot = torch.randint(0, vocab, (rows,), generator=g)
        sure = torch.rand(rows, generator=g) < 0.5
        x[sure] = float("-inf")
        x[sure, hot[sure]] = 0.0
    if kind == "nan":
        x[torch.rand(rows, vocab, generator=g) < 0.2] = float("nan")
    return x


def _run_beams(spec, bs, vocab, kind, seed, hot=None, base=0):
    g = torch.Generator().manual_seed(seed)
    st_ = BeamState.allocate(spec, bs, DEV)
    slots = {}  # (row, flat cand) -> scratch slot the node's KV went to
    first_step(spec, _logits(g, bs, vocab, kind).to(DEV), st_, hot_token_ids=hot, scratch_base=base)
    steps = []
    for j in range(1, spec.steps):
        for r in range(bs):
            for b in range(spec.topk):
                slots[r, int(st_.beam_cand[r, b])] = base + (r * spec.topk + b) * (spec.steps - 1) + j - 1
        # the ancestors of each beam are the slots of its path's nodes, never a cousin's
        for r in range(bs):
            for b in range(spec.topk):
                path, c = [], int(st_.beam_cand[r, b])
                while c >= 0:
                    path.append(c)
                    c = int(st_.cand_parent[r, c])
                want = [slots[r, c] for c in reversed(path)]
                assert st_.anc[r, b, :j].tolist() == want
        logits = _logits(g, bs * spec.topk, vocab, kind).to(DEV)
        steps.append(logits)
        decode_step(spec, j, logits, st_, hot_token_ids=hot, scratch_base=base)
    return st_, steps


def test_beams_k1_is_chain_argmax():
    spec = TreeSpec(4, 1)
    g = torch.Generator().manual_seed(1)
    hot = torch.randperm(100, generator=g)[:12].to(DEV)
    logits = [_logits(g, 3, 12, kind).to(DEV) for kind in ("ties", "nan", "certain", "plain")]
    st_ = BeamState.allocate(spec, 3, DEV)
    first_step(spec, logits[0], st_, hot_token_ids=hot)
    for j in range(1, 4):
        decode_step(spec, j, logits[j], st_, hot_token_ids=hot)
    for j in range(4):  # chain's selection: the drafter's torch path and its Triton kernel
        assert torch.equal(st_.cand_tok[:, j], argmax_with_map_ref(logits[j], hot))
        assert torch.equal(st_.cand_tok[:, j], argmax_with_map(logits[j], hot))
    assert torch.equal(st_.beam_tok[:, 0], st_.cand_tok[:, 2])  # the last fed-back token
    assert st_.cand_parent.tolist() == [[-1, 0, 1, 2]] * 3


def test_beams_hidden_follow_parent_beam():
    spec = TreeSpec(3, 3, 8)
    bs, hsz = 2, 5
    g = torch.Generator().manual_seed(4)
    st_ = BeamState.allocate(spec, bs, DEV)
    first_step(spec, torch.randn(bs, 20, generator=g).to(DEV), st_)
    hid_out = torch.randn(bs * 3, hsz, generator=g).to(DEV)
    hid_next = torch.empty_like(hid_out)
    decode_step(spec, 1, torch.randn(bs * 3, 20, generator=g).to(DEV), st_, hid_out=hid_out,
                hid_next=hid_next)
    for r in range(bs):
        for b in range(3):
            assert torch.equal(hid_next[r * 3 + b], hid_out[r * 3 + int(st_.parent_beam[r, b])])
            assert int(st_.cand_parent[r, int(st_.beam_cand[r, b])]) == int(st_.parent_beam[r, b])
    with pytest.raises(ValueError, match="hid_next"):
        decode_step(spec, 2, torch.randn(bs * 3, 20).to(DEV), st_, hid_out=hid_out, hid_next=hid_out)
    with pytest.raises(ValueError, match="logits"):
        decode_step(spec, 2, torch.randn(bs, 20).to(DEV), st_)
    with pytest.raises(ValueError, match="j:"):
        decode_step(spec, 3, torch.randn(bs * 3, 20).to(DEV), st_)


# ---------------------------------------------------------------- tree invariants


def _check_tree(spec, st_, root, plen, t):
    n, k = spec.n, spec.topk
    bs = root.shape[0]
    for r in range(bs):
        # selection: the n-1 best by (score desc, NaN = -inf, index asc)
        sc = [(-math.inf if math.isnan(x) else x) for x in st_.cand_score[r].tolist()]
        best = sorted(range(spec.M), key=lambda i: (-sc[i], i))[: n - 1]
        cn = t.cand_node[r].tolist()
        assert sorted(i for i in range(spec.M) if cn[i] > 0) == sorted(best)
        sel = sorted(best)
        assert [cn[c] for c in sel] == list(range(1, n))
        par, dep = t.parents[r].tolist(), t.depths[r].tolist()
        assert par[0] == -1 and dep[0] == 0
        assert int(t.tokens[r, 0]) == int(root[r])
        for i in range(1, n):
            c = sel[i - 1]
            assert 0 <= par[i] < i                                      # parent before child
            pc = int(st_.cand_parent[r, c])
            assert par[i] == (0 if pc < 0 else cn[pc]) and (pc < 0 or cn[pc] > 0)   # closure
            assert dep[i] == dep[par[i]] + 1 <= spec.steps
            assert int(t.tokens[r, i]) == int(st_.cand_tok[r, c])
        assert t.positions[r].tolist() == [int(plen[r]) + d for d in dep]
        for i in range(n):                                              # ancestor closure
            want, a = 0, i
            while a >= 0:
                want |= 1 << a
                a = par[a]
            assert int(t.mask[r, i]) == want
            kids = [j for j in range(n) if par[j] == i]
            assert int(t.first_child[r, i]) == (kids[0] if kids else -1)
            sibs = [j for j in range(i + 1, n) if i > 0 and par[j] == par[i]]
            assert int(t.next_sibling[r, i]) == (sibs[0] if sibs else -1)
            toks = [int(t.tokens[r, j]) for j in kids]
            assert len(set(toks)) == len(toks)                          # siblings distinct
            assert int(t.retrieve_index[r, i]) == r * n + i
        for d in range(spec.steps + 1):
            assert dep.count(d) <= k ** d
        assert sum(1 for d in dep if d > 0) == n - 1


@st.composite
def _specs(draw):
    steps = draw(st.integers(1, 4))
    topk = draw(st.integers(1, 3))
    m = topk + (steps - 1) * topk * topk
    n = steps + 1 if topk == 1 else draw(st.integers(2, min(m + 1, 64)))
    return TreeSpec(steps, topk, n)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_specs(), bs=st.integers(1, 3), kind=st.sampled_from(["ties", "certain", "nan", "plain"]),
       seed=st.integers(0, 2**16))
def test_tree_invariants_ref(spec, bs, kind, seed):
    vocab = 3 * spec.topk + 2
    hot = torch.arange(vocab, device=DEV) * 7 + 3
    st_, _ = _run_beams(spec, bs, vocab, kind, seed, hot=hot, base=11)
    root = torch.arange(bs, device=DEV) + 1000
    plen = torch.arange(bs, device=DEV, dtype=torch.int32) * 5 + 3
    t = TreeBuffers.allocate(spec, bs, DEV)
    build_tree_ref(spec, st_.cand_score, st_.cand_tok, st_.cand_parent, root, plen, t)
    _check_tree(spec, st_, root, plen, t)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_specs(), bs=st.integers(1, 2), kind=st.sampled_from(["ties", "certain", "nan", "plain"]),
       seed=st.integers(0, 2**16))
def test_tree_kernel_matches_ref(spec, bs, kind, seed):
    st_, _ = _run_beams(spec, bs, 3 * spec.topk + 2, kind, seed)
    root = torch.arange(bs, device=DEV, dtype=torch.int32) + 50
    plen = torch.arange(bs, device=DEV) * 9
    a, b = TreeBuffers.allocate(spec, bs, DEV), TreeBuffers.allocate(spec, bs, DEV)
    for f in FIELDS:  # the kernel must overwrite stale values
        getattr(b, f).fill_(-77)
    b.cand_node.fill_(0)
    build_tree_ref(spec, st_.cand_score, st_.cand_tok, st_.cand_parent, root, plen, a)
    build_tree(spec, st_.cand_score, st_.cand_tok, st_.cand_parent, root, plen, b)
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("fn", [build_tree_ref, build_tree])
def test_adversarial_ties_and_certain_tokens(fn):
    """Every candidate ties (all scores 0: every draft token certain) or children tie their
    parent: the lower flat index wins, so the selected set is still closed under ancestors."""
    spec = TreeSpec(3, 2, 7)
    bs = 2
    score = torch.zeros(bs, spec.M, device=DEV)
    score[1] = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    par = torch.tensor([-1, -1, 0, 0, 1, 1, 3, 3, 2, 2], device=DEV).expand(bs, -1).contiguous()
    tok = torch.arange(spec.M, device=DEV).expand(bs, -1).contiguous()
    t = TreeBuffers.allocate(spec, bs, DEV)
    fn(spec, score, tok, par, torch.zeros(bs, dtype=torch.int64, device=DEV),
       torch.zeros(bs, dtype=torch.int64, device=DEV), t)
    # selection = flat 0..5: nodes 1..6, parents root, root, 1, 1, 2, 2
    assert t.parents.tolist() == [[-1, 0, 0, 1, 1, 2, 2]] * 2
    assert t.mask[0].tolist() == [1, 3, 5, 11, 19, 37, 69]


@pytest.mark.parametrize("fn", [build_tree_ref, build_tree])
def test_k1_is_a_chain(fn):
    spec = TreeSpec(4, 1)
    st_, _ = _run_beams(spec, 2, 9, "plain", 7)
    t = TreeBuffers.allocate(spec, 2, DEV)
    plen = torch.tensor([10, 20], device=DEV)
    fn(spec, st_.cand_score, st_.cand_tok, st_.cand_parent, torch.tensor([1, 2], device=DEV), plen, t)
    n = spec.n
    tri = [sum(1 << j for j in range(i + 1)) for i in range(n)]
    for r in range(2):
        assert t.mask[r].tolist() == tri                     # lower-triangular mask
        assert t.positions[r].tolist() == [int(plen[r]) + i for i in range(n)]
        assert t.parents[r].tolist() == [-1, 0, 1, 2, 3]
        assert t.first_child[r].tolist() == [1, 2, 3, 4, -1]
        assert t.next_sibling[r].tolist() == [-1] * n
        assert t.tokens[r, 1:].tolist() == st_.cand_tok[r].tolist()


def test_build_rejects_bad_shapes():
    spec = TreeSpec(3, 2, 6)
    st_ = BeamState.allocate(spec, 2, DEV)
    t = TreeBuffers.allocate(spec, 2, DEV)
    root = torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="cand_score"):
        build_tree(spec, st_.cand_score[:, :4], st_.cand_tok, st_.cand_parent, root, root, t)
    with pytest.raises(ValueError, match="out.mask"):
        build_tree_ref(spec, st_.cand_score, st_.cand_tok, st_.cand_parent, root, root,
                       TreeBuffers(**{**t.__dict__, "mask": t.mask.int()}))
    with pytest.raises(ValueError, match="prefix_len"):
        build_tree(spec, st_.cand_score, st_.cand_tok, st_.cand_parent, root, root[:1], t)


@pytest.mark.parametrize("fn", [build_tree_ref, build_tree])
def test_padded_rows_inert(fn):
    """Garbage in a padded row's store (NaN / huge scores, huge tokens, out-of-range parents)
    stays in bounds and leaves the real rows' trees unchanged."""
    spec = TreeSpec(3, 2, 6)
    st_, _ = _run_beams(spec, 2, 8, "plain", 9)
    root = torch.tensor([4, 5], device=DEV)
    plen = torch.tensor([3, 8], device=DEV)
    alone = TreeBuffers.allocate(spec, 2, DEV)
    fn(spec, st_.cand_score, st_.cand_tok, st_.cand_parent, root, plen, alone)
    g = torch.Generator().manual_seed(0)
    bad_score = torch.randn(1, spec.M, generator=g).to(DEV) * 1e30
    bad_score[0, ::3] = float("nan")
    cat = lambda a, b: torch.cat([a, b]).contiguous()  # noqa: E731
    both = TreeBuffers.allocate(spec, 3, DEV)
    fn(spec, cat(st_.cand_score, bad_score),
       cat(st_.cand_tok, torch.full((1, spec.M), 2**50, dtype=torch.int64, device=DEV)),
       cat(st_.cand_parent, torch.randint(-5, 10**6, (1, spec.M), generator=g).to(DEV)),
       cat(root, torch.tensor([-3], device=DEV)), cat(plen, torch.tensor([10**9], device=DEV)), both)
    for f in FIELDS:
        assert torch.equal(getattr(alone, f), getattr(both, f)[:2]), f


def test_beams_score_sampled_rows_at_their_temperature():
    """`temperature [B]`: rows with T > 0 score by log_softmax(logits / T) (the draft's estimate
    of the target's p_T, the sampled acceptance probability), greedy rows (T = 0) exactly as
    without it; the tokens of a beam's top k do not change, the re-rank may."""
    spec, bs, vocab = TreeSpec(3, 3, 8), 3, 16
    g = torch.Generator().manual_seed(7)
    temps = torch.tensor([0.0, 0.5, 1.7]).to(DEV)
    l1 = (3 * torch.randn(bs, vocab, generator=g)).to(DEV)
    l2 = (3 * torch.randn(bs * 3, vocab, generator=g)).to(DEV)
    l3 = (3 * torch.randn(bs * 3, vocab, generator=g)).to(DEV)
    plain, scaled, none = (BeamState.allocate(spec, bs, DEV) for _ in range(3))
    first_step(spec, l1, plain)
    first_step(spec, l1, scaled, temperature=temps)
    first_step(spec, l1, none, temperature=torch.zeros(bs).to(DEV))
    for j, lg in ((1, l2), (2, l3)):
        decode_step(spec, j, lg, plain)
        decode_step(spec, j, lg, scaled, temperature=temps)
        decode_step(spec, j, lg, none, temperature=torch.zeros(bs).to(DEV))
    for f in ("cand_score", "cand_tok", "cand_parent", "beam_tok", "beam_cand", "anc"):
        assert torch.equal(getattr(none, f), getattr(plain, f)), f      # T = 0: unchanged
        assert torch.equal(getattr(scaled, f)[0], getattr(plain, f)[0]), f
    assert torch.equal(scaled.cand_tok[:, :3], plain.cand_tok[:, :3])  # same level-1 tokens
    for r in (1, 2):
        t = float(temps[r])
        lp1 = torch.log_softmax(l1[r].float() / t, -1)
        assert torch.allclose(scaled.cand_score[r, :3], lp1[scaled.cand_tok[r, :3]])
        # every level-2 candidate: its parent's score + its log-prob at T in its beam's row
        for m in range(3, 12):
            par, b = int(scaled.cand_parent[r, m]), (m - 3) // 3
            lp = torch.log_softmax(l2[r * 3 + b].float() / t, -1)
            want = scaled.cand_score[r, par] + lp[scaled.cand_tok[r, m]]
            assert torch.allclose(scaled.cand_score[r, m], want), (r, m)
    assert not torch.equal(scaled.cand_score[1:], plain.cand_score[1:])
    with pytest.raises(ValueError, match="temperature"):
        first_step(spec, l1, scaled, temperature=torch.zeros(bs + 1).to(DEV))
