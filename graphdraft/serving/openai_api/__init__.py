"""An OpenAI-compatible HTTP server over one `Engine` (`python -m graphdraft serve`).

  protocol     request bodies -> typed `GenerationRequest`s (every field checked; an
               `ApiError` names the field), response and stream-chunk bodies
  text         one choice's text: incremental detokenization and stop strings cut exactly
  engine_loop  the thread that owns the Engine: a queue in, token batches out to asyncio
  metrics      the Prometheus metrics of `/metrics`
  app          the ASGI application (Starlette): routes, server-sent events, errors
  server       running it under uvicorn with a bounded graceful shutdown on SIGTERM / Ctrl-C
"""
