"""The first draft step's per-row indices of decode rows, in one launch.

For decode row r (N verify tokens, `accept[r]` of them committed, 0..N):
    a'              = clamp(accept[r], 1, N)
    gather_ids[r]   = token_offset + r * N - 1 + a'          the token row that feeds the LM head
    seq_lens[r]     = max(target_seq_lens[r] - N + a', 1)    KV length that row attends over
    write_start[r]  = valid_cache_lengths[req[r]] + accept[r]  where draft step 2 writes
    last_token[r]   = tokens[gather_ids[r]]                   (optional) the last verified token

Inputs `[bs]`: accept int32, target_seq_lens int32, req int64; valid_cache_lengths
`[max_reqs + 1]` int32; tokens `[>= token_offset + bs * N]` int32/int64 (the first step's
input ids). Outputs `[bs]`: gather_ids int64, seq_lens int32, write_start int64 (contiguous),
last_token int32/int64 (any stride: the drafter passes column 0 of `next_tokens`).
Graph-capturable: no sync, no allocation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import INDEX_DTYPES, expect_tensor
from graphdraft.kernels.buckets import rows_block
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.pdl import launch_options, pdl_enter

__all__ = ["decode_draft_indices", "decode_draft_indices_ref"]


@triton.jit(do_not_specialize=["pdl_trigger", "bs", "N", "token_offset"],  # N = k + 1: one variant for every k
            do_not_specialize_on_alignment=["accept_ptr", "seq_ptr", "req_ptr", "gather_ptr",
                                            "seq_out_ptr", "write_start_ptr", "tokens_ptr",
                                            "last_ptr"])  # and any row offset
def _decode_draft_indices_kernel(accept_ptr, seq_ptr, req_ptr, valid_ptr, gather_ptr,
                                 seq_out_ptr, write_start_ptr, tokens_ptr, last_ptr, stride_last,
                                 bs, N, token_offset, BLOCK: tl.constexpr, LAST: tl.constexpr,
                                 pdl_trigger, PDL: tl.constexpr):
    pdl_enter(PDL, pdl_trigger)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < bs
    acc = tl.load(accept_ptr + r, mask=ok, other=1)
    safe = tl.minimum(tl.maximum(acc, 1), N)
    seq = tl.load(seq_ptr + r, mask=ok, other=1)
    req = tl.load(req_ptr + r, mask=ok, other=0)
    valid = tl.load(valid_ptr + req, mask=ok, other=0)
    gather = (token_offset + r.to(tl.int64) * N - 1 + safe).to(tl.int64)
    tl.store(gather_ptr + r, gather, mask=ok)
    if LAST:
        tok = tl.load(tokens_ptr + gather, mask=ok, other=0)
        tl.store(last_ptr + r.to(tl.int64) * stride_last, tok.to(last_ptr.dtype.element_ty), mask=ok)
    tl.store(seq_out_ptr + r, tl.maximum(seq - N + safe, 1).to(tl.int32), mask=ok)
    tl.store(write_start_ptr + r, (valid.to(tl.int64) + acc).to(tl.int64), mask=ok)


def _check(accept, target_seq_lens, req, gather_ids, seq_lens, write_start, n, token_offset,
           tokens, last_token) -> None:
    bs = accept.shape[0]
    for name, t, dtypes in (("accept", accept, INDEX_DTYPES),
                            ("target_seq_lens", target_seq_lens, INDEX_DTYPES),
                            ("req", req, INDEX_DTYPES),
                            ("gather_ids", gather_ids, torch.int64),
                            ("seq_lens", seq_lens, torch.int32),
                            ("write_start", write_start, torch.int64)):
        # unit stride whenever there is a row (strictly: also a single row)
        expect_tensor(name, t, shape=(bs,), dtypes=dtypes, layout="rows" if bs else None)
    if (tokens is None) != (last_token is None):
        raise ValueError("tokens, last_token: expected both or neither")
    if tokens is not None:
        need = token_offset + bs * n
        expect_tensor("tokens", tokens, shape=("len",), dtypes=INDEX_DTYPES, layout="rows")
        if tokens.shape[0] < need:
            raise ValueError(f"tokens: expected at least {need} elements (token_offset + bs * n), "
                             f"got {tokens.shape[0]}")
        expect_tensor("last_token", last_token, shape=(bs,), dtypes=INDEX_DTYPES)


def decode_draft_indices(accept: torch.Tensor, target_seq_lens: torch.Tensor, req: torch.Tensor,
                         valid_cache_lengths: torch.Tensor, n: int, token_offset: int,
                         gather_ids: torch.Tensor, seq_lens: torch.Tensor,
                         write_start: torch.Tensor, tokens: torch.Tensor | None = None,
                         last_token: torch.Tensor | None = None, *,
                         kernels: KernelConfig | None = None) -> None:
    """Write `gather_ids`, `seq_lens`, `write_start` (and with `tokens`, `last_token`) of `bs`
    decode rows (module docstring); `kernels`: the launch settings (None: the default)."""
    _check(accept, target_seq_lens, req, gather_ids, seq_lens, write_start, n, token_offset,
           tokens, last_token)
    bs = accept.shape[0]
    if bs == 0:
        return
    block = rows_block(bs)
    last = tokens is not None
    _decode_draft_indices_kernel[(triton.cdiv(bs, block),)](
        accept, target_seq_lens, req, valid_cache_lengths, gather_ids, seq_lens, write_start,
        tokens if last else gather_ids, last_token if last else gather_ids,
        last_token.stride(0) if last else 0, bs, n, token_offset, BLOCK=block, LAST=last,
        num_warps=1 if block <= 128 else 4, **launch_options(accept.device, bs, kernels=kernels))


def decode_draft_indices_ref(accept: torch.Tensor, target_seq_lens: torch.Tensor, req: torch.Tensor,
                             valid_cache_lengths: torch.Tensor, n: int, token_offset: int,
                             gather_ids: torch.Tensor, seq_lens: torch.Tensor,
                             write_start: torch.Tensor, tokens: torch.Tensor | None = None,
                             last_token: torch.Tensor | None = None) -> None:
    """Torch reference (the drafter's torch path): same arguments and writes."""
    _check(accept, target_seq_lens, req, gather_ids, seq_lens, write_start, n, token_offset,
           tokens, last_token)
    bs = accept.shape[0]
    safe = accept.clamp(1, n)
    rows = torch.arange(bs, device=accept.device) * n - 1 + token_offset
    torch.add(rows, safe, out=gather_ids)
    torch.clamp(target_seq_lens - n + safe, min=1, out=seq_lens)
    torch.add(valid_cache_lengths[req], accept, out=write_start)
    if tokens is not None:
        last_token.copy_(tokens.index_select(0, gather_ids))
