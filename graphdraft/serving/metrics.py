"""Serving metrics: per-request latencies, accept lengths and graph use, as a plain dict.

The Engine calls the `on_*` hooks with host timestamps (`time.perf_counter()` seconds);
`snapshot()` summarises them:

  requests          finished requests
  output_tokens     tokens emitted (all requests)
  ttft_s            time to first token per request: p50 / p99 / mean
  itl_s             inter-token latency (gap between consecutive emits of one request,
                    divided by the tokens of the later emit): p50 / p99 / mean
  tokens_per_s      output tokens over the span from the first add to the last emit
  accept_length     mean and histogram {length: rows} over decode rows
  graphs            per captured forward: replays (in all and per padded batch size), eager
                    runs by reason, hit_rate (replays over all runs; None before any run),
                    capture seconds

Timestamps are the host's view: on a GPU they are taken when the host reads the tokens back.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


def quantile(xs: list[float], p: float) -> float:
    """The p-quantile of `xs`, nearest rank on the sorted sample (NaN when `xs` is empty)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]


def _quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"p50": 0.0, "p99": 0.0, "mean": 0.0, "count": 0}
    return {"p50": quantile(xs, 0.50), "p99": quantile(xs, 0.99), "mean": sum(xs) / len(xs),
            "count": len(xs)}


@dataclass
class _Req:
    added: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0


@dataclass
class ServingMetrics:
    """Recorder of one Engine's serving (reset with `reset()`)."""

    _reqs: dict[int, _Req] = field(default_factory=dict)
    _ttft: list[float] = field(default_factory=list)
    _itl: list[float] = field(default_factory=list)
    accept_hist: Counter[int] = field(default_factory=Counter)
    finished: int = 0
    output_tokens: int = 0
    _t0: float | None = None
    _t1: float | None = None

    def reset(self) -> None:
        self.__init__()

    # --- hooks -------------------------------------------------------------------------
    def on_request_added(self, rid: int, now: float) -> None:
        self._reqs[rid] = _Req(now)
        if self._t0 is None:
            self._t0 = now

    def on_tokens(self, rid: int, n: int, now: float) -> None:
        """`n >= 1` tokens of request `rid` became known to the host at `now`."""
        r = self._reqs.get(rid)
        if r is None or n <= 0:
            return
        if r.first is None:
            r.first = now
            self._ttft.append(now - r.added)
        elif r.last is not None:
            self._itl.append((now - r.last) / n)
        r.last, r.tokens = now, r.tokens + n
        self.output_tokens += n
        self._t1 = now

    def on_decode_accept(self, accept_length: int) -> None:
        """One decode row committed `accept_length` tokens."""
        self.accept_hist[int(accept_length)] += 1

    def on_request_finished(self, rid: int) -> None:
        if self._reqs.pop(rid, None) is not None:
            self.finished += 1

    # --- summary -----------------------------------------------------------------------
    def snapshot(self, graph_stats: list[Any] | None = None) -> dict[str, Any]:
        """The dict described in the module docstring; `graph_stats`: `capture.GraphStats`."""
        rows = sum(self.accept_hist.values())
        span = (self._t1 - self._t0) if self._t0 is not None and self._t1 is not None else 0.0
        out: dict[str, Any] = {
            "requests": self.finished,
            "output_tokens": self.output_tokens,
            "ttft_s": _quantiles(self._ttft),
            "itl_s": _quantiles(self._itl),
            "tokens_per_s": self.output_tokens / span if span > 0 else 0.0,
            "accept_length": {
                "mean": sum(k * v for k, v in self.accept_hist.items()) / rows if rows else 0.0,
                "histogram": {int(k): v for k, v in sorted(self.accept_hist.items())},
            },
        }
        if graph_stats is not None:
            out["graphs"] = {}
            for st in graph_stats:
                eager = {k: v for k, v in st.eager.items() if v}
                runs = st.total_replays + sum(eager.values())
                out["graphs"][st.name] = {
                    "replays": st.total_replays, "replays_by_bs": dict(sorted(st.replays.items())),
                    "eager": eager, "hit_rate": st.total_replays / runs if runs else None,
                    "capture_s": round(st.total_capture_seconds, 4)}
        return out
