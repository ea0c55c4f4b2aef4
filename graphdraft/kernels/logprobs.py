"""Log-probabilities of emitted tokens and the top-k alternatives, on device, into the pack.

Row r's position j has its logits at row `logit_rows[r, j]` of `logits [*, V]` (None:
`r * n + j`, the chain's verify layout) and emitted the token `tokens[r, j]`. With the row's
slot `s = slots[r]` and its width `w = widths[s]` (the request's `logprobs`; -1: none asked), a
live position (`s != 0`, `done[s] == 0` when `done` is given, `w >= 0`, and `j < accept[r]`
when `accept [rows]` is given: positions past the row's accepted prefix are never read back)
writes, from x = the fp32 logits row:
  lp[r, j]         = x[tokens[r, j]] - logsumexp(x)                     (log_softmax at the token)
  top_ids[r, j, i] = the i-th largest x (ties: the lower id first), i < min(w, V)
  top_lp[r, j, i]  = its log_softmax value
Slots `i >= w` of the top arrays and positions that are not live are left as they were (the
host reads only `w` entries of the accepted positions of rows that asked).

Two launches, the logits read once: `_logprobs_split_kernel`, one program per (position, V
block of `BLOCK`), the block's max, sum of exp(x - max) and best min(w, K) entries picked in
registers; `_logprobs_combine_kernel`, one program per position, their log-sum-exp and the
best min(w, K) of the blocks' candidates (exact: a position's best w are among its blocks'
best w). Programs of positions that are not live read one slot (and accept) value and exit:
no work at all for rows that asked nothing. Scratch: `[rows * n, blocks, 2 + 2K]` words from
the caching allocator (the graph's pool under capture).

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


@triton.jit
def _position(pid, n, slots, widths, done, accept, HAS_DONE: tl.constexpr,
              HAS_ACCEPT: tl.constexpr):
    """(r, j, w, live) of program `pid` = r * n + j: live when the row's slot is not 0, its
    request asked (w >= 0), is not done and position j is emitted (j < accept[r])."""
    r = (pid // n).to(tl.int64)
    j = pid % n
    s = tl.load(slots + r).to(tl.int64)
    w = tl.load(widths + s).to(tl.int32)
    live = (s != 0) & (w >= 0)
    if HAS_DONE:
        if live:
            live = tl.load(done + s) == 0
    if HAS_ACCEPT:
        if live:
            live = j < tl.load(accept + r)
    return r, j, w, live


@triton.jit
def _logits_row(r, j, n, logit_rows, stride_i, HAS_ROWS: tl.constexpr):
    """The logits row of (row r, position j): `logit_rows[r, j]`, else r * n + j."""
    if HAS_ROWS:
        lrow = tl.load(logit_rows + r * stride_i + j).to(tl.int64)
    else:
        lrow = (r * n + j).to(tl.int64)
    return lrow


@triton.jit(do_not_specialize=["stride_l", "stride_i", "n", "SPLITS"],
            do_not_specialize_on_alignment=["slots", "logit_rows", "accept"])
def _logprobs_split_kernel(logits, stride_l, logit_rows, stride_i, slots, widths, done, accept,
                           part_m, part_z, part_v, part_i, n, V, SPLITS, K: tl.constexpr,
                           HAS_ROWS: tl.constexpr, HAS_DONE: tl.constexpr,
                           HAS_ACCEPT: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r * n + j, c): block c of position j's logits row, read once: its max
    `part_m`, its sum of exp(x - max) `part_z` and its best min(w, K) entries by (value desc,
    id asc) `part_v` / `part_i` (id V: none left)."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    r, j, w, live = _position(pid, n, slots, widths, done, accept, HAS_DONE, HAS_ACCEPT)
    if live:
        lrow = _logits_row(r, j, n, logit_rows, stride_i, HAS_ROWS)
        idx = c * BLOCK + tl.arange(0, BLOCK)
        ok = idx < V
        x = tl.load(logits + lrow * stride_l + idx, mask=ok, other=-float("inf")).to(tl.float32)
        m = tl.max(x, 0)
        z = tl.sum(tl.exp(x - m), 0)
        z = tl.where(m == -float("inf"), 0.0, z)
        out = pid.to(tl.int64) * SPLITS + c
        tl.store(part_m + out, m)
        tl.store(part_z + out, z)
        for i in range(0, tl.minimum(w, K)):  # in registers: the block is read once
            bv = tl.max(tl.where(ok, x, -float("inf")), 0)
            bi = tl.min(tl.where(ok & (x == bv), idx, V), 0)
            tl.store(part_v + out * K + i, bv)
            tl.store(part_i + out * K + i, bi)
            ok = ok & (idx != bi)


@triton.jit(do_not_specialize=["stride_l", "stride_t", "stride_i", "stride_o", "n", "SPLITS"],
            do_not_specialize_on_alignment=["tokens", "slots", "logit_rows", "out", "accept"])
def _logprobs_combine_kernel(logits, stride_l, tokens, stride_t, logit_rows, stride_i, slots,
                             widths, done, accept, part_m, part_z, part_v, part_i, out,
                             stride_o, n, V, SPLITS, NP: tl.constexpr, K: tl.constexpr,
                             KP: tl.constexpr, SP: tl.constexpr, HAS_ROWS: tl.constexpr,
                             HAS_DONE: tl.constexpr, HAS_ACCEPT: tl.constexpr):
    """Program r * n + j: the log-sum-exp of the blocks' (max, sum) and the best min(w, K)
    of their candidates (a position's best w are among its blocks' best w), into the pack."""
    pid = tl.program_id(0)
    r, j, w, live = _position(pid, n, slots, widths, done, accept, HAS_DONE, HAS_ACCEPT)
    if live:
        lrow = _logits_row(r, j, n, logit_rows, stride_i, HAS_ROWS)
        row = logits + lrow * stride_l
        sp = tl.arange(0, SP)
        base = pid.to(tl.int64) * SPLITS
        m = tl.load(part_m + base + sp, mask=sp < SPLITS, other=-float("inf"))
        z = tl.load(part_z + base + sp, mask=sp < SPLITS, other=0.0)
        mx = tl.max(m, 0)
        lse = mx + tl.log(tl.sum(z * tl.exp(m - mx), 0))
        tok = tl.load(tokens + r * stride_t + j).to(tl.int64)
        tok = tl.minimum(tl.maximum(tok, 0), V - 1)
        dst = out + r * stride_o
        lp = tl.load(row + tok).to(tl.float32) - lse
        tl.store(dst + j, lp.to(tl.int32, bitcast=True))
        wk = tl.minimum(w, K)
        kk = tl.arange(0, KP)
        cell = (base + sp[:, None]) * K + kk[None, :]
        ok = (sp[:, None] < SPLITS) & (kk[None, :] < wk)
        ids = tl.load(part_i + cell, mask=ok, other=V)
        vals = tl.load(part_v + cell, mask=ok, other=-float("inf"))
        ok = ok & (ids < V)
        for i in range(0, wk):
            bv = tl.max(tl.max(tl.where(ok, vals, -float("inf")), 1), 0)
            bi = tl.min(tl.min(tl.where(ok & (vals == bv), ids, V), 1), 0)
            if bi < V:
                tl.store(dst + NP + j * K + i, bi)
                tl.store(dst + NP + NP * K + j * K + i, (bv - lse).to(tl.int32, bitcast=True))
            ok = ok & (ids != bi)


def _check(logits, tokens, logit_rows, slots, widths, done, out, k, accept=None):
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
    if accept is not None:
        expect_tensor("accept", accept, shape=(rows,), layout="contiguous")
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
                   accept: torch.Tensor | None = None,
                   kernels: KernelConfig | None = None) -> None:
    """Triton path (`graphdraft.ops.token_logprobs` chooses): the module docstring's writes.
    `tokens [rows, n]`, `slots [rows]`, `widths [R]` (per slot, -1 none; at most `k`),
    `done [R]` or None, `logit_rows [rows, n]` or None, `accept [rows]` or None (positions
    `j >= accept[r]` write nothing), `out [rows, N * (1 + 2k)]` int32. Graph-capturable (no
    sync). `kernels`: the launch settings (these launches read none)."""
    rows, n, np_ = _check(logits, tokens, logit_rows, slots, widths, done, out, k, accept)
    if rows == 0 or n == 0:
        return
    v, dev = logits.shape[1], logits.device
    block = min(4096, triton.next_power_of_2(v))
    splits = triton.cdiv(v, block)
    lr = logit_rows if logit_rows is not None else tokens
    dn = done if done is not None else widths
    acc = accept if accept is not None else widths
    positions = rows * n
    part_m = torch.empty(positions * splits, dtype=torch.float32, device=dev)
    part_z = torch.empty_like(part_m)
    part_v = torch.empty(positions * splits * max(k, 1), dtype=torch.float32, device=dev)
    part_i = torch.empty(part_v.shape, dtype=torch.int32, device=dev)
    flags = dict(K=k, HAS_ROWS=logit_rows is not None, HAS_DONE=done is not None,
                 HAS_ACCEPT=accept is not None)
    _logprobs_split_kernel[(positions, splits)](
        logits, logits.stride(0), lr, lr.stride(0), slots, widths, dn, acc, part_m, part_z,
        part_v, part_i, n, v, splits, BLOCK=block, num_warps=4, **flags)
    _logprobs_combine_kernel[(positions,)](
        logits, logits.stride(0), tokens, tokens.stride(0), lr, lr.stride(0), slots, widths,
        dn, acc, part_m, part_z, part_v, part_i, out, out.stride(0), n, v, splits, NP=np_,
        KP=triton.next_power_of_2(max(k, 1)), SP=triton.next_power_of_2(splits), num_warps=4,
        **flags)


def token_logprobs_ref(logits: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor,
                       widths: torch.Tensor, *, out: torch.Tensor, k: int,
                       logit_rows: torch.Tensor | None = None,
                       done: torch.Tensor | None = None,
                       accept: torch.Tensor | None = None) -> None:
    """Torch path of `token_logprobs`: the same checks and writes (torch.log_softmax, a
    stable descending sort for the top)."""
    rows, n, np_ = _check(logits, tokens, logit_rows, slots, widths, done, out, k, accept)
    if rows == 0 or n == 0:
        return
    dev, v = logits.device, logits.shape[1]
    s = slots.to(torch.int64)
    w = widths[s].to(torch.int64)
    live = (s != 0) & (w >= 0)
    if done is not None:
        live &= done[s] == 0
    live = live[:, None].expand(rows, n)
    if accept is not None:
        live = live & (torch.arange(n, device=dev)[None, :] < accept.to(torch.int64)[:, None])
    if logit_rows is None:
        idx = torch.arange(rows * n, device=dev).view(rows, n)
    else:
        idx = logit_rows.to(torch.int64)
    lsm = torch.log_softmax(logits.index_select(0, idx.reshape(-1)).float(), -1).view(rows, n, v)
    tok = tokens.to(torch.int64).clamp(0, v - 1)
    lp = lsm.gather(2, tok.unsqueeze(2)).squeeze(2)
    flt = out.view(torch.float32)
    cur = flt[:, :n]
    flt[:, :n] = torch.where(live, lp, cur)
    kk = min(k, v)
    if kk == 0:
        return
    vals, ids = torch.sort(lsm, dim=-1, descending=True, stable=True)
    vals, ids = vals[..., :kk], ids[..., :kk].to(torch.int32)
    slot_i = torch.arange(kk, device=dev)
    want = live[:, :, None] & (slot_i[None, None, :] < w[:, None, None])
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
