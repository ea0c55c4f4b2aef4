"""Small-M matmuls of a draft step: `y [M, N] = x [M, K] @ w [N, K]^T` with M <= 16.

A draft step at small batch is a handful of matrix-vector products whose weights
are read once from HBM; cuBLAS leaves bandwidth on the table for the narrow ones
(DESIGN.md: o_proj at 34% of copy bandwidth at M=1). Each program streams one
`[BLOCK_N, K / split]` slab of `w` once and multiplies it by all M rows (M == 1:
CUDA-core dot products; M > 1: `tl.dot` on a 16-row tile). When N alone gives too
few programs, K is split and the fp32 partials `[split, M, N]` are summed in a
fixed order by the consumer (deterministic: no atomics, so graph replay and eager
runs stay bit-identical).

Fused forms, each one launch fewer than the unfused ops:
  act="silu_mul"        x is `gate_up [M, 2K]`; the product reads `silu(gate) * up`
                        (rounded like the torch ops) while loading x (M == 1; M > 1 computes
                        it in one small kernel first).
  linear_small_m_argmax each program also writes the (max, first index) of its logits
                        block; one tiny kernel picks the row argmax and maps it through
                        `hot_token_ids` (replaces the two-stage argmax's first pass).
  linear_small_m_residual_norm
                        the split partials are summed by the RMSNorm(+residual) kernel:
                        `h = round(x @ w^T) + residual`, `out = RMSNorm(h)`; `residual_index`
                        gathers the residual rows in the same kernel.
  linear_small_m_partials
                        the partials themselves, for a consumer kernel elsewhere that sums
                        them (`fused_inputs`): `norm.rms_norm_cat`'s second input.

Shapes: x `[M, K]` (row stride passed, unit column stride), w `[N, K]` contiguous
rows, out `[M, N]` (unit column stride). Accumulation in fp32, output in x.dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphdraft.kernels.argmax import _BIG, _argmax_stage2_kernel
from graphdraft.kernels.fused_inputs import check_row_index, sum_partials
from graphdraft.kernels.norm import rms_norm_row

MAX_M = 16
TILES_ENV = "GRAPHDRAFT_GEMV_TILES"
ACTS = (None, "silu_mul")
_TARGET_PROGRAMS = 264  # about two per SM on an H100/H200


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class GemvConfig:
    """Tile sizes of one launch: `split` K-slices, each `k_per_split` long (a BLOCK_K multiple)."""

    block_n: int
    block_k: int
    split: int
    k_per_split: int
    num_warps: int = 4
    num_stages: int = 3


def gemv_config(m: int, n: int, k: int, *, block_n: int | None = None, block_k: int | None = None,
                target_programs: int | None = None, max_split: int = 16, split: int | None = None,
                num_warps: int = 4, num_stages: int | None = None) -> GemvConfig:
    """Tiles for a `[m, k] x [n, k]^T` product, from the H200 sweep (`perf/gemv_sweep.py`,
    perf/RESULTS.md): M == 1 streams `[32|64, 256]` slabs with about 528 programs in flight,
    M > 1 `[64|128, 128]` slabs with about 264; K is split to reach that count (the nearest
    whole number of slices, at least 4 * BLOCK_K long, at most `max_split`); `split` forces
    the number of K slices. The keyword overrides are for tuning and tests.
    `GRAPHDRAFT_GEMV_TILES=uniform` gives M == 1 the M > 1 tiles (read at every call:
    graphs keep the tiles they were captured with)."""
    wide = m == 1 and os.environ.get(TILES_ENV, "").strip() != "uniform"
    if block_n is None:
        block_n = (32 if n <= 8192 else 64) if wide else (64 if n <= 8192 else 128)
    block_k = block_k or (256 if wide else 128)
    target_programs = target_programs or (2 * _TARGET_PROGRAMS if wide else _TARGET_PROGRAMS)
    num_stages = num_stages or (4 if wide else 3)
    n_blocks = triton.cdiv(n, block_n)
    if split is None:
        split = min(round(target_programs / n_blocks), k // (4 * block_k), max_split)
    split = max(1, min(split, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty slices
    return GemvConfig(block_n, block_k, split, k_per_split, num_warps, num_stages)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, amax_val_ptr, amax_idx_ptr,
                 M, N, K, stride_xm, stride_wn, stride_om, k_per_split, n_blocks,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 TO_WS: tl.constexpr, SILU_MUL: tl.constexpr, ARGMAX: tl.constexpr,
                 FP32_DOT: tl.constexpr):
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
        xm = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0)
        if SILU_MUL:  # x row = [gate (K) ; up (K)]: silu(gate) * up, each rounded like torch
            up = tl.load(x_rows + K + offs_k[None, :], mask=xm, other=0.0)
            g = x.to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(x.dtype)
            x = (s.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        elif FP32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    mask = m_ok[:, None] & n_ok[None, :]
    if TO_WS:
        ws = ws_ptr + (pid_s * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(ws, acc, mask=mask)
    else:
        y = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], y, mask=mask)
        if ARGMAX:  # over the rounded logits, as an argmax of `out` would see them
            v = y.to(tl.float32)
            v = tl.where((v != v) | ~n_ok[None, :], float("-inf"), v)  # NaN never the max
            best = tl.max(v, axis=1)
            cols = tl.broadcast_to(offs_n[None, :], (BLOCK_M, BLOCK_N))
            idx = tl.min(tl.where((v == best[:, None]) & n_ok[None, :], cols, _BIG), axis=1)
            p = offs_m.to(tl.int64) * n_blocks + pid_n
            tl.store(amax_val_ptr + p, best, mask=m_ok)
            tl.store(amax_idx_ptr + p, idx, mask=m_ok)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, K, stride_xm, stride_om, BLOCK: tl.constexpr):
    """Row m of `[gate ; up]`: `out = silu(gate) * up`, each rounded like the torch ops."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < K
    g = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_xm + K + offs, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * stride_om + offs, (s.to(tl.float32) * up.to(tl.float32)).to(g.dtype),
             mask=ok)


@triton.jit
def _sum_splits_kernel(ws_ptr, out_ptr, M, N, stride_om, SPLIT: tl.constexpr,
                       BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = sum_partials(ws_ptr + offs, M * N, ok, SPLIT)  # fixed order: deterministic
    m = offs // N
    n = offs % N
    tl.store(out_ptr + m.to(tl.int64) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _sum_residual_norm_kernel(ws_ptr, res_ptr, stride_res, res_index_ptr, w_ptr, out_ptr, stride_out,
                              res_out_ptr, stride_res_out, M, N, eps,
                              SPLIT: tl.constexpr, BLOCK: tl.constexpr, RES_INDEX: tl.constexpr):
    """Row m: `h = round(sum_s ws[s, m]) + residual[m]` (a dtype add; RES_INDEX: residual row
    `res_index[m]`), `out = RMSNorm(h)`."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    acc = sum_partials(ws_ptr + row * N + cols, M * N, ok, SPLIT)  # fixed order: deterministic
    res_row = row
    if RES_INDEX:
        res_row = tl.load(res_index_ptr + row).to(tl.int64)
    r = tl.load(res_ptr + res_row * stride_res + cols, mask=ok, other=0.0)
    y = acc.to(r.dtype)
    h = (y.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
    tl.store(res_out_ptr + row * stride_res_out + cols, h, mask=ok)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, rms_norm_row(h, w, N, eps), mask=ok)


# ---------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------
def _k_of(x: torch.Tensor, act: str | None) -> int:
    return x.shape[1] // 2 if act == "silu_mul" else x.shape[1]


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, act: str | None) -> None:
    if act not in ACTS:
        raise ValueError(f"act: expected one of {ACTS}, got {act!r}")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x: expected a 2-D tensor with unit column stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"x: expected 1..{MAX_M} rows, got {x.shape[0]}")
    k = _k_of(x, act)
    if act == "silu_mul" and x.shape[1] % 2:
        raise ValueError(f"x: expected an even width [gate ; up] for act='silu_mul', got {x.shape[1]}")
    if w.dim() != 2 or not w.is_contiguous() or w.shape[1] != k:
        raise ValueError(f"w: expected a contiguous [N, {k}] tensor, got {tuple(w.shape)}")
    if w.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"w: expected dtype {x.dtype} (bf16/fp16/fp32), got {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"w: expected device {x.device}, got {w.device}")
    if out is not None and (tuple(out.shape) != (x.shape[0], w.shape[0]) or out.dtype != x.dtype
                            or out.stride(-1) != 1):
        raise ValueError(f"out: expected [{x.shape[0]}, {w.shape[0]}] {x.dtype} with unit column "
                         f"stride, got {tuple(out.shape)} {out.dtype}")


def _act_input(x: torch.Tensor, act: str | None) -> tuple[torch.Tensor, str | None]:
    """M == 1 computes silu_mul while loading x; M > 1 (the `tl.dot` path, where that measured
    slower than cuBLAS) materialises `silu(gate) * up` `[M, K]` first, one small launch."""
    if act != "silu_mul" or x.shape[0] == 1:
        return x, act
    m, k = x.shape[0], x.shape[1] // 2
    out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(m, triton.cdiv(k, block))](x, out, k, x.stride(0), out.stride(0), BLOCK=block)
    return out, None


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, ws: torch.Tensor, act: str | None,
            cfg: GemvConfig, *, to_ws: bool, amax: tuple[torch.Tensor, torch.Tensor] | None = None,
            n_blocks: int = 1) -> None:
    m, k, n = x.shape[0], _k_of(x, act), w.shape[0]
    block_m = 1 if m == 1 else MAX_M
    fp32_dot = x.dtype == torch.float32 or _interpreting()
    amax_val, amax_idx = amax if amax is not None else (ws, ws)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), cfg.split)](
        x, w, out, ws, amax_val, amax_idx, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        cfg.k_per_split, n_blocks,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TO_WS=to_ws,
        SILU_MUL=act == "silu_mul", ARGMAX=amax is not None, FP32_DOT=fp32_dot,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def linear_small_m(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                   act: str | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """`act(x) [M, K] @ w [N, K]^T -> [M, N]` for 1 <= M <= 16 (graph-capturable; an fp32
    workspace `[split, M, N]` is allocated when K is split)."""
    _check(x, w, out, act)
    m, n = x.shape[0], w.shape[0]
    cfg = config or gemv_config(m, n, _k_of(x, act))
    x, act = _act_input(x, act)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if cfg.split == 1:
        _launch(x, w, out, out, act, cfg, to_ws=False)
        return out
    ws = torch.empty((cfg.split, m, n), dtype=torch.float32, device=x.device)
    _launch(x, w, out, ws, act, cfg, to_ws=True)
    block = 1024
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](ws, out, m, n, out.stride(0),
                                                      SPLIT=cfg.split, BLOCK=block)
    return out


def linear_small_m_partials(x: torch.Tensor, w: torch.Tensor, *, act: str | None = None,
                            config: GemvConfig | None = None) -> torch.Tensor:
    """The unsummed fp32 split-K partials `[split, M, N]` (split >= 1, contiguous) of
    `act(x) [M, K] @ w [N, K]^T`, 1 <= M <= 16, for a consumer kernel that sums them itself
    (`fused_inputs.sum_partials`, then rounded to x.dtype: `linear_small_m`'s bits)."""
    _check(x, w, None, act)
    m, n = x.shape[0], w.shape[0]
    cfg = config or gemv_config(m, n, _k_of(x, act))
    x, act = _act_input(x, act)
    ws = torch.empty((cfg.split, m, n), dtype=torch.float32, device=x.device)
    _launch(x, w, ws, ws, act, cfg, to_ws=True)
    return ws


def linear_small_m_argmax(x: torch.Tensor, w: torch.Tensor, hot_token_ids: torch.Tensor | None = None,
                          *, config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LM head and greedy pick: `logits = x @ w^T [M, N]` and int64 `ids [M]`, the row argmax
    (lowest index on ties, NaN never wins, as `argmax_with_map`) mapped by `hot_token_ids`."""
    _check(x, w, None, None)
    m, k = x.shape
    n = w.shape[0]
    cfg = config or gemv_config(m, n, k, max_split=1)
    if cfg.split != 1:
        raise ValueError(f"config: the argmax epilogue needs split == 1, got {cfg.split}")
    if hot_token_ids is not None and (hot_token_ids.dtype != torch.int64
                                      or hot_token_ids.shape != (n,)):
        raise ValueError(f"hot_token_ids: expected int64 [{n}], got {hot_token_ids.dtype} "
                         f"{tuple(hot_token_ids.shape)}")
    logits = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ids = torch.empty(m, dtype=torch.int64, device=x.device)
    n_blocks = triton.cdiv(n, cfg.block_n)
    val = torch.empty((m, n_blocks), dtype=torch.float32, device=x.device)
    idx = torch.empty((m, n_blocks), dtype=torch.int32, device=x.device)
    _launch(x, w, logits, logits, None, cfg, to_ws=False, amax=(val, idx), n_blocks=n_blocks)
    has_map = hot_token_ids is not None
    _argmax_stage2_kernel[(m,)](val, idx, n_blocks, hot_token_ids if has_map else ids, ids,
                                SPLITS_PAD=triton.next_power_of_2(n_blocks), HAS_MAP=has_map,
                                num_warps=4 if n_blocks >= 256 else 1)
    return logits, ids


def linear_small_m_residual_norm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor,
                                 norm_weight: torch.Tensor, eps: float, *, act: str | None = None,
                                 config: GemvConfig | None = None,
                                 residual_index: torch.Tensor | None = None,
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = act(x) @ w^T + residual` (rounded like the unfused ops), returns `(RMSNorm(h), h)`,
    both `[M, N]`; the matmul's split partials are summed inside the norm kernel. With
    `residual_index` `[M]` (int32/int64, contiguous) row m adds `residual[residual_index[m]]`
    (residual is then any `[R, N]`; index values must lie in `[0, R)`)."""
    _check(x, w, None, act)
    m, n = x.shape[0], w.shape[0]
    if (residual.dim() != 2 or residual.shape[1] != n
            or (residual_index is None and residual.shape[0] != m) or residual.dtype != x.dtype
            or residual.device != x.device or residual.stride(-1) != 1):
        raise ValueError(f"residual: expected [{m if residual_index is None else 'R'}, {n}] "
                         f"{x.dtype} on {x.device} with unit column stride, got "
                         f"{tuple(residual.shape)} {residual.dtype} on {residual.device}")
    if residual_index is not None:
        check_row_index("residual_index", residual_index, m, x.device)
    if norm_weight.shape != (n,) or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight: expected contiguous {x.dtype} [{n}], got "
                         f"{norm_weight.dtype} {tuple(norm_weight.shape)}")
    ws = linear_small_m_partials(x, w, act=act, config=config)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    h = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    _sum_residual_norm_kernel[(m,)](ws, residual, residual.stride(0),
                                    residual if residual_index is None else residual_index,
                                    norm_weight, out, out.stride(0),
                                    h, h.stride(0), m, n, float(eps), SPLIT=ws.shape[0], BLOCK=block,
                                    RES_INDEX=residual_index is not None,
                                    num_warps=min(16, max(1, block // 512)))
    return out, h


# ---------------------------------------------------------------------------
# fp32 references (the tests' oracles)
# ---------------------------------------------------------------------------
def linear_small_m_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                       act: str | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """fp32-accumulated reference of `linear_small_m`."""
    from graphdraft.ops import apply_act  # the torch path's activation

    del config
    y = (apply_act(x, act).float() @ w.float().T).to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y
