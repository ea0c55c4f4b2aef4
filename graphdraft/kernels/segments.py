"""Several small 1-D copies in one launch: `dst_k[:len(src_k)] = src_k` for up to
`MAX_SEGMENTS` pairs (the staged host values of one step into their device buffers:
`runtime.batch.write_batch` and the padded mixed forward's set-up pack them into one staging
copy, this scatters them).

pairs: `(dst_k, src_k)`, each a 1-D contiguous tensor of one dtype, `len(dst_k) >=
len(src_k)`; dst_k[len(src_k):] untouched; pairs whose source is empty copy nothing. The
destinations must not overlap each other or any source.

`copy_segments_ref` (torch: one copy per pair) is the torch path and the kernel's oracle;
`copy_segments` (Triton) writes the same values in one launch whatever the lengths (they
are runtime values, not specialised on, nor the pointers' alignment: one compiled variant
per number of pairs and dtype signature, the destinations' offsets included).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_tensor
from graphdraft.kernels.config import KernelConfig

__all__ = ["MAX_SEGMENTS", "copy_segments", "copy_segments_ref"]

MAX_SEGMENTS = 12
_BLOCK = 1024

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


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


def copy_segments_ref(pairs: Pairs) -> None:
    """Torch version: one `copy_` per pair with a non-empty source."""
    for dst, src in _check_pairs(pairs):
        dst[: src.shape[0]].copy_(src)


@triton.jit
def _segment(dst_ptr, src_ptr, n, at):
    """Elements `at` (< n) of one segment."""
    mask = at < n
    tl.store(dst_ptr + at, tl.load(src_ptr + at, mask=mask), mask=mask)


_IDS = range(MAX_SEGMENTS)


@triton.jit(do_not_specialize=[f"n{i}" for i in _IDS],  # views at any offset: one variant
            do_not_specialize_on_alignment=[f"{c}{i}" for c in "ds" for i in _IDS])
def _segments_kernel(d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11,
                     s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11,
                     n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11,
                     COUNT: tl.constexpr, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if COUNT > 0:
        _segment(d0, s0, n0, at)
    if COUNT > 1:
        _segment(d1, s1, n1, at)
    if COUNT > 2:
        _segment(d2, s2, n2, at)
    if COUNT > 3:
        _segment(d3, s3, n3, at)
    if COUNT > 4:
        _segment(d4, s4, n4, at)
    if COUNT > 5:
        _segment(d5, s5, n5, at)
    if COUNT > 6:
        _segment(d6, s6, n6, at)
    if COUNT > 7:
        _segment(d7, s7, n7, at)
    if COUNT > 8:
        _segment(d8, s8, n8, at)
    if COUNT > 9:
        _segment(d9, s9, n9, at)
    if COUNT > 10:
        _segment(d10, s10, n10, at)
    if COUNT > 11:
        _segment(d11, s11, n11, at)


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
    _segments_kernel[grid](*dsts, *srcs, *lens, COUNT=len(live), BLOCK=_BLOCK, num_warps=4)
