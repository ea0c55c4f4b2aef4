"""Tree drafting: the configuration `(K steps, k beams, n verified nodes)`, its derived sizes,
the static draft-scratch slot arithmetic, and the total order on candidate scores.

Symbols (the other tree modules use them):

    K = steps             draft levels (first step + K-1 decode steps), `speculative_num_steps`
    k = topk              beams per step, `speculative_eagle_topk` (1 = chain)
    n = num_draft_tokens  tree nodes verified per request, root included, `speculative_num_draft_tokens`
    M = k + (K-1)*k*k     candidates stored per request
    P = min(K + 1, n)     longest acceptable path (root + one node per level)

Per padded batch `B` the tree buffers are (every shape fixed by `(k, K, n)`, no data-dependent
shape anywhere):

| buffer | shape | dtype | written by |
|---|---|---|---|
| beam_tok, beam_cand | `[B, k]` | int64 | `graphdraft.runtime.beams` |
| beam_score | `[B, k]` | float32 | `graphdraft.runtime.beams` (cumulative log-prob) |
| parent_beam | `[B, k]` | int64 | `graphdraft.runtime.beams` (gathers the beams' hidden states) |
| anc | `[B, k, max(K-1, 1)]` | int64 | `graphdraft.runtime.beams` (draft-KV slots of a beam's path) |
| cand_score | `[B, M]` | float32 | `graphdraft.runtime.beams` |
| cand_tok, cand_parent | `[B, M]` | int64 | `graphdraft.runtime.beams` (parent: flat candidate index, -1 = root) |
| tree_tokens | `[B, n]` | int64 | `kernels.tree_build` (node 0 = root token) |
| parents | `[B, n]` | int64 | `kernels.tree_build` (node ids; root -1) |
| depths | `[B, n]` | int64 | `kernels.tree_build` |
| positions | `[B, n]` | int64 | `kernels.tree_build` (`L + depth`: rope positions) |
| mask | `[B, n]` | int64 | `kernels.tree_build` (bit j of row i: node i sees node j) |
| first_child, next_sibling | `[B, n]` | int64 | `kernels.tree_build` (-1 = none) |
| retrieve_index | `[B, n]` | int64 | `kernels.tree_build` (`r*n + i`: the node's verify row) |
| cand_node | `[B, M]` | int64 | `kernels.tree_build` (node id of each candidate, 0 = not selected) |
| coins, final_coin | `[B, n]`, `[B]` | float32 | the caller, before replay (sampled acceptance) |
| accept_len, bonus | `[B]` | int32, int64 | `kernels.tree_accept` |
| accept_index, out_tokens | `[B, P]` | int64 | `kernels.tree_accept` (-1 padded / bonus padded) |
| hid_c | `[B*P, kH]` | draft dtype | `kernels.kv_move` |

The draft scratch KV region (beams' KV, never in a request's pages) holds
`max_bs * k * (K-1)` slots; `scratch(r, b, j) = base + (r*k + b)*(K-1) + j - 1` for
`j = 1 .. K-1` is the slot the level-j node held by beam `b` of row `r` writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphdraft.kernels.tree_build import score_key  # noqa: F401 - re-exported (its home)

__all__ = ["TreeSpec", "MAX_NODES", "score_key", "scratch_slots"]

MAX_NODES = 64
"""Largest `n`: one int64 mask word per node."""


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class TreeSpec:
    """A validated tree shape. `num_draft_tokens=None` means `steps + 1` (chain's width).

    Raises ValueError naming the CLI field and what was expected when the combination cannot
    be drafted: `2 <= n <= 64`, `n - 1 <= M`, and with `topk == 1` `n == steps + 1`.
    """

    steps: int
    topk: int = 1
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        steps = _positive_int("speculative_num_steps", self.steps)
        topk = _positive_int("speculative_eagle_topk", self.topk)
        n = self.num_draft_tokens
        if n is None:
            object.__setattr__(self, "num_draft_tokens", steps + 1)
            n = steps + 1
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"speculative_num_draft_tokens: expected an int, got {n!r}")
        if topk == 1 and n != steps + 1:
            raise ValueError(
                f"speculative_num_draft_tokens: with speculative_eagle_topk=1 (chain) expected "
                f"speculative_num_steps + 1 = {steps + 1} (or leave it unset), got {n}")
        if n < 2:
            raise ValueError(f"speculative_num_draft_tokens: expected >= 2 (root + one draft), got {n}")
        if n > MAX_NODES:
            raise ValueError(f"speculative_num_draft_tokens: expected <= {MAX_NODES} (one int64 "
                             f"mask word per node), got {n}")
        m = topk + (steps - 1) * topk * topk
        if n - 1 > m:
            raise ValueError(
                f"speculative_num_draft_tokens: expected <= 1 + topk + (steps-1)*topk^2 = {m + 1} "
                f"for speculative_num_steps={steps}, speculative_eagle_topk={topk}, got {n}")

    # The short symbols of the module docstring.
    @property
    def K(self) -> int:  # noqa: N802 - the design's symbol
        return self.steps

    @property
    def k(self) -> int:
        return self.topk

    @property
    def n(self) -> int:
        return self.num_draft_tokens

    @property
    def M(self) -> int:  # noqa: N802
        """Candidates per request: `k + (K-1)*k*k`."""
        return self.topk + (self.steps - 1) * self.topk * self.topk

    @property
    def P(self) -> int:  # noqa: N802
        """Longest acceptable path, root included: `min(K + 1, n)`."""
        return min(self.steps + 1, self.num_draft_tokens)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def anc_width(self) -> int:
        """Last dimension of the ancestor table `[B, k, max(K-1, 1)]`."""
        return max(self.steps - 1, 1)

    def level_offset(self, level: int) -> int:
        """Flat candidate index of the first level-`level` candidate (level 1 .. K)."""
        if not 1 <= level <= self.steps:
            raise ValueError(f"level: expected in 1..{self.steps}, got {level}")
        return 0 if level == 1 else self.topk + (level - 2) * self.topk * self.topk

    def depth_of(self, flat: torch.Tensor) -> torch.Tensor:
        """Depth (= draft level) of flat candidate indices (any shape, int64): pure arithmetic."""
        k = self.topk
        return torch.where(flat < k, torch.ones_like(flat), 2 + (flat - k) // (k * k))

    def scratch_slot(self, base: int, rows: torch.Tensor, beam: torch.Tensor | int, j: int
                     ) -> torch.Tensor:
        """`scratch(r, b, j) = base + (r*k + b)*(K-1) + j - 1` for level `j` in 1..K-1."""
        if not 1 <= j <= self.steps - 1:
            raise ValueError(f"j: expected a decode level in 1..{self.steps - 1}, got {j}")
        return base + (rows * self.topk + beam) * (self.steps - 1) + (j - 1)


def scratch_slots(spec: TreeSpec, max_bs: int) -> int:
    """Draft-KV scratch slots the beams need: `max_bs * k * (K-1)`."""
    return _positive_int("max_bs", max_bs) * spec.topk * (spec.steps - 1)
