"""A `graphdraft serve` server for tests: the HTTP app under uvicorn in a thread of the test
process, its engine in a spawned engine process (as `python -m graphdraft serve` runs it), on
127.0.0.1 with the shipped pair on the CPU. Also an engine factory with an injected step
failure (`faulty_engine`), called in the engine process by name; and `python -m graphdraft
serve` as a subprocess (`ServeProcess`), with a streaming client in a thread
(`StreamClient`) and process checks (`alive`, `gone`, `refused`)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

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


ROOT = Path(__file__).resolve().parent.parent


class ServeProcess:
    def __init__(self, *flags: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "graphdraft", "serve", "--device", "cpu", "--port", "0",
             "--quiet", "--max-context-len", "256", *flags],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        self.err: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 120
        while not (m := re.search(r"on http://127\.0\.0\.1:(\d+)", "".join(self.err))):
            assert self.proc.poll() is None, "".join(self.err)
            assert time.monotonic() < deadline, "server did not start: " + "".join(self.err)
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{m.group(1)}"
        self.engine_pid = int(re.search(r"engine process (\d+) ready", "".join(self.err))[1])
        http = re.search(r"HTTP processes ([\d, ]+)", "".join(self.err))
        self.http_pids = [int(p) for p in http[1].split(",")] if http else []
        """--api-server-count > 1: the HTTP processes (else [])"""

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line)

    def finish(self, timeout: float) -> tuple[int, str, str]:
        rc = self.proc.wait(timeout)
        out = self.proc.stdout.read()
        self._reader.join(5)
        return rc, out, "".join(self.err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in (self.engine_pid, *self.http_pids):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class StreamClient(threading.Thread):
    """One streamed completion in a thread: its chunks' text, and whether [DONE] came."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.text, self.reasons, self.done, self.error = "", [], False, None
        self.server_error = None
        self.first = threading.Event()

    def run(self) -> None:
        body = {"prompt": "def main():\n", "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:  # aborted by the shutdown: said before [DONE]
                            self.server_error = event["error"]
                            continue
                        choice = event["choices"][0]
                        self.text += choice["text"]
                        self.reasons.append(choice["finish_reason"])
                        self.first.set()
        except Exception as e:  # noqa: BLE001 (reported by the test)
            self.error = e
        finally:
            self.first.set()


def refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.TransportError:
        return True
    return False


async def one_stream(client: httpx.AsyncClient, url: str, name: str, prompt: str, leave: bool,
                     max_tokens: int) -> str | None:
    """Stream one greedy completion; `leave`: disconnect after the first text chunk (None)."""
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    text = ""
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text
            chunk = json.loads(line[6:])
            text += chunk["choices"][0]["text"]
            if leave and text:
                return None  # leaving the block closes the connection mid-stream
    raise AssertionError("stream ended without [DONE]")
