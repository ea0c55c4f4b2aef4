"""Several constant fills in one launch: `dst_k[:] = value_k` for up to `MAX_FILLS` 1-D
contiguous views (the neutral rows / tokens a padded step writes into its buffers:
`runtime.buffers.neutral_fills`).

fills: `(dst_k, value_k)`, dst_k a 1-D contiguous tensor (a 2-D buffer's rows: its rows'
`view(-1)`), value_k a Python int, |value_k| < 2**24, written as `dst_k.fill_(value_k)`
writes it (converted to dst_k's dtype; the neutral values are small ints: floats are
refused, a 32-bit float scalar could round where `fill_` would not). Destinations must not
overlap.

`fill_segments_ref` (torch: one `fill_` per view) is the torch path and the kernel's oracle;
`fill_segments` (Triton) writes the same values in one launch, the lengths and values
runtime values (not specialised on: one compiled variant per number of fills and dtype
signature).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_tensor
from graphdraft.kernels.config import KernelConfig

__all__ = ["MAX_FILLS", "fill_segments", "fill_segments_ref"]

MAX_FILLS = 12
_BLOCK = 1024

Fills = Sequence[tuple[torch.Tensor, int]]


def _check(fills: Fills) -> list[tuple[torch.Tensor, int]]:
    """The fills with a non-empty destination (each checked, module doc)."""
    if len(fills) > MAX_FILLS:
        raise ValueError(f"fills: expected at most {MAX_FILLS}, got {len(fills)}")
    dev = fills[0][0].device if fills else None
    out = []
    for i, (dst, value) in enumerate(fills):
        expect_tensor(f"fills[{i}] destination", dst, shape=("n",), device=dev,
                      layout="contiguous")
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 2**24:
            raise ValueError(f"fills[{i}] value: expected an int, |value| < 2**24, got "
                             f"{value!r}")
        if dst.shape[0]:
            out.append((dst, value))
    return out


def fill_segments_ref(fills: Fills) -> None:
    """Torch version: one `fill_` per non-empty destination."""
    for dst, value in _check(fills):
        dst.fill_(value)


@triton.jit
def _fill(dst_ptr, value, n, at):
    ty = dst_ptr.dtype.element_ty
    if ty.is_floating():  # through float32 (exact for |value| < 2**24), then rounded as fill_
        x = value.to(tl.float32)
    else:
        x = value.to(tl.int64)
    v = (tl.zeros_like(at).to(x.dtype) + x).to(ty)
    tl.store(dst_ptr + at, v, mask=at < n)


_IDS = range(MAX_FILLS)


@triton.jit(do_not_specialize=[f"{c}{i}" for c in "nv" for i in _IDS],
            do_not_specialize_on_alignment=[f"d{i}" for i in _IDS])
def _fill_kernel(d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11,
                 v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11,
                 n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11,
                 NFILL: tl.constexpr, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if NFILL > 0:
        _fill(d0, v0, n0, at)
    if NFILL > 1:
        _fill(d1, v1, n1, at)
    if NFILL > 2:
        _fill(d2, v2, n2, at)
    if NFILL > 3:
        _fill(d3, v3, n3, at)
    if NFILL > 4:
        _fill(d4, v4, n4, at)
    if NFILL > 5:
        _fill(d5, v5, n5, at)
    if NFILL > 6:
        _fill(d6, v6, n6, at)
    if NFILL > 7:
        _fill(d7, v7, n7, at)
    if NFILL > 8:
        _fill(d8, v8, n8, at)
    if NFILL > 9:
        _fill(d9, v9, n9, at)
    if NFILL > 10:
        _fill(d10, v10, n10, at)
    if NFILL > 11:
        _fill(d11, v11, n11, at)


def fill_segments(fills: Fills, *, kernels: KernelConfig | None = None) -> None:
    """Triton version of `fill_segments_ref`: one launch (none when every destination is
    empty). `kernels`: the launch settings (None: the default; this launch reads none)."""
    live = _check(fills)
    if not live:
        return
    pad = MAX_FILLS - len(live)
    dsts = [d for d, _ in live] + [live[0][0]] * pad
    values = [v for _, v in live] + [0] * pad
    lens = [d.shape[0] for d, _ in live] + [0] * pad
    grid = (triton.cdiv(max(lens), _BLOCK),)
    _fill_kernel[grid](*dsts, *values, *lens, NFILL=len(live), BLOCK=_BLOCK, num_warps=4)
