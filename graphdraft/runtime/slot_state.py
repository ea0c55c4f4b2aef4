"""Per request-slot device state of the speculative cycle (allocated once; slot 0 = inert dummy).

The host writes a slot's row only when a request is admitted to it (`admit`); from then on
only device code reads and writes it: the cycle's prepare (ids, positions from last_token /
drafts / valid_cache_lengths), the acceptance (sampling columns, stop table, emitted,
max_new) and the commit (last_token, drafts, emitted, done). Slot 0 keeps neutral values
(greedy, no stop, done 0, never committed): padded and inert rows read it.

Tables (R = max_running_requests + 1, S = speculative_num_steps, W = stop_table_width):
  last_token   [R] int64     the last verified token of each slot (the next cycle's first input)
  drafts       [R, S] int64  the drafter's tokens after it (the next cycle's other N - 1 inputs;
                             after a cycle of k < S drafts, columns past k are filler; k = 0: all)
  stop_ids     [R, W] int64  stop token ids (EOS unless ignore_eos, then stop_token_ids); -1: unused
  emitted      [R] int32     tokens emitted so far
  done         [R] int32     1 once a stop token or max_new was reached (the row is inert after)
plus one `[R]` column per sampling field with a device column (`graphdraft.sampling.COLUMNS`:
max_new, temperature, top_p, top_k, seed; each field's dtype and neutral value are there).
`valid_cache_lengths` stays in `RuntimeStates` (the drafter reads it too).
"""

from __future__ import annotations

import torch

from graphdraft.sampling import COLUMNS


class StopTableFullError(ValueError):
    """A request has more stop token ids than the device stop table holds."""


_STATE_TABLES = ("last_token", "drafts", "stop_ids", "emitted", "done")


def table_names() -> list[str]:
    """Every `SlotState` table: the state tables, then the sampling columns."""
    return [*_STATE_TABLES, *(c.name for c in COLUMNS)]


class SlotState:
    """The tables above as attributes (`last_token`, ..., and one per `sampling.COLUMNS`)."""

    def __init__(self, tables: dict[str, torch.Tensor]) -> None:
        want = set(_STATE_TABLES) | {c.name for c in COLUMNS}
        if set(tables) != want:
            raise ValueError(f"tables: expected {sorted(want)}, got {sorted(tables)}")
        for name in table_names():
            setattr(self, name, tables[name])

    @classmethod
    def allocate(cls, num_slots: int, steps: int, stop_width: int,
                 device: str | torch.device) -> SlotState:
        def z(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)
        tables = dict(last_token=z(num_slots, torch.int64), drafts=z((num_slots, steps), torch.int64),
                      stop_ids=torch.full((num_slots, stop_width), -1, dtype=torch.int64,
                                          device=device),
                      emitted=z(num_slots, torch.int32), done=z(num_slots, torch.int32))
        for c in COLUMNS:
            tables[c.name] = torch.full((num_slots,), c.neutral, dtype=c.dtype, device=device)
        return cls(tables)

    def tables(self) -> dict[str, torch.Tensor]:
        """Every table by name (state tables first, then the sampling columns)."""
        return {name: getattr(self, name) for name in table_names()}

    @property
    def stop_width(self) -> int:
        return self.stop_ids.shape[1]

    def admit(self, slot: int, *, stop_ids: list[int], **columns: float | int) -> None:
        """Write slot `slot`'s row for a newly admitted request: `columns`, one value per
        sampling column by name (`graphdraft.sampling.device_row`), `stop_ids` its stop ids.
        Stream-ordered copies from host memory (one int64 row, one float32 row; no sync).
        Raises StopTableFullError (writing nothing) past the stop table's width."""
        if not 1 <= slot < self.done.shape[0]:
            raise ValueError(f"slot: expected 1..{self.done.shape[0] - 1}, got {slot}")
        if set(columns) != {c.name for c in COLUMNS}:
            raise ValueError(f"columns: expected {[c.name for c in COLUMNS]}, got {sorted(columns)}")
        if len(stop_ids) > self.stop_width:
            raise StopTableFullError(f"stop_token_ids: expected at most {self.stop_width} stop "
                                     f"ids with EOS (RuntimeConfig.stop_table_width), got "
                                     f"{len(stop_ids)}")
        ints = [c for c in COLUMNS if not c.dtype.is_floating_point]
        flts = [c for c in COLUMNS if c.dtype.is_floating_point]
        int_row = torch.tensor([columns[c.name] for c in ints] + list(stop_ids)
                               + [-1] * (self.stop_width - len(stop_ids)), dtype=torch.int64)
        flt_row = torch.tensor([columns[c.name] for c in flts], dtype=torch.float32)
        dev = self.done.device
        if dev.type == "cuda":
            int_row, flt_row = int_row.pin_memory(), flt_row.pin_memory()
        int_row = int_row.to(dev, non_blocking=True)
        flt_row = flt_row.to(dev, non_blocking=True)
        self.last_token[slot] = 0
        self.drafts[slot] = 0
        self.emitted[slot] = 0
        self.done[slot] = 0
        for i, c in enumerate(ints):
            getattr(self, c.name)[slot] = int_row[i].to(c.dtype)
        self.stop_ids[slot] = int_row[len(ints):]
        for i, c in enumerate(flts):
            getattr(self, c.name)[slot] = flt_row[i].to(c.dtype)

    def release(self, slot: int) -> None:
        """Neutral row again (done, no stop, neutral sampling columns): a stale row is inert."""
        self.done[slot] = 1
        self.stop_ids[slot] = -1
        for c in COLUMNS:
            getattr(self, c.name)[slot] = c.neutral

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables().values())
