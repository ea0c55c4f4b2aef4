"""Tree build: the candidate store -> the `n`-node verify tree of each row.

Inputs: cand_score `[B, M]` float32 (cumulative log-prob), cand_tok `[B, M]` int64 (target ids),
cand_parent `[B, M]` int64 (flat candidate index of the parent, -1 = child of the root),
root `[B]` int32/int64 (the root token), prefix_len `[B]` int32/int64 (`L`, the root's position).
Outputs (TreeBuffers, each `[B, n]` int64):

    select  the n-1 best candidates: higher score first, ties to the lower flat index, NaN as
            -inf (`score_key`); the set is closed under ancestors because a
            path's cumulative log-prob never increases and a parent has the lower flat index
    sort    selected flat indices ascending -> nodes 1..n-1 (node 0 = root): parents first
    parents parent node id (root: -1)
    depths  draft level of the node (root 0; from the flat index: pure arithmetic)
    positions  L + depth (rope positions; the node's KV index stays L + i)
    mask    bit j of row i set iff node j is node i or an ancestor (root row: bit 0)
    first_child / next_sibling  smallest child id / next larger sibling id, -1 when none
    retrieve_index  r*n + i (the node's row in the verify batch)
    tokens  root token, then cand_tok of the selected candidates
    cand_node  `[B, M]`: node id of each candidate, 0 = not selected (the Triton kernel's
            workspace too)

Fixed shapes, no host sync: `build_tree_ref` (torch: topk / sort / searchsorted) and
`build_tree` (Triton, one program per row) write the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch
import triton
import triton.language as tl

from graphdraft.checks import INDEX_DTYPES, expect_tensor
from graphdraft.kernels.config import KernelConfig

__all__ = ["TreeBuffers", "TreeShape", "build_tree", "build_tree_ref", "score_key"]


class TreeShape(Protocol):
    """What the tree kernels read of a tree shape (`graphdraft.runtime.tree.TreeSpec` is one):
    `steps` K, `topk` k, `n` verified nodes, `M = k + (K-1)*k*k` candidates, `P = min(K + 1, n)`
    the longest path, and the depth of flat candidate indices."""

    steps: int
    topk: int

    @property
    def n(self) -> int: ...

    @property
    def M(self) -> int: ...  # noqa: N802 - the design's symbol

    @property
    def P(self) -> int: ...  # noqa: N802

    def depth_of(self, flat: torch.Tensor) -> torch.Tensor: ...


_LOW31 = 0x7FFFFFFF


def score_key(scores: torch.Tensor) -> torch.Tensor:
    """The candidates' total order as one int64 per element of `scores [..., M]`: a higher
    score gives a larger key, equal scores the lower index along the last dim the larger key,
    NaN counts as -inf. Keys of one row are distinct, so `topk` on them is deterministic.
    `scores` float32 (other float dtypes are converted). `_key` computes the same in the
    kernel; `graphdraft.runtime.tree` re-exports it."""
    s = scores.float()
    s = torch.where(torch.isnan(s), torch.full_like(s, float("-inf")), s) + 0.0  # -0.0 -> +0.0
    bits = s.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ _LOW31, bits)  # order-preserving signed int
    m = scores.shape[-1]
    low = (m - 1) - torch.arange(m, device=scores.device, dtype=torch.int64)
    return ordered * (1 << 32) + low


@dataclass
class TreeBuffers:
    """The built tree of `B` rows, every field `[B, n]` int64 but cand_node `[B, M]` (module doc)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    retrieve_index: torch.Tensor
    cand_node: torch.Tensor

    @classmethod
    def allocate(cls, spec: TreeShape, bs: int, device: str | torch.device) -> TreeBuffers:
        return cls(**{f.name: torch.zeros(bs, spec.M if f.name == "cand_node" else spec.n,
                                          dtype=torch.int64, device=device)
                      for f in fields(cls)})

    def rows(self, bs: int) -> TreeBuffers:
        return TreeBuffers(**{f.name: getattr(self, f.name)[:bs] for f in fields(self)})


def _check(spec: TreeShape, cand_score, cand_tok, cand_parent, root, prefix_len, out) -> int:
    bs = expect_tensor("root", root, shape=("B",), dtypes=INDEX_DTYPES).shape[0]
    for name, t, dt in (("cand_score", cand_score, torch.float32), ("cand_tok", cand_tok, torch.int64),
                        ("cand_parent", cand_parent, torch.int64)):
        expect_tensor(name, t, shape=(bs, spec.M), dtypes=dt, layout="contiguous")  # [B, M]
    expect_tensor("prefix_len", prefix_len, shape=(bs,), dtypes=INDEX_DTYPES)
    for f in fields(out):
        t = getattr(out, f.name)
        width = spec.M if f.name == "cand_node" else spec.n
        expect_tensor(f"out.{f.name}", t, shape=(bs, width), dtypes=torch.int64, layout="contiguous")
    return bs


def build_tree_ref(spec: TreeShape, cand_score: torch.Tensor, cand_tok: torch.Tensor,
                   cand_parent: torch.Tensor, root: torch.Tensor, prefix_len: torch.Tensor,
                   out: TreeBuffers) -> None:
    """Torch version (module doc); capturable: fixed shapes, no sync."""
    bs = _check(spec, cand_score, cand_tok, cand_parent, root, prefix_len, out)
    n, dev = spec.n, root.device
    sel = torch.topk(score_key(cand_score), n - 1, dim=1).indices
    sel = torch.sort(sel, dim=1).values                                    # [B, n-1] ascending
    pflat = cand_parent.gather(1, sel)
    pnode = torch.where(pflat < 0, torch.zeros_like(pflat),
                        1 + torch.searchsorted(sel, pflat.clamp(0, spec.M - 1)))
    pnode = pnode.clamp(max=n - 1)  # only a malformed store (not one beams wrote) gets here
    minus1 = torch.full((bs, 1), -1, dtype=torch.int64, device=dev)
    zero = torch.zeros((bs, 1), dtype=torch.int64, device=dev)
    parents = torch.cat([minus1, pnode], 1)
    depths = torch.cat([zero, spec.depth_of(sel)], 1)
    ids = torch.arange(n, device=dev)
    bit = torch.ones((), dtype=torch.int64, device=dev) << ids                # [n]
    up = parents.clamp(min=0)
    mask = bit.expand(bs, n).clone()
    for _ in range(spec.steps):          # depth <= K: K rounds close the ancestor chain
        mask = bit | torch.where(parents >= 0, mask.gather(1, up), torch.zeros_like(mask))
    # first child: min{j : parent(j) = i}; next sibling: min{j' > j : parent(j') = parent(j)}
    big = torch.full((bs, n, n), n, dtype=torch.int64, device=dev)
    cols = ids.view(1, 1, n).expand(bs, n, n)
    child = parents.unsqueeze(1) == ids.view(1, n, 1)                      # [B, i, j]
    first = torch.where(child, cols, big).min(2).values
    sib = (parents.unsqueeze(1) == parents.unsqueeze(2)) & (cols > ids.view(1, n, 1))
    sib &= (parents >= 0).unsqueeze(2)
    nxt = torch.where(sib, cols, big).min(2).values
    out.tokens[:, 0].copy_(root)
    out.tokens[:, 1:].copy_(cand_tok.gather(1, sel))
    out.parents.copy_(parents)
    out.depths.copy_(depths)
    out.positions.copy_(depths + prefix_len.to(torch.int64).unsqueeze(1))
    out.mask.copy_(mask)
    out.first_child.copy_(torch.where(first == n, -1, first))
    out.next_sibling.copy_(torch.where(nxt == n, -1, nxt))
    out.retrieve_index.copy_(torch.arange(bs, device=dev).unsqueeze(1) * n + ids)
    out.cand_node.zero_()
    out.cand_node.scatter_(1, sel, ids[1:].expand(bs, n - 1).contiguous())


_NO_KEY = tl.constexpr(-(2**63) + 1)  # below every score key: padding lanes


@triton.jit
def _key(s, i, M):
    """score_key of fp32 scores `s` at flat indices `i` (`score_key`)."""
    s = tl.where(s != s, float("-inf"), s) + 0.0
    bits = s.to(tl.int32, bitcast=True).to(tl.int64)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered * 4294967296 + (M - 1 - i).to(tl.int64)


@triton.jit
def _build_tree_kernel(score_ptr, tok_ptr, par_ptr, root_ptr, plen_ptr,
                       o_tok, o_par, o_dep, o_pos, o_mask, o_first, o_next, o_ret, o_cnode,
                       M, n, k, K, MB: tl.constexpr, NB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, MB)
    ok = i < M
    crow = r * M
    key = tl.where(ok, _key(tl.load(score_ptr + crow + i, mask=ok, other=0.0), i, M), _NO_KEY)
    rank = tl.zeros([MB], tl.int32)
    for j in range(0, M):  # rank = number of larger keys (keys of a row are distinct)
        kj = _key(tl.load(score_ptr + crow + j), j, M)
        rank += (kj > key).to(tl.int32)
    sel = ok & (rank < n - 1)
    node = tl.cumsum(sel.to(tl.int32), axis=0).to(tl.int64)          # 1..n-1 where selected
    tl.store(o_cnode + crow + i, tl.where(sel, node, 0), mask=ok)
    tl.debug_barrier()
    nrow = r * n
    L = tl.load(plen_ptr + r).to(tl.int64)
    pf = tl.load(par_ptr + crow + i, mask=sel, other=-1)
    pf = tl.minimum(pf, M - 1)  # beams write valid parents; the clamp keeps garbage in bounds
    pnode = tl.where(pf < 0, 0, tl.load(o_cnode + crow + tl.maximum(pf, 0), mask=sel, other=0))
    depth = tl.where(i < k, 1, 2 + (i - k) // (k * k)).to(tl.int64)
    tl.store(o_tok + nrow + node, tl.load(tok_ptr + crow + i, mask=sel, other=0), mask=sel)
    tl.store(o_par + nrow + node, pnode, mask=sel)
    tl.store(o_dep + nrow + node, depth, mask=sel)
    tl.store(o_pos + nrow + node, L + depth, mask=sel)
    tl.store(o_tok + nrow, tl.load(root_ptr + r).to(tl.int64))
    tl.store(o_par + nrow, -1)
    tl.store(o_dep + nrow, 0)
    tl.store(o_pos + nrow, L)
    tl.debug_barrier()
    v = tl.arange(0, NB)
    vok = v < n
    par = tl.load(o_par + nrow + v, mask=vok, other=-1)
    one = tl.full([NB], 1, tl.int64)
    mask = one << v.to(tl.int64)
    a = par
    for _ in range(0, K):  # depth <= K
        mask = mask | tl.where(a >= 0, one << tl.maximum(a, 0), 0)
        a = tl.where(a >= 0, tl.load(o_par + nrow + tl.maximum(a, 0), mask=vok & (a >= 0),
                                     other=-1), -1)
    first = tl.full([NB], -1, tl.int64)
    nxt = tl.full([NB], -1, tl.int64)
    for j in range(1, n):  # ascending: the first hit is the smallest id
        pj = tl.load(o_par + nrow + j)
        first = tl.where((pj == v) & (first < 0), j, first)
        nxt = tl.where((pj == par) & (j > v) & (v > 0) & (nxt < 0), j, nxt)
    tl.store(o_mask + nrow + v, mask, mask=vok)
    tl.store(o_first + nrow + v, first, mask=vok)
    tl.store(o_next + nrow + v, nxt, mask=vok)
    tl.store(o_ret + nrow + v, nrow + v, mask=vok)


def build_tree(spec: TreeShape, cand_score: torch.Tensor, cand_tok: torch.Tensor,
               cand_parent: torch.Tensor, root: torch.Tensor, prefix_len: torch.Tensor,
               out: TreeBuffers, *, kernels: KernelConfig | None = None) -> None:
    """Triton version (module doc; `graphdraft.ops.build_tree` chooses): one program per row;
    same writes as `build_tree_ref`. `kernels`: the launch settings (None: the default; this launch reads none)."""
    bs = _check(spec, cand_score, cand_tok, cand_parent, root, prefix_len, out)
    if bs == 0:
        return
    _build_tree_kernel[(bs,)](
        cand_score, cand_tok, cand_parent, root, prefix_len, out.tokens, out.parents, out.depths,
        out.positions, out.mask, out.first_child, out.next_sibling, out.retrieve_index,
        out.cand_node, spec.M, spec.n, spec.topk, spec.steps,
        MB=triton.next_power_of_2(spec.M), NB=triton.next_power_of_2(spec.n), num_warps=4)
