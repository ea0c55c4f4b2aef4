"""The engine loop: one thread owns the `Engine`; requests reach it through a queue.

The Engine is not thread-safe, so only this thread calls it (`add_request`, `step`, `abort`,
`metrics_snapshot`, ...). The event loop hands it work with `submit(choices)` and
`cancel(choices)` (thread-safe, never blocking: they append a command and wake the thread);
the thread applies commands between steps, steps while any request is live, and after each
step hands every choice's new token ids to the event loop in ONE `call_soon_threadsafe`
(`Choice.deliver(ids, finish_reason)` runs there). Nothing here blocks the event loop.

Capacity: at most `capacity` choices are live (submitted, not finished) at once; `submit`
raises `ServerBusy` beyond that (the server answers 503) and once shutdown began.
Shutdown (`begin_shutdown(grace_s)`): no new choices; live ones may finish for `grace_s`
seconds, then every one left is aborted (its `deliver` gets finish reason "abort").

A step that raises: a request the Engine flagged (`Engine.step`'s ValueError) ends with
finish reason "error" and the others go on; any other exception is logged with its
traceback and every live choice ends with "error" (their KV pages go back); the thread goes
on serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from graphdraft.serving.engine import Engine
from graphdraft.serving.openai_api.metrics import EngineState, ServerMetrics
from graphdraft.serving.verify import SamplingParams

log = logging.getLogger("graphdraft.serving.openai_api")

FOLD_INTERVAL_S = 0.5
"""How often the loop folds the Engine's metrics (accept lengths, graph use) into the
server's and resets the Engine's recorder (so a long-running server's memory stays flat)."""
IDLE_WAIT_S = 0.25


class ServerBusy(Exception):
    """The loop takes no more choices now (queue full, or shutting down)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # "queue_full" or "shutting_down"


@dataclass(eq=False)
class Choice:
    """One engine request (one choice of an HTTP request) as the loop tracks it."""

    prompt: list[int]
    params: SamplingParams
    deliver: Callable[[list[int], str | None], None]
    """Called on the event loop with new ids and the finish reason (None while running)."""
    req: Any = None  # graphdraft.serving.request.Request, once added
    sent: int = 0
    arrived: float = field(default_factory=time.perf_counter)
    last_emit: float | None = None


class EngineLoop:
    """The thread that owns `engine` (module docstring). `loop`: the asyncio loop that
    `Choice.deliver` runs on."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, metrics: ServerMetrics,
                 capacity: int) -> None:
        self.engine, self.loop, self.metrics, self.capacity = engine, loop, metrics, capacity
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._live: dict[Choice, None] = {}  # added to the engine, not finished (loop thread)
        self._pending = 0                     # submitted, not finished (any thread, under _lock)
        self._closed = False
        self._deadline: float | None = None
        self._stop = False
        self._accept_hist: dict[int, int] = {}
        self._steps = self._step_errors = 0
        self._last_fold = 0.0
        self._graphs: dict[str, tuple[int, int]] = {}
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="graphdraft-engine-loop",
                                       daemon=True)

    # --- any thread ------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, choices: list[Choice]) -> None:
        """Queue `choices` (all or none); ServerBusy when full or shutting down."""
        with self._lock:
            if self.failed is not None or not self.thread.is_alive():
                raise ServerBusy("the engine loop has stopped (see the server log)",
                                 "unavailable")
            if self._closed:
                raise ServerBusy("the server is shutting down", "shutting_down")
            if self._pending + len(choices) > self.capacity:
                raise ServerBusy(f"the server is at capacity ({self.capacity} requests live, "
                                 f"{self._pending} now); retry later", "queue_full")
            self._pending += len(choices)
            self._inbox.append(("add", choices))
        self._wake.set()

    def cancel(self, choices: list[Choice]) -> None:
        """Abort `choices` (those not finished yet): their KV pages go back at the next
        command pass (before the next step)."""
        self._inbox.append(("abort", choices))
        self._wake.set()

    def begin_shutdown(self, grace_s: float) -> None:
        with self._lock:
            self._closed = True
        self._deadline = time.monotonic() + grace_s
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> bool:
        """Abort everything, end the thread; True when it ended within `timeout`."""
        self.begin_shutdown(0.0)
        self._stop = True
        self._wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        return not self.thread.is_alive()

    @property
    def live(self) -> int:
        """Choices submitted and not finished."""
        return self._pending

    @property
    def healthy(self) -> bool:
        return self.thread.is_alive() and self.failed is None and not self._closed

    # --- the loop thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                self._apply_commands()
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self._abort_all("abort")
                if self.engine.has_work:
                    self._step()
                elif self._stop or (self._closed and not self._live and not self._inbox):
                    break
                else:
                    self._fold(force=False)
                    self._wake.wait(IDLE_WAIT_S)
        except BaseException as e:  # noqa: BLE001 (the thread must say why it ended)
            self.failed = e
            log.exception("engine loop ended by an unexpected error; the server stops serving")
            self._abort_all("error")
        finally:
            self._fold(force=True)

    def _apply_commands(self) -> None:
        while self._inbox:
            kind, arg = self._inbox.popleft()
            if kind == "add":
                self._add(arg)
            else:
                for c in arg:
                    if c in self._live:
                        self._finish(c, "abort", deliver=False)

    def _add(self, choices: list[Choice]) -> None:
        for c in choices:
            try:
                c.req = self.engine.add_request(c.prompt, c.params)
            except Exception as e:  # noqa: BLE001 (checked before submit: not expected)
                log.error("request rejected by the engine: %s: %s", type(e).__name__, e,
                          exc_info=not isinstance(e, ValueError))
                self._release_count(1)
                self.metrics.finished.labels(reason="error").inc()
                self.loop.call_soon_threadsafe(c.deliver, [], "error")
                continue
            self._live[c] = None
            self.metrics.prompt_tokens.inc(len(c.prompt))

    def _step(self) -> None:
        try:
            self.engine.step()
        except ValueError as e:  # requests the engine flagged: finish "error", others go on
            self._step_errors += 1
            log.warning("engine step: %s", e)
        except Exception:  # noqa: BLE001 (the server never dies from one step)
            self._step_errors += 1
            log.exception("engine step failed; aborting every live request")
            self._abort_all("error")
        self._steps += 1
        self._deliver()
        self._publish_state()
        self._fold(force=False)

    def _deliver(self) -> None:
        batch, now = [], time.perf_counter()
        for c in list(self._live):
            r = c.req
            n = len(r.output)
            if n == c.sent and not r.finished:
                continue
            ids = r.output[c.sent:n]
            c.sent = n
            if ids:
                self._observe_tokens(c, len(ids), now)
            if r.finished:
                self._finish(c, r.finish_reason, deliver=False)
                self.metrics.e2e.observe(now - c.arrived)
            batch.append((c, ids, r.finish_reason if r.finished else None))
        if batch:
            self.loop.call_soon_threadsafe(_dispatch, batch)

    def _observe_tokens(self, c: Choice, n: int, now: float) -> None:
        self.metrics.generation_tokens.inc(n)
        if c.last_emit is None:
            self.metrics.ttft.observe(now - c.arrived)
        else:
            self.metrics.itl.observe((now - c.last_emit) / n)
        c.last_emit = now

    def _finish(self, c: Choice, reason: str | None, deliver: bool) -> None:
        """Take `c` off the live set (aborting its engine request when it still runs)."""
        del self._live[c]
        if c.req is not None and not c.req.finished:
            self.engine.abort(c.req)
        self._release_count(1)
        self.metrics.finished.labels(reason=reason or "abort").inc()
        if deliver:
            self.loop.call_soon_threadsafe(c.deliver, [], reason)

    def _abort_all(self, reason: str) -> None:
        self._apply_commands()
        for c in list(self._live):
            self._finish(c, reason, deliver=True)

    def _release_count(self, n: int) -> None:
        with self._lock:
            self._pending -= n

    def _publish_state(self) -> None:
        e = self.engine
        pages = e.pages
        self.metrics.state = EngineState(
            waiting=len(e.waiting), running=len(e.running),
            kv_pages_used=pages.num_pages - 1 - pages.num_free_pages,
            kv_pages_total=pages.num_pages - 1, steps=self._steps,
            max_accept=e.cfg.speculative_num_steps + 1,
            step_errors=self._step_errors, accept_hist=dict(self._accept_hist),
            graphs=self._graphs)

    def _fold(self, force: bool) -> None:
        """Move the Engine's accept lengths into the server's histogram, read graph use, and
        reset the Engine's recorder (every FOLD_INTERVAL_S)."""
        now = time.monotonic()
        if not force and now - self._last_fold < FOLD_INTERVAL_S:
            return
        self._last_fold = now
        snap = self.engine.metrics_snapshot()
        for length, rows in snap["accept_length"]["histogram"].items():
            self._accept_hist[int(length)] = self._accept_hist.get(int(length), 0) + rows
        self.engine.metrics.reset()
        self._graphs = {name: (g["replays"], sum(g["eager"].values()))
                        for name, g in snap.get("graphs", {}).items()}
        self._publish_state()


def _dispatch(batch: list[tuple[Choice, list[int], str | None]]) -> None:
    """On the event loop: hand each choice its ids (one call per engine step)."""
    for c, ids, finish in batch:
        c.deliver(ids, finish)
