"""The speculative cycle's small kernels: prepare (state -> verify inputs) and commit + pack
(accept -> state, packed output). One program per row; each has a torch reference doing the
same writes (`prepare_rows_ref`, `commit_pack_ref`: the torch path; `graphdraft.ops` chooses;
tests compare the two).

prepare(rows from `slot_rows`, N tokens per row):
  s = slot_rows[r]; live = s != 0 and done[s] == 0; v = valid_cache_lengths[s]
  ids = [last_token[s], drafts[s, :N - 1]]
  err[r] = 1 if live and an id is outside [0, vocab) | 2 if live and v + N > max_context_len
  (a flagged row becomes inert). Inert rows: slot 0, positions 0..N-1, ids 0, seq len N.
  input_ids / positions / out_cache_loc [r*N + j] (from tok0), req[r] = slot, seq_lens[r] =
  v + N, extend_lens[r] = N; KV slot = req_to_page[slot, pos // ps] * ps + pos % ps.
commit (rows with accept a > 0; the others write nothing but the prefill length):
  decode rows: valid_cache_lengths[s] += a; prefill rows: valid_cache_lengths[req] = seq_lens[r]
  last_token[s] = tokens[r, a - 1]; drafts[s] = next_tokens[r, 1:] (when given);
  emitted[s] += a; done[s] |= finish[r] != 0
pack: pack[r] = [tokens[r, :n], 0 up to N, accept, finish, err]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_tensor
from graphdraft.kernels.cache_loc import kv_slot
from graphdraft.kernels.config import KernelConfig

__all__ = ["commit_pack", "commit_pack_ref", "neutral_slot0", "prepare_rows", "prepare_rows_ref"]

ERR_DRAFTS, ERR_CACHE_LEN = 1, 2


# N (tokens a row, k + 1) is not specialized and NP2 covers the widest row (S + 1): one variant
# for every draft length k (a few masked lanes at k < S in a one-program-per-row kernel).
@triton.jit(do_not_specialize=["N"],  # row / token views at any offset (mixed steps): one variant
            do_not_specialize_on_alignment=["slot_rows", "input_ids", "positions", "out_cache_loc",
                                            "req", "seq_lens", "extend_lens", "err"])
def _prepare_kernel(slot_rows, done, vcl, last_token, drafts, stride_d, req_to_page, stride_p,
                    input_ids, positions, out_cache_loc, req, seq_lens, extend_lens, err,
                    N, PS, MAX_PAGES, MAX_CTX, VOCAB, NP2: tl.constexpr):
    r = tl.program_id(0)
    one = tl.arange(0, 1)
    s = tl.load(slot_rows + r + one).to(tl.int64)
    live = (s != 0) & (tl.load(done + s) == 0)
    v = tl.load(vcl + s).to(tl.int64)
    j = tl.arange(0, NP2)
    jm = j < N
    last = tl.load(last_token + s)                                           # [1]
    d = tl.load(drafts + s * stride_d + (j - 1), mask=jm & (j > 0), other=0)  # [NP2]
    ids = tl.where(j == 0, tl.sum(last, 0), d).to(tl.int64)
    bad_len = live & (v + N > MAX_CTX)
    bad_id = tl.sum((jm & ((ids < 0) | (ids >= VOCAB))).to(tl.int32), 0) > 0
    bad_ids = live & bad_id
    tl.store(err + r + one, bad_ids.to(tl.int32) * 1 | bad_len.to(tl.int32) * 2)
    live = live & ~bad_len & ~bad_ids
    sl = tl.where(live, s, 0)
    live_v = tl.sum(live.to(tl.int32), 0) > 0
    v_s = tl.sum(v, 0)
    sl_s = tl.sum(sl, 0)
    pos = tl.where(live_v, v_s + j, j)
    ids = tl.where(live_v, ids, 0)
    pidx = tl.minimum(pos // PS, MAX_PAGES - 1)
    page = tl.load(req_to_page + sl_s * stride_p + pidx, mask=jm, other=0).to(tl.int64)
    base = r.to(tl.int64) * N
    tl.store(input_ids + base + j, ids, mask=jm)
    tl.store(positions + base + j, pos.to(positions.dtype.element_ty), mask=jm)
    tl.store(out_cache_loc + base + j, (page * PS + pos % PS).to(out_cache_loc.dtype.element_ty),
             mask=jm)
    tl.store(req + r + one, sl.to(req.dtype.element_ty))
    tl.store(seq_lens + r + one, (tl.where(live, v, 0) + N).to(seq_lens.dtype.element_ty))
    tl.store(extend_lens + r + one, (v * 0 + N).to(extend_lens.dtype.element_ty))


def _check_prepare(rows, n, input_ids, positions, out_cache_loc, req, seq_lens, extend_lens,
                   err) -> None:
    for name, t, size in (("input_ids", input_ids, rows * n), ("positions", positions, rows * n),
                          ("out_cache_loc", out_cache_loc, rows * n), ("req", req, rows),
                          ("seq_lens", seq_lens, rows), ("extend_lens", extend_lens, rows),
                          ("err", err, rows)):
        expect_tensor(name, t, shape=(size,), layout="contiguous")


def prepare_rows(slot_rows, n, *, done, vcl, last_token, drafts, req_to_page, page_size,
                 max_context_len, vocab, input_ids, positions, out_cache_loc, req, seq_lens,
                 extend_lens, err, kernels: KernelConfig | None = None) -> None:
    """Triton path (`graphdraft.ops.prepare_rows` chooses): the module docstring's prepare over
    `rows = len(slot_rows)` rows; destinations are the rows' / tokens' slices (`[rows]`,
    `[rows * n]`). Graph-capturable. `kernels`: the launch settings (None: the default; this
    launch reads none)."""
    rows = slot_rows.shape[0]
    _check_prepare(rows, n, input_ids, positions, out_cache_loc, req, seq_lens, extend_lens, err)
    if rows == 0:
        return
    _prepare_kernel[(rows,)](slot_rows, done, vcl, last_token, drafts, drafts.stride(0),
                             req_to_page, req_to_page.stride(0), input_ids, positions,
                             out_cache_loc, req, seq_lens, extend_lens, err, n, page_size,
                             req_to_page.shape[1], max_context_len, vocab,
                             NP2=triton.next_power_of_2(max(n, drafts.shape[1] + 1)),
                             num_warps=1)


def prepare_rows_ref(slot_rows, n, *, done, vcl, last_token, drafts, req_to_page, page_size,
                     max_context_len, vocab, input_ids, positions, out_cache_loc, req, seq_lens,
                     extend_lens, err) -> None:
    """Torch path of `prepare_rows`: the same checks and writes."""
    rows = slot_rows.shape[0]
    _check_prepare(rows, n, input_ids, positions, out_cache_loc, req, seq_lens, extend_lens, err)
    if rows == 0:
        return
    s = slot_rows
    live = (s != 0) & (done[s] == 0)
    v = vcl[s].long()
    ids = torch.cat([last_token[s].unsqueeze(1), drafts[s, : n - 1]], 1)
    bad_len = live & (v + n > max_context_len)
    bad_ids = live & ((ids < 0) | (ids >= vocab)).any(1)
    err.copy_((bad_ids.int() * ERR_DRAFTS) | (bad_len.int() * ERR_CACHE_LEN))
    live = live & ~bad_len & ~bad_ids
    sl = torch.where(live, s, 0)
    j = torch.arange(n, device=s.device).expand(rows, n)
    pos = torch.where(live.unsqueeze(1), v.unsqueeze(1) + j, j)
    ids = torch.where(live.unsqueeze(1), ids, 0)
    input_ids.copy_(ids.reshape(-1))
    positions.copy_(pos.reshape(-1))
    out_cache_loc.copy_(kv_slot(req_to_page, sl.unsqueeze(1), pos, page_size).reshape(-1))
    req.copy_(sl)
    seq_lens.copy_(torch.where(live, v, 0) + n)
    extend_lens.fill_(n)


# prefill (0 / 1) is a runtime flag, not specialized: the cycle and the prefill share one variant.
@triton.jit(do_not_specialize=["stride_t", "n", "prefill"],  # tokens a row (k + 1): every k
            do_not_specialize_on_alignment=["accept", "finish", "err", "req", "seq_lens", "tokens",
                                            "next_tokens", "pack"])  # and any row offset
def _commit_pack_kernel(accept, finish, err, req, seq_lens, tokens, stride_t, next_tokens,
                        stride_n, vcl, last_token, drafts, stride_d, emitted, done, pack,
                        stride_pk, n, NROW, S, prefill, NP2: tl.constexpr, SP2: tl.constexpr,
                        HAS_NEXT: tl.constexpr):
    r = tl.program_id(0)
    r64 = r.to(tl.int64)
    one = tl.arange(0, 1)
    a = tl.load(accept + r + one)                      # [1] int32
    fin = tl.load(finish + r + one)
    e = tl.load(err + r + one)
    q = tl.load(req + r + one).to(tl.int64)
    live = a > 0
    if prefill != 0:
        tl.store(vcl + q, tl.load(seq_lens + r + one).to(vcl.dtype.element_ty))
    else:
        old = tl.load(vcl + q, mask=live, other=0)
        tl.store(vcl + q, (old + a).to(vcl.dtype.element_ty), mask=live)
    last = tl.load(tokens + r64 * stride_t + tl.maximum(a - 1, 0))
    tl.store(last_token + q, last.to(last_token.dtype.element_ty), mask=live)
    if HAS_NEXT:
        k = tl.arange(0, SP2)
        km = k < S
        nx = tl.load(next_tokens + r64 * stride_n + 1 + k, mask=km, other=0)
        live_v = (k * 0 + tl.sum(live.to(tl.int32), 0)) > 0
        q_s = tl.sum(q, 0)
        tl.store(drafts + q_s * stride_d + k, nx.to(drafts.dtype.element_ty), mask=km & live_v)
    em = tl.load(emitted + q, mask=live, other=0)
    tl.store(emitted + q, (em + a).to(emitted.dtype.element_ty), mask=live)
    dn = tl.load(done + q, mask=live, other=0)
    tl.store(done + q, (dn | (fin != 0).to(tl.int32)).to(done.dtype.element_ty), mask=live)
    j = tl.arange(0, NP2)
    t = tl.load(tokens + r64 * stride_t + j, mask=j < n, other=0)
    tl.store(pack + r64 * stride_pk + j, t.to(tl.int32), mask=j < NROW)
    tl.store(pack + r64 * stride_pk + NROW + one, a.to(tl.int32))
    tl.store(pack + r64 * stride_pk + NROW + 1 + one, fin.to(tl.int32))
    tl.store(pack + r64 * stride_pk + NROW + 2 + one, e.to(tl.int32))


def neutral_slot0(*tables: torch.Tensor) -> None:
    """Row 0 (the dummy slot) of each per-slot table back to 0, capturable (a slice's fill:
    `t[0] = 0` copies a host scalar)."""
    for t in tables:
        t[:1].zero_()


def _check_pack(tokens, pack) -> tuple[int, int, int]:
    """`(rows, n, nrow)` of a commit: tokens `[rows, n]` (unit column stride), pack
    `[rows, N + 3]` with N = nrow >= n."""
    rows, n = tokens.shape
    nrow = pack.shape[1] - 3
    if pack.shape[0] != rows or nrow < n or tokens.stride(1) != 1:
        raise ValueError(f"pack: expected [{rows}, >= {n} + 3], got {tuple(pack.shape)}")
    return rows, n, nrow


def commit_pack(tokens, next_tokens, *, accept, finish, err, req, seq_lens, vcl, last_token,
                drafts, emitted, done, pack, prefill: bool,
                kernels: KernelConfig | None = None) -> None:
    """Triton path (`graphdraft.ops.commit_pack` chooses): the module docstring's commit and
    pack over `rows = tokens.shape[0]` rows: tokens `[rows, n]`, next_tokens `[rows, S + 1]` or
    None, pack `[rows, N + 3]` (N >= n). `kernels`: the launch settings (None: the default;
    this launch reads none)."""
    rows, n, nrow = _check_pack(tokens, pack)
    if rows == 0:
        return
    s_cols = drafts.shape[1]
    nt = next_tokens if next_tokens is not None else tokens
    _commit_pack_kernel[(rows,)](
        accept, finish, err, req, seq_lens, tokens, tokens.stride(0), nt, nt.stride(0), vcl,
        last_token, drafts, drafts.stride(0), emitted, done, pack, pack.stride(0), n, nrow,
        s_cols, int(prefill), NP2=triton.next_power_of_2(nrow),
        SP2=triton.next_power_of_2(max(s_cols, 1)), HAS_NEXT=next_tokens is not None and s_cols > 0, num_warps=1)


def commit_pack_ref(tokens, next_tokens, *, accept, finish, err, req, seq_lens, vcl, last_token,
                    drafts, emitted, done, pack, prefill: bool) -> None:
    """Torch path of `commit_pack`: the same checks and writes."""
    rows, n, nrow = _check_pack(tokens, pack)
    if rows == 0:
        return
    s_cols = drafts.shape[1]
    a = accept.long()
    live = a > 0
    s = torch.where(live, req, 0)
    if prefill:
        vcl.index_put_((req,), seq_lens.to(vcl.dtype))
    else:
        vcl.index_put_((s,), (vcl[s] + a).to(vcl.dtype))
    last = tokens.gather(1, (a - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    last_token.index_put_((s,), last.to(last_token.dtype))
    if next_tokens is not None and s_cols:
        drafts.index_put_((s,), next_tokens[:, 1:].to(drafts.dtype))
    emitted.index_put_((s,), (emitted[s] + a).to(emitted.dtype))
    done.index_put_((s,), done[s] | (finish != 0).to(done.dtype))
    neutral_slot0(vcl, last_token, drafts, emitted, done)  # inert rows' sink
    pack[:, :n] = tokens
    if n < nrow:
        pack[:, n:nrow] = 0
    pack[:, nrow] = accept
    pack[:, nrow + 1] = finish
    pack[:, nrow + 2] = err
