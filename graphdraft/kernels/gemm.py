"""Mid-M matmuls of a verify / large-batch decode forward: `y [M, N] = x [M, K] @ w [N, K]^T`
for M above the GEMV's rows (`kernels/gemv.py`) and up to about a thousand.

At these M a projection is close to its ridge point (the weights read once and the FLOPs at
the tensor cores' rate take about the same time), and cuBLAS's tiles leave SMs idle where the
output has few tiles (o_proj, N 4096 at M 256: 64 tiles of 128 x 128 for 132 SMs). `ops.linear`
takes a route per card, shape and row bucket where one measured faster than plain cuBLAS
(`KernelConfig.gemm_routes`, `kernels/buckets.py`'s `gemm_config`; the sweep:
`perf/studies/mid_m_gemm.py`): cuBLASLt (`linear_lt`: cuBLASLt's own heuristic, through
`F.linear`'s bias epilogue with a zero bias) or this kernel with a tile and a K split:

* SWAP_AB: the product as `w @ x^T`, the weight slab the MMA's M side (64 or 128 weight
  rows, what Hopper's wgmma needs) and BLOCK_M rows of x its N side, so one program holds
  every row of a small M and streams its weight slab once;
* a K split (`split` > 1, a runtime argument): program (m, n, s) multiplies the s-th slice of
  K and stores its fp32 partial tile to a workspace `[split, tiles, BLOCK_M, BLOCK_N]`; the
  tile's last program to arrive (an acq_rel atomic count per tile, reset by that program)
  sums the `split` partials in slice order and stores the rounded output. The sum's order is
  fixed, so the result does not depend on which program came last (no float atomics: graph
  replays and eager runs are bit-identical); the partials are read back from L2 moments
  after they were written.

`GemmConfig.tma` reads the tiles through tensor descriptors (`_gemm_tma_kernel`: Hopper's
copy engine fills shared memory, out-of-range rows and columns read as zeros) instead of
pointer loads (`_gemm_kernel`: rows past M / N clamped, the K tail masked).

Shapes: x `[M, K]` (row stride passed, unit column stride), w `[N, K]` contiguous, out
`[M, N]` (row stride passed, unit column stride). fp32 accumulation, output in x.dtype
(bf16 / fp16 / fp32; fp32 and the interpreter multiply in IEEE fp32).

Compiled variants: one per `GemmConfig` tile (BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, warps,
stages) and EVEN_K (K a multiple of BLOCK_K); M and the split count are runtime arguments
(Triton does not specialize them), so every M of a row bucket shares one kernel.

The last-program count needs one int32 per output tile (`_counters`, one buffer per weight
and tile count, zero between launches): two launches over the same weight and tile count
must not run concurrently on different streams (the forward runs its matmuls on one).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from graphdraft.checks import expect_tensor
from graphdraft.kernels.pdl import interpreting
from graphdraft.kernels.placeholders import placeholder

__all__ = ["CUBLASLT", "GemmConfig", "card_name", "gemm", "gemm_ref", "linear_lt", "tma_ok"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GemmConfig:
    """One launch's tiles: BLOCK_M rows of x times BLOCK_N weight rows per program, BLOCK_K
    a step, K cut in `split` slices (each a whole number of BLOCK_K steps)."""

    block_m: int
    block_n: int
    block_k: int = 64
    split: int = 1
    swap_ab: bool = True
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False
    """Read the tiles through tensor descriptors (`_gemm_tma_kernel`; x's row stride and K a
    multiple of 16 bytes, 16-byte aligned bases) instead of pointer loads."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not (16 <= v <= 512 and v & (v - 1) == 0):
                raise ValueError(f"{name}: expected a power of two in [16, 512], got {v!r}")
        if not (isinstance(self.split, int) and self.split >= 1):
            raise ValueError(f"split: expected an int >= 1, got {self.split!r}")

    def tile(self) -> tuple:
        """The compile-relevant part (the split is a runtime argument)."""
        return (self.block_m, self.block_n, self.block_k, self.swap_ab, self.num_warps,
                self.num_stages, self.tma)


@triton.jit
def _store_out(out_ptr, acc, rm, rn, M, N, stride_om):
    """Round the fp32 tile `acc [BLOCK_M, BLOCK_N]` to out's dtype and store the rows < M and
    columns < N."""
    ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M", "split"])
def _gemm_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, counter_ptr, M, N, K, stride_xm, stride_om,
                 k_per_split, split,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, FP32_DOT: tl.constexpr):
    """Program (m tile, n tile, K slice); the module docstring has the scheme. Rows past M and
    weight rows past N are read clamped (in bounds) and never stored."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm_in = tl.minimum(rm, M - 1).to(tl.int64)
    rn_in = tl.minimum(rn, N - 1).to(tl.int64)
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm_in[:, None] * stride_xm + (k_begin + rk)[None, :]
    w_ptrs = w_ptr + rn_in[:, None] * K + (k_begin + rk)[None, :]
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            left = k_end - k0
            x = tl.load(x_ptrs, mask=rk[None, :] < left, other=0.0)
            w = tl.load(w_ptrs, mask=rk[None, :] < left, other=0.0, eviction_policy="evict_first")
        if SWAP_AB:
            a, b = w, x
        else:
            a, b = x, w
        if FP32_DOT:  # fp32 inputs, or the interpreter (whose bf16 dot is not exact)
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc,
                         input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    _epilogue(acc, out_ptr, ws_ptr, counter_ptr, rm, rn, M, N, stride_om, pid_m, pid_n, pid_s,
              split, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M", "split"])
def _gemm_tma_kernel(x_desc, w_desc, out_ptr, ws_ptr, counter_ptr, M, N, K, stride_om,
                     k_per_split, split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SWAP_AB: tl.constexpr, FP32_DOT: tl.constexpr):
    """`_gemm_kernel` with the x and w tiles read through tensor descriptors (Hopper's TMA:
    the copy engine fills shared memory, rows past M / N and columns past K read as zeros)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        x = x_desc.load([pid_m * BLOCK_M, k0])
        w = w_desc.load([pid_n * BLOCK_N, k0])
        if SWAP_AB:
            a, b = w, x
        else:
            a, b = x, w
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc,
                         input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _epilogue(acc, out_ptr, ws_ptr, counter_ptr, rm, rn, M, N, stride_om, pid_m, pid_n, pid_s,
              split, BLOCK_M, BLOCK_N)


@triton.jit
def _epilogue(acc, out_ptr, ws_ptr, counter_ptr, rm, rn, M, N, stride_om, pid_m, pid_n, pid_s,
              split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store the tile `acc [BLOCK_M, BLOCK_N]` (split == 1), or its partial to the workspace
    and, in the tile's last program to arrive, the slice-order sum of every partial."""
    if split == 1:
        _store_out(out_ptr, acc, rm, rn, M, N, stride_om)
    else:
        tiles = tl.num_programs(0) * tl.num_programs(1)
        tile = pid_n * tl.num_programs(0) + pid_m
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(ws_ptr + (pid_s * tiles + tile).to(tl.int64) * (BLOCK_M * BLOCK_N) + local, acc)
        tl.debug_barrier()  # every thread's partial issued before the release below
        done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == split - 1:  # the tile's last slice: every partial is in memory
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(split):  # slice order, whichever program came last
                p = ws_ptr + (s * tiles + tile).to(tl.int64) * (BLOCK_M * BLOCK_N) + local
                total += tl.load(p, cache_modifier=".cg")
            _store_out(out_ptr, total, rm, rn, M, N, stride_om)
            tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch


_COUNTERS: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def _counters(w: torch.Tensor, tiles: int) -> torch.Tensor:
    """The int32 arrival counts `[tiles]` of split launches over `w` with `tiles` output tiles
    (zero between launches: each tile's last program resets its count). Kept, so a CUDA
    graph that captured the address can replay."""
    key = (w.device, w.data_ptr(), tiles)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(tiles, dtype=torch.int32, device=w.device)
    return c


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> None:
    expect_tensor("x", x, shape=("M", "K"), dtypes=_DTYPES, layout="rows")
    expect_tensor("w", w, shape=("N", x.shape[1]), dtypes=x.dtype, device=x.device,
                  layout="contiguous")
    if x.shape[0] < 1:
        raise ValueError("x: expected at least one row, got 0")
    if out is not None:
        expect_tensor("out", out, shape=(x.shape[0], w.shape[0]), dtypes=x.dtype,
                      device=x.device, layout="rows")


def tma_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `x [M, K]` and `w [N, K]` can be read through tensor descriptors: 16-byte
    aligned bases and row strides."""
    e = x.element_size()
    return (x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and (x.stride(0) * e) % 16 == 0
            and (w.stride(0) * e) % 16 == 0)


def gemm(x: torch.Tensor, w: torch.Tensor, config: GemmConfig,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ w [N, K]^T -> [M, N]` in x.dtype under `config` (graph-capturable; with
    `config.split > 1` an fp32 workspace `[split, tiles, BLOCK_M, BLOCK_N]` is allocated per
    call), written into `out` when given."""
    _check(x, w, out)
    m, k = x.shape
    n = w.shape[0]
    c = config
    if c.tma and not tma_ok(x, w):
        raise ValueError(f"x, w: the TMA tiles need 16-byte aligned bases and rows (x row "
                         f"stride {x.stride(0)}, K {k}, {x.element_size()}-byte elements)")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, c.split), c.block_k) * c.block_k
    split = triton.cdiv(k, k_per_split)  # no empty slices
    grid = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n), split)
    tiles = grid[0] * grid[1]
    if split > 1:
        ws = torch.empty(split * tiles * c.block_m * c.block_n, dtype=torch.float32,
                         device=x.device)
        counters = _counters(w, tiles)
    else:
        ws = placeholder(x.device, torch.float32)  # not read (split == 1)
        counters = placeholder(x.device, torch.int32)
    fp32_dot = x.dtype == torch.float32 or interpreting()
    if c.tma:
        _gemm_tma_kernel[grid](TensorDescriptor.from_tensor(x, [c.block_m, c.block_k]),
                               TensorDescriptor.from_tensor(w, [c.block_n, c.block_k]),
                               out, ws, counters, m, n, k, out.stride(0), k_per_split, split,
                               BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                               SWAP_AB=c.swap_ab, FP32_DOT=fp32_dot,
                               num_warps=c.num_warps, num_stages=c.num_stages)
        return out
    _gemm_kernel[grid](x, w, out, ws, counters, m, n, k, x.stride(0), out.stride(0),
                       k_per_split, split,
                       BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                       EVEN_K=k % c.block_k == 0, SWAP_AB=c.swap_ab, FP32_DOT=fp32_dot,
                       num_warps=c.num_warps, num_stages=c.num_stages)
    return out


@functools.cache
def card_name(device: torch.device) -> str:
    """The card a route is keyed by (`KernelConfig.gemm_routes`): the CUDA device's name
    (`torch.cuda.get_device_name`), or the device type elsewhere ("cpu")."""
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device)


CUBLASLT = "cublaslt"
"""The route `buckets.gemm_config` names where cuBLASLt (`linear_lt`) beat plain cuBLAS and
every tile here."""
_ZERO_BIAS: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}


def linear_lt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x [M, K] @ w [N, K]^T` through cuBLASLt: `F.linear` with a kept zero bias `[N]` (torch
    runs a 1-D bias through cuBLASLt's bias epilogue, whose heuristic picks other tiles than
    plain cuBLAS's; adding zero changes no value). On CPU: the same call, torch's own
    kernel."""
    key = (w.device, w.dtype, w.shape[0])
    bias = _ZERO_BIAS.get(key)
    if bias is None:
        bias = _ZERO_BIAS[key] = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
    return torch.nn.functional.linear(x, w, bias)


def gemm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The torch reference: `F.linear(x, w)` (fp32 accumulation, rounded once)."""
    return torch.nn.functional.linear(x, w)
