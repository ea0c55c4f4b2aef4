"""Attention backend for paged KV: metadata and the attend call.

Two forms of metadata:
- per query token (`AttentionMetadata`, `bind_metadata`): token t attends to positions
  `[0, kv_lens[t])` of request slot `req_pool_indices[t]`. The single-token decode forwards
  (draft steps, one row per request) use it: the decode kernel.
- per row of several tokens (`RowMetadata`, `row_metadata` / `uniform_row_metadata`): row r
  holds the `extend_lens[r]` new tokens of request `req_pool_indices[r]`, whose sequence is
  `seq_lens[r]` long with them; token j sees `seq_lens[r] - extend_lens[r] + j + 1` positions.
  The target's verify (uniform rows of N tokens, graph-captured), prefill and mixed forwards
  use it: the extend kernel (`kernels.extend_attention`) loads each KV block once per row
  instead of once per token. The torch path expands the rows to the per-token form and runs
  the same plain attention.

Tree drafting's beams (`BeamMetadata`, `graphdraft.runtime.beams`): query t attends to positions
`[0, kv_lens[t])` of its request (the committed draft prefix, read through the page table)
and then to the explicit cache slots `extra_slots[t, :num_extra]` (its ancestors' and its
own KV in the draft scratch region), never to another beam's: `ops.paged_attention` with
`extra_slots` (the decode kernel's second segment on the Triton path, its torch reference over
both segments on the torch path).

The draft's seq-len alias: the drafter binds a persistent `kv_lens` buffer as
the metadata once (`bind_metadata`), then advances that buffer in place between draft steps
(`ops.advance_positions_and_seq_lens`); a captured graph reads the same memory, so it sees
new lengths without re-capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphdraft import ops
from graphdraft.kernels.config import KernelConfig, resolve


@dataclass
class AttentionMetadata:
    """Per query row: request slot `[T]` int64 and KV length `[T]` int32 (>= 1)."""

    req_pool_indices: torch.Tensor
    kv_lens: torch.Tensor


@dataclass
class RowMetadata:
    """Per row `[R]`: request slot, sequence length with the new tokens, and (ragged rows)
    new-token count `extend_lens` and first query row `q_starts` (int32/int64); uniform rows
    have `uniform_n` tokens each at `r * uniform_n` (extend_lens / q_starts None).
    `max_extend` (host int) bounds extend_lens (sizes the kernel's grid: no host sync);
    `mask_bits` `[T]` int64 (optional): bit i of token j's word = token j sees new token i."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor | None
    q_starts: torch.Tensor | None
    uniform_n: int
    max_extend: int
    mask_bits: torch.Tensor | None = None


@dataclass
class BeamMetadata:
    """Per beam query `[T]`: request slot, prefix length (>= 1); `extra_slots` `[T, W]` int64
    (unit column stride) and `num_extra` (host int <= W): the explicit slots each query also
    sees (module doc)."""

    req_pool_indices: torch.Tensor
    kv_lens: torch.Tensor
    extra_slots: torch.Tensor
    num_extra: int


class PagedAttentionBackend:
    """Paged attention over `req_to_page`; torch path everywhere, Triton path on CUDA.

    `kernels`: the kernel settings (`RuntimeConfig.kernels`; None: the default config)."""

    def __init__(self, req_to_page: torch.Tensor, page_size: int, max_context_len: int, *,
                 kernels: KernelConfig | None = None) -> None:
        if kernels is not None and not isinstance(kernels, KernelConfig):
            raise ValueError(f"kernels: expected a KernelConfig or None, got "
                             f"{type(kernels).__name__}")
        self.req_to_page = req_to_page
        self.page_size = page_size
        self.max_context_len = max_context_len
        self.kernels = resolve(kernels)
        self.metadata: AttentionMetadata | RowMetadata | None = None

    @property
    def use_triton(self) -> bool:
        """The Triton path (`kernels.use_triton`)."""
        return self.kernels.use_triton

    # --- metadata -----------------------------------------------------------
    def bind_metadata(self, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor) -> AttentionMetadata:
        """Use these tensors (views of persistent buffers, not copies) as the metadata."""
        self.metadata = AttentionMetadata(req_pool_indices, kv_lens)
        return self.metadata

    def uniform_row_metadata(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                             n: int, mask_bits: torch.Tensor | None = None) -> RowMetadata:
        """Bind rows of `n` tokens each (the verify forward): `req_pool_indices` / `seq_lens`
        `[R]` (views of persistent buffers: a captured graph reads them in place), the queries
        `[R * n]` row-major. Nothing is computed (no launch). With n == 1 (target-only decode)
        this is the per-token form over the same buffers (`kv_lens = seq_lens`, each >= 1:
        padded rows hold 1), which runs the single-token decode kernel."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n: expected a positive int (tokens per row), got {n!r}")
        if n == 1 and mask_bits is None:  # single-token rows: the decode kernel, kv_lens = seq_lens
            return self.bind_metadata(req_pool_indices, seq_lens)
        self.metadata = RowMetadata(req_pool_indices, seq_lens, None, None, n, n, mask_bits)
        return self.metadata

    def row_metadata(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     extend_lens: torch.Tensor, max_extend: int,
                     mask_bits: torch.Tensor | None = None) -> RowMetadata:
        """Bind ragged rows laid out in order (prefill chunks, mixed batches; eager): `[R]`
        each; `max_extend` a host upper bound of `extend_lens` (e.g. the longest chunk
        scheduled). The rows' first query rows (the exclusive cumsum of extend_lens) are
        computed on the device (one small tensor, no host sync)."""
        if not isinstance(max_extend, int) or max_extend < 1:
            raise ValueError(f"max_extend: expected a positive int, got {max_extend!r}")
        q_starts = torch.cumsum(extend_lens, 0, dtype=torch.int64) - extend_lens
        self.metadata = RowMetadata(req_pool_indices, seq_lens, extend_lens, q_starts, 0,
                                    max_extend, mask_bits)
        return self.metadata

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
               sm_scale: float, metadata: AttentionMetadata | RowMetadata | None = None,
               q_index: torch.Tensor | None = None) -> torch.Tensor:
        """q `[T, Hq, D]` -> `[T, Hq, D]` over the bound (or given) metadata's first T rows
        (per-token metadata) or its rows (row metadata: T their tokens). With `q_index` `[T]`
        the query rows are `q[q_index]` (q any `[R, Hq, D]`; with per-token metadata the
        gather happens inside the attention kernel on the Triton path)."""
        meta = metadata or self.metadata
        if meta is None:
            raise RuntimeError("attend: no attention metadata bound")
        if isinstance(meta, BeamMetadata):
            if q_index is not None:
                q = q.index_select(0, q_index)
            return ops.paged_attention(q, k_cache, v_cache, meta.req_pool_indices, meta.kv_lens,
                                       self.req_to_page, self.page_size, sm_scale,
                                       self.max_context_len, extra_slots=meta.extra_slots,
                                       num_extra=meta.num_extra, kernels=self.kernels)
        if isinstance(meta, RowMetadata):
            if q_index is not None:
                q = q.index_select(0, q_index)
            return ops.paged_extend_attention(
                q, k_cache, v_cache, meta.req_pool_indices, meta.seq_lens, meta.extend_lens,
                meta.q_starts, self.req_to_page, self.page_size, sm_scale, self.max_context_len,
                max_extend=meta.max_extend, uniform_n=meta.uniform_n, mask_bits=meta.mask_bits,
                kernels=self.kernels)
        t = q.shape[0] if q_index is None else q_index.shape[0]
        return ops.paged_attention(q, k_cache, v_cache, meta.req_pool_indices[:t], meta.kv_lens[:t],
                                   self.req_to_page, self.page_size, sm_scale,
                                   self.max_context_len, q_index=q_index,
                                   kernels=self.kernels)
