"""A/B on the CPU (accept lengths, not timings): sampled rows' candidates scored at their
temperature (the default) against scored at T 1, per head and tree config, at temperature T;
prints the ratio with its 95 % bootstrap interval over held-out documents (`perf.tree`).

Found (2026-12-04, CPU fp32, 32 held-out prompts, 64 new tokens, 7/4/8 at T 0.7): shipped
head 3.685 at T against 3.616 at T 1 (1.019x, 95 % [0.970, 1.066]); weak head (240 steps)
2.677 against 2.623 (1.020x, [0.947, 1.097]): the same small gain with both heads, not
significant at this size; `perf/tree.py` (RANK_AB, 64 prompts) measures it on the GPU.

`PYTHONPATH=. python scripts/tree_rank_ab.py --head shipped --configs 7/4/8 --prompts 32`
(`--head NAME:DIR` for a trained head, e.g. `perf.tree.train_weak_head`'s).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from perf.tree import ASSETS, accept_lengths, add_rank_ratios, heldout_windows


def main(argv=None) -> int:
    from graphdraft.io.checkpoint import load_model_pair
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="shipped")
    ap.add_argument("--configs", nargs="+", default=["7/4/8"])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    head_dir = ASSETS / "eagle3" if a.head == "shipped" else Path(a.head.split(":", 1)[1])
    target, head, _ = load_model_pair(ASSETS / "target", head_dir, dtype="float32", device="cpu")
    prompts, groups = heldout_windows(a.prompts)
    cfgs = [tuple(map(int, c.split("/"))) for c in a.configs]
    name = a.head.split(":")[0]
    rows = []
    for rank in (True, False):
        rows += accept_lengths(target, head, prompts, cfgs, new_tokens=a.new_tokens, device="cpu",
                               head_name=name, temps=(a.temperature,), rank_at_temperature=rank)
    add_rank_ratios(rows, groups)
    for r in rows:
        if "vs_rank_t1" in r:
            print("{} {} T {}: {:.3f} vs {:.3f} at T 1: {ratio:.3f}x [{lo:.3f}, {hi:.3f}]".format(
                name, "/".join(map(str, r["config"].values())), r["temperature"], r["accept_mean"],
                next(c["accept_mean"] for c in rows if not c["rank_at_temperature"]
                     and c["config"] == r["config"]), **r["vs_rank_t1"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
