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
  token_counts [R, V] int32  per token id: its count in the request's output so far (bits
                             0..29) | `PROMPT_FLAG` (bit 30) when it occurs in the prompt:
                             what the penalties read (repetition_penalty: prompt and output,
                             frequency / presence: output only, vLLM's convention). Reset to
                             the prompt's flags at admission, counted in each cycle's
                             commit (`ops.count_tokens`); 4 * R * V bytes (e.g. 65
                             slots x 128256 ids: 33 MB), allocated once with the others.
  bias_ids     [R, B] int32  the request's `logit_bias` ids (B = `sampling.MAX_LOGIT_BIAS`),
  bias_values  [R, B] float32  their biases, and
  bias_len     [R] int32     how many are used (0: no bias)
plus one `[R]` column per sampling field with a device column (`graphdraft.sampling.COLUMNS`:
max_new, temperature, top_p, top_k, seed, min_p, repetition_penalty, frequency_penalty,
presence_penalty; each field's dtype and neutral value are there). The logit controls
(`graphdraft.kernels.logit_controls`) read token_counts, the bias tables and the penalty
columns; the acceptance reads min_p. `valid_cache_lengths` stays in `RuntimeStates` (the
drafter reads it too).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphdraft.kernels.logit_controls import PROMPT_FLAG
from graphdraft.sampling import COLUMNS, MAX_LOGIT_BIAS


class StopTableFullError(ValueError):
    """A request has more stop token ids than the device stop table holds."""


_STATE_TABLES = ("last_token", "drafts", "stop_ids", "emitted", "done", "token_counts",
                 "bias_ids", "bias_values", "bias_len")


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
                 device: str | torch.device, *, vocab: int = 0) -> SlotState:
        """The tables for `num_slots` slots; `vocab`: token_counts' width (the target's vocab;
        0: no counts, for callers that never apply the logit controls)."""
        def z(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)
        tables = dict(last_token=z(num_slots, torch.int64), drafts=z((num_slots, steps), torch.int64),
                      stop_ids=torch.full((num_slots, stop_width), -1, dtype=torch.int64,
                                          device=device),
                      emitted=z(num_slots, torch.int32), done=z(num_slots, torch.int32),
                      token_counts=z((num_slots, vocab), torch.int32),
                      bias_ids=torch.full((num_slots, MAX_LOGIT_BIAS), -1, dtype=torch.int32,
                                          device=device),
                      bias_values=z((num_slots, MAX_LOGIT_BIAS), torch.float32),
                      bias_len=z(num_slots, torch.int32))
        for c in COLUMNS:
            tables[c.name] = torch.full((num_slots,), c.neutral, dtype=c.dtype, device=device)
        return cls(tables)

    def tables(self) -> dict[str, torch.Tensor]:
        """Every table by name (state tables first, then the sampling columns)."""
        return {name: getattr(self, name) for name in table_names()}

    @property
    def stop_width(self) -> int:
        return self.stop_ids.shape[1]

    @property
    def vocab(self) -> int:
        return self.token_counts.shape[1]

    def admit(self, slot: int, *, stop_ids: list[int], prompt: Sequence[int] = (),
              logit_bias: Sequence[tuple[int, float]] = (), **columns: float | int) -> None:
        """Write slot `slot`'s row for a newly admitted request: `columns`, one value per
        sampling column by name (`graphdraft.sampling.device_row`), `stop_ids` its stop ids,
        its token counts (the `prompt`'s flags, no output), its `logit_bias` entries
        (`SamplingParams.logit_bias`). Stream-ordered copies from host memory (no sync).
        Raises StopTableFullError past the stop table's width, ValueError naming the argument
        for a bias or prompt id outside [0, vocab) (both writing nothing)."""
        if not 1 <= slot < self.done.shape[0]:
            raise ValueError(f"slot: expected 1..{self.done.shape[0] - 1}, got {slot}")
        self._check_counted(prompt, logit_bias)
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
        int_row, flt_row = _stream_copies(self.done.device, int_row, flt_row)
        self.last_token[slot] = 0
        self.drafts[slot] = 0
        self.emitted[slot] = 0
        self.done[slot] = 0
        for i, c in enumerate(ints):
            getattr(self, c.name)[slot] = int_row[i].to(c.dtype)
        self.stop_ids[slot] = int_row[len(ints):]
        for i, c in enumerate(flts):
            getattr(self, c.name)[slot] = flt_row[i].to(c.dtype)
        self._admit_counts(slot, prompt, logit_bias)

    def _check_counted(self, prompt: Sequence[int], logit_bias) -> None:
        v = self.vocab
        if len(logit_bias) > self.bias_ids.shape[1]:
            raise ValueError(f"logit_bias: expected at most {self.bias_ids.shape[1]} entries, "
                             f"got {len(logit_bias)}")
        for name, ids in (("prompt", list(prompt)), ("logit_bias", [t for t, _ in logit_bias])):
            if ids and v and not all(0 <= t < v for t in ids):
                raise ValueError(f"{name}: expected token ids in [0, {v}), got "
                                 f"{[t for t in ids if not 0 <= t < v][:4]}")
        if logit_bias and not v:
            raise ValueError("logit_bias: expected none on slot tables without token counts "
                             "(SlotState.allocate(vocab=0))")

    def _admit_counts(self, slot: int, prompt: Sequence[int], logit_bias) -> None:
        """token_counts[slot] = the prompt's flags; the bias tables' row = `logit_bias`."""
        nb = len(logit_bias)
        ids, bias, bias_ids = _stream_copies(
            self.done.device, torch.tensor(list(prompt) if self.vocab else [], dtype=torch.int64),
            torch.tensor([b for _, b in logit_bias], dtype=torch.float32),
            torch.tensor([t for t, _ in logit_bias], dtype=torch.int32))
        self.token_counts[slot] = 0
        if ids.numel():
            self.token_counts[slot].index_fill_(0, ids, PROMPT_FLAG)
        self.bias_ids[slot] = -1
        self.bias_values[slot] = 0.0
        if nb:
            self.bias_ids[slot, :nb] = bias_ids
            self.bias_values[slot, :nb] = bias
        self.bias_len[slot] = nb

    def release(self, slot: int) -> None:
        """Neutral row again (done, no stop, neutral sampling columns): a stale row is inert."""
        self.done[slot] = 1
        self.stop_ids[slot] = -1
        self.bias_len[slot] = 0
        for c in COLUMNS:
            getattr(self, c.name)[slot] = c.neutral

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables().values())


def _stream_copies(device: torch.device, *rows: torch.Tensor) -> list[torch.Tensor]:
    """Host tensors on `device`, copied in stream order (pinned first on CUDA: no sync)."""
    if device.type == "cuda":
        rows = tuple(r.pin_memory() for r in rows)
    return [r.to(device, non_blocking=True) for r in rows]
