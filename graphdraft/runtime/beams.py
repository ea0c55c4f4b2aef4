"""Top-k beam bookkeeping of tree drafting, in fixed shapes.

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
launches than `topk(score_key(x))`, which a graph of a small model pays per kernel). Each
level runs through `ops.tree_beam_level` (`kernels.tree_beams`): on the Triton path with
k >= 2 one launch a level (log-softmax, the k best, the candidate store, the re-rank, the
ancestors, the next hidden input and the controls' windows), else the torch path (about 20
small ops a level). With `k = 1` the token is
chain's selection exactly: argmax of the raw logits, lowest index on ties, NaN never the max
(`graphdraft.kernels.argmax`), so `k = 1` drafts chain's tokens bit for bit. With `k = 1` a
caller may hand the head's own greedy ids (`greedy_ids [R]`, target ids: the fused argmax
chain drafts with, on either kernel path and for any float dtype); they are then the beams'
tokens and the row max of the log-probs their scores.
"""

from __future__ import annotations

import torch

from graphdraft import ops
from graphdraft.checks import expect_tensor
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.tree_beams import SORT_MAX, BeamState, best_k  # noqa: F401 - re-exported
from graphdraft.runtime.tree import TreeSpec

__all__ = ["BeamState", "best_k", "first_step", "decode_step", "scratch_table"]

_TORCH = KernelConfig(backend="torch")
"""`kernels=None`: the torch path (the beams' reference, whatever the environment says)."""


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


def scratch_table(spec: TreeSpec, base: int, bs: int, device: str | torch.device
                  ) -> torch.Tensor:
    """`[max(K-1, 1), bs*k]` int64: entry `[j - 1, r*k + b]` = `scratch(r, b, j)` for the
    decode levels j = 1..K-1 (`TreeSpec.scratch_slot`); a row of level j is the contiguous
    `[bs*k]` slot list of that level's queries, and `.view(bs, k)` the ancestor column."""
    k, lv = spec.topk, max(spec.steps - 1, 1)
    rb = torch.arange(bs * k, device=device, dtype=torch.int64)
    j = torch.arange(lv, device=device, dtype=torch.int64).unsqueeze(1)
    return base + rb * (spec.steps - 1) + j


def first_step(spec: TreeSpec, logits: torch.Tensor, st: BeamState, *,
               hot_token_ids: torch.Tensor | None = None, scratch_base: int = 0,
               greedy_ids: torch.Tensor | None = None,
               temperature: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None, hid_src: torch.Tensor | None = None,
               hid_dst: torch.Tensor | None = None, window: torch.Tensor | None = None,
               setup: tuple | None = None, kernels: KernelConfig | None = None) -> None:
    """Level 1 from the first draft step's `logits [B, Vd]` (module doc); writes `st`.
    `temperature [B]` (optional): score the rows that sample (> 0) at their temperature
    (module doc, "Scores"). `scratch`: `scratch_table(spec, scratch_base, >= B, ...)`
    precomputed (None: the slots are computed here). Optional, in the same launch on the
    Triton path (`kernels.tree_beams.beam_first_ref`): the beam steps' hidden input
    `hid_dst [B*k, H]` = `hid_src [B, H]` per beam, the controls' `window [B*k, K-1]`
    int32 (each beam's path: its token, then -1), `setup` = (req [B], prefix [B],
    beam_req [B*k], beam_lens [B*k] int32, step_pos [K-1, >= B*k]) the beam steps' request
    slots, prefix lengths and rope positions. `kernels`: the Triton path for k >= 2
    (`ops.tree_beam_level`; None: the torch path)."""
    _check(spec, st, logits, 1, "B", hot_token_ids)
    ops.tree_beam_level(spec, 0, logits, st, hot=hot_token_ids, temperature=temperature,
                        greedy_ids=greedy_ids, scratch_base=scratch_base, scratch=scratch,
                        hid_src=hid_src, hid_dst=hid_dst, window=window, setup=setup,
                        kernels=_TORCH if kernels is None else kernels)


def decode_step(spec: TreeSpec, j: int, logits: torch.Tensor, st: BeamState, *,
                hot_token_ids: torch.Tensor | None = None, scratch_base: int = 0,
                hid_out: torch.Tensor | None = None, hid_next: torch.Tensor | None = None,
                greedy_ids: torch.Tensor | None = None,
                temperature: torch.Tensor | None = None,
                scratch: torch.Tensor | None = None, window: torch.Tensor | None = None,
                kernels: KernelConfig | None = None) -> None:
    """Decode level `j` (1..K-1) from `logits [B*k, Vd]` (row `r*k + b` = beam b of row r);
    writes `st` (module doc). With `hid_out [B*k, H]` and `hid_next [B*k, H]` also gathers the
    next step's hidden input `hid_next[r*k + b] = hid_out[r*k + parent_beam[r, b]]`
    (`hid_next` must not alias `hid_out`); with `window [B*k, K-1]` int32 (the controls'
    beam paths) the same gather of the first j columns and the beam's token at column j.
    `temperature [B]`, `scratch`, `kernels`: as `first_step`."""
    if not 1 <= j <= spec.steps - 1:
        raise ValueError(f"j: expected a decode level in 1..{spec.steps - 1}, got {j}")
    _check(spec, st, logits, spec.topk, "B*k", hot_token_ids)
    if (hid_out is None) != (hid_next is None):
        raise ValueError("hid_out, hid_next: expected both or neither")
    if hid_out is not None and (hid_out.shape != hid_next.shape or hid_out.dim() != 2
                                or hid_out.shape[0] != logits.shape[0]):
        raise ValueError(f"hid_out, hid_next: expected [{logits.shape[0]}, H] each, got "
                         f"{tuple(hid_out.shape)} and {tuple(hid_next.shape)}")
    if hid_out is not None and hid_out.data_ptr() == hid_next.data_ptr():
        raise ValueError("hid_next: expected a buffer apart from hid_out")
    ops.tree_beam_level(spec, j, logits, st, hot=hot_token_ids, temperature=temperature,
                        greedy_ids=greedy_ids, scratch_base=scratch_base, scratch=scratch,
                        hid_src=hid_out, hid_dst=hid_next, window=window,
                        kernels=_TORCH if kernels is None else kernels)
