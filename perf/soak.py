"""Soak: many draft steps through the serving loop with requests coming and going.

`python -m perf.soak --steps 100000` (GPU: `make soak`) keeps the engine full of
requests of random lengths, replacing each one that finishes, until the drafter
has run `--steps` times. It checks, and prints:
  - allocated GPU memory does not grow after the first few hundred steps;
  - no graph is captured again (capture stats unchanged) and decode batches replay;
  - every `--check-every` steps, one decode step runs both as graph replay and
    eagerly (GRAPHDRAFT_EAGER=1) from the same state: the drafts and draft KV
    writes must be bit-identical;
  - every request's pages return to the pool.
Exit code 1 on any failed check.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch

from graphdraft.config import ModelConfig, RuntimeConfig
from graphdraft.engine import Engine
from graphdraft.random_models import random_model_pair
from graphdraft.verify import SamplingParams

SOAK_TARGET = ModelConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                          intermediate_size=512, num_hidden_layers=4, vocab_size=512,
                          max_position_embeddings=1024, rope_theta=10000.0)


@dataclass
class SoakReport:
    draft_steps: int = 0
    engine_steps: int = 0
    requests_done: int = 0
    tokens: int = 0
    seconds: float = 0.0
    mem_start: int = 0
    mem_end: int = 0
    checks: int = 0
    failures: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            f"draft steps {self.draft_steps}, engine steps {self.engine_steps}, "
            f"requests {self.requests_done}, tokens {self.tokens} in {self.seconds:.1f} s",
            f"allocated memory after warm-up {self.mem_start / 2**20:.1f} MiB, "
            f"at end {self.mem_end / 2**20:.1f} MiB",
            f"graph-vs-eager checks {self.checks}, failures {len(self.failures)}",
            *self.failures[:10],
        ]


def build(device: str, dtype: str, seed: int = 0, **runtime) -> Engine:
    cfg = RuntimeConfig(**{"speculative_num_steps": 3, "page_size": 16, "max_running_requests": 32,
                           "max_context_len": 512, "max_num_batched_tokens": 512,
                           "cuda_graph_max_bs": 32, "dtype": dtype, "device": device,
                           "validate_inputs": False, **runtime})
    target, head = random_model_pair(SOAK_TARGET, SOAK_TARGET.replace(num_hidden_layers=1),
                                     cfg.torch_dtype, seed, std=0.3)
    engine = Engine(target.to(device), cfg, head.to(device))
    engine.capture_graphs()
    return engine


def _checked_run(engine: Engine, report: SoakReport):
    """Wrap drafter.run until the next decode batch: graph and eager runs from the same
    KV state must give the same drafts and KV writes."""
    drafter = engine.drafter
    original = drafter.run

    def run(ctx, hidden, tokens, accept):
        if ctx.num_extends:  # checks are for decode batches (the graphed ones)
            return original(ctx, hidden, tokens, accept)
        drafter.run = original
        k, v = drafter.kv_pool.layer(0)
        k0, v0 = k.clone(), v.clone()
        graph = original(ctx, hidden, tokens, accept)
        kg, vg = k.clone(), v.clone()
        k.copy_(k0)
        v.copy_(v0)
        os.environ["GRAPHDRAFT_EAGER"] = "1"
        try:
            eager = original(ctx, hidden, tokens, accept)
        finally:
            del os.environ["GRAPHDRAFT_EAGER"]
        report.checks += 1
        same_kv = torch.equal(kg.nan_to_num(), k.nan_to_num()) and torch.equal(
            vg.nan_to_num(), v.nan_to_num())
        if not torch.equal(graph, eager) or not same_kv:
            report.failures.append(f"step {report.draft_steps}: graph != eager (bs={ctx.bs})")
        return graph

    drafter.run = run


def soak(engine: Engine, steps: int, check_every: int, seed: int = 0) -> SoakReport:
    rng = random.Random(seed)
    vocab = engine.target.config.vocab_size
    report = SoakReport()
    cuda = engine.device.type == "cuda"
    forwards = [engine.verify_graphs, engine.drafter.first_step_graphs,
                engine.drafter.multi_step_graphs]
    captured = [dict(f.stats.capture_seconds) for f in forwards]
    free_pages = engine.pages.num_free_pages

    def refill():
        while len(engine.running) + len(engine.waiting) < engine.cfg.max_running_requests:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 200))]
            engine.add_request(prompt, SamplingParams(max_new_tokens=rng.randint(1, 200),
                                                      ignore_eos=True))

    t0 = time.perf_counter()
    next_check = check_every
    while engine.drafter.stats.calls < steps:
        refill()
        if engine.drafter.stats.calls >= next_check:
            _checked_run(engine, report)
            next_check += check_every
        done = engine.step()
        report.engine_steps += 1
        report.requests_done += len(done)
        report.tokens += sum(len(r.output) for r in done)
        if report.engine_steps == 200:
            if cuda:
                torch.cuda.synchronize()
                report.mem_start = torch.cuda.memory_allocated()
    for r in list(engine.running) + list(engine.waiting):
        engine.abort(r)
    if cuda:
        torch.cuda.synchronize()
        report.mem_end = torch.cuda.memory_allocated()
    report.seconds = time.perf_counter() - t0
    report.draft_steps = engine.drafter.stats.calls
    if report.mem_end > report.mem_start:
        report.failures.append(f"allocated memory grew: {report.mem_start} -> {report.mem_end}")
    for f, before in zip(forwards, captured, strict=True):
        if f.stats.capture_seconds != before:
            report.failures.append(f"{f.name}: captured again")
    if cuda and engine.drafter.first_step_graphs.stats.total_replays == 0:
        report.failures.append("no draft graph replayed")
    if engine.pages.num_free_pages != free_pages:
        report.failures.append(f"pages leaked: {free_pages - engine.pages.num_free_pages}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--check-every", type=int, default=10_000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args(argv)
    engine = build(a.device, a.dtype)
    report = soak(engine, a.steps, a.check_every)
    for line in report.lines():
        print(line)
    for f in [engine.verify_graphs, engine.drafter.first_step_graphs,
              engine.drafter.multi_step_graphs]:
        print(f.stats.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
