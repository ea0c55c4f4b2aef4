"""What a drafter needs to propose under the rows' logit controls (issue #43).

The verify applies each request's logit_bias and penalties to the target's logits
(`ops.apply_logit_controls`); a drafter that picks from its own logits unchanged drafts tokens
the verify then rejects (a banned id, a repeated one). `DraftControls` holds what the drafters
(`runtime.drafter.EagleDrafter`, `runtime.tree_drafter.TreeDrafter`) hand to
`ops.apply_draft_logit_controls` on each draft step's logits: the Engine's `SlotState` (counts
through the last commit, bias tables, penalty columns) and the draft vocabulary's map to
target ids. The draft runs between the acceptance and the commit that counts its tokens (a
cycle that fails before its commit changes no count), so each drafter also hands the
kernel this cycle's accepted tokens and accept lengths (the chain: its first-step ids; the
tree: the accepted path's tokens) as a second window. Proposals never change what is
emitted, only how often it is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphdraft.runtime.slot_state import SlotState


@dataclass
class DraftControls:
    """What a drafter needs to propose under the rows' logit controls: the Engine's
    `SlotState` (`slots`), the target id of each draft column `col_ids [Vd]` and its inverse
    `col_of [V]` (-1: not drafted; both None when the head drafts the target's vocabulary),
    and `no_window [max_bs, 1]` (-1: nothing drafted since the acceptance, the first step)."""

    slots: SlotState
    col_ids: torch.Tensor | None
    col_of: torch.Tensor | None
    no_window: torch.Tensor

    @classmethod
    def build(cls, slots: SlotState, hot_token_ids: torch.Tensor | None, max_bs: int,
              device: torch.device) -> DraftControls:
        col_of = None
        if hot_token_ids is not None:
            col_of = torch.full((slots.vocab,), -1, dtype=torch.int64, device=device)
            col_of[hot_token_ids.long()] = torch.arange(hot_token_ids.shape[0], device=device)
        # int32 as `next_tokens`' drafts (the later steps' windows): one kernel variant
        no_window = torch.full((max_bs, 1), -1, dtype=torch.int32, device=device)
        return cls(slots, hot_token_ids, col_of, no_window)
