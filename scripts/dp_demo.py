"""Data-parallel attention demo: one process per device, started by torchrun.

  torchrun --nproc-per-node 2 scripts/dp_demo.py --device cpu --dtype float32 --check
  torchrun --nproc-per-node 2 scripts/dp_demo.py --device cuda --check --out $OUT    # NCCL + graphs
  torchrun --nproc-per-node 4 scripts/dp_demo.py --device cuda --check --out $OUT

Every rank builds the same small random pair on the CPU, keeps its slices of the MLPs
(`graphdraft.serving.data_parallel.shard_dense_`; `--replicated-head`: the head whole), moves them
to its device and serves ITS share of the prompts (prompt i on rank i % world, so ranks
get different batch sizes, prompt lengths and finishing times); the engines run in
lock-step (`Engine.step` agrees on every step's plan). Outputs are gathered to rank 0.
`--check`: rank 0 also serves every prompt with the unsplit models on one rank and compares
greedy tokens (float32 exact; bfloat16 may flip near-ties: a count is reported).
`--out DIR`: rank 0 writes DIR/dp_demo.json (figures, per-forward graph replays / eager
runs, the check). Without torchrun it runs on one rank (dp_size 1: today's engine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphdraft.config import ModelConfig, RuntimeConfig  # noqa: E402
from graphdraft.models.random_models import random_model_pair  # noqa: E402
from graphdraft.serving.data_parallel import (  # noqa: E402
    gather_outputs,
    init_data_parallel,
    shard_dense_,
    spread,
)
from graphdraft.serving.engine import Engine  # noqa: E402
from graphdraft.serving.verify import SamplingParams  # noqa: E402


def random_pair(dtype: torch.dtype, seed: int):
    """Small random models whose MLPs split over 1, 2, 4 or 8 ranks (F = 688)."""
    tc = ModelConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
                     intermediate_size=688, num_hidden_layers=6, vocab_size=1000,
                     max_position_embeddings=2048, rope_theta=10000.0)
    return random_model_pair(tc, tc.replace(num_hidden_layers=1), dtype, seed, std=0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dp-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                   help="data-parallel ranks (default: torchrun's WORLD_SIZE)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--replicated-head", action="store_true", help="keep the head's MLP whole")
    p.add_argument("--no-head", action="store_true", help="target-only decoding")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--check", action="store_true", help="rank 0 compares with 1 rank")
    p.add_argument("--prompts", type=int, default=11)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for dp_demo.json (rank 0)")
    args = p.parse_args()

    dp, device = init_data_parallel(args.dp_size, device=args.device, timeout_s=300)
    rank = 0 if dp is None else dp.rank
    dtype_name = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    cfg = RuntimeConfig(speculative_num_steps=3, page_size=16, max_running_requests=16,
                        max_context_len=512, max_num_batched_tokens=128, cuda_graph_max_bs=16,
                        dtype=dtype_name, device=device, enforce_eager=args.eager,
                        dp_size=args.dp_size)
    torch.manual_seed(args.seed)
    target, head = random_pair(cfg.torch_dtype, args.seed)
    shard_dense_(target, dp)
    if not args.replicated_head:
        shard_dense_(head, dp)
    target, head = target.to(device), head.to(device)
    engine = Engine(target, cfg, None if args.no_head else head)
    t0 = time.perf_counter()
    if device.startswith("cuda") and not args.eager:
        engine.capture_graphs(progress=rank == 0)  # sizes agreed over ranks afterwards
    capture_s = time.perf_counter() - t0

    rng = random.Random(args.seed)
    vocab = target.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(8, 200))]
               for _ in range(args.prompts)]
    mine = spread(prompts, dp)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    outs = engine.generate([prompts[i] for i in mine], params)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    full = gather_outputs(outs, mine, len(prompts), dp)
    if rank == 0:
        tokens = sum(len(o) for o in full)
        res = {"dp_size": args.dp_size, "device": device, "dtype": dtype_name,
               "head": "none" if args.no_head else ("replicated" if args.replicated_head
                                                    else "split"),
               "prompts": len(prompts), "tokens": tokens, "seconds": dt,
               "capture_seconds": capture_s, "steps_rank0": engine.stats.steps,
               "graphs_rank0": engine.graph_summary()}
        print(f"dp={args.dp_size} device={device} dtype={dtype_name} head={res['head']}: "
              f"{tokens} tokens in {dt:.2f} s ({engine.stats.steps} steps on rank 0)")
        if args.check:
            ref_target, ref_head = random_pair(cfg.torch_dtype, args.seed)
            ref = Engine(ref_target.to(device), cfg.replace(enforce_eager=True, dp_size=1),
                         None if args.no_head else ref_head.to(device)).generate(prompts, params)
            same = sum(a == b for a, b in zip(ref, full, strict=True))
            res["check_identical"], res["check_total"] = same, len(prompts)
            print(f"1-rank reference: {same}/{len(prompts)} requests identical")
        print(f"{'forward':<20} {'replays':>8} {'eager':>8}")
        for name, (rep, eag) in res["graphs_rank0"].items():
            print(f"{name:<20} {rep:>8} {eag:>8}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "dp_demo.json"), "w") as f:
                json.dump(res, f, indent=1)
        bad = args.check and res["check_identical"] != len(prompts)
    if dp is not None:
        dist.barrier(group=dp.host_group)
        dist.destroy_process_group()
    if rank == 0 and bad and cfg.torch_dtype in (torch.float32, torch.float64):
        sys.exit(1)


if __name__ == "__main__":
    main()
