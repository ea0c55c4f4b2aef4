"""`graphdraft generate`: your prompts through the speculative engine, streamed as accepted.

After every `engine.step()` the new tokens of each request are decoded with the pair's
tokenizer and printed (one prompt: the text as it comes; several: `[i] ` before each
piece). `--stop TEXT` ends a request at the first occurrence of TEXT (the text before it is
kept); `--json` prints one JSON object at the end instead (outputs and metrics).

`--dp-size N` (data-parallel attention, `graphdraft.serving.data_parallel`): start N processes with
`torchrun --nproc-per-node N -m graphdraft generate --dp-size N ...`; prompt i is served by
rank i % N, the ranks step in lock-step, and rank 0 prints every request's text once all
finished (no streaming) with its own engine's metrics.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from dataclasses import dataclass
from typing import Any

import graphdraft.serving.cli.models as models
from graphdraft.serving.cli.args import CliError, translate
from graphdraft.serving.cli.prompts import PromptSpec, gather
from graphdraft.serving.cli.report import CPU_TIMING_NOTE, metrics_lines, write_json
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams

log = logging.getLogger("graphdraft.serving.cli")


@dataclass
class Stream:
    """One request's text as shown so far."""

    index: int
    req: Any  # graphdraft.serving.request.Request
    stops: tuple[str, ...]
    shown: str = ""
    stopped: bool = False


def sampling_for(a: argparse.Namespace, spec: PromptSpec, stop_ids: tuple[int, ...],
                 eos: int | None) -> tuple[SamplingParams, tuple[str, ...]]:
    """The flags' SamplingParams with the prompt's overrides; CliError naming flag or line."""
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
              top_k=a.top_k, seed=None)
    over = dict(spec.overrides)
    stops = tuple(over.pop("stop", None) or a.stop or ())
    kw.update(over)
    try:
        return SamplingParams(stop_token_ids=stop_ids, ignore_eos=eos is None, **kw), stops
    except (ValueError, TypeError) as e:
        where = spec.source if spec.overrides else None
        raise CliError(f"{where}: {e}" if where else translate(str(e))) from None


def visible(text: str, final: bool, stops: tuple[str, ...] = ()) -> str:
    """What may be shown of a live request's text: hold back a trailing replacement character
    (maybe the first bytes of a multi-byte character whose rest is not accepted yet) and a
    tail that could be the start of a stop string. Everything once the request ended."""
    if final:
        return text
    text = text.rstrip("\ufffd")
    for t in stops:
        for k in range(min(len(t) - 1, len(text)), 0, -1):
            if text.endswith(t[:k]):
                text = text[:-k]
                break
    return text


def run_streams(engine: Engine, tokenizer, streams: list[Stream], emit) -> None:
    """Step the engine until every request finished, calling `emit(index, new_text)`.

    Stop strings: a request whose text contains one is aborted (when the engine has
    `abort`; else it runs on and its text is cut) and its text ends before the stop."""
    while engine.keep_stepping if hasattr(engine, "keep_stepping") else engine.has_work:
        engine.step()
        for s in streams:
            if s.stopped:
                continue
            done = s.req.finished
            text = tokenizer.decode(list(s.req.output))
            hits = [i for i in (text.find(t, len(s.shown)) for t in s.stops) if i >= 0]
            if hits:
                text = text[:min(hits)]
                if not done and hasattr(engine, "abort"):
                    engine.abort(s.req)
                s.req.finish_reason, done = "stop", True
            text = visible(text, done, s.stops)
            if len(text) > len(s.shown):
                emit(s.index, text[len(s.shown):])
                s.shown = text
            s.stopped = done


def generate(a: argparse.Namespace) -> int:
    specs = gather(a.prompt, a.prompt_file)
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
        shard_dense_(m.head, dp)
    if m.tokenizer is None:
        raise CliError("--prompt: the model pair has no tokenizer (--random-models has none; a "
                       "--target needs tokenizer.json and the `tokenizers` package)")
    cfg = m.cfg
    engine = Engine(m.target, cfg, m.head, eos_token_id=m.eos, seed=a.seed)
    from graphdraft.serving.cli.demo import capture, check_request, read_while_compiling
    read_while_compiling(m, [engine], cfg, a.quiet)
    capture(engine, "speculative", a.quiet)
    prompts, plist, stops = [], [], []
    for spec in specs:
        ids = m.tokenizer.encode(spec.text)
        params, st = sampling_for(a, spec, m.stops, m.eos)
        try:
            check_request(engine, ids, params)
        except ValueError as e:
            raise CliError(f"{spec.source}: {translate(str(e))}") from None
        prompts.append(ids)
        plist.append(params)
        stops.append(st)
    from graphdraft.serving.data_parallel import spread
    mine = set(spread(specs, dp))  # every prompt was checked on every rank: same errors
    streams = [Stream(i, engine.add_request(p, sp), st)
               for i, (p, sp, st) in enumerate(zip(prompts, plist, stops, strict=True))
               if i in mine]
    many = len(specs) > 1

    def emit(i: int, text: str) -> None:
        if a.json or dp is not None:  # data-parallel: rank 0 prints everything at the end
            return
        if many:
            text = "".join(f"[{i}] {line}\n" for line in text.splitlines())
        sys.stdout.write(text)
        sys.stdout.flush()

    run_streams(engine, m.tokenizer, streams, emit)
    snap = engine.metrics_snapshot()
    on_gpu = cfg.device.startswith("cuda")
    outputs = [{"index": s.index, "prompt": specs[s.index].text, "text": s.shown,
                "token_ids": list(s.req.output), "finish_reason": s.req.finish_reason,
                "params": dataclasses.asdict(s.req.params) | {"stop": list(s.stops)}}
               for s in streams]
    if dp is not None:
        import torch.distributed as dist

        from graphdraft.serving.data_parallel import gather_outputs
        outputs = gather_outputs(outputs, [s.index for s in streams], len(specs), dp)
        dist.barrier(group=dp.host_group)
        dist.destroy_process_group()
        if dp.rank != 0:
            return 0
        if not a.json:
            for o in outputs:
                emit_text = o["text"]
                sys.stdout.write("".join(f"[{o['index']}] {line}\n" for line in
                                         emit_text.splitlines()) if many else emit_text)
    if not a.json and not many:
        sys.stdout.write("\n")
    payload = {"device": cfg.device, "timings_are_performance": on_gpu, "metrics": snap}
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
