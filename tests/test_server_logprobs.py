"""Log-probabilities and exact stop strings through `graphdraft serve` (issue #43 items 1 and 4),
with the real `openai` client and raw HTTP against one server (tests/server_harness.py; the
shipped pair, speculative, on the CPU): `/v1/completions` `logprobs` (the legacy body) and
`/v1/chat/completions` `logprobs` + `top_logprobs` (the chat body), streamed and not, equal a
target-only `Engine` in this process over the same tokens; a stop string across token
boundaries leaves no token, text or log-probability after it, and
`include_stop_str_in_output` returns it. `prompt_logprobs` (vLLM's body: per prompt token
{id: {logprob, rank, decoded_token}}) and `/v1/completions` `echo` equal a plain torch
log_softmax of the prompt's logits, ranks included. Bad values: tests/test_server.py's table
and `BAD_PROMPT_LOGPROBS` here."""

from __future__ import annotations

import json

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import graphdraft.serving.cli.models as models  # noqa: E402
from graphdraft.serving.cli import build_parser  # noqa: E402
from graphdraft.serving.engine import Engine  # noqa: E402
from graphdraft.serving.verify import SamplingParams  # noqa: E402
from tests.checkpoint_fixtures import full_logits  # noqa: E402
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
        # the prompts' log-probabilities: a plain log_softmax of one forward over each prompt
        self.prompt_lsm = {key: (ids, torch.log_softmax(full_logits(m.target, ids).double(), -1))
                           for key, ids in zip(("completion", "chat"), prompts, strict=True)}

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


# --- prompt_logprobs and echo -------------------------------------------------------------
def _post(served, path: str, body: dict) -> dict:
    r = httpx.post(served.url + path, json={"model": served.name, "temperature": 0} | body,
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _check_prompt_logprobs(served, key: str, got: list, width: int) -> None:
    """vLLM's shape; each token's entry == the reference log_softmax (value and rank), its
    alternatives the `width` best (ranks 1, 2, ...)."""
    ids, lsm = served.prompt_lsm[key]
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        row, tok = lsm[i - 1], ids[i]
        entry = got[i]
        own = entry[str(tok)]
        assert set(own) == {"logprob", "rank", "decoded_token"}
        assert _close(own["logprob"], float(row[tok]))
        assert own["rank"] == 1 + int((row > row[tok]).sum()), i
        assert own["decoded_token"] == served.token(tok)
        best = torch.sort(row, descending=True, stable=True).indices[:width].tolist()
        assert list(entry)[0] == str(tok)  # the prompt token first, then the best
        assert [int(t) for t in entry if int(t) != tok] == [t for t in best if t != tok]
        for rank, t in enumerate(best, 1):
            assert _close(entry[str(t)]["logprob"], float(row[t]))
            assert entry[str(t)]["rank"] == rank
    ranks = [got[i][str(ids[i])]["rank"] for i in range(1, len(ids))]
    assert min(ranks) == 1 and max(ranks) > width  # both kinds were checked


def test_completions_prompt_logprobs_equal_log_softmax_with_ranks(served):
    body = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                            "prompt_logprobs": 2})
    c = body["choices"][0]
    _check_prompt_logprobs(served, "completion", c["prompt_logprobs"], 2)
    assert c["logprobs"] is None  # not asked
    # width 0: the prompt token alone; a batch: each choice its own prompt's
    second = "x = [1, 2]\n"
    body = _post(served, "/v1/completions", {"prompt": [PROMPT, second], "max_tokens": 2,
                                            "prompt_logprobs": 0})
    first, other = (c["prompt_logprobs"] for c in body["choices"])
    ids = served.prompt_lsm["completion"][0]
    assert [list(e) for e in first[1:]] == [[str(t)] for t in ids[1:]]
    assert len(other) == len(served.tok.encode(second))
    # not asked: no prompt_logprobs key
    assert "prompt_logprobs" not in _post(served, "/v1/completions",
                                          {"prompt": PROMPT, "max_tokens": 2})["choices"][0]


def test_chat_prompt_logprobs_beside_the_choices(served):
    """vLLM puts the chat prompt's log-probabilities in the response, beside the choices;
    the openai client keeps the field."""
    r = served.client.chat.completions.create(model=served.name, messages=MESSAGES, max_tokens=3,
                                              temperature=0, n=2,
                                              extra_body={"prompt_logprobs": 3})
    got = r.model_extra["prompt_logprobs"]
    _check_prompt_logprobs(served, "chat", got, 3)
    assert all("prompt_logprobs" not in (c.model_extra or {}) for c in r.choices)


def test_echo_returns_the_prompt_first_with_its_logprobs(served):
    ids, lsm = served.prompt_lsm["completion"]
    plain = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                             "logprobs": 2})["choices"][0]
    echo = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                            "logprobs": 2, "echo": True})["choices"][0]
    assert echo["text"] == PROMPT + plain["text"]
    lp, n = echo["logprobs"], len(ids)
    assert lp["tokens"] == [served.token(t) for t in ids] + plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, n):
        assert _close(lp["token_logprobs"][i], float(lsm[i - 1, ids[i]]))
        best = torch.sort(lsm[i - 1], descending=True, stable=True).indices[:2].tolist()
        assert list(lp["top_logprobs"][i]) == [served.token(t) for t in best]
    assert lp["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    assert lp["text_offset"] == [len(served.tok.decode(ids[:k])) for k in range(n)] + [
        len(PROMPT) + o for o in plain["logprobs"]["text_offset"]]
    assert len(echo["prompt_logprobs"]) == n  # prompt_logprobs defaults to logprobs
    # without logprobs: the text alone
    bare = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                            "echo": True})
    assert bare["choices"][0]["text"] == PROMPT + plain["text"]
    assert bare["choices"][0]["logprobs"] is None


def test_echo_with_max_tokens_0_scores_the_prompt_alone(served):
    """The log-likelihood request of evaluation harnesses: the prompt's tokens and their
    log-probabilities, no completion."""
    ids, lsm = served.prompt_lsm["completion"]
    body = _post(served, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True,
                                            "logprobs": 1})
    c = body["choices"][0]
    assert c["text"] == served.tok.decode(ids) and c["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                             "total_tokens": len(ids)}
    got = c["logprobs"]["token_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    assert all(_close(got[i], float(lsm[i - 1, ids[i]])) for i in range(1, len(ids)))
    served.idle()
    assert served.all_pages_free()


BAD_PROMPT_LOGPROBS = [
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs", "invalid_value"),
    ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs", "invalid_value"),
    ("/v1/completions", {"prompt_logprobs": "2"}, "prompt_logprobs", "invalid_type"),
    ("/v1/completions", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs",
     "invalid_value"),
    ("/v1/completions", {"echo": True, "stream": True}, "echo", "invalid_value"),
    ("/v1/completions", {"echo": "yes"}, "echo", "invalid_type"),
    ("/v1/completions", {"echo": True, "logprobs": 21}, "logprobs", "invalid_value"),
    ("/v1/chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs", "invalid_value"),
    ("/v1/chat/completions", {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs",
     "invalid_value"),
    ("/v1/chat/completions", {"echo": True}, "echo", "unknown_parameter"),
]


@pytest.mark.parametrize("path, extra, param, code", BAD_PROMPT_LOGPROBS,
                         ids=[f"{i}-{sorted(b)[0]}" for i, (_, b, *_r) in
                              enumerate(BAD_PROMPT_LOGPROBS)])
def test_bad_prompt_logprobs_and_echo_values_name_the_field(served, path, extra, param, code):
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    r = httpx.post(served.url + path, json={"model": served.name, "max_tokens": 2} | base | extra,
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err
    assert err["message"].startswith(param + ":"), err["message"]
