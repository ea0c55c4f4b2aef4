"""Acceptance on device: greedy and sampled rows of one fixed-shape batch, stop cut included.

One program per row. A row carries N candidates `cand [rows, N]` (column 0 the last verified
token, 1.. the drafts) and the target scored each: `logits [rows * N, V]`, logits row
`r * N + j` predicting the token at absolute position `start + j` with
`start = seq_lens[r] - N + 1` (for a decode row: its committed length + 1; a prefill row has
N = 1: the token after its prompt).

Per row, with the row's slot `s = slots[r]` (0: an inert row: the dummy slot, a padded row,
a prefill chunk that is not the last; also inert when `done[s]`):
  1. target token t_j at each position j < N, from the slot's parameters:
     temperature[s] == 0: argmax (first index of the max);
     otherwise sample-then-compare: x = logits / T; keep x >= the top_k-th largest value
     (bisection, ITERS steps, only when 0 < top_k < V) and, when min_p[s] > 0, x >= max(x) +
     log(min_p) (min_p: p >= min_p * p_max, before top-p as vLLM orders them); softmax; keep
     p >= the top_p
     threshold (bisection on the largest tau with mass(p >= tau) >= top_p, only when
     top_p < 1); inverse-CDF draw over the kept mass with one uniform
     u = noise(seed[s], position start + j).
  2. accept a = 1 + leading matches cand[:, j + 1] == t_j (drafts are a point mass: accepting
     draft j + 1 with probability p_j(d) and emitting t_j at the first mismatch is exactly
     sampling the target token by token).
  3. stop cut: the first j < a where t_j is in the slot's stop table `stop_ids[s, :W]` (-1:
     unused entry) -> a = j + 1, finish 1 ("stop"); or where emitted[s] + j + 1 reaches
     max_new[s] -> a = j + 1, finish 2 ("length"). A stop token wins over the length limit
     at the same position (the host order: append, check stop, then length).
Two launches: `_token_kernel`, one program per (row, position) (step 1), then
`_accept_kernel`, one program per row (steps 2-3).
Writes tokens[r, :N] (t_j; 0 for inert rows), accept[r] (the cut a; 0 for inert rows),
draft_accept[r] (max(a, 1): what the drafter reads), finish[r] and err[r] (bit 1: a candidate
outside [0, V), replaced by 0 before the compare).

Noise: the 64-bit key `seed[s]` and the counter (position, SALT, 0, 0) as 32-bit words go
through Philox-4x32-10 (`tl.philox`, counter-based: no generator state, graph-safe); the top 24 bits
of the first output word give u = (r + 0.5) / 2^24, never 0 or 1. A row's draws depend only on
its seed and the absolute positions it samples: not on the batch, the padded size, chunking or
how many drafts were accepted. (A position re-sampled in a later cycle after a rejection
reuses its uniform; what was committed never depended on it, so the stream stays exact.)

`accept_ref` is the plain torch reference (its own Philox); the Triton kernel matches it
token for token except where float sums of the two orders round across a draw boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_tensor
from graphdraft.kernels.config import KernelConfig

__all__ = ["ERR_TOKEN", "FINISH_LENGTH", "FINISH_STOP", "SALT_TARGET", "accept_ref",
           "accept_tokens", "accept_tokens_ref", "philox4x32_ref", "philox_uniform_ref"]

SALT_TARGET = 1
"""Stage salt of the target's sampled tokens (high word of the Philox counter)."""
_SALT = tl.constexpr(SALT_TARGET)  # jit functions read globals only as constexpr
FINISH_STOP, FINISH_LENGTH = 1, 2
ERR_TOKEN = 1
"""Error bit: a candidate token id outside [0, V)."""
ITERS = 32
"""Bisection steps of the top-k / top-p thresholds (fixed: graph-safe, bounded cost)."""


@triton.jit
def live_slot(slots, done, r):
    """Row r's slot `slots[r]` and whether it is live (not the dummy slot 0, not done); a
    row that is not live reads slot 0's values (inert)."""
    s = tl.load(slots + r).to(tl.int64)
    live = s != 0
    if live:
        live = tl.load(done + s) == 0
    return tl.where(live, s, 0), live


@triton.jit
def _uniform(seed, pos):
    # explicit 32-bit counters (c0 = position's low word, c1 = salt): the same Philox-4x32
    # stream on every Triton version, whatever width randint gives a 64-bit offset
    c0 = pos.to(tl.int64).to(tl.uint32)
    zero = c0 * 0
    r, _, _, _ = tl.philox(seed, c0, zero + _SALT, zero, zero)
    r = r.to(tl.uint32, bitcast=True) >> 8
    return (r.to(tl.float32) + 0.5) * (1.0 / 16777216.0)


# N (tokens a row, k + 1) and the token rows' stride vary with the draft length k: not
# specialized (N == 1 at k = 0 would compile a variant per k; scalar loads / stores only).
@triton.jit(do_not_specialize=["stride_t", "N"],  # row views at any row offset: one variant
            do_not_specialize_on_alignment=["slots", "seq_lens", "tokens"])
def _token_kernel(logits, stride_l, slots, seq_lens, temperature, top_p, top_k, min_p, seed,
                  done, tokens, stride_t, N, V, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Program (r, j): the target token t_j of row r (step 1 of the module docstring)."""
    pid = tl.program_id(0)
    r = pid // N
    j = pid % N
    r64 = r.to(tl.int64)
    s, live = live_slot(slots, done, r)
    temp = tl.load(temperature + s).to(tl.float32)
    tp = tl.load(top_p + s).to(tl.float32)
    tk = tl.load(top_k + s).to(tl.int32)
    key = tl.load(seed + s).to(tl.int64)
    start = tl.load(seq_lens + r).to(tl.int64) - N + 1
    cols = tl.arange(0, BLOCK)
    row = logits + (r64 * N + j) * stride_l
    if temp == 0:
        best = -float("inf")
        bi = 0
        for c in range(0, V, BLOCK):
            x = tl.load(row + c + cols, mask=c + cols < V, other=-float("inf")).to(tl.float32)
            m = tl.max(x, 0)
            i = tl.argmax(x, 0)
            if m > best:
                best = m
                bi = c + i
        tok = bi
    else:
        inv = 1.0 / temp
        mx = -float("inf")
        mn = float("inf")
        for c in range(0, V, BLOCK):
            ok = c + cols < V
            x = tl.load(row + c + cols, mask=ok, other=0.0).to(tl.float32) * inv
            mx = tl.maximum(mx, tl.max(tl.where(ok, x, -float("inf")), 0))
            mn = tl.minimum(mn, tl.min(tl.where(ok, x, float("inf")), 0))
        thr = -float("inf")
        if tk > 0 and tk < V:  # largest lo with count(x >= lo) >= top_k
            lo = mn
            hi = mx
            for _ in range(ITERS):
                mid = (lo + hi) * 0.5
                cnt = 0
                for c in range(0, V, BLOCK):
                    ok = c + cols < V
                    x = tl.load(row + c + cols, mask=ok, other=0.0).to(tl.float32) * inv
                    cnt += tl.sum((ok & (x >= mid)).to(tl.int32), 0)
                if cnt >= tk:
                    lo = mid
                else:
                    hi = mid
            thr = lo
        mp = tl.load(min_p + s).to(tl.float32)
        if mp > 0:
            thr = tl.maximum(thr, mx + tl.log(mp))
        z = 0.0
        for c in range(0, V, BLOCK):
            ok = c + cols < V
            x = tl.load(row + c + cols, mask=ok, other=0.0).to(tl.float32) * inv
            z += tl.sum(tl.where(ok & (x >= thr), tl.exp(x - mx), 0.0), 0)
        ethr = 0.0
        if tp < 1.0:  # largest tau with mass(e >= tau) >= top_p * z (e = exp(x - max))
            lo = 0.0
            hi = 1.0
            goal = tp * z
            for _ in range(ITERS):
                mid = (lo + hi) * 0.5
                mass = 0.0
                for c in range(0, V, BLOCK):
                    ok = c + cols < V
                    x = tl.load(row + c + cols, mask=ok, other=0.0).to(tl.float32) * inv
                    e = tl.exp(x - mx)
                    mass += tl.sum(tl.where(ok & (x >= thr) & (e >= mid), e, 0.0), 0)
                if mass >= goal:
                    lo = mid
                else:
                    hi = mid
            ethr = lo
            z = 0.0
            for c in range(0, V, BLOCK):
                ok = c + cols < V
                x = tl.load(row + c + cols, mask=ok, other=0.0).to(tl.float32) * inv
                e = tl.exp(x - mx)
                z += tl.sum(tl.where(ok & (x >= thr) & (e >= ethr), e, 0.0), 0)
        target = _uniform(key, start + j) * z
        run = 0.0
        found = -1
        last = 0
        for c in range(0, V, BLOCK):
            ok = c + cols < V
            x = tl.load(row + c + cols, mask=ok, other=0.0).to(tl.float32) * inv
            e = tl.exp(x - mx)
            keep = ok & (x >= thr) & (e >= ethr)
            e = tl.where(keep, e, 0.0)
            cs = tl.cumsum(e, 0) + run
            hit = keep & (cs >= target)
            first = tl.min(tl.where(hit, cols, BLOCK), 0)
            if found < 0 and first < BLOCK:
                found = c + first
            lk = tl.max(tl.where(keep, cols, -1), 0)
            if lk >= 0:
                last = c + lk
            run += tl.sum(e, 0)
        tok = tl.where(found >= 0, found, last)
    tok = tl.where(live, tok, 0)
    tl.store(tokens + r64 * stride_t + j, tok.to(tokens.dtype.element_ty))


@triton.jit(do_not_specialize=["stride_t", "stride_c", "N"],  # per k, as _token_kernel
            do_not_specialize_on_alignment=["tokens", "cand", "slots", "accept", "draft_accept",
                                            "finish", "err"])
def _accept_kernel(tokens, stride_t, cand, stride_c, slots, stop_ids, max_new, emitted, done,
                   accept, draft_accept, finish, err, N, V, W, WP2: tl.constexpr):
    """Program r: accept, stop cut and error bit of row r (steps 2-3) from its tokens."""
    r = tl.program_id(0)
    r64 = r.to(tl.int64)
    s, live = live_slot(slots, done, r)
    em = tl.load(emitted + s).to(tl.int32)
    mnew = tl.load(max_new + s).to(tl.int32)
    acc = 1
    matching = 1
    fin = 0
    cut = 0
    for j in range(0, N):
        tok = tl.load(tokens + r64 * stride_t + j).to(tl.int64)
        if fin == 0 and matching == 1:  # j < accept: the stop cut over the accepted prefix
            w = tl.arange(0, WP2)
            st = tl.load(stop_ids + s * W + w, mask=w < W, other=-1).to(tl.int64)
            if tl.sum((st == tok).to(tl.int32), 0) > 0:
                fin = 1
                cut = j + 1
            elif em + j + 1 >= mnew:
                fin = 2
                cut = j + 1
        if j + 1 < N:
            d = tl.load(cand + r64 * stride_c + j + 1).to(tl.int64)
            bad = (d < 0) | (d >= V)
            if bad & live:
                tl.store(err + r, tl.load(err + r) | 1)
            d = tl.where(bad, 0, d)
            if matching == 1:
                if d == tok:
                    acc += 1
                else:
                    matching = 0
    if fin == 0:
        cut = acc
    cut = tl.where(live, cut, 0)
    fin = tl.where(live, fin, 0)
    tl.store(accept + r, cut.to(accept.dtype.element_ty))
    tl.store(draft_accept + r, tl.maximum(cut, 1).to(draft_accept.dtype.element_ty))
    tl.store(finish + r, fin.to(finish.dtype.element_ty))


def _check(logits, cand, slots, seq_lens, tokens, accept, draft_accept, finish, err, rows, n):
    expect_tensor("logits", logits, shape=("rows", "V"), layout="rows")
    if logits.shape[0] < rows * n:
        raise ValueError(f"logits: expected at least {rows * n} rows (rows * n), "
                         f"got {logits.shape[0]}")
    for name, t in (("cand", cand), ("tokens", tokens)):
        expect_tensor(name, t, shape=(rows, n), layout="rows")
    for name, t in (("slots", slots), ("seq_lens", seq_lens), ("accept", accept),
                    ("draft_accept", draft_accept), ("finish", finish), ("err", err)):
        expect_tensor(name, t, shape=(rows,), layout="contiguous")


def accept_tokens(logits: torch.Tensor, cand: torch.Tensor, slots: torch.Tensor,
                  seq_lens: torch.Tensor, state, *, tokens: torch.Tensor, accept: torch.Tensor,
                  draft_accept: torch.Tensor, finish: torch.Tensor, err: torch.Tensor,
                  kernels: KernelConfig | None = None) -> None:
    """Triton path (`graphdraft.ops.accept_tokens` chooses): the module docstring's writes for
    `rows = cand.shape[0]` rows. `state`: a `graphdraft.runtime.slot_state.SlotState`
    (temperature, top_p, top_k, min_p, seed, stop_ids, max_new, emitted, done per slot). `err`
    is ORed into, not overwritten. Graph-capturable. `kernels`: the launch settings (None: the default;
    these two launches read none)."""
    rows, n = cand.shape
    _check(logits, cand, slots, seq_lens, tokens, accept, draft_accept, finish, err, rows, n)
    if rows == 0:
        return
    v = logits.shape[1]
    w = state.stop_ids.shape[1]
    _token_kernel[(rows * n,)](
        logits, logits.stride(0), slots, seq_lens, state.temperature, state.top_p, state.top_k,
        state.min_p, state.seed, state.done, tokens, tokens.stride(0), n, v,
        BLOCK=min(4096, triton.next_power_of_2(v)), ITERS=ITERS, num_warps=8)
    _accept_kernel[(rows,)](
        tokens, tokens.stride(0), cand, cand.stride(0), slots, state.stop_ids, state.max_new,
        state.emitted, state.done, accept, draft_accept, finish, err, n, v, w,
        WP2=triton.next_power_of_2(w), num_warps=1)


def accept_tokens_ref(logits: torch.Tensor, cand: torch.Tensor, slots: torch.Tensor,
                      seq_lens: torch.Tensor, state, *, tokens: torch.Tensor, accept: torch.Tensor,
                      draft_accept: torch.Tensor, finish: torch.Tensor, err: torch.Tensor) -> None:
    """Torch path of `accept_tokens`: the same checks and writes (`accept_ref`)."""
    rows, n = cand.shape
    _check(logits, cand, slots, seq_lens, tokens, accept, draft_accept, finish, err, rows, n)
    if rows == 0:
        return
    accept_ref(logits, cand, slots, seq_lens, state, tokens=tokens, accept=accept,
               draft_accept=draft_accept, finish=finish, err=err)


# ----------------------------------------------------------------------------
# Torch reference
# ----------------------------------------------------------------------------
_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * b for a 32-bit constant a and int64 b in [0, 2^32)."""
    x = a * (b & 0xFFFF)           # < 2^48
    y = a * (b >> 16)              # < 2^48
    lo = (x + ((y & 0xFFFF) << 16)) & _M32
    hi = (y + (x >> 16)) >> 16
    return hi, lo


def philox4x32_ref(seed: int | torch.Tensor, counter: torch.Tensor, c1: int = 0
                   ) -> tuple[torch.Tensor, ...]:
    """Triton's `tl.randint4x(seed, counter)` (`tl.philox` with counter words (counter, c1, 0,
    0)) in int64 torch arithmetic: Philox-4x32-10 with key (seed lo, seed hi). `seed`: an int
    or an int64 tensor broadcasting against the int32 `counter`; returns four int64 tensors
    of 32-bit words, `counter`'s shape."""
    c0 = counter.to(torch.int64) & _M32
    c1, c2, c3 = torch.full_like(c0, c1 & _M32), torch.zeros_like(c0), torch.zeros_like(c0)
    if isinstance(seed, torch.Tensor):
        seed = seed.to(torch.int64)
        k0, k1 = (seed & _M32).expand_as(c0), ((seed >> 32) & _M32).expand_as(c0)
    else:
        k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def philox_uniform_ref(seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """`_uniform` in torch: Philox-4x32-10 of key `seed` (int64) and counter
    (`pos` low word, SALT_TARGET, 0, 0); fp32 (top 24 bits + 0.5) / 2^24."""
    c0 = philox4x32_ref(seed, pos, SALT_TARGET)[0]
    return ((c0 >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def _bisect(pred, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    for _ in range(ITERS):
        mid = (lo + hi) * 0.5
        ok = pred(mid)
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    return lo


def accept_ref(logits, cand, slots, seq_lens, state, *, tokens, accept, draft_accept, finish,
               err) -> None:
    """Torch reference of `_accept_kernel` (same writes, vectorised over rows and positions)."""
    rows, n = cand.shape
    v = logits.shape[1]
    dev = logits.device
    s = slots.to(torch.int64)
    live = (s != 0) & (state.done[s] == 0)
    s = torch.where(live, s, torch.zeros_like(s))
    x = logits[: rows * n].to(torch.float32).view(rows, n, v)
    temp = state.temperature[s].to(torch.float32)
    greedy = temp == 0
    xs = x / torch.where(greedy, torch.ones_like(temp), temp)[:, None, None]
    mx = xs.amax(-1, keepdim=True)
    mn = xs.amin(-1, keepdim=True)
    tk = state.top_k[s].to(torch.int64)[:, None, None]
    use_k = (tk > 0) & (tk < v)
    thr_k = _bisect(lambda m: (xs >= m).sum(-1, keepdim=True) >= tk, mn, mx)
    thr = torch.where(use_k, thr_k, torch.full_like(thr_k, -float("inf")))
    mp = state.min_p[s].to(torch.float32)[:, None, None]
    thr = torch.where(mp > 0, torch.maximum(thr, mx + torch.log(mp)), thr)
    e = torch.exp(xs - mx)
    kept = xs >= thr
    z = torch.where(kept, e, 0.0).sum(-1, keepdim=True)
    tp = state.top_p[s].to(torch.float32)[:, None, None]
    goal = tp * z
    ethr = _bisect(lambda m: torch.where(kept & (e >= m), e, 0.0).sum(-1, keepdim=True) >= goal,
                   torch.zeros_like(z), torch.ones_like(z))
    ethr = torch.where(tp < 1.0, ethr, torch.zeros_like(ethr))
    kept = kept & (e >= ethr)
    ek = torch.where(kept, e, 0.0)
    z = ek.sum(-1, keepdim=True)
    start = seq_lens.to(torch.int64) - n + 1
    pos = start[:, None] + torch.arange(n, device=dev)
    u = philox_uniform_ref(state.seed[s].to(torch.int64)[:, None], pos)
    cs = torch.cumsum(ek, -1)
    hit = kept & (cs >= (u[..., None] * z))
    idx = torch.arange(v, device=dev)
    found = torch.where(hit, idx, v).amin(-1)
    last = torch.where(kept, idx, -1).amax(-1)
    sampled = torch.where(found < v, found, last)
    tok = torch.where(greedy[:, None], torch.argmax(x, -1), sampled)
    tok = torch.where(live[:, None], tok, torch.zeros_like(tok))
    tokens.copy_(tok.to(tokens.dtype))
    d = cand[:, 1:].to(torch.int64)
    bad = (d < 0) | (d >= v)
    err |= ((bad.any(-1) & live).to(err.dtype) * 1)
    d = torch.where(bad, torch.zeros_like(d), d)
    match = (d == tok[:, :-1]).to(torch.int64)
    acc = torch.cumprod(match, 1).sum(1) + 1
    # stop cut
    stop = (tok[:, :, None] == state.stop_ids[s].to(torch.int64)[:, None, :]).any(-1)
    j = torch.arange(n, device=dev)
    length = (state.emitted[s].to(torch.int64)[:, None] + j + 1) >= state.max_new[s].to(torch.int64)[:, None]
    within = j[None, :] < acc[:, None]
    hit_stop = stop & within
    hit_len = length & within
    first = torch.where(hit_stop | hit_len, j, n).amin(1)
    any_hit = first < n
    fj = first.clamp(max=n - 1)
    is_stop = hit_stop.gather(1, fj[:, None]).squeeze(1)
    cut = torch.where(any_hit, first + 1, acc)
    fin = torch.where(any_hit, torch.where(is_stop, FINISH_STOP, FINISH_LENGTH), 0)
    cut = torch.where(live, cut, 0)
    fin = torch.where(live, fin, 0)
    accept.copy_(cut.to(accept.dtype))
    draft_accept.copy_(cut.clamp(min=1).to(draft_accept.dtype))
    finish.copy_(fin.to(finish.dtype))
