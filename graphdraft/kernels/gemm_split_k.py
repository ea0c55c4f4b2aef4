"""cuBLAS matmuls above the GEMV's rows, split along K where their output tiles underfill the GPU.

A verify forward at bs 64 (M = 256 rows) multiplies by o_proj `[4096, 4096]` in 64 output
tiles of 128 x 128 on a GPU of 132 SMs: cuBLAS ran it at 0.60 of a large GEMM's rate (19.0 us
against a 10.9 us floor, H200, perf/RESULTS.md 2026-12-05 run N), and no whole-tile Triton
config did better. Cut K in `split` parts and the same tiles fill the machine: one
strided-batched cuBLAS call (`torch.bmm(..., out_dtype=torch.float32)`) computes batch s =
`x[:, s K/split : (s+1) K/split] @ w[:, same]^T` into fp32 partials `[split, M, N]`, views of
x and w (no copy). The partials travel as a `fused_inputs.SplitK` to the op that consumes the
product (`ops.rms_norm`'s residual norm after o_proj / down_proj, `ops.rope_and_store_qkv`
after qkv_proj), whose kernel sums them in fp32 and rounds once: no extra launch, and an fp32
sum of fp32 partials (the plain GEMM rounds its own fp32 accumulator once too).

`split_count` is the rule (`KernelConfig.gemm_split_k` caps it; 1: never split). It adds no
Triton kernel: the consumers' kernels take partials in the variant they already compile.
CUDA only (`aten::bmm.dtype` has no CPU kernel); the ops take this path only on CUDA.
"""

from __future__ import annotations

import torch

from graphdraft.kernels.fused_inputs import SplitK

__all__ = ["TILE", "linear_split_k", "split_count"]

TILE = 128
"""The output tile edge assumed of cuBLAS (its choice at these shapes, 128 x 128)."""
K_GRANULE = 64
"""Each split's share of K is a multiple of this (a whole number of cuBLAS k-steps)."""
DTYPES = (torch.bfloat16, torch.float16)


def split_count(m: int, n: int, k: int, max_split: int, sms: int) -> int:
    """K splits for `[m, k] @ [n, k]^T`: the most, up to `max_split`, that keep the output's
    `TILE` x `TILE` tiles times the splits within one wave of `sms` SMs, with each split's K a
    multiple of `K_GRANULE`; 1 where the tiles alone fill a wave (or `max_split` <= 1)."""
    tiles = -(-m // TILE) * -(-n // TILE)
    split = min(max_split, sms // max(tiles, 1))
    while split > 1 and k % (split * K_GRANULE):
        split -= 1
    return max(split, 1)


def linear_split_k(x: torch.Tensor, weight: torch.Tensor, split: int) -> SplitK:
    """x `[M, K]` @ weight `[N, K]`^T as fp32 partials `[split, M, N]` (a `SplitK` of a product
    in x's dtype): one strided-batched cuBLAS call over views. x needs unit column stride (any
    row stride), weight contiguous, K a multiple of `split`; CUDA, bf16 / fp16."""
    m, k = x.shape
    n = weight.shape[0]
    ks = k // split
    xs = x.view(m, split, ks).transpose(0, 1)  # [split, M, ks]: row stride x's, batch stride ks
    ws = weight.view(n, split, ks).permute(1, 2, 0)  # [split, ks, N]: column-major views
    return SplitK(torch.bmm(xs, ws, out_dtype=torch.float32), x.dtype)
