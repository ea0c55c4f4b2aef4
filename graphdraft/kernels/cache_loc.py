"""Out-cache locations and position refresh for paged KV, as Triton kernels.

Layouts (all tensors on one device; index inputs may be int32 or int64):

- ``req_to_page``: ``[max_reqs, max_pages]`` int32, any strides. Row ``r`` lists
  the page ids of request slot ``r``. Page 0 is the reserved dummy page.
- KV slot of position ``p`` of request slot ``r``::

      req_to_page[r, p // page_size] * page_size + p % page_size

  It is the dummy slot 0 instead when ``p < 0``, when ``p // page_size >=
  max_pages`` (past the page table), when the page id is ``<= 0``, or when
  ``r`` is outside ``[0, max_reqs)``.
- ``req_pool_indices``, ``cache_start``: ``[bs]``, int32 or int64, any stride.
- Out-cache locations (``out``) and ``positions_out``: int64, contiguous,
  indexed as flat memory.
- ``advance_positions_and_seq_lens``: ``seq_lens`` ``[bs]`` int32, ``positions``
  ``[bs]`` int64, any stride, updated in place.

The launch wrappers are CUDA-graph capturable: they never sync with the device,
never allocate, and size the grid from host shapes only. ``max_pages``, the
page-table strides and ``page_size`` are run-time kernel arguments, so one
compiled kernel serves every page-table size. The ``*_ref`` functions are the plain torch
references with the same signatures: `ops`' torch path and the tests' oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import INDEX_DTYPES, expect_int, expect_tensor
from graphdraft.kernels.buckets import rows_block
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.pdl import launch_options, pdl_enter

__all__ = [
    "compute_out_cache_loc_uniform",
    "compute_out_cache_loc_uniform_ref",
    "advance_positions_and_seq_lens",
    "advance_positions_and_seq_lens_ref",
    "kv_slot",
    "kv_slots",
]

_MAX_TOKEN_BLOCK = 128  # tokens per loop iteration, uniform kernel (upper bound)

# --------------------------------------------------------------------------- kernels


@triton.jit
def _slot(
    req_to_page_ptr,
    r,
    pos,
    mask,
    n_reqs,
    max_pages,
    stride_page_row,
    stride_page_col,
    page_size,
):
    """KV slot (int64) of positions ``pos`` (int64 vector) of request slot ``r``."""
    # A request slot outside the table sees zero pages. (Folded into a scalar bound:
    # the interpreter mis-broadcasts `vector_bool & scalar_bool`.)
    n_pages = tl.where((r >= 0) & (r < n_reqs), max_pages, 0)
    page_idx = pos // page_size
    valid = mask & (pos >= 0) & (page_idx < n_pages)
    page = tl.load(
        req_to_page_ptr + r * stride_page_row + page_idx * stride_page_col,
        mask=valid,
        other=0,
    ).to(tl.int64)
    return tl.where(valid & (page > 0), page * page_size + pos % page_size, 0)


# stride_out_tok is bs in the [length, bs] layout (the draft steps' slots): not specialized
@triton.jit(do_not_specialize=["pdl_trigger", "stride_out_tok", "n_reqs", "max_pages",
                               "stride_page_row", "stride_page_col"])
def _uniform_kernel(
    out_ptr,
    req_pool_ptr,
    start_ptr,
    req_to_page_ptr,
    length,
    stride_out_req,
    stride_out_tok,
    stride_req_pool,
    stride_start,
    n_reqs,
    max_pages,
    stride_page_row,
    stride_page_col,
    page_size,
    pos_out_ptr,
    seq_out_ptr,
    BLOCK: tl.constexpr,
    FIRST: tl.constexpr,
    pdl_trigger,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    """EARLY (with PDL): the row's request, start and first block of slots are loaded before
    waiting for the kernel before (pdl module doc); every store after."""
    if not EARLY:
        pdl_enter(PDL, pdl_trigger)
    row = tl.program_id(0).to(tl.int64)
    r = tl.load(req_pool_ptr + row * stride_req_pool).to(tl.int64)
    start = tl.load(start_ptr + row * stride_start).to(tl.int64)
    j0_loop = 0
    if EARLY:
        j = tl.arange(0, BLOCK).to(tl.int64)
        mask = j < length
        slot = _slot(
            req_to_page_ptr, r, start + j, mask,
            n_reqs, max_pages, stride_page_row, stride_page_col, page_size,
        )
        pdl_enter(PDL, pdl_trigger)
        tl.store(out_ptr + row * stride_out_req + j * stride_out_tok, slot, mask=mask)
        j0_loop = BLOCK
    if FIRST:  # the first written position and the KV length once it is written
        tl.store(pos_out_ptr + row, start)
        tl.store(seq_out_ptr + row, (start + 1).to(tl.int32))
    for j0 in range(j0_loop, length, BLOCK):
        j = (j0 + tl.arange(0, BLOCK)).to(tl.int64)
        mask = j < length
        slot = _slot(
            req_to_page_ptr, r, start + j, mask,
            n_reqs, max_pages, stride_page_row, stride_page_col, page_size,
        )
        tl.store(out_ptr + row * stride_out_req + j * stride_out_tok, slot, mask=mask)


@triton.jit(do_not_specialize=["pdl_trigger", "n"])
def _advance_kernel(seq_lens_ptr, positions_ptr, n, stride_seq, stride_pos, delta, BLOCK: tl.constexpr,
                    pdl_trigger, PDL: tl.constexpr, EARLY: tl.constexpr):
    """EARLY (with PDL): loads before waiting for the kernel before (pdl module doc), stores
    after."""
    if not EARLY:
        pdl_enter(PDL, pdl_trigger)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = i < n
    s = tl.load(seq_lens_ptr + i * stride_seq, mask=mask, other=0)
    p = tl.load(positions_ptr + i * stride_pos, mask=mask, other=0)
    if EARLY:
        pdl_enter(PDL, pdl_trigger)
    tl.store(seq_lens_ptr + i * stride_seq, (s + delta).to(tl.int32), mask=mask)
    tl.store(positions_ptr + i * stride_pos, (p + delta).to(tl.int64), mask=mask)


# --------------------------------------------------------------------------- validation


def _check_out(t: object, device: torch.device, min_numel: int) -> torch.Tensor:
    """`out`: contiguous int64 on `device` holding at least `min_numel` elements."""
    expect_tensor("out", t, dtypes=torch.int64, device=device, layout="contiguous")
    if t.numel() < min_numel:
        raise ValueError(f"out: expected at least {min_numel} elements, got {t.numel()}")
    return t


def _uniform_strides(length: int, stride_req: int | None, stride_tok: int | None) -> tuple[int, int]:
    stride_req = length if stride_req is None else expect_int("out_stride_req", stride_req, 0)
    stride_tok = 1 if stride_tok is None else expect_int("out_stride_tok", stride_tok, 0)
    return stride_req, stride_tok


def _check_uniform(out, req_pool_indices, cache_start, req_to_page, page_size, length,
                   out_stride_req, out_stride_tok, positions_out, seq_lens_out) -> tuple:
    """The uniform write's argument checks (the kernel's and the reference's): `(device, bs,
    page_size, length, stride_req, stride_tok, elements of out needed, first-step outputs?)`."""
    expect_tensor("req_to_page", req_to_page, shape=("max_reqs", "max_pages"), dtypes=torch.int32)
    dev = req_to_page.device
    bs = expect_tensor("req_pool_indices", req_pool_indices, shape=("bs",), dtypes=INDEX_DTYPES,
                       device=dev).shape[0]
    expect_tensor("cache_start", cache_start, shape=(bs,), dtypes=INDEX_DTYPES, device=dev)
    page_size = expect_int("page_size", page_size, 1)
    length = expect_int("length", length, 0)
    s_req, s_tok = _uniform_strides(length, out_stride_req, out_stride_tok)
    need = 0 if bs == 0 or length == 0 else (bs - 1) * s_req + (length - 1) * s_tok + 1
    _check_out(out, dev, need)
    first = check_first_step_outputs(positions_out, seq_lens_out, dev, bs)
    return dev, bs, page_size, length, s_req, s_tok, need, first


# --------------------------------------------------------------------------- wrappers


def compute_out_cache_loc_uniform(
    out: torch.Tensor,
    req_pool_indices: torch.Tensor,
    cache_start: torch.Tensor,
    req_to_page: torch.Tensor,
    page_size: int,
    length: int,
    *,
    out_stride_req: int | None = None,
    out_stride_tok: int | None = None,
    positions_out: torch.Tensor | None = None,
    seq_lens_out: torch.Tensor | None = None,
    kernels: KernelConfig | None = None,
) -> None:
    """Fill ``out`` with the KV slots of ``length`` consecutive positions per request.

    ``out[r * out_stride_req + j * out_stride_tok] = slot(req_pool_indices[r],
    cache_start[r] + j)`` for ``r < bs``, ``j < length`` (flat indices into ``out``).
    Default strides give row-major ``[bs, length]``; ``out_stride_req=1,
    out_stride_tok=bs`` gives ``[length, bs]`` (one contiguous slice per draft step).

    Args:
        out: int64, contiguous, at least ``(bs-1)*stride_req + (length-1)*stride_tok + 1``.
        req_pool_indices: ``[bs]`` int32/int64 request slots (rows of ``req_to_page``).
        cache_start: ``[bs]`` int32/int64 first position written per request.
        req_to_page: ``[max_reqs, max_pages]`` int32 page table.
        page_size: tokens per page (>= 1).
        length: tokens per request (>= 0).
        positions_out, seq_lens_out: both or neither: contiguous ``[bs]`` int64 / int32 that
            receive ``cache_start[r]`` and ``cache_start[r] + 1`` (the first draft decode
            step's position and KV length), in the same launch.
    """
    dev, bs, page_size, length, s_req, s_tok, need, first = _check_uniform(
        out, req_pool_indices, cache_start, req_to_page, page_size, length, out_stride_req,
        out_stride_tok, positions_out, seq_lens_out)
    if bs == 0 or (need == 0 and not first):
        return
    block = min(triton.next_power_of_2(max(length, 1)), _MAX_TOKEN_BLOCK)
    _uniform_kernel[(bs,)](
        out, req_pool_indices, cache_start, req_to_page,
        length, s_req, s_tok,
        req_pool_indices.stride(0), cache_start.stride(0),
        req_to_page.shape[0], req_to_page.shape[1], req_to_page.stride(0), req_to_page.stride(1),
        page_size,
        positions_out if first else out, seq_lens_out if first else out,
        BLOCK=block, FIRST=first, **launch_options(dev, bs, early=True, kernels=kernels),
    )


def check_first_step_outputs(positions_out: torch.Tensor | None, seq_lens_out: torch.Tensor | None,
                         device: torch.device, bs: int) -> bool:
    if (positions_out is None) != (seq_lens_out is None):
        raise ValueError("positions_out, seq_lens_out: expected both or neither")
    if positions_out is None:
        return False
    for name, t, dtype in (("positions_out", positions_out, torch.int64),
                           ("seq_lens_out", seq_lens_out, torch.int32)):
        expect_tensor(name, t, shape=(bs,), dtypes=dtype, device=device, layout="contiguous")
    return True


def advance_positions_and_seq_lens(seq_lens: torch.Tensor, positions: torch.Tensor, delta: int = 1,
                                   *, kernels: KernelConfig | None = None) -> None:
    """In place, one launch: ``seq_lens[:] += delta; positions[:] += delta``.

    Args:
        seq_lens: ``[bs]`` int32 (any stride).
        positions: ``[bs]`` int64 (any stride), same device.
        delta: python int, baked into a captured graph.
    """
    expect_tensor("seq_lens", seq_lens, shape=("bs",), dtypes=torch.int32)
    expect_tensor("positions", positions, shape=tuple(seq_lens.shape), dtypes=torch.int64,
                  device=seq_lens.device)  # seq_lens' shape and device
    expect_int("delta", delta)
    bs = seq_lens.shape[0]
    if bs == 0:
        return
    block = rows_block(bs)
    _advance_kernel[(triton.cdiv(bs, block),)](
        seq_lens, positions, bs, seq_lens.stride(0), positions.stride(0), delta, BLOCK=block,
        **launch_options(seq_lens.device, bs, early=True, kernels=kernels),
    )


# --------------------------------------------------------------------------- references


def kv_slot(req_to_page: torch.Tensor, req: torch.Tensor | int, pos: torch.Tensor,
            page_size: int) -> torch.Tensor:
    """The KV slot formula, the one torch home of it (`runtime.kv_cache` re-exports it): int64
    `req_to_page[req, pos // page_size] * page_size + pos % page_size` (`req` and `pos`
    broadcast; the page index is clamped into the table, so a position past it reads the
    last column: callers that can see such positions, or page ids <= 0, mask the result to
    the dummy slot 0 themselves, as `kv_slots` does). The Triton kernels compute the same in
    their own bodies (`_slot`)."""
    page_idx = torch.div(pos, page_size, rounding_mode="floor").clamp(0, req_to_page.shape[1] - 1)
    return req_to_page[req, page_idx].long() * page_size + torch.remainder(pos, page_size)


def kv_slots(req_to_page: torch.Tensor, req_pool_indices: torch.Tensor, positions: torch.Tensor,
             page_size: int) -> torch.Tensor:
    """Slots of `positions` in torch (`kv_slot`, the formula's one home);
    `req_pool_indices` broadcasts against it; the dummy slot 0 where unmapped: a negative
    position, one past the table, a page id <= 0 (the kernels' `_slot` rules)."""
    inside = (positions >= 0) & (positions < req_to_page.shape[1] * page_size)
    slot = kv_slot(req_to_page, req_pool_indices, positions, page_size)
    return torch.where(inside & (slot >= page_size), slot, torch.zeros_like(slot))  # page > 0


def compute_out_cache_loc_uniform_ref(
    out: torch.Tensor,
    req_pool_indices: torch.Tensor,
    cache_start: torch.Tensor,
    req_to_page: torch.Tensor,
    page_size: int,
    length: int,
    *,
    out_stride_req: int | None = None,
    out_stride_tok: int | None = None,
    positions_out: torch.Tensor | None = None,
    seq_lens_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of :func:`compute_out_cache_loc_uniform` (`ops.out_cache_loc_uniform`'s
    torch path): the same checks and writes, vectorized (no host sync); fills and returns
    ``out``. A request slot outside the table also writes the dummy slot 0."""
    dev, bs, page_size, length, s_req, s_tok, need, first = _check_uniform(
        out, req_pool_indices, cache_start, req_to_page, page_size, length, out_stride_req,
        out_stride_tok, positions_out, seq_lens_out)
    if need:
        req = req_pool_indices.long().unsqueeze(1)                                   # [bs, 1]
        pos = cache_start.long().unsqueeze(1) + torch.arange(length, device=dev)     # [bs, length]
        known = (req >= 0) & (req < req_to_page.shape[0])
        slots = kv_slots(req_to_page, req.clamp(0, req_to_page.shape[0] - 1), pos, page_size)
        slots = torch.where(known, slots, torch.zeros_like(slots))
        if s_req == 1 and s_tok == bs:  # [length, bs]: the drafter's layout, one copy
            out[: length * bs].view(length, bs).copy_(slots.t())
        else:
            idx = (torch.arange(bs, device=dev).unsqueeze(1) * s_req
                   + torch.arange(length, device=dev) * s_tok)
            out.view(-1).index_copy_(0, idx.reshape(-1), slots.reshape(-1).to(out.dtype))
    if first:
        positions_out.copy_(cache_start)
        seq_lens_out.copy_(cache_start + 1)
    return out


def advance_positions_and_seq_lens_ref(
    seq_lens: torch.Tensor, positions: torch.Tensor, delta: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`advance_positions_and_seq_lens`; in place, returns both."""
    seq_lens += delta
    positions += delta
    return seq_lens, positions
