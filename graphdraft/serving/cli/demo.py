"""`graphdraft demo`: the same prompts served with speculative decoding and with the target
alone, then what that shows.

On a CPU (graphs need a GPU; every forward runs eagerly) it prints tokens, the accept
length and its histogram, graph use and the greedy exactness check, and no timing: a CPU
run of this runtime says nothing about its performance. On a GPU it times the serving:
one untimed warm-up run of each engine (Triton compiles a kernel for every new
specialisation on first use), then `--repeats` timed runs of each, alternated, and prints
the median tokens/s of each and the speed-up (median of the per-repetition ratios, with
their range), then the latency metrics of the last speculative run, and the wall clock of the
whole process by phase (`report.WallClock`; also in the metrics JSON as `wall_s`).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import random
import sys
import time

import torch

import graphdraft.serving.cli.models as models
from graphdraft.io.tokenizer import ByteLevelTokenizer
from graphdraft.serving.cli.args import CliError, sampling_flag_values, translate
from graphdraft.serving.cli.report import (
    CPU_TIMING_NOTE,
    WallClock,
    metrics_lines,
    report_greedy_match,
    spread,
    write_json,
)
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from graphdraft.startup.spec import default_workers
from graphdraft.startup.warmup import precompile_running, start_precompile

log = logging.getLogger("graphdraft.serving.cli")

CPU_SPEEDUP = ("speed-up over target-only: not measured on a CPU (a GPU run times both: "
               "make demo-gpu)")
CHAT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences why the sky is blue.",
    "Write a Python function `fizzbuzz(n)` that returns the FizzBuzz list up to n.",
    "Give me three tips for learning to cook.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about the sea.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Describe a sunrise over the mountains in one paragraph.",
]
"""The demo's prompts for a chat model (one user message each, under its chat template)."""


def status(line: str) -> None:
    """A status line (what the demo is doing): stderr; results go to stdout."""
    print(line, file=sys.stderr, flush=True)

SAMPLE_PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "A recipe for bread: first,",
    "In speculative decoding, a small draft model",
    "The capital of France is",
    "Once upon a time, in a village by the sea,",
    "import numpy as np\n\n# compute the mean of each column\n",
    "Photosynthesis converts light energy into",
]


def capture(engine: Engine, name: str, quiet: bool) -> float:
    """Capture the engine's CUDA graphs, saying so; returns the seconds it took. `quiet`
    turns the progress bars off where `Engine.capture_graphs` accepts `progress`."""
    kw = {}
    if "progress" in inspect.signature(engine.capture_graphs).parameters:
        kw["progress"] = not quiet
    on_gpu = engine.device.type == "cuda"
    graphs = on_gpu and not engine.cfg.enforce_eager
    if graphs:
        sizes = getattr(engine, "schedule", None)
        status(f"capturing {name} CUDA graphs" + (f" (batch sizes {list(sizes)})" if sizes else "")
               + " ...")
    t0 = time.perf_counter()
    engine.capture_graphs(**kw)
    dt = time.perf_counter() - t0
    if graphs:
        status(f"captured {name} graphs in {dt:.1f} s")
    return dt


def read_while_compiling(m: models.Loaded, engines: list[Engine], cfg, quiet: bool) -> float:
    """Read the checkpoint's weights (`Loaded.read_weights`) while one compile phase for the
    engines' graphs starts and runs (GPU, graphs on: `warmup.start_precompile`, the read
    beside its plan and workers; the captures adopt it). Returns the seconds the read took.
    A failed read stops the phase."""
    seconds = [0.0]

    def read() -> None:
        seconds[0] = m.read_weights()

    if cfg.device.startswith("cuda") and not cfg.enforce_eager:
        start_precompile(engines, workers=default_workers(cfg), progress=not quiet, meanwhile=read)
    else:
        read()
    if seconds[0] and not quiet:
        status(f"read the weights in {seconds[0]:.1f} s"
               + (" while the kernels compiled" if any(map(precompile_running, engines)) else ""))
    return seconds[0]


def check_request(engine: Engine, prompt: list[int], params: SamplingParams) -> None:
    """`Engine.check_request` where the engine has it (ValueError naming the argument);
    otherwise `add_request` reports the same when the request is queued."""
    check = getattr(engine, "check_request", None)
    if check is not None:
        check(prompt, params)


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def timed(engine: Engine, prompts: list[list[int]], params: SamplingParams, progress: bool
          ) -> tuple[list[list[int]], float]:
    """One `generate` of all prompts, synchronised: (outputs, output tokens per second)."""
    _sync(engine)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, progress=progress)
    _sync(engine)
    return outs, sum(len(o) for o in outs) / (time.perf_counter() - t0)


def demo_prompts(a: argparse.Namespace, m: models.Loaded) -> tuple[list[list[int]], str]:
    if isinstance(m.tokenizer, ByteLevelTokenizer):
        from graphdraft.io.corpus import heldout_prompts
        texts = heldout_prompts(a.num_prompts, a.prompt_bytes)
        if not texts:
            raise CliError("--num-prompts: no held-out standard-library text found for prompts")
        texts = [texts[i % len(texts)] for i in range(a.num_prompts)]
        return ([m.tokenizer.encode(t) for t in texts],
                f"{a.num_prompts} x {a.prompt_bytes} bytes of held-out stdlib sources")
    if m.tokenizer is not None and m.tokenizer.has_chat_template:
        texts = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(a.num_prompts)]
        return ([m.tokenizer.encode(m.tokenizer.apply_chat_template(
            [{"role": "user", "content": t}])) for t in texts],
            f"{a.num_prompts} chat requests (code and prose) under the chat template")
    if m.tokenizer is not None:
        texts = [SAMPLE_PROMPTS[i % len(SAMPLE_PROMPTS)] for i in range(a.num_prompts)]
        return [m.tokenizer.encode(t) for t in texts], f"{a.num_prompts} sample sentences"
    rng = random.Random(a.seed)
    vocab = m.target.config.vocab_size
    return ([[rng.randrange(vocab) for _ in range(rng.randint(16, 64))]
             for _ in range(a.num_prompts)], f"{a.num_prompts} random token sequences")


def print_sample(m: models.Loaded, prompt: list[int], output: list[int]) -> None:
    """Request 0 as text: a chat model's question and answer, else prompt -> output."""
    tok = m.tokenizer
    if tok is not None and tok.has_chat_template and not isinstance(tok, ByteLevelTokenizer):
        print(f"sample (request 0): {CHAT_PROMPTS[0]}\n{tok.decode(output)}\n")
    elif tok is not None:
        print(f"sample: {tok.decode(prompt)!r} -> {tok.decode(output)!r}")
    else:
        print(f"sample: request 0 -> tokens {output[:16]}{' ...' if len(output) > 16 else ''}")


def demo(a: argparse.Namespace) -> int:
    """The demo (module docstring). Ctrl-C: the line a progress bar was drawing is ended
    first, so the caller's "interrupted" message starts a line of its own."""
    try:
        return _demo(a)
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        sys.stderr.flush()
        raise


def _demo(a: argparse.Namespace) -> int:
    wall = WallClock()
    if a.cuda_graph_max_bs is None:  # the batch the demo serves: no graph above it is replayed
        a.cuda_graph_max_bs = min(a.num_prompts, a.max_running_requests)
    m = models.load(a, read=False)  # the tensors are read while the kernels compile
    cfg = m.cfg
    on_gpu = cfg.device.startswith("cuda")
    if not on_gpu:
        status("no CUDA device: running eagerly on the CPU (graphs need a GPU)")
    status(f"model pair: {m.label}")
    prompts, what = demo_prompts(a, m)
    status(f"prompts: {what}")
    try:
        params = SamplingParams(**sampling_flag_values(a), stop_token_ids=m.stops,
                                ignore_eos=m.eos is None)
        base = Engine(m.target, cfg.replace(speculative_algorithm="eagle3"),  # target-only
                      eos_token_id=m.eos, seed=a.seed)
        spec = Engine(m.target, cfg, m.head, eos_token_id=m.eos, seed=a.seed)
        for i, p in enumerate(prompts):
            try:
                check_request(spec, p, params)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
    except ValueError as e:
        raise CliError(translate(str(e))) from None
    wall.mark("models_and_engines")
    capture_s = {"weights": read_while_compiling(m, [base, spec], cfg, a.quiet)}
    capture_s |= {"target-only": capture(base, "target-only", a.quiet),
                 "speculative": capture(spec, "speculative", a.quiet)}
    wall.mark("weights_compile_and_capture")
    progress = not a.quiet
    result: dict = {"device": cfg.device, "timings_are_performance": on_gpu,
                    "capture_s": capture_s}
    if on_gpu:
        base.generate(prompts, params)  # warm-up: kernel compilation, allocator
        spec.generate(prompts, params)
        wall.mark("warm_up_runs")
        base_tps, spec_tps, ratios = [], [], []
        for _ in range(a.repeats):
            base_out, b = timed(base, prompts, params, progress)
            spec.metrics.reset()
            spec_out, s = timed(spec, prompts, params, progress)
            base_tps.append(b)
            spec_tps.append(s)
            ratios.append(s / b)
        wall.mark("timed_runs")
        sb, ss, sr = spread(base_tps), spread(spec_tps), spread(ratios)
        print(f"target-only decoding: {sb['median']:,.1f} tokens/s (median of {a.repeats})")
        print(f"speculative decoding: {ss['median']:,.1f} tokens/s (median of {a.repeats})")
        print(f"speed-up over target-only: {sr['median']:.2f}x "
              f"(median of {a.repeats} runs; range {sr['min']:.2f}x-{sr['max']:.2f}x)")
        result.update(target_only_tokens_per_s=sb, speculative_tokens_per_s=ss, speed_up=sr)
    else:
        base_out = base.generate(prompts, params, progress=progress)
        spec_out = spec.generate(prompts, params, progress=progress)
        wall.mark("serving")
    print_sample(m, prompts[0], spec_out[0])
    snap = spec.metrics_snapshot()
    result["metrics"] = snap
    for line in metrics_lines(snap, timings=on_gpu):
        print(line)
    if not on_gpu:
        print(CPU_TIMING_NOTE)
        print(CPU_SPEEDUP)
    code = 0
    if params.greedy:
        code = report_greedy_match(base_out, spec_out, cfg.torch_dtype)
        result["greedy_identical"] = base_out == spec_out
    result["wall_s"] = wall.seconds()
    if on_gpu:
        print(wall.line())
    if a.metrics_json:
        write_json(a.metrics_json, result)
        status(f"metrics written to {a.metrics_json}")
    return code
