"""Tree-drafting kernels, each as a replayed CUDA graph: `python3 -m perf.tree_kernels --out DIR`.

Per tree config `(steps K, topk k, num_draft_tokens n)` and padded batch size, the median replay
time (us) of:

    beams_step     one decode level's top-k expand + re-rank (`graphdraft.runtime.beams.decode_step`)
                   from fp32 logits [B*k, 32000] (log_softmax + top-k included)
    build          tree build, Triton (`kernels.tree_build.build_tree`)
    build_torch    tree build, torch (`build_tree_ref`)
    accept_greedy  greedy tree walk (`kernels.tree_accept.tree_accept`, target ids [B*n])
    accept_sampled sampled acceptance over fp32 probs [B*n, 128256]
    kv_move        accepted-path KV move, Llama-3.1-8B target KV (32 layers, 8 x 128 bf16,
                   page size 16)
    hid_gather     accepted hidden gather [B*P, 3*4096] bf16

Writes DIR/tree_kernels.json: {"device", "rows": [{"config": {"steps", "topk",
"num_draft_tokens"}, "bs", "kernel", "us"}]} and prints a table. On a CPU (`--smoke`) it
runs tiny shapes eagerly, to check the script, not to time anything.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from graphdraft.kernels.kv_move import gather_accepted_hidden, move_accepted_kv
from graphdraft.kernels.tree_accept import tree_accept
from graphdraft.kernels.tree_build import TreeBuffers, build_tree, build_tree_ref
from graphdraft.runtime.beams import BeamState, decode_step, first_step
from graphdraft.runtime.tree import TreeSpec
from perf.timing import time_us, write_json

CONFIGS = [(3, 1, 4), (7, 1, 8), (5, 4, 8), (3, 4, 16)]
BATCHES = [1, 8, 32, 64]


def _graphed(fn: Callable[[], None], device: str) -> Callable[[], None]:
    """`fn` captured once (after a warm-up on a side stream); the replay on CUDA, else `fn`."""
    if device != "cuda":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _cases(spec: TreeSpec, bs: int, device: str, vd: int, v: int, layers: int, hkv: int, hd: int,
           kh: int) -> dict[str, Callable[[], None]]:
    gen = torch.Generator(device=device).manual_seed(bs)
    k, n, P = spec.topk, spec.n, spec.P
    st = BeamState.allocate(spec, bs, device)
    first_step(spec, torch.randn(bs, vd, device=device, generator=gen), st)
    snap = BeamState(**{f: t.clone() for f, t in st.__dict__.items()})
    logits = torch.randn(bs * k, vd, device=device, generator=gen)

    def beams_step():
        for f, t in st.__dict__.items():   # restore level 1 so each replay does the same work
            t.copy_(getattr(snap, f))
        decode_step(spec, 1, logits, st)

    if spec.steps > 1:
        beams_step()
        for j in range(2, spec.steps):
            decode_step(spec, j, torch.randn(bs * k, vd, device=device, generator=gen), st)
    root = torch.zeros(bs, dtype=torch.int64, device=device)
    plen = torch.full((bs,), 1000, dtype=torch.int64, device=device)
    tree = TreeBuffers.allocate(spec, bs, device)
    tree2 = TreeBuffers.allocate(spec, bs, device)
    build_tree(spec, st.cand_score, st.cand_tok, st.cand_parent, root, plen, tree)
    target = tree.tokens.gather(1, tree.first_child.clamp(min=0)).reshape(-1).contiguous()
    x = torch.randn(bs * n, v, device=device, generator=gen)
    x[torch.arange(bs * n, device=device), target] += 8.0
    probs = torch.softmax(x, -1)
    del x
    coins = torch.rand(bs, n, device=device, generator=gen)
    final = torch.rand(bs, device=device, generator=gen)
    outs = dict(accept_len=torch.zeros(bs, dtype=torch.int32, device=device),
                accept_index=torch.zeros(bs, P, dtype=torch.int64, device=device),
                out_tokens=torch.zeros(bs, P, dtype=torch.int64, device=device),
                bonus=torch.zeros(bs, dtype=torch.int64, device=device))
    tree_accept(spec, tree.tokens, tree.first_child, tree.next_sibling, target=target, **outs)
    page, pages_per_req = 16, 64
    slots = (bs * pages_per_req + 1) * page
    ks = [torch.zeros(slots, hkv, hd, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    vs = [torch.zeros(slots, hkv, hd, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    table = torch.arange(1, bs * pages_per_req + 1, dtype=torch.int32, device=device).view(bs, -1)
    req = torch.arange(bs, device=device)
    aux = torch.zeros(bs * n, kh, dtype=torch.bfloat16, device=device)
    hid_c = torch.zeros(bs * P, kh, dtype=torch.bfloat16, device=device)
    cases = {
        "build": lambda: build_tree(spec, st.cand_score, st.cand_tok, st.cand_parent, root, plen,
                                    tree2),
        "build_torch": lambda: build_tree_ref(spec, st.cand_score, st.cand_tok, st.cand_parent,
                                              root, plen, tree2),
        "accept_greedy": lambda: tree_accept(spec, tree.tokens, tree.first_child,
                                             tree.next_sibling, target=target, **outs),
        "accept_sampled": lambda: tree_accept(spec, tree.tokens, tree.first_child,
                                              tree.next_sibling, probs=probs, coins=coins,
                                              final_coin=final, **outs),
        "kv_move": lambda: move_accepted_kv(ks, vs, table, req, plen, outs["accept_index"],
                                            outs["accept_len"], page),
        "hid_gather": lambda: gather_accepted_hidden(aux, outs["accept_index"],
                                                     outs["accept_len"], n, hid_c),
    }
    if spec.steps > 1:
        cases = {"beams_step": beams_step, **cases}
    return cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="perf/out")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the script)")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        shape = dict(vd=64, v=96, layers=2, hkv=2, hd=8, kh=16)
        configs, batches, reps = CONFIGS[:1] + CONFIGS[2:3], [1, 2], 1
    else:
        if device != "cuda":
            p.error("needs a CUDA GPU (use --smoke for a CPU check of the script)")
        shape = dict(vd=32000, v=128256, layers=32, hkv=8, hd=128, kh=3 * 4096)
        configs, batches, reps = CONFIGS, BATCHES, 50
    rows = []
    for steps, topk, n in configs:
        spec = TreeSpec(steps, topk, n)
        for bs in batches:
            for name, fn in _cases(spec, bs, device, **shape).items():
                us = statistics.median(time_us(_graphed(fn, device), warmup=2 if args.smoke else 5,
                                               reps=reps, device=device))
                rows.append({"config": {"steps": steps, "topk": topk, "num_draft_tokens": n},
                             "bs": bs, "kernel": name, "us": round(us, 2)})
            if device == "cuda":
                torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    path = write_json(args.out, "tree_kernels.json", {"device": name, "smoke": args.smoke,
                                                      "rows": rows})
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    print(f"tree kernels, median graph replay us ({name}{', smoke: not a timing' if args.smoke else ''})")
    print(f"{'K/k/n':>8} {'bs':>3} " + " ".join(f"{k:>14}" for k in kernels))
    for steps, topk, n in configs:
        for bs in batches:
            cell = {r["kernel"]: r["us"] for r in rows
                    if r["bs"] == bs and r["config"] == {"steps": steps, "topk": topk,
                                                         "num_draft_tokens": n}}
            print(f"{f'{steps}/{topk}/{n}':>8} {bs:>3} "
                  + " ".join(f"{cell[k]:>14.1f}" if k in cell else f"{'-':>14}" for k in kernels))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
