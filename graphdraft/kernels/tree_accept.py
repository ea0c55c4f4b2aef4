"""Tree acceptance: one walk per row from the root down the verified tree.

Inputs (tree of `graphdraft.kernels.tree_build`): tokens, first_child, next_sibling `[B, n]`
int64. Greedy: target `[B*n]` int64, the target's argmax at every node (verify row `r*n + i`).
Sampled: probs `[B*n, V]` float32, the target distribution at every node after temperature,
top-k and top-p (rows sum to 1); coins `[B, n]` (one per node that can be expanded) and
final_coin `[B]` float32 in [0, 1], clamped to `[tiny, 1 - 2^-24]` before use (a coin of 0
would accept a zero-probability draft under `<=`, a coin of 1 could walk past the last
non-zero CDF bucket).

Walk, at most P-1 levels (P = min(K+1, n)), from cur = root:
  greedy   accept the child (first_child / next_sibling order) whose token equals target[cur]
  sampled  walk the children keeping s += p_cur(tok_c); accept the first child with
           coin[cur] <= s. Child c is taken with probability exactly p_cur(tok_c) (siblings
           hold distinct tokens); if none is taken the token is drawn from p_cur with all
           children zeroed and renormalised, at a leaf from p_cur: each emitted token is
           distributed as the target's p given the accepted prefix (multi-draft rejection
           sampling with point-mass drafts), whatever the drafts are.
A draft token outside `[0, V)` (garbage in a padded row) has probability 0: never read out
of bounds. The token drawn after the walk (greedy: target[cur]) is the bonus; inverse-CDF draw with
final_coin over the residual (if the residual has no mass left, which rounding alone can
cause, over p_cur itself), never a zero-probability token.

Outputs (chain-compatible):
  accept_len [B] int32 in 1..P       path nodes = accepted drafts + 1 (the bonus)
  accept_index [B, P] int64          path node ids, root first, -1 padded
  out_tokens [B, P] int64            accepted drafts' tokens, then the bonus; padded with bonus
  bonus [B] int64

`tree_accept` (Triton, one program per row; the V loop in chunks of BLOCK) and
`tree_accept_ref` (vectorised torch over rows) make the same decisions; the residual draw's
fp32 sums may round differently in the last bit, which can move a draw lying exactly on a
CDF boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_tensor
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.tree_build import TreeShape

__all__ = ["tree_accept", "tree_accept_ref", "clamp_coins", "COIN_MAX"]

COIN_MAX = 1.0 - 2.0 ** -24
_TINY = torch.finfo(torch.float32).tiny


def clamp_coins(u: torch.Tensor) -> torch.Tensor:
    """Coins into `[tiny, 1 - 2^-24]` (fp32)."""
    return u.float().clamp(_TINY, COIN_MAX)


def _check(spec: TreeShape, tokens, first_child, next_sibling, target, probs, coins, final_coin,
           accept_len, accept_index, out_tokens, bonus) -> int:
    bs = tokens.shape[0]
    n, p = spec.n, spec.P
    for name, t in (("tokens", tokens), ("first_child", first_child), ("next_sibling", next_sibling)):
        expect_tensor(name, t, shape=(bs, n), dtypes=torch.int64, layout="contiguous")
    if (target is None) == (probs is None):
        raise ValueError("target, probs: expected exactly one (greedy: target; sampled: probs)")
    if target is not None:
        expect_tensor("target", target, shape=(bs * n,), dtypes=torch.int64, layout="contiguous")
    if probs is not None:
        expect_tensor("probs", probs, shape=(bs * n, "V"), dtypes=torch.float32, layout="rows")
        expect_tensor("coins", coins, shape=(bs, n), dtypes=torch.float32, layout="contiguous")
        expect_tensor("final_coin", final_coin, shape=(bs,), dtypes=torch.float32)
    for name, t, shape, dt in (("accept_len", accept_len, (bs,), torch.int32),
                               ("accept_index", accept_index, (bs, p), torch.int64),
                               ("out_tokens", out_tokens, (bs, p), torch.int64),
                               ("bonus", bonus, (bs,), torch.int64)):
        expect_tensor(name, t, shape=shape, dtypes=dt, layout="contiguous")  # P = spec.P
    return bs


def _draw_ref(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF per row of `p [B, V]` (non-negative) at `u [B]`: the first column whose CDF
    reaches `u * sum` among columns with p > 0; the last such column if rounding misses."""
    cdf = torch.cumsum(p, dim=1)
    thr = (u * p.sum(1)).unsqueeze(1)
    v = p.shape[1]
    cols = torch.arange(v, device=p.device).expand_as(p)
    pos = p > 0
    first = torch.where((cdf >= thr) & pos, cols, v).min(1).values
    last = torch.where(pos, cols, -1).max(1).values
    return torch.where(first < v, first, last.clamp(min=0))


def tree_accept_ref(spec: TreeShape, tokens: torch.Tensor, first_child: torch.Tensor,
                    next_sibling: torch.Tensor, *, target: torch.Tensor | None = None,
                    probs: torch.Tensor | None = None, coins: torch.Tensor | None = None,
                    final_coin: torch.Tensor | None = None, accept_len: torch.Tensor,
                    accept_index: torch.Tensor, out_tokens: torch.Tensor,
                    bonus: torch.Tensor) -> None:
    """Vectorised torch version (module doc): same arguments and writes as `tree_accept`."""
    bs = _check(spec, tokens, first_child, next_sibling, target, probs, coins, final_coin,
                accept_len, accept_index, out_tokens, bonus)
    n, P, dev = spec.n, spec.P, tokens.device
    greedy = target is not None
    rows = torch.arange(bs, device=dev)
    cur = torch.zeros(bs, dtype=torch.int64, device=dev)
    alive = torch.ones(bs, dtype=torch.bool, device=dev)
    length = torch.ones(bs, dtype=torch.int64, device=dev)
    path = torch.full((bs, P), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    drafts = torch.zeros((bs, P), dtype=torch.int64, device=dev)
    u = None if greedy else clamp_coins(coins)
    for level in range(P - 1):
        c = first_child.gather(1, cur[:, None]).squeeze(1)
        want = target.view(bs, n).gather(1, cur[:, None]).squeeze(1) if greedy else None
        uc = None if greedy else u.gather(1, cur[:, None]).squeeze(1)
        s = torch.zeros(bs, dtype=torch.float32, device=dev)
        matched = torch.full((bs,), -1, dtype=torch.int64, device=dev)
        mtok = torch.zeros(bs, dtype=torch.int64, device=dev)
        for _ in range(n - 1):
            valid = (c >= 0) & (matched < 0) & alive
            tc = tokens.gather(1, c.clamp(min=0)[:, None]).squeeze(1)
            if greedy:
                hit = valid & (tc == want)
            else:
                vocab = probs.shape[1]
                pc = torch.where((tc >= 0) & (tc < vocab), probs[rows * n + cur, tc.clamp(0, vocab - 1)], 0.0)
                s = torch.where(valid, s + pc, s)
                hit = valid & (uc <= s)
            matched = torch.where(hit, c, matched)
            mtok = torch.where(hit, tc, mtok)
            c = torch.where(c >= 0, next_sibling.gather(1, c.clamp(min=0)[:, None]).squeeze(1), -1)
        adv = alive & (matched >= 0)
        path[:, level + 1] = torch.where(adv, matched, -1)
        drafts[:, level] = mtok
        length += adv.long()
        cur = torch.where(adv, matched, cur)
        alive = adv
    if greedy:
        drawn = target.view(bs, n).gather(1, cur[:, None]).squeeze(1)
    else:
        p = probs[rows * n + cur]                                      # [B, V]
        res = p.clone()
        c = first_child.gather(1, cur[:, None]).squeeze(1)
        for _ in range(n - 1):                                         # zero every child of cur
            tc = tokens.gather(1, c.clamp(min=0)[:, None]).squeeze(1)
            hitcol = (torch.arange(p.shape[1], device=dev)[None, :] == tc[:, None]) & (c >= 0)[:, None]
            res = res.masked_fill(hitcol, 0.0)
            c = torch.where(c >= 0, next_sibling.gather(1, c.clamp(min=0)[:, None]).squeeze(1), -1)
        res = torch.where((res.sum(1) > 0)[:, None], res, p)
        drawn = _draw_ref(res, clamp_coins(final_coin))
    d = torch.arange(P, device=dev)[None, :]
    out = torch.where(d < (length - 1)[:, None], drafts, drawn[:, None])
    accept_len.copy_(length)
    accept_index.copy_(path)
    out_tokens.copy_(out)
    bonus.copy_(drawn)


@triton.jit
def _zero_kids(p, cols, kid, off, BLOCK: tl.constexpr):
    """`p` with the columns listed in `kid` zeroed; the 2-D compare runs only for the chunks
    `[off, off + BLOCK)` that hold a child's token."""
    res = p
    if tl.sum(((kid >= off) & (kid < off + BLOCK)).to(tl.int32), axis=0) > 0:
        hit = tl.sum((cols[:, None] == kid[None, :]).to(tl.int32), axis=1) > 0
        res = tl.where(hit, 0.0, p)
    return res


@triton.jit
def _tree_accept_kernel(tok_ptr, fc_ptr, ns_ptr, tgt_ptr, prob_ptr, stride_p, coin_ptr, fcoin_ptr,
                        len_ptr, idx_ptr, out_ptr, bonus_ptr, n, V, P, tiny, cmax,
                        GREEDY: tl.constexpr, BLOCK: tl.constexpr, PB: tl.constexpr,
                        NB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    base = r * n
    cur = r * 0
    alive = cur + 1
    length = cur + 1
    tl.store(idx_ptr + r * P, cur)
    for level in range(0, P - 1):
        c = tl.load(fc_ptr + base + cur)
        if GREEDY:
            want = tl.load(tgt_ptr + base + cur)
        else:
            u = tl.minimum(tl.maximum(tl.load(coin_ptr + base + cur), tiny), cmax)
        prow = prob_ptr + (base + cur) * stride_p
        s = (cur * 0).to(tl.float32)
        matched = cur * 0 - 1
        mtok = cur * 0
        for _ in range(0, n - 1):
            valid = (c >= 0) & (matched < 0) & (alive > 0)
            tc = tl.load(tok_ptr + base + tl.maximum(c, 0))
            if GREEDY:
                hit = valid & (tc == want)
            else:
                pc = tl.load(prow + tc, mask=valid & (tc >= 0) & (tc < V), other=0.0)
                s = tl.where(valid, s + pc, s)
                hit = valid & (u <= s)
            matched = tl.where(hit, c, matched)
            mtok = tl.where(hit, tc, mtok)
            c = tl.where(c >= 0, tl.load(ns_ptr + base + tl.maximum(c, 0)), -1)
        adv = (alive > 0) & (matched >= 0)
        tl.store(idx_ptr + r * P + level + 1, tl.where(adv, matched, -1))
        tl.store(out_ptr + r * P + level, mtok, mask=adv)
        length += adv.to(tl.int64)
        cur = tl.where(adv, matched, cur)
        alive = adv.to(tl.int64)
    if GREEDY:
        drawn = tl.load(tgt_ptr + base + cur)
    else:
        uf = tl.minimum(tl.maximum(tl.load(fcoin_ptr + r), tiny), cmax)
        prow = prob_ptr + (base + cur) * stride_p
        v = tl.arange(0, NB)
        kid = tl.full([NB], -1, tl.int64)        # the tokens of cur's children (-1: none)
        c = tl.load(fc_ptr + base + cur)
        for sib in range(0, n - 1):
            tc = tl.load(tok_ptr + base + tl.maximum(c, 0))
            kid = tl.where((v == sib) & (c >= 0), tc, kid)
            c = tl.where(c >= 0, tl.load(ns_ptr + base + tl.maximum(c, 0)), -1)
        lanes = tl.arange(0, BLOCK)
        total = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        total_p = total
        for off in range(0, V, BLOCK):
            cols = off + lanes
            p = tl.load(prow + cols, mask=cols < V, other=0.0)
            res = _zero_kids(p, cols, kid, off, BLOCK)
            total += tl.sum(res, axis=0)
            total_p += tl.sum(p, axis=0)
        use_res = total > 0
        thr = uf * tl.where(use_res, total, total_p)
        running = total * 0.0
        found = cur * 0 + V
        last = cur * 0 - 1
        for off in range(0, V, BLOCK):
            cols = off + lanes
            p = tl.load(prow + cols, mask=cols < V, other=0.0)
            res = _zero_kids(p, cols, kid, off, BLOCK)
            res = tl.where(use_res, res, p)
            cdf = running + tl.cumsum(res, axis=0)
            pos = (res > 0) & (cols < V)
            first = tl.min(tl.where((cdf >= thr) & pos, cols, V), axis=0).to(tl.int64)
            found = tl.minimum(found, first)
            last = tl.maximum(last, tl.max(tl.where(pos, cols, -1), axis=0).to(tl.int64))
            running += tl.sum(res, axis=0)
        drawn = tl.where(found < V, found, tl.maximum(last, 0))
    tl.store(len_ptr + r, length.to(tl.int32))
    tl.store(bonus_ptr + r, drawn)
    d = tl.arange(0, PB)
    tl.store(out_ptr + r * P + d, tl.zeros([PB], tl.int64) + drawn, mask=(d < P) & (d >= length - 1))


def tree_accept(spec: TreeShape, tokens: torch.Tensor, first_child: torch.Tensor,
                next_sibling: torch.Tensor, *, target: torch.Tensor | None = None,
                probs: torch.Tensor | None = None, coins: torch.Tensor | None = None,
                final_coin: torch.Tensor | None = None, accept_len: torch.Tensor,
                accept_index: torch.Tensor, out_tokens: torch.Tensor, bonus: torch.Tensor,
                block: int = 1024, kernels: KernelConfig | None = None) -> None:
    """Triton version (module doc; `graphdraft.ops.tree_accept` chooses): one program per row.
    Greedy: pass `target`; sampled: `probs`, `coins`, `final_coin`. `block`: the V chunk (a
    test hook). `kernels`: the launch settings (None: the default; this launch reads none)."""
    bs = _check(spec, tokens, first_child, next_sibling, target, probs, coins, final_coin,
                accept_len, accept_index, out_tokens, bonus)
    if bs == 0:
        return
    greedy = target is not None
    if greedy:  # the sampled-only pointers are never read: any tensor will do
        probs_, stride, v, coins_, fcoin = tokens, 0, 1, tokens, tokens
    else:
        probs_, stride, v, coins_, fcoin = probs, probs.stride(0), probs.shape[1], coins, final_coin
    blk = min(block, triton.next_power_of_2(v))
    _tree_accept_kernel[(bs,)](
        tokens, first_child, next_sibling, target if greedy else tokens, probs_, stride, coins_,
        fcoin, accept_len, accept_index, out_tokens, bonus, spec.n, v, spec.P, _TINY, COIN_MAX,
        GREEDY=greedy, BLOCK=blk, PB=triton.next_power_of_2(spec.P),
        NB=triton.next_power_of_2(spec.n), num_warps=4)
