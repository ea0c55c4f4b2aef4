"""Inputs of kernels that take over a producer's last step: row gathers and split-K partials.

Row index `[M]` (int32/int64, contiguous): row m of the kernel's input is `x[index[m]]`, which
replaces an `x.index_select(0, index)` launch before the kernel. Index values are not checked
(that would be a host sync): they must lie in `[0, x.shape[0])`.
"""

from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def check_row_index(name: str, index: torch.Tensor, rows: int, device: torch.device) -> None:
    """ValueError naming `name` unless `index` is a contiguous int32/int64 `[rows]` on `device`."""
    if (index.dim() != 1 or index.shape[0] != rows or index.dtype not in INDEX_DTYPES
            or index.device != device or not index.is_contiguous()):
        raise ValueError(f"{name}: expected a contiguous int32/int64 [{rows}] tensor on {device}, "
                         f"got {index.dtype} {tuple(index.shape)} on {index.device}")
