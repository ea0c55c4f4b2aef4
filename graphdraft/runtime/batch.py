"""What one forward is: its mode, which hidden states it keeps, and its context."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from graphdraft import ops
from graphdraft.kernels.config import KernelConfig
from graphdraft.runtime.staging import HostStaging


class ForwardMode(enum.Enum):
    """Token layout of a target forward (and of the draft's first step).

    EXTEND: every row is a prefill chunk (ragged lengths).
    DECODE: every row is a decode row of `spec_num_tokens` tokens (verify).
    MIXED:  `num_extends` prefill rows first, then decode rows.
    IDLE:   no rows (a data-parallel rank with nothing to do).
    """

    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"

    @classmethod
    def of(cls, bs: int, num_extends: int) -> ForwardMode:
        if bs == 0:
            return cls.IDLE
        if num_extends == 0:
            return cls.DECODE
        return cls.EXTEND if num_extends == bs else cls.MIXED


@dataclass
class ForwardContext:
    """The target's batch as the drafter sees it, after the engine filled `InputBuffers`.

    Rows: `num_extends` prefill rows first, then `bs - num_extends` decode rows
    of `spec_num_tokens` tokens each; `input_num_tokens` tokens in all.
    `all_extends_mid_chunk` is True when every row is a prefill chunk that is
    not its request's last chunk (no draft from it can be verified).
    """

    bs: int
    num_extends: int
    input_num_tokens: int
    forward_mode: ForwardMode | None = None
    all_extends_mid_chunk: bool = False

    def __post_init__(self) -> None:
        if self.bs < 0:
            raise ValueError(f"bs: expected >= 0, got {self.bs}")
        if not 0 <= self.num_extends <= self.bs:
            raise ValueError(f"num_extends: expected 0..bs ({self.bs}), got {self.num_extends}")
        if self.input_num_tokens < self.bs:
            raise ValueError(
                f"input_num_tokens: expected >= bs ({self.bs}), got {self.input_num_tokens}")
        mode = ForwardMode.of(self.bs, self.num_extends)
        if self.forward_mode is None:
            self.forward_mode = mode
        elif self.forward_mode is not mode:
            raise ValueError(f"forward_mode: expected {mode} for bs={self.bs}, "
                             f"num_extends={self.num_extends}, got {self.forward_mode}")

    @property
    def num_decodes(self) -> int:
        return self.bs - self.num_extends


@dataclass
class BatchRow:
    """One row of a target forward, as the engine schedules it.

    slot       request-pool slot
    start      position of the first input token (the committed KV length before this step)
    input_ids  the tokens fed this step: a prefill chunk, or N verify tokens of a decode row
    next_ids   prefill rows: the next token after each input position (the prompt shifted
               one left; -1 where it is the target's output, i.e. at the end of the prompt)
    """

    slot: int
    start: int
    input_ids: list[int]
    is_prefill: bool
    next_ids: list[int] | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.input_ids)


def write_batch(buffers, page_table, rows: list[BatchRow], *,
                staging: HostStaging | None = None,
                kernels: KernelConfig | None = None) -> ForwardContext:
    """Fill `InputBuffers` for `rows` (prefill rows must come first); returns the context.

    Slots are computed on the host (vectorised) from the page table's host-side page lists,
    then copied through `staging` (a pinned ring: no host sync): with `kernels` on the
    Triton path every buffer's values in one stream-ordered transfer, scattered into the
    buffers by one `ops.copy_segments` launch; else one transfer per buffer (`staging`
    None: a pinned copy per buffer). Every row's positions must already be reserved."""
    num_extends = sum(r.is_prefill for r in rows)
    if any(r.is_prefill for r in rows[num_extends:]):
        raise ValueError("rows: expected prefill rows before decode rows")
    ps = page_table.page_size
    lens = np.fromiter((len(r.input_ids) for r in rows), np.int64, len(rows))
    t, bs = int(lens.sum()), len(rows)
    page_lists = []
    for r in rows:
        pages = page_table.pages_of(r.slot)
        if len(pages) * ps < r.end:
            raise ValueError(f"rows: slot {r.slot} holds {len(pages) * ps} positions, needs {r.end}")
        if r.is_prefill and r.next_ids is not None and len(r.next_ids) != len(r.input_ids):
            raise ValueError("rows: next_ids must match input_ids in length")
        page_lists.append(pages)
    if bs > buffers.max_bs or t > buffers.max_tokens:
        raise ValueError(f"rows: {bs} rows / {t} tokens exceed the buffers "
                         f"({buffers.max_bs} / {buffers.max_tokens})")
    starts = np.fromiter((r.start for r in rows), np.int64, bs)
    row_of = np.repeat(np.arange(bs), lens)
    first = np.cumsum(lens) - lens  # each row's first token
    positions = starts[row_of] + np.arange(t) - first[row_of]
    page_lens = np.fromiter((len(p) for p in page_lists), np.int64, bs)
    flat_pages = np.fromiter(itertools.chain.from_iterable(page_lists), np.int64,
                             int(page_lens.sum()))
    page0 = np.cumsum(page_lens) - page_lens  # each row's first page in flat_pages
    locs = flat_pages[page0[row_of] + positions // ps] * ps + positions % ps
    ids = np.fromiter(itertools.chain.from_iterable(r.input_ids for r in rows), np.int64, t)
    shifted = list(itertools.chain.from_iterable(
        r.next_ids if r.next_ids is not None else [-1] * len(r.input_ids)
        for r in rows[:num_extends]))
    values = [(buffers.input_ids, ids), (buffers.positions, positions),
              (buffers.out_cache_loc, locs), (buffers.shifted_prefill_ids, shifted),
              (buffers.seq_lens, starts + lens), (buffers.req_pool_indices, [r.slot for r in rows]),
              (buffers.extend_lens, lens)]
    if staging is not None and kernels is not None and kernels.use_triton:
        staged = staging.pack(*((v, dst.dtype) for dst, v in values))
        ops.copy_segments([(dst, src) for (dst, _), src in zip(values, staged, strict=True)],
                          kernels=kernels)
    else:
        put = staging.copy_into if staging is not None else _pinned_copy
        for dst, v in values:
            put(dst, v)
    mid_chunk = num_extends == bs and all(
        r.next_ids is not None and r.next_ids[-1] >= 0 for r in rows)
    return ForwardContext(bs=bs, num_extends=num_extends, input_num_tokens=t,
                          all_extends_mid_chunk=bs > 0 and mid_chunk)


def _pinned_copy(dst: torch.Tensor, values) -> None:
    """`dst[:len(values)] = values` through a pinned copy (a pageable source would make the
    non_blocking copy wait for the stream)."""
    if len(values):
        src = torch.as_tensor(np.asarray(values), dtype=dst.dtype)
        if dst.device.type == "cuda":
            src = src.pin_memory()
        dst[: len(values)].copy_(src.to(dst.device, non_blocking=True))
