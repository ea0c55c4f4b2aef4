"""Per-request sampling parameters as one typed record: the field list everything follows.

`SAMPLING_FIELDS` is the one list of a request's sampling parameters. From it follow:
  - `SamplingParams` (a frozen dataclass built from the list) and its validation: a bad value
    raises ValueError naming the field and what was expected;
  - the per-slot device tables of `graphdraft.runtime.slot_state.SlotState`: one column
    `[R]` per field with a `column` (its name, dtype and neutral value), written at
    admission from `SamplingParams` (`device_row`) and read by the acceptance kernels
    (`graphdraft.kernels.accept`, the tree cycle in `graphdraft.serving.tree_cycle`);
  - the CLI's sampling flags (`graphdraft.serving.cli.args.add_sampling_flags`: the fields
    with a `flag`).
Adding a parameter: a `SamplingField` here, and the kernel that reads its column.

Seeds (sampled requests): the Engine samples on device with Philox noise keyed by the
request's seed and the absolute position of each sampled token, so a request's tokens depend
only on its seed, its prompt and the models: not on the other requests of the batch, the
padded batch size, prefill chunking or how many drafts were accepted. `seed=None`: the Engine
draws a distinct seed from its own `Engine(seed=...)`. `seed=s`: the k-th request of an Engine
carrying seed s (k = 0, 1, ... in `add_request` order) uses `request_seed(s, k)`: one request
with seed s reproduces alone or in any batch, and several requests sharing one
`SamplingParams(seed=s)` get distinct streams, the same ones again whenever the same requests
are added in the same order. The seed column holds that derived key (`device_row`'s
`request_seed` argument), not the field's value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Range:
    """Allowed values of a numeric field: `lo <= v <= hi` (`lo_open`: `lo < v`)."""

    lo: float
    hi: float = math.inf
    lo_open: bool = False

    def contains(self, v: float) -> bool:
        return (v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi


@dataclass(frozen=True)
class Column:
    """A field's per-slot device table in `SlotState`: `[R]` of `dtype`; `neutral` is the value
    of slot 0 and of released slots (inert rows read it)."""

    name: str
    dtype: torch.dtype
    neutral: float | int


@dataclass(frozen=True)
class SamplingField:
    """One sampling parameter: its name, Python type, default, allowed values (`range` for
    numbers; `check` for anything else), the message naming what is expected, its device
    column (None: host only) and its CLI flag (None: no flag) with the flag's help."""

    name: str
    type: Any
    default: Any
    expected: str
    range: Range | None = None
    integer: bool = False
    optional: bool = False
    check: Callable[[Any], bool] | None = None
    column: Column | None = None
    flag: str | None = None
    help: str = ""

    def validate(self, value: Any) -> Any:
        """`value` as stored (a sequence becomes a tuple); ValueError naming the field."""
        if value is None and self.optional:
            return value
        ok = True
        if self.integer:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.range is not None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and self.range is not None:
            ok = self.range.contains(value)
        if ok and self.check is not None:
            ok = self.check(value)
        if not ok:
            raise ValueError(f"{self.name}: expected {self.expected}, got {value!r}")
        if isinstance(value, (list, tuple)):
            return tuple(value)
        return value


def _token_ids(v: Any) -> bool:
    return (isinstance(v, (list, tuple))
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v))


SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    SamplingField("max_new_tokens", int, 32, "an int >= 1", Range(1), integer=True,
                  column=Column("max_new", torch.int32, 2**30), flag="--max-new-tokens",
                  help="tokens to generate per prompt"),
    SamplingField("temperature", float, 0.0, ">= 0", Range(0),
                  column=Column("temperature", torch.float32, 0.0), flag="--temperature",
                  help="0: greedy"),
    SamplingField("top_p", float, 1.0, "in (0, 1]", Range(0, 1, lo_open=True),
                  column=Column("top_p", torch.float32, 1.0), flag="--top-p",
                  help="nucleus sampling mass (needs --temperature > 0)"),
    SamplingField("top_k", int, 0, "an int >= 0 (0: off)", Range(0), integer=True,
                  column=Column("top_k", torch.int32, 0), flag="--top-k",
                  help="sample among the k likeliest tokens, 0: off (needs --temperature > 0)"),
    SamplingField("seed", int | None, None, "an int or None", integer=True, optional=True,
                  column=Column("seed", torch.int64, 0)),
    SamplingField("stop_token_ids", tuple[int, ...], (), "a sequence of token ids >= 0",
                  check=_token_ids),
    SamplingField("ignore_eos", bool, False, "a bool", check=lambda v: isinstance(v, bool)),
)
"""Every sampling parameter, in `SamplingParams`' field order."""

FIELDS_BY_NAME = {f.name: f for f in SAMPLING_FIELDS}
COLUMNS: tuple[Column, ...] = tuple(f.column for f in SAMPLING_FIELDS if f.column is not None)
"""The per-slot device tables the fields pack into (`SlotState`), in field order."""


class _SamplingParamsMethods:
    """Validation and helpers of `SamplingParams` (its fields come from `SAMPLING_FIELDS`)."""

    def __post_init__(self) -> None:
        for f in SAMPLING_FIELDS:
            value = f.validate(getattr(self, f.name))
            object.__setattr__(self, f.name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


SamplingParams = dataclasses.make_dataclass(
    "SamplingParams",
    [(f.name, f.type, dataclasses.field(default=f.default)) for f in SAMPLING_FIELDS],
    bases=(_SamplingParamsMethods,), frozen=True)
SamplingParams.__module__ = __name__
SamplingParams.__doc__ = (
    "Per-request decoding parameters (fields: `SAMPLING_FIELDS`, validated on construction: "
    "ValueError naming the field); `temperature == 0` is greedy. Seeds: the module docstring.")


def device_row(params: Any, request_seed: int) -> dict[str, float | int]:
    """The values of each device column (`COLUMNS`) for a request with `params`: the field's
    value, except the seed column, which holds `request_seed` (the request's Philox key)."""
    row = {}
    for f in SAMPLING_FIELDS:
        if f.column is not None:
            row[f.column.name] = request_seed if f.name == "seed" else getattr(params, f.name)
    return row


def request_seed(seed: int, k: int) -> int:
    """The Philox key of the k-th request carrying `seed` (k = 0: the seed itself, masked to
    63 bits; k > 0: a splitmix64 mix of (seed, k))."""
    m = (1 << 64) - 1
    if k == 0:
        return seed & ((1 << 63) - 1)
    z = (seed + 0x9E3779B97F4A7C15 * (k + 1)) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def flag_fields() -> Sequence[SamplingField]:
    """The fields the CLI exposes as flags, in field order."""
    return [f for f in SAMPLING_FIELDS if f.flag is not None]
