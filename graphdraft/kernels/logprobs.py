"""Log-probabilities of emitted tokens and the top-k alternatives, on device, into the pack.

One program per (row, position). Row r's position j has its logits at row
`logit_rows[r, j]` of `logits [*, V]` (None: `r * n + j`, the chain's verify layout) and
emitted the token `tokens[r, j]`. With the row's slot `s = slots[r]` and its width
`w = widths[s]` (the request's `logprobs`; -1: none asked), a live row (`s != 0`, and
`done[s] == 0` when `done` is given) with `w >= 0` writes, from x = the fp32 logits row:
  lp[r, j]         = x[tokens[r, j]] - logsumexp(x)                     (log_softmax at the token)
  top_ids[r, j, i] = the i-th largest x (ties: the lower id first), i < w
  top_lp[r, j, i]  = its log_softmax value
Slots `i >= w` of the top arrays and rows that asked nothing are left as they were (the host
reads only `w` entries of rows that asked): only rows that asked pay for the top-k sweeps
(`w` passes over V), and no row pays anything when none asked beyond one slot load.

Output: `out [rows, L]` int32 (a view into the step's pack, any row stride), each row
`[lp: N | top_ids: N * K | top_lp: N * K]` with fp32 values stored as their bits; N the
positions per row of the pack (n <= N), K the engine's widest top (`RuntimeConfig.max_logprobs`).
`unpack_row` reads one row back on the host.

Which distribution: `logits` as the caller hands them (the target's logits after the
request's own logit transforms), at temperature 1, with no top-k / top-p / min_p mask: the
model's distribution the request sampled from before truncation (see
`graphdraft.sampling`'s logprobs note).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_int, expect_tensor
from graphdraft.kernels.config import KernelConfig

__all__ = ["pack_width", "token_logprobs", "token_logprobs_ref", "unpack_row"]


def pack_width(n: int, k: int) -> int:
    """int32 words a row of `n` positions and top width `k` takes: `n * (1 + 2k)`."""
    return n * (1 + 2 * k)


@triton.jit(do_not_specialize=["stride_l", "stride_t", "stride_i", "stride_o", "n"],
            do_not_specialize_on_alignment=["tokens", "slots", "logit_rows", "out"])
def _logprobs_kernel(logits, stride_l, tokens, stride_t, logit_rows, stride_i, slots, widths,
                     done, out, stride_o, n, V, NP: tl.constexpr, K: tl.constexpr,
                     HAS_ROWS: tl.constexpr, HAS_DONE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    r = (pid // n).to(tl.int64)
    j = pid % n
    s = tl.load(slots + r).to(tl.int64)
    w = tl.load(widths + s).to(tl.int32)
    live = (s != 0) & (w >= 0)
    if HAS_DONE:
        if live:
            live = tl.load(done + s) == 0
    if live:
        if HAS_ROWS:
            lrow = tl.load(logit_rows + r * stride_i + j).to(tl.int64)
        else:
            lrow = r * n + j
        row = logits + lrow * stride_l
        cols = tl.arange(0, BLOCK)
        mx = -float("inf")
        z = 0.0
        for c in range(0, V, BLOCK):  # online logsumexp: one pass
            x = tl.load(row + c + cols, mask=c + cols < V, other=-float("inf")).to(tl.float32)
            m = tl.maximum(mx, tl.max(x, 0))
            z = z * tl.exp(mx - m) + tl.sum(tl.exp(x - m), 0)
            mx = m
        lse = mx + tl.log(z)
        tok = tl.load(tokens + r * stride_t + j).to(tl.int64)
        tok = tl.minimum(tl.maximum(tok, 0), V - 1)
        lp = tl.load(row + tok).to(tl.float32) - lse
        base = out + r * stride_o
        tl.store(base + j, lp.to(tl.int32, bitcast=True))
        # top w by (value desc, id asc): pass i takes the best entry after pass i - 1's
        pv = float("inf")
        pi = -1
        for i in range(0, tl.minimum(w, K)):
            bv = -float("inf")
            bi = V
            for c in range(0, V, BLOCK):
                idx = c + cols
                x = tl.load(row + idx, mask=idx < V, other=-float("inf")).to(tl.float32)
                after = (idx < V) & ((x < pv) | ((x == pv) & (idx > pi)))
                x = tl.where(after, x, -float("inf"))
                m = tl.max(x, 0)
                mi = tl.min(tl.where(after & (x == m), idx, V), 0)
                better = (m > bv) | ((m == bv) & (mi < bi))
                bv = tl.where(better, m, bv)
                bi = tl.where(better, mi, bi)
            bi = tl.minimum(bi, V - 1)
            bv = tl.load(row + bi).to(tl.float32)
            tl.store(base + NP + j * K + i, bi.to(tl.int32))
            tl.store(base + NP + NP * K + j * K + i, (bv - lse).to(tl.int32, bitcast=True))
            pv = bv
            pi = bi


def _check(logits, tokens, logit_rows, slots, widths, done, out, k):
    rows, n = tokens.shape
    expect_tensor("logits", logits, shape=("rows", "V"), layout="rows")
    expect_tensor("tokens", tokens, shape=(rows, n), layout="rows")
    if logit_rows is not None:
        expect_tensor("logit_rows", logit_rows, shape=(rows, n), layout="rows")
    elif logits.shape[0] < rows * n:
        raise ValueError(f"logits: expected at least {rows * n} rows (rows * n), "
                         f"got {logits.shape[0]}")
    expect_tensor("slots", slots, shape=(rows,), layout="contiguous")
    expect_tensor("widths", widths, shape=("R",), layout="contiguous")
    if done is not None:
        expect_tensor("done", done, shape=("R",), layout="contiguous")
    expect_tensor("out", out, shape=(rows, "L"), dtypes=torch.int32, layout="rows")
    expect_int("k", k, 0)
    np_ = out.shape[1] // (1 + 2 * k)
    if out.shape[1] != pack_width(np_, k) or np_ < n:
        raise ValueError(f"out: expected [{rows}, N * (1 + 2 * {k})] with N >= {n}, "
                         f"got {tuple(out.shape)}")
    return rows, n, np_


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor,
                   widths: torch.Tensor, *, out: torch.Tensor, k: int,
                   logit_rows: torch.Tensor | None = None, done: torch.Tensor | None = None,
                   kernels: KernelConfig | None = None) -> None:
    """Triton path (`graphdraft.ops.token_logprobs` chooses): the module docstring's writes.
    `tokens [rows, n]`, `slots [rows]`, `widths [R]` (per slot, -1 none; at most `k`),
    `done [R]` or None, `logit_rows [rows, n]` or None, `out [rows, N * (1 + 2k)]` int32.
    Graph-capturable (no sync). `kernels`: the launch settings (this launch reads none)."""
    rows, n, np_ = _check(logits, tokens, logit_rows, slots, widths, done, out, k)
    if rows == 0 or n == 0:
        return
    v = logits.shape[1]
    lr = logit_rows if logit_rows is not None else tokens
    dn = done if done is not None else widths
    _logprobs_kernel[(rows * n,)](
        logits, logits.stride(0), tokens, tokens.stride(0), lr, lr.stride(0), slots, widths,
        dn, out, out.stride(0), n, v, NP=np_, K=k, HAS_ROWS=logit_rows is not None,
        HAS_DONE=done is not None, BLOCK=min(4096, triton.next_power_of_2(v)), num_warps=4)


def token_logprobs_ref(logits: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor,
                       widths: torch.Tensor, *, out: torch.Tensor, k: int,
                       logit_rows: torch.Tensor | None = None,
                       done: torch.Tensor | None = None) -> None:
    """Torch path of `token_logprobs`: the same checks and writes (torch.log_softmax, a
    stable descending sort for the top)."""
    rows, n, np_ = _check(logits, tokens, logit_rows, slots, widths, done, out, k)
    if rows == 0 or n == 0:
        return
    dev, v = logits.device, logits.shape[1]
    s = slots.to(torch.int64)
    w = widths[s].to(torch.int64)
    live = (s != 0) & (w >= 0)
    if done is not None:
        live &= done[s] == 0
    if logit_rows is None:
        idx = torch.arange(rows * n, device=dev).view(rows, n)
    else:
        idx = logit_rows.to(torch.int64)
    lsm = torch.log_softmax(logits.index_select(0, idx.reshape(-1)).float(), -1).view(rows, n, v)
    tok = tokens.to(torch.int64).clamp(0, v - 1)
    lp = lsm.gather(2, tok.unsqueeze(2)).squeeze(2)
    flt = out.view(torch.float32)
    cur = flt[:, :n]
    flt[:, :n] = torch.where(live[:, None], lp, cur)
    kk = min(k, v)
    if kk == 0:
        return
    vals, ids = torch.sort(lsm, dim=-1, descending=True, stable=True)
    vals, ids = vals[..., :kk], ids[..., :kk].to(torch.int32)
    slot_i = torch.arange(kk, device=dev)
    want = live[:, None, None] & (slot_i[None, None, :] < w[:, None, None])
    ids_view = out[:, np_: np_ + np_ * k].view(rows, np_, k)[:, :n, :kk]
    lp_view = flt[:, np_ + np_ * k:].view(rows, np_, k)[:, :n, :kk]
    ids_view.copy_(torch.where(want, ids, ids_view))
    lp_view.copy_(torch.where(want, vals, lp_view))


def unpack_row(row: torch.Tensor, n_pack: int, k: int, count: int, width: int
               ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Host side of one pack row's region `row [N * (1 + 2k)]` int32 (CPU): the first
    `count` positions' log-probabilities and, per position, its `width` best
    `(token id, log-probability)` pairs, best first."""
    flt = row.view(torch.float32)
    lps = flt[:count].tolist()
    if width <= 0:
        return lps, [[] for _ in range(count)]
    ids = row[n_pack: n_pack + n_pack * k].view(n_pack, k)[:count, :width].tolist()
    tlp = flt[n_pack + n_pack * k:].view(n_pack, k)[:count, :width].tolist()
    return lps, [list(zip(i, v, strict=True)) for i, v in zip(ids, tlp, strict=True)]
