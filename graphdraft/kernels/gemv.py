"""Small-M matmuls of a draft step: `y [M, N] = x [M, K] @ w [N, K]^T` with M <= 64.

A draft step at small batch is a handful of matrix-vector products whose weights
are read once from HBM; cuBLAS leaves bandwidth on the table for the narrow ones
(measured in perf/RESULTS.md). Each program streams one
`[BLOCK_N, K / split]` slab of `w` once and multiplies it by all M rows (M == 1:
CUDA-core dot products; M > 1: `tl.dot` on a 16-, 32- or 64-row tile). When N alone gives too
few programs, K is split and the fp32 partials `[split, M, N]` are summed in a
fixed order by the consumer (deterministic: no atomics, so graph replay and eager
runs stay bit-identical).

Fused forms, each one launch fewer than the unfused ops:
  act="silu_mul"        x is `gate_up [M, 2K]`; the product reads `silu(gate) * up`
                        (rounded like the torch ops) while loading x (M == 1; M > 1 computes
                        it in one small kernel first).
  linear_small_m_argmax each program also writes the (max, first index) of its logits
                        block (the argmax's first stage); `argmax.argmax_stage2` picks the
                        row argmax and maps it through `hot_token_ids`.
  linear_small_m_residual_norm
                        the split partials are summed by the RMSNorm(+residual) pass:
                        `h = round(x @ w^T) + residual`, `out = RMSNorm(h)`; for M <= 4 the
                        launch's last program runs it, else a second launch.

"The last program": every program bumps an int32 counter (one per weight, `_counter`) with an
acq_rel atomic after its stores; the one that sees `programs - 1` knows every partial is in
memory, runs the finisher for all M rows and resets the counter. The sums keep their fixed
order, so results do not depend on which program is last.

  linear_small_m_partials
                        the partials themselves, for a consumer kernel elsewhere that sums
                        them (`fused_inputs`): `norm.rms_norm_cat`'s second input, RoPE's qkv.

Shapes: x `[M, K]` (row stride passed, unit column stride), w `[N, K]` contiguous
rows, out `[M, N]` (unit column stride). Accumulation in fp32, output in x.dtype.

Compiled variants: one per tile (`m_bucket`, BLOCK_N / BLOCK_K), the silu_mul input and the
finisher (FINISH, which changes the register budget); the output kind (rows or partials), the
argmax epilogue, the residual index and the split count are runtime arguments read after the
K loop, and the pointers a launch does not use get typed placeholders, so they add none.

Settings (`kernels/config.KernelConfig`, each wrapper's `kernels=`; None: the default config):
  gemv_pdl            launch with programmatic dependent launch (CUDA): the programs start while
                      the previous kernel finishes and wait (`gdc_wait`) for its writes before
                      reading x; each lets the next launch start once its K loop is done.
                      Faster at bs 1, neutral at bs 8; prefetching the first weight tiles
                      into L2 before the wait measured slower: not done (perf/RESULTS.md,
                      third session, and "Figures moved out of the code").
  stream_evict_first  load weights `evict_first`: each is read once per draft step, so keeping
                      it in L2 only pushes out what the small kernels between the GEMVs reuse
                      (faster at bs 1, neutral at bs 8; marking the 32 MiB o_proj
                      `evict_last` to keep it in L2 across steps measured no faster;
                      perf/RESULTS.md "Figures moved out of the code").
  finish_maxnreg      register cap of M == 1 launches that carry a finisher (None: the
                      compiler's choice).
  finish_norm_max_m   rows up to which the residual + RMSNorm runs in the GEMV's last program.
  gemv_tiles          "uniform": M == 1 takes the M > 1 tiles (`gemv_config`).
  gemv_split / gemv_block_k  forced K split / BLOCK_K of the GEMVs that may split.
  gemv_num_stages     forced pipeline stages of every launch the heuristic sizes.
  gemv_swap_ab        M > 1: the product as `w @ x^T` (the weight slab the MMA's M side, so
                      Hopper's wgmma, which needs M >= 64, can take it; the rows its N).

The torch reference lives here too: `linear_ref` (`F.linear` of the activated input,
`silu_mul_ref`), the torch path of `ops.linear` and the tests' oracle (`linear_small_m_ref`
is it with `linear_small_m`'s signature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from graphdraft.checks import INDEX_DTYPES, expect_one_of, expect_tensor
from graphdraft.kernels.argmax import _BIG, argmax_stage2, check_ids_out
from graphdraft.kernels.config import GEMV_MAX_M, KernelConfig
from graphdraft.kernels.config import default as default_config
from graphdraft.kernels.fused_inputs import SplitK, sum_partials
from graphdraft.kernels.norm import rms_norm_row
from graphdraft.kernels.pdl import interpreting, launch_options, pdl_enter
from graphdraft.kernels.pdl import supported as pdl_supported
from graphdraft.kernels.placeholders import placeholder

MAX_M = GEMV_MAX_M
"""Most rows a launch takes (`KernelConfig.small_m_max` decides which matmuls come here)."""
MAX_NORM_N = 16384  # widest row the residual + RMSNorm pass holds in registers
ACTS = (None, "silu_mul")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TARGET_PROGRAMS = 264  # about two per SM on an H100/H200
def m_bucket(m: int) -> int:
    """The row tile (BLOCK_M) of an M-row launch: 1 for M == 1 (CUDA-core dot products), else
    16, 32 or 64 (`tl.dot` on the next power of two, at least 16). The GEMV compiles once per
    bucket (M itself is not specialized); the fused-norm finisher (a constexpr that stays)
    runs in the launch up to `finish_norm_max_m` rows (default 1), which splits a bucket
    where it falls inside one (at 4: 1 | 2-4 | 5-16 | 17-32 | 33-64)."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"m: expected 1..{MAX_M} rows, got {m}")
    return 1 if m == 1 else max(16, triton.next_power_of_2(m))


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
                num_warps: int = 4, num_stages: int | None = None,
                kernels: KernelConfig | None = None) -> GemvConfig:
    """Tiles for a `[m, k] x [n, k]^T` product, from the H200 sweep (`perf/studies/gemv_sweep.py`,
    perf/RESULTS.md): M == 1 streams `[32|64, 256]` slabs with about 528 programs in flight,
    M > 1 `[64|128, 128]` slabs with about 264; K is split to reach that count (the nearest
    whole number of slices, at least 4 * BLOCK_K long, at most `max_split`); `split` forces
    the number of K slices. The keyword overrides are for tuning and tests.
    `kernels.gemv_tiles == "uniform"` gives M == 1 the M > 1 tiles; `kernels.gemv_split` /
    `gemv_block_k` force the split / BLOCK_K where `max_split > 1`, `kernels.gemv_num_stages`
    the stages (None `kernels`: the default config)."""
    kc = kernels if kernels is not None else default_config()
    wide = m == 1 and kc.gemv_tiles != "uniform"
    if max_split > 1:
        block_k = block_k or kc.gemv_block_k
        split = split if split is not None else kc.gemv_split
    if block_n is None:
        block_n = (32 if n <= 8192 else 64) if wide else (64 if n <= 8192 else 128)
    block_k = block_k or (256 if wide else 128)
    target_programs = target_programs or (2 * _TARGET_PROGRAMS if wide else _TARGET_PROGRAMS)
    num_stages = num_stages or kc.gemv_num_stages or (4 if wide else 3)
    n_blocks = triton.cdiv(n, block_n)
    if split is None:
        split = min(round(target_programs / n_blocks), k // (4 * block_k), max_split)
    split = max(1, min(split, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty slices
    return GemvConfig(block_n, block_k, split, k_per_split, num_warps, num_stages)


def _gemv_body(x_ptr, w_ptr, out_ptr, ws_ptr, amax_val_ptr, amax_idx_ptr,
                 M, N, K, stride_xm, stride_wn, stride_om, k_per_split, n_blocks,
                 counter_ptr,
                 res_ptr, stride_res, res_idx_ptr, nw_ptr, nout_ptr, stride_nout, h_ptr, stride_h,
                 eps, to_ws, argmax, split, has_res_index,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SILU_MUL: tl.constexpr, FP32_DOT: tl.constexpr, FINISH: tl.constexpr,
                 NORM_BLOCK: tl.constexpr,
                 PDL: tl.constexpr, W_EVICT: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """Program (n block, K slice): one `[BLOCK_N, k_per_split]` slab of w times the M rows of x,
    stored as fp32 partials to `ws [split, M, N]` (`to_ws`) or rounded to `out`. With `argmax`
    (not with `to_ws`), it also writes the (max, first index) of its rounded logits to
    `amax_val/amax_idx [M, n_blocks]`. With FINISH, the launch's last program to finish (an
    atomic count on `counter`, reset by it) runs `_residual_norm_row` over the `split` partials
    for all M rows; one launch instead of two. The mode flags `to_ws`, `argmax` and
    `has_res_index` and the count `split` are runtime values read after the K loop (one
    compiled kernel serves them all); every pointer keeps one dtype in every mode."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if SWAP_AB:  # the product as w @ x^T: the weight slab is the MMA's M side
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    if PDL:  # launched while the previous kernel finishes: its writes (x) are visible from here
        tl.extra.cuda.gdc_wait()
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
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy=W_EVICT)
        if SWAP_AB:  # acc += a @ b^T: the weights as a, or the rows
            a, b = w, x
        else:
            a, b = x, w
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        elif FP32_DOT:
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b))
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next launch may start its own prologue
    if SWAP_AB:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N], as the epilogues take it
    mask = m_ok[:, None] & n_ok[None, :]
    if to_ws:
        ws = ws_ptr + (pid_s * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(ws, acc, mask=mask)
    else:
        y = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], y, mask=mask)
        if argmax:  # over the rounded logits, as an argmax of `out` would see them
            v = y.to(tl.float32)
            v = tl.where((v != v) | ~n_ok[None, :], float("-inf"), v)  # NaN never the max
            best = tl.max(v, axis=1)
            cols = tl.broadcast_to(offs_n[None, :], (BLOCK_M, BLOCK_N))
            idx = tl.min(tl.where((v == best[:, None]) & n_ok[None, :], cols, _BIG), axis=1)
            p = offs_m.to(tl.int64) * n_blocks + pid_n
            tl.store(amax_val_ptr + p, best, mask=m_ok)
            tl.store(amax_idx_ptr + p, idx, mask=m_ok)
    if FINISH:
        tl.debug_barrier()  # every thread's stores issued before the release below
        done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) * tl.num_programs(1) - 1:  # the last program
            for m in range(M):
                _residual_norm_row(m, ws_ptr, M, N, res_ptr, stride_res, res_idx_ptr,
                                   has_res_index, nw_ptr, nout_ptr, stride_nout, h_ptr, stride_h,
                                   eps, split, NORM_BLOCK)
            tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch


# The row count M is a runtime argument Triton does not specialize (value 1, divisibility by
# 16), so every M of one tile bucket (`m_bucket`) shares one compiled kernel; M == 1 (its own
# bucket: BLOCK_M == 1) keeps the specialized form it was measured with. The mode flags and
# counts are not specialized either (a flag's 1 would be).
_RUNTIME = ["n_blocks", "to_ws", "argmax", "split", "has_res_index"]
_gemv_kernel = triton.jit(do_not_specialize=["M"] + _RUNTIME)(_gemv_body)
_gemv_kernel_m1 = triton.jit(do_not_specialize=_RUNTIME)(_gemv_body)


@triton.jit(do_not_specialize=["pdl_trigger"])
def _silu_mul_kernel(x_ptr, out_ptr, K, stride_xm, stride_om, BLOCK: tl.constexpr,
                     pdl_trigger, PDL: tl.constexpr):
    """Row m of `[gate ; up]`: `out = silu(gate) * up`, each rounded like the torch ops."""
    pdl_enter(PDL, pdl_trigger)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < K
    g = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_xm + K + offs, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * stride_om + offs, (s.to(tl.float32) * up.to(tl.float32)).to(g.dtype),
             mask=ok)


@triton.jit(do_not_specialize=["pdl_trigger", "M", "split"])
def _sum_splits_kernel(ws_ptr, out_ptr, M, N, stride_om, split,
                       BLOCK: tl.constexpr, pdl_trigger, PDL: tl.constexpr):
    pdl_enter(PDL, pdl_trigger)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = sum_partials(ws_ptr + offs, M * N, ok, split)  # fixed order: deterministic
    m = offs // N
    n = offs % N
    tl.store(out_ptr + m.to(tl.int64) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["pdl_trigger", "M", "split", "has_res_index"])
def _sum_residual_norm_kernel(ws_ptr, res_ptr, stride_res, res_idx_ptr, has_res_index, w_ptr,
                              out_ptr, stride_out, h_ptr, stride_h, M, N, eps, split,
                              BLOCK: tl.constexpr,
                              pdl_trigger, PDL: tl.constexpr):
    """Program m: `_residual_norm_row` of row m."""
    pdl_enter(PDL, pdl_trigger)
    _residual_norm_row(tl.program_id(0), ws_ptr, M, N, res_ptr, stride_res, res_idx_ptr,
                       has_res_index, w_ptr, out_ptr, stride_out, h_ptr, stride_h, eps, split,
                       BLOCK)


@triton.jit
def _residual_norm_row(row, ws_ptr, M, N, res_ptr, stride_res, res_idx_ptr, has_res_index, w_ptr,
                       out_ptr, stride_out, h_ptr, stride_h, eps, split,
                       BLOCK: tl.constexpr):
    """Row m: `h = round(sum_s ws[s, m]) + residual[r]` (a dtype add; r = res_index[m] with
    `has_res_index`, else m) -> `h[m]`, then `out[m] = RMSNorm(h[m])` (`norm.rms_norm_row`);
    the row in registers (one pass: two passes of 1024 columns measured slower per draft call,
    perf/RESULTS.md "Figures moved out of the code")."""
    row = tl.cast(row, tl.int64)  # a loop index (a python int when interpreting) or program id
    r_row = row
    if has_res_index:
        r_row = tl.load(res_idx_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    acc = sum_partials(ws_ptr + row * N + cols, M * N, ok, split)  # fixed order
    r = tl.load(res_ptr + r_row * stride_res + cols, mask=ok, other=0.0)
    h = (acc.to(r.dtype).to(tl.float32) + r.to(tl.float32)).to(r.dtype)
    tl.store(h_ptr + row * stride_h + cols, h, mask=ok)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, rms_norm_row(h, w, N, eps), mask=ok)


# ---------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------
def _k_of(x: torch.Tensor, act: str | None) -> int:
    return x.shape[1] // 2 if act == "silu_mul" else x.shape[1]


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, act: str | None) -> None:
    expect_one_of("act", act, ACTS)
    expect_tensor("x", x, shape=("M", "K"), layout="rows")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"x: expected 1..{MAX_M} rows, got {x.shape[0]}")
    k = _k_of(x, act)
    if act == "silu_mul" and x.shape[1] % 2:
        raise ValueError(f"x: expected an even width [gate ; up] for act='silu_mul', got {x.shape[1]}")
    expect_tensor("w", w, shape=("N", k), dtypes=x.dtype, device=x.device, layout="contiguous")
    expect_tensor("x", x, dtypes=_DTYPES)
    if out is not None:
        expect_tensor("out", out, shape=(x.shape[0], w.shape[0]), dtypes=x.dtype, layout="rows")


def silu_mul(x: torch.Tensor, *, kernels: KernelConfig | None = None) -> torch.Tensor:
    """`[gate ; up]` `[M, 2K]` (unit column stride) -> `silu(gate) * up` `[M, K]`, each op
    rounded like torch's (`silu_mul_ref`); one launch."""
    m, k = x.shape[0], x.shape[1] // 2
    out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m:
        block = 1024
        _silu_mul_kernel[(m, triton.cdiv(k, block))](x, out, k, x.stride(0), out.stride(0),
                                                      BLOCK=block,
                                                      **launch_options(x.device, m, kernels=kernels))
    return out


def _act_input(x: torch.Tensor, act: str | None,
               kernels: KernelConfig | None) -> tuple[torch.Tensor, str | None]:
    """M == 1 computes silu_mul while loading x; M > 1 (the `tl.dot` path, where that measured
    slower than cuBLAS) materialises `silu(gate) * up` `[M, K]` first, one small launch."""
    if act != "silu_mul" or x.shape[0] == 1:
        return x, act
    return silu_mul(x, kernels=kernels), None


@dataclass
class _NormFinish:
    """FINISH_NORM operands: `out = RMSNorm(h)`, `h = sum of partials + residual[rows]`."""

    residual: torch.Tensor
    residual_index: torch.Tensor | None
    norm_weight: torch.Tensor
    out: torch.Tensor
    h: torch.Tensor
    eps: float


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _counter(w: torch.Tensor) -> torch.Tensor:
    """The int32 arrival counter of GEMVs over `w` (zero between launches: the last program
    resets it). One per weight, so launches over different weights may run concurrently."""
    key = (w.device, w.data_ptr())
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=w.device)
    return c


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, ws: torch.Tensor | None,
            act: str | None, cfg: GemvConfig, kc: KernelConfig, *,
            amax: tuple[torch.Tensor, torch.Tensor] | None = None, n_blocks: int = 1,
            norm: _NormFinish | None = None) -> None:
    """One GEMV launch: into `out` (x.dtype `[M, N]`) or, when `ws` is given, the fp32 partials
    `ws [split, M, N]`. Pointers a mode does not use get a `placeholder` of their own dtype, so
    every mode launches one compiled kernel per tile (`m_bucket`, BLOCK_N, FINISH, SILU_MUL)."""
    m, k, n = x.shape[0], _k_of(x, act), w.shape[0]
    block_m = m_bucket(m)
    fp32_dot = x.dtype == torch.float32 or interpreting()
    dev, dt = x.device, x.dtype
    f32 = placeholder(dev, torch.float32)
    act_dt = placeholder(dev, dt)
    amax_val, amax_idx = amax if amax is not None else (f32, placeholder(dev, torch.int32))
    # an int64 index (the runtime's) shares the placeholder's dtype: one compiled kernel
    res_idx = norm.residual_index if norm is not None else None
    # M == 1 runs ~4 programs per SM, which 128 registers a thread allow; the finisher (run by
    # one program) would raise the whole kernel's count and halve that: cap it there
    capped = norm is not None and block_m == 1 and kc.finish_maxnreg and not interpreting()
    extra = {"maxnreg": kc.finish_maxnreg} if capped else {}
    pdl = kc.gemv_pdl and pdl_supported(dev)
    if pdl:
        extra["launch_pdl"] = True
    kernel = _gemv_kernel_m1 if m == 1 else _gemv_kernel
    kernel[(triton.cdiv(n, cfg.block_n), cfg.split)](
        x, w, out if out is not None else act_dt, ws if ws is not None else f32, amax_val,
        amax_idx, m, n, k, x.stride(0), w.stride(0), out.stride(0) if out is not None else 0,
        cfg.k_per_split, n_blocks,
        _counter(w) if norm else placeholder(dev, torch.int32),
        norm.residual if norm else act_dt, norm.residual.stride(0) if norm else 0,
        res_idx if res_idx is not None else placeholder(dev, torch.int64),
        norm.norm_weight if norm else act_dt, norm.out if norm else act_dt,
        norm.out.stride(0) if norm else 0, norm.h if norm else act_dt,
        norm.h.stride(0) if norm else 0, float(norm.eps) if norm else 0.0,
        int(ws is not None), int(amax is not None), cfg.split, int(res_idx is not None),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SILU_MUL=act == "silu_mul", FP32_DOT=fp32_dot, FINISH=norm is not None,
        NORM_BLOCK=triton.next_power_of_2(n) if norm else 16,
        PDL=pdl, W_EVICT="evict_first" if kc.stream_evict_first else "",
        SWAP_AB=kc.gemv_swap_ab and block_m > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra)


def linear_small_m(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                   act: str | None = None, config: GemvConfig | None = None,
                   kernels: KernelConfig | None = None) -> torch.Tensor:
    """`act(x) [M, K] @ w [N, K]^T -> [M, N]` for 1 <= M <= MAX_M (graph-capturable; an fp32
    workspace `[split, M, N]` is allocated when K is split). `config`: the tiles (default:
    `gemv_config` under `kernels`, which also holds the launch settings; None: the default
    config)."""
    _check(x, w, out, act)
    kc = kernels if kernels is not None else default_config()
    m, n = x.shape[0], w.shape[0]
    cfg = config or gemv_config(m, n, _k_of(x, act), kernels=kc)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if cfg.split > 1:  # the partials, summed by a second launch
        ws = linear_small_m_partials(x, w, act=act, config=cfg, kernels=kc).partials
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](ws, out, m, n, out.stride(0), cfg.split,
                                                          BLOCK=block,
                                                          **launch_options(x.device, m, kernels=kc))
        return out
    x, act = _act_input(x, act, kc)
    _launch(x, w, out, None, act, cfg, kc)
    return out


def linear_small_m_partials(x: torch.Tensor, w: torch.Tensor, *, act: str | None = None,
                            config: GemvConfig | None = None,
                            kernels: KernelConfig | None = None) -> SplitK:
    """`act(x) [M, K] @ w [N, K]^T`, 1 <= M <= MAX_M, as a `SplitK`: its unsummed fp32 split-K
    partials `[split, M, N]` (split >= 1, contiguous) and x.dtype, for a consumer kernel that
    sums them itself (`fused_inputs.sum_partials`, then rounded to x.dtype: `linear_small_m`'s
    bits)."""
    _check(x, w, None, act)
    kc = kernels if kernels is not None else default_config()
    m, n = x.shape[0], w.shape[0]
    cfg = config or gemv_config(m, n, _k_of(x, act), kernels=kc)
    dtype = x.dtype
    x, act = _act_input(x, act, kc)
    ws = torch.empty((cfg.split, m, n), dtype=torch.float32, device=x.device)
    _launch(x, w, None, ws, act, cfg, kc)
    return SplitK(ws, dtype)


def linear_small_m_argmax(x: torch.Tensor, w: torch.Tensor, hot_token_ids: torch.Tensor | None = None,
                          *, ids_out: torch.Tensor | None = None, tokens_out: torch.Tensor | None = None,
                          config: GemvConfig | None = None,
                          kernels: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LM head and greedy pick: `logits = x @ w^T [M, N]` and int64 `ids [M]`, the row argmax
    (lowest index on ties, NaN never wins, as `argmax_with_map`) mapped by `hot_token_ids`.
    `ids_out` (int64 `[M]`, contiguous) receives the ids instead of a new tensor; `tokens_out`
    (int32/int64 `[M]`, any stride, e.g. a column of the drafter's `next_tokens`) a copy."""
    _check(x, w, None, None)
    m, k = x.shape
    n = w.shape[0]
    check_ids_out(ids_out, tokens_out, m, x.device)
    kc = kernels if kernels is not None else default_config()
    cfg = config or gemv_config(m, n, k, max_split=1, kernels=kc)
    if cfg.split != 1:
        raise ValueError(f"config: the argmax epilogue needs split == 1, got {cfg.split}")
    if hot_token_ids is not None:
        expect_tensor("hot_token_ids", hot_token_ids, shape=(n,), dtypes=torch.int64)
    logits = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ids = ids_out if ids_out is not None else torch.empty(m, dtype=torch.int64, device=x.device)
    n_blocks = triton.cdiv(n, cfg.block_n)
    val = torch.empty((m, n_blocks), dtype=torch.float32, device=x.device)
    idx = torch.empty((m, n_blocks), dtype=torch.int32, device=x.device)
    _launch(x, w, logits, None, None, cfg, kc, amax=(val, idx), n_blocks=n_blocks)
    argmax_stage2(val, idx, ids, hot_token_ids, tokens_out, kernels=kc)
    return logits, ids


def linear_small_m_residual_norm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor,
                                 norm_weight: torch.Tensor, eps: float, *, act: str | None = None,
                                 h_out: torch.Tensor | None = None,
                                 residual_index: torch.Tensor | None = None,
                                 config: GemvConfig | None = None,
                                 kernels: KernelConfig | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = act(x) @ w^T + residual` (rounded like the unfused ops), returns `(RMSNorm(h), h)`,
    both `[M, N]`. `residual` is `[M, N]`, or `[R, N]` read at rows `residual_index` (int32/int64
    `[M]`, values in [0, R): not checked, a device sync). `h` is written into `h_out` (`[M, N]`,
    unit column stride) when given. The matmul's split partials are summed by the RMSNorm pass:
    for M <= `kernels.finish_norm_max_m` inside the GEMV launch (its last program), else in a
    second one."""
    _check(x, w, None, act)
    m, n = x.shape[0], w.shape[0]
    expect_tensor("residual", residual, shape=("R" if residual_index is not None else m, n),
                  dtypes=x.dtype, layout="rows")
    if residual_index is not None:
        expect_tensor("residual_index", residual_index, shape=(m,), dtypes=INDEX_DTYPES,
                      device=x.device, layout="contiguous")
    expect_tensor("norm_weight", norm_weight, shape=(n,), dtypes=x.dtype, layout="contiguous")
    if n > MAX_NORM_N:
        raise ValueError(f"w: expected at most {MAX_NORM_N} rows (the norm holds a row in "
                         f"registers), got {n}")
    if h_out is not None:
        expect_tensor("h_out", h_out, shape=(m, n), dtypes=x.dtype, device=x.device, layout="rows")
    kc = kernels if kernels is not None else default_config()
    cfg = config or gemv_config(m, n, _k_of(x, act), kernels=kc)
    x, act = _act_input(x, act, kc)
    ws = torch.empty((cfg.split, m, n), dtype=torch.float32, device=x.device)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    h = h_out if h_out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    norm = _NormFinish(residual, residual_index, norm_weight, out, h, eps)
    if m <= kc.finish_norm_max_m:
        _launch(x, w, None, ws, act, cfg, kc, norm=norm)
        return out, h
    _launch(x, w, None, ws, act, cfg, kc)
    has_index = residual_index is not None
    _sum_residual_norm_kernel[(m,)](ws, residual, residual.stride(0),
                                    residual_index if has_index else placeholder(x.device, torch.int64),
                                    int(has_index), norm_weight, out, out.stride(0), h,
                                    h.stride(0), m, n, float(eps), cfg.split,
                                    BLOCK=triton.next_power_of_2(n),
                                    num_warps=min(16, max(1, triton.next_power_of_2(n) // 512)),
                                    **launch_options(x.device, m, kernels=kc))
    return out, h


# ---------------------------------------------------------------------------
# Torch references: the torch path of `ops.apply_act` / `ops.linear`, and the tests' fp32 oracle
# ---------------------------------------------------------------------------
def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """`[gate ; up]` `[..., 2K]` -> `silu(gate) * up` `[..., K]` in torch (each op rounded in
    x.dtype, as `silu_mul` and the fused load round)."""
    k = x.shape[-1] // 2
    return F.silu(x[..., :k]) * x[..., k:]


def linear_ref(x: torch.Tensor, w: torch.Tensor, *, act: str | None = None) -> torch.Tensor:
    """`act(x) [M, K] @ w [N, K]^T -> [M, N]` in torch (cuBLAS on CUDA): `ops.linear`'s path
    outside the GEMV's rows."""
    expect_one_of("act", act, ACTS)
    return F.linear(x if act is None else silu_mul_ref(x), w)


def linear_small_m_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                       act: str | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """`linear_small_m`'s signature over the one torch reference, `linear_ref` (fp32
    accumulation, rounded once), written into `out` when given."""
    del config
    y = linear_ref(x, w, act=act)
    return y if out is None else out.copy_(y)
