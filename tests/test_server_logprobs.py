"""Log-probabilities and exact stop strings through `graphdraft serve` (issue #43 items 1 and 4),
with the real `openai` client and raw HTTP against one server (tests/server_harness.py; the
shipped pair, speculative, on the CPU): `/v1/completions` `logprobs` (the legacy body) and
`/v1/chat/completions` `logprobs` + `top_logprobs` (the chat body), streamed and not, equal a
target-only `Engine` in this process over the same tokens; a stop string across token
boundaries leaves no token, text or log-probability after it, and
`include_stop_str_in_output` returns it. Bad values: tests/test_server.py's table."""

from __future__ import annotations

import json

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

PROMPT = "def main():\n"
MESSAGES = [{"role": "user", "content": "print a list"}]
MAX_TOKENS = 16
TOL = 1e-5


class Served(ServedBase):
    """The server, with target-only references (ids and log-probabilities, width 3) built in
    this process while the engine process starts."""

    def __init__(self) -> None:
        super().__init__(meanwhile=self._references)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=120)

    def _references(self):
        a = build_parser().parse_args(["serve", "--device", "cpu", "--quiet"])
        m = models.load(a)
        tok = m.tokenizer
        ref = Engine(m.target, m.cfg, None, eos_token_id=m.eos)  # target-only
        prompts = [tok.encode(PROMPT), tok.encode(tok.apply_chat_template(MESSAGES))]
        params = SamplingParams(max_new_tokens=MAX_TOKENS, stop_token_ids=tuple(m.stops),
                                logprobs=3)
        self.refs = dict(zip(("completion", "chat"), ref.generate_requests(prompts, params),
                             strict=True))

    def token(self, i: int) -> str:
        return self.tok.decode([i], skip_special_tokens=False)

    def kept(self, key: str) -> list[int]:
        """The reference's ids that carry text (a final stop id has none)."""
        out = self.refs[key].output
        return out[:-1] if out and out[-1] in self.stops else out


@pytest.fixture(scope="module")
def served():
    s = Served()
    yield s
    s.stop()


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


def test_completions_logprobs_legacy_body(served):
    ref = served.refs["completion"]
    ids = served.kept("completion")
    r = served.client.completions.create(model=served.name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                         temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [served.token(i) for i in ids]
    assert all(_close(a, b) for a, b in zip(lp.token_logprobs, ref.logprobs, strict=False))
    assert len(lp.token_logprobs) == len(ids)
    for top, want in zip(lp.top_logprobs, ref.top_logprobs, strict=False):
        assert list(top) == [served.token(i) for i, _ in want]  # best first, 3 of them
        assert all(_close(top[served.token(i)], v) for i, v in want)
    text = r.choices[0].text
    assert lp.text_offset == [len(served.tok.decode(ids[:k])) for k in range(len(ids))]
    assert "".join(lp.tokens) == text
    # streamed: the same entries, spread over the chunks with their text
    chunks = list(served.client.completions.create(model=served.name, prompt=PROMPT, stream=True,
                                                   max_tokens=MAX_TOKENS, temperature=0,
                                                   logprobs=3))
    got = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((g.tokens for g in got), []) == lp.tokens
    assert sum((g.text_offset for g in got), []) == lp.text_offset
    assert sum((g.token_logprobs for g in got), []) == lp.token_logprobs


def test_chat_logprobs_body_streamed_and_not(served):
    ref = served.refs["chat"]
    ids = served.kept("chat")
    r = served.client.chat.completions.create(model=served.name, messages=MESSAGES,
                                              max_tokens=MAX_TOKENS, temperature=0,
                                              logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [served.token(i) for i in ids]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert all(_close(c.logprob, v) for c, v in zip(content, ref.logprobs, strict=False))
    for c, want in zip(content, ref.top_logprobs, strict=False):
        assert [t.token for t in c.top_logprobs] == [served.token(i) for i, _ in want[:2]]
    chunks = list(served.client.chat.completions.create(
        model=served.name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]
    # logprobs without top_logprobs: the token's own, no alternatives; not asked: null
    r = served.client.chat.completions.create(model=served.name, messages=MESSAGES,
                                              max_tokens=4, temperature=0, logprobs=True)
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)
    r = served.client.chat.completions.create(model=served.name, messages=MESSAGES,
                                              max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


def test_stop_string_across_tokens_cuts_text_tokens_and_logprobs(served):
    ids = served.kept("completion")
    full = served.tok.decode(ids)
    # a stop string over three tokens (inside one token: tests/test_stop_strings.py)
    starts = [len(served.tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    stop = full[4:7]
    at = full.index(stop)
    end = next(k for k in range(len(ids) + 1) if starts[k] >= at + len(stop))
    for include, want in ((False, full[:at]), (True, full[: at + len(stop)])):
        body = {"model": served.name, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                "temperature": 0, "logprobs": 1, "stop": [stop],
                "include_stop_str_in_output": include}
        r = httpx.post(served.url + "/v1/completions", json=body, timeout=120).json()
        c = r["choices"][0]
        assert c["text"] == want and c["finish_reason"] == "stop"
        assert c["logprobs"]["tokens"] == [served.token(i) for i in ids[:end]]
        assert r["usage"]["completion_tokens"] == end
        text = ""
        with httpx.stream("POST", served.url + "/v1/completions", json=body | {"stream": True},
                          timeout=120) as resp:
            lines = [x[6:] for x in resp.iter_lines() if x.startswith("data: {")]
        chunks = [json.loads(x)["choices"][0] for x in lines]
        text = "".join(ch["text"] for ch in chunks)
        toks = [t for ch in chunks if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
        assert text == want and toks == [served.token(i) for i in ids[:end]]
    served.idle()
    assert served.all_pages_free()
