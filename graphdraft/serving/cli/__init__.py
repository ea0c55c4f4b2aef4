"""Command line: `python -m graphdraft {demo,generate,serve} [flags]` (or the `graphdraft` script).

  demo       serve held-out text with speculative decoding and with the target alone:
             accept lengths, graph use, the greedy exactness check; on a GPU tokens/s
             and the speed-up (median of --repeats runs, with its range)
  generate   your prompts (--prompt, --prompt-file), streamed as they are accepted
  serve      an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)

stdout carries results only (generated text, JSON); status lines go to stderr.

Flags follow the serving ecosystem's names (`--speculative-num-steps`,
`--cuda-graph-max-bs`, `--enforce-eager`, ...); `graphdraft <command> --help` lists them
with their defaults. A user error is one line on stderr naming the flag, exit code 2.
Logging goes to the 'graphdraft' (and 'capture') loggers only, at `--log-level`.
"""

from __future__ import annotations

import logging
import sys

from graphdraft.serving.cli.args import (
    CliError,
    Parser,
    add_model_flags,
    add_output_flags,
    add_runtime_flags,
    add_sampling_flags,
    check_conflicts,
    int_at_least,
    translate,
)
from graphdraft.serving.cli.prompts import add_chat_flags

LOGGERS = ("graphdraft", "capture")
"""The loggers the CLI configures (never the root logger)."""


class _StderrHandler(logging.Handler):
    """Writes to the current `sys.stderr` (which tests and tools may swap)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 (logging's contract)
            self.handleError(record)


_HANDLER = _StderrHandler()
_HANDLER.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))


def setup_logging(level: str) -> None:
    for name in LOGGERS:
        lg = logging.getLogger(name)
        lg.setLevel(level.upper())
        if _HANDLER not in lg.handlers:
            lg.addHandler(_HANDLER)
        lg.propagate = False


def build_parser() -> Parser:
    parser = Parser(prog="graphdraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{demo,generate,serve}", parser_class=Parser)
    from graphdraft.serving.cli import demo as demo_mod
    from graphdraft.serving.cli import generate as generate_mod
    from graphdraft.serving.cli import serve as serve_mod
    d = sub.add_parser("demo", help="speculative vs target-only on held-out text",
                       description=demo_mod.__doc__)
    add_model_flags(d)
    add_runtime_flags(d)
    g = d.add_argument_group("demo")
    g.add_argument("--num-prompts", type=int_at_least(1), default=8,
                   help="prompts served in one batch (without --cuda-graph-max-bs, graphs are "
                        "captured up to this many requests)")
    g.add_argument("--prompt-bytes", type=int_at_least(1), default=128,
                   help="prompt length for the byte-level pair (held-out stdlib text)")
    g.add_argument("--repeats", type=int_at_least(1), default=5,
                   help="timed runs of each engine on a GPU (after one warm-up run)")
    add_sampling_flags(d, max_new_tokens=64)
    add_output_flags(d)

    gen = sub.add_parser("generate", help="your prompts, streamed as they are accepted",
                         description=generate_mod.__doc__)
    add_model_flags(gen)
    add_runtime_flags(gen)
    p = gen.add_argument_group("prompts")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a prompt (repeat the flag for several)")
    p.add_argument("--prompt-file", default=None, metavar="PATH",
                   help="one prompt per line, or JSONL with per-prompt sampling keys")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end a request at this text (repeatable; JSONL 'stop' overrides)")
    p.add_argument("--include-stop-str-in-output", action="store_true",
                   help="keep the stop string that ended a request in its text")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document (outputs and metrics) at the end instead of "
                        "streaming text")
    p.add_argument("--json-lines", action="store_true",
                   help="stream JSON lines: {\"index\", \"text\"} per accepted piece, then "
                        "{\"index\", \"finish_reason\", \"completion_tokens\"} per request")
    add_chat_flags(gen)
    add_sampling_flags(gen, max_new_tokens=64)
    add_output_flags(gen)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                         description=serve_mod.__doc__)
    add_model_flags(srv)
    add_runtime_flags(srv)
    serve_mod.add_server_flags(srv)
    add_output_flags(srv)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command; returns the exit code (2: a user error, printed as one line)."""
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
        check_conflicts(_sub(parser, a.command), a)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    setup_logging(a.log_level)
    prog = f"graphdraft {a.command}"
    try:
        if a.command == "demo":
            from graphdraft.serving.cli.demo import demo
            return demo(a)
        if a.command == "serve":
            from graphdraft.serving.cli.serve import serve
            return serve(a)
        from graphdraft.serving.cli.generate import generate
        return generate(a)
    except CliError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        if a.log_level == "debug":
            raise
        print(f"{prog}: error: {translate(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (one line unless --log-level debug)
        if a.log_level == "debug":
            raise
        print(f"{prog}: internal error: {type(e).__name__}: {e} (--log-level debug shows the "
              "traceback)", file=sys.stderr)
        return 1


def _sub(parser: Parser, command: str) -> Parser:
    for action in parser._subparsers._group_actions:  # argparse keeps subparsers here
        if command in action.choices:
            return action.choices[command]
    return parser
