"""Stage a decode batch's draft inputs into the persistent buffers, padding included, in one launch.

Before the first-step graph replays at the padded size `pbs >= bs` (N tokens per row):
  accept[:bs] = accept_src                first_ids[:bs*N] = tokens_src
  first_hidden[:bs*N] = hidden_src        (the target's hidden states of every input token)
and the padded rows / tokens get the neutral values of `graphdraft.kernels.neutral`:
  rows [bs, pbs):        accept 1, seq_lens 1, req_pool_indices 0 (dummy slot), extend_lens 1
  tokens [bs*N, pbs*N):  first_ids 0, first_hidden 0, input_ids 0, positions 0, out_cache_loc 0
(The first step itself writes every row's write_start, ids and hidden up to pbs.)
When hidden_src already is `first_hidden[:bs*N]` (the caller's target wrote its hidden
states into the drafter's buffer, `EagleDrafter.decode_hidden_buffer`), the copy is skipped
and only the padded tokens' hidden rows are written.

Shapes: accept_src `[bs]` int32/int64, tokens_src `[bs*N]` int32/int64, hidden_src
`[bs*N, kH]` (unit column stride); the destinations are the buffers' full tensors.
Graph-capturable (no sync, no allocation); the torch reference does the same writes
with slices, fills and copies (about 3 launches, 9 more when bs < pbs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_tensor
from graphdraft.kernels.neutral import (
    NEUTRAL_DRAFT_ROW,
    NEUTRAL_DRAFT_TOKEN,
    NEUTRAL_ROW,
    NEUTRAL_TOKEN,
)

__all__ = ["hidden_in_place", "stage_decode_inputs", "stage_decode_inputs_ref"]

BLOCK = 2048
"""Hidden-state columns per program (a row of kH columns takes cdiv(kH, BLOCK) programs when
hidden rows are written; one when none are: hidden in place and no padded rows)."""


@triton.jit(do_not_specialize=["bs", "pbs"])
def _stage_kernel(accept_src, tokens_src, hidden_src, stride_hs, accept, first_ids, first_hidden,
                  stride_fh, seq_lens, req, extend_lens, input_ids, positions, out_cache_loc,
                  bs, pbs, N, KH, BLOCK: tl.constexpr, COPY_HIDDEN: tl.constexpr):
    """Program (t, c): columns [c * BLOCK, (c + 1) * BLOCK) of token row t's hidden state;
    the programs with c == 0 also write row / token t's scalars."""
    t = tl.program_id(0)  # token row in [0, pbs * N); also row t when t < pbs
    t64 = t.to(tl.int64)
    real = (tl.zeros([BLOCK], dtype=tl.int32) + t) < bs * N
    write = ~real  # padded token rows: hidden 0
    if COPY_HIDDEN:
        write = write | real
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < KH
    h = tl.load(hidden_src + t64 * stride_hs + cols, mask=ok & real & write, other=0.0)
    tl.store(first_hidden + t64 * stride_fh + cols, h.to(first_hidden.dtype.element_ty),
             mask=ok & write)
    if tl.program_id(1) == 0:
        # Per-token and per-row scalars as 1-wide vectors (masked scalars trip the interpreter).
        i = t64 + tl.arange(0, 1)
        tok_real = i < bs * N
        tok = tl.load(tokens_src + i, mask=tok_real, other=0)
        tl.store(first_ids + i, tok.to(tl.int64))
        zero = tl.zeros([1], dtype=tl.int64)
        tl.store(input_ids + i, zero.to(input_ids.dtype.element_ty), mask=~tok_real)
        tl.store(positions + i, zero.to(positions.dtype.element_ty), mask=~tok_real)
        tl.store(out_cache_loc + i, zero.to(out_cache_loc.dtype.element_ty), mask=~tok_real)
        row = i < pbs
        row_real = i < bs
        a = tl.load(accept_src + i, mask=row_real, other=1)
        tl.store(accept + i, a.to(accept.dtype.element_ty), mask=row)
        pad = row & ~row_real
        one = zero + 1
        tl.store(seq_lens + i, one.to(seq_lens.dtype.element_ty), mask=pad)
        tl.store(req + i, zero.to(req.dtype.element_ty), mask=pad)
        tl.store(extend_lens + i, one.to(extend_lens.dtype.element_ty), mask=pad)


def _check(bs: int, pbs: int, n: int, accept_src, tokens_src, hidden_src, accept, first_ids,
           first_hidden, seq_lens, req, extend_lens, input_ids, positions, out_cache_loc) -> None:
    if not 0 <= bs <= pbs:
        raise ValueError(f"pbs: expected >= bs ({bs}), got {pbs}")
    for name, t, rows in (("accept", accept, pbs), ("seq_lens", seq_lens, pbs), ("req", req, pbs),
                          ("extend_lens", extend_lens, pbs), ("first_ids", first_ids, pbs * n),
                          ("input_ids", input_ids, pbs * n), ("positions", positions, pbs * n),
                          ("out_cache_loc", out_cache_loc, pbs * n),
                          ("first_hidden", first_hidden, pbs * n)):
        if t.shape[0] < rows or not t.is_contiguous():  # a capacity, not a shape
            raise ValueError(f"{name}: expected a contiguous buffer of >= {rows} rows, got "
                             f"{tuple(t.shape)}")
    expect_tensor("accept_lengths", accept_src, shape=(bs,))
    expect_tensor("output_tokens", tokens_src, shape=(bs * n,))
    # unit column stride whenever there is a row
    expect_tensor("hidden_states", hidden_src, shape=(bs * n, first_hidden.shape[1]),
                  layout="rows" if bs else None)
    if (bs and hidden_src.untyped_storage().data_ptr() == first_hidden.untyped_storage().data_ptr()
            and not hidden_in_place(hidden_src, first_hidden)):
        raise ValueError("hidden_states: expected a tensor apart from the drafter's first_hidden "
                         "buffer, or exactly its first rows (decode_hidden_buffer(bs))")


def hidden_in_place(hidden_src: torch.Tensor, first_hidden: torch.Tensor) -> bool:
    """Whether `hidden_src` is the view `first_hidden[:len(hidden_src)]` (nothing to copy)."""
    return (hidden_src.numel() > 0 and hidden_src.data_ptr() == first_hidden.data_ptr()
            and hidden_src.stride() == first_hidden.stride() and hidden_src.dtype == first_hidden.dtype)


def stage_decode_inputs(bs: int, pbs: int, n: int, accept_src: torch.Tensor, tokens_src: torch.Tensor,
                        hidden_src: torch.Tensor, *, accept: torch.Tensor, first_ids: torch.Tensor,
                        first_hidden: torch.Tensor, seq_lens: torch.Tensor, req: torch.Tensor,
                        extend_lens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                        out_cache_loc: torch.Tensor) -> None:
    """One launch: the writes of the module docstring."""
    args = (accept_src, tokens_src, hidden_src, accept, first_ids, first_hidden, seq_lens, req,
            extend_lens, input_ids, positions, out_cache_loc)
    _check(bs, pbs, n, *args)
    if pbs == 0:
        return
    kh = first_hidden.shape[1]
    block = min(BLOCK, triton.next_power_of_2(kh))
    copy = not hidden_in_place(hidden_src, first_hidden)
    _stage_kernel[(pbs * n, triton.cdiv(kh, block) if copy or pbs > bs else 1)](
        accept_src, tokens_src, hidden_src, hidden_src.stride(0) if bs else kh, accept, first_ids,
        first_hidden, first_hidden.stride(0), seq_lens, req, extend_lens, input_ids, positions,
        out_cache_loc, bs, pbs, n, kh, BLOCK=block, COPY_HIDDEN=copy, num_warps=4)


def stage_decode_inputs_ref(bs: int, pbs: int, n: int, accept_src: torch.Tensor,
                            tokens_src: torch.Tensor, hidden_src: torch.Tensor, *, accept: torch.Tensor,
                            first_ids: torch.Tensor, first_hidden: torch.Tensor, seq_lens: torch.Tensor,
                            req: torch.Tensor, extend_lens: torch.Tensor, input_ids: torch.Tensor,
                            positions: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
    """Torch reference: the same writes with copies and fills."""
    _check(bs, pbs, n, accept_src, tokens_src, hidden_src, accept, first_ids, first_hidden,
           seq_lens, req, extend_lens, input_ids, positions, out_cache_loc)
    t, pt = bs * n, pbs * n
    accept[:bs].copy_(accept_src)
    first_ids[:t].copy_(tokens_src)
    if not hidden_in_place(hidden_src, first_hidden):
        first_hidden[:t].copy_(hidden_src)
    if pbs > bs:  # the neutral values of graphdraft.kernels.neutral
        rows = {"accept_lengths": accept, "seq_lens": seq_lens, "req_pool_indices": req,
                "extend_lens": extend_lens}
        tokens = {"first_input_ids": first_ids, "first_hidden": first_hidden,
                  "input_ids": input_ids, "positions": positions, "out_cache_loc": out_cache_loc}
        neutral_rows = NEUTRAL_ROW | {"accept_lengths": NEUTRAL_DRAFT_ROW["accept_lengths"]}
        neutral_tokens = NEUTRAL_TOKEN | NEUTRAL_DRAFT_TOKEN
        for name, buf in rows.items():
            buf[bs:pbs] = neutral_rows[name]
        for name, buf in tokens.items():
            buf[t:pt] = neutral_tokens[name]
