"""`python -m graphdraft.train {target,head,all,evaluate} [flags]`: train or evaluate the
byte-level pair; `python -m graphdraft.train real --target DIR_OR_GGUF --out DIR` trains an
EAGLE-3 head for a pretrained chat target (`graphdraft.train.real`, `make train-real`).

`--recipe gpu` is the one-GPU recipe (`make train-gpu`): batch 64 x 256 for both stages,
bf16 autocast, eager steps (`--compile` to compile them), time caps (target 1.5 min, pool
0.4 min + one chunk, head 1.2 min) that keep the whole run under about 3.5 minutes on an H200,
a self-distillation pool of up to 4096 sequences; flags given explicitly override the
recipe's values. `--evaluate` evaluates the
written pair afterwards (as `evaluate --dir OUT`: `graphdraft.train.evaluate`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from graphdraft.train.train import (
    DEVICES,
    PRECISIONS,
    HeadRun,
    TargetRun,
    resolve_device,
    train_head,
    train_target,
)

# The one-GPU recipe. Throughput reasoning: the 4.9M-parameter target at batch 64 x 256 = 16k
# tokens a step is ~0.5 TFLOP a step with the backward (under a ms of H200 bf16 matmul time)
# and ~1,000 small kernels, many of them memory-bound norms / RoPE over [16k, 256..1536]
# activations: ~10 ms of GPU time and about as much host time launching them eagerly, so
# ~10-15 ms a step, ~6,000-9,000 steps (100-150M tokens, ~10 epochs) in the 1.5-minute cap.
# The head's step (teacher forward + 3 unrolled TTT steps) costs about the same. The step
# counts are ceilings: the time caps are expected to end both stages, and the schedule then
# follows the time (train._Clock). torch.compile is off: its warm-up (estimated 30-60 s a
# stage, the whole first step) would take 35-80 % of a stage's cap for a ~1.5x faster step.
GPU_RECIPE = {
    "device": "cuda", "compile": False,
    "target_batch": 64, "target_steps": 12000, "target_lr": 3e-3, "target_warmup": 100,
    "target_max_minutes": 1.5,
    "head_batch": 64, "head_steps": 8000, "head_lr": 3e-3, "head_warmup": 50,
    "head_max_minutes": 1.2,
    "generated": 4096, "generated_fraction": 0.75, "pool_max_minutes": 0.4,
    "log_every": 100,
}
CPU_RECIPE = {  # the dataclass defaults (the shipped CPU run's settings)
    "device": "auto", "compile": True,
    "target_batch": TargetRun.batch, "target_steps": TargetRun.steps, "target_lr": TargetRun.lr,
    "target_warmup": TargetRun.warmup, "target_max_minutes": None,
    "head_batch": HeadRun.batch, "head_steps": HeadRun.steps, "head_lr": HeadRun.lr,
    "head_warmup": HeadRun.warmup, "head_max_minutes": None,
    "generated": 0, "generated_fraction": HeadRun.generated_fraction, "pool_max_minutes": None,
    "log_every": TargetRun.log_every,
}
RECIPES = {"cpu": CPU_RECIPE, "gpu": GPU_RECIPE}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m graphdraft.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["target", "head", "all", "evaluate"])
    p.add_argument("--out", default=None,
                   help="directory for target/ and eagle3/ (required for training; the shipped "
                        "pair is graphdraft/assets: name it explicitly to overwrite it)")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="cpu",
                   help="defaults for the flags below: cpu (the shipped run's) or gpu "
                        "(one H200 in about 4 minutes)")
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="auto: cuda when available (recipe gpu: cuda)")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="auto: bf16 autocast on cuda, fp32 on the cpu (fp32 master weights always)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--target-steps", type=int, default=None)
    p.add_argument("--target-batch", type=int, default=None)
    p.add_argument("--target-lr", type=float, default=None)
    p.add_argument("--target-warmup", type=int, default=None)
    p.add_argument("--head-steps", type=int, default=None)
    p.add_argument("--head-batch", type=int, default=None)
    p.add_argument("--head-lr", type=float, default=None)
    p.add_argument("--ttt-steps", type=int, default=HeadRun.ttt_steps)
    p.add_argument("--generated", type=int, default=None,
                   help="self-distillation pool: sequences the target continues greedily")
    p.add_argument("--generated-fraction", type=float, default=None,
                   help="share of each head batch drawn from that pool")
    p.add_argument("--pool-max-minutes", type=float, default=None,
                   help="stop generating the pool after this many minutes (a smaller pool)")
    p.add_argument("--init-from", default=None, help="head checkpoint to start from")
    p.add_argument("--head-warmup", type=int, default=None)
    p.add_argument("--hard-labels", action="store_true",
                   help="head loss against the target's greedy token instead of its softmax")
    p.add_argument("--lm-head", choices=["own", "target"], default="own",
                   help="own: the head's LM head is trained and saved; target: it is the "
                        "target's, frozen and not saved (config graphdraft_lm_head)")
    p.add_argument("--target-max-minutes", type=float, default=None,
                   help="stop the target's training after this many minutes, the compile "
                        "warm-up included (a safety cap: the step count is then not reproducible)")
    p.add_argument("--head-max-minutes", type=float, default=None,
                   help="the same for the head's training")
    p.add_argument("--log-every", type=int, default=None, help="steps between progress lines")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the training steps (recipe cpu: on, gpu: off)")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g = p.add_argument_group("evaluation (the `evaluate` command, or --evaluate after training)")
    g.add_argument("--evaluate", action="store_true", help="evaluate the pair written to --out")
    g.add_argument("--dir", default=None, help="evaluate: the pair's directory (default: --out)")
    g.add_argument("--baseline", default=None,
                   help="evaluate this pair too, the same way (e.g. graphdraft/assets)")
    g.add_argument("--json", default=None, help="summary path (default: DIR/evaluation.json)")
    g.add_argument("--eval-device", default="cpu", choices=["cpu", "cuda"],
                   help="the evaluation's device (cpu: the test's and the model card's setting)")
    g.add_argument("--prompt-counts", default="16,4",
                   help="mean accept length over each of these numbers of held-out prompts")
    g.add_argument("--prompt-bytes", type=int, default=96)
    g.add_argument("--new-tokens", type=int, default=64)
    g.add_argument("--eval-windows", type=int, default=64,
                   help="held-out windows for the target's loss")
    return p


def resolve(a: argparse.Namespace) -> dict:
    """The flags' values: explicit ones, else the recipe's."""
    recipe = RECIPES[a.recipe]
    return {k: (getattr(a, k) if getattr(a, k) is not None else v) for k, v in recipe.items()}


def run_evaluate(a: argparse.Namespace, d: str) -> dict:
    from graphdraft.train.evaluate import evaluate

    counts = tuple(int(x) for x in a.prompt_counts.split(",") if x.strip())
    return evaluate(d, baseline=a.baseline, json_path=a.json, device=a.eval_device,
                    prompt_counts=counts, prompt_bytes=a.prompt_bytes, new_tokens=a.new_tokens,
                    windows=a.eval_windows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["real"]:  # a pretrained chat target's head: graphdraft.train.real
        from graphdraft.train.real import main as real_main
        return real_main(argv[1:])
    p = parser()
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.what == "evaluate":
        d = a.dir or a.out
        if d is None:
            p.error("evaluate: --dir DIR is required")
        run_evaluate(a, d)
        return 0
    if a.out is None:
        p.error("--out DIR is required (graphdraft/assets holds the shipped pair: name it "
                "explicitly to overwrite it)")
    r = resolve(a)
    resolve_device(r["device"])  # fail before reading the corpus
    out = Path(a.out)
    print(f"recipe {a.recipe}: " + ", ".join(f"{k} {v}" for k, v in r.items()), flush=True)
    common = dict(seed=a.seed, compile=r["compile"], save_dtype=a.save_dtype,
                  device=r["device"], precision=a.precision, log_every=r["log_every"])
    corpus = None
    if a.what == "all":  # read the corpus once for both stages
        from graphdraft.train.data import load_corpus
        corpus = load_corpus()
    if a.what in ("target", "all"):
        train_target(TargetRun(steps=r["target_steps"], batch=r["target_batch"], lr=r["target_lr"],
                               warmup=r["target_warmup"], max_minutes=r["target_max_minutes"],
                               out=str(out / "target"), **common), corpus)
    if a.what in ("head", "all"):
        train_head(HeadRun(steps=r["head_steps"], batch=r["head_batch"], lr=r["head_lr"],
                           ttt_steps=a.ttt_steps, hard_labels=a.hard_labels, lm_head=a.lm_head,
                           generated=r["generated"], generated_fraction=r["generated_fraction"],
                           pool_max_minutes=r["pool_max_minutes"], init_from=a.init_from,
                           warmup=r["head_warmup"], max_minutes=r["head_max_minutes"],
                           target=str(out / "target"), out=str(out / "eagle3"), **common), corpus)
    if a.evaluate:
        run_evaluate(a, str(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
