"""Soak: many draft steps through the serving loop with requests coming and going.

`python -m perf.soak --steps 100000` (GPU: `make soak`) keeps the engine full of
requests of random lengths, replacing each one that finishes, until the drafter
has run `--steps` times. It checks, and prints:
  - allocated GPU memory does not grow after the first few hundred steps;
  - no graph is captured again (capture stats unchanged) and decode batches replay;
  - every `--check-every` steps, one decode cycle runs both as the cycle graph's
    replay and eagerly (GRAPHDRAFT_EAGER=1) from the same state: the committed slot
    state, the packed tokens and the target and draft KV writes must be bit-identical;
  - every request's pages return to the pool.
A progress line every `--progress-every` draft steps (10,000). `--max-minutes` caps
the wall time: the soak stops early, says how many draft steps it did and that the
target was not reached. Exit code 1 on any failed check, else 2 when stopped early
by `--max-minutes`, else 0.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import torch

from graphdraft.config import ModelConfig, RuntimeConfig
from graphdraft.models.random_models import random_model_pair
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams

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
    mem_measured: bool = False
    """Whether `mem_start` was taken (the soak ran past its warm-up on CUDA)."""
    checks: int = 0
    failures: list[str] = field(default_factory=list)
    target_steps: int = 0
    max_seconds: float | None = None
    stopped_early: bool = False
    """The `max_seconds` cap ended the soak before `target_steps` draft steps."""

    @property
    def mean_engine_step_ms(self) -> float:
        """Wall time per engine step (checks and request churn included)."""
        return 1e3 * self.seconds / self.engine_steps if self.engine_steps else 0.0

    def lines(self) -> list[str]:
        mem = (f"allocated memory after warm-up {self.mem_start / 2**20:.1f} MiB, "
               f"at end {self.mem_end / 2**20:.1f} MiB" if self.mem_measured else
               f"allocated memory at end {self.mem_end / 2**20:.1f} MiB (no warm-up baseline: "
               "not checked)")
        out = [
            f"draft steps {self.draft_steps}, engine steps {self.engine_steps}, "
            f"requests {self.requests_done}, tokens {self.tokens} in {self.seconds:.1f} s",
            f"mean engine step {self.mean_engine_step_ms:.2f} ms",
            mem,
            f"graph-vs-eager checks {self.checks}, failures {len(self.failures)}",
            *self.failures[:10],
        ]
        if self.stopped_early:
            out.append(f"TARGET NOT REACHED: stopped after {self.draft_steps} of "
                       f"{self.target_steps} draft steps at the {self.max_seconds / 60:g}-minute "
                       "cap (--max-minutes)")
        return out

    @property
    def exit_code(self) -> int:
        """1: a check failed; 2: all checks passed but the step target was not reached; 0."""
        return 1 if self.failures else 2 if self.stopped_early else 0


def build(device: str, dtype: str, seed: int = 0, **runtime) -> Engine:
    cfg = RuntimeConfig(**{"speculative_num_steps": 3, "page_size": 16, "max_running_requests": 32,
                           "max_context_len": 512, "max_num_batched_tokens": 512,
                           "cuda_graph_max_bs": 32, "dtype": dtype, "device": device,
                           "validate_inputs": False, "speculative_policy": "fixed", **runtime})
    target, head = random_model_pair(SOAK_TARGET, SOAK_TARGET.replace(num_hidden_layers=1),
                                     cfg.torch_dtype, seed, std=0.3)
    engine = Engine(target.to(device), cfg, head.to(device))
    engine.capture_graphs()
    return engine


def _checked_cycle(engine: Engine, report: SoakReport):
    """Wrap `engine.cycle_graphs.run` until the next decode cycle: the graph replay and an
    eager run from the same device state (slot tables, cache lengths, target and draft KV of
    layer 0) must commit the same state, pack the same tokens and write the same KV. Returns
    the undo (for a soak that stops before the next decode cycle)."""
    forward = engine.cycle_graphs
    original = forward.run
    drafter_kv = engine.drafter.kv_pool.layer(0)
    target_kv = engine.kv.layer(0)

    def kv_clones() -> list[torch.Tensor]:
        return [t.clone() for t in (*target_kv, *drafter_kv)]

    def restore_kv(saved: list[torch.Tensor]) -> None:
        for t, c in zip((*target_kv, *drafter_kv), saved, strict=True):
            t.copy_(c)

    def run(bs, padded_bs=None):
        del forward.run  # one check per wrap
        before, kv0 = engine.state_snapshot(), kv_clones()
        original(bs, padded_bs)
        graph_state, graph_kv = engine.state_snapshot(), kv_clones()
        graph_pack = engine.cycle.pack[:bs].clone()
        engine.restore_state(before)
        restore_kv(kv0)
        os.environ["GRAPHDRAFT_EAGER"] = "1"
        try:
            original(bs, padded_bs)
        finally:
            del os.environ["GRAPHDRAFT_EAGER"]
        report.checks += 1
        eager_state = engine.state_snapshot()
        same = (torch.equal(graph_pack, engine.cycle.pack[:bs])
                and all(torch.equal(graph_state[k], eager_state[k]) for k in graph_state)
                and all(torch.equal(g.nan_to_num(), e.nan_to_num())
                        for g, e in zip(graph_kv, kv_clones(), strict=True)))
        if not same:
            report.failures.append(f"step {report.draft_steps}: cycle graph != eager (bs={bs})")

    forward.run = run

    def undo() -> None:
        if vars(forward).get("run") is run:
            del forward.run

    return undo


def _progress_line(report: SoakReport, steps: int, elapsed: float, cuda: bool) -> str:
    mem = f"{torch.cuda.memory_allocated() / 2**20:.1f} MiB" if cuda else "n/a (CPU)"
    return (f"[soak] draft steps {steps}, engine steps {report.engine_steps}, "
            f"elapsed {elapsed:.1f} s, allocated {mem}")


def soak(engine: Engine, steps: int, check_every: int, seed: int = 0, *,
         max_seconds: float | None = None, progress_every: int = 10_000,
         out: TextIO | None = None) -> SoakReport:
    """Run until the drafter has run `steps` times, or `max_seconds` of wall time have
    passed (`report.stopped_early`). A progress line every `progress_every` draft steps
    goes to `out` (stdout when None; 0 turns them off), flushed."""
    rng = random.Random(seed)
    vocab = engine.target.config.vocab_size
    report = SoakReport(target_steps=steps, max_seconds=max_seconds)
    cuda = engine.device.type == "cuda"
    stream = sys.stdout if out is None else out
    forwards = [engine.cycle_graphs, engine.verify_graphs, engine.drafter.decode_graphs,
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
    next_progress = progress_every if progress_every > 0 else None
    undo_check = None
    while engine.drafter.stats.calls < steps:
        if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
            report.stopped_early = True
            break
        refill()
        if engine.drafter.stats.calls >= next_check:
            undo_check = _checked_cycle(engine, report)
            next_check += check_every
        done = engine.step()
        report.engine_steps += 1
        report.requests_done += len(done)
        report.tokens += sum(len(r.output) for r in done)
        if report.engine_steps == 200:
            if cuda:
                torch.cuda.synchronize()
                report.mem_start = torch.cuda.memory_allocated()
                report.mem_measured = True
        calls = engine.drafter.stats.calls
        if next_progress is not None and calls >= next_progress:
            print(_progress_line(report, calls, time.perf_counter() - t0, cuda), file=stream,
                  flush=True)
            while next_progress <= calls:
                next_progress += progress_every
    if undo_check is not None:
        undo_check()
    for r in list(engine.running) + list(engine.waiting):
        engine.abort(r)
    if cuda:
        torch.cuda.synchronize()
        report.mem_end = torch.cuda.memory_allocated()
    report.seconds = time.perf_counter() - t0
    report.draft_steps = engine.drafter.stats.calls
    if report.mem_measured and report.mem_end > report.mem_start:
        report.failures.append(f"allocated memory grew: {report.mem_start} -> {report.mem_end}")
    for f, before in zip(forwards, captured, strict=True):
        if f.stats.capture_seconds != before:
            report.failures.append(f"{f.name}: captured again")
    if cuda and engine.cycle_graphs.stats.total_replays == 0:
        report.failures.append("no cycle graph replayed")
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
    p.add_argument("--max-minutes", type=float, default=None,
                   help="wall-time cap: stop early (exit code 2 if every check passed)")
    p.add_argument("--progress-every", type=int, default=10_000,
                   help="draft steps between progress lines (0: none)")
    a = p.parse_args(argv)
    if a.max_minutes is not None and a.max_minutes <= 0:
        p.error("--max-minutes must be > 0")
    engine = build(a.device, a.dtype)
    max_seconds = None if a.max_minutes is None else 60.0 * a.max_minutes
    report = soak(engine, a.steps, a.check_every, max_seconds=max_seconds,
                  progress_every=a.progress_every)
    for line in report.lines():
        print(line)
    for f in [engine.verify_graphs, engine.drafter.decode_graphs,
              engine.drafter.multi_step_graphs]:
        print(f.stats.summary())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
