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

Logit controls (`graphdraft.kernels.logit_controls`, applied to the target's logits before the
acceptance, in vLLM's order and conventions): `logit_bias` (added to the raw logits), then
`repetition_penalty` (a token seen in the prompt OR the output so far: positive logits divided
by it, negative ones multiplied), `frequency_penalty` (minus the penalty times the token's
count in the output only) and `presence_penalty` (minus the penalty once if the token occurs
in the output only); greedy rows take the argmax after them. Then, for sampled rows, the
temperature, `min_p` (keep tokens whose probability is >= min_p x the likeliest one's), top-k
and top-p. Under speculation the penalties at a verify position count the earlier drafts of
the window as emitted, so every emitted token follows exactly what target-only decoding
would sample.

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
    numbers; `check` for anything else; `convert`: the stored form of a value, raising
    ValueError or TypeError when it has none), the message naming what is expected, its
    device column (None: host only) and its CLI flag (None: no flag) with the flag's help."""

    name: str
    type: Any
    default: Any
    expected: str
    range: Range | None = None
    integer: bool = False
    optional: bool = False
    check: Callable[[Any], bool] | None = None
    convert: Callable[[Any], Any] | None = None
    column: Column | None = None
    flag: str | None = None
    help: str = ""

    def validate(self, value: Any) -> Any:
        """`value` as stored (a sequence becomes a tuple); ValueError naming the field."""
        if value is None and self.optional:
            return value
        if self.convert is not None:
            try:
                return self.convert(value)
            except (ValueError, TypeError):
                raise ValueError(f"{self.name}: expected {self.expected}, got "
                                 f"{_short(value)}") from None
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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _token_ids(v: Any) -> bool:
    return (isinstance(v, (list, tuple))
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v))


MAX_LOGIT_BIAS = 300
"""Entries of one request's `logit_bias` at most (OpenAI's bound; `SlotState.bias_ids`' width)."""
LOGIT_BIAS_RANGE = 100.0
"""|bias| at most (OpenAI's -100..100)."""


def _logit_bias(v: Any) -> tuple[tuple[int, float], ...]:
    """A `logit_bias` map (token id -> bias; an id may be its decimal string, as in JSON) as
    its stored form: `((id, bias), ...)` sorted by id. ValueError / TypeError when not one."""
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, (list, tuple)) and all(isinstance(e, (list, tuple)) and len(e) == 2
                                              for e in v):
        items = [tuple(e) for e in v]
    else:
        raise TypeError("not a map")
    out = {}
    for k, b in items:
        if isinstance(k, str) and k.isascii() and k.isdigit():
            k = int(k)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0 or k in out:
            raise ValueError("bad token id")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (
                -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE):
            raise ValueError("bad bias")
        out[k] = float(b)
    if len(out) > MAX_LOGIT_BIAS:
        raise ValueError("too many entries")
    return tuple(sorted(out.items()))


MAX_LOGPROBS = 20
"""The widest `logprobs` / `prompt_logprobs` a request may ask (OpenAI's `top_logprobs` bound;
an Engine may allow fewer: `RuntimeConfig.max_logprobs`).

Log-probabilities (`logprobs`: the emitted token's, and its `logprobs` likeliest
alternatives; `prompt_logprobs`: each prompt token's after the first) are
`log_softmax` of the target's logits after the request's logit controls (logit_bias and the
penalties: they define the distribution this request is sampled from) and before the
temperature and the truncations (top-k, top-p, min_p): the model's own distribution at
temperature 1, the same for greedy and sampled rows and never -inf for a token a truncation
dropped (vLLM's `processed_logprobs` minus the temperature and truncation; OpenAI's
logprobs do not change with temperature either). Speculative and target-only decoding
return the same values for the same tokens: each emitted token's entry comes from the verify
logits of its own position, whether it was an accepted draft or the correction."""


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
    SamplingField("min_p", float, 0.0, "in [0, 1]", Range(0, 1),
                  column=Column("min_p", torch.float32, 0.0), flag="--min-p",
                  help="keep tokens with probability >= min_p x the likeliest one's, 0: off "
                       "(needs --temperature > 0)"),
    SamplingField("repetition_penalty", float, 1.0, "> 0", Range(0, lo_open=True),
                  column=Column("repetition_penalty", torch.float32, 1.0),
                  flag="--repetition-penalty",
                  help="divide positive / multiply negative logits of tokens seen in the "
                       "prompt or output (vLLM's convention), 1: off"),
    SamplingField("frequency_penalty", float, 0.0, "in [-2, 2]", Range(-2, 2),
                  column=Column("frequency_penalty", torch.float32, 0.0),
                  flag="--frequency-penalty",
                  help="subtract this x the token's count in the output, 0: off"),
    SamplingField("presence_penalty", float, 0.0, "in [-2, 2]", Range(-2, 2),
                  column=Column("presence_penalty", torch.float32, 0.0),
                  flag="--presence-penalty",
                  help="subtract this from tokens present in the output, 0: off"),
    SamplingField("logit_bias", tuple[tuple[int, float], ...], (),
                  f"a map of token id (an int >= 0 or its decimal string) -> bias in "
                  f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], at most {MAX_LOGIT_BIAS} "
                  f"entries", convert=_logit_bias, flag="--logit-bias",
                  help="JSON map of token id -> bias in [-100, 100] added to its logit, e.g. "
                       "'{\"50256\": -100}' (at most 300 entries)"),
    SamplingField("logprobs", int | None, None, f"None or an int in [0, {MAX_LOGPROBS}]",
                  Range(0, MAX_LOGPROBS), integer=True, optional=True,
                  column=Column("logprobs", torch.int32, -1), flag="--logprobs",
                  help="return each generated token's log-probability and its N likeliest "
                       "alternatives"),
    SamplingField("prompt_logprobs", int | None, None, f"None or an int in [0, {MAX_LOGPROBS}]",
                  Range(0, MAX_LOGPROBS), integer=True, optional=True, flag="--prompt-logprobs",
                  help="return each prompt token's log-probability (after the first) and its "
                       "N likeliest alternatives"),
    # host only: the front ends' stop-string rule (`graphdraft.serving.stop_strings`) reads it
    SamplingField("include_stop_str_in_output", bool, False, "a bool",
                  check=lambda v: isinstance(v, bool)),
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
            value = request_seed if f.name == "seed" else getattr(params, f.name)
            row[f.column.name] = f.column.neutral if value is None else value  # logprobs
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
