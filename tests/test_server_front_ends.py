"""`graphdraft serve --api-server-count N`: several HTTP processes over one engine process
(`openai_api.front_ends`; the shipped pair on the CPU).

The engine core serves one socket per HTTP process: each peer's request ids are its own, an
abort or an exit of one peer touches only its requests, each peer's state counts its own
finishes (a fake Engine, turn by turn). Then `python -m graphdraft serve --api-server-count 2`
as a subprocess with the real `openai` client: greedy outputs equal `Engine.generate`; 32
concurrent streams with a fifth disconnecting leave every KV page free, and both HTTP
processes served some of them (each one's own counter file); /metrics, whichever process answers, counts every process's requests;
Ctrl-C while streaming ends the stream and exits 0 with every process gone; an HTTP process
that dies ends the server with exit code 1.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from graphdraft.serving.openai_api.engine_core import EngineCore  # noqa: E402
from graphdraft.serving.openai_api.front_ends import capacity_shares  # noqa: E402
from graphdraft.serving.openai_api.wire import FrameReader, encode, socket_pair  # noqa: E402
from tests.server_harness import (  # noqa: E402
    ServeProcess,
    StreamClient,
    alive,
    gone,
    one_stream,
)
from tests.test_engine_core_times import _Engine  # noqa: E402

PROMPTS = ["def main():\n", "import os\n", "class A:\n    def __init__(self", "for i in range("]
MAX_TOKENS = 16
STREAM_TOKENS = 8


def test_capacity_shares_split_evenly_and_sum_to_the_total():
    assert capacity_shares(10, 3) == [4, 3, 3]
    assert capacity_shares(2, 4) == [1, 1, 0, 0]
    assert sum(capacity_shares(1152, 5)) == 1152
    with pytest.raises(ValueError, match="count"):
        capacity_shares(8, 0)


# --- the engine core with two peers (a fake Engine, turn by turn) -------------------------
class _Peer:
    def __init__(self) -> None:
        self.http, self.core = socket_pair()
        self.http.setblocking(False)
        self.reader = FrameReader(self.http)
        self.ids: dict[int, list[int]] = {}
        self.finish: dict[int, str] = {}
        self.finished_state = 0

    def send(self, message: tuple) -> None:
        self.http.sendall(encode(message))

    def add(self, *rids: int) -> None:
        self.send(("add", [(rid, [5, 6], {"max_new_tokens": 3}, None) for rid in rids]))

    def read(self) -> None:
        for m in self.reader.read():
            assert m[0] == "out", m
            for rid, ids, fin, *_ in m[1]:
                self.ids.setdefault(rid, []).extend(ids)
                if fin is not None:
                    self.finish[rid] = fin
            if m[2] is not None:
                self.finished_state = m[2]["finished"]


def _turns(core: EngineCore, peers: list[_Peer], n: int = 8) -> None:
    for _ in range(n):
        core.turn()
        for p in peers:
            p.read()


def test_the_engine_core_keeps_each_peers_requests_apart():
    a, b = _Peer(), _Peer()
    core = EngineCore(_Engine(), [a.core, b.core])
    a.add(1)
    b.add(1, 2)  # the same rid on another peer: another request
    _turns(core, [a, b])
    assert a.ids == {1: [7, 7, 7]} and a.finish == {1: "length"}
    assert b.ids == {1: [7, 7, 7], 2: [7, 7, 7]} and b.finish == {1: "length", 2: "length"}
    assert (a.finished_state, b.finished_state) == (1, 2)  # each peer's own finishes

    a.add(3)
    b.add(3)
    core.turn()
    b.send(("abort", [3]))  # peer b's 3 only
    _turns(core, [a, b])
    assert a.finish[3] == "length" and a.ids[3] == [7, 7, 7]
    assert b.finish[3] == "abort"

    a.add(4)
    b.add(4)
    core.turn()
    b.send(("exit",))  # peer b leaves: its live request ends, peer a's goes on
    _turns(core, [a])
    assert not core.exiting and not core.peers[1].open
    assert a.finish[4] == "length" and 4 not in b.finish
    assert core.engine.running == [] and not core.live and not core.held

    a.add(5)
    core.turn()
    a.http.close()  # the owner gone: the loop ends
    core.turn()
    assert core.exiting


# --- the real server with two HTTP processes ---------------------------------------------
def _references():
    """Greedy `Engine.generate` outputs of the shipped pair, as the server's flags load it."""
    import graphdraft.serving.cli.models as models
    from graphdraft.serving.cli import build_parser
    from graphdraft.serving.engine import Engine
    from graphdraft.serving.verify import SamplingParams

    a = build_parser().parse_args(["serve", "--device", "cpu", "--quiet",
                                   "--max-context-len", "256"])
    m = models.load(a)
    tok = m.tokenizer
    engine = Engine(m.target, m.cfg, m.head, eos_token_id=m.eos)
    outs = engine.generate([tok.encode(p) for p in PROMPTS],
                           SamplingParams(max_new_tokens=MAX_TOKENS, stop_token_ids=tuple(m.stops)))

    def text(ids: list[int]) -> str:
        return tok.decode(ids[:-1] if ids and ids[-1] in m.stops else ids)
    return {p: (text(o), text(o[:STREAM_TOKENS])) for p, o in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module")
def two():
    s = ServeProcess("--api-server-count", "2", "--max-running-requests", "16",
                     "--max-queued-requests", "48", "--shutdown-timeout", "2")
    try:
        assert len(s.http_pids) == 2, "".join(s.err)
        s.refs = _references()
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0,
                                 timeout=120)
        s.name = s.client.models.list().data[0].id
        yield s
    finally:
        s.kill()


def _requests_served(pid: int) -> float:
    """The HTTP requests HTTP process `pid` counted (its own prometheus multiprocess file, in
    the directory its environment names)."""
    from prometheus_client.mmap_dict import MmapedDict
    env = dict(item.split("=", 1) for item in
               Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    path = Path(env["PROMETHEUS_MULTIPROC_DIR"]) / f"counter_{pid}.db"
    return sum(value for key, value, *_ in MmapedDict.read_all_values_from_file(str(path))
               if '"graphdraft_requests_total"' in key and "completions" in key)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M):
        total += float(m[1])
    return total


def _idle(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (_metric(url, "graphdraft_running_requests") or _metric(url, "graphdraft_queue_depth")
           or _metric(url, "graphdraft_kv_pages_used")):
        assert time.monotonic() < deadline, "requests still live"
        time.sleep(0.05)


def test_greedy_completions_equal_engine_generate(two):
    r = two.client.completions.create(model=two.name, prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                      temperature=0)
    assert [c.text for c in r.choices] == [two.refs[p][0] for p in PROMPTS]
    for p in PROMPTS:  # one request each: several connections, either process
        stream = two.client.completions.create(model=two.name, prompt=p, stream=True,
                                               max_tokens=MAX_TOKENS, temperature=0)
        assert "".join(c.choices[0].text for c in stream if c.choices) == two.refs[p][0]


def test_32_streams_over_both_processes_with_a_fifth_disconnecting(two):
    rng = random.Random(1)
    plan = [(PROMPTS[i % len(PROMPTS)], rng.random() < 0.2) for i in range(32)]
    before_requests = _metric(two.url, "graphdraft_requests_total")
    served = [_requests_served(p) for p in two.http_pids]

    async def run() -> list[str | None]:
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one_stream(client, two.url, two.name, p, leave, STREAM_TOKENS)
                                          for p, leave in plan))

    results = asyncio.run(run())
    for (p, leave), got in zip(plan, results, strict=True):
        if not leave:
            assert got == two.refs[p][1], p
    _idle(two.url)
    assert _metric(two.url, "graphdraft_kv_pages_used") == 0
    # the kernel spread the connections over both processes' SO_REUSEPORT sockets (by address
    # hash: 32 connections all on one has odds 2^-31), and /metrics counts both
    gained = [_requests_served(p) - n for p, n in zip(two.http_pids, served, strict=True)]
    assert all(g >= 1 for g in gained) and sum(gained) == len(plan), gained
    assert _metric(two.url, "graphdraft_requests_total") == before_requests + len(plan)
    assert _metric(two.url, 'graphdraft_choices_finished_total{reason="abort"}') >= 1
    assert all(alive(p) for p in (two.engine_pid, *two.http_pids))


def test_ctrl_c_while_streaming_ends_the_stream_and_exits_0(two):
    client = StreamClient(two.url, max_tokens=200)
    client.start()
    assert client.first.wait(60) and client.error is None
    os.killpg(two.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the job
    rc, out, err = two.finish(timeout=40)
    client.join(10)
    assert rc == 0, err
    assert all(gone(p) for p in (two.engine_pid, *two.http_pids)), "a process outlived it"
    assert out == "" and "Traceback" not in err and "stopped" in err
    assert client.error is None and client.done  # the client saw the stream end
    assert client.reasons[-1] in ("length", "abort")


def test_an_http_process_that_dies_ends_the_server():
    s = ServeProcess("--api-server-count", "2", "--shutdown-timeout", "1")
    try:
        assert httpx.get(s.url + "/health", timeout=30).json() == {"status": "ok"}
        os.kill(s.http_pids[0], signal.SIGKILL)
        rc, _, err = s.finish(timeout=40)
        assert rc == 1, err
        assert "exited unexpectedly" in err
        assert all(gone(p) for p in (s.engine_pid, *s.http_pids))
    finally:
        s.kill()


def test_a_port_in_use_is_one_line_naming_the_flag_before_the_engine_starts():
    import socket
    import subprocess
    import sys

    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "graphdraft", "serve", "--device", "cpu",
                            "--api-server-count", "2", "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert r.returncode == 2 and r.stdout == ""
    assert f"--host/--port: cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "engine process" not in r.stderr and "Traceback" not in r.stderr
