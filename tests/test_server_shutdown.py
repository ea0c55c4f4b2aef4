"""`python -m graphdraft serve` stopped by signals while it streams (a subprocess each, in its
own session like a terminal's foreground job; the shipped pair on the CPU): Ctrl-C (SIGINT
to the whole process group: the server and its engine process) stops accepting connections,
lets the live stream end (finished or aborted at --shutdown-timeout) with `data: [DONE]`, and
exits 0 with nothing on stdout and no traceback; a second SIGTERM exits at once. Either way
the engine process is gone afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

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
        if _alive(self.engine_pid):
            os.kill(self.engine_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
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


def _refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.TransportError:
        return True
    return False


def test_ctrl_c_while_streaming_ends_the_stream_and_exits_0():
    s = ServeProcess("--shutdown-timeout", "1")
    try:
        client = StreamClient(s.url, max_tokens=200)
        client.start()
        assert client.first.wait(60) and client.error is None
        os.killpg(s.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the job
        deadline = time.monotonic() + 10
        while not _refused(s.url):  # no new connections once the shutdown began
            assert time.monotonic() < deadline
            time.sleep(0.05)
        rc, out, err = s.finish(timeout=30)
    finally:
        s.kill()
    client.join(10)
    assert rc == 0, err
    assert _gone(s.engine_pid), "the engine process outlived the server"
    assert out == ""  # stdout holds results only: a server has none
    assert "Traceback" not in err and "stopped" in err
    assert client.error is None and client.done  # the client saw the stream end
    assert client.text and client.reasons[-1] in ("length", "abort")
    if client.reasons[-1] == "abort":
        assert client.server_error["code"] == "shutting_down"


def test_a_second_signal_exits_at_once():
    s = ServeProcess("--shutdown-timeout", "60")
    try:
        client = StreamClient(s.url, max_tokens=200)
        client.start()
        assert client.first.wait(60)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rc, _, err = s.finish(timeout=10)
        assert time.monotonic() - t0 < 5
        assert _gone(s.engine_pid), "the engine process outlived the server"
    finally:
        s.kill()
    assert rc == 128 + signal.SIGTERM, err
    assert "second signal" in err
