"""Top-k beam bookkeeping of tree drafting, in fixed-shape torch.

Per draft level the drafter hands over its log-its; this module keeps the `k` beams of every
row, their cumulative log-probabilities, the candidate store the tree is built from, and the
ancestor table the draft attention reads. Every tensor has a shape fixed by `(B, k, K)`: no
host sync, no boolean indexing, no data-dependent shape, so the same code runs eagerly and
inside a captured CUDA graph.

Level 1 (`first_step`, logits `[B, Vd]` of the first draft step's LM-head rows):
    lp = log_softmax(logits) (fp32); (s, idx) = the k best of lp
    beam_tok = hot[idx], beam_score = s, beam_cand = 0..k-1
    cand_*[:, :k] = (s, hot[idx], -1);  anc[:, b, 0] = scratch(r, b, 1)
Decode level j = 1..K-1 (`decode_step`, logits `[B*k, Vd]`, one row per beam, row r*k + b):
    lp, ct = the k best of each beam's log_softmax              [B, k, k]
    cum = beam_score[:, :, None] + lp                           [B, k, k]
    cand_* at flat offset k + (j-1)*k*k + b*k + c = (cum, hot[ct], beam_cand[b])
    and, when j < K-1 (a forward follows):
    sel = the k best of cum.view(B, k*k); pb = sel // k (parent beam)
    beam_tok = hot[ct].flat[sel], beam_score = cum.flat[sel], beam_cand = offset + sel
    anc[:, b, :j] = anc_old[:, pb[b], :j]; anc[:, b, j] = scratch(r, b, j+1)
    hidden of beam b (optional) = hid_out[r*k + pb[b]]

Scores: a candidate's score estimates the log-probability that the verify accepts it. Greedy
rows use the draft's log-probs at temperature 1 (the target's argmax matches a candidate about
as often as the draft's cumulative probability says: `scripts/tree_oracle.py`). A sampled row's
node is accepted with probability exactly the target's `p_T` of its path (`kernels.tree_accept`),
so with `temperature [B]` given, rows with T > 0 score by `log_softmax(logits / T)`: the
draft's estimate of `p_T` (same tokens per beam; the re-rank across beams and the tree's
selection across depths change). The verify still decides: exactness does not depend on it.

"The k best": the order of `graphdraft.runtime.tree.score_key` (higher first, ties to the lower index,
NaN as -inf), so the tree build's tie rule and this one agree (`best_k`: that order in fewer
launches than `topk(score_key(x))`, which a graph of a small model pays per kernel). With `k = 1` the token is
chain's selection exactly: argmax of the raw logits, lowest index on ties, NaN never the max
(`graphdraft.kernels.argmax`), so `k = 1` drafts chain's tokens bit for bit. With `k = 1` a
caller may hand the head's own greedy ids (`greedy_ids [R]`, target ids: the fused argmax
chain drafts with, on either kernel path and for any float dtype); they are then the beams'
tokens and the row max of the log-probs their scores.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from graphdraft.checks import expect_tensor
from graphdraft.kernels.argmax import argmax_with_map_ref
from graphdraft.runtime.tree import TreeSpec

__all__ = ["BeamState", "best_k", "first_step", "decode_step", "scratch_table"]

_LOW31 = 0x7FFFFFFF
SORT_MAX = 64
"""`best_k` ranks rows this wide or narrower with one stable sort (the beams' re-rank over
k*k candidates), wider ones with `topk` of an int64 key (a draft vocab row)."""


@dataclass
class BeamState:
    """Beams and candidate store of `B` rows (shapes: `graphdraft.runtime.tree` table).

    beam_tok [B, k] int64 (target ids), beam_score [B, k] float32, beam_cand [B, k] int64,
    parent_beam [B, k] int64, anc [B, k, max(K-1, 1)] int64,
    cand_score [B, M] float32, cand_tok [B, M] int64, cand_parent [B, M] int64.
    """

    beam_tok: torch.Tensor
    beam_score: torch.Tensor
    beam_cand: torch.Tensor
    parent_beam: torch.Tensor
    anc: torch.Tensor
    cand_score: torch.Tensor
    cand_tok: torch.Tensor
    cand_parent: torch.Tensor

    @classmethod
    def allocate(cls, spec: TreeSpec, bs: int, device: str | torch.device) -> BeamState:
        """Zeroed buffers for `bs` rows (allocate once for the largest `B`, then `rows(B)`)."""
        k, m = spec.topk, spec.M
        i64 = dict(dtype=torch.int64, device=device)
        return cls(beam_tok=torch.zeros(bs, k, **i64),
                   beam_score=torch.zeros(bs, k, dtype=torch.float32, device=device),
                   beam_cand=torch.zeros(bs, k, **i64), parent_beam=torch.zeros(bs, k, **i64),
                   anc=torch.zeros(bs, k, spec.anc_width, **i64),
                   cand_score=torch.zeros(bs, m, dtype=torch.float32, device=device),
                   cand_tok=torch.zeros(bs, m, **i64), cand_parent=torch.zeros(bs, m, **i64))

    def rows(self, bs: int) -> BeamState:
        """Views of the first `bs` rows (the buffers a graph of padded size `bs` uses)."""
        return BeamState(**{f.name: getattr(self, f.name)[:bs] for f in fields(self)})


def _check(spec: TreeSpec, st: BeamState, logits: torch.Tensor, rows_per_req: int, what: str,
           hot_token_ids: torch.Tensor | None) -> int:
    bs = st.beam_tok.shape[0]
    if logits.dim() != 2 or logits.shape[0] != bs * rows_per_req or not logits.is_floating_point():
        raise ValueError(f"logits: expected float [{what} = {bs * rows_per_req}, Vd], got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    if spec.topk > logits.shape[1]:
        raise ValueError(f"speculative_eagle_topk: expected <= the draft vocab {logits.shape[1]}, "
                         f"got {spec.topk}")
    want = {"beam_tok": (bs, spec.topk), "beam_score": (bs, spec.topk),
            "beam_cand": (bs, spec.topk), "parent_beam": (bs, spec.topk),
            "anc": (bs, spec.topk, spec.anc_width), "cand_score": (bs, spec.M),
            "cand_tok": (bs, spec.M), "cand_parent": (bs, spec.M)}
    for name, shape in want.items():
        t = getattr(st, name)
        expect_tensor(name, t, shape=shape)  # fixed by spec
    if hot_token_ids is not None:
        expect_tensor("hot_token_ids", hot_token_ids, shape=(logits.shape[1],))
    return bs


def _rank_scale(temperature: torch.Tensor | None, rows: int, per: int) -> torch.Tensor | None:
    """`[rows, 1]` divisor of the logits: the request's temperature where it samples (> 0), 1
    for greedy rows; `temperature [rows // per]` (per request; `per` rows each). None: None."""
    if temperature is None:
        return None
    expect_tensor("temperature", temperature, shape=(rows // per,))
    t = temperature.float()
    t = torch.where(t > 0, t, torch.ones_like(t))
    return (t.repeat_interleave(per) if per > 1 else t).unsqueeze(1)


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


def scratch_table(spec: TreeSpec, base: int, bs: int, device: str | torch.device
                  ) -> torch.Tensor:
    """`[max(K-1, 1), bs*k]` int64: entry `[j - 1, r*k + b]` = `scratch(r, b, j)` for the
    decode levels j = 1..K-1 (`TreeSpec.scratch_slot`); a row of level j is the contiguous
    `[bs*k]` slot list of that level's queries, and `.view(bs, k)` the ancestor column."""
    k, lv = spec.topk, max(spec.steps - 1, 1)
    rb = torch.arange(bs * k, device=device, dtype=torch.int64)
    j = torch.arange(lv, device=device, dtype=torch.int64).unsqueeze(1)
    return base + rb * (spec.steps - 1) + j


def _top(spec: TreeSpec, logits: torch.Tensor, scale: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `logits [R, Vd]` -> (log-prob `[R, k]` fp32, draft index `[R, k]` int64) of the
    k best (module doc), best first. `scale [R, 1]`: log-probs of softmax(logits / scale)
    (the same k tokens: only the scores change)."""
    x = logits.float()
    lp = torch.log_softmax(x if scale is None else x / scale, dim=-1)
    if spec.topk == 1:
        idx = argmax_with_map_ref(logits).unsqueeze(1)  # chain's exact selection
    else:
        idx = best_k(lp, spec.topk)
    return lp.gather(1, idx), idx


def _map(idx: torch.Tensor, hot_token_ids: torch.Tensor | None) -> torch.Tensor:
    return idx if hot_token_ids is None else hot_token_ids[idx].to(torch.int64)


def _greedy(spec: TreeSpec, logits: torch.Tensor, greedy_ids: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """k = 1 with the caller's greedy ids: (row max of the log-probs `[R, 1]`, ids `[R, 1]`)."""
    if spec.topk != 1:
        raise ValueError(f"greedy_ids: expected only with speculative_eagle_topk=1, got "
                         f"topk={spec.topk}")
    expect_tensor("greedy_ids", greedy_ids, shape=(logits.shape[0],))
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.amax(dim=-1, keepdim=True), greedy_ids.to(torch.int64).unsqueeze(1)


def first_step(spec: TreeSpec, logits: torch.Tensor, st: BeamState, *,
               hot_token_ids: torch.Tensor | None = None, scratch_base: int = 0,
               greedy_ids: torch.Tensor | None = None,
               temperature: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None) -> None:
    """Level 1 from the first draft step's `logits [B, Vd]` (module doc); writes `st`.
    `temperature [B]` (optional): score the rows that sample (> 0) at their temperature
    (module doc, "Scores"). `scratch`: `scratch_table(spec, scratch_base, >= B, ...)`
    precomputed (None: the slots are computed here)."""
    bs = _check(spec, st, logits, 1, "B", hot_token_ids)
    k = spec.topk
    if greedy_ids is not None:
        s, tok = _greedy(spec, logits, greedy_ids)
    else:
        s, idx = _top(spec, logits, _rank_scale(temperature, bs, 1))
        tok = _map(idx, hot_token_ids)
    st.beam_tok.copy_(tok)
    st.beam_score.copy_(s)
    st.beam_cand.copy_(torch.arange(k, device=logits.device).expand(bs, k))
    st.parent_beam.zero_()
    st.cand_score[:, :k].copy_(s)
    st.cand_tok[:, :k].copy_(tok)
    st.cand_parent[:, :k].fill_(-1)
    if spec.steps > 1:
        st.anc[:, :, 0].copy_(_slots(spec, scratch, scratch_base, bs, 1, logits.device))


def decode_step(spec: TreeSpec, j: int, logits: torch.Tensor, st: BeamState, *,
                hot_token_ids: torch.Tensor | None = None, scratch_base: int = 0,
                hid_out: torch.Tensor | None = None, hid_next: torch.Tensor | None = None,
                greedy_ids: torch.Tensor | None = None,
                temperature: torch.Tensor | None = None,
                scratch: torch.Tensor | None = None) -> None:
    """Decode level `j` (1..K-1) from `logits [B*k, Vd]` (row `r*k + b` = beam b of row r);
    writes `st` (module doc). With `hid_out [B*k, H]` and `hid_next [B*k, H]` also gathers the
    next step's hidden input `hid_next[r*k + b] = hid_out[r*k + parent_beam[r, b]]`
    (`hid_next` must not alias `hid_out`). `temperature [B]`, `scratch`: as `first_step`."""
    if not 1 <= j <= spec.steps - 1:
        raise ValueError(f"j: expected a decode level in 1..{spec.steps - 1}, got {j}")
    bs = _check(spec, st, logits, spec.topk, "B*k", hot_token_ids)
    if (hid_out is None) != (hid_next is None):
        raise ValueError("hid_out, hid_next: expected both or neither")
    if hid_out is not None and (hid_out.shape != hid_next.shape or hid_out.dim() != 2
                                or hid_out.shape[0] != logits.shape[0]):
        raise ValueError(f"hid_out, hid_next: expected [{logits.shape[0]}, H] each, got "
                         f"{tuple(hid_out.shape)} and {tuple(hid_next.shape)}")
    if hid_out is not None and hid_out.data_ptr() == hid_next.data_ptr():
        raise ValueError("hid_next: expected a buffer apart from hid_out")
    k, dev = spec.topk, logits.device
    if greedy_ids is not None:
        lp, tok = _greedy(spec, logits, greedy_ids)
    else:
        lp, idx = _top(spec, logits, _rank_scale(temperature, logits.shape[0], k))  # [B*k, k]
        tok = _map(idx, hot_token_ids)
    off, kk = spec.level_offset(j + 1), k * k
    # the level's candidates straight into the store (views of its columns: no staging copy)
    flat = st.cand_score[:, off:off + kk]                           # cum: [B, k*k]
    torch.add(st.beam_score.unsqueeze(2), lp.view(bs, k, k), out=flat.view(bs, k, k))
    cand_tok = st.cand_tok[:, off:off + kk]
    cand_tok.view(bs, k, k).copy_(tok.view(bs, k, k))  # tok [B*k, k] may be a strided view
    st.cand_parent[:, off:off + kk].view(bs, k, k).copy_(
        st.beam_cand.unsqueeze(2).expand(bs, k, k))
    if j == spec.steps - 1:
        return  # level K: no forward follows, no re-rank
    if k == 1:
        sel = torch.zeros(bs, 1, dtype=torch.int64, device=dev)
    else:
        sel = best_k(flat, k)                                       # [B, k], best first
    pb = torch.floor_divide(sel, k, out=st.parent_beam)
    torch.gather(cand_tok, 1, sel, out=st.beam_tok)
    torch.gather(flat, 1, sel, out=st.beam_score)
    torch.add(sel, off, out=st.beam_cand)
    kept = st.anc[:, :, :j].gather(1, pb.unsqueeze(2).expand(bs, k, j))
    st.anc[:, :, :j].copy_(kept)
    st.anc[:, :, j].copy_(_slots(spec, scratch, scratch_base, bs, j + 1, dev))
    if hid_out is not None:
        h = hid_out.shape[1]
        torch.gather(hid_out.view(bs, k, h), 1, pb.unsqueeze(2).expand(bs, k, h),
                     out=hid_next.view(bs, k, h))


def _slots(spec: TreeSpec, scratch: torch.Tensor | None, base: int, bs: int, j: int,
           device: torch.device) -> torch.Tensor:
    """`[bs, k]` scratch slots of level j's queries: from the precomputed `scratch` table
    (`scratch_table`), else computed."""
    k = spec.topk
    if scratch is not None:
        if scratch.dim() != 2 or scratch.shape[1] < bs * k or scratch.shape[0] < j:
            raise ValueError(f"scratch: expected a scratch_table of >= {bs} rows and "
                             f"{spec.steps - 1} levels, got {tuple(scratch.shape)}")
        return scratch[j - 1, : bs * k].view(bs, k)
    rows = torch.arange(bs, device=device).unsqueeze(1)
    beams = torch.arange(k, device=device).unsqueeze(0)
    return spec.scratch_slot(base, rows, beams, j)
