"""A `graphdraft serve` server for tests: the HTTP app under uvicorn in a thread of the test
process, its engine in a spawned engine process (as `python -m graphdraft serve` runs it), on
127.0.0.1 with the shipped pair on the CPU. Also an engine factory with an injected step
failure (`faulty_engine`), called in the engine process by name."""

from __future__ import annotations

import logging
import threading
import time

from graphdraft.serving.cli import build_parser
from graphdraft.serving.cli.serve import ENGINE_FACTORY, engine_for_core, model_name
from graphdraft.serving.openai_api.app import OpenAIServer, ServerConfig
from graphdraft.serving.openai_api.engine_client import EngineClient
from graphdraft.serving.openai_api.engine_core import EngineCoreSpec
from graphdraft.serving.openai_api.server import make_server

FAULTY_FACTORY = "tests.server_harness:faulty_engine"
FAIL_MAX_TOKENS = 19
"""`faulty_engine`: a step raises once for each request of this max_new_tokens, after its
first token."""
LOGGERS = ("uvicorn", "uvicorn.error", "graphdraft", "asyncio")


def faulty_engine(a):
    """`engine_for_core`'s Engine whose `step` raises RuntimeError("injected step failure")
    once per request with max_new_tokens == FAIL_MAX_TOKENS, once it has a token."""
    engine, info = engine_for_core(a)
    real, failed = engine.step, set()

    def step():
        for r in list(engine.running):
            if r.params.max_new_tokens == FAIL_MAX_TOKENS and r.output and r.rid not in failed:
                failed.add(r.rid)
                raise RuntimeError("injected step failure")
        return real()

    engine.step = step
    return engine, info


class Records(logging.Handler):
    """Every log record of the server's loggers (uvicorn's do not reach the root logger)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def tracebacks(self) -> list[str]:
        return [self.format(r) for r in self.records
                if r.exc_info or r.levelno >= logging.ERROR or "Traceback" in r.getMessage()]


class Served:
    """One server: `url`, `api`, `engine` (its EngineClient), `log` (records), `tok`, `name`.
    `meanwhile()` runs while the engine process builds its Engine."""

    def __init__(self, factory: str = ENGINE_FACTORY, capacity: int = 128,
                 flags: tuple[str, ...] = (), meanwhile=None) -> None:
        self.args = build_parser().parse_args(["serve", "--device", "cpu", "--quiet",
                                               "--max-running-requests", "16",
                                               "--max-queued-requests", "112", *flags])
        self.engine = EngineClient(EngineCoreSpec(factory, self.args), capacity=capacity)
        self.engine.launch()
        try:
            self.extra = meanwhile() if meanwhile is not None else None
            self.info = self.engine.wait_ready(timeout=120)
        except BaseException:
            self.engine.kill()
            raise
        from graphdraft.serving.cli.models import load_tokenizer
        self.tok, self.name = load_tokenizer(self.info["tokenizer_dir"]), model_name(self.args)
        self.stops = tuple(self.info["stop_token_ids"])
        self.api = OpenAIServer(self.engine, self.tok, ServerConfig(
            self.name, stop_token_ids=self.stops, shutdown_grace_s=2.0))
        self.log = Records()
        for name in LOGGERS:
            logging.getLogger(name).addHandler(self.log)
        self.server = make_server(self.api, "127.0.0.1", 0, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def idle(self, timeout: float = 30.0) -> None:
        """Wait (bounded) until no request is live here or in the engine process."""
        deadline = time.monotonic() + timeout
        while not self.engine.idle:
            assert time.monotonic() < deadline, "requests still live"
            time.sleep(0.02)

    def all_pages_free(self) -> bool:
        s = self.engine.state
        return s.kv_pages_used == 0 and s.running == 0 and s.waiting == 0

    def stop(self) -> None:
        """Shut the server down; the engine process must have exited (not killed)."""
        self.server.begin_shutdown()
        self.thread.join(30)
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(self.log)
        assert not self.thread.is_alive()
        assert not self.engine.process.is_alive()
