"""`python -m graphdraft.train {target,head,all} [flags]`: train the shipped byte-level pair."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from graphdraft.train.train import HeadRun, TargetRun, train_head, train_target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphdraft.train", description=__doc__)
    p.add_argument("what", choices=["target", "head", "all"])
    p.add_argument("--out", default="graphdraft/assets",
                   help="directory for target/ and eagle3/ (default: graphdraft/assets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--target-steps", type=int, default=TargetRun.steps)
    p.add_argument("--target-batch", type=int, default=TargetRun.batch)
    p.add_argument("--target-lr", type=float, default=TargetRun.lr)
    p.add_argument("--head-steps", type=int, default=HeadRun.steps)
    p.add_argument("--head-batch", type=int, default=HeadRun.batch)
    p.add_argument("--head-lr", type=float, default=HeadRun.lr)
    p.add_argument("--ttt-steps", type=int, default=HeadRun.ttt_steps)
    p.add_argument("--generated", type=int, default=0,
                   help="self-distillation pool: sequences the target continues greedily")
    p.add_argument("--generated-fraction", type=float, default=0.75,
                   help="share of each head batch drawn from that pool")
    p.add_argument("--init-from", default=None, help="head checkpoint to start from")
    p.add_argument("--head-warmup", type=int, default=10)
    p.add_argument("--hard-labels", action="store_true",
                   help="head loss against the target's greedy token instead of its softmax")
    p.add_argument("--target-max-minutes", type=float, default=None,
                   help="stop the target's training early after this many minutes "
                        "(a safety cap: the step count is then not reproducible)")
    p.add_argument("--head-max-minutes", type=float, default=None,
                   help="the same for the head's training")
    p.add_argument("--no-compile", action="store_true", help="eager training steps (slower)")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    if a.what in ("target", "all"):
        train_target(TargetRun(seed=a.seed, steps=a.target_steps, batch=a.target_batch,
                               lr=a.target_lr, max_minutes=a.target_max_minutes, compile=not a.no_compile,
                               out=str(out / "target"), save_dtype=a.save_dtype))
    if a.what in ("head", "all"):
        train_head(HeadRun(seed=a.seed, steps=a.head_steps, batch=a.head_batch, lr=a.head_lr,
                           ttt_steps=a.ttt_steps, hard_labels=a.hard_labels,
                           generated=a.generated, generated_fraction=a.generated_fraction,
                           init_from=a.init_from, warmup=a.head_warmup,
                           max_minutes=a.head_max_minutes, compile=not a.no_compile,
                           target=str(out / "target"),
                           out=str(out / "eagle3"), save_dtype=a.save_dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
