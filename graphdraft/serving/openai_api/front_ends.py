"""Several HTTP processes over one engine process (`graphdraft serve --api-server-count N`).

One Python event loop parses every request, detokenizes and streams every response of a
server; under load it saturates one CPU and then bounds the whole server (perf/RESULTS.md,
2026-12-06i: the HTTP process at 0.98 CPU with 128 streams while the engine process idled),
which vLLM's `--api-server-count` addresses the same way. With N > 1:

  supervisor (`Supervisor`, in the    holds the port (`reuseport_socket`, not listening);
  `serve` process)                    starts the engine process with 1 + N connections (`EngineClient(peers=N)`; its own is the
                                      control one: the engine's log, its state for
                                      --metrics-json, its exit); spawns the N HTTP processes and
                                      watches them and the signals
  HTTP process i (`run_api_server`)   the ASGI app under uvicorn on its own SO_REUSEPORT
                                      socket at that port (the kernel spreads new connections
                                      over them by address hash: a shared socket went to
                                      whichever event loop accepted first, once 32 of 32),
                                      over `EngineClient.over` its own
                                      connection; capacity: its share of the server's
                                      (`capacity_shares`: a request beyond its process's share
                                      answers 503)

Metrics: each HTTP process counts its own in prometheus_client's multiprocess mode, in a
directory the supervisor makes and removes (`PROMETHEUS_MULTIPROC_DIR` in the processes'
environment); `/metrics`, whichever process answers, sums them (`metrics.ServerMetrics`).

Shutdown: the first SIGTERM / SIGINT reaching the supervisor is forwarded once, as SIGTERM, to
every HTTP process (they ignore SIGINT: a terminal's Ctrl-C reaches the whole process group);
each shuts down as a one-process server does (`server.GracefulServer`: no new connections, its
live requests get the grace, then are aborted). The supervisor waits for them (the grace + 10
s, then kills what is left), ends the engine process and returns 0. A second signal kills every
process and exits at once (128 + the signal). An HTTP process that exits while the server runs
ends the server (exit code 1) rather than serve on with part of its capacity gone; an engine
process that dies leaves every HTTP process answering 503 (/health says why), as with one.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any

from graphdraft.serving.openai_api.app import ServerConfig
from graphdraft.serving.openai_api.engine_client import EngineClient, describe_exit
from graphdraft.serving.openai_api.metrics import ServerMetrics

log = logging.getLogger("graphdraft.serving.openai_api")

METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
BACKLOG = 2048
"""The listening socket's backlog (uvicorn's default)."""
STOP_MARGIN_S = 10.0
"""How much longer than the grace the supervisor waits for the HTTP processes to exit."""


@dataclass(frozen=True)
class ApiServerSpec:
    """What HTTP process `index` of `count` serves with (picklable: plain data only)."""

    index: int
    count: int
    capacity: int
    """Choices this process may have live (`capacity_shares`)."""
    config: ServerConfig
    """Its `metrics_dir` set: the shared multiprocess directory."""
    tokenizer_dir: str
    log_level: str = "warning"
    ready_timeout_s: float = 60.0


def capacity_shares(total: int, count: int) -> list[int]:
    """`total` choices split over `count` processes as evenly as ints allow (sum == total)."""
    if count < 1:
        raise ValueError(f"count: expected an int >= 1, got {count}")
    return [total // count + (i < total % count) for i in range(count)]


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: any free one) with SO_REUSEADDR and
    SO_REUSEPORT, not listening: the supervisor's holds the port (and resolves port 0); each
    HTTP process binds its own to the same address and listens, and the kernel spreads new
    connections over the listening ones by their address hash."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def run_api_server(spec: ApiServerSpec, address: tuple[str, int],
                   engine_sock: socket.socket, listening: Any = None) -> None:
    """HTTP process `spec.index`: the app over the engine connection `engine_sock`, served on
    its own SO_REUSEPORT socket at `address` until SIGTERM (module docstring); exits when the
    supervisor is gone. `listening` (an Event): set once its socket listens."""
    from graphdraft.io.tokenizer import load_tokenizer
    from graphdraft.serving.openai_api.app import OpenAIServer
    from graphdraft.serving.openai_api.engine_core import watch_parent
    from graphdraft.serving.openai_api.server import make_server

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(os.getppid())
    _logging(spec.log_level)
    tokenizer = load_tokenizer(spec.tokenizer_dir)
    if tokenizer is None:
        raise SystemExit(f"HTTP process {spec.index}: no tokenizer in {spec.tokenizer_dir}")
    client = EngineClient.over(engine_sock, spec.capacity)
    client.wait_ready(spec.ready_timeout_s)
    api = OpenAIServer(client, tokenizer, spec.config)
    listener = reuseport_socket(*address)
    listener.listen(BACKLOG)
    if listening is not None:
        listening.set()
    server = make_server(api, "", 0, log_level=spec.log_level, supervised=True)
    server.run(sockets=[listener])


def _logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    lg = logging.getLogger("graphdraft")
    lg.setLevel(level.upper())
    lg.addHandler(handler)
    lg.propagate = False


class Supervisor:
    """The `serve` process with N HTTP processes (module docstring). `client`: the launched
    engine's owner client, `peers=count`, ready; `listener`: the bound socket; `config`: what
    every HTTP process serves with; `capacity`: the server's in all."""

    def __init__(self, client: EngineClient, listener: socket.socket, config: ServerConfig,
                 tokenizer_dir: str, capacity: int, log_level: str = "warning") -> None:
        if len(client.peer_socks) < 1:
            raise ValueError("client: expected an EngineClient launched with peers >= 1")
        self.client, self.listener = client, listener
        self.address = listener.getsockname()[:2]
        self.grace_s = config.shutdown_grace_s
        self.metrics_dir = tempfile.mkdtemp(prefix="graphdraft-metrics-")
        count = len(client.peer_socks)
        config = replace(config, metrics_dir=self.metrics_dir)
        self.specs = [ApiServerSpec(i, count, share, config, tokenizer_dir, log_level)
                      for i, share in enumerate(capacity_shares(capacity, count))]
        self.processes: list[Any] = []
        self._listening: list[Any] = []
        self.signals = 0
        self.code = 0
        self._stopping: asyncio.Event | None = None

    def start(self) -> None:
        """Spawn the HTTP processes; then this process's copies of their sockets close (the
        supervisor's bound socket stays, holding the port, until the end)."""
        ctx = mp.get_context("spawn")
        previous = os.environ.get(METRICS_ENV)
        os.environ[METRICS_ENV] = self.metrics_dir
        try:
            for spec, sock in zip(self.specs, self.client.peer_socks, strict=True):
                listening = ctx.Event()
                p = ctx.Process(target=run_api_server,
                                args=(spec, self.address, sock, listening),
                                name=f"graphdraft-http-{spec.index}", daemon=True)
                p.start()
                self.processes.append(p)
                self._listening.append(listening)
        finally:
            if previous is None:
                os.environ.pop(METRICS_ENV, None)
            else:
                os.environ[METRICS_ENV] = previous
            self.client.release_peers()
        self._wait_listening()

    def _wait_listening(self, timeout: float = 120.0) -> None:
        """Until every HTTP process listens (then the address may be announced); RuntimeError
        naming one that exited first or did not within `timeout`."""
        deadline = time.monotonic() + timeout
        for p, listening in zip(self.processes, self._listening, strict=True):
            while not listening.wait(0.05):
                if not p.is_alive() or time.monotonic() > deadline:
                    self.stop()
                    self._end()
                    raise RuntimeError(f"HTTP process {p.pid} did not start listening ("
                                       f"{describe_exit(p.exitcode)}); see the messages above")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def run(self) -> int:
        """Supervise until the HTTP processes exited (module docstring); the exit code."""
        try:
            return asyncio.run(self._supervise())
        finally:
            self._end()

    async def _supervise(self) -> int:
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self.client.attach(loop, ServerMetrics())
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig)
        for p in self.processes:
            loop.add_reader(p.sentinel, self._exited, p)
        await self._stopping.wait()
        deadline = time.monotonic() + self.grace_s + STOP_MARGIN_S
        while any(p.is_alive() for p in self.processes) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in self.processes:
            loop.remove_reader(p.sentinel)
            if p.is_alive():
                log.warning("HTTP process %d did not exit within %.0f s: killing it", p.pid,
                            self.grace_s + STOP_MARGIN_S)
                p.kill()
        return self.code

    def on_signal(self, sig: int) -> None:
        """The first: forward SIGTERM to every HTTP process and wait for them; the second:
        kill every process and exit now."""
        self.signals += 1
        if self.signals > 1:
            print("graphdraft serve: second signal, exiting now", file=sys.stderr, flush=True)
            for p in self.processes:
                if p.is_alive():
                    p.kill()
            self.client.kill()
            os._exit(128 + sig)
        log.warning("shutting down (signal %d): no new requests; live ones get %.0f s, then "
                    "are aborted; a second signal exits at once", sig, self.grace_s)
        self.stop()

    def stop(self) -> None:
        """Shut the HTTP processes down (SIGTERM to each, once)."""
        for p in self.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        self.client.begin_shutdown(self.grace_s)
        if self._stopping is not None:
            self._stopping.set()

    def _exited(self, p: Any) -> None:
        asyncio.get_running_loop().remove_reader(p.sentinel)
        if self._stopping is not None and self._stopping.is_set():
            return
        p.join(1.0)
        log.error("HTTP process %d exited unexpectedly (%s): shutting the server down", p.pid,
                  describe_exit(p.exitcode))
        self.code = 1
        self.stop()

    def _end(self) -> None:
        """The engine process ends; the metrics directory goes."""
        for p in self.processes:
            p.join(5.0)
        self.client.stop()
        self.listener.close()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
