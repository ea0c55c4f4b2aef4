"""The server's Prometheus metrics (`GET /metrics`, the text exposition format).

All of them live in the HTTP process. Updated by the handlers:
`graphdraft_requests_total{endpoint, status}`. Updated as the engine process's messages
arrive (`engine_client.EngineClient`): prompt and generation token counters, finished
choices by finish reason, time to first token, inter-token latency and end-to-end latency
histograms (host clock of the HTTP process, from the request's submission to the tokens
reaching its event loop). The `EngineState` the engine process sends (every few tens of
milliseconds while busy, once when idle) is exposed at scrape time by a collector: queue
depth (requests waiting for a slot), running requests, KV pages in use and in all, the
accept length histogram (decode rows by tokens accepted per verify) and graph replays and
eager runs per captured forward family.

Several HTTP processes (`front_ends`): each counts its own requests in prometheus_client's
multiprocess mode (files under `$PROMETHEUS_MULTIPROC_DIR`, which must be set before
prometheus_client is first imported in the process), and `/metrics`, whichever process
answers, sums every process's counters and histograms (`MultiProcessCollector`); the engine
state is the one engine process's, the same in each.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
               0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class EngineState:
    """The engine process's state as last sent (replaced whole, never mutated)."""

    waiting: int = 0
    running: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    steps: int = 0
    step_errors: int = 0
    accept_hist: dict[int, int] = field(default_factory=dict)
    """Cumulative decode rows by accept length."""
    max_accept: int = 1
    """The longest accept length of a chain cycle (S + 1): the histogram's buckets are
    1..max(max_accept, longest seen), the same at every scrape."""
    graphs: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Forward family -> (graph replays, eager runs), cumulative."""
    finished: int = 0
    """Requests the engine process reported finished (any reason), cumulative."""
    has_work: bool = False
    """Whether the Engine had requests or launched steps when the state was read."""


class _EngineCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator:
        s = self.metrics.state
        for name, doc, value in (
                ("graphdraft_queue_depth", "requests waiting for a request slot", s.waiting),
                ("graphdraft_running_requests", "requests holding a slot", s.running),
                ("graphdraft_kv_pages_used", "KV-cache pages held by requests", s.kv_pages_used),
                ("graphdraft_kv_pages_total", "KV-cache pages of the pool", s.kv_pages_total)):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("graphdraft_engine_steps", "engine steps run", value=s.steps)
        yield CounterMetricFamily("graphdraft_engine_step_errors",
                                  "engine steps that raised", value=s.step_errors)
        hist = sorted(s.accept_hist.items())
        buckets, acc = [], 0
        for length in range(1, max([s.max_accept, *s.accept_hist]) + 1):
            acc += s.accept_hist.get(length, 0)
            buckets.append((str(float(length)), acc))
        buckets.append(("+Inf", acc))
        yield HistogramMetricFamily(
            "graphdraft_accept_length", "tokens accepted per verify, per decode row",
            buckets=buckets, sum_value=float(sum(k * v for k, v in hist)))
        replays = CounterMetricFamily("graphdraft_graph_replays",
                                      "CUDA graph replays per forward family", labels=["forward"])
        eager = CounterMetricFamily("graphdraft_eager_runs",
                                    "eager runs per forward family", labels=["forward"])
        for name, (r, e) in sorted(s.graphs.items()):
            replays.add_metric([name], r)
            eager.add_metric([name], e)
        yield replays
        yield eager


class ServerMetrics:
    """One server's metrics in their own registry (`registry`; `render()` for /metrics).
    `multiprocess_dir`: the metrics of every HTTP process writing there, summed (module
    docstring); RuntimeError when prometheus_client was imported without it set."""

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        if multiprocess_dir is not None:
            from prometheus_client import multiprocess, values
            if values.ValueClass is values.MutexValue:
                raise RuntimeError("ServerMetrics(multiprocess_dir=...): prometheus_client was "
                                   "imported before PROMETHEUS_MULTIPROC_DIR was set")
            multiprocess.MultiProcessCollector(r, path=multiprocess_dir)
            r = CollectorRegistry()  # the counters below: this process's, read from the files
        self.requests = Counter("graphdraft_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("graphdraft_choices_finished",
                                "engine requests (choices) finished, by finish reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("graphdraft_prompt_tokens", "prompt tokens queued",
                                     registry=r)
        self.generation_tokens = Counter("graphdraft_generation_tokens",
                                         "tokens generated", registry=r)
        self.ttft = Histogram("graphdraft_time_to_first_token_seconds",
                              "submission to the engine to the first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("graphdraft_inter_token_latency_seconds",
                             "gap between a choice's token deliveries over the tokens delivered",
                             registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram("graphdraft_request_latency_seconds",
                             "submission to the engine to the last token", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.state = EngineState()
        self.registry.register(_EngineCollector(self))

    def render(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)
