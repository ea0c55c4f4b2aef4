"""`graphdraft serve`: an OpenAI-compatible HTTP server over the speculative engine.

Loads the model pair as `generate` does (every model and runtime flag applies), captures the
CUDA graphs, then serves `/v1/completions`, `/v1/chat/completions` (the checkpoint's chat
template), `/v1/models`, `/health` and `/metrics` on `--host:--port`
(`graphdraft.serving.openai_api`). Status lines go to stderr; stdout stays empty.

Capacity: `--max-running-requests` requests run at once and `--max-queued-requests` more
wait; beyond that a request answers 503. SIGTERM / Ctrl-C: stop accepting, let live
requests finish for `--shutdown-timeout` seconds, abort the rest, exit 0; a second signal
exits at once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

import graphdraft.serving.cli.models as models
from graphdraft.serving.cli.args import CliError, int_at_least

log = logging.getLogger("graphdraft.serving.cli")

GIL_SWITCH_INTERVAL_S = 0.0005
"""The interpreter's thread switch interval while serving (default 5 ms): the engine-loop
thread, back from a device wait, takes the GIL from a busy event loop within this time
rather than 5 ms later (a step of a small model takes a few ms)."""


def add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int_at_least(0), default=8000,
                   help="TCP port (0: any free port, printed at start)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send (None: the --target directory's name, or "
                        "'graphdraft-shipped-pair')")
    g.add_argument("--max-queued-requests", type=int_at_least(0), default=1024,
                   help="requests (choices) that may wait for a slot beyond "
                        "--max-running-requests; more answer 503")
    g.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM / Ctrl-C, how long live requests may finish before they "
                        "are aborted")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the models' random weights and requests sent without a seed")


def model_name(a: argparse.Namespace) -> str:
    if a.served_model_name:
        return a.served_model_name
    if a.target:
        from pathlib import Path
        return Path(a.target).resolve().name
    return "graphdraft-shipped-pair"


def build_engine(a: argparse.Namespace):
    """(engine, loaded models) with graphs captured; status lines on stderr."""
    from graphdraft.serving.cli.demo import capture, read_while_compiling
    from graphdraft.serving.engine import Engine

    with contextlib.redirect_stdout(sys.stderr):  # stdout holds results only
        m = models.load(a, read=False)
        if m.tokenizer is None:
            raise CliError("--target: the model pair has no tokenizer (--random-models has "
                           "none; a --target needs tokenizer.json and the `tokenizers` package)")
        engine = Engine(m.target, m.cfg, m.head, eos_token_id=m.eos, seed=a.seed)
        read_while_compiling(m, [engine], m.cfg, a.quiet)
        capture(engine, "speculative", a.quiet)
    return engine, m


def serve(a: argparse.Namespace) -> int:
    if a.dp_size != 1:
        raise CliError(f"--dp-size: expected 1 for serve (one engine per server), got {a.dp_size}")
    if a.port > 65535:
        raise CliError(f"--port: expected a TCP port in 0..65535, got {a.port}")
    if a.shutdown_timeout < 0:
        raise CliError(f"--shutdown-timeout: expected a number of seconds >= 0, got "
                       f"{a.shutdown_timeout}")
    try:
        from graphdraft.serving.openai_api.app import OpenAIServer, ServerConfig
        from graphdraft.serving.openai_api.server import make_server
    except ImportError as e:
        raise CliError(f"serve: needs the server packages ({e.name} is missing): pip install "
                       "'graphdraft[serve]'") from None
    engine, m = build_engine(a)
    config = ServerConfig(model_name=model_name(a),
                          capacity=a.max_running_requests + a.max_queued_requests,
                          stop_token_ids=tuple(m.stops), shutdown_grace_s=a.shutdown_timeout)
    api = OpenAIServer(engine, m.tokenizer, config)
    server = make_server(api, a.host, a.port, log_level=a.log_level)
    _announce_when_started(server, a, config.model_name)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    server.run()
    if a.metrics_json:
        import dataclasses

        from graphdraft.serving.cli.report import write_json
        write_json(a.metrics_json, {"engine": dataclasses.asdict(api.metrics.state),
                                    "device": m.cfg.device})
    print("graphdraft serve: stopped", file=sys.stderr, flush=True)
    return 0


def _announce_when_started(server, a: argparse.Namespace, name: str) -> None:
    """Print the address (the bound port, when --port 0) on stderr once uvicorn listens."""
    startup = server.startup

    async def announced(sockets=None) -> None:
        await startup(sockets=sockets)
        ports = [s.getsockname()[1] for srv in getattr(server, "servers", [])
                 for s in srv.sockets] or [a.port]
        print(f"graphdraft serve: model {name!r} on http://{a.host}:{ports[0]} "
              "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)",
              file=sys.stderr, flush=True)

    server.startup = announced
