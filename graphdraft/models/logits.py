"""The draft head's LM head: logits of its rows and their greedy ids, mapped to target ids."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphdraft import ops
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.config import default as default_kernels


@dataclass
class LogitsOutput:
    """next_token_logits `[B, V]`; next_token_ids int64 `[B]` (fused argmax, mapped through
    the hot-token map when there is one)."""

    next_token_logits: torch.Tensor
    next_token_ids: torch.Tensor


class LogitsProcessor:
    """`normed [B, H] -> logits [B, V]` and their argmax ids (`ops.linear_argmax`)."""

    def __init__(self, hot_token_ids: torch.Tensor | None = None, *,
                 kernels: KernelConfig | None = None) -> None:
        self.hot_token_ids = hot_token_ids
        self.kernels = kernels if kernels is not None else default_kernels()

    def __call__(self, normed: torch.Tensor, lm_head: torch.Tensor, *,
                 ids_out: torch.Tensor | None = None,
                 tokens_out: torch.Tensor | None = None) -> LogitsOutput:
        """The greedy ids also go into `ids_out` / `tokens_out` when given."""
        logits, ids = ops.linear_argmax(normed, lm_head, self.hot_token_ids, ids_out=ids_out,
                                        tokens_out=tokens_out, kernels=self.kernels)
        return LogitsOutput(logits, ids)
