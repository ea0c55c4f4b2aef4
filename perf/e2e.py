"""End-to-end speculative cycle at the Llama-3.1-8B shape: `python3 -m perf.e2e --out DIR`.

One process, one H200: the 8B-shaped target with random bf16 weights and its EAGLE-3 head
(perf/models_8b.py), 3 draft steps (N = 4), prompts of 512 random tokens, greedy, graphs
captured for the measured batch sizes. Per bs, two Engines over the same weights:

  target_only_step_ms  wall time per `Engine.step()` of a target-only engine in steady decode
  cycle_ms             wall time per `Engine.step()` of the speculative engine in steady decode
                       (every row decoding; the host loop, syncs and copies included)
  verify_ms            one replay of the speculative engine's captured verify forward (N tokens/row)
  draft_ms             one replay of the drafter's captured decode graph (first step + multi-step)
                       (verify_ms, draft_ms: None where the cycle graph serves: the split-mode
                       graphs are not captured then, issue #19)
  cycle_replay_ms      one replay of the whole cycle graph, where the engine has one
  target_only_replay_ms  one replay of the target-only engine's cycle (prepare, decode, accept,
                       commit)
  host_ms              cycle_ms minus the GPU work of a cycle (the cycle graph's replay where it
                       exists, else verify + draft replays): what the GPU idles per cycle
  floor_ms             the cycle's HBM floor: target weights + target KV once + draft weights per
                       step (+ fc once) + draft KV per step, over the copy bandwidth of this run
  decode_floor_ms      the target-only decode step's floor: target weights + KV once
  speedup_at_<a>       projected tokens/s over target-only at mean accept length a:
                       a * target_only_step_ms / cycle_ms

`serving` (GPU only): 64 requests of 512 tokens served to 128 new tokens each through
`Engine.generate`; `mixed_draft_share` is the share of that run's wall time spent in the
drafter's eager calls of prefill / mixed steps (the draft work no graph covers).

Both engines run the fixed policy (`speculative_policy="fixed"`: S drafts every cycle; the
adaptive policy is measured by perf/policy.py). Wall times are medians over blocks of steps after warm-up (synchronized at block ends);
replays are medians of CUDA-event timings. Writes `DIR/e2e.json` and prints a table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from capture import padded_batch_size
from graphdraft.config import RuntimeConfig
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from perf.cases import int_list
from perf.floors import floor_bytes
from perf.models_8b import build_pair, kv_bytes_per_token, weight_bytes
from perf.timing import copy_bandwidth, median_us, write_json

BATCH_SIZES = (1, 8, 32, 64, 128)
PROMPT_LEN = 512
STEPS = 3
ACCEPTS = (2.5, 3.0, 3.5)


def runtime(max_bs: int, sizes: tuple[int, ...], prompt_len: int = PROMPT_LEN,
            device: str = "cuda", dtype: str = "bfloat16") -> RuntimeConfig:
    cfg = RuntimeConfig(speculative_num_steps=STEPS, page_size=16, max_running_requests=max_bs,
                        max_context_len=prompt_len + 256, max_num_batched_tokens=8192,
                        cuda_graph_max_bs=max_bs, cuda_graph_bs=sizes, dtype=dtype,
                        device=device, speculative_policy="fixed")
    # every slot at max context: no request waits for pages (over kv_cache_memory_gb's default)
    return cfg.replace(num_kv_pages=cfg.max_running_requests * cfg.max_pages_per_req)


def _decoding(engine: Engine, bs: int) -> bool:
    return len(engine.running) == bs and all(not r.prefilling for r in engine.running)


def _drain(engine: Engine) -> None:
    for r in list(engine.running) + list(engine.waiting):
        engine.abort(r)
    for _ in range(4):  # an engine that keeps a cycle in flight retires it here
        if not engine.has_work:
            break
        engine.step()
    _sync(engine)


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def steady_step_ms(engine: Engine, bs: int, rng: random.Random, *, prompt_len: int = PROMPT_LEN,
                   warmup: int = 4, blocks: int = 5, block: int = 6,
                   params: SamplingParams | None = None) -> float:
    """Median wall ms per `step()` once `bs` requests of `prompt_len` tokens all decode
    (`params`: each request's; default greedy, 200 new tokens, EOS ignored)."""
    vocab = engine.target.config.vocab_size
    params = params or SamplingParams(max_new_tokens=200, ignore_eos=True)
    for _ in range(bs):
        engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params)
    for _ in range(1000):
        if _decoding(engine, bs):
            break
        engine.step()
    else:
        raise RuntimeError("requests did not reach decode")
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(blocks):
        _sync(engine)
        t0 = time.perf_counter()
        for _ in range(block):
            engine.step()
        _sync(engine)
        times.append((time.perf_counter() - t0) * 1e3 / block)
    return statistics.median(times)


def replay_ms(forward: Any, bs: int) -> float | None:
    """Median CUDA-event ms of `forward.run(padded bs)` where a graph is captured, else None."""
    if forward is None:
        return None
    pbs = padded_batch_size(forward.captured_sizes, bs)
    if pbs is None:
        return None
    return median_us(lambda: forward.run(bs, padded_bs=pbs), warmup=3, reps=20,
                     device="cuda") / 1e3


def cycle_replay_ms(engine: Engine, bs: int) -> float | None:
    """`replay_ms` of the cycle graph from one fixed state: every replay commits (advances the
    requests), so the state is restored before each one, outside the replay's event pair (a
    median of restore + replay less a median of restore alone once read a bs-8 replay 0.7 ms
    short, perf/RESULTS.md 2026-12-05j)."""
    if getattr(engine, "cycle_graphs", None) is None:
        return None
    pbs = padded_batch_size(engine.cycle_graphs.captured_sizes, bs)
    if pbs is None:
        return None
    engine.drain()  # nothing in flight: host and device agree on every request
    snap = engine.state_snapshot()
    ms = median_us(lambda: engine.cycle_graphs.run(bs, padded_bs=pbs),
                   setup=lambda: engine.restore_state(snap), warmup=3, reps=20,
                   device="cuda") / 1e3
    engine.restore_state(snap)
    return ms


def serving_run(engine: Engine, bs: int, rng: random.Random, *, prompt_len: int = PROMPT_LEN,
                new_tokens: int = 128) -> dict[str, Any]:
    """`bs` requests of `prompt_len` random tokens served to `new_tokens` each with
    `Engine.generate` (prefill chunks, mixed steps, then decode cycles); the drafter's eager
    calls (prefill / mixed steps: the only draft work outside a graph) timed with CUDA events
    around each, as a share of the run's wall time (`mixed_draft_share`)."""
    drafter = engine.drafter
    original, spans = drafter.run, []

    def timed(*args: Any, **kw: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = original(*args, **kw)
        end.record()
        spans.append((start, end))
        return out

    vocab = engine.target.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(bs)]
    cycles0 = engine.cycle_graphs.stats.total_replays + engine.cycle_graphs.stats.total_eager
    drafter.run = timed
    try:
        _sync(engine)
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        _sync(engine)
        wall = (time.perf_counter() - t0) * 1e3
    finally:
        del drafter.run
    mixed = sum(s.elapsed_time(e) for s, e in spans)
    cycles = engine.cycle_graphs.stats.total_replays + engine.cycle_graphs.stats.total_eager - cycles0
    return {"bs": bs, "prompt_len": prompt_len, "new_tokens": new_tokens, "wall_ms": wall,
            "decode_cycles": cycles, "mixed_draft_calls": len(spans), "mixed_draft_ms": mixed,
            "mixed_draft_share": mixed / wall}


def measure(batch_sizes: tuple[int, ...], *, seed: int = 0, pair: tuple | None = None,
            device: str = "cuda", dtype: str = "bfloat16",
            prompt_len: int = PROMPT_LEN) -> dict[str, Any]:
    """The rows of the module docstring. `pair`: (target, head) instead of the 8B-shaped pair
    (the CPU smoke test passes tiny models; its timings mean nothing)."""
    bw = copy_bandwidth(device, nbytes=(2 << 30) if device == "cuda" else (1 << 20))
    target, head = pair if pair is not None else build_pair(device, seed=seed)
    max_bs = max(batch_sizes)
    cfg = runtime(max_bs, tuple(sorted(batch_sizes)), prompt_len, device, dtype)
    t0 = time.perf_counter()
    base = Engine(target, cfg)
    base.capture_graphs()
    spec = Engine(target, cfg, head)
    spec.capture_graphs()
    capture_s = time.perf_counter() - t0
    tw = weight_bytes(target)
    kv_tok = kv_bytes_per_token(target.config, target.dtype.itemsize)
    rows = []
    rng = random.Random(seed)
    for bs in batch_sizes:
        base_ms = steady_step_ms(base, bs, rng, prompt_len=prompt_len)
        decode_replay = cycle_replay_ms(base, bs)
        base_kv = prompt_len + 20  # about where the timed steps decode
        _drain(base)
        cycle_ms = steady_step_ms(spec, bs, rng, prompt_len=prompt_len)
        verify = replay_ms(spec.verify_graphs, bs)
        draft = replay_ms(getattr(spec.drafter, "decode_graphs", None), bs)
        cycle_replay = cycle_replay_ms(spec, bs)
        kv = prompt_len + 40
        _drain(spec)
        fb = floor_bytes(head.config, bs, kv, STEPS, head.dtype.itemsize)
        cycle_floor = tw + bs * (kv + STEPS + 1) * kv_tok + fb.total
        gpu = cycle_replay if cycle_replay is not None else (verify or 0.0) + (draft or 0.0)
        row = {"bs": bs, "target_only_step_ms": base_ms, "target_only_replay_ms": decode_replay,
               "cycle_ms": cycle_ms, "verify_ms": verify, "draft_ms": draft,
               "cycle_replay_ms": cycle_replay, "host_ms": cycle_ms - gpu,
               "floor_ms": cycle_floor / bw * 1e3,
               "decode_floor_ms": (tw + bs * base_kv * kv_tok) / bw * 1e3}
        for a in ACCEPTS:
            row[f"speedup_at_{a}"] = a * base_ms / cycle_ms
        rows.append(row)
        print(f"[e2e] bs {bs}: " + ", ".join(
            f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)), flush=True)
    serving = None
    if device == "cuda":
        serving = serving_run(spec, min(64, max_bs), rng, prompt_len=prompt_len)
        print(f"[e2e] serving: {serving}", flush=True)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (timings meaningless)"
    return {"gpu": gpu, "torch": torch.__version__,
            "copy_bw": bw, "target_weight_bytes": tw, "prompt_len": prompt_len, "steps": STEPS,
            "capture_s": capture_s, "rows": rows, "serving": serving}


def table(data: dict[str, Any]) -> str:
    cols = ["bs", "target_only_step_ms", "cycle_ms", "verify_ms", "draft_ms", "cycle_replay_ms",
            "host_ms", "floor_ms", "decode_floor_ms"]
    out = ["| " + " | ".join(cols + ["cycle/floor", "step/floor"] + [f"x@{a}" for a in ACCEPTS])
           + " |", "|" + "---|" * (len(cols) + 2 + len(ACCEPTS))]
    for r in data["rows"]:
        cells = [str(r["bs"])] + [("-" if r[c] is None else f"{r[c]:.2f}") for c in cols[1:]]
        cells += [f"{r['cycle_ms'] / r['floor_ms']:.2f}x",
                  f"{r['target_only_step_ms'] / r['decode_floor_ms']:.2f}x"]
        cells += [f"{r[f'speedup_at_{a}']:.2f}x" for a in ACCEPTS]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="perf/out")
    p.add_argument("--bs", type=int_list, default=BATCH_SIZES,
                   help="comma-separated batch sizes")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("perf.e2e needs a CUDA GPU")
        return 2
    data = measure(a.bs)
    path = write_json(a.out, "e2e.json", data)
    print(table(data))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
