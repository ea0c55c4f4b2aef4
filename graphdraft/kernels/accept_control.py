"""Accept-rate control for benchmarks: drafts that match the target with a chosen probability.

A benchmark with random weights has no meaningful accept rate. This op overwrites the drafter's
drafts, in place, so that each one equals the target's own greedy token with probability `p`:

  next_tokens  [bs, S + 1] int32/int64 (any strides): column 0 the last verified token of each
               row (left alone), column j = 1..S the draft for absolute position positions[r] + j
  slots        [bs] int32/int64: each row's request slot (row of `oracle`)
  positions    [bs] int32/int64: absolute position of column 0's token (the drafter's
               `write_start`: committed length after this step's accept)
  oracle       [max_reqs + 1, max_context_len] int32 (any strides): oracle[slot, q] is the token
               at position q of that request's greedy continuation (prompt, then what a
               target-only run of the same prompt emitted); negative = unknown

  draft j of row r, with q = positions[r] + j, o = oracle[slots[r], q]:
      coin < p  -> o
      else      -> a token id in [0, vocab_size) other than o (uniform up to modulo bias)
  left unchanged where the slot or q is out of the table, or o is not in [0, vocab_size).

Noise is counter-based Philox (`tl.randint4x`, 10 rounds), keyed by (seed, slot * max_context_len
+ q): no generator state, nothing to refill, the same draw for the same (request slot, position)
whichever cycle, padded bs or graph replays it. Each position's coin decides acceptance at most
once (after a rejection at q the target's token is committed there and the next drafts start at
q + 1), so the accept lengths are exactly truncated geometric in p: per-draft match rate p,
mean accept (1 - p^(S+1)) / (1 - p). The coin is the top 24 bits of the first Philox word
against trunc(p * 2^24) (exact in fp32 too); the random token is (second word >> 1) % (vocab_size - 1), shifted up
by one at or above o. Integer-only, so `accept_control_ref` (torch, int64 Philox) matches bit
for bit.

`p` is a host number (baked into a captured graph) or a one-element float32 device tensor read
by the kernel at each launch (clamped to [0, 1]): one captured graph then serves every regime,
the benchmark writes the tensor between runs.

Graph-capturable: host-side shape checks only, no allocation, no sync (the reference reads a
tensor p on the host); `seed` is baked into a captured graph.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from graphdraft.checks import INDEX_DTYPES, expect_int, expect_tensor
from graphdraft.kernels.accept import philox4x32_ref
from graphdraft.kernels.config import KernelConfig

__all__ = ["accept_control", "accept_control_ref", "philox4x32_ref"]


@triton.jit
def _accept_control_kernel(tok_ptr, stride_tr, stride_tc, slot_ptr, pos_ptr, oracle_ptr,
                           stride_or, stride_oc, S, L, R, threshold, p_ptr, vocab, seed,
                           BLOCK: tl.constexpr, P_TENSOR: tl.constexpr):
    r = tl.program_id(0)
    if P_TENSOR:  # p read on the device at every launch: one captured graph serves every p
        pv = tl.minimum(tl.maximum(tl.load(p_ptr).to(tl.float32), 0.0), 1.0)
        threshold = (pv * 16777216.0).to(tl.int32)
    j = 1 + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + r).to(tl.int64) + tl.zeros([BLOCK], dtype=tl.int64)  # per lane
    q = tl.load(pos_ptr + r).to(tl.int64) + j
    ok = (j <= S) & (q >= 0) & (q < L) & (slot >= 0) & (slot < R)
    o = tl.load(oracle_ptr + slot * stride_or + q * stride_oc, mask=ok, other=-1)
    ok = ok & (o >= 0) & (o < vocab)
    ctr = tl.where(ok, slot * L + q, 0).to(tl.int32)
    r0, r1, _r2, _r3 = tl.randint4x(seed, ctr)
    coin = (r0 >> 8).to(tl.int32)
    rnd = (r1 >> 1).to(tl.int32) % (vocab - 1)
    rnd = tl.where(rnd >= o, rnd + 1, rnd)
    new = tl.where(coin < threshold, o, rnd)
    tl.store(tok_ptr + r.to(tl.int64) * stride_tr + j.to(tl.int64) * stride_tc,
             new.to(tok_ptr.dtype.element_ty), mask=ok)


def _check(next_tokens, slots, positions, oracle, p, seed, vocab_size) -> tuple[int | None, int]:
    """-> (threshold, or None for a tensor p; S); raises ValueError naming the argument."""
    expect_tensor("next_tokens", next_tokens, shape=("bs", "S + 1"), dtypes=INDEX_DTYPES)
    bs, dev = next_tokens.shape[0], next_tokens.device
    for name, t in (("slots", slots), ("positions", positions)):
        # unit stride whenever there is a row (strictly: also a single row)
        expect_tensor(name, t, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                      layout="rows" if bs else None)
    expect_tensor("oracle", oracle, shape=("max_reqs + 1", "max_context_len"), dtypes=torch.int32,
                  device=dev)
    rows, ctx = oracle.shape
    if rows * ctx >= 2**31:
        raise ValueError(f"oracle: expected (max_reqs + 1) * max_context_len < 2^31 (the noise "
                         f"counter is int32), got {rows} x {ctx}")
    if isinstance(p, torch.Tensor):
        if p.numel() != 1 or p.dtype != torch.float32 or p.device != next_tokens.device:
            raise ValueError(f"p: expected a number in [0, 1] or a one-element float32 tensor on "
                             f"{next_tokens.device}, got {p.dtype} {tuple(p.shape)} on {p.device}")
    elif isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"p: expected a number in [0, 1], got {p!r}")
    expect_int("seed", seed, 0, 2**31 - 1)
    expect_int("vocab_size", vocab_size, 2, 2**31 - 1)
    # from p's float32 value, as the kernel computes it from a tensor p: both paths agree
    threshold = None if isinstance(p, torch.Tensor) else int(np.float32(p) * np.float32(1 << 24))
    return threshold, next_tokens.shape[1] - 1


def accept_control(next_tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                   oracle: torch.Tensor, p: float, seed: int, vocab_size: int, *,
                   kernels: KernelConfig | None = None) -> None:
    """Overwrite drafts `next_tokens[:, 1:]` in place (module docstring). One program per row
    (`graphdraft.ops.accept_control` chooses). `kernels`: the launch settings (None: the default; this launch reads none)."""
    threshold, s = _check(next_tokens, slots, positions, oracle, p, seed, vocab_size)
    bs = next_tokens.shape[0]
    if bs == 0 or s == 0:
        return
    _accept_control_kernel[(bs,)](
        next_tokens, next_tokens.stride(0), next_tokens.stride(1), slots, positions, oracle,
        oracle.stride(0), oracle.stride(1), s, oracle.shape[1], oracle.shape[0],
        0 if threshold is None else threshold, p if threshold is None else oracle, vocab_size,
        seed, BLOCK=triton.next_power_of_2(s), P_TENSOR=threshold is None, num_warps=1)


def accept_control_ref(next_tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                       oracle: torch.Tensor, p: float, seed: int, vocab_size: int) -> None:
    """Torch reference of `accept_control`: same arguments, same writes."""
    threshold, s = _check(next_tokens, slots, positions, oracle, p, seed, vocab_size)
    bs = next_tokens.shape[0]
    if bs == 0 or s == 0:
        return
    if threshold is None:
        threshold = int((p.reshape(()).clamp(0.0, 1.0) * (1 << 24)).to(torch.int32))
    rows, ctx = oracle.shape
    j = torch.arange(1, s + 1, device=next_tokens.device)
    slot = slots.to(torch.int64)[:, None].expand(bs, s)
    q = positions.to(torch.int64)[:, None] + j
    ok = (q >= 0) & (q < ctx) & (slot >= 0) & (slot < rows)
    o = torch.full((bs, s), -1, dtype=torch.int64, device=next_tokens.device)
    o[ok] = oracle[slot[ok], q[ok]].to(torch.int64)
    ok &= (o >= 0) & (o < vocab_size)
    ctr = torch.where(ok, slot * ctx + q, 0)
    r0, r1, _, _ = philox4x32_ref(seed, ctr)
    rnd = (r1 >> 1) % (vocab_size - 1)
    rnd = torch.where(rnd >= o, rnd + 1, rnd)
    new = torch.where((r0 >> 8) < threshold, o, rnd)
    drafts = next_tokens[:, 1:]
    drafts.copy_(torch.where(ok, new, drafts.to(torch.int64)).to(next_tokens.dtype))
