"""Sampling controls inside the speculative cycle (issue #43's benchmark):
`make perf-sampling OUT=DIR` (`python3 -m perf.sampling --out DIR`).

One process, one GPU: perf/e2e.py's engines (the Llama-3.1-8B-shaped target with random bf16
weights and its EAGLE-3 head, perf/models_8b.py; 3 draft steps, fixed policy, prompts of 512
random tokens, graphs captured for the measured batch sizes). Two speculative Engines over the
same weights, each holding `bs` requests in steady decode, sampled at `TEMPERATURE` (min_p
does nothing to a greedy row):
  plain     no control
  controls  every control on each request (`CONTROLS`): repetition / frequency / presence
            penalties, min_p, a logit_bias of `BIAS_ENTRIES` ids, logprobs 5
Per bs, after each engine's warm-up steps (e2e.steady_step_ms, also recorded as the wall
time per `Engine.step()`: host loop and the per-step read-back included), `--repeats`
alternated repetitions of one replay of each engine's whole cycle graph (e2e.cycle_replay_ms:
CUDA events, the state restored before each replay, median of 20 after 3 warm-up replays).
Row keys: bs, plain_ms / controls_ms (medians over the repetitions of the replay times),
ratio (median of the per-repetition controls / plain ratios; the issue's goal: <= 1.05 at
every bs), plain_step_ms / controls_step_ms (wall), the repetitions' raw figures.

`--breakdown`: also one control group at a time on the same controls engine (refilled),
against plain the same way: rows with `variant` "logprobs" (logprobs 5), "penalties" (the
three penalties and the logit_bias), "min_p" (`breakdown` in the JSON): where the cost goes.

Writes DIR/<tag>-<card>-sampling.json (card: h200 / h100 from `torch.cuda.get_device_name`)
and prints a table. `--smoke`: the same on a tiny random pair on the CPU (a check of the
script; CPU timings mean nothing and replays are not timed: no graphs there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from graphdraft.config import ModelConfig
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from perf import e2e
from perf.cases import int_list
from perf.real import card_name

BATCH_SIZES = (1, 64, 128)
TEMPERATURE = 0.7
BIAS_ENTRIES = 8
CONTROLS = dict(repetition_penalty=1.1, frequency_penalty=0.4, presence_penalty=0.3, min_p=0.05,
                logprobs=5)
"""Every control a request carries in the `controls` variant (plus its logit_bias)."""
ROW_KEYS = ("bs", "plain_ms", "controls_ms", "ratio")
BREAKDOWN = {"logprobs": ("logprobs",),
             "penalties": ("repetition_penalty", "frequency_penalty", "presence_penalty",
                           "logit_bias"),
             "min_p": ("min_p",)}
"""`--breakdown`'s variants: the `controls` fields each one keeps (the rest stay off)."""
NEW_TOKENS = 200


def variant_params(vocab: int, seed: int = 0) -> dict[str, SamplingParams]:
    """{"plain", "controls", and each `BREAKDOWN` group}: the variants' request parameters
    (same temperature; the logit_bias ids drawn from `vocab` with `seed`, biases in [-2, 2])."""
    rng = random.Random(seed)
    bias = tuple((t, round(rng.uniform(-2.0, 2.0), 3))
                 for t in sorted(rng.sample(range(vocab), BIAS_ENTRIES)))
    common = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=TEMPERATURE)
    every = dict(CONTROLS, logit_bias=bias)
    groups = {name: SamplingParams(**common, **{k: every[k] for k in keep})
              for name, keep in BREAKDOWN.items()}
    return {"plain": SamplingParams(**common), "controls": SamplingParams(**common, **every),
            **groups}


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def measure_bs(engines: dict[str, Engine], params: dict[str, SamplingParams], bs: int,
               rng: random.Random, *, prompt_len: int, repeats: int,
               timing: dict[str, int], variant: str = "controls") -> dict[str, Any]:
    """One row: the plain engine filled with `bs` plain requests, the controls engine with
    `bs` of `variant`, both warmed up (wall ms per step recorded), then `repeats` alternated
    cycle replays of each (the `controls_*` keys are the variant's)."""
    row: dict[str, Any] = {"bs": bs} if variant == "controls" else {"variant": variant, "bs": bs}
    chosen = {"plain": params["plain"], "controls": params[variant]}
    for name, engine in engines.items():
        row[f"{name}_step_ms"] = e2e.steady_step_ms(engine, bs, rng, prompt_len=prompt_len,
                                                    params=chosen[name], **timing)
    reps: dict[str, list[float | None]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            reps[name].append(e2e.cycle_replay_ms(engine, bs))
    controlled = engines["controls"].running
    if chosen["controls"].logprobs and (not controlled or not all(
            r.top_logprobs and len(r.top_logprobs[-1]) == CONTROLS["logprobs"] for r in controlled)):
        raise RuntimeError(f"the {variant} variant's requests returned no top logprobs")
    for engine in engines.values():
        e2e._drain(engine)
    row["plain_ms"], row["controls_ms"] = _median(reps["plain"]), _median(reps["controls"])
    ratios = [c / p for p, c in zip(reps["plain"], reps["controls"], strict=True)
              if p is not None and c is not None]
    row["ratio"] = statistics.median(ratios) if ratios else None
    row["step_ratio"] = row["controls_step_ms"] / row["plain_step_ms"]
    row["plain_reps_ms"], row["controls_reps_ms"] = reps["plain"], reps["controls"]
    return row


def measure(target, head, batch_sizes: tuple[int, ...], *, device: str = "cuda",
            dtype: str = "bfloat16", prompt_len: int = e2e.PROMPT_LEN, repeats: int = 5,
            seed: int = 0, timing: dict[str, int] | None = None,
            breakdown: bool = False) -> dict[str, Any]:
    """The rows of the module docstring over (`target`, `head`) (tests pass a tiny pair);
    `breakdown`: also the `BREAKDOWN` variants' rows."""
    cfg = e2e.runtime(max(batch_sizes), tuple(sorted(batch_sizes)), prompt_len, device, dtype)
    t0 = time.perf_counter()
    engines = {}
    for name in ("plain", "controls"):
        engines[name] = Engine(target, cfg, head)
        engines[name].capture_graphs()
    capture_s = time.perf_counter() - t0
    params = variant_params(target.config.vocab_size, seed)
    rng = random.Random(seed)
    rows, parts = [], []
    for bs in batch_sizes:
        for variant in ("controls", *(BREAKDOWN if breakdown else ())):
            row = measure_bs(engines, params, bs, rng, prompt_len=prompt_len, repeats=repeats,
                             timing=timing or {}, variant=variant)
            (rows if variant == "controls" else parts).append(row)
            print(f"[sampling] {variant} bs {bs}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)), flush=True)
    controls = {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in params["controls"].__dict__.items()
                if k in CONTROLS or k in ("logit_bias", "temperature")}
    return {"prompt_len": prompt_len, "steps": e2e.STEPS, "repeats": repeats,
            "temperature": TEMPERATURE, "controls": controls, "capture_s": capture_s,
            "rows": rows, **({"breakdown": parts} if breakdown else {})}


def smoke_pair():
    """A tiny random target and EAGLE-3 head (fp32, CPU) of perf.models_8b's builders."""
    from perf.models_8b import build_head, build_target
    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=97, max_position_embeddings=512,
                 rope_theta=10000.0)
    target_mc = ModelConfig(**shape, num_hidden_layers=4, aux_hidden_state_layer_ids=(1, 2, 3))
    target = build_target("cpu", target_mc, dtype=torch.float32)
    head = build_head(ModelConfig(**shape, draft_vocab_size=64), "cpu", dtype=torch.float32,
                      seed=1)
    head.embed_tokens = target.embed_tokens
    return target, head


def table(data: dict[str, Any]) -> str:
    def f(v: float | None, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    out = ["| variant | bs | plain_ms | controls_ms | ratio | plain_step_ms | controls_step_ms "
           "| step ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"] + data.get("breakdown", []):
        out.append(f"| {r.get('variant', 'controls')} | {r['bs']} | {f(r['plain_ms'])} | "
                   f"{f(r['controls_ms'])} | "
                   f"{f(r['ratio'])}x | {f(r['plain_step_ms'])} | {f(r['controls_step_ms'])} | "
                   f"{f(r['step_ratio'])}x |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.sampling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="perf/out", help="directory for the JSON")
    ap.add_argument("--tag", default=None, help="file name prefix (default: today, UTC)")
    ap.add_argument("--bs", type=int_list, default=BATCH_SIZES, help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=5, help="alternated repetitions per bs")
    ap.add_argument("--breakdown", action="store_true",
                    help="also each control group alone (logprobs, penalties, min_p)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random pair on the CPU (bs 1, 2): a check, not a timing")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error(f"argument --repeats: expected an int >= 1, got {a.repeats}")
    if not a.smoke and not torch.cuda.is_available():
        ap.error("argument --smoke: expected a CUDA GPU, or --smoke for the CPU check")
    t0 = time.perf_counter()
    device = "cpu" if a.smoke else "cuda"
    card = card_name(device)
    tag = a.tag or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    if a.smoke:
        target, head = smoke_pair()
        data = measure(target, head, (1, 2), device="cpu", dtype="float32", prompt_len=24,
                       repeats=min(a.repeats, 2), timing=dict(warmup=0, blocks=1, block=1),
                       breakdown=a.breakdown)
    else:
        from perf.models_8b import build_pair
        target, head = build_pair(device)
        data = measure(target, head, tuple(a.bs), repeats=a.repeats, breakdown=a.breakdown)
    doc = {"device": torch.cuda.get_device_name() if card != "cpu" else "cpu (timings meaningless)",
           "card": card, "torch": torch.__version__, "smoke": a.smoke, **data,
           "wall_s": round(time.perf_counter() - t0, 1)}
    out = Path(a.out) / f"{tag}-{card}-sampling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(table(doc))
    print(f"{doc['wall_s']} s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
