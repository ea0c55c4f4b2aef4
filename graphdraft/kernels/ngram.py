"""N-gram (prompt-lookup) drafting on device: per row, the tokens that followed the most recent
earlier occurrence of the history's last n tokens.

Inputs: `history [R, L]` int (per request slot: the prompt and the emitted tokens, token at
position p in column p), `lengths [R]` int (tokens of each slot's history), `slots [rows]`
int (each row's slot; a row whose slot has length 0, e.g. the dummy slot 0, matches nothing),
`k` (drafts wanted, 0..S), `ngram_min` <= `ngram_max` (n-gram lengths, >= 1).

Per row r, with h = history[slots[r], :len] (len = lengths[slots[r]]):
  for n = ngram_max down to ngram_min (the first n with a match wins):
    a match is a start i with 0 <= i <= len - n - 1 and h[i : i + n] == h[len - n : len]
    (an earlier occurrence with at least one token after it; it may overlap the suffix);
    the most recent one (largest i) is taken;
  found = min(k, len - (i + n)) tokens follow it (0 without a match, or with k = 0).
Writes `out [rows, S + 1]` (the `Drafter.draft` layout): column 0 = h[len - 1] (0 when
len == 0); column j >= 1 = h[i + n + min(j, found) - 1] when min(j, found) > 0, else column 0.
So columns past `found` repeat the last draft (filler; with no match: the last token). Filler
is a valid token id: the verify may accept it only where it equals the target's own token at
that position (greedy: the argmax; sampled: the sampled token, see `kernels/accept.py`), which
keeps decoding exact. And `found [rows]` (the real drafts of each row).

One program per row; the n loop and the scan (blocks of BLOCK starts, from the end back, each
n-gram compared token by token) stop at the first match: no host sync, graph-capturable. The
row count, k, n range and history width are runtime arguments (not specialized): one variant
for every padded batch size and draft length. `ngram_propose_ref` is the plain torch
reference (a loop over rows: the spec above, line for line).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_int, expect_tensor
from graphdraft.kernels.config import KernelConfig

__all__ = ["NGRAM_BLOCK", "ngram_propose", "ngram_propose_ref"]

NGRAM_BLOCK = 128
"""Candidate starts compared per scan step of one row."""


@triton.jit(do_not_specialize=["stride_h", "stride_o", "K", "NMIN", "NMAX", "S1"],
            do_not_specialize_on_alignment=["slots", "out", "found"])
def _ngram_kernel(history, stride_h, lengths, slots, out, stride_o, found, K, NMIN, NMAX, S1,
                  BLOCK: tl.constexpr, SP2: tl.constexpr):
    r = tl.program_id(0)
    s = tl.load(slots + r).to(tl.int64)
    length = tl.load(lengths + s).to(tl.int64)
    row = history + s * stride_h
    offs = tl.arange(0, BLOCK)
    best = length * 0 - 1          # the match's start (-1: none)
    n = length * 0 + NMAX
    while (best < 0) & (n >= NMIN):
        hi = length - n - 1        # the last start with a token after the n-gram
        end = hi + 1
        while (best < 0) & (end > 0):
            i = end - BLOCK + offs
            m = i >= 0
            for t in range(0, n):
                want = tl.load(row + length - n + t)
                got = tl.load(row + i + t, mask=m, other=-1)
                m = m & (got == want)
            best = tl.max(tl.where(m, i, -1), 0)
            end = end - BLOCK
        if best < 0:
            n = n - 1
    cnt = tl.where(best >= 0, tl.minimum(length - best - n, K), 0)
    cnt = tl.maximum(cnt, 0)
    last = tl.load(row + tl.maximum(length - 1, 0), mask=length > 0, other=0)
    j = tl.arange(0, SP2)
    use = tl.minimum(j, cnt)
    src = tl.maximum(best + n + use - 1, 0)
    tok = tl.load(row + src, mask=(j < S1) & (use > 0), other=0)
    tok = tl.where(use > 0, tok, last)
    tl.store(out + r.to(tl.int64) * stride_o + j, tok.to(out.dtype.element_ty), mask=j < S1)
    tl.store(found + r, cnt.to(found.dtype.element_ty))


_INTS = (torch.int32, torch.int64)


def _check(history, lengths, slots, out, found, k, ngram_min, ngram_max) -> tuple[int, int]:
    expect_tensor("history", history, shape=("R", "L"), dtypes=_INTS, layout="rows")
    expect_tensor("lengths", lengths, shape=(history.shape[0],), dtypes=_INTS,
                  layout="contiguous")
    expect_tensor("slots", slots, shape=("rows",), dtypes=_INTS, layout="contiguous")
    rows = slots.shape[0]
    expect_tensor("out", out, shape=(rows, "S1"), dtypes=_INTS, layout="rows")
    expect_tensor("found", found, shape=(rows,), dtypes=_INTS, layout="contiguous")
    s1 = out.shape[1]
    expect_int("k", k, lo=0, hi=s1 - 1)
    expect_int("ngram_min", ngram_min, lo=1)
    expect_int("ngram_max", ngram_max, lo=ngram_min)
    return rows, s1


def ngram_propose(history: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, k: int,
                  ngram_min: int, ngram_max: int, *, out: torch.Tensor, found: torch.Tensor,
                  kernels: KernelConfig | None = None) -> None:
    """Triton path (`graphdraft.ops.ngram_propose` chooses): the module docstring's writes of
    `out [rows, S + 1]` and `found [rows]` for `rows = slots.shape[0]`. Graph-capturable.
    `kernels`: the launch settings (None: the default; this launch reads none)."""
    rows, s1 = _check(history, lengths, slots, out, found, k, ngram_min, ngram_max)
    if rows == 0:
        return
    _ngram_kernel[(rows,)](history, history.stride(0), lengths, slots, out, out.stride(0), found,
                           k, ngram_min, ngram_max, s1, BLOCK=NGRAM_BLOCK,
                           SP2=triton.next_power_of_2(s1), num_warps=4)


def ngram_propose_ref(history: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, k: int,
                      ngram_min: int, ngram_max: int, *, out: torch.Tensor,
                      found: torch.Tensor) -> None:
    """Torch path of `ngram_propose`: the same checks and writes, computed per row with
    tensor ops (vectorised over the candidate starts of each n; no host sync)."""
    rows, s1 = _check(history, lengths, slots, out, found, k, ngram_min, ngram_max)
    if rows == 0:
        return
    L = history.shape[1]
    dev = history.device
    h = history[slots.long()].long()                      # [rows, L]
    ln = lengths[slots.long()].long()                     # [rows]
    pos = torch.arange(L, device=dev)
    best = torch.full((rows,), -1, dtype=torch.long, device=dev)
    best_n = torch.zeros(rows, dtype=torch.long, device=dev)
    for n in range(ngram_max, ngram_min - 1, -1):
        ok = pos[None, :] <= (ln - n - 1)[:, None]         # [rows, L] starts i
        for t in range(n):
            want = h.gather(1, (ln - n + t).clamp(0, L - 1)[:, None])  # [rows, 1]
            got = h.gather(1, (pos + t).clamp(max=L - 1)[None, :].expand(rows, L))
            ok = ok & (got == want)
        cand = torch.where(ok, pos[None, :], -1).amax(1)
        take = (best < 0) & (cand >= 0)
        best = torch.where(take, cand, best)
        best_n = torch.where(take, torch.full_like(best_n, n), best_n)
    cnt = torch.where(best >= 0, torch.minimum(ln - best - best_n, torch.full_like(ln, k)), 0)
    last = torch.where(ln > 0, h.gather(1, (ln - 1).clamp(min=0)[:, None]).squeeze(1), 0)
    j = torch.arange(s1, device=dev)
    use = torch.minimum(j[None, :], cnt[:, None])          # [rows, S + 1]
    src = (best + best_n)[:, None] + use - 1
    tok = h.gather(1, src.clamp(0, L - 1))
    out.copy_(torch.where(use > 0, tok, last[:, None]).to(out.dtype))
    found.copy_(cnt.to(found.dtype))
