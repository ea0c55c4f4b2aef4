"""Admitted requests' rows of the per-slot state tables in one launch (`SlotState` admission).

Tables (`runtime.slot_state.SlotState`; R slots, S draft steps, W stop width, V vocab, B
logit-bias width), passed by name in `tables` (`TABLES`, each contiguous):
  last_token [R] int64, drafts [R, S] int64, stop_ids [R, W] int64, emitted [R] int32,
  done [R] int32, token_counts [R, V] int32, bias_ids [R, B] int32, bias_values [R, B]
  float32, bias_len [R] int32.
Rows, m admitted requests with distinct `slots [m]` int64 (each in [1, R)):
  stop [m, W] int64, bias_ids [m, B] int32 (-1 past the row's entries), bias_values [m, B]
  float32 (0 past them), bias_len [m] int32; `counted [P]` int64, the flat
  `token_counts.view(-1)` index (`slot * V + id`) of every prompt token, rows in order, and
  `counted_off [m + 1]` int64 each row's first entry in it (`counted_off[m] = P`);
  `columns`, up to `MAX_COLUMNS` pairs (dst `[R]`, src `[m]` of dst's dtype).
Per row i, slot s = slots[i]:
  last_token[s] = drafts[s] = emitted[s] = done[s] = 0;  token_counts[s] = 0, then
  `PROMPT_FLAG` at each of the row's `counted` entries;  stop_ids[s] = stop[i];
  bias_ids[s] = bias_ids[i];  bias_values[s] = bias_values[i];  bias_len[s] = bias_len[i];
  each column: dst[s] = src[i].

`admit_rows_ref` (torch: an indexed fill or copy per table) is the torch path and the
kernel's oracle; `admit_rows` (Triton) writes the same values, one program per row. No host
sync; rows of other slots untouched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_tensor
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.logit_controls import PROMPT_FLAG

__all__ = ["MAX_COLUMNS", "TABLES", "admit_rows", "admit_rows_ref"]

TABLES = {"last_token": torch.int64, "drafts": torch.int64, "stop_ids": torch.int64,
          "emitted": torch.int32, "done": torch.int32, "token_counts": torch.int32,
          "bias_ids": torch.int32, "bias_values": torch.float32, "bias_len": torch.int32}
"""The state tables the admission writes, by name, with their dtypes."""
MAX_COLUMNS = 12
_BLOCK = 128       # row copies and the prompt loop
_BLOCK_V = 1024    # token_counts zeroing
_FLAG = tl.constexpr(PROMPT_FLAG)


def _check(tables: Mapping[str, torch.Tensor], slots: torch.Tensor, stop: torch.Tensor,
           counted: torch.Tensor, counted_off: torch.Tensor, bias_ids: torch.Tensor,
           bias_values: torch.Tensor, bias_len: torch.Tensor,
           columns: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Shapes, dtypes and devices of every argument (module doc); -> m."""
    if set(tables) != set(TABLES):
        raise ValueError(f"tables: expected {sorted(TABLES)}, got {sorted(tables)}")
    expect_tensor("slots", slots, shape=("m",), dtypes=torch.int64, layout="contiguous")
    m, dev = slots.shape[0], slots.device
    r = tables["done"].shape[0] if tables["done"].dim() == 1 else -1
    wide = {"drafts": "S", "stop_ids": "W", "token_counts": "V", "bias_ids": "B",
            "bias_values": "B"}
    for name, dt in TABLES.items():
        shape = (r, wide[name]) if name in wide else (r,)
        expect_tensor(f"tables[{name!r}]", tables[name], shape=shape, dtypes=dt, device=dev,
                      layout="contiguous")
    w, b = tables["stop_ids"].shape[1], tables["bias_ids"].shape[1]
    if tables["bias_values"].shape[1] != b:
        raise ValueError(f"tables['bias_values']: expected width {b} (bias_ids'), got "
                         f"{tables['bias_values'].shape[1]}")
    for name, t, shape, dt in (("stop", stop, (m, w), torch.int64),
                               ("counted", counted, ("P",), torch.int64),
                               ("counted_off", counted_off, (m + 1,), torch.int64),
                               ("bias_ids", bias_ids, (m, b), torch.int32),
                               ("bias_values", bias_values, (m, b), torch.float32),
                               ("bias_len", bias_len, (m,), torch.int32)):
        expect_tensor(name, t, shape=shape, dtypes=dt, device=dev, layout="contiguous")
    if len(columns) > MAX_COLUMNS:
        raise ValueError(f"columns: expected at most {MAX_COLUMNS} pairs, got {len(columns)}")
    for i, (dst, src) in enumerate(columns):
        expect_tensor(f"columns[{i}] destination", dst, shape=(r,), device=dev,
                      layout="contiguous")
        expect_tensor(f"columns[{i}] source", src, shape=(m,), dtypes=dst.dtype, device=dev,
                      layout="contiguous")
    return m


# --- torch path --------------------------------------------------------------------------------

def admit_rows_ref(tables: Mapping[str, torch.Tensor], slots: torch.Tensor, stop: torch.Tensor,
                   counted: torch.Tensor, counted_off: torch.Tensor, bias_ids: torch.Tensor,
                   bias_values: torch.Tensor, bias_len: torch.Tensor,
                   columns: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
    """Torch version of the admission (module doc): an indexed fill or copy per table."""
    _check(tables, slots, stop, counted, counted_off, bias_ids, bias_values, bias_len, columns)
    t = tables
    for name in ("last_token", "drafts", "emitted", "done", "token_counts"):
        t[name].index_fill_(0, slots, 0)
    t["stop_ids"].index_copy_(0, slots, stop)
    for dst, src in columns:
        dst.index_copy_(0, slots, src)
    if counted.numel():
        t["token_counts"].view(-1).index_fill_(0, counted, PROMPT_FLAG)
    t["bias_ids"].index_copy_(0, slots, bias_ids)
    t["bias_values"].index_copy_(0, slots, bias_values)
    t["bias_len"].index_copy_(0, slots, bias_len)


# --- Triton --------------------------------------------------------------------------------

@triton.jit
def _put_row(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
    """dst[:n] = src[:n]."""
    i = tl.arange(0, BLOCK)
    for j in range(0, n, BLOCK):
        mask = j + i < n
        tl.store(dst_ptr + j + i, tl.load(src_ptr + j + i, mask=mask), mask=mask)


@triton.jit
def _zero_row(dst_ptr, n, BLOCK: tl.constexpr):
    """dst[:n] = 0 (dst's dtype)."""
    i = tl.arange(0, BLOCK)
    zero = tl.zeros([BLOCK], dtype=dst_ptr.dtype.element_ty)
    for j in range(0, n, BLOCK):
        tl.store(dst_ptr + j + i, zero, mask=j + i < n)


@triton.jit
def _column(dst_ptr, src_ptr, slot, row):
    tl.store(dst_ptr + slot, tl.load(src_ptr + row))


@triton.jit
def _admit_kernel(slots_ptr, last_ptr, drafts_ptr, stop_t_ptr, emitted_ptr, done_ptr, counts_ptr,
                  bias_ids_t_ptr, bias_values_t_ptr, bias_len_t_ptr,
                  stop_ptr, counted_ptr, off_ptr, bias_ids_ptr, bias_values_ptr, bias_len_ptr,
                  S, W, V, B,
                  d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11,
                  s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11,
                  NCOL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    tl.store(last_ptr + slot, 0)
    tl.store(emitted_ptr + slot, 0)
    tl.store(done_ptr + slot, 0)
    tl.store(bias_len_t_ptr + slot, tl.load(bias_len_ptr + row))
    _zero_row(drafts_ptr + slot * S, S, BLOCK)
    _put_row(stop_t_ptr + slot * W, stop_ptr + row * W, W, BLOCK)
    _put_row(bias_ids_t_ptr + slot * B, bias_ids_ptr + row * B, B, BLOCK)
    _put_row(bias_values_t_ptr + slot * B, bias_values_ptr + row * B, B, BLOCK)
    _zero_row(counts_ptr + slot * V, V, BLOCK_V)
    tl.debug_barrier()  # the row's zeros stored before its prompt flags (same addresses)
    lo = tl.load(off_ptr + row)
    hi = tl.load(off_ptr + row + 1)
    i = tl.arange(0, BLOCK)
    flag = tl.full([BLOCK], _FLAG, dtype=counts_ptr.dtype.element_ty)
    for j in range(lo, hi, BLOCK):
        mask = j + i < hi
        at = tl.load(counted_ptr + j + i, mask=mask, other=0)
        tl.store(counts_ptr + at, flag, mask=mask)
    if NCOL > 0:
        _column(d0, s0, slot, row)
    if NCOL > 1:
        _column(d1, s1, slot, row)
    if NCOL > 2:
        _column(d2, s2, slot, row)
    if NCOL > 3:
        _column(d3, s3, slot, row)
    if NCOL > 4:
        _column(d4, s4, slot, row)
    if NCOL > 5:
        _column(d5, s5, slot, row)
    if NCOL > 6:
        _column(d6, s6, slot, row)
    if NCOL > 7:
        _column(d7, s7, slot, row)
    if NCOL > 8:
        _column(d8, s8, slot, row)
    if NCOL > 9:
        _column(d9, s9, slot, row)
    if NCOL > 10:
        _column(d10, s10, slot, row)
    if NCOL > 11:
        _column(d11, s11, slot, row)


def admit_rows(tables: Mapping[str, torch.Tensor], slots: torch.Tensor, stop: torch.Tensor,
               counted: torch.Tensor, counted_off: torch.Tensor, bias_ids: torch.Tensor,
               bias_values: torch.Tensor, bias_len: torch.Tensor,
               columns: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), *,
               kernels: KernelConfig | None = None) -> None:
    """Triton version of `admit_rows_ref`: one launch, one program per row. `kernels`: the
    launch settings (None: the default; this launch reads none)."""
    m = _check(tables, slots, stop, counted, counted_off, bias_ids, bias_values, bias_len,
               columns)
    if m == 0:
        return
    t = dict(tables)
    for name, stand_in in (("token_counts", "done"), ("drafts", "last_token"),
                           ("stop_ids", "last_token"), ("bias_ids", "bias_len"),
                           ("bias_values", "bias_len")):
        if t[name].numel() == 0:  # width 0: nothing stored, no pointer to an empty tensor
            t[name] = t[stand_in]
    pad = MAX_COLUMNS - len(columns)
    dsts = [d for d, _ in columns] + [slots] * pad
    srcs = [s for _, s in columns] + [slots] * pad
    _admit_kernel[(m,)](
        slots, t["last_token"], t["drafts"], t["stop_ids"], t["emitted"], t["done"],
        t["token_counts"],
        t["bias_ids"], t["bias_values"], t["bias_len"],
        stop if stop.numel() else slots, counted if counted.numel() else slots, counted_off,
        bias_ids if bias_ids.numel() else bias_len,
        bias_values if bias_values.numel() else bias_len, bias_len,
        *(tables[name].shape[1] for name in ("drafts", "stop_ids", "token_counts", "bias_ids")),
        *dsts, *srcs, NCOL=len(columns), BLOCK=_BLOCK, BLOCK_V=_BLOCK_V, num_warps=4)
