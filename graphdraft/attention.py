"""Attention backend for paged KV: metadata and the attend call.

Every attention in graphdraft is expressed per query row: row t attends to
positions `[0, kv_lens[t])` of request slot `req_pool_indices[t]`. A decode
draft step has one row per request; the target's prefill and verify forwards
have one row per token, with `kv_lens` growing causally inside a request.

The draft's seq-len alias: the drafter binds a persistent `kv_lens` buffer as
the metadata once, then advances it in place before each draft step
(`advance_draft_forward_metadata`); a captured graph reads the same memory,
so it sees new lengths without re-capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from graphdraft import ops


@dataclass
class AttentionMetadata:
    """Per query row: request slot `[T]` int64 and KV length `[T]` int32 (>= 1)."""

    req_pool_indices: torch.Tensor
    kv_lens: torch.Tensor


class PagedAttentionBackend:
    """Paged attention over `req_to_page`; torch path everywhere, Triton path on CUDA."""

    def __init__(self, req_to_page: torch.Tensor, page_size: int, max_context_len: int,
                 use_triton: bool) -> None:
        self.req_to_page = req_to_page
        self.page_size = page_size
        self.max_context_len = max_context_len
        self.use_triton = use_triton
        self.num_extends = 0
        self.metadata: AttentionMetadata | None = None

    # --- metadata -----------------------------------------------------------
    def bind_metadata(self, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor) -> AttentionMetadata:
        """Use these tensors (views of persistent buffers, not copies) as the metadata."""
        self.metadata = AttentionMetadata(req_pool_indices, kv_lens)
        return self.metadata

    def advance_draft_forward_metadata(self, seq_lens: torch.Tensor) -> None:
        """Make the bound seq-len alias hold `seq_lens`.

        When `seq_lens` is the bound alias itself (the drafter advanced it in
        place) nothing is copied; otherwise it is copied in place, so a
        captured graph still reads the same memory.
        """
        meta = self.metadata
        if meta is None:
            raise RuntimeError("advance_draft_forward_metadata: no metadata bound")
        if seq_lens.data_ptr() != meta.kv_lens.data_ptr():
            meta.kv_lens[: seq_lens.shape[0]].copy_(seq_lens)

    @contextlib.contextmanager
    def override_num_extends(self, num_extends: int) -> Iterator[None]:
        """Treat the batch as having `num_extends` prefill rows inside the block."""
        saved, self.num_extends = self.num_extends, num_extends
        try:
            yield
        finally:
            self.num_extends = saved

    def token_metadata(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       extend_lens: torch.Tensor, num_tokens: int,
                       out_req: torch.Tensor, out_kv_lens: torch.Tensor) -> AttentionMetadata:
        """Causal per-token metadata for a forward of ragged rows (prefill, verify, mixed).

        Row r's `extend_lens[r]` tokens sit at positions `seq_lens[r] - extend_lens[r] + j`;
        token j attends to `seq_lens[r] - extend_lens[r] + j + 1` positions.
        Writes `out_req[:num_tokens]`, `out_kv_lens[:num_tokens]` in place (no host sync).
        """
        row = torch.repeat_interleave(torch.arange(extend_lens.shape[0], device=extend_lens.device),
                                      extend_lens.long(), output_size=num_tokens)
        starts = torch.cumsum(extend_lens.long(), 0) - extend_lens.long()
        j = torch.arange(num_tokens, device=extend_lens.device) - starts[row]
        out_req[:num_tokens].copy_(req_pool_indices[row])
        out_kv_lens[:num_tokens].copy_(seq_lens.long()[row] - extend_lens.long()[row] + j + 1)
        return self.bind_metadata(out_req[:num_tokens], out_kv_lens[:num_tokens])

    # --- compute ------------------------------------------------------------
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               sm_scale: float, metadata: AttentionMetadata | None = None,
               q_index: torch.Tensor | None = None) -> torch.Tensor:
        """q `[T, Hq, D]` -> `[T, Hq, D]` over the bound (or given) metadata's first T rows.
        With `q_index` `[T]` the query rows are `q[q_index]` (q any `[R, Hq, D]`; the gather
        happens inside the attention kernel on the Triton path)."""
        meta = metadata or self.metadata
        if meta is None:
            raise RuntimeError("attend: no attention metadata bound")
        t = q.shape[0] if q_index is None else q_index.shape[0]
        return ops.paged_attention(q, k_cache, v_cache, meta.req_pool_indices[:t], meta.kv_lens[:t],
                                   self.req_to_page, self.page_size, sm_scale,
                                   self.max_context_len, q_index=q_index,
                                   use_triton=self.use_triton)
