"""The HTTP process's handle on the engine-core process (`engine_core`).

`EngineClient.start()` spawns the engine process (multiprocessing's spawn context, daemon)
and waits for its ("ready", info) message (blocking: before the server listens); `info`
carries the Engine's `serving.limits.EngineLimits`, so requests are checked here. `attach(loop,
metrics)` then hooks the socket and the process's sentinel into the asyncio loop
(`add_reader`): every message is read and dispatched on the event loop, one callback per
read however many messages and steps it holds, and nothing blocks the loop (a command the
socket does not take now is written when it becomes writable).

On the event loop: `submit(choices)` numbers the choices and sends one ("add", ...)
command (all or none; `ServerBusy` when at capacity, shutting down, or the engine process
is gone); `cancel(choices)` sends ("abort", ids): the engine process ends them before its
next step and confirms with finish reason "abort". A choice counts against `capacity` until
the engine process reports it finished. Each choice's new ids and finish reason reach
`Choice.deliver(ids, finish_reason)`; the token metrics are observed as they arrive.

Several HTTP processes (`graphdraft serve --api-server-count N`): the process that starts the
engine (`EngineClient(spec, capacity, peers=N)`) makes one more socket per other HTTP
process (`peer_socks`, handed to them, then `release_peers()`); each of those builds
`EngineClient.over(sock, capacity)`, a client of the running engine process that owns
nothing: it waits for the same ready message, its `stop()` says only that this HTTP process
leaves (its requests end), `kill()` does nothing, and the engine's end of stream is its sign
that the engine process died.

`begin_shutdown(grace_s)` (any thread, a signal handler included): no new choices; the
engine process lets live ones finish for `grace_s` seconds, then aborts them.
`stop()`: ("exit",), then join the process (terminate, then kill, if it lingers): the engine
process never outlives the server. `kill()`: at once (a second signal).

When the engine process dies (its sentinel, the socket's end of stream, or a liveness check
every LIVENESS_CHECK_S): every live choice ends with finish reason "error", `failure` says
what happened (and the server's log, once), new requests answer 503, and `healthy` turns
False.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from multiprocessing.connection import wait
from typing import Any

from graphdraft.serving.limits import EngineLimits
from graphdraft.serving.openai_api.engine_core import EngineCoreSpec, run_engine_core
from graphdraft.serving.openai_api.metrics import EngineState, ServerMetrics
from graphdraft.serving.openai_api.wire import FrameReader, Outbox, PeerGone, socket_pair
from graphdraft.serving.verify import SamplingParams

log = logging.getLogger("graphdraft.serving.openai_api")

EXIT_JOIN_S = 10.0
"""How long `stop()` waits for the engine process to exit before terminating it."""
PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))
"""The SamplingParams fields an ("add", ...) command carries (read once, not per request)."""
LIVENESS_CHECK_S = 1.0
"""How often the event loop also asks whether the engine process still runs (its sentinel and
socket may stay open in a process it forked, e.g. a precompile worker)."""


class ServerBusy(Exception):
    """No more choices now (at capacity, shutting down, or the engine process is gone)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # "queue_full", "shutting_down" or "engine_unavailable"


class EngineStartError(Exception):
    """The engine process could not build its Engine; `user_error`: a bad flag or
    checkpoint (the message names it), else an internal error."""

    def __init__(self, message: str, user_error: bool, details: str = "") -> None:
        super().__init__(message)
        self.user_error, self.details = user_error, details


@dataclass(eq=False)
class Choice:
    """One engine request (one choice of an HTTP request)."""

    prompt: list[int]
    params: SamplingParams
    deliver: Callable[..., None]
    """Called on the event loop as `deliver(ids, finish, lps, prompt)`: new ids, the finish
    reason (None while running), the ids' (logprob, top alternatives) pairs (None: not
    asked) and, once, the prompt's (logprob, rank, top alternatives) per token (None: not
    asked or not scored yet; `engine_core`'s outputs)."""
    seed_stream: int | None = None
    """With `params.seed`: the Philox stream (`Engine.add_request(seed_stream=)`), the
    choice's index in its HTTP request, so the same request reproduces its samples."""
    rid: int = -1
    arrived: float = field(default_factory=time.perf_counter)
    last_emit: float | None = None
    cancelled: bool = False


def _join(process: Any, timeout: float) -> None:
    """Wait up to `timeout` s for `process` to end, asking its pid (not its sentinel, which a
    process it forked may still hold open)."""
    deadline = time.monotonic() + timeout
    while process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class EngineClient:
    """The engine process and the messages to and from it (module docstring)."""

    def __init__(self, spec: EngineCoreSpec | None, capacity: int, peers: int = 0) -> None:
        if peers < 0:
            raise ValueError(f"peers: expected an int >= 0, got {peers}")
        self.spec, self.capacity, self.peers = spec, capacity, peers
        self.process: Any = None
        self.sock: Any = None
        self.peer_socks: list[Any] = []
        """The engine-process connections of the other HTTP processes (`launch`)."""
        self.info: dict[str, Any] = {}
        self.limits: EngineLimits | None = None
        self.state = EngineState()
        self.metrics = ServerMetrics()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.failure: str | None = None
        self.finished = 0  # finishes the engine process reported
        self._choices: dict[int, Choice] = {}
        self._rids = itertools.count()
        self._closed = False
        self._writing = False
        self._reader: FrameReader | None = None
        self._outbox: Outbox | None = None
        self._liveness: asyncio.TimerHandle | None = None

    # --- start-up (blocking: before the server serves) -------------------------------------
    def start(self, timeout: float | None = None) -> dict[str, Any]:
        """Spawn the engine process and wait for its Engine (`launch` + `wait_ready`)."""
        self.launch()
        return self.wait_ready(timeout)

    @classmethod
    def over(cls, sock: Any, capacity: int) -> EngineClient:
        """A client of an engine process another HTTP process started, over its connection
        `sock` (one of that process's `peer_socks`); `wait_ready()` next."""
        client = cls(None, capacity)
        client._connect(sock)
        return client

    def _connect(self, sock: Any) -> None:
        self.sock = sock
        sock.setblocking(False)
        self._reader, self._outbox = FrameReader(sock), Outbox(sock)

    @property
    def owner(self) -> bool:
        """Whether this client started (and ends) the engine process."""
        return self.process is not None

    def launch(self) -> None:
        """Spawn the engine process (it builds its Engine meanwhile), with `peers` more
        connections in `peer_socks`."""
        pairs = [socket_pair() for _ in range(1 + self.peers)]
        theirs = [b for _, b in pairs]
        self.process = mp.get_context("spawn").Process(
            target=run_engine_core, args=(self.spec, theirs), name="graphdraft-engine-core",
            daemon=True)
        try:
            self.process.start()
        finally:
            for sock in theirs:
                sock.close()
        self.peer_socks = [a for a, _ in pairs[1:]]
        self._connect(pairs[0][0])

    def release_peers(self) -> None:
        """Close this process's copies of `peer_socks` (their HTTP processes hold them)."""
        for sock in self.peer_socks:
            sock.close()
        self.peer_socks = []

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the engine process's Engine; returns its ready info. EngineStartError
        when it could not build it (the process has then ended)."""
        try:
            self.info = self._await_ready(timeout)
        except BaseException:
            self.kill()
            self.sock.close()
            self.release_peers()
            raise
        self.limits = EngineLimits(**self.info["limits"])
        return self.info

    def _await_ready(self, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = [self.sock, self.process.sentinel] if self.owner else [self.sock]
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not wait(waited, left) and left == 0.0:
                raise EngineStartError(f"the engine process did not start within {timeout} s",
                                       False)
            try:
                messages, gone = self._reader.read(), False
            except PeerGone:
                messages, gone = [], True
            for i, m in enumerate(messages):
                if m[0] == "ready":
                    self._handle(messages[i + 1:])  # read with it: its first state
                    return m[1]
                if m[0] == "failed":
                    if self.owner:
                        _join(self.process, 10.0)
                    raise EngineStartError(m[1], m[2] == "user", m[3])
                if m[0] == "log":
                    log.log(m[1], "engine process: %s", m[2])
            if not self.owner and gone:
                raise EngineStartError("the engine process closed this server's connection "
                                       "while starting", False)
            if gone or (not messages and not self.process.is_alive()):
                _join(self.process, 5.0)
                raise EngineStartError("the engine process ended while starting ("
                                       f"{describe_exit(self.process.exitcode)}); see the "
                                       "messages above", False)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.owner else self.info.get("pid")

    # --- on the event loop -----------------------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop, metrics: ServerMetrics) -> None:
        """Read the engine process's messages on `loop`, observing `metrics`."""
        self.loop, self.metrics = loop, metrics
        metrics.state = self.state
        loop.add_reader(self.sock.fileno(), self._on_readable)
        if self.owner:
            loop.add_reader(self.process.sentinel, self._on_exit)
            self._check_liveness()

    def _check_liveness(self) -> None:
        if not self.process.is_alive():
            self._on_exit()
            return
        self._liveness = self.loop.call_later(LIVENESS_CHECK_S, self._check_liveness)

    def submit(self, choices: list[Choice]) -> None:
        """Send `choices` to the engine (all or none); ServerBusy when it takes none now."""
        if self.failure is not None:
            raise ServerBusy(f"{self.failure}; this server cannot serve requests (see its log)",
                             "engine_unavailable")
        if self._closed:
            raise ServerBusy("the server is shutting down", "shutting_down")
        live = len(self._choices)
        if live + len(choices) > self.capacity:
            raise ServerBusy(f"the server is at capacity ({self.capacity} requests live, "
                             f"{live} now); retry later", "queue_full")
        items = []
        for c in choices:
            c.rid = next(self._rids)
            self._choices[c.rid] = c
            items.append((c.rid, c.prompt, {name: getattr(c.params, name)
                                            for name in PARAM_FIELDS}, c.seed_stream))
            self.metrics.prompt_tokens.inc(len(c.prompt))
        self._send(("add", items))

    def cancel(self, choices: list[Choice]) -> None:
        """Abort `choices` not finished yet (their KV pages go back before the next step)."""
        rids = []
        for c in choices:
            if c.rid in self._choices and not c.cancelled:
                c.cancelled = True
                rids.append(c.rid)
        if rids:
            self._send(("abort", rids))

    def begin_shutdown(self, grace_s: float) -> None:
        """No new choices; live ones may finish for `grace_s` s (any thread)."""
        self._closed = True
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._send, ("shutdown", grace_s))

    @property
    def live(self) -> int:
        """Choices submitted and not reported finished."""
        return len(self._choices)

    @property
    def healthy(self) -> bool:
        return (self.failure is None and not self._closed and self.sock is not None
                and (not self.owner or self.process.is_alive()))

    @property
    def idle(self) -> bool:
        """No choice live, and the engine's last state came after every finish and shows no
        work (its KV pages are then all free unless one leaked)."""
        s = self.state
        return not self._choices and s.finished == self.finished and not s.has_work

    # --- the end ---------------------------------------------------------------------------
    def stop(self, timeout: float = EXIT_JOIN_S) -> bool:
        """End the engine process: ("exit",), then terminate / kill if it lingers. True when
        it exited by itself within `timeout`."""
        self._closed = True
        self._detach()
        p = self.process
        if not self.owner:  # this HTTP process leaves: its requests end, the engine goes on
            if self.sock is not None:
                self._say_exit()
                self.sock.close()
            return True
        if p.is_alive() and self.failure is None:
            self._say_exit()
        self.release_peers()
        _join(p, timeout)
        clean = p.exitcode == 0
        if p.is_alive():
            log.warning("the engine process did not exit within %.0f s: terminating it", timeout)
            p.terminate()
            _join(p, 5.0)
        if p.is_alive():
            p.kill()
            _join(p, 5.0)
        self.sock.close()
        return clean

    def _say_exit(self) -> None:
        try:
            self.sock.setblocking(True)
            self.sock.settimeout(2.0)
            self._outbox.put(("exit",))
            self._outbox.flush()
        except (OSError, PeerGone):
            pass

    def kill(self) -> None:
        """End the engine process at once (a client that does not own it: nothing)."""
        if self.owner and self.process.is_alive():
            self.process.kill()
            _join(self.process, 5.0)

    def _detach(self) -> None:
        if self.loop is None or self.loop.is_closed() or self.sock is None:
            return
        if self._liveness is not None:
            self._liveness.cancel()
            self._liveness = None
        if self.sock.fileno() >= 0:
            self.loop.remove_reader(self.sock.fileno())
            self.loop.remove_writer(self.sock.fileno())
        if self.owner:
            self.loop.remove_reader(self.process.sentinel)
        self._writing = False

    # --- messages --------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        if self.failure is not None or self.sock is None or self.sock.fileno() < 0:
            return
        self._outbox.put(message)
        self._flush()

    def _flush(self) -> None:
        try:
            done = self._outbox.flush()
        except PeerGone:
            self._on_exit()
            return
        fd = self.sock.fileno()
        if done and self._writing:
            self.loop.remove_writer(fd)
            self._writing = False
        elif not done and not self._writing:
            self.loop.add_writer(fd, self._flush)
            self._writing = True

    def _on_readable(self) -> None:
        try:
            messages, gone = self._reader.read(), False
        except PeerGone:
            messages, gone = [], True
        self._handle(messages)
        if gone:
            self._on_exit()

    def _handle(self, messages: list[tuple]) -> None:
        """Every message read at once: outputs merged per choice, then dispatched."""
        outputs: dict[int, list] = {}
        state = None
        for m in messages:
            if m[0] == "out":
                for rid, ids, fin, lps, prompt in m[1]:
                    have = outputs.get(rid)
                    if have is None:
                        outputs[rid] = [ids, fin, lps, prompt]
                    else:
                        have[0] = have[0] + ids
                        have[1] = fin or have[1]
                        if lps is not None:
                            have[2] = (have[2] or []) + lps
                        have[3] = prompt or have[3]
                state = m[2] if m[2] is not None else state
            elif m[0] == "log":
                log.log(m[1], "engine process: %s", m[2])
        if outputs:
            self._dispatch(outputs)
        if state is not None:
            self.state = self.metrics.state = EngineState(**state)

    def _dispatch(self, outputs: dict[int, list]) -> None:
        now, m = time.perf_counter(), self.metrics
        for rid, (ids, fin, lps, prompt) in outputs.items():
            if fin is None:
                c = self._choices.get(rid)
            else:
                self.finished += 1
                c = self._choices.pop(rid, None)
            if c is None:
                continue
            if ids:
                m.generation_tokens.inc(len(ids))
                if c.last_emit is None:
                    m.ttft.observe(now - c.arrived)
                else:
                    m.itl.observe((now - c.last_emit) / len(ids))
                c.last_emit = now
            if fin is not None:
                m.finished.labels(reason=fin).inc()
                m.e2e.observe(now - c.arrived)
            c.deliver(ids, fin, lps, prompt)

    def _on_exit(self) -> None:
        """The engine process died (it was not told to exit): fail what is live."""
        if self.failure is not None or self.sock is None:
            return
        try:
            self._handle(self._reader.read())  # what it sent before it died
        except PeerGone:
            pass
        self._detach()
        if self.owner:
            _join(self.process, 1.0)
            if self.process.is_alive():
                self.process.kill()
                _join(self.process, 5.0)
            how = describe_exit(self.process.exitcode)
        else:
            how = "it closed this server's connection"
        self.failure = f"the engine process (pid {self.pid}) exited unexpectedly ({how})"
        log.error("%s: %d live request(s) fail, new requests answer 503, /health reports "
                  "it", self.failure, len(self._choices))
        choices, self._choices = list(self._choices.values()), {}
        for c in choices:
            self.metrics.finished.labels(reason="error").inc()
            c.deliver([], "error", None, None)
