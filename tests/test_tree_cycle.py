"""The tree cycle end to end on the CPU (float64 / float32, torch path; one Triton-interpreter
run): the tree cycle in the Engine (ARCHITECTURE.md, "Tree drafting").

- greedy tree speculative decoding == target-only greedy (tiny random pair and the shipped
  trained pair, page_size 1 and 16, several (K, k, n));
- tree verify logits == a causal verify of each node's root-to-node path;
- draft ancestry: every candidate's cumulative log-prob equals the chain drafter run along
  its own path (a cousin's KV would change it), and the beam attention ignores a cousin's KV;
- topk = 1 is the chain drafter: same draft tokens and same draft KV bytes on the same inputs;
- padded rows are inert; sampled rows run beside greedy rows without changing them;
- bad shapes rejected with a ValueError naming the argument.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import graphdraft
from graphdraft.kernels.cache_loc import kv_slots
from graphdraft.kernels.config import TORCH, TRITON
from graphdraft.kernels.decode_attention import paged_decode_attention_ref
from graphdraft.models.attention import BeamMetadata, PagedAttentionBackend
from graphdraft.runtime.batch import ForwardContext
from graphdraft.runtime.kv_cache import KVPool, PageTable, kv_slot
from graphdraft.runtime.tree import TreeSpec
from graphdraft.runtime.tree_drafter import TreeDrafter
from graphdraft.serving.tree_cycle import TreeRunner
from tests.drafter_harness import FakeServingLoop, make_setup
from tests.engine_harness import make_models

ASSETS = Path(graphdraft.__file__).resolve().parent / "assets"
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 20, 30, 40, 50, 60, 3]]


class _Dense:
    """Target (and head) forwards over a fresh paged cache with page_size 1: references."""

    def __init__(self, target, head=None, ctx: int = 256) -> None:
        self.target, self.head = target, head
        self.pages = PageTable(1, ctx, ctx + 1, 1, "cpu")
        self.slot = self.pages.alloc_slot()
        self.pages.reserve(self.slot, ctx)
        self.backend = PagedAttentionBackend(self.pages.req_to_page, 1, ctx, kernels=TORCH)
        tc = target.config
        self.kv = KVPool(tc.num_hidden_layers, ctx + 1, 1, tc.num_key_value_heads, tc.head_dim,
                         target.dtype, "cpu")
        if head is not None:
            hc = head.config
            self.dkv = KVPool(1, ctx + 1, 1, hc.num_key_value_heads, hc.head_dim, head.dtype, "cpu")

    def target_all(self, ids: list[int], start: int = 0):
        """Causal forward over `ids` at positions `start ..` (the cache holds `[0, start)`)
        -> (logits `[T, V]`, aux `[T, kH]`)."""
        L = len(ids)
        req = torch.tensor([self.slot])
        pos = torch.arange(start, start + L)
        seq = torch.tensor([start + L], dtype=torch.int32)
        meta = self.backend.row_metadata(req, seq, torch.tensor([L], dtype=torch.int32), L)
        out = self.target(torch.tensor(ids), pos, kv_slots(self.pages.req_to_page, req, pos, 1),
                          self.kv, self.backend, meta, None, capture_aux=True)
        return out.logits, out.aux_hidden

    def chain_logprob(self, prompt: list[int], root: int, path: list[int],
                      aux: torch.Tensor) -> float:
        """Sum of the head's log-probs of `path` drafted as a chain after prompt + root
        (`aux`: the target's aux hidden states over the prompt)."""
        L, req = len(prompt), torch.tensor([self.slot])
        ids = torch.tensor(prompt[1:] + [root])
        pos = torch.arange(L)
        be = self.backend
        out = self.head(ids, pos, aux, kv_slots(self.pages.req_to_page, req, pos, 1),
                        self.dkv.layer(0), be, be.bind_metadata(req, torch.tensor([L], dtype=torch.int32)),
                        torch.tensor([L - 1]))
        total = 0.0
        for i, tok in enumerate(path):
            total += float(torch.log_softmax(out.logits[0].double(), -1)[tok])
            if i + 1 == len(path):
                break
            p = torch.tensor([L + i])
            out = self.head(torch.tensor([tok]), p, out.hidden, kv_slots(
                self.pages.req_to_page, req, p, 1), self.dkv.layer(0), be,
                be.bind_metadata(req, torch.tensor([L + i + 1], dtype=torch.int32)))
        return total


def _greedy_ref(target, prompts, new_tokens):
    """Target-only greedy decoding, one token per forward."""
    outs = []
    for p in prompts:
        dense = _Dense(target)
        logits, _ = dense.target_all(p)
        out = [int(torch.argmax(logits[-1]))]
        while len(out) < new_tokens:
            logits, _ = dense.target_all(out[-1:], len(p) + len(out) - 1)
            out.append(int(torch.argmax(logits[-1])))
        outs.append(out)
    return outs


@pytest.fixture(scope="module")
def tiny():
    return make_models(seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def tiny_ref(tiny):
    return _greedy_ref(tiny[0], PROMPTS, 16)


@pytest.mark.parametrize("spec", [TreeSpec(3, 1), TreeSpec(3, 2, 6), TreeSpec(4, 3, 10),
                                  TreeSpec(2, 4, 5), TreeSpec(1, 3, 3)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_tree_equals_target_greedy_tiny(tiny, tiny_ref, spec, page_size):
    target, head = tiny
    r = TreeRunner(target, head, spec, max_bs=4, page_size=page_size, max_context_len=256)
    outs, accepts = r.generate(PROMPTS, 16)
    assert outs == tiny_ref
    assert all(1 <= a <= spec.P for a in accepts)


@pytest.fixture(scope="module")
def trained():
    from graphdraft.io.checkpoint import load_model_pair
    from graphdraft.train.evaluate import prompt_ids
    target, head, _ = load_model_pair(ASSETS / "target", ASSETS / "eagle3", dtype="float64")
    return target, head, [p[:24] for p in prompt_ids(3, 96)]


@pytest.fixture(scope="module")
def trained_ref(trained):
    return _greedy_ref(trained[0], trained[2], 16)


@pytest.mark.parametrize("spec,page_size", [(TreeSpec(3, 4, 8), 16), (TreeSpec(4, 3, 12), 1)])
def test_greedy_tree_equals_target_greedy_trained(trained, trained_ref, spec, page_size):
    """The trained pair accepts several tokens per step: paths through siblings, overlapping
    KV moves and long paths all happen here."""
    (target, head, prompts), ref = trained, trained_ref
    r = TreeRunner(target, head, spec, max_bs=4, page_size=page_size, max_context_len=256)
    outs, accepts = r.generate(prompts, 16)
    assert outs == ref
    assert max(accepts) >= 3  # the walk went deep (else this test proves little)


@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_verify_equals_path_verify(trained, page_size):
    target, head, prompts = trained
    spec = TreeSpec(3, 3, 8)
    prompts = prompts[:2]
    r = TreeRunner(target, head, spec, max_bs=4, page_size=page_size, max_context_len=256)
    roots = r.add(prompts, 8)
    bs, n = len(prompts), spec.n
    logits = r.cycle.verify(bs).logits.view(bs, n, -1)
    tree = r.drafter.tree.rows(bs)
    assert (tree.positions[:, 0] == torch.tensor([len(p) for p in prompts])).all()
    for row, p in enumerate(prompts):
        toks, par = tree.tokens[row].tolist(), tree.parents[row].tolist()
        assert toks[0] == roots[row]
        for i in range(n):
            path, c = [], i
            while c >= 0:
                path.append(toks[c])
                c = par[c]
            ref, _ = _Dense(target).target_all(p + path[::-1])
            # attention runs in fp32 on the torch path, the rest in fp64
            torch.testing.assert_close(logits[row, i], ref[-1], rtol=1e-5, atol=1e-5)


def test_draft_ancestry_each_candidate_is_its_chain(trained):
    """cand_score of every candidate == the head's chain log-prob along its own path."""
    target, head, prompts = trained
    spec = TreeSpec(3, 3, 8)
    r = TreeRunner(target, head, spec, max_bs=4, page_size=16, max_context_len=256)
    roots = r.add(prompts[:2], 8)
    st = r.drafter.beams
    assert head.hot_token_ids is None or torch.equal(head.hot_token_ids,
                                                     torch.arange(head.hot_token_ids.numel()))
    for row in range(2):
        aux = _Dense(target).target_all(prompts[row])[1]
        score, tok, par = st.cand_score[row], st.cand_tok[row].tolist(), st.cand_parent[row].tolist()
        for c in range(spec.M):
            path, x = [], c
            while x >= 0:
                path.append(tok[x])
                x = par[x]
            want = _Dense(target, head).chain_logprob(prompts[row], roots[row], path[::-1], aux)
            assert float(score[c]) == pytest.approx(want, abs=1e-5), (row, c)


def _per_query_attention(q, k, v, req, lens, r2p, ps, scale, extra, num_extra):
    """Query by query: the slots of `[0, lens[t])` then `extra[t, :num_extra]`, fp32 softmax
    (written apart from the references it checks)."""
    G = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        slots = torch.cat([kv_slot(r2p, int(req[t]), torch.arange(int(lens[t])), ps),
                           extra[t, :num_extra].long()])
        kt = k[slots].float().repeat_interleave(G, dim=1)             # [n, Hq, D]
        vt = v[slots].float().repeat_interleave(G, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[t].float(), kt) * scale, dim=-1)
        out[t] = torch.einsum("hn,nhd->hd", p, vt).to(q.dtype)
    return out


def test_beam_attention_ignores_cousins():
    """Query t's output (the backend's torch path for `BeamMetadata`) depends on the prefix
    and extra_slots[t, :num_extra] only."""
    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, D, ps = 6, 4, 2, 8, 4
    k = torch.randn(40 * ps, Hkv, D, generator=g)
    v = torch.randn(40 * ps, Hkv, D, generator=g)
    q = torch.randn(T, Hq, D, generator=g)
    r2p = torch.arange(1, 31, dtype=torch.int32).view(3, 10)
    req = torch.tensor([0, 0, 1, 1, 2, 2])
    lens = torch.tensor([5, 5, 9, 9, 1, 1], dtype=torch.int32)
    scratch = 32 * ps + torch.arange(T * 3).view(T, 3)      # each query's own slots
    backend = PagedAttentionBackend(r2p, ps, 40, kernels=TORCH)
    for j in (1, 2, 3):
        meta = BeamMetadata(req, lens, scratch, j)
        a = backend.attend(q, k, v, 0.3, meta)
        b = _per_query_attention(q, k, v, req, lens, r2p, ps, 0.3, scratch, j)
        torch.testing.assert_close(a, b)
        k2, v2 = k.clone(), v.clone()
        for t in range(T):  # every query's unused slots, and cousins' slots, get garbage
            k2[scratch[t, j:]] = 1e3
            v2[scratch[t, j:]] = -1e3
        k2[33 * ps + 40:] = 7.0
        c = backend.attend(q, k2, v2, 0.3, meta)
        torch.testing.assert_close(a, c)
        # a query reads its own slots: changing one of them changes only that query
        k3 = k.clone()
        k3[scratch[1, 0]] += 1.0
        d = backend.attend(q, k3, v, 0.3, meta)
        assert not torch.allclose(a[1], d[1])
        torch.testing.assert_close(a[[0, 2, 3, 4, 5]], d[[0, 2, 3, 4, 5]])


@pytest.mark.parametrize("page_size", [1, 16])
def test_topk1_is_the_chain_drafter(page_size):
    """On the same decode inputs a k = 1 TreeDrafter drafts the EagleDrafter's tokens and
    leaves the same draft KV bytes (float32, torch path). bs 4 = a captured size: the
    drafter pads to it, and matmuls over other row counts may round differently."""
    s = make_setup(steps=3, page_size=page_size, seed=3)
    loop = FakeServingLoop(s, seed=5)
    for plen in (9, 17, 4, 12):
        loop.add(plen, plen)
    loop.step()                                               # prefill
    rows, order, ctx, hidden, out_tokens, accept = loop.prepare()
    spec = TreeSpec(3, 1)
    td = TreeDrafter(s.head, spec, req_to_page=s.pages.req_to_page, page_size=page_size,
                     num_pages=s.cfg.total_kv_pages, max_context_len=s.cfg.max_context_len,
                     max_bs=s.cfg.max_bs, kernels=TORCH, device="cpu")
    slots = s.drafter.kv_pool.num_slots
    td.kv.k[0][:slots].copy_(s.drafter.kv_pool.k[0])
    td.kv.v[0][:slots].copy_(s.drafter.kv_pool.v[0])
    bs, n = ctx.bs, s.cfg.spec_num_tokens
    req = torch.tensor([r.slot for r in order])
    L = torch.tensor([r.committed for r in order])
    nxt = s.drafter.run(ctx, hidden, out_tokens, accept)
    td.first_ids[: bs * n].copy_(out_tokens)
    td.first_hidden[: bs * n].copy_(hidden)
    root = out_tokens.view(bs, n).gather(1, (accept.long() - 1).clamp(0, n - 1)[:, None])[:, 0]
    tree = td.draft(bs, req, L, accept, root)
    assert torch.equal(tree.tokens, nxt.long())
    real = slice(page_size, slots)  # page 0: the dummy page padded rows write
    diff = (td.kv.k[0][:slots] != s.drafter.kv_pool.k[0]).flatten(1).any(1).nonzero().flatten()
    assert diff.numel() == 0 or int(diff.max()) < page_size, diff
    assert torch.equal(td.kv.k[0][real], s.drafter.kv_pool.k[0][real])
    assert torch.equal(td.kv.v[0][real], s.drafter.kv_pool.v[0][real])
    assert isinstance(ctx, ForwardContext)


def test_padded_rows_inert(tiny):
    """A padded row holding a live tree (another prompt's, on the dummy slot) changes no real
    row's output, KV bytes or committed length."""
    target, head = tiny
    spec = TreeSpec(3, 2, 6)
    runs = []
    for garbage in (False, True):
        r = TreeRunner(target, head, spec, max_bs=4, page_size=4, max_context_len=256,
                       cuda_graph_bs=[4])
        r.add(PROMPTS, 12)
        c, tree = r.cycle, r.drafter.tree
        for _ in range(3):
            c.neutral_rows(3, 4)
            if garbage:
                for f in ("tokens", "parents", "depths", "positions", "mask", "first_child",
                          "next_sibling"):
                    getattr(tree, f)[3] = getattr(tree, f)[0]
                c.prefix_len[3] = 50
                c.coins[3] = 0.123
            pack = c.run(4)[:3].clone()
        pages = [p for s in r.slots for p in r.pages.pages_of(s)]
        kv = torch.stack([r.kv.k[i].view(-1, 4, *r.kv.k[i].shape[1:])[pages] for i in range(2)])
        runs.append((pack, kv, c.prefix_len[:3].clone()))
    for a, b in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a, b)


def test_sampled_rows_beside_greedy_rows(tiny, tiny_ref):
    target, head = tiny
    r = TreeRunner(target, head, TreeSpec(3, 2, 6), max_bs=4, page_size=16, max_context_len=256,
                   sampling=True, seed=1)
    outs, _ = r.generate(PROMPTS, 16, temperature=[0.0, 0.8, 0.0], top_k=6, top_p=0.9)
    assert outs[0] == tiny_ref[0] and outs[2] == tiny_ref[2]
    assert all(0 <= t < target.config.vocab_size for t in outs[1]) and len(outs[1]) == 16
    with pytest.raises(ValueError, match="temperature"):
        TreeRunner(target, head, TreeSpec(3, 2, 6), max_bs=4).add(PROMPTS, 4, temperature=0.5)


def test_triton_path_matches_torch_path_under_interpreter():
    """The kernels the GPU runs (extend attention with mask bits, decode attention's second
    segment, tree build, tree accept, KV move, hidden gather) give the torch path's tokens."""
    target, head = make_models(seed=2, dtype=torch.float32, layers=2)
    spec = TreeSpec(3, 2, 5)
    prompts = [p[:4] for p in PROMPTS[:2]]
    outs = []
    for tri in (False, True):
        r = TreeRunner(target, head, spec, max_bs=2, page_size=4, max_context_len=32,
                       kernels=TRITON if tri else TORCH)
        outs.append(r.generate(prompts, 4))
    assert outs[0] == outs[1]


def test_bad_configs_rejected(tiny):
    target, head = tiny
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        TreeSpec(3, 4, 64)          # n - 1 > M = 4 + 2*16
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        TreeSpec(3, 1, 8)           # chain needs n = steps + 1
    with pytest.raises(ValueError, match="speculative_eagle_topk"):
        TreeSpec(3, 0)
    with pytest.raises(ValueError, match="spec"):
        TreeRunner(target, head, (3, 4, 8))
    with pytest.raises(ValueError, match="speculative_eagle_topk"):
        TreeRunner(target, head, TreeSpec(2, 62, 10))   # above the draft vocab (61)
    with pytest.raises(ValueError, match="max_bs"):
        TreeRunner(target, head, TreeSpec(3, 2, 6), max_bs=0)
    r = TreeRunner(target, head, TreeSpec(3, 2, 6), max_bs=2, max_context_len=64)
    with pytest.raises(ValueError, match="prompts"):
        r.add(PROMPTS, 4)           # 3 prompts > max_bs 2
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        r.add([[1, 2, 999]], 4)
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        r.add([[1] * 40], 30)       # does not fit max_context_len
    assert r.bs == 0 and r.pages.num_free_slots == 2   # nothing changed
    with pytest.raises(ValueError, match="num_extra"):
        q = torch.zeros(2, 4, 8)
        paged_decode_attention_ref(q, q.new_zeros(8, 2, 8), q.new_zeros(8, 2, 8),
                                   torch.zeros(2, dtype=torch.int64),
                                   torch.ones(2, dtype=torch.int32),
                                   torch.zeros(1, 2, dtype=torch.int32), 4, 1.0, max_kv_len=8,
                                   extra_slots=torch.zeros(2, 1, dtype=torch.int64), num_extra=2)


def test_state_snapshot_restores_a_step(tiny):
    target, head = tiny
    r = TreeRunner(target, head, TreeSpec(3, 2, 6), max_bs=4, page_size=4, max_context_len=256)
    r.add(PROMPTS, 12)
    snap = r.state_snapshot()
    first = r.step()
    r.step()
    r.restore_state(snap)
    again = r.step()
    assert (first.tokens, first.accept) == (again.tokens, again.accept)


def test_finished_row_writes_nothing(tiny):
    target, head = tiny
    r = TreeRunner(target, head, TreeSpec(3, 2, 6), max_bs=4, page_size=4, max_context_len=256)
    r.add(PROMPTS, 12)
    r.step()
    r.finish(1)
    pages = torch.tensor(r.pages.pages_of(r.slots[1]))
    before = [k.view(-1, 4, *k.shape[1:])[pages].clone() for k in r.kv.k]
    L = int(r.cycle.prefix_len[1])
    for _ in range(2):
        r.step()
    after = [k.view(-1, 4, *k.shape[1:])[pages] for k in r.kv.k]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert int(r.cycle.req[1]) == 0 and L >= len(PROMPTS[1]) + 1   # inert: the dummy slot
    with pytest.raises(ValueError, match="row"):
        r.finish(3)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_kernel_second_segment_matches_reference(num_splits, page_size):
    """The decode kernel's explicit-slot segment (Triton, interpreter) == the torch reference
    and == the per-query attention; the backend routes `BeamMetadata` to it on the Triton path;
    every num_extra, with and without splits."""
    from graphdraft.kernels.decode_attention import paged_decode_attention
    g = torch.Generator().manual_seed(1)
    T, Hq, Hkv, D = 6, 4, 2, 16
    r2p = torch.arange(1, 1 + 3 * 40, dtype=torch.int32).view(3, 40)   # 40 pages per request
    slots = 121 * page_size
    k = torch.randn(slots, Hkv, D, generator=g)
    v = torch.randn(slots, Hkv, D, generator=g)
    q = torch.randn(T, Hq, D, generator=g)
    req = torch.tensor([0, 0, 1, 1, 2, 2])
    lens = torch.tensor([5, 5, 33, 33, 1, 1], dtype=torch.int32)
    extra = torch.randint(page_size, slots, (T, 3), generator=g)
    for ne in (0, 1, 3):
        a = paged_decode_attention(q, k, v, req, lens, r2p, page_size, 0.3, max_kv_len=40,
                                   num_splits=num_splits, extra_slots=extra, num_extra=ne)
        b = paged_decode_attention_ref(q, k, v, req, lens, r2p, page_size, 0.3, max_kv_len=40,
                                       extra_slots=extra, num_extra=ne)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            b, _per_query_attention(q, k, v, req, lens, r2p, page_size, 0.3, extra, ne),
            atol=1e-5, rtol=1e-5)
        if ne:
            backend = PagedAttentionBackend(r2p, page_size, 40, kernels=TRITON)
            c = backend.attend(q, k, v, 0.3, BeamMetadata(req, lens, extra, ne))
            assert torch.equal(c, paged_decode_attention(
                q, k, v, req, lens, r2p, page_size, 0.3, max_kv_len=40, extra_slots=extra,
                num_extra=ne, kernels=TRITON))


def _chi2_pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square goodness of fit; bins with expected count < 5 pooled into one."""
    counts, p = counts.double(), p.double()
    exp = counts.sum() * p
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    ex = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = ex > 0
    chi2 = ((obs[keep] - ex[keep]) ** 2 / ex[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2))


def test_sampled_tree_step_emits_the_target_distribution(tiny):
    """End to end at T = 1, top-k 8, top-p 0.95: the first token a tree step emits follows the
    target's filtered softmax at the root (whatever the drafts; never a filtered-out token),
    over 768 steps replayed from one state (fresh coins)."""
    from graphdraft.serving.verify import SamplingParams, target_probs
    target, head = tiny
    spec, bs, reps = TreeSpec(3, 4, 8), 32, 24
    prompt = [3, 14, 15, 9, 26, 5]
    r = TreeRunner(target, head, spec, max_bs=bs, page_size=4, max_context_len=64,
                   sampling=True, seed=3)
    (root, *_) = r.add([prompt] * bs, 8, top_k=8, top_p=0.95)  # greedy root: rows alike
    r.cycle.temperature[:bs] = 1.0
    snap = r.state_snapshot()
    counts = torch.zeros(target.config.vocab_size, dtype=torch.float64)
    drafts = r.drafter.tree.tokens[0, 1:].clone()
    accepted = 0
    for _ in range(reps):
        r.restore_state(snap)
        res = r.step()
        for toks, a in zip(res.tokens, res.accept, strict=True):
            counts[toks[0]] += 1
            accepted += a > 1
    logits, _ = _Dense(target).target_all(prompt + [root])
    p = target_probs(logits[-1:], SamplingParams(temperature=1.0, top_k=8, top_p=0.95))[0]
    assert counts[p == 0].sum() == 0, "a filtered-out token was emitted"
    assert _chi2_pvalue(counts, p) > 1e-4
    # a draft is accepted exactly when the first token is one of the root's children
    assert int(r.drafter.tree.first_child[0, 0]) >= 0 and accepted > 0
    assert torch.equal(drafts, snap["tree.tokens"][0, 1:])


def test_sampled_step_exact_with_trees_scored_at_temperature(tiny):
    """Rows sampling at T = 0.6 draft trees scored at T (`runtime.beams`, "Scores"): the
    emitted first token still follows the target's softmax(logits / 0.6) given the row's
    root (per row; counts of all rows against the sum of their expected counts)."""
    from graphdraft.serving.verify import SamplingParams, target_probs
    target, head = tiny
    spec, bs, reps, temp = TreeSpec(3, 4, 8), 32, 24, 0.6
    prompt = [3, 14, 15, 9, 26, 5]
    r = TreeRunner(target, head, spec, max_bs=bs, page_size=4, max_context_len=64,
                   sampling=True, seed=5)
    assert r.drafter.rank_at_temperature
    roots = r.add([prompt] * bs, 8, temperature=temp)   # trees drafted at T (add passes it)
    snap = r.state_snapshot()
    vocab = target.config.vocab_size
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(reps):
        r.restore_state(snap)
        for toks in r.step().tokens:
            counts[toks[0]] += 1
    expected = torch.zeros(vocab, dtype=torch.float64)
    for root in roots:
        logits, _ = _Dense(target).target_all(prompt + [root])
        expected += target_probs(logits[-1:], SamplingParams(temperature=temp))[0].double()
    assert counts[expected == 0].sum() == 0
    assert _chi2_pvalue(counts, expected / expected.sum()) > 1e-4


def test_slot_trees_store_and_load(tiny):
    """Per-slot tree tables: a tree stored by slot comes back in any row order; slot 0 rows
    never overwrite anything and load the neutral root-only tree."""
    from graphdraft.serving.tree_cycle import SlotTrees
    target, head = tiny
    spec = TreeSpec(3, 2, 6)
    r = TreeRunner(target, head, spec, max_bs=4, page_size=4, max_context_len=256)
    r.add(PROMPTS, 8)
    tree = r.drafter.tree.rows(3)
    want = {f: getattr(tree, f).clone() for f in SlotTrees.TREE_FIELDS + ("positions",)}
    table = SlotTrees(spec, 6, "cpu")
    neutral = {f: getattr(table, f)[0].clone() for f in SlotTrees.TREE_FIELDS}
    slots = torch.tensor(r.slots)
    table.store(tree, torch.cat([slots[:2], torch.zeros(1, dtype=torch.int64)]))  # row 2 inert
    table.store(tree.__class__(**{f: getattr(tree, f)[2:] for f in vars(tree)}), slots[2:])
    out = r.drafter.tree.rows(4)
    order = torch.tensor([2, 0, 1])
    rows = torch.cat([slots[order], torch.zeros(1, dtype=torch.int64)])
    vcl = torch.zeros(7, dtype=torch.int32)
    vcl[slots] = r.cycle.prefix_len[:3].int()
    done = torch.zeros(7, dtype=torch.int32)
    live = torch.ones(4, dtype=torch.bool)
    req, L = torch.ones(4, dtype=torch.int64), torch.ones(4, dtype=torch.int64)
    table.load(out, rows, done, vcl, live, req, L)
    assert live.tolist() == [True, True, True, False] and torch.equal(req, rows)
    assert torch.equal(L[:3], r.cycle.prefix_len[:3][order]) and int(L[3]) == 0
    for f in SlotTrees.TREE_FIELDS + ("positions",):
        assert torch.equal(getattr(out, f)[:3], want[f][order]), f
    for f in SlotTrees.TREE_FIELDS:
        assert torch.equal(getattr(out, f)[3], neutral[f]), f
        assert torch.equal(getattr(table, f)[0], neutral[f]), f
    assert torch.equal(out.retrieve_index[1], 6 + torch.arange(6))


def test_row_target_probs_is_target_probs_per_row():
    """Per-row temperature / top-k / top-p == serving.verify.target_probs row by row;
    temperature 0 rows one-hot at the argmax."""
    from graphdraft.serving.tree_cycle import row_target_probs
    from graphdraft.serving.verify import SamplingParams, target_probs
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 50, generator=g) * 3
    temp = torch.tensor([0.7, 1.0, 1.3, 0.0, 0.9, 1.0])
    top_k = torch.tensor([0, 5, 0, 3, 12, 60])
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.5, 0.6, 0.95])
    got = row_target_probs(logits, temp, top_k, top_p, logits.argmax(-1))
    for r in range(6):
        if temp[r] == 0:
            assert got[r].argmax() == logits[r].argmax() and got[r].max() == 1.0
            continue
        want = target_probs(logits[r:r + 1], SamplingParams(
            temperature=float(temp[r]), top_k=int(top_k[r]), top_p=float(top_p[r])))[0]
        torch.testing.assert_close(got[r], want, atol=1e-6, rtol=1e-5)
        assert (got[r] == 0).sum() >= 50 - (int(top_k[r]) or 50)
