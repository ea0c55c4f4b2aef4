"""Tensor-parallel serving demo: one process per device, started by torchrun.

  torchrun --nproc-per-node 2 scripts/tp_demo.py --device cpu --dtype float32 --check
  torchrun --nproc-per-node 4 scripts/tp_demo.py --device cuda          # NCCL (+ CUDA graphs)
  torchrun --nproc-per-node 8 scripts/tp_demo.py --target DIR --draft DIR --shard-head

Every rank builds (or loads, on the CPU) the full models, keeps its slices
(`graphdraft.parallel.shard_`), moves them to its device and serves the same prompts
through an unchanged `graphdraft.serving.engine.Engine`; the ranks stay in lock-step because they
see identical requests and every decision depends only on the batch and the config.
`--check`: rank 0 also serves the prompts with the unsharded models and compares the
greedy tokens (exact on CPU in float32/float64; in bfloat16 the all-reduce order may
flip near-ties, so a mismatch count is reported instead of an error). Without torchrun
it runs on one rank.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphdraft.config import ModelConfig, RuntimeConfig  # noqa: E402
from graphdraft.models.random_models import random_model_pair  # noqa: E402
from graphdraft.parallel import init_tensor_parallel, shard_  # noqa: E402
from graphdraft.serving.engine import Engine  # noqa: E402
from graphdraft.serving.verify import SamplingParams  # noqa: E402


def random_pair(dtype: torch.dtype, seed: int):
    """Small random models whose shapes split over 1, 2, 4 or 8 ranks."""
    tc = ModelConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
                     intermediate_size=688, num_hidden_layers=6, vocab_size=1000,
                     max_position_embeddings=2048, rope_theta=10000.0)
    return random_model_pair(tc, tc.replace(num_hidden_layers=1), dtype, seed, std=0.1)


def build(args, tp, dtype: torch.dtype):
    """Full models on the CPU, then this rank's shard (tp None: unsharded)."""
    if args.target:
        from graphdraft.io.checkpoint import load_model_pair
        target, head, _ = load_model_pair(args.target, args.draft, dtype, "cpu")
    else:
        target, head = random_pair(dtype, args.seed)
    memo: dict = {}
    shard_(target, tp, memo=memo)  # after the head took the full embedding
    if args.shard_head:
        shard_(head, tp, memo=memo)
    return target, head


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--target", help="target checkpoint dir (default: small random models)")
    p.add_argument("--draft", help="EAGLE-3 head checkpoint dir (with --target)")
    p.add_argument("--shard-head", action="store_true", help="shard the head too (default: "
                   "replicated on every rank)")
    p.add_argument("--no-head", action="store_true", help="target-only decoding")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--check", action="store_true", help="rank 0 compares with 1 rank")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if bool(args.target) != bool(args.draft):
        p.error("--target and --draft go together")

    tp, device = init_tensor_parallel(device=args.device)
    dtype_name = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    cfg = RuntimeConfig(speculative_num_steps=3, page_size=16, max_running_requests=16,
                        max_context_len=512, max_num_batched_tokens=512, cuda_graph_max_bs=16,
                        dtype=dtype_name, device=device, enforce_eager=args.eager)
    torch.manual_seed(args.seed)  # same global RNG on every rank (unseeded sampling)
    target, head = build(args, tp, cfg.torch_dtype)
    target, head = target.to(device), head.to(device)
    engine = Engine(target, cfg, None if args.no_head else head)
    if device.startswith("cuda") and not args.eager:
        engine.capture_graphs()  # same graphs, same order on every rank

    rng = random.Random(args.seed)
    vocab = target.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(8, 64))]
               for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0

    every = [outs]
    if tp.is_parallel:
        every = [None] * tp.world_size
        dist.all_gather_object(every, outs)
    if tp.rank == 0:
        tokens = sum(len(o) for o in outs)
        print(f"tp={tp.world_size} device={device} dtype={dtype_name} "
              f"head={'none' if args.no_head else 'sharded' if args.shard_head else 'replicated'}"
              f" kv heads/rank={engine.kv.k[0].shape[1]}: {tokens} tokens in {dt:.2f} s, "
              f"mean accept {engine.stats.mean_accept_length:.2f}")
        print("ranks agree:", all(e == outs for e in every))
        if args.check:
            ref_target, ref_head = build(args, None, cfg.torch_dtype)
            ref = Engine(ref_target.to(device), cfg.replace(enforce_eager=True),
                         None if args.no_head else ref_head.to(device)).generate(prompts, params)
            bad = sum(a != b for a, b in zip(ref, outs, strict=True))
            print(f"1-rank reference: {len(prompts) - bad}/{len(prompts)} requests identical")
            if bad and cfg.torch_dtype in (torch.float32, torch.float64):
                sys.exit(1)
    if tp.is_parallel:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
