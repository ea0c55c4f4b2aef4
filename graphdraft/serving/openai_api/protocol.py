"""The OpenAI API's request and response bodies: parsing, checking, building.

`parse_request(body, chat=...)` turns a decoded JSON body of `/v1/completions` or
`/v1/chat/completions` into a `GenerationRequest`, or raises `ApiError` naming the field
(`param`) and what was expected. Every field is known: a field this server does not know is
rejected (`unknown_parameter`), and a known one it does not implement
(`suffix`, `best_of`, tools, ...) is rejected unless
it has its neutral value, since ignoring it would change what the client gets without saying
so. Fields that change nothing the model returns (`user`, `metadata`, `store`,
`service_tier`, `parallel_tool_calls`) are accepted and ignored.

Sampling controls: OpenAI's `frequency_penalty` and `presence_penalty` (-2..2, on the output's
tokens) and `logit_bias` (an object of token id -> bias in [-100, 100], at most 300 entries,
ids within the vocabulary), and vLLM's `repetition_penalty` (> 0, on prompt and output
tokens) and `min_p` (0..1): `SamplingParams`' fields of the same names, exact under
speculation (`graphdraft.sampling`'s note).

Extensions beside OpenAI's fields (as vLLM names them): `top_k` (0 or -1: off),
`stop_token_ids` (token ids that end a choice), `ignore_eos` and `include_stop_str_in_output`
(return the stop string that ended a choice).

Log-probabilities: `/v1/completions` `logprobs` (an int in [0, 20]: each token's
log-probability and that many alternatives, the legacy body `tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`); `/v1/chat/completions` `logprobs: true` and `top_logprobs`
(0..20; the body `content: [{token, logprob, bytes, top_logprobs}]`). Both become
`SamplingParams.logprobs` (values: `graphdraft.sampling.MAX_LOGPROBS`' note); a token's
`token` is its own decoded text, `bytes` that text's UTF-8 bytes.

Prompt log-probabilities (vLLM's extension, both endpoints, not with `stream`):
`prompt_logprobs` (an int in [0, 20]) returns, per prompt token, a map token id -> {logprob,
rank, decoded_token} holding the prompt token (its rank: 1 + the vocabulary entries with a
strictly larger log-probability) and the `prompt_logprobs` likeliest tokens (ranks 1, 2, ...
as they rank), None for the first token (`prompt_logprobs_body`): in each choice of
`/v1/completions`, beside the choices of `/v1/chat/completions` (one prompt), as vLLM does.
`/v1/completions` `echo: true` (not with `stream`) returns the prompt before the completion:
its text first, and with `logprobs` its tokens' entries first (the first token's null, as
OpenAI and vLLM do; `prompt_logprobs` defaults to `logprobs` then); `max_tokens: 0` with echo
scores the prompt alone (no completion, `completion_tokens` 0), as log-likelihood
evaluations ask.

Ranges of the sampling fields are checked by `SamplingParams` itself (`sampling_params`),
so the server and the library accept the same values; its field names map to the API's
(`max_new_tokens` -> `max_tokens`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphdraft.sampling import MAX_LOGPROBS
from graphdraft.serving.verify import SamplingParams

MAX_N = 128
"""Largest `n` (choices per prompt)."""
MAX_CHOICES = 256
"""Largest number of engine requests one HTTP request may start (prompts x n)."""
MAX_STOP_STRINGS = 16

# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered in the OpenAI format: `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(param: str, expected: str, got: Any, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: expected {expected}, got {_show(got)}", param=param, code=code)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------------
# Field types (JSON level)
# ---------------------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _typed(check: Callable[[Any], bool], expected: str) -> Callable[[str, Any], Any]:
    def parse(name: str, v: Any) -> Any:
        if v is not None and not check(v):
            raise invalid(name, expected, v, code="invalid_type")
        return v
    return parse


_INT = _typed(_is_int, "an integer")
_NUMBER = _typed(_is_number, "a number")
_BOOL = _typed(lambda v: isinstance(v, bool), "true or false")
_STRING = _typed(lambda v: isinstance(v, str), "a string")
_ANY = _typed(lambda v: True, "anything")
_OBJECT = _typed(lambda v: isinstance(v, Mapping), "an object")


def _neutral(*allowed: Any, what: str) -> Callable[[str, Any], Any]:
    """A field this server does not implement: only its neutral values are accepted."""
    def parse(name: str, v: Any) -> Any:
        if v is None or any(type(v) is type(a) and v == a for a in allowed):
            return v
        raise ApiError(400, f"{name}: not supported by this server (expected {what}), got "
                       f"{_show(v)}", param=name, code="unsupported_parameter")
    return parse


def _stop(name: str, v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid(name, "a string or a list of strings", v, code="invalid_type")
    if not all(stops) or len(stops) > MAX_STOP_STRINGS:
        raise invalid(name, f"at most {MAX_STOP_STRINGS} non-empty strings", v)
    return tuple(dict.fromkeys(stops))


def _token_list(name: str, v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise invalid(name, "a list of token ids (integers)", v, code="invalid_type")
    if any(t < 0 for t in v):
        raise invalid(name, "token ids >= 0", v)
    return tuple(v)


def _stream_options(name: str, v: Any) -> bool:
    if v is None:
        return False
    if not isinstance(v, Mapping):
        raise invalid(name, "an object such as {\"include_usage\": true}", v, code="invalid_type")
    unknown = sorted(set(v) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise ApiError(400, f"{name}.{unknown[0]}: unknown field; expected include_usage",
                       param=f"{name}.{unknown[0]}", code="unknown_parameter")
    inc = v.get("include_usage", False)
    if not isinstance(inc, bool):
        raise invalid(f"{name}.include_usage", "true or false", inc, code="invalid_type")
    return inc


def _logprobs_width(name: str, v: Any) -> int | None:
    """An int in [0, MAX_LOGPROBS] or null (`logprobs` of completions, `top_logprobs`)."""
    if v is None:
        return None
    if not _is_int(v):
        raise invalid(name, "an integer or null", v, code="invalid_type")
    if not 0 <= v <= MAX_LOGPROBS:
        raise invalid(name, f"an integer in [0, {MAX_LOGPROBS}]", v)
    return v


def _logprobs_asked(chat: bool, v: dict[str, Any]) -> int | None:
    """`SamplingParams.logprobs` of a parsed body (None: not asked)."""
    if not chat:
        return v.get("logprobs")
    top = v.get("top_logprobs")
    if top is not None and not v.get("logprobs"):
        raise ApiError(400, "top_logprobs: only allowed with logprobs: true",
                       param="top_logprobs", code="invalid_value")
    return (top or 0) if v.get("logprobs") else None


def _echo(v: dict[str, Any], max_tokens: int | None) -> tuple[bool, bool]:
    """(echo, score only) of a parsed body; `prompt_logprobs` and `echo` are refused with
    `stream` (vLLM refuses the first too: the prompt's scores come whole)."""
    asked = {"prompt_logprobs": v.get("prompt_logprobs") is not None, "echo": bool(v.get("echo"))}
    for name, on in asked.items():
        if on and v.get("stream"):
            raise ApiError(400, f"{name}: not available with stream: true", param=name,
                           code="invalid_value")
    echo = bool(v.get("echo"))
    return echo, echo and max_tokens == 0


def _response_format(name: str, v: Any) -> Any:
    if v is None or (isinstance(v, Mapping) and dict(v) == {"type": "text"}):
        return v
    raise ApiError(400, f"{name}: only {{\"type\": \"text\"}} is supported, got {_show(v)}",
                   param=name, code="unsupported_parameter")


COMMON_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "model": _STRING, "max_tokens": _INT, "temperature": _NUMBER, "top_p": _NUMBER,
    "top_k": _INT, "n": _INT, "stream": _BOOL, "stream_options": _stream_options,
    "stop": _stop, "stop_token_ids": _token_list, "ignore_eos": _BOOL, "seed": _INT,
    "presence_penalty": _NUMBER, "frequency_penalty": _NUMBER, "repetition_penalty": _NUMBER,
    "min_p": _NUMBER, "logit_bias": _OBJECT,
    "user": _STRING, "metadata": _OBJECT, "store": _BOOL, "service_tier": _STRING,
    "include_stop_str_in_output": _BOOL, "prompt_logprobs": _logprobs_width,
}
"""Fields of both endpoints -> their parser (raises ApiError naming the field)."""

COMPLETION_FIELDS = COMMON_FIELDS | {
    "prompt": _ANY, "echo": _BOOL, "suffix": _neutral(what="null"),
    "best_of": _neutral(1, what="1 or null"), "logprobs": _logprobs_width,
}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages": _ANY, "max_completion_tokens": _INT, "logprobs": _BOOL,
    "top_logprobs": _logprobs_width, "response_format": _response_format,
    "tools": _neutral([], what="an empty list or null"),
    "tool_choice": _neutral("none", "auto", what="'none', 'auto' or null"),
    "parallel_tool_calls": _BOOL,
}


# ---------------------------------------------------------------------------------------
# The parsed request
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationRequest:
    """One HTTP request's generation: prompts (completions: text or token ids, one per prompt;
    chat: the messages, rendered by the server's chat template), how many choices each, and
    the sampling fields (`max_tokens` None: the largest that fits the context)."""

    chat: bool
    model: str | None
    prompts: tuple[str | tuple[int, ...], ...] = ()
    messages: tuple[dict[str, Any], ...] = ()
    n: int = 1
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    """SamplingParams fields other than max_new_tokens (temperature, top_p, top_k, seed,
    stop_token_ids, ignore_eos, the penalties, min_p, logit_bias, logprobs, ...)."""
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    """Completions: the prompt returned before the completion (its text, its tokens' logprobs)."""
    score_only: bool = False
    """echo with max_tokens 0: the prompt alone is returned (one token is generated, unused)."""

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"


def parse_request(body: Any, *, chat: bool) -> GenerationRequest:
    """A decoded JSON body -> GenerationRequest; ApiError (400) naming the first bad field."""
    if not isinstance(body, Mapping):
        raise ApiError(400, f"body: expected a JSON object, got {type(body).__name__}",
                       param=None, code="invalid_type")
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name not in fields:
            raise ApiError(400, f"{name}: unknown parameter; this endpoint accepts "
                           f"{', '.join(sorted(fields))}", param=name, code="unknown_parameter")
    v = {name: fields[name](name, value) for name, value in body.items()}
    required = "messages" if chat else "prompt"
    if body.get(required) is None:
        raise ApiError(400, f"{required}: required", param=required,
                       code="missing_required_parameter")
    if v.get("stream_options") and not v.get("stream"):
        raise ApiError(400, "stream_options: only allowed with stream: true",
                       param="stream_options", code="invalid_value")
    n = 1 if v.get("n") is None else v["n"]
    if not 1 <= n <= MAX_N:
        raise invalid("n", f"an integer in [1, {MAX_N}]", n)
    max_tokens = v.get("max_tokens")
    if chat and v.get("max_completion_tokens") is not None:
        max_tokens = v["max_completion_tokens"]
    echo, score_only = _echo(v, max_tokens)
    max_tokens = 1 if score_only else max_tokens
    prompts = () if chat else parse_prompts(body["prompt"])
    if len(prompts) * n > MAX_CHOICES:
        raise invalid("n", f"prompts x n <= {MAX_CHOICES}", f"{len(prompts)} x {n}")
    top_k = v.get("top_k")
    sampling = {
        "temperature": 1.0 if v.get("temperature") is None else v["temperature"],
        "top_p": 1.0 if v.get("top_p") is None else v["top_p"],
        "top_k": 0 if top_k is None or top_k == -1 else top_k,
        "seed": v.get("seed"),
        "stop_token_ids": v.get("stop_token_ids", ()),
        "ignore_eos": bool(v.get("ignore_eos")),
        "frequency_penalty": v.get("frequency_penalty") or 0.0,
        "presence_penalty": v.get("presence_penalty") or 0.0,
        "repetition_penalty": 1.0 if v.get("repetition_penalty") is None
        else v["repetition_penalty"],
        "min_p": v.get("min_p") or 0.0,
        "logit_bias": v.get("logit_bias") or {},
        "logprobs": _logprobs_asked(chat, v),
        "include_stop_str_in_output": bool(v.get("include_stop_str_in_output")),
        "prompt_logprobs": v.get("prompt_logprobs"),
    }
    if echo and sampling["prompt_logprobs"] is None:
        sampling["prompt_logprobs"] = sampling["logprobs"]  # vLLM's rule
    messages = tuple(check_messages(body["messages"])) if chat else ()
    req = GenerationRequest(chat=chat, model=v.get("model"), prompts=prompts, messages=messages,
                            n=n, max_tokens=max_tokens, sampling=sampling,
                            stop=v.get("stop", ()), stream=bool(v.get("stream")),
                            include_usage=bool(v.get("stream_options")), echo=echo,
                            score_only=score_only)
    sampling_params(req, max_tokens or 1)  # the ranges, checked by SamplingParams itself
    return req


def parse_prompts(prompt: Any) -> tuple[str | tuple[int, ...], ...]:
    """`prompt`: a string, a list of token ids, or a list of either (a batch)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_int(prompt[0])):
        items, batch = [prompt], False
    elif isinstance(prompt, list):
        items, batch = prompt, True
    else:
        raise invalid("prompt", "a string, a list of token ids, or a list of those", prompt,
                      code="invalid_type")
    if not items:
        raise invalid("prompt", "at least one prompt", prompt)
    out: list[str | tuple[int, ...]] = []
    for i, p in enumerate(items):
        where = f"prompt[{i}]" if batch else "prompt"
        if isinstance(p, str):
            if not p:
                raise invalid(where, "a non-empty string", p)
            out.append(p)
        elif isinstance(p, list) and p and all(_is_int(t) for t in p):
            out.append(tuple(p))
        else:
            raise invalid(where, "a non-empty string or a non-empty list of token ids", p,
                          code="invalid_type")
    return tuple(out)


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages`: a non-empty list of {"role", "content"}; content a string or a list of
    {"type": "text", "text"} parts (joined). ApiError naming `messages[i].field`."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "a non-empty list of {role, content} objects", messages,
                      code="invalid_type" if not isinstance(messages, list) else "invalid_value")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise invalid(f"messages[{i}]", "an object with role and content", m,
                          code="invalid_type")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise invalid(f"messages[{i}].role", "one of system, developer, user, assistant, "
                          "tool", role)
        content = m.get("content")
        if isinstance(content, list):
            parts = [p.get("text") if isinstance(p, Mapping) and p.get("type") == "text" else None
                     for p in content]
            if any(not isinstance(p, str) for p in parts):
                raise invalid(f"messages[{i}].content", "a string or a list of "
                              "{\"type\": \"text\", \"text\": ...} parts", content)
            content = "".join(parts)
        if not isinstance(content, str):
            raise invalid(f"messages[{i}].content", "a string", content, code="invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


API_NAMES = {"max_new_tokens": "max_tokens"}
"""SamplingParams field -> the API field a client sent."""


def sampling_params(req: GenerationRequest, max_tokens: int,
                    stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The request's SamplingParams (`max_tokens` as max_new_tokens; `stop_token_ids` added to
    the request's own); ApiError naming the API field SamplingParams rejected."""
    kw = dict(req.sampling)
    kw["stop_token_ids"] = tuple(dict.fromkeys(tuple(kw.get("stop_token_ids", ()))
                                               + tuple(stop_token_ids)))
    try:
        return SamplingParams(max_new_tokens=max_tokens, **kw)
    except (ValueError, TypeError) as e:
        text = str(e)
        name = text.split(":", 1)[0]
        param = API_NAMES.get(name, name if name in COMMON_FIELDS else None)
        if param is not None and name != param:
            text = param + text[len(name):]
        raise ApiError(400, text, param=param, code="invalid_value") from None


# ---------------------------------------------------------------------------------------
# Response bodies
# ---------------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(rid: str, model: str, chat: bool, chunk: bool, created: int | None = None
             ) -> dict[str, Any]:
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and chunk else "")
    return {"id": rid, "object": kind, "created": created or int(time.time()), "model": model}


class ChunkEncoder:
    """A stream's `data: {chunk}` events: `encoder(choices, **more)` -> the event's text (its
    envelope, `choices`, `"usage": null` when the stream asked `include_usage`, then `more`).
    The envelope is the same in every event of a stream: encoded once, so an event encodes its
    choices alone (the same bytes as encoding the whole body)."""

    def __init__(self, rid: str, model: str, chat: bool, created: int,
                 include_usage: bool) -> None:
        self.envelope = envelope(rid, model, chat, chunk=True, created=created)
        self.extra = {"usage": None} if include_usage else {}
        head = json.dumps(self.envelope, ensure_ascii=False)
        self.head = f'data: {head[:-1]}, "choices": '
        self.tail = (', "usage": null' if include_usage else "") + "}\n\n"

    def __call__(self, choices: list[dict[str, Any]], **more: Any) -> str:
        if not more:
            return self.head + json.dumps(choices, ensure_ascii=False) + self.tail
        body = self.envelope | {"choices": choices} | self.extra | more
        return "data: " + json.dumps(body, ensure_ascii=False) + "\n\n"


def choice(index: int, text: str, finish_reason: str | None, chat: bool, *, delta: bool = False,
           first: bool = False, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a response (`delta`: of a stream chunk; `first`: the chunk that carries
    the chat role; `logprobs`: `logprobs_body`'s, None when not asked)."""
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if not delta:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason}
    body: dict[str, Any] = {"role": "assistant"} if first else {}
    if text or first:
        body["content"] = text
    return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish_reason}


def logprobs_body(tokens: Sequence[Any], token_text: Callable[[int], str], chat: bool
                  ) -> dict[str, Any]:
    """A choice's `logprobs` for its kept `tokens` (`stop_strings.Token`s with logprob and
    top): chat `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}`, or
    the completions legacy `{tokens, token_logprobs, top_logprobs, text_offset}` (offsets in
    the choice's text; an echoed first prompt token's logprob and top are null).
    `token_text(id)`: a token's own text."""
    if chat:
        def entry(t: int, lp: float) -> dict[str, Any]:
            s = token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        return {"content": [entry(t.id, t.logprob) | {"top_logprobs": [entry(i, v) for i, v in t.top]}
                            for t in tokens], "refusal": None}
    return {"tokens": [token_text(t.id) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [None if t.logprob is None else {token_text(i): v for i, v in t.top}
                             for t in tokens],
            "text_offset": [t.start for t in tokens]}


def prompt_logprobs_body(prompt: Sequence[int], scores: Sequence[tuple],
                         token_text: Callable[[int], str]) -> list[dict[int, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, then {token id:
    {logprob, rank, decoded_token}} with the prompt token first and its top alternatives
    after (one entry per id). `scores`: per token (logprob, rank, [(id, logprob), ...] best
    first), the engine's. A top entry's rank: 1 + the entries above it with a strictly larger
    log-probability (ties share a rank, as the prompt token's rank counts)."""
    out: list[dict[int, Any] | None] = [None]
    for tok, (lp, rank, top) in zip(prompt[1:], scores[1:], strict=True):
        entry = {tok: {"logprob": lp, "rank": rank, "decoded_token": token_text(tok)}}
        for j, (i, v) in enumerate(top):
            if i not in entry:
                above = sum(1 for _, u in top[:j] if u > v)
                entry[i] = {"logprob": v, "rank": 1 + above, "decoded_token": token_text(i)}
        out.append(entry)
    return out
