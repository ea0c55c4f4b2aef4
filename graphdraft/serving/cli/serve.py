"""`graphdraft serve`: an OpenAI-compatible HTTP server over the speculative engine.

Two processes: this one serves HTTP and spawns the engine process, which loads the model
pair as `generate` does (every model and runtime flag applies; `engine_for_core` is its
factory), captures the CUDA graphs and steps the Engine. Once it is ready, this process
serves `/v1/completions`, `/v1/chat/completions` (the checkpoint's chat template),
`/v1/models`, `/health` and `/metrics` on `--host:--port` (`graphdraft.serving.openai_api`).
Status lines go to stderr; stdout stays empty.

Capacity: `--max-running-requests` requests run at once and `--max-queued-requests` more
wait; beyond that a request answers 503. `--api-server-count N` (> 1): N HTTP processes share
the listening socket and the engine process, this one supervises them
(`graphdraft.serving.openai_api.front_ends`); each takes its share of the capacity. SIGTERM / Ctrl-C: stop accepting, let live
requests finish for `--shutdown-timeout` seconds, abort the rest, end the engine process,
exit 0; a second signal ends both at once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

import graphdraft.serving.cli.models as models
from graphdraft.serving.cli.args import CliError, int_at_least
from graphdraft.serving.openai_api.engine_core import ADMISSION_GROUP_DEFAULT

log = logging.getLogger("graphdraft.serving.cli")

ENGINE_FACTORY = "graphdraft.serving.cli.serve:engine_for_core"
"""What the engine process calls to build its Engine (`EngineCoreSpec.factory`)."""


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
    g.add_argument("--admission-group", type=int_at_least(0), default=ADMISSION_GROUP_DEFAULT,
                   metavar="D",
                   help="requests that arrive while the engine only decodes are held until "
                        "ceil(running / D) of them can start together in one prefill step, "
                        "for at most as many decode steps as one mixed step costs (measured; "
                        "1 to 8) (0: each starts at once; engine_core's admit_now)")
    g.add_argument("--api-server-count", type=int_at_least(1), default=1, metavar="N",
                   help="HTTP processes sharing the port and the one engine process (one "
                        "Python event loop streams every response of a process: more serve "
                        "more concurrent streams); each takes 1/N of the capacity")
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
            raise CliError(NO_TOKENIZER)
        engine = Engine(m.target, m.cfg, m.head, eos_token_id=m.eos, seed=a.seed)
        read_while_compiling(m, [engine], m.cfg, a.quiet)
        capture(engine, "speculative", a.quiet)
    return engine, m


def engine_for_core(a: argparse.Namespace):
    """The engine process's factory: (Engine with graphs captured, info for the HTTP process:
    stop_token_ids, tokenizer_dir, device). A user error is an EngineBuildError (one line)."""
    from graphdraft.serving.openai_api.engine_core import EngineBuildError

    _engine_process_logging(a.log_level)
    try:
        engine, m = build_engine(a)
        info = {"stop_token_ids": list(m.stops), "tokenizer_dir": tokenizer_dir(a),
                "device": str(m.cfg.device)}
    except CliError as e:
        raise EngineBuildError(str(e)) from None
    return engine, info


def _engine_process_logging(level: str) -> None:
    """The engine process's 'graphdraft' and 'capture' loggers at --log-level on stderr, in
    the CLI's format (a spawned process starts with logging unconfigured)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for name in ("graphdraft", "capture"):
        lg = logging.getLogger(name)
        lg.setLevel(level.upper())
        lg.addHandler(handler)
        lg.propagate = False


def tokenizer_dir(a: argparse.Namespace) -> str | None:
    """The directory the served tokenizer is read from (None: the pair has none)."""
    if a.target:
        return models.converted_target(a.target)
    if a.random_models or not models.shipped_pair_available():
        return None
    return str(models.SHIPPED_TARGET)


NO_TOKENIZER = ("--target: the model pair has no tokenizer (--random-models has none; a "
                "--target needs tokenizer.json and the `tokenizers` package)")


def _check_flags(a: argparse.Namespace) -> None:
    if a.dp_size != 1:
        raise CliError(f"--dp-size: expected 1 for serve (one engine per server), got {a.dp_size}")
    if a.port > 65535:
        raise CliError(f"--port: expected a TCP port in 0..65535, got {a.port}")
    if a.shutdown_timeout < 0:
        raise CliError(f"--shutdown-timeout: expected a number of seconds >= 0, got "
                       f"{a.shutdown_timeout}")
    if not a.target and tokenizer_dir(a) is None:
        raise CliError(NO_TOKENIZER)


def start_engine(a: argparse.Namespace, capacity: int, peers: int = 0):
    """(EngineClient with its engine process ready, `peers` more connections to it in its
    `peer_socks`, the tokenizer, the ready info); CliError for a user error the engine process
    reported."""
    from graphdraft.serving.openai_api.engine_client import EngineClient, EngineStartError
    from graphdraft.serving.openai_api.engine_core import EngineCoreSpec

    client = EngineClient(EngineCoreSpec(ENGINE_FACTORY, argparse.Namespace(**vars(a)),
                                         admission_group=a.admission_group),
                          capacity=capacity, peers=peers)
    try:
        info = client.start()
    except EngineStartError as e:
        if e.details:
            log.debug("the engine process's traceback:\n%s", e.details)
        if e.user_error:
            raise CliError(str(e)) from None
        raise RuntimeError(f"the engine process: {e}") from None
    tokenizer = models.load_tokenizer(info["tokenizer_dir"]) if info["tokenizer_dir"] else None
    if tokenizer is None:
        client.stop()
        raise CliError(NO_TOKENIZER)
    return client, tokenizer, info


def serve(a: argparse.Namespace) -> int:
    _check_flags(a)
    try:
        from graphdraft.serving.openai_api.app import OpenAIServer
        from graphdraft.serving.openai_api.server import http_stack, make_server
    except ImportError as e:
        raise CliError(f"serve: needs the server packages ({e.name} is missing): pip install "
                       "'graphdraft[serve]'") from None
    capacity = a.max_running_requests + a.max_queued_requests
    if a.api_server_count > 1:
        return _serve_many(a, capacity)
    client, tokenizer, info = start_engine(a, capacity)
    try:
        config = _config(a, info)
        api = OpenAIServer(client, tokenizer, config)
        print(f"graphdraft serve: engine process {client.pid} ready ({info['device']}); HTTP "
              f"on {http_stack()}", file=sys.stderr, flush=True)
        server = make_server(api, a.host, a.port, log_level=a.log_level)
        _announce_when_started(server, a, config.model_name)
        server.run()
    finally:
        client.stop()
    _stopped(a, api.metrics.state, info)
    return 0


def _config(a: argparse.Namespace, info: dict):
    from graphdraft.serving.openai_api.app import ServerConfig
    return ServerConfig(model_name=model_name(a), stop_token_ids=tuple(info["stop_token_ids"]),
                        shutdown_grace_s=a.shutdown_timeout)


def _stopped(a: argparse.Namespace, state, info: dict) -> None:
    """--metrics-json (the engine's last state), then the last status line."""
    if a.metrics_json:
        import dataclasses

        from graphdraft.serving.cli.report import write_json
        write_json(a.metrics_json, {"engine": dataclasses.asdict(state),
                                    "device": info["device"]})
    print("graphdraft serve: stopped", file=sys.stderr, flush=True)


def _serve_many(a: argparse.Namespace, capacity: int) -> int:
    """--api-server-count N > 1: bind, start the engine with N more connections, spawn the
    N HTTP processes and supervise them (`front_ends.Supervisor`)."""
    from graphdraft.serving.openai_api.front_ends import Supervisor, reuseport_socket
    from graphdraft.serving.openai_api.server import http_stack

    try:
        listener = reuseport_socket(a.host, a.port)
    except OSError as e:
        raise CliError(f"--host/--port: cannot listen on {a.host}:{a.port} ({e.strerror})") \
            from None
    try:
        client, _, info = start_engine(a, 0, peers=a.api_server_count)
    except BaseException:
        listener.close()
        raise
    port = listener.getsockname()[1]
    config = _config(a, info)
    supervisor = Supervisor(client, listener, config, info["tokenizer_dir"], capacity,
                            log_level=a.log_level)
    supervisor.start()
    print(f"graphdraft serve: engine process {client.pid} ready ({info['device']}); HTTP "
          f"processes {', '.join(map(str, supervisor.pids))} on {http_stack()}",
          file=sys.stderr, flush=True)
    print(f"graphdraft serve: model {config.model_name!r} on http://{a.host}:{port} "
          "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)",
          file=sys.stderr, flush=True)
    code = supervisor.run()
    _stopped(a, client.state, info)
    return code


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
