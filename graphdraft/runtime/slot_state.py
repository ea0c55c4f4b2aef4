"""Per request-slot device state of the speculative cycle (allocated once; slot 0 = inert dummy).

The host writes a slot's row only when a request is admitted to it (`admit`); from then on
only device code reads and writes it: the cycle's prepare (ids, positions from last_token /
drafts / valid_cache_lengths), the accept kernel (sampling parameters, stop table, emitted,
max_new) and the commit (last_token, drafts, emitted, done). Slot 0 keeps neutral values
(greedy, no stop, done 0, never committed): padded and inert rows read it.

Tables (R = max_running_requests + 1, S = speculative_num_steps, W = stop_table_width):
  last_token   [R] int64     the last verified token of each slot (the next cycle's first input)
  drafts       [R, S] int64  the drafter's tokens after it (the next cycle's other N - 1 inputs;
                             after a cycle of k < S drafts, columns past k are filler; k = 0: all)
  temperature  [R] float32   0: greedy
  top_p        [R] float32   1: off
  top_k        [R] int32     0: off
  seed         [R] int64     Philox key of the slot's sampled tokens (`graphdraft.kernels.accept`)
  stop_ids     [R, W] int64  stop token ids (EOS unless ignore_eos, then stop_token_ids); -1: unused
  max_new      [R] int32     max_new_tokens
  emitted      [R] int32     tokens emitted so far
  done         [R] int32     1 once a stop token or max_new was reached (the row is inert after)
`valid_cache_lengths` stays in `RuntimeStates` (the drafter reads it too).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


class StopTableFullError(ValueError):
    """A request has more stop token ids than the device stop table holds."""


@dataclass
class SlotState:
    last_token: torch.Tensor
    drafts: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seed: torch.Tensor
    stop_ids: torch.Tensor
    max_new: torch.Tensor
    emitted: torch.Tensor
    done: torch.Tensor

    @classmethod
    def allocate(cls, num_slots: int, steps: int, stop_width: int,
                 device: str | torch.device) -> SlotState:
        def z(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(last_token=z(num_slots, torch.int64), drafts=z((num_slots, steps), torch.int64),
                   temperature=z(num_slots, torch.float32),
                   top_p=torch.ones(num_slots, dtype=torch.float32, device=device),
                   top_k=z(num_slots, torch.int32), seed=z(num_slots, torch.int64),
                   stop_ids=torch.full((num_slots, stop_width), -1, dtype=torch.int64, device=device),
                   max_new=torch.full((num_slots,), 2**30, dtype=torch.int32, device=device),
                   emitted=z(num_slots, torch.int32), done=z(num_slots, torch.int32))

    @property
    def stop_width(self) -> int:
        return self.stop_ids.shape[1]

    def admit(self, slot: int, *, temperature: float, top_p: float, top_k: int, seed: int,
              stop_ids: list[int], max_new: int) -> None:
        """Write slot `slot`'s row for a newly admitted request (stream-ordered copies from
        host memory; no sync). Raises StopTableFullError (writing nothing) past the width."""
        if not 1 <= slot < self.done.shape[0]:
            raise ValueError(f"slot: expected 1..{self.done.shape[0] - 1}, got {slot}")
        if len(stop_ids) > self.stop_width:
            raise StopTableFullError(f"stop_token_ids: expected at most {self.stop_width} stop "
                                     f"ids with EOS (RuntimeConfig.stop_table_width), got "
                                     f"{len(stop_ids)}")
        dev = self.done.device
        pin = dev.type == "cuda"
        # one int64 row [last, max_new, emitted, done, top_k, seed, stops...] + one float row
        ints = torch.tensor([0, max_new, 0, 0, top_k, seed]
                            + list(stop_ids) + [-1] * (self.stop_width - len(stop_ids)),
                            dtype=torch.int64)
        flts = torch.tensor([temperature, top_p], dtype=torch.float32)
        if pin:
            ints, flts = ints.pin_memory(), flts.pin_memory()
        ints = ints.to(dev, non_blocking=True)
        flts = flts.to(dev, non_blocking=True)
        self.last_token[slot] = ints[0]
        self.drafts[slot] = 0
        self.max_new[slot] = ints[1].to(torch.int32)
        self.emitted[slot] = 0
        self.done[slot] = 0
        self.top_k[slot] = ints[4].to(torch.int32)
        self.seed[slot] = ints[5]
        self.stop_ids[slot] = ints[6:]
        self.temperature[slot] = flts[0]
        self.top_p[slot] = flts[1]

    def release(self, slot: int) -> None:
        """Neutral row again (greedy, no stop, done): a stale row reads as inert."""
        self.done[slot] = 1
        self.temperature[slot] = 0
        self.stop_ids[slot] = -1

    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))
