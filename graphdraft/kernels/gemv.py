"""Split-K GEMV for small batches: `y [M, N] = x [M, K] @ w [N, K]^T` with M <= 16.

A draft step at small batch is a handful of matrix-vector products whose
weights are read once from HBM; cuBLAS leaves bandwidth on the table for the
narrow ones (DESIGN.md: o_proj at 34% of copy bandwidth at M=1). Here each
program streams one `[BLOCK_N, K / SPLIT]` slab of `w` once and multiplies it by
all M rows; when N alone gives too few programs, K is split and a second
kernel sums the fp32 partials in a fixed order (deterministic: no atomics, so
graph replay and eager runs stay bit-identical).

Shapes: x `[M, K]` (row stride passed, unit column stride), w `[N, K]` contiguous
rows, out `[M, N]`. Accumulation in fp32, output in x.dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_M = 16
BLOCK_K = 128
_TARGET_PROGRAMS = 264  # about two per SM on an H100/H200


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, FP32_DOT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + (pid_s * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(ws, acc, mask=mask)


@triton.jit
def _sum_splits_kernel(ws_ptr, out_ptr, M, N, stride_om, SPLIT: tl.constexpr,
                       BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):  # fixed order: deterministic
        acc += tl.load(ws_ptr + s * M * N + offs, mask=ok, other=0.0)
    m = offs // N
    n = offs % N
    tl.store(out_ptr + m.to(tl.int64) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


def gemv_plan(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, split, k_per_split) for a `[m, k] x [n, k]^T` product."""
    block_n = 64 if n <= 8192 else 128
    n_blocks = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(_TARGET_PROGRAMS, n_blocks), triton.cdiv(k, 4 * BLOCK_K), 16))
    k_per_split = triton.cdiv(triton.cdiv(k, split), BLOCK_K) * BLOCK_K
    split = triton.cdiv(k, k_per_split)
    return block_n, split, k_per_split


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x: expected a 2-D tensor with unit column stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"x: expected 1..{MAX_M} rows, got {x.shape[0]}")
    if w.dim() != 2 or not w.is_contiguous() or w.shape[1] != x.shape[1]:
        raise ValueError(f"w: expected a contiguous [N, {x.shape[1]}] tensor, got {tuple(w.shape)}")
    if w.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"w: expected dtype {x.dtype} (bf16/fp16/fp32), got {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"w: expected device {x.device}, got {w.device}")
    if out is not None and (tuple(out.shape) != (x.shape[0], w.shape[0]) or out.dtype != x.dtype
                            or out.stride(-1) != 1):
        raise ValueError(f"out: expected [{x.shape[0]}, {w.shape[0]}] {x.dtype} with unit column "
                         f"stride, got {tuple(out.shape)} {out.dtype}")


def linear_small_m(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ w [N, K]^T -> [M, N]` for 1 <= M <= 16 (graph-capturable; fp32 workspace
    `[split, M, N]` allocated when K is split)."""
    _check(x, w, out)
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, split, k_per_split = gemv_plan(m, n, k)
    ws = (torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out)
    fp32_dot = x.dtype == torch.float32 or _interpreting()
    _gemv_kernel[(triton.cdiv(n, block_n), split)](
        x, w, out, ws, m, n, k, x.stride(0), w.stride(0), out.stride(0), k_per_split,
        BLOCK_M=MAX_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, SPLIT=split, FP32_DOT=fp32_dot,
        num_warps=4, num_stages=3)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](ws, out, m, n, out.stride(0),
                                                          SPLIT=split, BLOCK=block)
    return out


def linear_small_m_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 reference of `linear_small_m`."""
    y = (x.float() @ w.float().T).to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y
