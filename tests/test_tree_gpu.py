"""Tree kernels on the GPU: Triton == torch reference at real sizes, and one CUDA graph of the
whole tree tail (beams -> build -> accept -> KV move -> hidden gather; the beams and the KV
move on the Triton path: `kernels.tree_beams`, `kernels.tree_kv_move`) replays what eager
computes, bit for bit, with fresh data and after another batch size's graph.

Run with `make test-gpu` (marker `gpu`).
"""

from __future__ import annotations

import pytest
import torch

from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.kv_move import (
    gather_accepted_hidden,
    gather_accepted_hidden_ref,
    move_accepted_kv,
    move_accepted_kv_ref,
)
from graphdraft.kernels.tree_accept import tree_accept, tree_accept_ref
from graphdraft.kernels.tree_build import TreeBuffers, build_tree, build_tree_ref
from graphdraft.kernels.tree_kv_move import kv_pointer_table, move_accepted_kv_all
from graphdraft.runtime.beams import BeamState, decode_step, first_step
from graphdraft.runtime.tree import TreeSpec

pytestmark = pytest.mark.gpu
DEV = "cuda"
FULL_VOCAB = 128256
TRITON = KernelConfig(backend="triton")


def _beams(spec, bs, vd, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    st = BeamState.allocate(spec, bs, DEV)
    first_step(spec, torch.randn(bs, vd, device=DEV, generator=g), st)
    for j in range(1, spec.steps):
        decode_step(spec, j, torch.randn(bs * spec.topk, vd, device=DEV, generator=g), st)
    return st


@pytest.mark.parametrize("spec", [TreeSpec(5, 4, 8), TreeSpec(3, 4, 16), TreeSpec(7, 8, 64),
                                  TreeSpec(3, 1)])
@pytest.mark.parametrize("bs", [1, 64])
def test_build_kernel_matches_ref_at_scale(spec, bs):
    st = _beams(spec, bs, 32000, 1)
    root = torch.randint(0, 128256, (bs,), device=DEV)
    plen = torch.randint(0, 4000, (bs,), device=DEV, dtype=torch.int32)
    a, b = TreeBuffers.allocate(spec, bs, DEV), TreeBuffers.allocate(spec, bs, DEV)
    build_tree_ref(spec, st.cand_score, st.cand_tok, st.cand_parent, root, plen, a)
    build_tree(spec, st.cand_score, st.cand_tok, st.cand_parent, root, plen, b)
    for f in a.__dict__:
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def _outs(bs, spec):
    return dict(accept_len=torch.zeros(bs, dtype=torch.int32, device=DEV),
                accept_index=torch.zeros(bs, spec.P, dtype=torch.int64, device=DEV),
                out_tokens=torch.zeros(bs, spec.P, dtype=torch.int64, device=DEV),
                bonus=torch.zeros(bs, dtype=torch.int64, device=DEV))


@pytest.mark.parametrize("spec", [TreeSpec(5, 4, 8), TreeSpec(3, 4, 16)])
def test_accept_kernel_matches_ref_full_vocab(spec):
    bs, v = 64, FULL_VOCAB
    st = _beams(spec, bs, min(32000, v), 2)
    t = TreeBuffers.allocate(spec, bs, DEV)
    build_tree(spec, st.cand_score, st.cand_tok, st.cand_parent,
               torch.zeros(bs, dtype=torch.int64, device=DEV),
               torch.zeros(bs, dtype=torch.int64, device=DEV), t)
    g = torch.Generator(device=DEV).manual_seed(3)
    logits = torch.randn(bs * spec.n, v, device=DEV, generator=g) * 3
    # give the drafted tokens most of the mass so walks go deep
    kid = t.tokens.gather(1, t.first_child.clamp(min=0)).reshape(-1)
    logits[torch.arange(bs * spec.n, device=DEV), kid] += 12.0
    probs = torch.softmax(logits, -1)
    coins = torch.rand(bs, spec.n, device=DEV, generator=g)
    final = torch.rand(bs, device=DEV, generator=g)
    a, b = _outs(bs, spec), _outs(bs, spec)
    kw = dict(target=probs.argmax(-1))
    tree_accept_ref(spec, t.tokens, t.first_child, t.next_sibling, **kw, **a)
    tree_accept(spec, t.tokens, t.first_child, t.next_sibling, **kw, **b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert int(a["accept_len"].max()) >= 3
    # sampled: the walk is exact (same fp32 sums in the same order); the residual draw's sums
    # over 128256 columns round differently in torch and Triton, so the bonus is checked
    # against the float64 inverse CDF instead (its interval must hold u * total, to 1e-5)
    kw = dict(probs=probs, coins=coins, final_coin=final)
    tree_accept_ref(spec, t.tokens, t.first_child, t.next_sibling, **kw, **a)
    tree_accept(spec, t.tokens, t.first_child, t.next_sibling, **kw, **b)
    assert torch.equal(a["accept_len"], b["accept_len"])
    assert torch.equal(a["accept_index"], b["accept_index"])
    d = torch.arange(spec.P, device=DEV)[None, :]
    drafted = d < (b["accept_len"].long() - 1)[:, None]
    assert torch.equal(torch.where(drafted, a["out_tokens"], 0), torch.where(drafted, b["out_tokens"], 0))
    assert torch.equal(torch.where(drafted, 0, b["out_tokens"]), torch.where(drafted, 0, b["bonus"][:, None]))
    last = b["accept_index"].gather(1, (b["accept_len"].long() - 1)[:, None]).squeeze(1)
    p = probs.view(bs, spec.n, v)[torch.arange(bs, device=DEV), last].double()
    kids = (t.parents == last[:, None]) & (torch.arange(spec.n, device=DEV)[None, :] > 0)
    res = p.clone()
    for r in range(bs):
        for i in range(1, spec.n):
            if bool(kids[r, i]):
                res[r, int(t.tokens[r, i])] = 0.0
    cdf = res.cumsum(1)
    thr = final.double().clamp(1e-30, 1 - 2 ** -24) * cdf[:, -1]
    tok = b["bonus"]
    hi = cdf.gather(1, tok[:, None]).squeeze(1)
    lo = hi - res.gather(1, tok[:, None]).squeeze(1)
    tol = 1e-5 * cdf[:, -1]
    assert bool((res.gather(1, tok[:, None]).squeeze(1) > 0).all())
    assert bool(((lo <= thr + tol) & (hi >= thr - tol)).all())
    assert int((a["bonus"] != b["bonus"]).sum()) <= bs // 8


@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_move_at_8b_shape(page_size):
    bs, P, layers, slots = 64, 6, 32, 64 * 512
    g = torch.Generator(device=DEV).manual_seed(4)
    ks = [torch.randn(slots, 8, 128, device=DEV, generator=g).bfloat16() for _ in range(layers)]
    vs = [torch.randn(slots, 8, 128, device=DEV, generator=g).bfloat16() for _ in range(layers)]
    max_pages = 512 // page_size
    table = torch.zeros(bs + 1, max_pages, dtype=torch.int32, device=DEV)
    table[1:] = (torch.randperm(bs * max_pages, device=DEV, generator=g).view(bs, max_pages)
                 .int())
    req = torch.arange(1, bs + 1, device=DEV)
    plen = torch.randint(0, 400, (bs,), device=DEV, generator=g)
    path = torch.sort(torch.rand(bs, 15, device=DEV, generator=g).argsort(1)[:, : P - 1] + 1,
                      dim=1).values
    path = torch.cat([torch.zeros(bs, 1, dtype=torch.int64, device=DEV), path], 1)
    alen = torch.randint(1, P + 1, (bs,), device=DEV, generator=g, dtype=torch.int32)
    path = torch.where(torch.arange(P, device=DEV) < alen[:, None].long(), path, -1)
    ks2, vs2 = [t.clone() for t in ks], [t.clone() for t in vs]
    move_accepted_kv(ks, vs, table, req, plen, path, alen, page_size)
    move_accepted_kv_ref(ks2, vs2, table, req, plen, path, alen, page_size)
    for x, y in zip(ks + vs, ks2 + vs2, strict=True):
        assert torch.equal(x, y)
    ks3, vs3 = [t.clone() for t in ks2], [t.clone() for t in vs2]   # every layer, one launch
    move_accepted_kv_all(ks3, vs3, kv_pointer_table(ks3, vs3), table, req, plen, path, alen,
                         page_size)
    move_accepted_kv_ref(ks2, vs2, table, req, plen, path, alen, page_size)
    for x, y in zip(ks3 + vs3, ks2 + vs2, strict=True):
        assert torch.equal(x, y)
    aux = torch.randn(bs * 16, 3 * 4096, device=DEV, generator=g).bfloat16()
    h1 = torch.empty(bs * P, 3 * 4096, device=DEV, dtype=torch.bfloat16)
    h2 = torch.empty_like(h1)
    gather_accepted_hidden(aux, path, alen, 16, h1)
    gather_accepted_hidden_ref(aux, path, alen, 16, h2)
    assert torch.equal(h1, h2)


@pytest.mark.parametrize("bs", [1, 8])
def test_beams_kernel_matches_torch_path_at_smollm2_size(bs):
    """`kernels.tree_beams` at the SmolLM2 head's shape (draft vocab 8192, bf16 logits, tree
    7/2/8, hot map, some rows sampling): the torch path's tokens, parents and ancestors, the
    scores to fp32 rounding."""
    spec, vd, h = TreeSpec(7, 2, 8), 8192, 576
    g = torch.Generator(device=DEV).manual_seed(bs)
    hot = torch.randperm(49152, device=DEV, generator=g)[:vd].sort().values
    temp = torch.where(torch.arange(bs, device=DEV) % 2 == 1, 0.7, 0.0)
    st = {s: BeamState.allocate(spec, bs, DEV) for s in ("ref", "tri")}
    hid = {s: [torch.randn(bs * 2, h, device=DEV, generator=torch.Generator(device=DEV)
                           .manual_seed(9)).bfloat16() for _ in range(2)] for s in st}
    for j in range(spec.steps):
        lg = (torch.randn(bs * (1 if j == 0 else 2), vd, device=DEV, generator=g) * 4).bfloat16()
        for side, kc in (("ref", None), ("tri", TRITON)):
            a, b = hid[side]
            if j == 0:
                first_step(spec, lg, st[side], hot_token_ids=hot, temperature=temp,
                           scratch_base=5, hid_src=a[:bs], hid_dst=b, kernels=kc)
            else:
                decode_step(spec, j, lg, st[side], hot_token_ids=hot, temperature=temp,
                            scratch_base=5, hid_out=a, hid_next=b, kernels=kc)
            hid[side].reverse()
        for f in ("beam_tok", "beam_cand", "parent_beam", "anc", "cand_tok", "cand_parent"):
            assert torch.equal(getattr(st["ref"], f), getattr(st["tri"], f)), (j, f)
        for f in ("beam_score", "cand_score"):
            torch.testing.assert_close(getattr(st["ref"], f), getattr(st["tri"], f), rtol=1e-5,
                                       atol=1e-5)
        for x, y in zip(hid["ref"], hid["tri"], strict=True):
            assert torch.equal(x, y)
        for f in ("beam_score", "cand_score"):       # the next level from the same scores
            getattr(st["tri"], f).copy_(getattr(st["ref"], f))


class _Tail:
    """Persistent buffers of the tree tail for `bs` rows, and the tail itself."""

    def __init__(self, spec, bs, vd, v, page_size=16):
        self.spec, self.bs, self.v, self.ps = spec, bs, v, page_size
        z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=DEV)  # noqa: E731
        self.logits0, self.logits = z(bs, vd), [z(bs * spec.topk, vd) for _ in range(spec.steps - 1)]
        self.root, self.plen = z(bs, dt=torch.int64), z(bs, dt=torch.int64)
        self.probs, self.coins, self.final = z(bs * spec.n, v), z(bs, spec.n), z(bs)
        self.aux = z(bs * spec.n, 64)
        self.hid_c = z(bs * spec.P, 64)
        self.st = BeamState.allocate(spec, bs, DEV)
        self.t = TreeBuffers.allocate(spec, bs, DEV)
        self.o = _outs(bs, spec)
        self.table = torch.arange(1, bs * 8 + 1, dtype=torch.int32, device=DEV).view(bs, 8)
        self.req = torch.arange(bs, device=DEV)
        self.ks = [z(bs * 8 * page_size + page_size, 2, 16) for _ in range(2)]
        self.vs = [z(bs * 8 * page_size + page_size, 2, 16) for _ in range(2)]
        self.kv_table = kv_pointer_table(self.ks, self.vs)

    def fill(self, seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        for t in [self.logits0, *self.logits, self.coins, self.final, self.aux, *self.ks, *self.vs]:
            t.copy_(torch.rand(t.shape, device=DEV, generator=g) * 4)
        self.root.copy_(torch.randint(0, self.v, (self.bs,), device=DEV, generator=g))
        self.plen.copy_(torch.randint(0, 40, (self.bs,), device=DEV, generator=g))
        x = torch.randn(self.probs.shape, device=DEV, generator=g)
        x[:, : self.v // 8] += 6.0   # a few tokens dominate: the walks accept some drafts
        self.probs.copy_(torch.softmax(x, -1))
        self.logits0[:, : self.v // 8] += 6.0
        for t in self.logits:
            t[:, : self.v // 8] += 6.0

    def run(self):
        s, st, t = self.spec, self.st, self.t
        first_step(s, self.logits0, st, scratch_base=7, kernels=TRITON)
        for j in range(1, s.steps):
            decode_step(s, j, self.logits[j - 1], st, scratch_base=7, kernels=TRITON)
        build_tree(s, st.cand_score, st.cand_tok, st.cand_parent, self.root, self.plen, t)
        tree_accept(s, t.tokens, t.first_child, t.next_sibling, probs=self.probs, coins=self.coins,
                    final_coin=self.final, **self.o)
        move_accepted_kv_all(self.ks, self.vs, self.kv_table, self.table, self.req, self.plen,
                             self.o["accept_index"], self.o["accept_len"], self.ps)
        gather_accepted_hidden(self.aux, self.o["accept_index"], self.o["accept_len"], s.n,
                               self.hid_c)

    def state(self):
        return [x.clone() for x in (*self.st.__dict__.values(), *self.t.__dict__.values(),
                                    *self.o.values(), self.hid_c, *self.ks, *self.vs)]


@pytest.mark.parametrize("spec", [TreeSpec(5, 4, 8), TreeSpec(3, 1)])
def test_tree_tail_graph_equals_eager(spec):
    vd = v = 64
    tails = {bs: _Tail(spec, bs, vd, v) for bs in (8, 2)}
    graphs = {}
    for bs, tail in tails.items():
        tail.fill(0)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            tail.run()                                    # warm-up (Triton compiles)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            tail.run()
        graphs[bs] = g
    for seed in (1, 2):
        for bs in (8, 2):
            tail = tails[bs]
            tail.fill(seed)
            graphs[bs].replay()
            torch.cuda.synchronize()
            got = tail.state()
            tail.fill(seed)
            tail.run()
            want = tail.state()
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
