"""Row argmax over logits, mapped through an optional draft->target id table.

Semantics (the kernel and :func:`argmax_with_map_ref` agree exactly):

* the result is the index of the row maximum; on ties the LOWEST index wins;
* NaN is never a maximum (it is treated as ``-inf``); a row of only NaN/``-inf``
  therefore yields index 0;
* with ``hot_token_ids`` (int64 ``[V]``) the index is mapped ``id -> hot_token_ids[id]``.

Large rows use a two-stage reduction: stage 1 splits each row into ``num_splits``
chunks (grid ``(B, num_splits)``) and writes a (max, first index) pair per chunk;
stage 2 (grid ``(B,)``) combines them, keeping the lowest index on ties. With one
split, stage 1 writes the final id directly (one launch).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from graphdraft.checks import INDEX_DTYPES, expect_tensor
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.pdl import launch_options, pdl_enter

__all__ = ["argmax_with_map", "argmax_with_map_ref", "argmax_with_map_torch", "check_ids_out",
           "num_sms"]

_LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BIG_INT = 2**31 - 1  # "no index yet": larger than any valid column
_BIG = tl.constexpr(_BIG_INT)


@functools.cache
def _num_sms_cached(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (132 for a CPU/interpreter run: an H200's)."""
    if device.type != "cuda":
        return 132
    return _num_sms_cached(device.index if device.index is not None else torch.cuda.current_device())


# chunk (a multiple of BLOCK) stays specialized: always "divisible by 16", which keeps the
# logits' loads aligned; the split count varies with the rows.
@triton.jit(do_not_specialize=["num_splits"])
def _argmax_stage1_kernel(
    logits_ptr, stride_b, V, chunk,
    part_val_ptr, part_idx_ptr, num_splits,
    hot_ptr, out_ptr,
    BLOCK: tl.constexpr, FINAL: tl.constexpr, HAS_MAP: tl.constexpr,
):
    b = tl.program_id(0)
    s = tl.program_id(1)
    start = s * chunk
    end = tl.minimum(start + chunk, V)
    row = logits_ptr + b.to(tl.int64) * stride_b
    lanes = tl.arange(0, BLOCK)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], _BIG, tl.int32)
    for off in range(start, end, BLOCK):
        cols = off + lanes
        valid = cols < end
        x = tl.load(row + cols, mask=valid, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("-inf"), x)  # NaN is never the max
        # Strictly greater, or equal with a lower index (first -inf of a row).
        better = valid & ((x > best_val) | ((x == best_val) & (cols < best_idx)))
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, cols, best_idx)
    m = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == m, best_idx, _BIG), axis=0)
    if FINAL:
        res = idx.to(tl.int64)
        if HAS_MAP:
            res = tl.load(hot_ptr + res)
        tl.store(out_ptr + b, res)
    else:
        p = b.to(tl.int64) * num_splits + s
        tl.store(part_val_ptr + p, m)
        tl.store(part_idx_ptr + p, idx)


_STAGE2_BLOCK = 512  # lanes of the second stage, looped over a row's partials
_STAGE2_WARPS = 1


@triton.jit(do_not_specialize=["pdl_trigger", "num_splits"])
def _argmax_stage2_kernel(
    part_val_ptr, part_idx_ptr, num_splits, hot_ptr, out_ptr, tokens_ptr, stride_tokens,
    BLOCK: tl.constexpr, HAS_MAP: tl.constexpr, HAS_TOKENS: tl.constexpr,
    pdl_trigger,
    PDL: tl.constexpr,
):
    """Program b: `argmax_final_row` of row b."""
    pdl_enter(PDL, pdl_trigger)
    argmax_final_row(tl.program_id(0), part_val_ptr, part_idx_ptr, num_splits, hot_ptr, out_ptr,
                     tokens_ptr, stride_tokens, BLOCK, HAS_MAP, HAS_TOKENS)


@triton.jit
def argmax_final_row(b, part_val_ptr, part_idx_ptr, num_splits, hot_ptr, out_ptr, tokens_ptr,
                     stride_tokens, BLOCK: tl.constexpr, HAS_MAP: tl.constexpr,
                     HAS_TOKENS: tl.constexpr):
    """Row b: the (max, first index) over its `[num_splits]` partials, mapped -> `out[b]` (int64)
    and, with HAS_TOKENS, the same id in `tokens[b * stride_tokens]` (its dtype, e.g. int32).
    The partials are read BLOCK at a time (a runtime loop: one pass up to BLOCK splits), each
    lane keeping its (max, lowest index), through L2 (`.cg`)."""
    lanes = tl.arange(0, BLOCK)
    b = tl.cast(b, tl.int64)  # int64 offsets
    base = b * num_splits
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], _BIG, tl.int32)
    for start in range(0, num_splits, BLOCK):
        offs = start + lanes
        valid = offs < num_splits
        val = tl.load(part_val_ptr + base + offs, mask=valid, other=float("-inf"),
                      cache_modifier=".cg")
        idx = tl.load(part_idx_ptr + base + offs, mask=valid, other=_BIG, cache_modifier=".cg")
        better = (val > best_val) | ((val == best_val) & (idx < best_idx))
        best_val = tl.where(better, val, best_val)
        best_idx = tl.where(better, idx, best_idx)
    m = tl.max(best_val, axis=0)
    res = tl.min(tl.where(best_val == m, best_idx, _BIG), axis=0).to(tl.int64)
    if HAS_MAP:
        res = tl.load(hot_ptr + res)
    tl.store(out_ptr + b, res)
    if HAS_TOKENS:
        tl.store(tokens_ptr + b * stride_tokens, res.to(tokens_ptr.dtype.element_ty))


def argmax_stage2(part_val: torch.Tensor, part_idx: torch.Tensor, out: torch.Tensor,
                  hot_token_ids: torch.Tensor | None = None, tokens_out: torch.Tensor | None = None,
                  *, kernels: KernelConfig | None = None) -> None:
    """Second stage, one program per row b: the (max, first index) over the partials
    `part_val` fp32 / `part_idx` int32 `[B, splits]` (contiguous), mapped through
    `hot_token_ids` (int64 `[V]`) if given -> `out[b]` (int64 `[B]`); `tokens_out` (int32/int64
    `[B]`, any stride) gets a copy. Arguments are not checked (the callers do).
    One compiled variant for every split and row count: `_STAGE2_BLOCK` lanes, one pass for
    the split counts of the draft head on an H200 (`argmax_with_map`: at most 264; the LM
    head GEMV's 32000-column blocks: 500 at one row, 250 above), and `_STAGE2_WARPS` warps."""
    B, splits = part_val.shape
    has_map, has_tokens = hot_token_ids is not None, tokens_out is not None
    _argmax_stage2_kernel[(B,)](
        part_val, part_idx, splits, hot_token_ids if has_map else out, out,
        tokens_out if has_tokens else out, tokens_out.stride(0) if has_tokens else 0,
        BLOCK=_STAGE2_BLOCK, HAS_MAP=has_map, HAS_TOKENS=has_tokens,
        num_warps=_STAGE2_WARPS, **launch_options(out.device, B, kernels=kernels),
    )


def _check(logits: torch.Tensor, hot_token_ids: torch.Tensor | None, out: torch.Tensor | None) -> None:
    expect_tensor("logits", logits, shape=("B", "V"), dtypes=_LOGIT_DTYPES)
    B, V = logits.shape
    # the column stride is read only when there is a row (B == 0 launches nothing)
    expect_tensor("logits", logits, layout="rows" if B > 0 else None)
    if not 1 <= V < _BIG_INT:
        raise ValueError(f"logits: expected V in [1, {_BIG_INT}) (fits in int32), got {V}")
    if hot_token_ids is not None:
        expect_tensor("hot_token_ids", hot_token_ids, shape=(V,), dtypes=torch.int64,
                      device=logits.device, layout="contiguous")
    if out is not None:
        expect_tensor("out", out, shape=(B,), dtypes=torch.int64, device=logits.device,
                      layout="contiguous")


def check_ids_out(ids_out: torch.Tensor | None, tokens_out: torch.Tensor | None, m: int,
                  device: torch.device) -> None:
    """Destinations of `m` greedy ids: `ids_out` int64 `[m]` contiguous, `tokens_out`
    int32/int64 `[m]` any stride; both optional, on `device`."""
    if ids_out is not None:
        expect_tensor("ids_out", ids_out, shape=(m,), dtypes=torch.int64, device=device,
                      layout="contiguous")
    if tokens_out is not None:
        expect_tensor("tokens_out", tokens_out, shape=(m,), dtypes=INDEX_DTYPES, device=device)


def _pick_splits(B: int, V: int, block: int, device: torch.device) -> int:
    """Enough programs for ~2 per SM when B is small; never more splits than blocks."""
    return max(1, min(triton.cdiv(V, block), triton.cdiv(2 * num_sms(device), max(B, 1))))


def argmax_with_map(
    logits: torch.Tensor,
    hot_token_ids: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tokens_out: torch.Tensor | None = None,
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """Row argmax (lowest index on ties, NaN never wins), optionally mapped.

    logits ``[B, V]`` (fp32/fp16/bf16, unit column stride, any row stride);
    hot_token_ids int64 ``[V]`` or None; returns int64 ``[B]`` (``out`` if given);
    ``tokens_out`` (int32/int64 ``[B]``, any stride) gets a copy of the ids, written by
    the second stage. ``num_splits`` forces the number of row chunks (default:
    heuristic). CUDA-graph capturable: with ``num_splits > 1`` it allocates two small
    ``[B, num_splits]`` work buffers.
    """
    _check(logits, hot_token_ids, out)
    check_ids_out(None, tokens_out, logits.shape[0], logits.device)
    B, V = logits.shape
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    block = min(1024, triton.next_power_of_2(V))
    splits = _pick_splits(B, V, block, logits.device) if num_splits is None else max(1, int(num_splits))
    chunk = triton.cdiv(triton.cdiv(V, splits), block) * block
    splits = triton.cdiv(V, chunk)  # no empty chunks
    hot = hot_token_ids if hot_token_ids is not None else out  # dummy pointer when unused
    has_map = hot_token_ids is not None
    num_warps = 4 if block >= 512 else 1
    if splits == 1:
        _argmax_stage1_kernel[(B, 1)](
            logits, logits.stride(0), V, chunk, out, out, 1, hot, out,
            BLOCK=block, FINAL=True, HAS_MAP=has_map, num_warps=num_warps,
        )
        if tokens_out is not None:
            tokens_out.copy_(out)
        return out
    part_val = torch.empty(B, splits, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(B, splits, dtype=torch.int32, device=logits.device)
    _argmax_stage1_kernel[(B, splits)](
        logits, logits.stride(0), V, chunk, part_val, part_idx, splits, hot, out,
        BLOCK=block, FINAL=False, HAS_MAP=has_map, num_warps=num_warps,
    )
    argmax_stage2(part_val, part_idx, out, hot_token_ids, tokens_out, kernels=kernels)
    return out


def argmax_with_map_ref(
    logits: torch.Tensor,
    hot_token_ids: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tokens_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: the kernel's argument checks, then :func:`argmax_with_map_torch`."""
    del num_splits
    _check(logits, hot_token_ids, out)
    check_ids_out(None, tokens_out, logits.shape[0], logits.device)
    return argmax_with_map_torch(logits, hot_token_ids, out=out, tokens_out=tokens_out)


def argmax_with_map_torch(logits: torch.Tensor, hot_token_ids: torch.Tensor | None = None, *,
                          out: torch.Tensor | None = None,
                          tokens_out: torch.Tensor | None = None) -> torch.Tensor:
    """The op in torch, its one home (`ops.argmax_with_map`'s torch path and
    :func:`argmax_with_map_ref`): `[B, V]` (any float dtype, any strides) -> int64 `[B]`, the
    kernel's semantics: NaN is `-inf` (never the max), the first index of the row max
    (`torch.argmax` returns the first), then mapped by `hot_token_ids`; written into `out`
    (int64 `[B]`) and copied into `tokens_out` when given. Arguments are not checked."""
    x = torch.where(torch.isnan(logits), float("-inf"), logits) if logits.is_floating_point() \
        else logits
    ids = torch.argmax(x, dim=-1)
    if hot_token_ids is not None:
        ids = hot_token_ids[ids]
    if out is not None:
        ids = out.copy_(ids)
    if tokens_out is not None:
        tokens_out.copy_(ids)
    return ids
