"""RMSNorm (HF LlamaRMSNorm numerics), optionally fused with the residual add.

`rms_norm_cat` normalises two inputs side by side (the EAGLE-3 head's `[embedding ; hidden]`);
fused into it: a row gather of the first input (`a_index`: the embedding lookup) and the
split-K sum of the second (b given as a GEMV's fp32 partials: the fc projection's sum).

Math, exactly as HF Llama::

    h  = x + residual                      # in the input dtype (if residual given)
    hf = h.float()
    y  = (hf * rsqrt(mean(hf**2, -1) + eps)).to(dtype)
    out = weight * y                       # in the input dtype

One program per row; the whole row (N <= 16384) is held in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import INDEX_DTYPES, expect_tensor
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.fused_inputs import SplitK, check_partials, sum_partials
from graphdraft.kernels.pdl import launch_options, pdl_enter
from graphdraft.kernels.placeholders import placeholder

__all__ = ["rms_norm", "rms_norm_cat", "rms_norm_ref", "rms_norm_row"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_N = 16384


# has_res (0 / 1) is a runtime flag, not specialized: with and without the residual share one
# variant (a uniform branch; the weight is loaded before it, so its load is not held back).
@triton.jit(do_not_specialize=["has_res"])
def _rms_norm_kernel(
    x_ptr, stride_x, res_ptr, stride_res, w_ptr, out_ptr, stride_out, res_out_ptr, stride_res_out,
    N, eps, has_res,
    BLOCK: tl.constexpr,
):
    """Row `row`: out = RMSNorm(x) or, with has_res != 0, h = x + res (rounded to x's dtype,
    written to res_out) and out = RMSNorm(h)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if has_res != 0:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # rounded like a dtype add
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    tl.store(out_ptr + row * stride_out + cols, rms_norm_row(x, w, N, eps), mask=mask)


@triton.jit
def rms_norm_row(x, w, N, eps):
    """One row `x [BLOCK]` (zeros past N) in its dtype, weight `w [BLOCK]` -> normed row, same dtype."""
    dtype = x.dtype
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf * (1.0 / tl.sqrt(var + eps))).to(dtype)
    return (w.to(tl.float32) * y.to(tl.float32)).to(dtype)  # == a dtype multiply


# split_stride_b (M * N) stays specialized: N % 16 == 0 makes it "divisible by 16" at every M,
# and that keeps the partials' loads vectorized. b_split is a runtime count (0: b is not
# partials), so both forms of b share one variant.
@triton.jit(do_not_specialize=["pdl_trigger", "b_split"])
def _rms_norm_cat_kernel(a_ptr, stride_a, a_index_ptr, wa_ptr, eps_a, b_ptr, bp_ptr, stride_b,
                         split_stride_b, b_split, wb_ptr, eps_b, b_out_ptr, stride_b_out, out_ptr,
                         stride_out, N, BLOCK: tl.constexpr, A_INDEX: tl.constexpr,
                         pdl_trigger, PDL: tl.constexpr):
    """Program (row, half): half 0 writes RMSNorm(a[row]) (A_INDEX: a[a_index[row]]) to
    out[row, :N], half 1 RMSNorm(b[row]) to out[row, N:]. b_split == 0: b[row] is read from
    b_ptr (a's dtype); b_split > 0: from bp_ptr, that many fp32 split-K partials
    (`sum_partials`), whose rounded sum is b[row] and is also written to
    b_out[row]. The pointer a mode does not read is a dummy of its dtype."""
    pdl_enter(PDL, pdl_trigger)
    row = tl.program_id(0).to(tl.int64)
    half = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if half == 0:
        a_row = row
        if A_INDEX:
            a_row = tl.load(a_index_ptr + row).to(tl.int64)
        x = tl.load(a_ptr + a_row * stride_a + cols, mask=mask, other=0.0)
        w = tl.load(wa_ptr + cols, mask=mask, other=0.0)
        eps = eps_a
    else:
        w = tl.load(wb_ptr + cols, mask=mask, other=0.0)
        if b_split > 0:
            x = sum_partials(bp_ptr + row * stride_b + cols, split_stride_b, mask, b_split)
            x = x.to(b_out_ptr.dtype.element_ty)
            tl.store(b_out_ptr + row * stride_b_out + cols, x, mask=mask)
        else:
            x = tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0)
        eps = eps_b
    tl.store(out_ptr + row * stride_out + half * N + cols, rms_norm_row(x, w, N, eps), mask=mask)


def rms_norm_cat(a: torch.Tensor, weight_a: torch.Tensor, eps_a: float, b: torch.Tensor | SplitK,
                 weight_b: torch.Tensor, eps_b: float, *, a_index: torch.Tensor | None = None,
                 b_out: torch.Tensor | None = None,
                 kernels: KernelConfig | None = None) -> torch.Tensor:
    """`cat([RMSNorm(a), RMSNorm(b)], -1)`: a, b `[M, N]` -> `[M, 2N]`, one launch.

    With `a_index` `[M]` (int32/int64, contiguous) row m of the first input is `a[a_index[m]]`
    (a is then any `[R, N]` table, such as an embedding: the lookup is fused; the index values
    must lie in `[0, R)`).
    b may instead be a `SplitK` (fp32 split-K partials `[split, M, N]` of the matmul that makes
    it, `gemv.linear_small_m_partials`): the kernel sums them and rounds to a's dtype exactly as
    `gemv.linear_small_m` would (`fused_inputs`), normalises that, and writes it to `b_out`
    `[M, N]` (required then, a's dtype, unit column stride). `kernels`: the launch settings
    (None: the default config).
    """
    _check(a, weight_a, None, None, None)
    N = a.shape[1]
    split_k = isinstance(b, SplitK)
    if split_k:
        M = b.shape[0]
        check_partials("b", b, M, N, a.device)
        if b.dtype != a.dtype:
            raise ValueError(f"b: expected split-K partials of a {a.dtype} product (like a), "
                             f"got {b.dtype}")
        b = b.partials
        # required: the sum of b's split partials lands there
        expect_tensor("b_out", b_out, shape=(M, N), dtypes=a.dtype, device=a.device,
                      layout=_rows_if_read(b_out))
        _check(b_out, weight_b, None, None, None)
        b_rows = b_out
    else:
        if b_out is not None:
            raise ValueError("b_out: only valid when b is split partials [split, M, N]")
        _check(b, weight_b, None, None, None)
        M, b_rows = b.shape[0], b
    if a_index is None:
        if b_rows.shape != a.shape or b_rows.dtype != a.dtype:
            raise ValueError(f"b: expected {a.dtype} {tuple(a.shape)} like a, got {b.dtype} {tuple(b.shape)}")
    else:
        if b_rows.shape[1] != N or b_rows.dtype != a.dtype or b_rows.device != a.device:
            raise ValueError(f"b: expected {a.dtype} [M, {N}] on {a.device} like a's rows, "
                             f"got {b.dtype} {tuple(b.shape)} on {b.device}")
        expect_tensor("a_index", a_index, shape=(M,), dtypes=INDEX_DTYPES, device=a.device,
                      layout="contiguous")
    out = torch.empty((M, 2 * N), dtype=a.dtype, device=a.device)
    if M > 0:
        block = triton.next_power_of_2(N)
        b_split = b.shape[0] if split_k else 0
        # b_ptr gets b's rows (b_out with partials: never read), bp_ptr the partials (without
        # them: an fp32 placeholder): each pointer keeps its dtype in both modes
        bp = b if split_k else placeholder(a.device, torch.float32)
        _rms_norm_cat_kernel[(M, 2)](a, a.stride(0), a if a_index is None else a_index, weight_a,
                                     float(eps_a), b_rows, bp, b.stride(-2),
                                     b.stride(0) if split_k else 0, b_split,
                                     weight_b, float(eps_b), b_rows, b_rows.stride(0), out,
                                     out.stride(0), N, BLOCK=block, A_INDEX=a_index is not None,
                                     num_warps=min(16, max(1, block // 512)),
                                     **launch_options(out.device, M, kernels=kernels))
    return out


def _rows_if_read(t: object) -> str | None:
    """"rows" (unit column stride) for a `[M, N]` tensor the kernel reads by column: not when
    it is empty or has a single column (that stride is then never used)."""
    read = isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] > 0 and t.shape[1] > 1
    return "rows" if read else None


def _check(x, weight, residual, out, residual_out) -> None:
    expect_tensor("x", x, shape=("M", "N"), dtypes=_DTYPES, layout=_rows_if_read(x))
    if not 1 <= x.shape[1] <= _MAX_N:
        raise ValueError(f"x: N must be in [1, {_MAX_N}], got {x.shape[1]}")
    expect_tensor("weight", weight, shape=(x.shape[1],), dtypes=x.dtype, device=x.device,
                  layout="contiguous")
    for name, t in (("residual", residual), ("out", out), ("residual_out", residual_out)):
        if t is not None:
            expect_tensor(name, t, shape=tuple(x.shape), dtypes=x.dtype, device=x.device,
                          layout=_rows_if_read(t))
    if residual is None and residual_out is not None:
        raise ValueError("residual_out: only valid together with residual")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x ``[M, N]`` with weight ``[N]`` (same dtype as x).

    Without ``residual`` returns ``out`` ``[M, N]``; with ``residual`` ``[M, N]``
    returns ``(out, h)`` where ``h = x + residual`` (written to ``residual_out``,
    which may alias ``residual`` or ``x`` for an in-place update). Rows may have
    any stride; columns must be contiguous. M == 0 launches nothing.
    """
    _check(x, weight, residual, out, residual_out)
    M, N = x.shape
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if residual is not None and residual_out is None:
        residual_out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M > 0:
        block = triton.next_power_of_2(N)
        res = residual if residual is not None else x
        res_out = residual_out if residual_out is not None else out
        _rms_norm_kernel[(M,)](
            x, x.stride(0), res, res.stride(0), weight, out, out.stride(0), res_out, res_out.stride(0),
            N, float(eps), int(residual is not None),
            BLOCK=block, num_warps=min(16, max(1, block // 512)),
        )
    return out if residual is None else (out, residual_out)


def rms_norm_torch(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm formula in torch, its one home (HF LlamaRMSNorm): `[M, N] -> [M, N]`,
    fp32 statistics, cast to h's dtype before the weight multiply. `ops.rms_norm`'s torch
    path, :func:`rms_norm_ref` and the training forward call it."""
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def rms_norm_residual_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                            residual: torch.Tensor | None = None, *,
                            residual_out: torch.Tensor | None = None):
    """`ops.rms_norm`'s torch path (any float dtype, no checks): `[M, N] -> [M, N]`; with
    `residual`: `h = x + residual` (written into `residual_out` when given), returns
    `(norm(h), h)`."""
    if residual is not None:
        x = x + residual
        if residual_out is not None:
            x = residual_out.copy_(x)
    normed = rms_norm_torch(x, weight, eps)
    return (normed, x) if residual is not None else normed


def rms_norm_cat_torch(a: torch.Tensor, weight_a: torch.Tensor, eps_a: float,
                       b: torch.Tensor | SplitK, weight_b: torch.Tensor, eps_b: float, *,
                       a_index: torch.Tensor | None = None,
                       b_out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rms_norm_cat` in torch (`ops.rms_norm_cat`'s torch path, any float dtype): b a
    `SplitK` is summed (`SplitK.sum`) into `b_out` (required then)."""
    if a_index is not None:
        a = a.index_select(0, a_index)
    if isinstance(b, SplitK):
        if b_out is None:
            raise ValueError("b_out: expected an [M, N] tensor for the sum of b's split partials")
        b = b_out.copy_(b.sum())
    return torch.cat([rms_norm_torch(a, weight_a, eps_a), rms_norm_torch(b, weight_b, eps_b)],
                     dim=-1)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (HF LlamaRMSNorm); same signature and outputs as :func:`rms_norm`."""
    _check(x, weight, residual, out, residual_out)
    res = rms_norm_residual_torch(x, weight, eps, residual, residual_out=residual_out)
    y, h = res if residual is not None else (res, None)
    if out is not None:
        y = out.copy_(y)
    return y if residual is None else (y, h)
