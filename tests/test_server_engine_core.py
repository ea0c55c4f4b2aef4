"""The engine process as the server sees it (one server of this module, its engine built by
`tests.server_harness.faulty_engine`): a step that raises fails its requests, not the
server; an Engine that cannot be built is serve's one-line error; a killed engine process
makes every live request fail with a clear 500, new requests answer 503 and /health says
why, never a hang; the shutdown leaves no process."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from tests.server_harness import FAIL_MAX_TOKENS, FAULTY_FACTORY, Served  # noqa: E402

C = "/v1/completions"
BODY = {"prompt": "class A:\n    def __init__(self", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def served():
    s = Served(factory=FAULTY_FACTORY)
    yield s
    s.stop()
    assert s.engine.process.exitcode in (0, -signal.SIGKILL)


def test_a_failing_step_fails_its_requests_not_the_server(served):
    """A step that raises (injected) ends the live requests with an engine error (500, its
    traceback in the server's log); their pages go back and the next request is served."""
    before = httpx.post(served.url + C, json=BODY, timeout=60)
    assert before.status_code == 200
    r = httpx.post(served.url + C, json=BODY | {"max_tokens": FAIL_MAX_TOKENS}, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    assert any("injected step failure" in t and "Traceback" in t
               for t in served.log.tracebacks())
    served.idle()
    assert served.all_pages_free() and served.engine.state.step_errors == 1
    after = httpx.post(served.url + C, json=BODY, timeout=60)
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}


def test_a_bad_checkpoint_is_one_line_from_the_engine_process(tmp_path, capsys):
    """The engine process fails to build its Engine (a user error): `serve` exits 2 with the
    one line naming the flag, as before the engine had a process of its own."""
    from graphdraft.__main__ import main
    argv = ["serve", "--device", "cpu", "--quiet", "--port", "0", "--target", str(tmp_path),
            "--draft", str(tmp_path)]
    assert main(argv) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1, cap.err
    assert "--target" in cap.err and "config.json" in cap.err


def _stream(url: str, out: dict) -> None:
    body = {"prompt": "def main():\n", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    out.update(text="", events=[], done=False)
    with httpx.stream("POST", url + C, json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                out["events"].append(event)
                if "choices" in event:
                    out["text"] += event["choices"][0]["text"]
                    out["first"].set()


def test_a_killed_engine_process_fails_clearly_and_health_says_so(served):
    """SIGKILL to the engine process mid-stream: the stream ends with an error event naming
    the engine process and `data: [DONE]`; then every request answers 503, /health 503 with
    the reason, and the server's log says what happened. (Last test of the module.)"""
    out = {"first": threading.Event()}
    client = threading.Thread(target=_stream, args=(served.url, out), daemon=True)
    client.start()
    assert out["first"].wait(60)
    pid = served.engine.pid
    os.kill(pid, signal.SIGKILL)
    client.join(30)
    assert not client.is_alive() and out["done"], out
    err = out["events"][-1]["error"]
    assert err["code"] == "engine_error" and f"pid {pid}" in err["message"]
    assert "SIGKILL" in err["message"]
    r = httpx.post(served.url + C, json=BODY, timeout=10)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "engine_unavailable"
    assert "engine process" in r.json()["error"]["message"]
    h = httpx.get(served.url + "/health", timeout=10)
    assert h.status_code == 503 and "exited unexpectedly" in h.json()["reason"]
    assert any("exited unexpectedly" in t for t in served.log.tracebacks())
    assert httpx.get(served.url + "/v1/models", timeout=10).status_code == 200
