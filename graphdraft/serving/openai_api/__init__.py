"""An OpenAI-compatible HTTP server over one `Engine` (`python -m graphdraft serve`).

Two processes, as vLLM (API server + EngineCore) and SGLang (tokenizer manager + scheduler)
do: the HTTP process runs the ASGI app (HTTP, JSON, server-sent events, detokenization, stop
strings, metrics) and the engine-core process owns the Engine and steps it at its own pace;
a socket between them carries commands one way and per-step token batches the other.

  protocol       request bodies -> typed `GenerationRequest`s (every field checked; an
                 `ApiError` names the field), response and stream-chunk bodies
  text           one choice's text: incremental detokenization and stop strings cut exactly
  wire           the messages between the two processes and their framing
  engine_core    the engine process: builds the Engine, applies commands between steps,
                 sends every step's new tokens in one message
  engine_client  the HTTP process's handle on it: spawn, submit / cancel, read on asyncio,
                 shutdown, a crashed engine process
  metrics        the Prometheus metrics of `/metrics`
  app            the ASGI application (Starlette): routes, server-sent events, errors
  server         running it under uvicorn with a bounded graceful shutdown on SIGTERM / Ctrl-C
  front_ends     several HTTP processes over one engine process (`--api-server-count`): the
                 supervisor, the shared listening socket, the HTTP process's entry point
"""
