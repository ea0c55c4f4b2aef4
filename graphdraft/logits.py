"""Logits processing: keep only the rows that are sampled, and the hidden states asked for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphdraft import ops
from graphdraft.batch import CaptureHiddenMode


@dataclass
class LogitsOutput:
    """next_token_logits `[B, V]`; next_token_ids int64 `[B]` (fused argmax, mapped) or None;
    hidden_states: None, the gathered rows `[B, H]` (LAST) or every token `[T, H]` (FULL)."""

    next_token_logits: torch.Tensor
    next_token_ids: torch.Tensor | None
    hidden_states: torch.Tensor | None


class LogitsProcessor:
    """`hidden [T, H] -> logits [B, V]` for the rows in `gather_ids` (all rows when None)."""

    def __init__(self, hot_token_ids: torch.Tensor | None = None, use_triton: bool = False) -> None:
        self.hot_token_ids = hot_token_ids
        self.use_triton = use_triton

    def __call__(self, normed: torch.Tensor, lm_head: torch.Tensor, *,
                 gather_ids: torch.Tensor | None = None,
                 hidden_states: torch.Tensor | None = None,
                 capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NONE,
                 fuse_argmax: bool = False, ids_out: torch.Tensor | None = None,
                 tokens_out: torch.Tensor | None = None) -> LogitsOutput:
        """With `fuse_argmax`, the greedy ids go into `ids_out` / `tokens_out` when given
        (`ops.linear_argmax`)."""
        rows = normed if gather_ids is None else normed.index_select(0, gather_ids)
        if fuse_argmax:
            logits, ids = ops.linear_argmax(rows, lm_head, self.hot_token_ids, ids_out=ids_out,
                                            tokens_out=tokens_out, use_triton=self.use_triton)
        else:
            logits, ids = ops.linear(rows, lm_head, use_triton=self.use_triton), None
        if capture_hidden_mode is CaptureHiddenMode.NONE or hidden_states is None:
            kept = None
        elif capture_hidden_mode is CaptureHiddenMode.LAST and gather_ids is not None:
            kept = hidden_states.index_select(0, gather_ids)
        else:
            kept = hidden_states
        return LogitsOutput(logits, ids, kept)
