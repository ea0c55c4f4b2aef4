"""Logit controls on device: logit_bias and the repetition / frequency / presence penalties of
each row's request, applied in place to the target's verify logits before the acceptance (and
to the drafters' logits), and the per-slot token counts they read (counted at each commit).

Verify logits `logits [rows * N, V]`: row `r * N + j` predicts the token after candidate j of
row r (`cand [rows, N]`: column 0 the last verified token, 1.. the drafts; a tree: node j of
the row's verified tree). Each row's request slot `s = slots[r]` (0: inert; also inert when
`done[s]`) carries its parameters in the slot tables (`graphdraft.runtime.slot_state`):

  counts [R, V] int32   `token_counts`: bits 0..29 the token's count in the request's output
                        so far, bit 30 (`PROMPT_FLAG`) set when it occurs in the prompt
  bias_ids [R, W] int32, bias_values [R, W] float32, bias_len [R] int32: the request's
                        `logit_bias` (`bias_len[s]` distinct ids, the rest unused)
  repetition_penalty, frequency_penalty, presence_penalty [R] float32 (neutral 1, 0, 0)

Position j of row r counts the candidates on its path as emitted (they are, when the verify
accepts up to j): the chain's path is candidates 1..j; a tree's is the nodes whose bit is set
in `path[r, j]` (the tree's ancestor mask, self included), node 0 excluded. Candidate 0 /
the root is the last committed token, already in `counts`. With `out` = the output count of
token v at that position (the table's count plus the path's occurrences) and `seen` = prompt
flag or `out > 0`, in fp32 (vLLM's order and formulas):

  x = logits[r * N + j, v] + bias(v)                   (logit_bias; a first launch)
  x = seen ? (x > 0 ? x / rep : x * rep) : x           (repetition_penalty: prompt and output)
  x = x - freq * out - pres * (out > 0)                (frequency / presence: output only)

stored back in the logits' dtype after each of the two launches. Rows whose request sets no
penalty (rep 1, freq 0, pres 0) and no bias read only their slot's four scalars. The
penalties' launch reads a row's `counts` once per cycle step, coalesced (one program per
(row, block of target ids), every position of the row in it) and loads / stores only the
logits it changes (the seen ids; with rep 1, the ids with out > 0): any other column would
come back bit for bit, so its bytes are not moved.

`count_tokens` (in the commit, after the draft: a cycle that fails before its commit leaves
the counts untouched): `counts[slots[r], tokens[r, j]] += 1` for j < accept[r] (rows with
accept 0, inert or mid-prompt, add nothing). Admission (`SlotState.admit`) resets a slot's
row to its prompt flags.

A draft step's logits (`apply_draft_logit_controls`, the drafter proposing under the same
controls so that its proposals are the ones the verify accepts): one position per row, two
windows of tokens counted as emitted beside `counts` (through the last commit): the row's
`window [B, W]` drafted since the acceptance (-1: none), and this cycle's accepted tokens,
not yet counted, `accepted [A, n]` with `accepted_len [A]` (entries j < accepted_len
count), read by row `r // (B / A)` (a tree's beams `r * k + b` share their request row's);
a draft vocabulary maps column c to target id `col_ids[c]` (bias entries outside it are
dropped).

Graph-capturable (no host sync, fixed shapes). The torch references (`*_ref`) compute the same
in the same order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_tensor
from graphdraft.kernels.accept import live_slot
from graphdraft.kernels.config import KernelConfig

__all__ = ["COUNT_MASK", "PROMPT_FLAG", "apply_draft_logit_controls",
           "apply_draft_logit_controls_ref", "apply_logit_controls", "apply_logit_controls_ref",
           "count_tokens", "count_tokens_ref"]

PROMPT_FLAG = 1 << 30
"""`token_counts` bit: the token occurs in the request's prompt."""
COUNT_MASK = PROMPT_FLAG - 1
"""`token_counts` bits of the output count."""
_PROMPT = tl.constexpr(PROMPT_FLAG)
_MASK = tl.constexpr(COUNT_MASK)


@triton.jit(do_not_specialize=["N", "W"],
            do_not_specialize_on_alignment=["logits", "slots"])
def _bias_kernel(logits, stride_l, slots, done, bias_ids, bias_values, bias_len, col_of, N, W,
                 MAPPED: tl.constexpr, WP2: tl.constexpr):
    """Program (r, j): logits[r * N + j, c(bias_ids[s, b])] += bias_values[s, b] for b <
    bias_len[s]; c(t) = t, or `col_of[t]` when MAPPED (-1: the id has no column)."""
    pid = tl.program_id(0)
    r = pid // N
    s, live = live_slot(slots, done, r)
    nb = tl.load(bias_len + s)
    if nb > 0:
        w = tl.arange(0, WP2)
        ok = w < nb
        ids = tl.load(bias_ids + s * W + w, mask=ok, other=0).to(tl.int64)
        val = tl.load(bias_values + s * W + w, mask=ok, other=0.0)
        if MAPPED:
            ids = tl.load(col_of + ids, mask=ok, other=-1).to(tl.int64)
            ok = ok & (ids >= 0)
        row = logits + pid.to(tl.int64) * stride_l
        x = tl.load(row + ids, mask=ok, other=0.0).to(tl.float32) + val
        tl.store(row + ids, x.to(logits.dtype.element_ty), mask=ok)


@triton.jit
def _penalize(logits, stride_l, lrow, tid, ok, col_of, prompt, out, rep, freq, pres,
              MAPPED: tl.constexpr):
    """The penalties at one logits row `lrow` for the target ids `tid` of a block (output
    counts `out`, prompt flags `prompt`), loading and storing only the columns they change:
    the seen ids when rep != 1, else the ids with out > 0 (every other column keeps its value
    exactly: x - freq * 0 - pres * 0 == x)."""
    seen = prompt | (out > 0)
    upd = ok & tl.where(rep != 1.0, seen, out > 0)
    col = tid
    if MAPPED:
        col = tl.load(col_of + tid, mask=upd, other=-1).to(tl.int64)
        upd = upd & (col >= 0)
    row = logits + lrow * stride_l
    x = tl.load(row + col, mask=upd, other=0.0).to(tl.float32)
    x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
    x = x - freq * out.to(tl.float32) - pres * (out > 0).to(tl.float32)
    tl.store(row + col, x.to(logits.dtype.element_ty), mask=upd)


@triton.jit(do_not_specialize=["P", "NC", "stride_c", "stride_p", "stride_k", "stride_a", "NA",
                               "G"],
            do_not_specialize_on_alignment=["logits", "cand", "path", "slots", "acc",
                                            "acc_len"])
def _penalty_kernel(logits, stride_l, cand, stride_c, path, stride_p, slots, done, counts,
                    stride_k, rep_t, freq_t, pres_t, col_of, acc, stride_a, acc_len, P, NC, VT,
                    NA, G, MODE: tl.constexpr, MAPPED: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r, block): the penalties of the module docstring for the target ids of one
    block of `counts` (read once, coalesced) at each of the row's P positions (logits rows
    r * P + j), touching only the logits columns they change. MODE 0 (chain): candidates
    1..j count at position j; 1 (tree): the set bits of path[r, j] but bit 0; 2 (a draft
    step, P = 1): every one of the row's NC window tokens (-1: none), and the accepted tokens
    `acc[r // G, m]` for m < acc_len[r // G] (NA columns; 0: none). MAPPED: target id t scores
    draft column `col_of[t]` (-1: none)."""
    r = tl.program_id(0)
    blk = tl.program_id(1)
    r64 = r.to(tl.int64)
    s, live = live_slot(slots, done, r)
    rep = tl.load(rep_t + s)
    freq = tl.load(freq_t + s)
    pres = tl.load(pres_t + s)
    if (rep != 1.0) | (freq != 0.0) | (pres != 0.0):
        tid = blk * BLOCK + tl.arange(0, BLOCK)
        ok = tid < VT
        tid = tid.to(tl.int64)
        raw = tl.load(counts + s * stride_k + tid, mask=ok, other=0)
        prompt = (raw & _PROMPT) != 0
        out = raw & _MASK
        if MODE == 2:
            for m in range(0, NC):
                t = tl.load(cand + r64 * stride_c + m).to(tl.int64)
                out += ((tid == t) & (t >= 0)).to(tl.int32)
            ra = (r // G).to(tl.int64)
            na = tl.load(acc_len + ra)
            for m in range(0, NA):
                t = tl.load(acc + ra * stride_a + m).to(tl.int64)
                out += ((tid == t) & (m < na) & (t >= 0)).to(tl.int32)
            _penalize(logits, stride_l, r64, tid, ok, col_of, prompt, out, rep, freq, pres,
                      MAPPED)
        elif MODE == 0:  # position j counts candidates 1..j: one more each position
            for j in range(0, P):
                if j >= 1:
                    t = tl.load(cand + r64 * stride_c + j).to(tl.int64)
                    out += (tid == t).to(tl.int32)
                _penalize(logits, stride_l, r64 * P + j, tid, ok, col_of, prompt, out, rep,
                          freq, pres, MAPPED)
        else:
            for j in range(0, P):
                bits = tl.load(path + r64 * stride_p + j).to(tl.int64)
                oj = out
                for m in range(1, NC):
                    t = tl.load(cand + r64 * stride_c + m).to(tl.int64)
                    oj += ((tid == t) & (((bits >> m) & 1) != 0)).to(tl.int32)
                _penalize(logits, stride_l, r64 * P + j, tid, ok, col_of, prompt, oj, rep,
                          freq, pres, MAPPED)


@triton.jit(do_not_specialize=["N", "stride_t", "stride_k"],
            do_not_specialize_on_alignment=["tokens", "accept", "slots"])
def _count_kernel(tokens, stride_t, accept, slots, counts, stride_k, N, V):
    """Program r: counts[slots[r], tokens[r, j]] += 1 for j < accept[r]."""
    r = tl.program_id(0)
    s = tl.load(slots + r).to(tl.int64)
    a = tl.load(accept + r).to(tl.int32)
    for j in range(0, N):
        t = tl.load(tokens + r.to(tl.int64) * stride_t + j).to(tl.int64)
        if (j < a) & (t >= 0) & (t < V):
            tl.atomic_add(counts + s * stride_k + t, 1)


def _check(logits, cand, slots, state, path, positions: int) -> int:
    rows, n = cand.shape
    expect_tensor("logits", logits, shape=("rows", "V"), layout="rows")
    if logits.shape[0] < rows * positions:
        raise ValueError(f"logits: expected at least {rows * positions} rows, "
                         f"got {logits.shape[0]}")
    expect_tensor("cand", cand, shape=(rows, n), layout="rows")
    expect_tensor("slots", slots, shape=(rows,), layout="contiguous")
    if path is not None:
        expect_tensor("path", path, shape=(rows, n), layout="rows")
    return rows


def _check_vocab(logits, state, col_ids, col_of) -> None:
    v = state.token_counts.shape[1]
    if col_ids is None:
        if v != logits.shape[1]:
            raise ValueError(f"state.token_counts: expected {logits.shape[1]} columns (the "
                             f"logits' vocab), got {v}")
        return
    expect_tensor("col_ids", col_ids, shape=(logits.shape[1],), layout="contiguous")
    expect_tensor("col_of", col_of, shape=(v,), layout="contiguous")


def _check_accepted(rows: int, accepted, accepted_len) -> int:
    """The draft rows per accepted row (`G`; 1 without accepted tokens)."""
    if (accepted is None) != (accepted_len is None):
        raise ValueError("accepted_len: expected a tensor exactly when accepted is given "
                         f"(accepted is {'None' if accepted is None else 'given'})")
    if accepted is None:
        return 1
    expect_tensor("accepted", accepted, shape=("A", "n"), layout="rows")
    a = accepted.shape[0]
    expect_tensor("accepted_len", accepted_len, shape=(a,), layout="contiguous")
    if (a == 0 and rows) or (a and rows % a):
        raise ValueError(f"accepted: expected a number of rows dividing the logits' {rows} "
                         f"rows, got {a}")
    return rows // a if a else 1


def _launch(logits, cand, slots, state, path, *, mode: int, positions: int, col_ids=None,
            col_of=None, accepted=None, accepted_len=None, group: int = 1) -> None:
    rows, nc = cand.shape
    w = state.bias_ids.shape[1]
    mapped = col_ids is not None
    _bias_kernel[(rows * positions,)](
        logits, logits.stride(0), slots, state.done, state.bias_ids, state.bias_values,
        state.bias_len, col_of if mapped else slots, positions, w, MAPPED=mapped,
        WP2=triton.next_power_of_2(max(w, 1)), num_warps=4)
    counts = state.token_counts
    vt = counts.shape[1]
    block = min(2048, triton.next_power_of_2(vt))
    acc = accepted is not None
    _penalty_kernel[(rows, triton.cdiv(vt, block))](
        logits, logits.stride(0), cand, cand.stride(0), path if path is not None else cand,
        path.stride(0) if path is not None else 0, slots, state.done, counts, counts.stride(0),
        state.repetition_penalty, state.frequency_penalty, state.presence_penalty,
        col_of if mapped else slots, accepted if acc else cand,
        accepted.stride(0) if acc else 0, accepted_len if acc else slots, positions, nc, vt,
        accepted.shape[1] if acc else 0, group, MODE=mode, MAPPED=mapped, BLOCK=block,
        num_warps=4)


def apply_logit_controls(logits: torch.Tensor, cand: torch.Tensor, slots: torch.Tensor, state,
                         *, path: torch.Tensor | None = None,
                         kernels: KernelConfig | None = None) -> None:
    """Triton path (`graphdraft.ops.apply_logit_controls` chooses): the module docstring's
    transform of `logits [rows * N, V]` in place. `cand [rows, N]` the candidates, `slots
    [rows]` their slots, `state` a `SlotState` (token_counts, bias tables, penalty columns,
    done); `path [rows, N]` int64 ancestor bit masks (a tree; None: the chain). `kernels`:
    launch settings (None: the default; these launches read none)."""
    rows = _check(logits, cand, slots, state, path, cand.shape[1])
    _check_vocab(logits, state, None, None)
    if rows:
        _launch(logits, cand, slots, state, path, mode=0 if path is None else 1,
                positions=cand.shape[1])


def apply_draft_logit_controls(logits: torch.Tensor, window: torch.Tensor, slots: torch.Tensor,
                               state, *, accepted: torch.Tensor | None = None,
                               accepted_len: torch.Tensor | None = None,
                               col_ids: torch.Tensor | None = None,
                               col_of: torch.Tensor | None = None,
                               kernels: KernelConfig | None = None) -> None:
    """Triton path of `ops.apply_draft_logit_controls`: a draft step's logits `[B, Vd]` in
    place, as the target's would be after the row's committed tokens (`counts`), this cycle's
    accepted tokens `accepted [A, n]` (target ids; the first `accepted_len [A]` of row
    `r // (B / A)`; both None: none) and the `window [B, W]` (target ids; -1: none) drafted
    since. `col_ids [Vd]`: the target id of each draft column (None: Vd = V), `col_of [V]`:
    its inverse (-1: not in the draft vocabulary)."""
    rows = _check(logits, window, slots, state, None, 1)
    _check_vocab(logits, state, col_ids, col_of)
    group = _check_accepted(rows, accepted, accepted_len)
    if rows:
        _launch(logits, window, slots, state, None, mode=2, positions=1, col_ids=col_ids,
                col_of=col_of, accepted=accepted, accepted_len=accepted_len, group=group)


def count_tokens(tokens: torch.Tensor, accept: torch.Tensor, slots: torch.Tensor,
                 counts: torch.Tensor, *, kernels: KernelConfig | None = None) -> None:
    """Triton path of `ops.count_tokens`: tokens `[rows, n]`, accept / slots `[rows]`, counts
    `[R, V]` int32 (module docstring)."""
    rows, n = tokens.shape
    _check_counts(tokens, accept, slots, counts)
    if rows == 0:
        return
    _count_kernel[(rows,)](tokens, tokens.stride(0), accept, slots, counts, counts.stride(0),
                           n, counts.shape[1], num_warps=1)


def _check_counts(tokens, accept, slots, counts) -> None:
    rows, n = tokens.shape
    expect_tensor("tokens", tokens, shape=(rows, n), layout="rows")
    for name, t in (("accept", accept), ("slots", slots)):
        expect_tensor(name, t, shape=(rows,), layout="contiguous")
    expect_tensor("counts", counts, shape=("R", "V"), dtypes=torch.int32, layout="contiguous")


# ----------------------------------------------------------------------------
# Torch references
# ----------------------------------------------------------------------------
def _path_counts(cand: torch.Tensor, path: torch.Tensor | None, v: int,
                 window: bool = False) -> torch.Tensor:
    """`[rows, P, V]` int32: occurrences of each token among the candidates counted at each
    position (chain: candidates 1..j; a tree: the set bits of `path[r, j]` but bit 0; a
    draft's `window`: all of the row's tokens, one position)."""
    rows, n = cand.shape
    dev = cand.device
    m = torch.arange(n, device=dev)
    if window:
        on = torch.ones(rows, 1, n, dtype=torch.bool, device=dev)
    elif path is None:
        on = (m[None, :] >= 1) & (m[None, :] <= m[:, None])            # [N (j), N (m)]
        on = on.unsqueeze(0).expand(rows, n, n)
    else:
        on = ((path.to(torch.int64)[:, :, None] >> m) & 1).bool() & (m >= 1)
    tok = cand.to(torch.int64).clamp(0, v - 1)
    onehot = torch.nn.functional.one_hot(tok, v).to(torch.int32)      # [rows, N (m), V]
    valid = ((cand >= 0) & (cand < v)).to(torch.int32)[:, :, None]
    return torch.einsum("rjm,rmv->rjv", on.to(torch.float32),
                        (onehot * valid).to(torch.float32)).round().to(torch.int32)


def _accepted_counts(accepted: torch.Tensor, accepted_len: torch.Tensor, v: int,
                     group: int) -> torch.Tensor:
    """`[A * group, 1, V]` int32: occurrences of each token among row `r // group`'s first
    `accepted_len` accepted tokens."""
    a, n = accepted.shape
    on = torch.arange(n, device=accepted.device) < accepted_len.to(torch.int64)[:, None]
    on = on & (accepted >= 0) & (accepted < v)
    tok = accepted.to(torch.int64).clamp(0, v - 1)
    out = torch.zeros(a, v, dtype=torch.int32, device=accepted.device)
    out.scatter_add_(1, tok, on.to(torch.int32))
    return out.repeat_interleave(group, 0).unsqueeze(1)


def _controls_ref(logits, extra, slots, state, positions: int, col_ids=None) -> None:
    """`logits [rows * P, Vc]` in place; `extra [rows, P, V]` the counted candidates; column
    c scores target id `col_ids[c]` (None: c)."""
    rows = slots.shape[0]
    vc, dt = logits.shape[1], logits.dtype
    v = state.token_counts.shape[1]
    s = slots.to(torch.int64)
    live = (s != 0) & (state.done[s] == 0)
    s = torch.where(live, s, torch.zeros_like(s))
    x = logits[: rows * positions].view(rows, positions, vc)
    cols = (torch.arange(vc, device=x.device) if col_ids is None else col_ids.to(torch.int64))
    # logit_bias: a dense [rows, V] bias from the slots' entries, read at the columns' ids
    w = state.bias_ids.shape[1]
    ids = state.bias_ids[s].to(torch.int64)                               # [rows, W]
    used = torch.arange(w, device=ids.device) < state.bias_len[s].to(torch.int64)[:, None]
    vals = torch.where(used, state.bias_values[s], 0.0)
    dense = torch.zeros(rows, v, dtype=torch.float32, device=x.device)
    dense.scatter_add_(1, torch.where(used, ids, 0), vals)
    has_bias = used.any(1)[:, None, None]
    x.copy_(torch.where(has_bias, (x.float() + dense[:, cols][:, None, :]).to(dt), x))
    # penalties
    raw = state.token_counts[s][:, cols]                                  # [rows, Vc]
    prompt = ((raw & PROMPT_FLAG) != 0)[:, None, :]
    out = (raw & COUNT_MASK)[:, None, :] + extra[:, :, cols]              # [rows, P, Vc]
    rep = state.repetition_penalty[s].float()[:, None, None]
    freq = state.frequency_penalty[s].float()[:, None, None]
    pres = state.presence_penalty[s].float()[:, None, None]
    active = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)
    y = x.float()
    seen = prompt | (out > 0)
    y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
    y = y - freq * out.float() - pres * (out > 0).float()
    x.copy_(torch.where(active, y.to(dt), x))


def apply_logit_controls_ref(logits: torch.Tensor, cand: torch.Tensor, slots: torch.Tensor,
                             state, *, path: torch.Tensor | None = None) -> None:
    """Torch path of `apply_logit_controls` (same checks, same in-place writes)."""
    rows = _check(logits, cand, slots, state, path, cand.shape[1])
    _check_vocab(logits, state, None, None)
    if rows:
        _controls_ref(logits, _path_counts(cand, path, logits.shape[1]), slots, state,
                      cand.shape[1])


def apply_draft_logit_controls_ref(logits: torch.Tensor, window: torch.Tensor,
                                   slots: torch.Tensor, state, *,
                                   accepted: torch.Tensor | None = None,
                                   accepted_len: torch.Tensor | None = None,
                                   col_ids: torch.Tensor | None = None,
                                   col_of: torch.Tensor | None = None) -> None:
    """Torch path of `apply_draft_logit_controls` (same checks, same in-place writes)."""
    rows = _check(logits, window, slots, state, None, 1)
    _check_vocab(logits, state, col_ids, col_of)
    group = _check_accepted(rows, accepted, accepted_len)
    if rows:
        v = state.token_counts.shape[1]
        extra = _path_counts(window, None, v, window=True)
        if accepted is not None:
            extra = extra + _accepted_counts(accepted, accepted_len, v, group)
        _controls_ref(logits, extra, slots, state, 1, col_ids)


def count_tokens_ref(tokens: torch.Tensor, accept: torch.Tensor, slots: torch.Tensor,
                     counts: torch.Tensor) -> None:
    """Torch path of `count_tokens` (fixed shapes: masked entries add 0)."""
    _check_counts(tokens, accept, slots, counts)
    rows, n = tokens.shape
    if rows == 0:
        return
    v = counts.shape[1]
    t = tokens.to(torch.int64)
    on = (torch.arange(n, device=t.device)[None, :] < accept.to(torch.int64)[:, None])
    on = on & (t >= 0) & (t < v)
    flat = slots.to(torch.int64)[:, None] * v + t.clamp(0, v - 1)
    counts.view(-1).index_add_(0, flat.reshape(-1), on.reshape(-1).to(counts.dtype))
