"""The draft benchmark's cases: (page size, KV length, bs) points and their groups."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

STEPS = 3
BATCH_SIZES = (1, 8, 32, 64, 128)
KV_LENS = (512, 4096)
PAGE1_BS = 64
"""The single page-size-1 case runs at this bs (kv 4096)."""


@dataclass(frozen=True)
class Case:
    """One benchmark point; cases sharing `group` share one drafter (captured once)."""

    page_size: int
    kv_len: int
    bs: int

    @property
    def group(self) -> tuple[int, int]:
        return self.page_size, self.kv_len

    def __str__(self) -> str:
        return f"page{self.page_size}-kv{self.kv_len}-bs{self.bs}"


def int_list(raw: str, hi: int | None = None) -> tuple[int, ...]:
    """The benchmarks' comma-separated sizes ("1,8,64" -> (1, 8, 64)), each in [1, hi] (an
    argparse type: `type=int_list`, or `type=lambda r: int_list(r, 64)`); anything else raises
    `argparse.ArgumentTypeError` saying what was expected."""
    try:
        vals = tuple(int(v) for v in raw.split(",") if v.strip())
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1 or (hi is not None and max(vals) > hi):
        bound = f" in [1, {hi}]" if hi is not None else ""
        raise argparse.ArgumentTypeError(
            f"expected positive ints{bound} separated by commas, got {raw!r}")
    return vals


def default_cases(batch_sizes: Sequence[int] = BATCH_SIZES) -> list[Case]:
    """Page 16 at every kv length and bs, then one page-size-1 case (kv 4096)."""
    cases = [Case(16, kv, bs) for kv in KV_LENS for bs in batch_sizes]
    cases.append(Case(1, max(KV_LENS), PAGE1_BS if PAGE1_BS in batch_sizes else max(batch_sizes)))
    return cases


def cases_from_env(env: dict[str, str] | None = None) -> list[Case]:
    """`default_cases`, restricted by `GRAPHDRAFT_PERF_BS="1,64"` when set."""
    raw = (os.environ if env is None else env).get("GRAPHDRAFT_PERF_BS", "").strip()
    return default_cases(tuple(int(b) for b in raw.split(",")) if raw else BATCH_SIZES)


def ordered_params(cases: Sequence[Case], compile: bool) -> list[tuple[Case, str]]:
    """`(case, variant)` in run order: per group, every "graph" variant (eager + graph
    replay) before any "compile" variant (the graphs go stale once the baseline runs)."""
    out: list[tuple[Case, str]] = []
    for group in dict.fromkeys(c.group for c in cases):
        mine = [c for c in cases if c.group == group]
        out += [(c, "graph") for c in mine]
        out += [(c, "compile") for c in mine] if compile else []
    return out


def group_batch_sizes(cases: Sequence[Case], group: tuple[int, int]) -> tuple[int, ...]:
    """The sizes a group must capture: every bs of its cases, ascending."""
    return tuple(sorted({c.bs for c in cases if c.group == group}))

