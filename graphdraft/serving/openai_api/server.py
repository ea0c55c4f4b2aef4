"""Running the app under uvicorn, with a bounded graceful shutdown.

The first SIGTERM or SIGINT (Ctrl-C): the listening socket closes (no new connections),
new requests on open connections answer 503, live requests may finish for
`shutdown_grace_s` seconds and are then aborted (a stream ends with finish reason "abort"
and `data: [DONE]`), the engine process is told to exit and joined, and `serve` returns
normally (exit code 0). A second signal kills the engine process and exits at once
(`os._exit`, code 128 + the signal number).

One of several HTTP processes (`front_ends`): the server handles SIGTERM alone (its
supervisor sends it; a terminal's Ctrl-C reaches the supervisor, which forwards it once) and
serves the listening socket the supervisor bound (`run(sockets=[sock])`). A second SIGTERM
changes nothing there (the supervisor's and a service manager's may both reach it): the
supervisor kills it when the user insists.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading

import uvicorn

from graphdraft.serving.openai_api.app import OpenAIServer

log = logging.getLogger("graphdraft.serving.openai_api")

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the shutdown of the module docstring (its own signal handling:
    uvicorn's re-raises the signal after a graceful exit, which would not exit 0)."""

    def __init__(self, config: uvicorn.Config, api: OpenAIServer,
                 handled: tuple[int, ...] = HANDLED_SIGNALS, supervised: bool = False) -> None:
        super().__init__(config)
        self.api, self.handled, self.supervised = api, handled, supervised
        self.signals = 0

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread (tests run the server in another)
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in self.handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        self.signals += 1
        if self.supervised:  # (the supervisor said why, and kills it when the user insists)
            if self.signals == 1:
                log.info("HTTP process %d: shutting down (signal %d)", os.getpid(), sig)
                self.begin_shutdown()
            return
        if self.signals > 1:
            print("graphdraft serve: second signal, exiting now", file=sys.stderr, flush=True)
            self.api.engine.kill()
            os._exit(128 + sig)
        log.warning("shutting down (signal %d): no new requests; live ones get %.0f s, then are "
                    "aborted; a second signal exits at once", sig,
                    self.api.config.shutdown_grace_s)
        self.begin_shutdown()

    def begin_shutdown(self) -> None:
        self.api.begin_shutdown()
        self.should_exit = True


def http_stack() -> str:
    """What uvicorn serves with here (its "auto" choices): the HTTP parser (httptools, else
    the pure-Python h11) and the event loop (uvloop, else asyncio's); `.[serve]` installs the
    faster two."""
    import importlib.util as u
    parser = "httptools" if u.find_spec("httptools") else "h11"
    loop = "uvloop" if u.find_spec("uvloop") else "asyncio"
    return f"{parser} + {loop}"


def make_server(api: OpenAIServer, host: str, port: int, log_level: str = "warning",
                supervised: bool = False) -> GracefulServer:
    """A server for `api`; uvicorn cancels what still runs `shutdown_grace_s` + 5 s after the
    shutdown began (after the engine process aborted it). `supervised`: one of several HTTP
    processes (module docstring: SIGTERM only, once)."""
    config = uvicorn.Config(api.app, host=host, port=port, log_level=log_level,
                            lifespan="on", access_log=False,
                            timeout_graceful_shutdown=int(api.config.shutdown_grace_s) + 5)
    return GracefulServer(config, api, (signal.SIGTERM,) if supervised else HANDLED_SIGNALS,
                          supervised)
