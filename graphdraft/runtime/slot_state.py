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

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from graphdraft import ops
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.slot_admit import TABLES as ADMITTED_TABLES
from graphdraft.runtime.staging import HostStaging
from graphdraft.sampling import COLUMNS, MAX_LOGIT_BIAS


class StopTableFullError(ValueError):
    """A request has more stop token ids than the device stop table holds."""


_STATE_TABLES = tuple(ADMITTED_TABLES)  # the admission writes every state table


def table_names() -> list[str]:
    """Every `SlotState` table: the state tables, then the sampling columns."""
    return [*_STATE_TABLES, *(c.name for c in COLUMNS)]


class SlotState:
    """The tables above as attributes (`last_token`, ..., and one per `sampling.COLUMNS`):
    the instance dict holds the tables only (`vars(slots)`); the host-side members (the
    staging ring, pending admissions / releases) are slots."""

    __slots__ = ("__dict__", "staging", "kernels", "_admitting", "_releasing",
                 "_batch_releases")

    def __init__(self, tables: dict[str, torch.Tensor], *,
                 kernels: KernelConfig | None = None) -> None:
        want = set(_STATE_TABLES) | {c.name for c in COLUMNS}
        if set(tables) != want:
            raise ValueError(f"tables: expected {sorted(want)}, got {sorted(tables)}")
        for name in table_names():
            setattr(self, name, tables[name])
        self.staging = HostStaging(self.done.device)
        """The pinned ring the host writes these tables through (the Engine's other small
        host -> device copies share it)."""
        self.kernels = kernels
        """The admission's op path (`ops.admit_slot_rows`; None: the default config)."""
        self._admitting: list[_Admission] | None = None  # inside `admitting()`
        self._releasing: list[int] = []
        self._batch_releases = False  # inside `releasing()`

    @classmethod
    def allocate(cls, num_slots: int, steps: int, stop_width: int,
                 device: str | torch.device, *, vocab: int = 0,
                 kernels: KernelConfig | None = None) -> SlotState:
        """The tables for `num_slots` slots; `vocab`: token_counts' width (the target's vocab;
        0: no counts, for callers that never apply the logit controls); `kernels`: the
        admission's op path (None: the default config)."""
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
        return cls(tables, kernels=kernels)

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
        (`SamplingParams.logit_bias`). Stream-ordered writes from pinned staging (no host
        sync); inside `admitting()` the row is written with the others on its exit.
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
        row = _Admission(slot, list(stop_ids), prompt if self.vocab else (), list(logit_bias),
                         columns)
        if slot in self._releasing:
            self._write_releases()
        if self._admitting is None:
            self._write_admissions([row])
            return
        if any(r.slot == slot for r in self._admitting):
            self._write_admissions(self._admitting)
            self._admitting.clear()
        self._admitting.append(row)

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """`admit` calls inside write their rows together when the block exits (also when one
        raised: the rows admitted before it are written): one staging copy and one launch per
        table whatever the number of rows."""
        outer = self._admitting is not None
        if not outer:
            self._admitting = []
        try:
            yield
        finally:
            if not outer:
                rows, self._admitting = self._admitting, None
                if rows:
                    self._write_admissions(rows)

    def _check_counted(self, prompt: Sequence[int], logit_bias) -> None:
        v = self.vocab
        if len(logit_bias) > self.bias_ids.shape[1]:
            raise ValueError(f"logit_bias: expected at most {self.bias_ids.shape[1]} entries, "
                             f"got {len(logit_bias)}")
        for name, ids in (("prompt", prompt), ("logit_bias", [t for t, _ in logit_bias])):
            bad = _outside(ids, v) if v and len(ids) else []
            if bad:
                raise ValueError(f"{name}: expected token ids in [0, {v}), got {bad}")
        if logit_bias and not v:
            raise ValueError("logit_bias: expected none on slot tables without token counts "
                             "(SlotState.allocate(vocab=0))")

    def _write_admissions(self, rows: list[_Admission]) -> None:
        """The admitted rows' tables (validated by `admit`): one staging copy of every host
        value, then `ops.admit_slot_rows` (one launch on the Triton path)."""
        m, w, v, nb_max = len(rows), self.stop_width, self.vocab, self.bias_ids.shape[1]
        slots = np.fromiter((r.slot for r in rows), np.int64, m)
        stop = np.full((m, w), -1, dtype=np.int64)
        bias_ids = np.full((m, nb_max), -1, dtype=np.int32)
        bias_values = np.zeros((m, nb_max), dtype=np.float32)
        for i, r in enumerate(rows):
            stop[i, : len(r.stop_ids)] = r.stop_ids
            if r.logit_bias:
                bias_ids[i, : len(r.logit_bias)] = [t for t, _ in r.logit_bias]
                bias_values[i, : len(r.logit_bias)] = [b for _, b in r.logit_bias]
        counted = [np.asarray(r.prompt, dtype=np.int64) + r.slot * v for r in rows if len(r.prompt)]
        counted_off = np.zeros(m + 1, dtype=np.int64)
        np.cumsum([len(r.prompt) for r in rows], out=counted_off[1:])
        dev = self.staging.pack(
            (slots, torch.int64), (stop.reshape(-1), torch.int64),
            (np.concatenate(counted) if counted else (), torch.int64), (counted_off, torch.int64),
            (bias_ids.reshape(-1), torch.int32), (bias_values.reshape(-1), torch.float32),
            ([len(r.logit_bias) for r in rows], torch.int32),
            *(([r.columns[c.name] for r in rows], c.dtype) for c in COLUMNS))
        idx, stop_d, counted_d, off_d, bias_ids_d, bias_values_d, bias_len_d = dev[:7]
        tables = {name: getattr(self, name) for name in _STATE_TABLES}
        columns = [(getattr(self, c.name), col) for c, col in zip(COLUMNS, dev[7:], strict=True)]
        ops.admit_slot_rows(tables, idx, stop_d.view(m, w), counted_d, off_d,
                            bias_ids_d.view(m, nb_max), bias_values_d.view(m, nb_max), bias_len_d,
                            columns, kernels=self.kernels)

    def release(self, slot: int) -> None:
        """Neutral row again (done, no stop, neutral sampling columns): a stale row is inert.
        No host sync; inside `releasing()` written with the others on its exit."""
        if self._admitting and any(r.slot == slot for r in self._admitting):
            self._write_admissions(self._admitting)
            self._admitting.clear()
        self._releasing.append(slot)
        if not self._batch_releases:
            self._write_releases()

    @contextlib.contextmanager
    def releasing(self) -> Iterator[None]:
        """`release` calls inside write their rows together when the block exits."""
        outer, self._batch_releases = self._batch_releases, True
        try:
            yield
        finally:
            self._batch_releases = outer
            if not outer:
                self._write_releases()

    def _write_releases(self) -> None:
        slots, self._releasing = self._releasing, []
        if not slots:
            return
        if len(slots) == 1:  # a fill per table, nothing copied
            s = slots[0]
            self.done[s].fill_(1)
            self.stop_ids[s].fill_(-1)
            self.bias_len[s].fill_(0)
            for c in COLUMNS:
                getattr(self, c.name)[s].fill_(c.neutral)
            return
        idx = self.staging.tensor(slots)
        self.done.index_fill_(0, idx, 1)
        self.stop_ids.index_fill_(0, idx, -1)
        self.bias_len.index_fill_(0, idx, 0)
        for c in COLUMNS:
            getattr(self, c.name).index_fill_(0, idx, c.neutral)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables().values())



def _outside(ids: Sequence[int], v: int) -> list[int]:
    """The first (at most 4) of `ids` outside [0, v), in order: vectorised for an integer
    sequence, element by element for anything numpy does not read as one."""
    arr = np.asarray(ids)
    if arr.ndim == 1 and arr.dtype.kind in "iu":
        return arr[(arr < 0) | (arr >= v)][:4].tolist()
    return [t for t in ids if not 0 <= t < v][:4]


@dataclass
class _Admission:
    """One validated `SlotState.admit` call, waiting to be written."""

    slot: int
    stop_ids: list[int]
    prompt: Sequence[int]
    logit_bias: list[tuple[int, float]]
    columns: dict[str, float | int]
