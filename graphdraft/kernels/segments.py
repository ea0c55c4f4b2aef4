"""Several small 1-D writes in one launch, up to `MAX_SEGMENTS` of them: copies
`dst_k[:len(src_k)] = src_k` (`copy_segments`: the staged host values of one step into their
device buffers; `runtime.batch.write_batch` packs them into one staging copy, this scatters
them) or constant fills `dst_k[:] = value_k` (`fill_segments`: the neutral rows / tokens a
padded step writes into its buffers, `runtime.buffers.neutral_fills`).

copy pairs: `(dst_k, src_k)`, each a 1-D contiguous tensor of one dtype, `len(dst_k) >=
len(src_k)`; dst_k[len(src_k):] untouched; pairs whose source is empty copy nothing.
fills: `(dst_k, value_k)`, dst_k a 1-D contiguous tensor (a 2-D buffer's rows: its rows'
`view(-1)`), value_k a Python int, |value_k| < 2**24, written as `dst_k.fill_(value_k)`
writes it (converted to dst_k's dtype; the neutral values are small ints: floats are
refused, a 32-bit float scalar could round where `fill_` would not).
Destinations must not overlap each other or any source.

`copy_segments_ref` / `fill_segments_ref` (torch: one `copy_` / `fill_` per segment) are the
torch path and the kernel's oracles; `copy_segments` / `fill_segments` (Triton, one kernel
`_segments_kernel`) write the same values in one launch whatever the lengths and values
(runtime values, not specialised on, nor the pointers' alignment: one compiled variant per
kind, number of segments and dtype signature, the destinations' offsets included).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_tensor
from graphdraft.kernels.config import KernelConfig

__all__ = ["MAX_SEGMENTS", "copy_segments", "copy_segments_ref", "fill_segments",
           "fill_segments_ref"]

MAX_SEGMENTS = 12
_BLOCK = 1024

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]
Fills = Sequence[tuple[torch.Tensor, int]]


def _check_pairs(pairs: Pairs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The pairs whose source is not empty (each checked, module doc)."""
    if len(pairs) > MAX_SEGMENTS:
        raise ValueError(f"pairs: expected at most {MAX_SEGMENTS}, got {len(pairs)}")
    dev = pairs[0][0].device if pairs else None
    out = []
    for i, (dst, src) in enumerate(pairs):
        expect_tensor(f"pairs[{i}] destination", dst, shape=("n",), device=dev,
                      layout="contiguous")
        expect_tensor(f"pairs[{i}] source", src, shape=("m",), dtypes=dst.dtype, device=dev,
                      layout="contiguous")
        if src.shape[0] > dst.shape[0]:
            raise ValueError(f"pairs[{i}] source: expected at most {dst.shape[0]} values "
                             f"(its destination's length), got {src.shape[0]}")
        if src.shape[0]:
            out.append((dst, src))
    return out


def _check_fills(fills: Fills) -> list[tuple[torch.Tensor, int]]:
    """The fills with a non-empty destination (each checked, module doc)."""
    if len(fills) > MAX_SEGMENTS:
        raise ValueError(f"fills: expected at most {MAX_SEGMENTS}, got {len(fills)}")
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


def copy_segments_ref(pairs: Pairs) -> None:
    """Torch version: one `copy_` per pair with a non-empty source."""
    for dst, src in _check_pairs(pairs):
        dst[: src.shape[0]].copy_(src)


def fill_segments_ref(fills: Fills) -> None:
    """Torch version: one `fill_` per non-empty destination."""
    for dst, value in _check_fills(fills):
        dst.fill_(value)


@triton.jit
def _segment(dst_ptr, src, n, at, FILL: tl.constexpr):
    """Elements `at` (< n) of one segment: `src` a pointer to copy from, or (FILL) an int."""
    mask = at < n
    if FILL:
        ty = dst_ptr.dtype.element_ty
        if ty.is_floating():  # through float32 (exact for |src| < 2**24), rounded as fill_
            x = src.to(tl.float32)
        else:
            x = src.to(tl.int64)
        tl.store(dst_ptr + at, (tl.zeros_like(at).to(x.dtype) + x).to(ty), mask=mask)
    else:
        tl.store(dst_ptr + at, tl.load(src + at, mask=mask), mask=mask)


_IDS = range(MAX_SEGMENTS)


@triton.jit(do_not_specialize=[f"{c}{i}" for c in "ns" for i in _IDS],
            do_not_specialize_on_alignment=[f"{c}{i}" for c in "ds" for i in _IDS])
def _segments_kernel(d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11,
                     s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11,
                     n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11,
                     COUNT: tl.constexpr, FILL: tl.constexpr, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if COUNT > 0:
        _segment(d0, s0, n0, at, FILL)
    if COUNT > 1:
        _segment(d1, s1, n1, at, FILL)
    if COUNT > 2:
        _segment(d2, s2, n2, at, FILL)
    if COUNT > 3:
        _segment(d3, s3, n3, at, FILL)
    if COUNT > 4:
        _segment(d4, s4, n4, at, FILL)
    if COUNT > 5:
        _segment(d5, s5, n5, at, FILL)
    if COUNT > 6:
        _segment(d6, s6, n6, at, FILL)
    if COUNT > 7:
        _segment(d7, s7, n7, at, FILL)
    if COUNT > 8:
        _segment(d8, s8, n8, at, FILL)
    if COUNT > 9:
        _segment(d9, s9, n9, at, FILL)
    if COUNT > 10:
        _segment(d10, s10, n10, at, FILL)
    if COUNT > 11:
        _segment(d11, s11, n11, at, FILL)


def copy_segments(pairs: Pairs, *, kernels: KernelConfig | None = None) -> None:
    """Triton version of `copy_segments_ref`: one launch (none when every source is empty).
    `kernels`: the launch settings (None: the default; this launch reads none)."""
    if not _check_pairs(pairs):
        return
    # every pair with a destination keeps its place (an empty source reads its destination's
    # pointer, never dereferenced): the same compiled variant whichever sources are empty
    live = [(d, s if s.shape[0] else d) for d, s in pairs if d.shape[0]]
    lens = [s.shape[0] for d, s in pairs if d.shape[0]]
    pad = MAX_SEGMENTS - len(live)
    dsts = [d for d, _ in live] + [live[0][0]] * pad
    srcs = [s for _, s in live] + [live[0][1]] * pad
    lens += [0] * pad
    grid = (triton.cdiv(max(lens), _BLOCK),)
    _segments_kernel[grid](*dsts, *srcs, *lens, COUNT=len(live), FILL=False, BLOCK=_BLOCK,
                           num_warps=4)


def fill_segments(fills: Fills, *, kernels: KernelConfig | None = None) -> None:
    """Triton version of `fill_segments_ref`: one launch (none when every destination is
    empty). `kernels`: the launch settings (None: the default; this launch reads none)."""
    live = _check_fills(fills)
    if not live:
        return
    pad = MAX_SEGMENTS - len(live)
    dsts = [d for d, _ in live] + [live[0][0]] * pad
    values = [v for _, v in live] + [0] * pad
    lens = [d.shape[0] for d, _ in live] + [0] * pad
    grid = (triton.cdiv(max(lens), _BLOCK),)
    _segments_kernel[grid](*dsts, *values, *lens, COUNT=len(live), FILL=True, BLOCK=_BLOCK,
                           num_warps=4)
