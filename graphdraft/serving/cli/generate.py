"""`graphdraft generate`: your prompts through the speculative engine, streamed as accepted.

stdout holds results only; status lines (loading, capture, per-request summaries, metrics)
go to stderr. What stdout shows:
  one prompt       its text as it is accepted (after every `engine.step()`)
  several prompts  each request's text whole, under a `==> [i] <==` header, as it completes
  --json-lines     one JSON object per line as text is accepted: `{"index": i, "text": delta}`,
                   then `{"index": i, "finish_reason": ..., "completion_tokens": n}` per request
  --json           one JSON document at the end (outputs and metrics), with or without --quiet
`--stop TEXT` ends a request at the first occurrence of TEXT (the text before it is kept, TEXT
too with `--include-stop-str-in-output`; no token after it is shown, counted or listed:
`graphdraft.serving.stop_strings.ChoiceText`, the server's rule); `--chat` renders each
prompt with the target's chat template (`graphdraft.serving.cli.prompts.encode_prompts`).
`--logprobs N`: each token's log-probability and its N likeliest alternatives, as
`"logprobs": [{"token_id", "token", "logprob", "top_logprobs": [{"token_id", "token",
"logprob"}]}]` in --json outputs and beside each --json-lines piece (`--prompt-logprobs N`:
the prompt's, in --json outputs).

`--dp-size N` (data-parallel attention, `graphdraft.serving.data_parallel`): start N processes with
`torchrun --nproc-per-node N -m graphdraft generate --dp-size N ...`; prompt i is served by
rank i % N, the ranks step in lock-step, and rank 0 prints every request's text once all
finished (no streaming) with its own engine's metrics.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import graphdraft.serving.cli.models as models
from graphdraft.serving.cli.args import CliError, sampling_flag_values, translate
from graphdraft.serving.cli.prompts import PromptSpec, encode_prompts, gather
from graphdraft.serving.cli.report import CPU_TIMING_NOTE, metrics_lines, write_json
from graphdraft.serving.engine import Engine
from graphdraft.serving.stop_strings import ChoiceText, Token
from graphdraft.serving.verify import SamplingParams

log = logging.getLogger("graphdraft.serving.cli")


@dataclass
class Stream:
    """One request's text as shown so far (`text`: its stop strings and stop token ids)."""

    index: int
    req: Any  # graphdraft.serving.request.Request
    text: ChoiceText
    sent: int = 0      # output tokens handed to `text`
    shown: str = ""
    finish_reason: str | None = None
    tokens: list[Token] = field(default_factory=list)  # kept tokens shown so far
    new_tokens: list[Token] = field(default_factory=list)  # those the last piece showed

    @property
    def stopped(self) -> bool:
        return self.finish_reason is not None


def sampling_for(a: argparse.Namespace, spec: PromptSpec, stop_ids: tuple[int, ...],
                 eos: int | None) -> tuple[SamplingParams, tuple[str, ...]]:
    """The flags' SamplingParams with the prompt's overrides; CliError naming flag or line."""
    kw = sampling_flag_values(a) | {"seed": None}
    kw["include_stop_str_in_output"] = bool(getattr(a, "include_stop_str_in_output", False))
    over = dict(spec.overrides)
    stops = tuple(over.pop("stop", None) or a.stop or ())
    kw.update(over)
    try:
        return SamplingParams(stop_token_ids=stop_ids, ignore_eos=eos is None, **kw), stops
    except (ValueError, TypeError) as e:
        where = spec.source if spec.overrides else None
        raise CliError(f"{where}: {e}" if where else translate(str(e))) from None


def run_streams(engine: Engine, streams: list[Stream],
                emit: Callable[[Stream, str], None]) -> None:
    """Step the engine until every request finished, calling `emit(stream, new_text)` with
    each piece that may be shown (and once more with "" when a request finished). A request
    whose text reaches one of its stop strings is aborted and its text ends before it."""
    while engine.keep_stepping:
        engine.step()
        for s in streams:
            if s.stopped:
                continue
            out, r = s.req.output, s.req
            lps = None if r.logprobs is None else list(
                zip(r.logprobs[s.sent:], r.top_logprobs[s.sent:], strict=True))
            piece = s.text.push(out[s.sent:len(out)], r.finish_reason if r.finished else None,
                                lps)
            s.sent = len(out)
            s.new_tokens = s.text.take_tokens()
            s.tokens += s.new_tokens
            if s.text.stopped and not r.finished:
                engine.abort(r)
            if s.text.done:
                s.finish_reason = "stop" if s.text.stopped else r.finish_reason
            s.shown += piece
            if piece or s.stopped or s.new_tokens:
                emit(s, piece)


def generate(a: argparse.Namespace) -> int:
    if a.json and a.json_lines:
        raise CliError("--json-lines: expected either --json or --json-lines, not both")
    specs = gather(a.prompt, a.prompt_file)
    with contextlib.redirect_stdout(sys.stderr):  # status lines: stdout holds results only
        engine, m, dp, streams = _start(a, specs)
    emit = _emitter(a, len(specs), dp is not None)
    run_streams(engine, streams, emit)
    snap = engine.metrics_snapshot()
    on_gpu = m.cfg.device.startswith("cuda")
    outputs = [{"index": s.index, "prompt": specs[s.index].text, "text": s.shown,
                "token_ids": list(s.text.token_ids), "finish_reason": s.finish_reason,
                "params": dataclasses.asdict(s.req.params) | {"stop": list(s.text.stops)}}
               | _logprob_fields(s, m.tokenizer) for s in streams]
    if dp is not None:
        outputs = _gather_ranks(outputs, streams, len(specs), dp)
        if outputs is None:
            return 0  # not rank 0
        if not (a.json or a.json_lines):
            for o in outputs:
                _print_block(o["index"], o["text"], len(specs) > 1)
    payload = {"device": m.cfg.device, "timings_are_performance": on_gpu, "metrics": snap}
    if dp is not None:
        payload["dp_size"] = dp.world_size  # metrics: rank 0's engine
    if a.metrics_json:
        write_json(a.metrics_json, payload)
    if a.json:
        print(json.dumps({"outputs": outputs, **payload}))
        return 0
    for o in outputs:
        print(f"[{o['index']}] finished: {o['finish_reason']}, {len(o['token_ids'])} tokens",
              file=sys.stderr)
    for line in metrics_lines(snap, timings=on_gpu):
        print(line, file=sys.stderr)
    if not on_gpu:
        print(CPU_TIMING_NOTE, file=sys.stderr)
    return 0


def _start(a: argparse.Namespace, specs: list[PromptSpec]):
    """Load the models, build the engine, capture, queue every prompt (checked first):
    (engine, loaded models, data-parallel group or None, this rank's streams)."""
    dp = None
    if getattr(a, "dp_size", 1) > 1:  # one process per rank (torchrun): join the group first
        from graphdraft.serving.data_parallel import init_data_parallel
        try:
            dp, a.device = init_data_parallel(a.dp_size, device=a.device)
        except ValueError as e:
            raise CliError(translate(str(e))) from None
    m = models.load(a, read=dp is not None)  # sharding reads the weights: first
    if dp is not None:
        from graphdraft.serving.data_parallel import shard_dense_
        shard_dense_(m.target, dp)
        if m.head is not None:  # --speculative-algorithm ngram: no head
            shard_dense_(m.head, dp)
    prompts = encode_prompts(m.tokenizer, specs, chat=getattr(a, "chat", False),
                             system_prompt=getattr(a, "system_prompt", None))
    engine = Engine(m.target, m.cfg, m.head, eos_token_id=m.eos, seed=a.seed)
    from graphdraft.serving.cli.demo import capture, read_while_compiling
    read_while_compiling(m, [engine], m.cfg, a.quiet)
    capture(engine, "speculative", a.quiet)
    plist, stops = [], []
    for spec, ids in zip(specs, prompts, strict=True):
        params, st = sampling_for(a, spec, m.stops, m.eos)
        try:
            engine.check_request(ids, params)
        except ValueError as e:
            raise CliError(f"{spec.source}: {translate(str(e))}") from None
        plist.append(params)
        stops.append(st)
    from graphdraft.serving.data_parallel import spread
    mine = set(spread(specs, dp))  # every prompt was checked on every rank: same errors
    streams = []
    for i, (p, sp, st) in enumerate(zip(prompts, plist, stops, strict=True)):
        if i in mine:
            text = ChoiceText(m.tokenizer, st, sp.stop_token_ids + (() if m.eos is None
                                                                     else (m.eos,)),
                              include_stop=sp.include_stop_str_in_output)
            streams.append(Stream(i, engine.add_request(p, sp), text))
    return engine, m, dp, streams


def _emitter(a: argparse.Namespace, n_prompts: int, dp: bool) -> Callable[[Stream, str], None]:
    """What stdout gets as text is accepted (module docstring)."""
    def emit(s: Stream, piece: str) -> None:
        if a.json or dp:  # data-parallel: rank 0 prints everything at the end
            return
        if a.json_lines:
            line = {"index": s.index, "text": piece} if piece or s.new_tokens else None
            if line is not None and s.req.logprobs is not None:
                line["logprobs"] = token_entries(s.new_tokens, _tokenizer_of(s))
            if line is not None:
                sys.stdout.write(json.dumps(line, ensure_ascii=False) + "\n")
            if s.stopped:
                sys.stdout.write(json.dumps({"index": s.index, "finish_reason": s.finish_reason,
                                             "completion_tokens": s.text.tokens}) + "\n")
        elif n_prompts == 1:
            sys.stdout.write(piece + ("\n" if s.stopped else ""))
        elif s.stopped:
            _print_block(s.index, s.shown, True)
        sys.stdout.flush()
    return emit


def _tokenizer_of(s: Stream):
    """The tokenizer of a stream's text (its decoder's)."""
    return s.text.decoder.tokenizer


def token_entries(tokens: list[Token], tokenizer) -> list[dict[str, Any]]:
    """JSON entries of kept tokens with their log-probabilities (the module docstring)."""
    def text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False)
    return [{"token_id": t.id, "token": text(t.id), "logprob": t.logprob,
             "top_logprobs": [{"token_id": i, "token": text(i), "logprob": v} for i, v in t.top]}
            for t in tokens]


def _logprob_fields(s: Stream, tokenizer) -> dict[str, Any]:
    """A --json output's `logprobs` / `prompt_logprobs` (only the ones its params asked)."""
    out: dict[str, Any] = {}
    r = s.req
    if r.logprobs is not None:
        out["logprobs"] = token_entries(s.tokens, tokenizer)
    if r.prompt_logprobs is not None:
        out["prompt_logprobs"] = [None] + [
            {"token_id": t, "token": tokenizer.decode([t], skip_special_tokens=False),
             "logprob": lp, "rank": rank,
             "top_logprobs": [{"token_id": i, "logprob": v} for i, v in top]}
            for t, lp, rank, top in zip(r.prompt[1:], r.prompt_logprobs[1:], r.prompt_ranks[1:],
                                        r.prompt_top_logprobs[1:], strict=True)]
    return out


def _print_block(index: int, text: str, many: bool) -> None:
    """One request's whole text (several prompts: under a `==> [i] <==` header)."""
    if many:
        sys.stdout.write(f"==> [{index}] <==\n{text}\n\n")
    else:
        sys.stdout.write(text + "\n")


def _gather_ranks(outputs: list[dict], streams: list[Stream], n: int, dp) -> list[dict] | None:
    """Every rank's outputs on rank 0 (None on the others); ends the process group."""
    import torch.distributed as dist

    from graphdraft.serving.data_parallel import gather_outputs
    outputs = gather_outputs(outputs, [s.index for s in streams], n, dp)
    dist.barrier(group=dp.host_group)
    dist.destroy_process_group()
    return outputs if dp.rank == 0 else None
