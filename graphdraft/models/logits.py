"""The draft head's LM head: logits of its rows and their greedy ids, mapped to target ids."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphdraft import ops


@dataclass
class LogitsOutput:
    """next_token_logits `[B, V]`; next_token_ids int64 `[B]` (fused argmax, mapped through
    the hot-token map when there is one)."""

    next_token_logits: torch.Tensor
    next_token_ids: torch.Tensor


class LogitsProcessor:
    """`normed [B, H] -> logits [B, V]` and their argmax ids (`ops.linear_argmax`)."""

    def __init__(self, hot_token_ids: torch.Tensor | None = None, use_triton: bool = False) -> None:
        self.hot_token_ids = hot_token_ids
        self.use_triton = use_triton

    def __call__(self, normed: torch.Tensor, lm_head: torch.Tensor, *,
                 ids_out: torch.Tensor | None = None,
                 tokens_out: torch.Tensor | None = None) -> LogitsOutput:
        """The greedy ids also go into `ids_out` / `tokens_out` when given."""
        logits, ids = ops.linear_argmax(normed, lm_head, self.hot_token_ids, ids_out=ids_out,
                                        tokens_out=tokens_out, use_triton=self.use_triton)
        return LogitsOutput(logits, ids)
