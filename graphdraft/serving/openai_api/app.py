"""The ASGI application (Starlette): the OpenAI routes over one `EngineLoop`.

  GET  /health                 200 {"status": "ok"} while serving; 503 {"status":
                               "unavailable", "reason"} once shutting down or when the
                               engine process is gone
  GET  /metrics                Prometheus text format (`metrics.ServerMetrics`)
  GET  /v1/models              the one served model (its id: `--served-model-name`)
  GET  /v1/models/{model}
  POST /v1/completions         prompt: text, token ids, or a batch of either
  POST /v1/chat/completions    messages rendered with the checkpoint's chat template

The Engine runs in its own process (`engine_core`); this process holds an `EngineClient`
to it and does the HTTP work, the detokenization and the stop strings. A generation request
is checked whole before anything is queued (`protocol.parse_request`, the model name, the
prompt's encoding, the Engine's limits for every choice (`serving.limits.EngineLimits.check`): a
request that can never fit the context answers 400); then its choices (prompts x n engine
requests) go to the engine process at once, or the request answers 503 (full, shutting down,
or the engine process gone). A streamed response is server-sent events: one `data: {chunk}`
per wake-up with every token that arrived since the last write (of every choice), then
`data: [DONE]`; a client that disconnects, from a stream or while waiting for a whole
response, has its requests aborted at once. Every error is the OpenAI error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from graphdraft.io.tokenizer import IncrementalDecoder, Tokenizer
from graphdraft.serving.openai_api import protocol as P
from graphdraft.serving.openai_api.engine_client import Choice, EngineClient, ServerBusy
from graphdraft.serving.openai_api.metrics import ServerMetrics
from graphdraft.serving.openai_api.protocol import ApiError, GenerationRequest
from graphdraft.serving.openai_api.text import ChoiceText, Token
from graphdraft.serving.verify import SamplingParams

log = logging.getLogger("graphdraft.serving.openai_api")

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""`/v1/completions` without max_tokens (OpenAI's default); chat: the largest that fits."""


@dataclass
class ServerConfig:
    """What the app serves with (the CLI fills it from `graphdraft serve`'s flags)."""

    model_name: str
    stop_token_ids: tuple[int, ...] = ()
    """Ids that end every request (the tokenizer's EOS / end-of-turn), unless ignore_eos."""
    shutdown_grace_s: float = 10.0
    metrics_dir: str | None = None
    """One of several HTTP processes (`front_ends`): where every process's metrics are
    written and summed (`metrics.ServerMetrics`); None: this process's own."""


@dataclass
class _Run:
    """One HTTP request's choices on their way back."""

    req: GenerationRequest
    choices: list[Choice]
    texts: list[ChoiceText]
    prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finish: dict[int, str] = field(default_factory=dict)
    prompt_scores: dict[int, list] = field(default_factory=dict)
    """Choice index -> its prompt's (logprob, rank, top) per token (prompt_logprobs asked)."""

    @property
    def open(self) -> bool:
        return len(self.finish) < len(self.choices)


class OpenAIServer:
    """The routes and their state; `app` is the ASGI application. `engine`: a started
    `EngineClient` (its process ready); the app attaches it to its event loop at start-up
    and stops it (the engine process exits) at shutdown."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, config: ServerConfig) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.limits = engine.limits
        self.metrics = ServerMetrics(config.metrics_dir)
        self.attached = False
        self.created = int(time.time())
        routes = [Route("/health", self.health), Route("/metrics", self.prometheus),
                  Route("/v1/models", self.models), Route("/v1/models/{model:path}", self.model),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"])]
        self.app = Starlette(routes=routes, lifespan=self._lifespan,
                             exception_handlers={HTTPException: self._http_error,
                                                 Exception: self._internal_error})

    # --- lifecycle -------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette):
        self.engine.attach(asyncio.get_running_loop(), self.metrics)
        self.attached = True
        try:
            yield
        finally:
            self.engine.stop()

    def begin_shutdown(self) -> None:
        """Refuse new requests; live ones get `shutdown_grace_s`, then are aborted (any
        thread)."""
        self.engine.begin_shutdown(self.config.shutdown_grace_s)

    # --- small routes ----------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.attached and self.engine.healthy:
            return JSONResponse({"status": "ok"})
        reason = self.engine.failure or ("shutting down" if self.attached else "starting")
        return JSONResponse({"status": "unavailable", "reason": reason}, 503)

    async def prometheus(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.config.model_name, "object": "model", "created": self.created,
                "owned_by": "graphdraft", "max_model_len": self.limits.max_context_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        try:
            self._check_model(request.path_params["model"])
        except ApiError as e:
            return self._error(e, "models")
        return JSONResponse(self._model_card())

    # --- errors ----------------------------------------------------------------------------
    def _error(self, e: ApiError, endpoint: str) -> Response:
        self.metrics.requests.labels(endpoint=endpoint, status=str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        what = {404: "no such route", 405: "method not allowed"}.get(exc.status_code, exc.detail)
        return JSONResponse(ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                     f"{what}", code=str(exc.status_code)).body(),
                            status_code=exc.status_code)

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        log.exception("internal error serving %s %s", request.method, request.url.path)
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                     code="internal_error").body(), status_code=500)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise ApiError(404, f"model: {name!r} is not served here; expected "
                           f"{self.config.model_name!r}", param="model", code="model_not_found")

    # --- generation ------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            req = P.parse_request(await _read_json(request), chat=chat)
            self._check_model(req.model)
            run = self._start(req)
        except ApiError as e:
            return self._error(e, endpoint)
        rid, model = P.new_id(chat), self.config.model_name
        if req.stream:
            self.metrics.requests.labels(endpoint=endpoint, status="200").inc()
            return StreamingResponse(self._sse(run, rid, model), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._whole(request, run, rid, model, endpoint)

    def _start(self, req: GenerationRequest) -> _Run:
        """Encode, check and queue every choice of `req` (all or none)."""
        prompts = self._encode(req)
        choices, texts = [], []
        for prompt in prompts:
            params = self._params(req, prompt)
            for _ in range(req.n):
                choices.append(Choice(prompt, params, deliver=_noop, seed_stream=len(choices)))
                texts.append(ChoiceText(self.tokenizer, req.stop, params.stop_token_ids
                                        + self.config.stop_token_ids,
                                        include_stop=params.include_stop_str_in_output))
        run = _Run(req, choices, texts, sum(len(p) for p in prompts))
        for i, c in enumerate(choices):
            c.deliver = _deliverer(run.queue, i)
        if not self.attached:
            raise ApiError(503, "the server is starting", code="unavailable")
        try:
            self.engine.submit(choices)
        except ServerBusy as e:
            raise ApiError(503, str(e), code=e.reason) from None
        return run

    def _encode(self, req: GenerationRequest) -> list[list[int]]:
        if req.chat:
            try:
                text = self.tokenizer.apply_chat_template(list(req.messages))
            except ValueError as e:
                raise ApiError(400, f"messages: {e}", param="messages",
                               code="invalid_value") from None
            prompts: list[str | tuple[int, ...]] = [text]
        else:
            prompts = list(req.prompts)
        out = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for p in out:
            if not p:
                raise ApiError(400, f"{req.prompt_param}: encodes to no tokens",
                               param=req.prompt_param, code="invalid_value")
        return out

    def _params(self, req: GenerationRequest, prompt: list[int]) -> SamplingParams:
        """The choice's SamplingParams, checked against the Engine's limits (400 if it can
        never fit); without max_tokens: 16 for completions, the largest that fits for chat."""
        stops = () if req.sampling.get("ignore_eos") else self.config.stop_token_ids
        max_tokens = req.max_tokens
        if max_tokens is None and not req.chat:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
        if max_tokens is None:
            max_tokens = self._largest_fit(req, prompt, stops)
        params = P.sampling_params(req, max_tokens, stops)
        try:
            self.limits.check(prompt, params)
        except ValueError as e:
            raise _fit_error(req, str(e)) from None
        return params

    def _largest_fit(self, req: GenerationRequest, prompt: list[int], stops) -> int:
        """The largest max_tokens the Engine's limits accept for `prompt` (1 if none)."""
        def fits(m: int) -> bool:
            try:
                self.limits.check(prompt, P.sampling_params(req, m, stops))
            except ValueError:
                return False
            return True
        lo, hi = 1, self.limits.max_context_len
        if not fits(lo):
            return lo  # check_request then reports why
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    async def _updates(self, run: _Run) -> AsyncIterator[list[tuple[int, str, str | None, list]]]:
        """(choice index, new text, finish reason or None, the kept tokens that text shows:
        `stop_strings.Token`s) per wake-up, until every choice finished; a choice ended by a
        stop string has its engine request aborted."""
        while run.open:
            items = [await run.queue.get()]
            while not run.queue.empty():
                items.append(run.queue.get_nowait())
            out: dict[int, list] = {}
            for i, ids, fin, lps, prompt in items:
                if prompt is not None:
                    run.prompt_scores[i] = prompt
                text = run.texts[i]
                if text.done:
                    continue
                piece = text.push(ids, fin, lps)
                if text.stopped and fin is None:
                    self.engine.cancel([run.choices[i]])
                if text.done:
                    run.finish[i] = text.finish_reason_override or fin or "stop"
                prev = out.get(i)
                out[i] = [i, (prev[1] if prev else "") + piece, run.finish.get(i),
                          (prev[3] if prev else []) + text.take_tokens()]
            if out:
                yield [tuple(v) for v in out.values()]

    def _logprobs(self, run: _Run, tokens: list) -> dict[str, Any] | None:
        """A choice's (or a chunk's) `logprobs` body for `tokens`; None when not asked."""
        if run.req.sampling.get("logprobs") is None:
            return None
        return P.logprobs_body(tokens, self._token_text, run.req.chat)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _usage(self, run: _Run) -> dict[str, int]:
        done = 0 if run.req.score_only else sum(t.tokens for t in run.texts)
        return P.usage(run.prompt_tokens, done)

    def _prompt_logprobs(self, run: _Run, i: int) -> list | None:
        """Choice `i`'s `prompt_logprobs` body (None: not asked or not scored)."""
        scores = run.prompt_scores.get(i)
        if scores is None:
            return None
        return P.prompt_logprobs_body(run.choices[i].prompt, scores, self._token_text)

    def _echoed(self, run: _Run, i: int, text: str, tokens: list) -> tuple[str, list]:
        """Choice `i`'s text and kept tokens with its prompt first (`echo`; `score_only`: the
        prompt alone): the prompt as sent (token ids: decoded), its tokens with their
        log-probabilities (the first's None) and offsets, the completion's shifted after."""
        prompt, src = run.choices[i].prompt, run.req.prompts[i // run.req.n]
        scores = run.prompt_scores.get(i) or [(None, None, ())] * len(prompt)
        decoder, entries, at = IncrementalDecoder(self.tokenizer), [], 0
        for t, (lp, _, top) in zip(prompt, scores, strict=True):
            piece = decoder.push([t])
            entries.append(Token(t, at, at + len(piece), lp, tuple(top)))
            at += len(piece)
        if entries:  # bytes of a character the prompt never completed
            entries[-1] = replace(entries[-1], end=at + len(decoder.flush()))
        head = src if isinstance(src, str) else self.tokenizer.decode(prompt)
        if run.req.score_only:
            return head, entries
        n = len(head)
        return head + text, entries + [replace(t, start=t.start + n, end=t.end + n)
                                       for t in tokens]

    async def _whole(self, request: Request, run: _Run, rid: str, model: str,
                     endpoint: str) -> Response:
        """A non-streamed response; a client gone meanwhile aborts the choices."""
        texts = [""] * len(run.choices)
        tokens: list[list] = [[] for _ in run.choices]

        async def collect() -> None:
            async for updates in self._updates(run):
                for i, piece, _, toks in updates:
                    texts[i] += piece
                    tokens[i] += toks

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                self.engine.cancel(run.choices)
        if not work.done() or work.cancelled():
            self.metrics.requests.labels(endpoint=endpoint, status="499").inc()
            return Response(status_code=499)
        work.result()
        bad = _failure(run, self.engine.failure)
        if bad is not None:
            return self._error(bad, endpoint)
        body = P.envelope(rid, model, run.req.chat, chunk=False)
        if run.req.echo:
            for i in range(len(texts)):
                texts[i], tokens[i] = self._echoed(run, i, texts[i], tokens[i])
        body["choices"] = [P.choice(i, texts[i], run.finish[i], run.req.chat,
                                    logprobs=self._logprobs(run, tokens[i]))
                           for i in range(len(texts))]
        if run.req.sampling.get("prompt_logprobs") is not None:
            if run.req.chat:  # one prompt: beside the choices, as vLLM puts it
                body["prompt_logprobs"] = self._prompt_logprobs(run, 0)
            else:
                for i, c in enumerate(body["choices"]):
                    c["prompt_logprobs"] = self._prompt_logprobs(run, i)
        body["usage"] = self._usage(run)
        self.metrics.requests.labels(endpoint=endpoint, status="200").inc()
        return JSONResponse(body)

    async def _sse(self, run: _Run, rid: str, model: str) -> AsyncIterator[str]:
        """The event stream of a streamed response; closing it early (client gone) aborts
        every choice still running."""
        chat = run.req.chat
        chunk = P.ChunkEncoder(rid, model, chat, int(time.time()), run.req.include_usage)
        try:
            if chat:  # the role first, as OpenAI does
                yield chunk([P.choice(i, "", None, True, delta=True, first=True)
                             for i in range(len(run.choices))])
            async for updates in self._updates(run):
                parts = [P.choice(i, piece, _public_reason(fin), chat, delta=True,
                                  logprobs=self._logprobs(run, toks))
                         for i, piece, fin, toks in updates if piece or fin is not None or toks]
                if parts:
                    yield chunk(parts)
            bad = _failure(run, self.engine.failure)
            if bad is not None:
                yield "data: " + json.dumps(bad.body()) + "\n\n"
            if run.req.include_usage:
                yield chunk([], usage=self._usage(run))
            yield "data: [DONE]\n\n"
        finally:
            if run.open:
                self.engine.cancel(run.choices)


def _public_reason(reason: str | None) -> str | None:
    return None if reason == "error" else reason


def _failure(run: _Run, engine_failure: str | None) -> ApiError | None:
    """The error to report when a choice failed (engine error, the engine process gone) or
    was aborted by shutdown."""
    reasons = set(run.finish.values())
    if "error" in reasons:
        what = engine_failure or "the engine failed"
        return ApiError(500, f"{what} while serving this request (see the server log)",
                        code="engine_error")
    if "abort" in reasons:
        return ApiError(503, "the server shut down before this request finished",
                        code="shutting_down")
    return None


def _fit_error(req: GenerationRequest, message: str) -> ApiError:
    """`EngineLimits.check`'s ValueError as a 400 naming the API field."""
    param = req.prompt_param
    if "stop_token_ids" in message:
        param = "stop_token_ids"
    elif "params.logit_bias" in message:
        param = "logit_bias"
    elif "params.prompt_logprobs" in message:
        param = "prompt_logprobs"
    elif "params.logprobs" in message:
        param = "top_logprobs" if req.chat else "logprobs"
    elif "max_new_tokens" in message and req.max_tokens is not None:
        param = "max_tokens"
    message = message.replace("max_new_tokens", "max_tokens").replace("params.", "")
    if message.startswith("prompt:"):
        message = message[len("prompt:"):].lstrip()
    if not message.startswith(param + ":"):
        message = f"{param}: {message}"
    code = "context_length_exceeded" if "exceed" in message or "pages" in message else None
    return ApiError(400, message, param=param, code=code or "invalid_value")


async def _read_json(request: Request) -> Any:
    body = await request.body()
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"body: expected valid JSON ({e})", code="invalid_json") from None


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _deliverer(queue: asyncio.Queue, index: int):
    def deliver(ids: list[int], finish: str | None, lps: list | None = None,
                prompt: list | None = None) -> None:
        queue.put_nowait((index, ids, finish, lps, prompt))
    return deliver


def _noop(ids: list[int], finish: str | None, lps: list | None = None,
          prompt: list | None = None) -> None:
    return None
