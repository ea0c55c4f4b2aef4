"""One beam level of tree drafting (`graphdraft.runtime.beams`) in one launch.

The beams' bookkeeping of a level, per request row r of `B` (k beams, K levels, `M = k +
(K-1)*k*k` candidates; `BeamState` names the tables and their shapes):

Step j = 0 (the first draft step, `logits [B, Vd]`, one row per request):
    lp = log_softmax(logits[r] / T_r) (fp32; T_r = temperature[r] where > 0, else 1; no
    temperature: the logits as they are); (s, idx) = the k best of lp, best first
    beam_tok[r] = tok = hot[idx], beam_score[r] = s, beam_cand[r] = 0..k-1, parent_beam[r] = 0
    cand_score / cand_tok / cand_parent[r, :k] = s, tok, -1
    K > 1: anc[r, b, 0] = scratch(r, b, 1)
    and optionally the beam steps' inputs: `hid_dst[r*k + b] = hid_src[r]`, the window
    `window[r*k + b] = (tok[b], -1, ...)`, `setup`: beam_req[r*k + b] = req[r],
    beam_lens[r*k + b] = prefix[r] (k > 1), step_pos[i, r*k + b] = prefix[r] + i (i < K-1).
Step j = 1..K-1 (`logits [B*k, Vd]`, row r*k + b = beam b of row r):
    (lp, ct) = the k best of each beam's log_softmax; cum[b, c] = beam_score[r, b] + lp[b, c]
    cand_* at off + b*k + c, off = k + (j-1)*k*k: (cum, hot[ct], beam_cand[r, b]);
    and when j < K-1 (a forward follows): sel = the k best of cum (flat b*k + c),
    parent_beam = sel // k, beam_tok / beam_score = the candidates at off + sel,
    beam_cand = off + sel, anc[r, b, :j] = anc_old[r, pb[b], :j], anc[r, b, j] =
    scratch(r, b, j + 1), optionally `hid_dst[r*k + b] = hid_src[r*k + pb[b]]` and
    `window[r*k + b, :j] = window_old[r*k + pb[b], :j]`, `window[r*k + b, j]` = its token.
    scratch(r, b, j) = scratch_base + (r*k + b)*(K-1) + j - 1.

"The k best": higher first, equal values the lower index first, NaN as -inf, -0.0 equal to
0.0 (`kernels.tree_build.score_key`'s order; `best_k`). With k = 1 the token is the chain's
selection (argmax of the raw logits, `kernels.argmax`) or the caller's `greedy_ids`: only
the torch path serves k = 1.

`beam_first_ref` / `beam_decode_ref` are the torch formulation (the torch path). The Triton
kernel (`beam_first` / `beam_decode`, one program per request row, k >= 2) computes the same
selection rule over its own log-softmax: the same tokens and tables, the scores equal up to
the last bits of the log-softmax sum (its summation order and exp / log), so ranking ties
created by that rounding may resolve apart. Fixed shapes, host checks only: graph-capturable.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from graphdraft.checks import INDEX_DTYPES, expect_int, expect_tensor
from graphdraft.kernels.argmax import argmax_with_map_ref
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.tree_build import TreeShape

__all__ = ["BeamState", "SORT_MAX", "beam_decode", "beam_decode_ref", "beam_first",
           "beam_first_ref", "best_k", "rank_scale"]

_LOW31 = 0x7FFFFFFF
SORT_MAX = 64
"""`best_k` ranks rows this wide or narrower with one stable sort (the beams' re-rank over
k*k candidates), wider ones with `topk` of an int64 key (a draft vocab row)."""


@dataclass
class BeamState:
    """Beams and candidate store of `B` rows (`runtime.beams` re-exports it; shapes:
    `graphdraft.runtime.tree` table): beam_tok [B, k] int64 (target ids), beam_score [B, k]
    float32, beam_cand / parent_beam [B, k] int64, anc [B, k, max(K-1, 1)] int64,
    cand_score [B, M] float32, cand_tok / cand_parent [B, M] int64 (each contiguous)."""

    beam_tok: torch.Tensor
    beam_score: torch.Tensor
    beam_cand: torch.Tensor
    parent_beam: torch.Tensor
    anc: torch.Tensor
    cand_score: torch.Tensor
    cand_tok: torch.Tensor
    cand_parent: torch.Tensor

    @classmethod
    def allocate(cls, shape: TreeShape, bs: int, device: str | torch.device) -> BeamState:
        """Zeroed buffers for `bs` rows (allocate once for the largest `B`, then `rows(B)`)."""
        k, m = shape.topk, shape.M
        i64 = dict(dtype=torch.int64, device=device)
        return cls(beam_tok=torch.zeros(bs, k, **i64),
                   beam_score=torch.zeros(bs, k, dtype=torch.float32, device=device),
                   beam_cand=torch.zeros(bs, k, **i64), parent_beam=torch.zeros(bs, k, **i64),
                   anc=torch.zeros(bs, k, max(shape.steps - 1, 1), **i64),
                   cand_score=torch.zeros(bs, m, dtype=torch.float32, device=device),
                   cand_tok=torch.zeros(bs, m, **i64), cand_parent=torch.zeros(bs, m, **i64))

    def rows(self, bs: int) -> BeamState:
        """Views of the first `bs` rows (the buffers a graph of padded size `bs` uses)."""
        return BeamState(**{f.name: getattr(self, f.name)[:bs] for f in fields(self)})


# --- torch path ---------------------------------------------------------------------------

def best_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices `[R, k]` int64 of the k best of each row of `scores [R, W]` (float), best first,
    in `score_key`'s order exactly (higher first, equal scores the lower index first, -0.0
    equal to 0.0, NaN as -inf), as `torch.topk(score_key(scores), k).indices` but in fewer
    kernels: rows of `W <= SORT_MAX` by one stable descending sort (its tie rule is that
    order), wider rows by `topk` of the same int64 key built in 7 ops instead of 12."""
    s = torch.nan_to_num(scores.float(), nan=float("-inf"), posinf=float("inf"),
                         neginf=float("-inf")).add_(0.0)          # NaN -> -inf, -0.0 -> +0.0
    w = s.shape[-1]
    if w <= SORT_MAX:
        return torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]
    bits = s.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ _LOW31, bits)             # order-preserving int
    low = torch.arange(w - 1, -1, -1, device=s.device, dtype=torch.int64)
    return torch.topk(torch.add(low, ordered, alpha=1 << 32), k, dim=-1).indices


def rank_scale(temperature: torch.Tensor | None, rows: int, per: int) -> torch.Tensor | None:
    """`[rows, 1]` divisor of the logits: the request's temperature where it samples (> 0), 1
    for greedy rows; `temperature [rows // per]` (per request; `per` rows each). None: None."""
    if temperature is None:
        return None
    expect_tensor("temperature", temperature, shape=(rows // per,))
    t = temperature.float()
    t = torch.where(t > 0, t, torch.ones_like(t))
    return (t.repeat_interleave(per) if per > 1 else t).unsqueeze(1)


def _top(k: int, logits: torch.Tensor, scale: torch.Tensor | None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `logits [R, Vd]` -> (log-prob `[R, k]` fp32, draft index `[R, k]` int64) of the
    k best, best first (k = 1: the chain's argmax of the raw logits)."""
    x = logits.float()
    lp = torch.log_softmax(x if scale is None else x / scale, dim=-1)
    idx = argmax_with_map_ref(logits).unsqueeze(1) if k == 1 else best_k(lp, k)
    return lp.gather(1, idx), idx


def _pick(k: int, logits: torch.Tensor, hot: torch.Tensor | None, greedy_ids, temperature,
          per: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores `[R, k]`, target ids `[R, k]`) of each row's k best (module doc)."""
    if greedy_ids is not None:  # k = 1, the head's own ids: the row max of the log-probs
        if k != 1:
            raise ValueError(f"greedy_ids: expected only with speculative_eagle_topk=1, got "
                             f"topk={k}")
        expect_tensor("greedy_ids", greedy_ids, shape=(logits.shape[0],))
        lp = torch.log_softmax(logits.float(), dim=-1)
        return lp.amax(dim=-1, keepdim=True), greedy_ids.to(torch.int64).unsqueeze(1)
    s, idx = _top(k, logits, rank_scale(temperature, logits.shape[0], per))
    return s, (idx if hot is None else hot[idx].to(torch.int64))


def _scratch(shape, scratch, base: int, bs: int, j: int, device) -> torch.Tensor:
    """`[bs, k]` scratch slots of step j's queries (from the precomputed table when given)."""
    k = shape.topk
    if scratch is not None:
        if scratch.dim() != 2 or scratch.shape[1] < bs * k or scratch.shape[0] < j:
            raise ValueError(f"scratch: expected a scratch table of >= {bs} rows and "
                             f"{shape.steps - 1} levels, got {tuple(scratch.shape)}")
        return scratch[j - 1, : bs * k].view(bs, k)
    rows = torch.arange(bs, device=device).unsqueeze(1)
    beams = torch.arange(k, device=device).unsqueeze(0)
    return base + (rows * k + beams) * (shape.steps - 1) + (j - 1)


def _setup_ref(shape, setup, bs: int) -> None:
    req, prefix, beam_req, beam_lens, step_pos = setup
    k, lv = shape.topk, shape.steps - 1
    beam_req[: bs * k].view(bs, k).copy_(req.long().unsqueeze(1).expand(bs, k))
    ld = prefix.long()
    if k > 1:
        beam_lens[: bs * k].view(bs, k).copy_(ld.unsqueeze(1).expand(bs, k))
    off = torch.arange(lv, device=ld.device, dtype=torch.int64)
    torch.add(ld.view(1, bs, 1).expand(lv, bs, k), off.view(lv, 1, 1),
              out=step_pos[:lv, : bs * k].view(lv, bs, k))


def beam_first_ref(shape, logits: torch.Tensor, st: BeamState, *,
                   hot: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                   greedy_ids: torch.Tensor | None = None, scratch_base: int = 0,
                   scratch: torch.Tensor | None = None, hid_src: torch.Tensor | None = None,
                   hid_dst: torch.Tensor | None = None, window: torch.Tensor | None = None,
                   setup: tuple | None = None) -> None:
    """Torch version of step j = 0 (module doc). `scratch`: the slots table `[K-1, >= B*k]`
    (None: computed); `hid_src [B, H]` / `hid_dst [B*k, H]`; `window [B*k, K-1]` int32;
    `setup` = (req [B], prefix [B], beam_req [B*k] int64, beam_lens [B*k] int32,
    step_pos [K-1, >= B*k] int64)."""
    bs, k = st.beam_tok.shape
    s, tok = _pick(k, logits, hot, greedy_ids, temperature, 1)
    st.beam_tok.copy_(tok)
    st.beam_score.copy_(s)
    st.beam_cand.copy_(torch.arange(k, device=logits.device).expand(bs, k))
    st.parent_beam.zero_()
    st.cand_score[:, :k].copy_(s)
    st.cand_tok[:, :k].copy_(tok)
    st.cand_parent[:, :k].fill_(-1)
    if shape.steps > 1:
        st.anc[:, :, 0].copy_(_scratch(shape, scratch, scratch_base, bs, 1, logits.device))
    if window is not None:
        window.fill_(-1)
        window[:, 0].copy_(st.beam_tok.reshape(bs * k))
    if hid_src is not None:
        hid_dst.view(bs, k, -1).copy_(hid_src.unsqueeze(1).expand(bs, k, hid_src.shape[1]))
    if setup is not None:
        _setup_ref(shape, setup, bs)


def beam_decode_ref(shape, j: int, logits: torch.Tensor, st: BeamState, *,
                    hot: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                    greedy_ids: torch.Tensor | None = None, scratch_base: int = 0,
                    scratch: torch.Tensor | None = None, hid_src: torch.Tensor | None = None,
                    hid_dst: torch.Tensor | None = None,
                    window: torch.Tensor | None = None) -> None:
    """Torch version of step j in 1..K-1 (module doc): `hid_src` / `hid_dst` `[B*k, H]`
    (apart), `window [B*k, K-1]` int32; the rest as `beam_first_ref`."""
    bs, k = st.beam_tok.shape
    lp, tok = _pick(k, logits, hot, greedy_ids, temperature, k)       # [B*k, k] each
    off, kk = k + (j - 1) * k * k, k * k
    # the level's candidates straight into the store (views of its columns: no staging copy)
    flat = st.cand_score[:, off:off + kk]                           # cum: [B, k*k]
    torch.add(st.beam_score.unsqueeze(2), lp.view(bs, k, k), out=flat.view(bs, k, k))
    cand_tok = st.cand_tok[:, off:off + kk]
    cand_tok.view(bs, k, k).copy_(tok.view(bs, k, k))  # tok [B*k, k] may be a strided view
    st.cand_parent[:, off:off + kk].view(bs, k, k).copy_(
        st.beam_cand.unsqueeze(2).expand(bs, k, k))
    if j == shape.steps - 1:
        return  # the last level: no forward follows, no re-rank
    if k == 1:
        sel = torch.zeros(bs, 1, dtype=torch.int64, device=logits.device)
    else:
        sel = best_k(flat, k)                                       # [B, k], best first
    pb = torch.floor_divide(sel, k, out=st.parent_beam)
    torch.gather(cand_tok, 1, sel, out=st.beam_tok)
    torch.gather(flat, 1, sel, out=st.beam_score)
    torch.add(sel, off, out=st.beam_cand)
    kept = st.anc[:, :, :j].gather(1, pb.unsqueeze(2).expand(bs, k, j))
    st.anc[:, :, :j].copy_(kept)
    st.anc[:, :, j].copy_(_scratch(shape, scratch, scratch_base, bs, j + 1, logits.device))
    if hid_src is not None:
        h = hid_src.shape[1]
        torch.gather(hid_src.view(bs, k, h), 1, pb.unsqueeze(2).expand(bs, k, h),
                     out=hid_dst.view(bs, k, h))
    if window is not None:
        w = window.view(bs, k, -1)
        kept = w[:, :, :j].gather(1, pb.unsqueeze(2).expand(bs, k, j))
        w[:, :, :j].copy_(kept)
        w[:, :, j].copy_(st.beam_tok)


# --- Triton -------------------------------------------------------------------------------

@triton.jit
def _scaled(row_ptr, i, V, t, HAS_T: tl.constexpr):
    """fp32 logits `row[i] / t` (masked lanes: -inf)."""
    x = tl.load(row_ptr + i, mask=i < V, other=float("-inf")).to(tl.float32)
    if HAS_T:
        x = x / t
    return x


@triton.jit
def _log_norm(row_ptr, V, t, HAS_T: tl.constexpr, VB: tl.constexpr):
    """(max, log of the sum of exp(x - max)) of one row: log_softmax = (x - max) - lse."""
    offs = tl.arange(0, VB)
    mx = tl.full([VB], float("-inf"), tl.float32)
    for c in range(0, V, VB):
        mx = tl.maximum(mx, _scaled(row_ptr, c + offs, V, t, HAS_T))
    m = tl.max(mx, axis=0)
    acc = tl.zeros([VB], dtype=tl.float32)
    for c in range(0, V, VB):
        i = c + offs
        e = tl.exp(_scaled(row_ptr, i, V, t, HAS_T) - m)
        acc += tl.where(i < V, e, 0.0)
    return m, tl.log(tl.sum(acc, axis=0))


@triton.jit
def _next_best(row_ptr, V, t, m, lse, pv, pi, ANY: tl.constexpr, HAS_T: tl.constexpr,
               VB: tl.constexpr):
    """(key, index) of the best element of the row's log-softmax after (pv, pi) in the order
    (key descending, index ascending), key = the log-prob with NaN as -inf; ANY: the best."""
    offs = tl.arange(0, VB)
    bv = tl.full([VB], float("-inf"), tl.float32)      # each lane's best so far
    bi = tl.zeros([VB], dtype=tl.int32) + V             # V: none yet
    for c in range(0, V, VB):
        i = c + offs
        lp = (_scaled(row_ptr, i, V, t, HAS_T) - m) - lse
        key = tl.where(lp != lp, float("-inf"), lp)
        ok = i < V
        if not ANY:
            ok = ok & ((key < pv) | ((key == pv) & (i > pi)))
        take = ok & ((key > bv) | (bi == V))             # a lane's later index loses ties
        bv = tl.where(take, key, bv)
        bi = tl.where(take, i, bi)
    v = tl.max(bv, axis=0)
    return v, tl.min(tl.where((bv == v) & (bi < V), bi, V), axis=0)


@triton.jit
def _beam_row(lg_ptr, row, stride_lg, V, t, hot_ptr, old_score, old_cand, cs_ptr, ct_ptr,
              cp_ptr, base, K: tl.constexpr, HAS_OLD: tl.constexpr, HAS_T: tl.constexpr,
              HAS_HOT: tl.constexpr, VB: tl.constexpr):
    """The k best of one logits row into the candidate store at `base + c` (c < k):
    (old_score + lp (HAS_OLD; else lp), hot[idx], old_cand); the caller re-reads the store."""
    row_ptr = lg_ptr + row * stride_lg
    m, lse = _log_norm(row_ptr, V, t, HAS_T, VB)
    pv = m
    pi = V
    for c in tl.static_range(K):
        if c == 0:
            v, i = _next_best(row_ptr, V, t, m, lse, pv, pi, True, HAS_T, VB)
        else:
            v, i = _next_best(row_ptr, V, t, m, lse, pv, pi, False, HAS_T, VB)
        pv = v
        pi = i
        x = tl.load(row_ptr + i).to(tl.float32)
        if HAS_T:
            x = x / t
        lp = (x - m) - lse
        if HAS_HOT:
            tok = tl.load(hot_ptr + i).to(tl.int64)
        else:
            tok = i.to(tl.int64)
        if HAS_OLD:
            lp = old_score + lp
        tl.store(cs_ptr + base + c, lp)
        tl.store(ct_ptr + base + c, tok)
        tl.store(cp_ptr + base + c, old_cand)


@triton.jit
def _copy_row(src_ptr, dst_ptr, H, HB: tl.constexpr):
    h = tl.arange(0, HB)
    for c in range(0, H, HB):
        x = tl.load(src_ptr + c + h, mask=c + h < H)
        tl.store(dst_ptr + c + h, x, mask=c + h < H)


@triton.jit
def _first_kernel(lg_ptr, stride_lg, V, temp_ptr, hot_ptr, tok_ptr, score_ptr, cand_ptr,
                  par_ptr, anc_ptr, W, cs_ptr, ct_ptr, cp_ptr, M, LV, scratch_base,
                  hs_ptr, stride_hs, hd_ptr, stride_hd, H, win_ptr, WW,
                  req_ptr, pre_ptr, breq_ptr, blen_ptr, spos_ptr, stride_sp,
                  K: tl.constexpr, HAS_T: tl.constexpr, HAS_HOT: tl.constexpr,
                  HAS_HID: tl.constexpr, HAS_WIN: tl.constexpr, HAS_SETUP: tl.constexpr,
                  VB: tl.constexpr, HB: tl.constexpr, WB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t = 1.0
    if HAS_T:
        t = tl.load(temp_ptr + r).to(tl.float32)
        t = tl.where(t > 0, t, 1.0)
    _beam_row(lg_ptr, r, stride_lg, V, t, hot_ptr, 0.0, r * 0 - 1, cs_ptr + r * M,
              ct_ptr + r * M, cp_ptr + r * M, 0, K, False, HAS_T, HAS_HOT, VB)
    tl.debug_barrier()                                   # the store written above, read back
    w = tl.arange(0, WB)
    for b in tl.static_range(K):
        q = r * K + b
        tok = tl.load(ct_ptr + r * M + b)
        tl.store(tok_ptr + q, tok)
        tl.store(score_ptr + q, tl.load(cs_ptr + r * M + b))
        tl.store(cand_ptr + q, b + 0 * r)
        tl.store(par_ptr + q, 0 * r)
        if LV > 0:
            tl.store(anc_ptr + q * W, scratch_base + q * LV)
        if HAS_WIN:
            tl.store(win_ptr + q * WW + w, tl.where(w == 0, tok, -1).to(tl.int32), mask=w < WW)
        if HAS_HID:
            _copy_row(hs_ptr + r * stride_hs, hd_ptr + q * stride_hd, H, HB)
        if HAS_SETUP:
            pre = tl.load(pre_ptr + r).to(tl.int64)
            tl.store(breq_ptr + q, tl.load(req_ptr + r).to(tl.int64))
            tl.store(blen_ptr + q, pre.to(tl.int32))
            tl.store(spos_ptr + w * stride_sp + q, pre + w, mask=w < LV)


@triton.jit(do_not_specialize=["off", "j"])  # one compiled variant for every level
def _decode_kernel(lg_ptr, stride_lg, V, temp_ptr, hot_ptr, tok_ptr, score_ptr, cand_ptr,
                   par_ptr, anc_ptr, W, cs_ptr, ct_ptr, cp_ptr, M, off, j, LV, scratch_base,
                   hs_ptr, stride_hs, hd_ptr, stride_hd, H, win_ptr, WW,
                   K: tl.constexpr, KKB: tl.constexpr, RERANK: tl.constexpr,
                   HAS_T: tl.constexpr, HAS_HOT: tl.constexpr, HAS_HID: tl.constexpr,
                   HAS_WIN: tl.constexpr, VB: tl.constexpr, HB: tl.constexpr,
                   WB: tl.constexpr, KB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    kb = tl.arange(0, KB)
    w = tl.arange(0, WB)
    blk = (kb[:, None] < K) & (w[None, :] < j)
    old_anc = tl.load(anc_ptr + (r * K + kb[:, None]) * W + w[None, :], mask=blk, other=0)
    if HAS_WIN:
        old_win = tl.load(win_ptr + (r * K + kb[:, None]) * WW + w[None, :], mask=blk, other=0)
    else:
        old_win = old_anc
    t = 1.0
    if HAS_T:
        t = tl.load(temp_ptr + r).to(tl.float32)
        t = tl.where(t > 0, t, 1.0)
    for b in tl.static_range(K):
        _beam_row(lg_ptr, r * K + b, stride_lg, V, t, hot_ptr, tl.load(score_ptr + r * K + b),
                  tl.load(cand_ptr + r * K + b), cs_ptr + r * M, ct_ptr + r * M, cp_ptr + r * M,
                  off + b * K, K, True, HAS_T, HAS_HOT, VB)
    if RERANK:
        tl.debug_barrier()                               # old tables read, the store written
        _rerank(r, kb, w, old_anc, old_win, tok_ptr, score_ptr, cand_ptr, par_ptr, anc_ptr, W,
                cs_ptr + r * M, ct_ptr + r * M, off, j, LV, scratch_base, hs_ptr, stride_hs,
                hd_ptr, stride_hd, H, win_ptr, WW, K, KKB, HAS_HID, HAS_WIN, HB)


@triton.jit
def _rerank(r, kb, w, old_anc, old_win, tok_ptr, score_ptr, cand_ptr, par_ptr, anc_ptr, W,
            cs_ptr, ct_ptr, off, j, LV, scratch_base, hs_ptr, stride_hs, hd_ptr, stride_hd, H,
            win_ptr, WW, K: tl.constexpr, KKB: tl.constexpr, HAS_HID: tl.constexpr,
            HAS_WIN: tl.constexpr, HB: tl.constexpr):
    """The k best of the level's k*k candidates become the beams (module doc)."""
    f = tl.arange(0, KKB)
    g = tl.arange(0, KKB)
    v = tl.load(cs_ptr + off + f, mask=f < K * K, other=float("-inf"))
    key = tl.where(v != v, float("-inf"), v)
    kg = tl.load(cs_ptr + off + g, mask=g < K * K, other=float("-inf"))
    kg = tl.where(kg != kg, float("-inf"), kg)
    # rank of candidate f: how many candidates g come before it (higher, or equal and lower)
    before = (kg[None, :] > key[:, None]) | ((kg[None, :] == key[:, None]) & (g[None, :] < f[:, None]))
    rank = tl.sum((before & (g[None, :] < K * K)).to(tl.int32), axis=1)
    rank = tl.where(f < K * K, rank, KKB)
    for nb in tl.static_range(K):
        sel = tl.sum(tl.where(rank == nb, f, 0), axis=0).to(tl.int64)
        pb = sel // K
        q = r * K + nb
        tok = tl.load(ct_ptr + off + sel)
        tl.store(tok_ptr + q, tok)
        tl.store(score_ptr + q, tl.load(cs_ptr + off + sel))
        tl.store(cand_ptr + q, off + sel)
        tl.store(par_ptr + q, pb)
        a = tl.sum(tl.where(kb[:, None] == pb, old_anc, 0), axis=0)
        a = tl.where(w == j, scratch_base + q * LV + j, a)
        tl.store(anc_ptr + q * W + w, a, mask=w <= j)
        if HAS_HID:
            _copy_row(hs_ptr + (r * K + pb) * stride_hs, hd_ptr + q * stride_hd, H, HB)
        if HAS_WIN:
            x = tl.sum(tl.where(kb[:, None] == pb, old_win, 0), axis=0)
            x = tl.where(w == j, tok.to(tl.int32), x.to(tl.int32))
            tl.store(win_ptr + q * WW + w, x, mask=w <= j)


# --- launch wrappers ------------------------------------------------------------------------

_TABLES = {"beam_tok": torch.int64, "beam_score": torch.float32, "beam_cand": torch.int64,
           "parent_beam": torch.int64, "anc": torch.int64, "cand_score": torch.float32,
           "cand_tok": torch.int64, "cand_parent": torch.int64}


def _check(shape, st: BeamState, logits: torch.Tensor, per: int, hot, temperature,
           hid_src, hid_dst, src_rows: int, window) -> tuple[int, int]:
    """Metadata checks of both wrappers -> (B, k)."""
    expect_tensor("beam_tok", st.beam_tok, shape=("B", shape.topk))
    bs, k = st.beam_tok.shape
    if k < 2:
        raise ValueError(f"speculative_eagle_topk: expected >= 2 on the Triton path, got {k}")
    dev, w = logits.device, max(shape.steps - 1, 1)
    want = {"anc": (bs, k, w), "cand_score": (bs, shape.M), "cand_tok": (bs, shape.M),
            "cand_parent": (bs, shape.M)}
    for name, dt in _TABLES.items():
        expect_tensor(name, getattr(st, name), shape=want.get(name, (bs, k)), dtypes=dt,
                      device=dev, layout="contiguous")
    expect_tensor("logits", logits, shape=(bs * per, "Vd"),
                  dtypes=(torch.float32, torch.float16, torch.bfloat16), layout="rows")
    if k > logits.shape[1]:
        raise ValueError(f"speculative_eagle_topk: expected <= the draft vocab "
                         f"{logits.shape[1]}, got {k}")
    if hot is not None:
        expect_tensor("hot_token_ids", hot, shape=(logits.shape[1],), dtypes=INDEX_DTYPES,
                      device=dev, layout="contiguous")
    if temperature is not None:
        expect_tensor("temperature", temperature, shape=(bs,), device=dev, layout="contiguous")
    if (hid_src is None) != (hid_dst is None):
        raise ValueError("hid_src, hid_dst: expected both or neither")
    if hid_src is not None:
        expect_tensor("hid_src", hid_src, shape=(src_rows, "H"), device=dev, layout="rows")
        expect_tensor("hid_dst", hid_dst, shape=(bs * k, hid_src.shape[1]), dtypes=hid_src.dtype,
                      device=dev, layout="rows")
        if hid_src.data_ptr() == hid_dst.data_ptr():
            raise ValueError("hid_dst: expected a buffer apart from hid_src")
    if window is not None:
        expect_tensor("window", window, shape=(bs * k, w), dtypes=torch.int32, device=dev,
                      layout="contiguous")
    return bs, k


def _common(shape, st, logits, hot, temperature, hid_src, hid_dst, window, block: int):
    """The launch arguments both kernels share (dummies for absent optional tensors)."""
    v = logits.shape[1]
    vb = min(triton.next_power_of_2(v), triton.next_power_of_2(expect_int("block", block, 1)))
    hid = hid_src is not None
    h = hid_src.shape[1] if hid else 1
    args = [logits, logits.stride(0), v,
            temperature if temperature is not None else st.beam_score,
            hot if hot is not None else st.beam_tok,
            st.beam_tok, st.beam_score, st.beam_cand, st.parent_beam, st.anc, st.anc.shape[2],
            st.cand_score, st.cand_tok, st.cand_parent, shape.M]
    hid_args = [hid_src if hid else st.beam_score, hid_src.stride(0) if hid else 0,
                hid_dst if hid else st.beam_score, hid_dst.stride(0) if hid else 0, h,
                window if window is not None else st.anc, st.anc.shape[2]]
    meta = dict(K=shape.topk, HAS_T=temperature is not None, HAS_HOT=hot is not None,
                HAS_HID=hid, HAS_WIN=window is not None, VB=vb,
                HB=min(triton.next_power_of_2(h), 1024),
                WB=triton.next_power_of_2(st.anc.shape[2]), num_warps=8 if vb >= 4096 else 4)
    return args, hid_args, meta


def beam_first(shape, logits: torch.Tensor, st: BeamState, *,
               hot: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
               scratch_base: int = 0, scratch: torch.Tensor | None = None,
               hid_src: torch.Tensor | None = None, hid_dst: torch.Tensor | None = None,
               window: torch.Tensor | None = None, setup: tuple | None = None,
               block: int = 8192, kernels: KernelConfig | None = None) -> None:
    """Triton version of `beam_first_ref` (k >= 2; one program per row; `block`: the vocab
    chunk, default a whole 8192-wide row: its later passes then read it from L1). `scratch`
    is not read: the kernel computes the table's slots from `scratch_base`.
    `kernels`: the launch settings (None: the default; this launch reads none)."""
    bs, k = _check(shape, st, logits, 1, hot, temperature, hid_src, hid_dst, st.beam_tok.shape[0],
                   window)
    expect_int("scratch_base", scratch_base, 0)
    lv, dev = shape.steps - 1, logits.device
    if setup is not None:
        req, prefix, beam_req, beam_lens, step_pos = setup
        for name, t in (("req", req), ("prefix", prefix)):
            expect_tensor(name, t, shape=(bs,), dtypes=INDEX_DTYPES, device=dev)
        expect_tensor("beam_req", beam_req, shape=(bs * k,), dtypes=torch.int64, device=dev,
                      layout="contiguous")
        expect_tensor("beam_lens", beam_lens, shape=(bs * k,), dtypes=torch.int32, device=dev,
                      layout="contiguous")
        expect_tensor("step_pos", step_pos, shape=("levels", "rows"), dtypes=torch.int64,
                      device=dev, layout="rows")
        if step_pos.shape[0] < lv or step_pos.shape[1] < bs * k:
            raise ValueError(f"step_pos: expected >= [{lv}, {bs * k}], got {tuple(step_pos.shape)}")
        sargs = [req, prefix, beam_req, beam_lens, step_pos, step_pos.stride(0)]
    else:
        sargs = [st.beam_tok, st.beam_tok, st.beam_tok, st.beam_tok, st.beam_tok, 0]
    if bs == 0:
        return
    args, hid_args, meta = _common(shape, st, logits, hot, temperature, hid_src, hid_dst,
                                   window, block)
    _first_kernel[(bs,)](*args, lv, scratch_base, *hid_args, *sargs, HAS_SETUP=setup is not None,
                         **meta)


def beam_decode(shape, j: int, logits: torch.Tensor, st: BeamState, *,
                hot: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                scratch_base: int = 0, scratch: torch.Tensor | None = None,
                hid_src: torch.Tensor | None = None, hid_dst: torch.Tensor | None = None,
                window: torch.Tensor | None = None, block: int = 8192,
                kernels: KernelConfig | None = None) -> None:
    """Triton version of `beam_decode_ref` (k >= 2; one program per row; `block`: the vocab
    chunk; `scratch` not read, as `beam_first`)."""
    expect_int("j", j, 1, shape.steps - 1)
    bs, k = _check(shape, st, logits, st.beam_tok.shape[1], hot, temperature, hid_src, hid_dst,
                   logits.shape[0], window)
    expect_int("scratch_base", scratch_base, 0)
    if bs == 0:
        return
    args, hid_args, meta = _common(shape, st, logits, hot, temperature, hid_src, hid_dst,
                                   window, block)
    _decode_kernel[(bs,)](*args, k + (j - 1) * k * k, j, shape.steps - 1, scratch_base,
                          *hid_args, KKB=triton.next_power_of_2(k * k),
                          RERANK=j < shape.steps - 1, KB=triton.next_power_of_2(k), **meta)
