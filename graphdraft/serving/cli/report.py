"""Printing what a run measured: serving metrics, graph use, the greedy exactness check.

Timings are printed only where they mean something: `timings=False` (a CPU run) prints
token counts, accept lengths and graph use, and says why there is no timing.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

CPU_TIMING_NOTE = ("timings: not shown: a CPU run of this runtime is not a performance "
                   "figure (the metrics JSON keeps them, marked timings_are_performance: false)")
CPU_SPEEDUP_NOTE = "speed-up over target-only: not measured (needs a GPU; see timings above)"


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms"


def metrics_lines(snap: dict[str, Any], *, timings: bool) -> list[str]:
    """Human-readable lines for `Engine.metrics_snapshot()`."""
    acc = snap["accept_length"]
    hist = ", ".join(f"{k}: {v}" for k, v in acc["histogram"].items()) or "none"
    lines = [f"requests: {snap['requests']}, output tokens: {snap['output_tokens']}",
             f"mean accept length: {acc['mean']:.2f} tokens per verify "
             f"(histogram, length: decode rows: {hist})"]
    dr = acc.get("drafting")
    if dr:
        shape = (f"steps {dr['steps']}, topk {dr['topk']}, {dr['num_draft_tokens']} tokens "
                 "verified per request")
        lines.append(f"drafting: {dr['mode']}" + (f" ({shape})" if dr["mode"] != "none" else ""))
    if timings:
        t, i = snap["ttft_s"], snap["itl_s"]
        lines += [f"time to first token: p50 {_ms(t['p50'])}, p99 {_ms(t['p99'])}",
                  f"inter-token latency: p50 {_ms(i['p50'])}, p99 {_ms(i['p99'])}",
                  f"throughput: {snap['tokens_per_s']:,.1f} tokens/s"]
    for name, g in snap.get("graphs", {}).items():
        eager = ", ".join(f"{k} {v}" for k, v in g["eager"].items()) or "none"
        cap = f", captured in {g['capture_s']:.1f} s" if timings and g["capture_s"] else ""
        rate = g.get("hit_rate")
        hit = f" (hit rate {rate:.0%})" if rate is not None else ""
        lines.append(f"{name:>18}: {g['replays']} graph replays{hit}, eager runs: {eager}{cap}")
    return lines


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: `/proc/self/stat`'s start time against
    `/proc/uptime`, 10 ms ticks); None where that cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class WallClock:
    """The wall clock of a command's phases: `mark(name)` ends the phase begun at the last mark
    (the first begins when the clock is made; `before` is the process's age then, the
    interpreter's start and the imports). `seconds()`: {phase: s, ..., "total": s}; `line()`:
    one printed line (a GPU run's; a CPU run prints none: not a performance figure)."""

    def __init__(self) -> None:
        self.before = process_age_s()
        self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now

    def seconds(self) -> dict[str, float]:
        out = {"before_the_command": round(self.before, 2)} if self.before is not None else {}
        out |= {k: round(v, 2) for k, v in self.phases.items()}
        out["total"] = round(sum(self.phases.values()) + (self.before or 0.0), 2)
        return out

    def line(self) -> str:
        s = self.seconds()
        since = "since the process started" if self.before is not None else "in the command"
        parts = [f"{k.replace('_', ' ')} {v:.1f}" for k, v in s.items() if k != "total"]
        return f"wall clock: {s['total']:.1f} s {since} ({', '.join(parts)})"


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def write_json(path: str, payload: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def report_greedy_match(base_out: list[list[int]], spec_out: list[list[int]],
                        dtype: torch.dtype) -> int:
    """Print whether speculative greedy outputs equal target-only ones; the exit code: 1 for a
    difference in float32/float64 (exactness is checkable there), else 0."""
    same = base_out == spec_out
    print(f"greedy outputs identical to target-only: {same}")
    if same:
        return 0
    n_same = sum(b == s for b, s in zip(base_out, spec_out, strict=True))
    r = next(i for i, (b, s) in enumerate(zip(base_out, spec_out, strict=True)) if b != s)
    k = next((j for j, (x, y) in enumerate(zip(base_out[r], spec_out[r], strict=False)) if x != y),
             min(len(base_out[r]), len(spec_out[r])))
    print(f"  {n_same}/{len(base_out)} requests identical; request {r} differs from token {k}")
    if dtype in (torch.float32, torch.float64):
        return 1
    print(f"  expected in {str(dtype).removeprefix('torch.')}: the target's verify forward "
          "(N tokens per row) and its decode forward (one per row) round their matmuls "
          "differently, so near-tied greedy picks can differ; --dtype float32 makes this "
          "check exact")
    return 0
