"""Inputs of kernels that take over a producer's last step: row gathers and split-K partials.

Row index `[M]` (int32/int64, contiguous; `checks.INDEX_DTYPES`): row m of the kernel's input is `x[index[m]]`, which
replaces an `x.index_select(0, index)` launch before the kernel. Index values are not checked
(that would be a host sync): they must lie in `[0, x.shape[0])`.

Split-K partials `[split, M, N]` (fp32, contiguous, split >= 1): the unsummed output of a
split-K GEMV (`gemv.linear_small_m_partials`), which replaces the GEMV's own split-sum launch.
They travel as a `SplitK` value (the partials and the dtype of the product they stand for),
from the op that makes them to the op that consumes them: no caller tests a tensor's rank.
Every kernel that consumes them sums with `sum_partials` and rounds once to the activation
dtype, so it sees the values `gemv.linear_small_m` would have written: the partials added in
the order of `gemv`'s split-sum kernels (s = 0, 1, ... onto 0.0 in fp32); split 1 is the GEMV's
own fp32 accumulator, which `linear_small_m` rounds and stores directly (the same bits but for
the sign of a zero: 0.0 + -0.0 is 0.0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphdraft.checks import describe, expect_tensor


@dataclass(frozen=True)
class SplitK:
    """A matmul product `[M, N]` in `dtype`, left as its fp32 split-K partials
    `partials [split, M, N]` for the next op to sum (`ops.linear_partials` makes it,
    `ops.rms_norm_cat`'s b and `ops.rope_and_store_qkv`'s qkv consume it)."""

    partials: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int]:
        """`(M, N)`: the product's shape."""
        return (self.partials.shape[1], self.partials.shape[2])

    def sum(self) -> torch.Tensor:
        """The product `[M, N]` in `dtype`, summed in the kernels' order (`sum_partials`:
        s = 0, 1, ... onto 0.0 in fp32) and rounded once; a new tensor (the torch reference of
        every consumer's sum)."""
        ws = self.partials
        acc = torch.zeros_like(ws[0])
        for part in ws:
            acc = acc + part
        return acc.to(self.dtype)


def check_partials(name: str, ws: object, m: int, n: int, device: torch.device) -> None:
    """ValueError naming `name` unless `ws` is a `SplitK` whose partials are contiguous
    float32 `[split, m, n]` on `device` with split >= 1 (the format above;
    `checks.expect_tensor` plus the split rule)."""
    if not isinstance(ws, SplitK):
        raise ValueError(f"{name}: expected split-K partials (a SplitK), got {describe(ws)}")
    ws = ws.partials
    expect_tensor(name, ws, shape=("split", m, n), dtypes=torch.float32, device=device,
                  layout="contiguous")
    if ws.shape[0] < 1:
        raise ValueError(f"{name}: expected split-K partials [split, {m}, {n}] with split >= 1, "
                         f"got {describe(ws)}")


@triton.jit
def sum_partials(ptrs, split_stride, mask, split):
    """fp32 sum of the `split` partials at `ptrs + s * split_stride` (masked lanes: 0.0), added
    in the order s = 0, 1, ... onto 0.0 (split 1: the partial's value; a -0.0 reads as 0.0).
    `split` is a runtime count, so one compiled kernel serves every split (a loop, as a
    constexpr count compiled to: unrolling it would hold every partial of a wide row in
    registers at once)."""
    acc = tl.zeros(ptrs.shape, dtype=tl.float32)
    for s in range(split):
        acc += tl.load(ptrs + s * split_stride, mask=mask, other=0.0)
    return acc
