"""Inputs of kernels that take over a producer's last step: row gathers and split-K partials.

Row index `[M]` (int32/int64, contiguous): row m of the kernel's input is `x[index[m]]`, which
replaces an `x.index_select(0, index)` launch before the kernel. Index values are not checked
(that would be a host sync): they must lie in `[0, x.shape[0])`.

Split-K partials `[split, M, N]` (fp32, contiguous, split >= 1): the unsummed output of a
split-K GEMV (`gemv.linear_small_m_partials`), which replaces the GEMV's own split-sum launch.
Every kernel that consumes them sums with `sum_partials` and rounds once to the activation
dtype, so it sees the bits `gemv.linear_small_m` would have written: split 1 is the GEMV's own
fp32 accumulator (which `linear_small_m` rounds and stores directly), split > 1 is summed in
the order of `gemv`'s split-sum kernels (s = 0, 1, ... added onto 0.0 in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INDEX_DTYPES = (torch.int32, torch.int64)


def check_row_index(name: str, index: torch.Tensor, rows: int, device: torch.device) -> None:
    """ValueError naming `name` unless `index` is a contiguous int32/int64 `[rows]` on `device`."""
    if (index.dim() != 1 or index.shape[0] != rows or index.dtype not in INDEX_DTYPES
            or index.device != device or not index.is_contiguous()):
        raise ValueError(f"{name}: expected a contiguous int32/int64 [{rows}] tensor on {device}, "
                         f"got {index.dtype} {tuple(index.shape)} on {index.device}")


def check_rows_out(name: str, out: torch.Tensor, rows: int, width: int, dtype: torch.dtype,
                   device: torch.device) -> None:
    """ValueError naming `name` unless `out` is a `[rows, width]` `dtype` destination on
    `device` with unit column stride (any row stride: a view of a persistent buffer)."""
    if (tuple(out.shape) != (rows, width) or out.dtype != dtype or out.device != device
            or out.stride(-1) != 1):
        raise ValueError(f"{name}: expected [{rows}, {width}] {dtype} on {device} with unit column "
                         f"stride, got {tuple(out.shape)} {out.dtype} on {out.device}")


def check_partials(name: str, ws: torch.Tensor, m: int, n: int, device: torch.device) -> None:
    """ValueError naming `name` unless `ws` is contiguous float32 `[split, m, n]` on `device`."""
    if (ws.dim() != 3 or ws.shape[0] < 1 or tuple(ws.shape[1:]) != (m, n)
            or ws.dtype != torch.float32 or ws.device != device or not ws.is_contiguous()):
        raise ValueError(f"{name}: expected contiguous float32 split-K partials [split, {m}, {n}] "
                         f"on {device}, got {ws.dtype} {tuple(ws.shape)} on {ws.device}")


@triton.jit
def sum_partials(ptrs, split_stride, mask, SPLIT: tl.constexpr):
    """fp32 sum of the SPLIT partials at `ptrs + s * split_stride` (masked lanes: 0.0): the
    partial itself when SPLIT == 1, else added in the order s = 0, 1, ... onto 0.0."""
    if SPLIT == 1:
        acc = tl.load(ptrs, mask=mask, other=0.0)
    else:
        acc = tl.zeros(ptrs.shape, dtype=tl.float32)
        for s in range(SPLIT):
            acc += tl.load(ptrs + s * split_stride, mask=mask, other=0.0)
    return acc
