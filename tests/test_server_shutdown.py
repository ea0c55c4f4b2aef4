"""`python -m graphdraft serve` stopped by signals while it streams (a subprocess each, in its
own session like a terminal's foreground job; the shipped pair on the CPU): Ctrl-C (SIGINT
to the whole process group: the server and its engine process) stops accepting connections,
lets the live stream end (finished or aborted at --shutdown-timeout) with `data: [DONE]`, and
exits 0 with nothing on stdout and no traceback; a second SIGTERM exits at once. Either way
the engine process is gone afterwards."""

from __future__ import annotations

import os
import signal
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from tests.server_harness import ServeProcess, StreamClient, gone, refused  # noqa: E402


def test_ctrl_c_while_streaming_ends_the_stream_and_exits_0():
    s = ServeProcess("--shutdown-timeout", "1")
    try:
        client = StreamClient(s.url, max_tokens=200)
        client.start()
        assert client.first.wait(60) and client.error is None
        os.killpg(s.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the job
        deadline = time.monotonic() + 10
        while not refused(s.url):  # no new connections once the shutdown began
            assert time.monotonic() < deadline
            time.sleep(0.05)
        rc, out, err = s.finish(timeout=30)
    finally:
        s.kill()
    client.join(10)
    assert rc == 0, err
    assert gone(s.engine_pid), "the engine process outlived the server"
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
        assert gone(s.engine_pid), "the engine process outlived the server"
    finally:
        s.kill()
    assert rc == 128 + signal.SIGTERM, err
    assert "second signal" in err
