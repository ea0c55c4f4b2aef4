"""Tree acceptance (`graphdraft.kernels.tree_accept`): greedy walk, sampled target-only acceptance.

The statistical runs use the vectorised torch reference over 2e5 rows (one call per case);
the Triton kernel (interpreter on CPU) is checked equal to the reference on small batches.
Chi-square p-values come from the regularised upper incomplete gamma; a case fails at
p < 1e-4 with fixed seeds.
"""

from __future__ import annotations

import pytest
import torch

from graphdraft.kernels.tree_accept import COIN_MAX, tree_accept, tree_accept_ref
from graphdraft.kernels.tree_build import TreeBuffers, build_tree_ref
from graphdraft.runtime.beams import BeamState, decode_step, first_step
from graphdraft.runtime.tree import TreeSpec

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (spec, parents of nodes 1..n-1): chain, star, k=2 depth 3
SHAPES = {
    "chain": (TreeSpec(3, 1), [0, 1, 2]),
    "star": (TreeSpec(1, 5, 6), [0, 0, 0, 0, 0]),
    "k2d3": (TreeSpec(3, 2, 8), [0, 0, 1, 1, 2, 3, 4]),
    "sorted": (TreeSpec(3, 4, 8), [0, 0, 0, 1, 1, 2, 4]),   # SGLang-like: 3 / 2+1 / 1 per level
}


def _links(parents: list[int]) -> tuple[list[int], list[int]]:
    par = [-1] + parents
    n = len(par)
    first = [next((j for j in range(n) if par[j] == i), -1) for i in range(n)]
    nxt = [next((j for j in range(i + 1, n) if i > 0 and par[j] == par[i]), -1) for i in range(n)]
    return first, nxt


def _outs(bs, spec):
    return dict(accept_len=torch.full((bs,), -5, dtype=torch.int32, device=DEV),
                accept_index=torch.full((bs, spec.P), -5, dtype=torch.int64, device=DEV),
                out_tokens=torch.full((bs, spec.P), -5, dtype=torch.int64, device=DEV),
                bonus=torch.full((bs,), -5, dtype=torch.int64, device=DEV))


def _node_probs(g, n, vocab, zero_frac=0.3):
    """Per-node target distributions `[n, V]`: Dirichlet(0.5) with exact zeros."""
    p = torch.distributions.Dirichlet(torch.full((vocab,), 0.5)).sample((n,))
    zero = torch.rand(n, vocab, generator=g) < zero_frac
    zero[:, :2] = False  # at least two tokens keep mass
    p = p.masked_fill(zero, 0.0)
    return p / p.sum(1, keepdim=True)


def _adversarial_tokens(g, p, parents, vocab):
    """Children of each node get distinct tokens: the lowest-probability ones first (a zero-p
    token where there is one), then random ones."""
    n = len(parents) + 1
    tok = [int(torch.randint(0, vocab, (1,), generator=g))]
    kids = {i: [j for j in range(1, n) if parents[j - 1] == i] for i in range(n)}
    tok += [0] * (n - 1)
    for i in range(n):
        order = torch.argsort(p[i]).tolist()          # ascending probability
        rnd = torch.randperm(vocab, generator=g).tolist()
        pick = order[:1] + [t for t in rnd if t != order[0]]
        for c, t in zip(kids[i], pick, strict=False):
            tok[c] = t
    return tok


def _case(name, bs, seed, vocab=12):
    spec, parents = SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n = spec.n
    p = _node_probs(g, n, vocab)
    tok = _adversarial_tokens(g, p, parents, vocab)
    first, nxt = _links(parents)
    rep = lambda x: torch.tensor(x, dtype=torch.int64).expand(bs, n).contiguous().to(DEV)  # noqa: E731
    probs = p.repeat(bs, 1).to(DEV)
    coins = torch.rand(bs, n, generator=g).to(DEV)
    final = torch.rand(bs, generator=g).to(DEV)
    return spec, parents, p, tok, rep(tok), rep(first), rep(nxt), probs, coins, final


def _pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square goodness of fit over p's support; counts outside it must be zero."""
    counts, p = counts.double(), p.double()
    assert counts[p == 0].sum() == 0, "a zero-probability token was emitted"
    sup = p > 0
    total = counts.sum()
    exp = total * p[sup]
    chi2 = ((counts[sup] - exp) ** 2 / exp).sum()
    dof = int(sup.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2))


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_acceptance_keeps_target_distribution(name, seed):
    bs, vocab = 200_000, 12
    spec, parents, p, tok, tokens, first, nxt, probs, coins, final = _case(name, bs, seed, vocab)
    o = _outs(bs, spec)
    tree_accept_ref(spec, tokens, first, nxt, probs=probs, coins=coins, final_coin=final, **o)
    out, idx, length = o["out_tokens"].cpu(), o["accept_index"].cpu(), o["accept_len"].cpu()
    assert int(length.min()) >= 1 and int(length.max()) <= spec.P
    # first emitted token ~ p_root
    assert _pvalue(torch.bincount(out[:, 0], minlength=vocab), p[0]) > 1e-4
    # root acceptance rate = sum of p_root over the root's children tokens
    kids = [j for j in range(1, spec.n) if parents[j - 1] == 0]
    rate = float(p[0, [tok[c] for c in kids]].sum())
    got = float((length >= 2).double().mean())
    sd = (rate * (1 - rate) / bs) ** 0.5
    assert abs(got - rate) <= 3.9 * sd + 1e-12, (got, rate)
    # second token given the first accepted child c ~ p_c
    for c in kids:
        sel = idx[:, 1] == c
        assert torch.equal(sel, (out[:, 0] == tok[c]) & (length >= 2))
        if int(sel.sum()) > 2000:
            assert _pvalue(torch.bincount(out[sel, 1], minlength=vocab), p[c]) > 1e-4, c
    # format: accepted tokens are the path's tokens, padding is the bonus / -1
    for d in range(spec.P):
        on = d < length - 1
        node = idx[:, min(d + 1, spec.P - 1)].clamp(min=0)
        assert torch.equal(out[on, d], torch.tensor(tok)[node[on]])
        assert torch.equal(out[~on, d], o["bonus"].cpu()[~on])
        assert bool((idx[:, d] >= 0).eq(d < length).all())


def test_sampled_second_level_chain_and_zero_mass():
    """A chain whose drafts are all zero-probability tokens is never accepted; every emitted
    token is the root's distribution with the draft token removed."""
    spec = TreeSpec(3, 1)
    bs, vocab = 50_000, 8
    g = torch.Generator().manual_seed(5)
    p = _node_probs(g, spec.n, vocab, zero_frac=0.0)
    p[0, 3] = 0.0
    p[0] /= p[0].sum()
    tokens = torch.tensor([0, 3, 1, 2]).expand(bs, 4).contiguous()
    first, nxt = (torch.tensor(x).expand(bs, 4).contiguous() for x in _links([0, 1, 2]))
    coins = torch.rand(bs, 4, generator=g)
    coins[:100] = 0.0  # a zero coin must not accept a zero-probability draft
    o = _outs(bs, spec)
    tree_accept_ref(spec, tokens.to(DEV), first.to(DEV), nxt.to(DEV), probs=p.repeat(bs, 1).to(DEV),
                    coins=coins.to(DEV), final_coin=torch.rand(bs, generator=g).to(DEV), **o)
    assert bool((o["accept_len"] == 1).all())
    assert _pvalue(torch.bincount(o["out_tokens"][:, 0].cpu(), minlength=vocab), p[0]) > 1e-4


@pytest.mark.parametrize("fn", [tree_accept_ref, tree_accept])
def test_coin_edges(fn):
    """Coins of exactly 0 and 1 are clamped: no zero-probability token, ever."""
    spec = TreeSpec(2, 2, 3)   # root with two children
    vocab = 6
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0]] * 3)
    tokens = torch.tensor([[0, 3, 4]] * 4)
    first, nxt = (torch.tensor(x).expand(4, 3).contiguous() for x in _links([0, 0]))
    coins = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    final = torch.tensor([0.0, 1.0, 1.0, 0.0])
    o = _outs(4, spec)
    fn(spec, tokens.to(DEV), first.to(DEV), nxt.to(DEV), probs=p.repeat(4, 1)[:12].to(DEV),
       coins=coins.to(DEV), final_coin=final.to(DEV), **o)
    assert o["accept_len"].tolist() == [1, 1, 1, 1]    # both children have p = 0
    assert o["bonus"].tolist() == [1, 2, 2, 1]         # coin 0 -> first non-zero, 1 -> last
    assert vocab == p.shape[1]


def _random_trees(spec, bs, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    st_ = BeamState.allocate(spec, bs, DEV)
    first_step(spec, torch.randn(bs, vocab, generator=g).to(DEV), st_)
    for j in range(1, spec.steps):
        decode_step(spec, j, torch.randn(bs * spec.topk, vocab, generator=g).to(DEV), st_)
    t = TreeBuffers.allocate(spec, bs, DEV)
    build_tree_ref(spec, st_.cand_score, st_.cand_tok, st_.cand_parent,
                   torch.randint(0, vocab, (bs,), generator=g).to(DEV),
                   torch.zeros(bs, dtype=torch.int64, device=DEV), t)
    return t, g


@pytest.mark.parametrize("spec", [TreeSpec(3, 1), TreeSpec(3, 2, 6), TreeSpec(4, 3, 9), TreeSpec(2, 4, 8)])
def test_greedy_kernel_matches_ref_and_walk(spec):
    bs, vocab = 24, 6
    t, g = _random_trees(spec, bs, 11, vocab)
    # the target agrees with some child most of the time: pick a child's token or a random one
    kid_tok = t.tokens.gather(1, t.first_child.clamp(min=0))
    rnd = torch.randint(0, vocab, (bs, spec.n), generator=g).to(DEV)
    target = torch.where(torch.rand(bs, spec.n, generator=g).to(DEV) < 0.7, kid_tok, rnd).reshape(-1)
    a, b = _outs(bs, spec), _outs(bs, spec)
    tree_accept_ref(spec, t.tokens, t.first_child, t.next_sibling, target=target, **a)
    tree_accept(spec, t.tokens, t.first_child, t.next_sibling, target=target, **b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    tv = target.view(bs, spec.n).cpu()
    for r in range(bs):  # the walk, written out plainly
        par = t.parents[r].tolist()
        cur, path = 0, [0]
        while len(path) < spec.P:
            kids = [j for j in range(spec.n) if par[j] == cur and int(t.tokens[r, j]) == int(tv[r, cur])]
            if not kids:
                break
            cur = kids[0]
            path.append(cur)
        assert int(a["accept_len"][r]) == len(path)
        assert a["accept_index"][r].tolist() == path + [-1] * (spec.P - len(path))
        emitted = [int(tv[r, i]) for i in path]
        assert a["out_tokens"][r].tolist() == emitted + [emitted[-1]] * (spec.P - len(path))


@pytest.mark.parametrize("spec", [TreeSpec(3, 2, 6), TreeSpec(2, 4, 8)])
def test_sampled_kernel_matches_ref(spec):
    bs, vocab = 32, 40
    t, g = _random_trees(spec, bs, 3, vocab)
    x = torch.randn(bs * spec.n, vocab, generator=g) * 2
    x[torch.rand(bs * spec.n, vocab, generator=g) < 0.3] = float("-inf")
    x[:, 0] = 0.0
    probs = torch.softmax(x, -1).to(DEV)
    # make the drafts likely: give each node's children tokens most of the mass sometimes
    coins = torch.rand(bs, spec.n, generator=g).to(DEV)
    coins[:4] = 0.0
    coins[4:8] = 1.0
    final = torch.rand(bs, generator=g).to(DEV)
    final[:2], final[2:4] = 0.0, 1.0
    a, b = _outs(bs, spec), _outs(bs, spec)
    kw = dict(probs=probs, coins=coins, final_coin=final)
    tree_accept_ref(spec, t.tokens, t.first_child, t.next_sibling, **kw, **a)
    tree_accept(spec, t.tokens, t.first_child, t.next_sibling, block=16, **kw, **b)  # 3 V chunks
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert int(a["accept_len"].max()) > 1   # some drafts were accepted: the walk was exercised
    assert bool((probs[torch.arange(bs, device=DEV) * spec.n, a["out_tokens"][:, 0]] > 0).all())


def test_onehot_sampling_is_the_greedy_walk():
    spec = TreeSpec(4, 3, 9)
    bs, vocab = 64, 7
    t, g = _random_trees(spec, bs, 8, vocab)
    kid_tok = t.tokens.gather(1, t.first_child.clamp(min=0))
    target = torch.where(torch.rand(bs, spec.n, generator=g).to(DEV) < 0.8, kid_tok,
                         torch.randint(0, vocab, (bs, spec.n), generator=g).to(DEV)).reshape(-1)
    onehot = torch.nn.functional.one_hot(target, vocab).float()
    a, b = _outs(bs, spec), _outs(bs, spec)
    tree_accept_ref(spec, t.tokens, t.first_child, t.next_sibling, target=target, **a)
    tree_accept_ref(spec, t.tokens, t.first_child, t.next_sibling, probs=onehot,
                    coins=torch.rand(bs, spec.n, generator=g).to(DEV),
                    final_coin=torch.full((bs,), COIN_MAX, device=DEV), **b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_bad_inputs_named():
    spec = TreeSpec(3, 2, 6)
    bs = 2
    t = TreeBuffers.allocate(spec, bs, DEV)
    o = _outs(bs, spec)
    with pytest.raises(ValueError, match="target, probs"):
        tree_accept(spec, t.tokens, t.first_child, t.next_sibling, **o)
    with pytest.raises(ValueError, match="target"):
        tree_accept(spec, t.tokens, t.first_child, t.next_sibling,
                    target=torch.zeros(bs * spec.n, dtype=torch.int32, device=DEV), **o)
    with pytest.raises(ValueError, match="accept_index"):
        tree_accept(spec, t.tokens, t.first_child, t.next_sibling,
                    target=torch.zeros(bs * spec.n, dtype=torch.int64, device=DEV),
                    **{**o, "accept_index": torch.zeros(bs, spec.n, dtype=torch.int64, device=DEV)})
    with pytest.raises(ValueError, match="coins"):
        tree_accept(spec, t.tokens, t.first_child, t.next_sibling,
                    probs=torch.zeros(bs * spec.n, 5, device=DEV),
                    coins=torch.zeros(bs, 3, device=DEV), final_coin=torch.zeros(bs, device=DEV), **o)


@pytest.mark.parametrize("fn", [tree_accept_ref, tree_accept])
def test_padded_rows_inert(fn):
    """Garbage in padded rows (huge token ids, broken links inside bounds, NaN probs, coins
    outside [0, 1]) neither crashes nor changes a real row's outputs."""
    spec = TreeSpec(3, 2, 6)
    real, vocab = 4, 10
    t, g = _random_trees(spec, real, 21, vocab)
    probs = torch.softmax(torch.randn(real * spec.n, vocab, generator=g), -1).to(DEV)
    coins, final = torch.rand(real, spec.n, generator=g).to(DEV), torch.rand(real, generator=g).to(DEV)
    alone = _outs(real, spec)
    fn(spec, t.tokens, t.first_child, t.next_sibling, probs=probs, coins=coins, final_coin=final,
       **alone)
    pad = 3
    cat = lambda a, b: torch.cat([a, b]).contiguous()  # noqa: E731
    tokens = cat(t.tokens, torch.full((pad, spec.n), 2**40, dtype=torch.int64, device=DEV))
    first = cat(t.first_child, torch.randint(-1, spec.n, (pad, spec.n), generator=g).to(DEV))
    nxt = cat(t.next_sibling, torch.randint(-1, spec.n, (pad, spec.n), generator=g).to(DEV))
    probs2 = cat(probs, torch.full((pad * spec.n, vocab), float("nan"), device=DEV))
    coins2 = cat(coins, torch.full((pad, spec.n), 7.0, device=DEV))
    final2 = cat(final, torch.full((pad,), -3.0, device=DEV))
    both = _outs(real + pad, spec)
    fn(spec, tokens, first, nxt, probs=probs2, coins=coins2, final_coin=final2, **both)
    for key in alone:
        assert torch.equal(alone[key], both[key][:real]), key
    assert bool(((both["bonus"] >= 0) & (both["bonus"] < vocab)).all())


def _path_probs(p: torch.Tensor, tok: list[int], parents: list[int]) -> list[float]:
    """Per node: the target probability of its root-to-node tokens, prod of p_parent(tok)."""
    par = [-1] + parents
    out = [1.0]
    for i in range(1, len(par)):
        out.append(out[par[i]] * float(p[par[i], tok[i]]))
    return out


@pytest.mark.parametrize("name", ["k2d3", "sorted"])
def test_sampled_acceptance_reaches_the_exact_bound(name):
    """No exact scheme accepts more from these candidates: a node can be accepted only when
    the emitted tokens are its path's, which under the target happens with probability
    prod p(path); every node is accepted with exactly that probability, so the mean accept
    length is 1 + the sum over nodes, the bound (drafts chosen by the draft's top-k are
    point masses: the target-only residual rule is the best scheme for them)."""
    bs, vocab = 200_000, 12
    spec, parents, p, tok, tokens, first, nxt, probs, coins, final = _case(name, bs, 3, vocab)
    o = _outs(bs, spec)
    tree_accept_ref(spec, tokens, first, nxt, probs=probs, coins=coins, final_coin=final, **o)
    idx, length = o["accept_index"].cpu(), o["accept_len"].cpu()
    want = _path_probs(p, tok, parents)
    par = [-1] + parents
    depth = [0] * len(par)
    for i in range(1, len(par)):
        depth[i] = depth[par[i]] + 1
    for i in range(1, spec.n):
        got = float((idx[:, depth[i]] == i).double().mean())
        sd = (want[i] * (1 - want[i]) / bs) ** 0.5
        assert abs(got - want[i]) <= 4.5 * sd + 1e-12, (i, got, want[i])
    bound = 1 + sum(want[1:])
    sd = float(length.double().std()) / bs ** 0.5
    assert abs(float(length.double().mean()) - bound) <= 4.5 * sd, (bound,)
