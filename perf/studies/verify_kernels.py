"""Where one captured verify (or decode) replay spends its GPU time, kernel by kernel.

    python3 -m perf.studies.verify_kernels --bs 1,8 --kv 512,4096 [--n 4] [--kernels-from-env]
                                           --out DIR
        (one GPU; writes DIR/verify_kernels.json)

For each (bs, kv) it captures the 8B-shaped target's forward over bs rows of n tokens as
`perf.verify` does (`Batch`, `target_forward`, the shipped Triton kernels), replays it once
under the torch profiler and reports, per kernel name (template arguments dropped): count,
summed GPU time and mean, plus `busy_ms` (the union of kernel intervals), `span_ms` (first
start to last end) and `idle_ms` = span - busy (time the GPU ran no kernel of the graph).
`layer`: about one layer's kernels (the replay's kernel count over the layers, taken from the
middle of the replay) in launch order, each with its start offset from the first, duration and
the idle gap before it.
"""

from __future__ import annotations

import argparse
import math
import re

import torch

from graphdraft.kernels.config import TRITON, KernelConfig
from graphdraft.runtime.kv_cache import KVPool
from perf.cases import int_list
from perf.models_8b import LLAMA31_8B, build_target
from perf.timing import median_us, write_json
from perf.verify import PAGE_SIZE, Batch, capture_graph, profile_replay, target_forward


def short_name(name: str) -> str:
    """A kernel name without template / argument lists, at most 60 characters."""
    name = re.sub(r"<.*>", "", name)
    name = re.sub(r"\(.*\)", "", name)
    name = re.sub(r"^void ", "", name.strip())
    return name.strip()[:60]


def summarize(ks: list[tuple[str, float, float]], layers: int) -> dict:
    """Per-name totals, busy / span / idle, and one middle layer's timeline; `{"n_kernels": 0}`
    when the profiler recorded no kernel (as `perf.verify.replay_gaps`' empty result)."""
    if not ks:
        return {"n_kernels": 0}
    by: dict[str, dict] = {}
    for name, a, b in ks:
        r = by.setdefault(short_name(name), {"count": 0, "total_us": 0.0})
        r["count"] += 1
        r["total_us"] += b - a
    for r in by.values():
        r["mean_us"] = r["total_us"] / r["count"]
    busy, end = 0.0, -math.inf
    for _, a, b in ks:
        if b > end:
            busy += b - max(a, end)
            end = b
    span = ks[-1][2] - ks[0][1]
    per_layer = len(ks) // layers
    mid = layers // 2
    sel = ks[mid * per_layer:(mid + 1) * per_layer]
    t0 = sel[0][1]
    timeline, prev_end = [], sel[0][1]
    for name, a, b in sel:
        timeline.append({"kernel": short_name(name), "start_us": a - t0, "us": b - a,
                         "gap_before_us": a - prev_end})
        prev_end = max(prev_end, b)
    kernels = sorted(({"kernel": k, **v} for k, v in by.items()), key=lambda r: -r["total_us"])
    return {"kernels": kernels, "n_kernels": len(ks), "busy_ms": busy / 1e3,
            "span_ms": span / 1e3, "idle_ms": (span - busy) / 1e3, "layer": timeline}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int_list, default=(1, 8))
    ap.add_argument("--kv", type=int_list, default=(512, 4096))
    ap.add_argument("--n", type=int, default=4, help="tokens a row (4: verify, 1: decode)")
    ap.add_argument("--kernels-from-env", action="store_true",
                    help="the Triton path with the GRAPHDRAFT_* settings of the environment "
                         "(KernelConfig.from_env), as perf.verify's flag; default: TRITON")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error(f"--n: expected a positive token count, got {args.n}")
    if not torch.cuda.is_available():
        print("verify_kernels: no CUDA device (GPU only); nothing measured")
        return 0
    device = "cuda"
    mc = LLAMA31_8B
    target = build_target(device)
    target.set_kernels(KernelConfig.from_env(backend="triton") if args.kernels_from_env
                       else TRITON)
    cases = [(bs, kv) for kv in args.kv for bs in args.bs]
    pages = max(bs * math.ceil((kv + args.n) / PAGE_SIZE) for bs, kv in cases) + 1
    pool = KVPool(mc.num_hidden_layers, pages, PAGE_SIZE, mc.num_key_value_heads, mc.head_dim,
                  torch.bfloat16, device)
    for t in pool.k + pool.v:
        t.normal_()
    rows = []
    with torch.inference_mode():
        for bs, kv in cases:
            batch = Batch(pool, bs, kv, args.n, device)
            graph = capture_graph(target_forward(target, pool, batch, args.n, "rows"))
            ms = median_us(graph.replay, warmup=3, reps=15, device=device) / 1e3
            row = {"bs": bs, "kv": kv, "n": args.n, "replay_ms": ms,
                   **summarize(profile_replay(graph.replay), mc.num_hidden_layers)}
            rows.append(row)
            del graph, batch
            if not row["n_kernels"]:
                print(f"\nbs {bs} kv {kv} n {args.n}: replay {ms:.3f} ms; the profiler recorded "
                      "no kernel of the graph")
                continue
            print(f"\nbs {bs} kv {kv} n {args.n}: replay {ms:.3f} ms; profiled span "
                  f"{row['span_ms']:.3f} ms, busy {row['busy_ms']:.3f}, idle {row['idle_ms']:.3f}, "
                  f"{row['n_kernels']} kernels")
            for k in row["kernels"][:12]:
                print(f"  {k['total_us']:9.1f} us {k['count']:4d} x {k['mean_us']:7.2f}  {k['kernel']}")
            print("  one layer:")
            for k in row["layer"]:
                print(f"    +{k['start_us']:7.2f} {k['us']:7.2f} us (gap {k['gap_before_us']:6.2f})"
                      f"  {k['kernel']}")
    path = write_json(args.out, "verify_kernels.json", {"rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
