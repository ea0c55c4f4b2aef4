"""What one forward is: its mode, which hidden states it keeps, and its context."""

from __future__ import annotations

import enum
from dataclasses import dataclass


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


def write_batch(buffers, page_table, rows: list[BatchRow]) -> ForwardContext:
    """Fill `InputBuffers` for `rows` (prefill rows must come first); returns the context.

    Slots are computed on the host from the page table's host-side page lists, then
    copied in one transfer per buffer. Every row's positions must already be reserved.
    """
    import torch

    num_extends = sum(r.is_prefill for r in rows)
    if any(r.is_prefill for r in rows[num_extends:]):
        raise ValueError("rows: expected prefill rows before decode rows")
    ps = page_table.page_size
    ids, positions, locs, shifted = [], [], [], []
    for r in rows:
        pages = page_table.pages_of(r.slot)
        if len(pages) * ps < r.end:
            raise ValueError(f"rows: slot {r.slot} holds {len(pages) * ps} positions, needs {r.end}")
        for j, tok in enumerate(r.input_ids):
            p = r.start + j
            ids.append(tok)
            positions.append(p)
            locs.append(pages[p // ps] * ps + p % ps)
        if r.is_prefill:
            nxt = r.next_ids if r.next_ids is not None else [-1] * len(r.input_ids)
            if len(nxt) != len(r.input_ids):
                raise ValueError("rows: next_ids must match input_ids in length")
            shifted.extend(nxt)
    t, bs = len(ids), len(rows)
    if bs > buffers.max_bs or t > buffers.max_tokens:
        raise ValueError(f"rows: {bs} rows / {t} tokens exceed the buffers "
                         f"({buffers.max_bs} / {buffers.max_tokens})")
    dev = buffers.input_ids.device

    def put(dst, values, dtype):
        if values:
            src = torch.tensor(values, dtype=dtype)
            if dev.type == "cuda":
                src = src.pin_memory()  # pageable sources make non_blocking copies synchronous
            dst[: len(values)].copy_(src.to(dev, non_blocking=True))

    put(buffers.input_ids, ids, torch.int64)
    put(buffers.positions, positions, torch.int64)
    put(buffers.out_cache_loc, locs, torch.int64)
    put(buffers.shifted_prefill_ids, shifted, torch.int64)
    put(buffers.seq_lens, [r.end for r in rows], torch.int32)
    put(buffers.req_pool_indices, [r.slot for r in rows], torch.int64)
    put(buffers.extend_lens, [len(r.input_ids) for r in rows], torch.int32)
    mid_chunk = num_extends == bs and all(
        r.next_ids is not None and r.next_ids[-1] >= 0 for r in rows)
    return ForwardContext(bs=bs, num_extends=num_extends, input_num_tokens=t,
                          all_extends_mid_chunk=bs > 0 and mid_chunk)
