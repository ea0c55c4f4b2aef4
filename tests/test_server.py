"""`graphdraft serve` as its clients meet it: the real `openai` client package and raw HTTP
against one server on 127.0.0.1 (the shipped pair on the CPU; one module-scoped server: its
HTTP app in a thread of this process, its engine in a spawned engine process, whose state
the tests read after each test: every KV page free, nothing running).

Completions, chat, streaming, `n`, stop strings and stop token ids; greedy outputs equal
`Engine.generate` on the same prompts; 64 concurrent streams with a fifth of them
disconnecting mid-stream; every bad request's status and error body, the server serving on
after them; `/metrics`; the HTTP side's limits equal `Engine.check_request`. Shutdown under
signals runs in a subprocess (test_server_shutdown.py); a failing step and a killed engine
process in test_server_engine_core.py.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import graphdraft.serving.cli.models as models  # noqa: E402
from graphdraft.serving.cli import build_parser  # noqa: E402
from graphdraft.serving.engine import Engine  # noqa: E402
from graphdraft.serving.verify import SamplingParams  # noqa: E402
from tests.server_harness import Served as ServedBase  # noqa: E402
from tests.server_harness import one_stream  # noqa: E402

PROMPTS = ["def main():\n", "import os\n", "class A:\n    def __init__(self", "for i in range(",
           "    return ", "# compute the mean\n", "with open(path) as f:\n", "x = [1, 2,"]
MAX_TOKENS = 24
STREAM_TOKENS = 12  # the 64 concurrent streams: a prefix of the greedy text
MESSAGES = [{"role": "user", "content": "print a list"}]


class Served(ServedBase):
    """The module's server, with greedy references from `Engine.generate` built in this
    process while the engine process starts."""

    def __init__(self) -> None:
        super().__init__(meanwhile=self._references)
        self.refs, self.ref_engine = self.extra
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=120)

    def _references(self):
        """Greedy outputs of `Engine.generate` (an engine of this process over the same
        models and flags as the server's)."""
        a = build_parser().parse_args(["serve", "--device", "cpu", "--quiet",
                                       "--max-running-requests", "16"])
        m = models.load(a)
        tok = m.tokenizer
        ref = Engine(m.target, m.cfg, m.head, eos_token_id=m.eos)
        chat_ids = tok.encode(tok.apply_chat_template(MESSAGES))
        prompts = [tok.encode(p) for p in PROMPTS] + [chat_ids]
        params = SamplingParams(max_new_tokens=MAX_TOKENS, stop_token_ids=tuple(m.stops))
        outs = ref.generate(prompts, params)
        return dict(zip([*PROMPTS, "<chat>"], outs, strict=True)), ref

    def text(self, key: str, limit: int = MAX_TOKENS) -> str:
        """The reference's text, as the server returns it (a trailing stop id is not text);
        `limit`: the first `limit` tokens (greedy: a prefix of the longer output)."""
        ids = self.refs[key][:limit]
        return self.tok.decode(ids[:-1] if ids and ids[-1] in self.stops else ids)


@pytest.fixture(scope="module")
def served():
    s = Served()
    yield s
    s.stop()
    assert s.engine.process.exitcode == 0  # told to exit, it did (not terminated)


def _idle(s: Served, timeout: float = 30.0) -> None:
    s.idle(timeout)


def _all_pages_free(s: Served) -> bool:
    return s.all_pages_free()


# --- the real client ---------------------------------------------------------------------
def test_models_and_health(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [served.name]
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    r = httpx.get(served.url + "/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_greedy_completions_equal_engine_generate(served):
    r = served.client.completions.create(model=served.name, prompt=PROMPTS[:4],
                                         max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c, p in zip(r.choices, PROMPTS[:4], strict=True):
        assert c.text == served.text(p), p
        assert c.finish_reason == ("stop" if served.refs[p][-1] in served.stops else "length")
    assert r.usage.completion_tokens == sum(len(served.refs[p]) for p in PROMPTS[:4])
    assert r.usage.prompt_tokens == sum(len(served.tok.encode(p)) for p in PROMPTS[:4])
    # token-id prompts, one at a time and streamed
    ids = served.tok.encode(PROMPTS[4])
    stream = served.client.completions.create(model=served.name, prompt=ids, stream=True,
                                              max_tokens=MAX_TOKENS, temperature=0,
                                              stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == served.text(PROMPTS[4])
    assert len(chunks) > 3  # streamed as accepted, not in one piece
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        served.refs[PROMPTS[4]])


def test_chat_streaming_and_n(served):
    r = served.client.chat.completions.create(model=served.name, messages=MESSAGES, n=2,
                                              max_tokens=MAX_TOKENS, temperature=0)
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.message.role == "assistant" and c.message.content == served.text("<chat>")
    stream = served.client.chat.completions.create(model=served.name, messages=MESSAGES,
                                                   max_completion_tokens=MAX_TOKENS,
                                                   temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == served.text("<chat>")
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # sampled choices: n of them, each its own stream
    r = served.client.completions.create(model=served.name, prompt=PROMPTS[0], n=3, seed=7,
                                         max_tokens=12, temperature=1.0,
                                         extra_body={"top_k": 40})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert 3 <= r.usage.completion_tokens <= 3 * 12
    # the same seeded request again: the same samples (choice i samples stream i)
    again = served.client.completions.create(model=served.name, prompt=PROMPTS[0], n=3, seed=7,
                                             max_tokens=12, temperature=1.0,
                                             extra_body={"top_k": 40})
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    assert len(set(texts)) > 1  # the n choices are distinct streams


def test_stop_strings_cut_exactly(served):
    p = PROMPTS[0]
    full = served.text(p)
    stop = full[6:9]
    want = full[: full.index(stop)]
    r = served.client.completions.create(model=served.name, prompt=p, max_tokens=MAX_TOKENS,
                                         temperature=0, stop=[stop, "never appears"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    stream = served.client.completions.create(model=served.name, prompt=p, stream=True,
                                              max_tokens=MAX_TOKENS, temperature=0, stop=stop)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop token id: the text before it, the token counted
    ref = served.refs[p]
    k = 5
    r = served.client.completions.create(model=served.name, prompt=p, max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={"stop_token_ids": [ref[k]]})
    first = ref.index(ref[k])
    assert r.choices[0].text == served.tok.decode(ref[:first])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1
    _idle(served)
    assert _all_pages_free(served)


# --- concurrency and disconnects ---------------------------------------------------------
def test_64_streams_with_a_fifth_disconnecting(served):
    rng = random.Random(0)
    plan = [(PROMPTS[i % len(PROMPTS)], rng.random() < 0.2) for i in range(64)]
    assert any(leave for _, leave in plan)

    async def run() -> list[str | None]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one_stream(client, served.url, served.name, p, leave, STREAM_TOKENS)
                                          for p, leave in plan))

    before = len(served.log.records)
    results = asyncio.run(run())
    for (p, leave), got in zip(plan, results, strict=True):
        if not leave:
            assert got == served.text(p, STREAM_TOKENS), p
    _idle(served)
    assert _all_pages_free(served)
    assert served.log.tracebacks() == [] and len(served.log.records) >= before
    metrics = httpx.get(served.url + "/metrics").text
    assert 'graphdraft_choices_finished_total{reason="abort"}' in metrics


def test_sampling_controls_equal_engine_generate(served):
    """OpenAI's frequency / presence penalties and logit_bias, vLLM's repetition_penalty and
    min_p: the served text is `Engine.generate`'s under the same SamplingParams (and differs
    from the plain greedy text)."""
    p, n = PROMPTS[0], 12
    ids = served.tok.encode(p)
    space = served.tok.encode(" ")[0]
    r = served.client.completions.create(
        model=served.name, prompt=p, max_tokens=n, temperature=0, frequency_penalty=0.8,
        presence_penalty=0.4, logit_bias={str(space): -100},
        extra_body={"repetition_penalty": 1.3, "min_p": 0.05})
    params = SamplingParams(max_new_tokens=n, stop_token_ids=tuple(served.stops),
                            frequency_penalty=0.8, presence_penalty=0.4,
                            logit_bias={space: -100}, repetition_penalty=1.3, min_p=0.05)
    want = served.ref_engine.generate([ids], params)[0]
    assert space not in want
    text = served.tok.decode(want[:-1] if want[-1] in served.stops else want)
    assert r.choices[0].text == text
    assert text != served.text(p, n)


# --- bad requests ------------------------------------------------------------------------
C, CH = "/v1/completions", "/v1/chat/completions"
OK = {"prompt": "x", "max_tokens": 4}
MSG = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [
    (C, b"{not json", 400, None, "invalid_json"),
    (C, b"[1, 2]", 400, None, "invalid_type"),
    (C, OK | {"max_tokens": "10"}, 400, "max_tokens", "invalid_type"),
    (C, OK | {"temperature": "hot"}, 400, "temperature", "invalid_type"),
    (C, OK | {"stream": "yes"}, 400, "stream", "invalid_type"),
    (C, OK | {"n": 1.5}, 400, "n", "invalid_type"),
    (C, OK | {"stop": [1]}, 400, "stop", "invalid_type"),
    (C, OK | {"top_p": 0}, 400, "top_p", "invalid_value"),
    (C, OK | {"top_p": 1.5}, 400, "top_p", "invalid_value"),
    (C, OK | {"temperature": -1}, 400, "temperature", "invalid_value"),
    (C, OK | {"max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    (C, OK | {"top_k": -5}, 400, "top_k", "invalid_value"),
    (C, OK | {"n": 0}, 400, "n", "invalid_value"),
    (C, OK | {"n": 1000}, 400, "n", "invalid_value"),
    (C, OK | {"model": "gpt-4"}, 404, "model", "model_not_found"),
    (C, OK | {"prompt": ""}, 400, "prompt", "invalid_value"),
    (C, OK | {"prompt": []}, 400, "prompt", "invalid_value"),
    (C, OK | {"prompt": [99999]}, 400, "prompt", "invalid_value"),
    (C, {"max_tokens": 4}, 400, "prompt", "missing_required_parameter"),
    (C, OK | {"foo": 1}, 400, "foo", "unknown_parameter"),
    (C, OK | {"repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value"),
    (C, OK | {"min_p": "a"}, 400, "min_p", "invalid_type"),
    (C, OK | {"min_p": 1.5}, 400, "min_p", "invalid_value"),
    (C, OK | {"logprobs": 21}, 400, "logprobs", "invalid_value"),
    (C, OK | {"logprobs": "2"}, 400, "logprobs", "invalid_type"),
    (CH, MSG | {"top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    (CH, MSG | {"logprobs": True, "top_logprobs": -1}, 400, "top_logprobs", "invalid_value"),
    (CH, MSG | {"logprobs": 1}, 400, "logprobs", "invalid_type"),
    (C, OK | {"include_stop_str_in_output": "yes"}, 400, "include_stop_str_in_output",
     "invalid_type"),
    (C, OK | {"presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value"),
    (C, OK | {"frequency_penalty": "x"}, 400, "frequency_penalty", "invalid_type"),
    (C, OK | {"echo": 1}, 400, "echo", "invalid_type"),
    (C, OK | {"logit_bias": {"x": 10}}, 400, "logit_bias", "invalid_value"),
    (C, OK | {"logit_bias": {"5": 101}}, 400, "logit_bias", "invalid_value"),
    (C, OK | {"logit_bias": [5]}, 400, "logit_bias", "invalid_type"),
    (C, OK | {"logit_bias": {"99999": 1}}, 400, "logit_bias", "invalid_value"),
    (C, OK | {"stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value"),
    (C, OK | {"max_tokens": 1000}, 400, "max_tokens", "context_length_exceeded"),
    (C, OK | {"stop_token_ids": [1, 2, 3, 4, 5]}, 400, "stop_token_ids", "invalid_value"),
    (CH, MSG | {"messages": []}, 400, "messages", "invalid_value"),
    (CH, MSG | {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role",
     "invalid_value"),
    (CH, MSG | {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
     "invalid_type"),
    (CH, MSG | {"tools": [{"type": "function"}]}, 400, "tools", "unsupported_parameter"),
    (CH, MSG | {"prompt": "x"}, 400, "prompt", "unknown_parameter"),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD,
                         ids=[f"{i}-{b if isinstance(b, bytes) else sorted(b)[-1]}"
                              for i, (_, b, *_rest) in enumerate(BAD)])
def test_bad_requests_answer_the_openai_error_format(served, path, body, status, param, code):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(served.url + path, headers={"content-type": "application/json"}, timeout=30,
                   **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == code, err
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["message"].startswith(param.split("[")[0]), err["message"]


def test_the_server_serves_on_after_bad_requests(served):
    assert httpx.get(served.url + "/v1/nothing").status_code == 404
    assert httpx.get(served.url + C).status_code == 405
    r = served.client.completions.create(model=served.name, prompt=PROMPTS[1], temperature=0,
                                         max_tokens=MAX_TOKENS)
    assert r.choices[0].text == served.text(PROMPTS[1])
    _idle(served)
    assert _all_pages_free(served)


def test_full_queue_answers_503(served):
    engine = served.engine
    capacity, engine.capacity = engine.capacity, 0
    try:
        r = httpx.post(served.url + C, json=OK, timeout=30)
    finally:
        engine.capacity = capacity
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "server_error"
    assert httpx.post(served.url + C, json=OK, timeout=30).status_code == 200


def test_metrics_are_prometheus_text(served):
    assert httpx.post(served.url + C, json=OK | {"n": 0}, timeout=30).status_code == 400
    assert httpx.post(served.url + C, json=OK, timeout=30).status_code == 200
    _idle(served)
    text = httpx.get(served.url + "/metrics").text
    for name in ("graphdraft_requests_total", "graphdraft_prompt_tokens_total",
                 "graphdraft_generation_tokens_total",
                 "graphdraft_time_to_first_token_seconds_bucket",
                 "graphdraft_inter_token_latency_seconds_bucket",
                 "graphdraft_accept_length_bucket", "graphdraft_graph_replays_total",
                 "graphdraft_eager_runs_total", "graphdraft_queue_depth",
                 "graphdraft_kv_pages_used", "graphdraft_running_requests"):
        assert name in text, name
    assert 'graphdraft_requests_total{endpoint="completions",status="400"}' in text
    values = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("graphdraft_") and "{" not in line}
    assert values["graphdraft_kv_pages_used"] == 0.0  # the engine process's state, after
    assert values["graphdraft_kv_pages_total"] > 0    # the requests above
    assert values["graphdraft_engine_steps_total"] > 0
    assert values["graphdraft_accept_length_count"] > 0


def test_the_load_generator_against_the_server(served):
    """perf/serve.py's closed-loop client: every request counted, a leaver not failed."""
    from perf.serve import bodies_for, closed_loop, summarize
    prompts = [served.tok.encode(p) for p in PROMPTS]
    bodies = bodies_for(prompts, 6, max_tokens=6)
    leave = [None, 1, None, None, None, None]
    t0 = time.monotonic()
    res = asyncio.run(closed_loop(served.url, bodies, leave, concurrency=3))
    row = summarize(3, [{"wall_s": time.monotonic() - t0, "results": res}])
    assert row["requests"] == 6 and row["failed"] == 0, row
    assert sum(1 for r in res if r.get("left")) == 1
    assert all(r["tokens"] == 6 for r in res if not r.get("left"))
    _idle(served)
    assert _all_pages_free(served)


def test_limits_check_like_the_engine(served):
    """The HTTP process's `EngineLimits` (sent by the engine process) accept and reject
    exactly what `Engine.check_request` does, with the same messages."""
    from graphdraft.serving.limits import EngineLimits
    ref = served.ref_engine
    limits = served.engine.limits
    assert limits == EngineLimits.of(ref)
    rng = random.Random(1)
    vocab = limits.vocab_size
    cases = [([], SamplingParams()), ([vocab], SamplingParams()), ([1, 2], SamplingParams()),
             ([1] * 10, SamplingParams(stop_token_ids=(1, 2, 3, 4, 5))),
             ([1] * 10, SamplingParams(stop_token_ids=(1, 2, 3), ignore_eos=True))]
    for _ in range(200):
        n = rng.choice([1, 5, 100, 200, 255, 256, 300, 600, 2000])
        prompt = [rng.randrange(vocab) for _ in range(n)]
        stops = tuple(rng.sample(range(vocab), rng.randrange(0, 6)))
        cases.append((prompt, SamplingParams(max_new_tokens=rng.choice([1, 16, 200, 1000, 4000]),
                                             stop_token_ids=stops,
                                             ignore_eos=rng.random() < 0.3)))
    verdicts = set()
    for prompt, params in cases:
        want = got = None
        try:
            ref.check_request(prompt, params)
        except ValueError as e:
            want = str(e)
        try:
            limits.check(prompt, params)
        except ValueError as e:
            got = str(e)
        assert got == want, (len(prompt), params)
        verdicts.add(want is None)
    assert verdicts == {True, False}


def test_the_engine_core_steps_on_while_nobody_reads(served):
    """`EngineCore` over an Engine of this process (in a thread), its socket's buffers at
    their smallest and the reading end left unread: the Engine serves every request to the
    end anyway (the outputs merge while the socket is backed up); read afterwards, each
    request's ids (from fewer messages than steps) equal `Engine.generate`'s."""
    import dataclasses
    import socket
    import threading as th

    from graphdraft.serving.openai_api.engine_core import EngineCore
    from graphdraft.serving.openai_api.wire import FrameReader, encode

    ours, theirs = socket.socketpair()
    for s, opt in ((theirs, socket.SO_SNDBUF), (ours, socket.SO_RCVBUF)):
        s.setsockopt(socket.SOL_SOCKET, opt, 1)  # the kernel's minimum
    theirs.setblocking(False)
    engine = served.ref_engine
    core = EngineCore(engine, theirs)
    params = SamplingParams(max_new_tokens=MAX_TOKENS, stop_token_ids=served.stops)
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    keys = [*PROMPTS, *PROMPTS]
    ours.sendall(encode(("add", [(i, served.tok.encode(p), fields, None)
                                 for i, p in enumerate(keys)])))
    thread = th.Thread(target=core.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while core.steps == 0 or engine.has_work or core.live:  # nothing read meanwhile
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    assert core.outbox or core.outputs  # backed up: the outputs waited, the Engine did not
    ours.setblocking(False)
    reader, got, finish, frames = FrameReader(ours), {}, {}, 0
    while len(finish) < len(keys):
        assert time.monotonic() < deadline
        for _kind, outputs, _state in (m for m in reader.read() if m[0] == "out"):
            frames += bool(outputs)
            for rid, ids, fin, *_scores in outputs:
                got.setdefault(rid, []).extend(ids)
                if fin is not None:
                    finish[rid] = fin
        time.sleep(0.005)
    ours.sendall(encode(("exit",)))
    thread.join(10)
    assert not thread.is_alive()
    for rid, key in enumerate(keys):
        assert got[rid] == served.refs[key], key
        assert finish[rid] == ("stop" if served.refs[key][-1] in served.stops else "length")
    assert frames < core.steps
    ours.close()
    theirs.close()
