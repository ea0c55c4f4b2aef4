"""Tree vs chain drafting: accept length on the shipped pair, 8B-shape cycle time, tokens/s.

(a) Mean accept length (tokens per verify: accepted drafts + bonus) of the shipped byte-level
    pair (graphdraft/assets, float32) on held-out prompts (`graphdraft.io.corpus`), greedy and
    temperature 0.7, through `TreeRunner` (eager, torch kernel path: the pair is tiny and
    needs no Triton compile), for chain configs
    (steps 3 / n 4, steps 7 / n 8) and tree configs (topk 4 with n 8 and n 16).
(b) The whole tree cycle (verify + accept + KV move + first draft step + beam steps + tree
    build + commit) as one CUDA graph replay at the Llama-3.1-8B shape (random bf16 target
    and EAGLE-3 head, `perf.models_8b`), prompts of PROMPT_LEN tokens, at bs 1, 8, 32, 64.
    Chain = the same runner with topk 1 (the chain's cycle in this runner, not the Engine's:
    `make perf-e2e` times the Engine's chain cycle).
(c) Projected tokens/s = bs * accept_mean(a, greedy) / cycle_ms(b) (and at temperature 0.7).

The shipped head accepts 3.6 of 4 on chain 3/1/4: too close to the ceiling for a tree to show
much. `--weak-head-steps N` (default WEAK_HEAD_STEPS; 0: off) also trains a weaker EAGLE-3 head
for the shipped target in the same run (`graphdraft.train.train_head`: N steps of batch
WEAK_HEAD_BATCH x 256, seeded, no self-distillation pool, no compile; seconds on the GPU) and
measures (a) for it too; every (a) row names its head (`head`: "shipped" / "weak (N steps)"),
and (c) uses the shipped head's accept lengths.

Writes DIR/<date>-h200-tree.json: {"device", "smoke", "rows": [{"config": {"steps", "topk",
"num_draft_tokens"}, "bs", "accept_mean", "accept_mean_t07", "cycle_ms", "tokens_per_s",
"tokens_per_s_t07"}], "accept": [...per head, config and temperature...], "weak_head": {...}}
and prints a table.
`--smoke` runs tiny random models on the CPU (a check of the script, not a timing).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import statistics
import time
from pathlib import Path

import torch

import graphdraft
from graphdraft.runtime.tree import TreeSpec
from graphdraft.serving.tree_cycle import TreeRunner
from perf.timing import time_us, write_json

CONFIGS = [(3, 1, 4), (7, 1, 8), (5, 4, 8), (7, 4, 8), (3, 4, 16), (7, 4, 16)]
"""(steps, topk, num_draft_tokens): chain 3/4 and 7/8; tree 4 beams with 8 and 16 nodes."""
CYCLE_CONFIGS = [(3, 1, 4), (5, 4, 8), (7, 1, 8), (3, 4, 16), (7, 4, 8)]
"""(b)'s configs, most wanted first: a config that would start past `--budget-s` is skipped."""
BATCHES = [1, 8, 32, 64]
WEAK_HEAD_STEPS = 240
"""Head steps of the weak head, chosen on the CPU (fp32, 4 held-out prompts, 32 new tokens;
chain 3/1/4 greedy accept: 30 steps 1.76, 80 steps 2.06, 160 steps 2.49, 240 steps 2.61
(T 0.7: 2.42; tree 5/4/8 3.28); the shipped head 3.57): about 2.5-3 of 4."""
WEAK_HEAD_BATCH = 16
PROMPT_LEN = 512
ASSETS = Path(graphdraft.__file__).resolve().parent / "assets"


def train_weak_head(steps: int, device, out_dir: Path, *, seed: int = 0, context: int = 256,
                    eval_windows: int = 16) -> tuple[object, dict]:
    """A weaker EAGLE-3 head for the shipped target: `steps` head-training steps (seeded, no
    pool, no compile) written to `out_dir`; returns (the head loaded beside a float32 target,
    a summary: steps, seconds, held-out metrics). `context` / `eval_windows`: the training
    window and the held-out windows (smaller for the CPU smoke run)."""
    from graphdraft.io.checkpoint import load_model_pair
    from graphdraft.train.train import HeadRun, train_head
    t0 = time.perf_counter()
    run = HeadRun(seed=seed, steps=steps, batch=WEAK_HEAD_BATCH, warmup=min(10, steps),
                  context=context, compile=False, eval_windows=eval_windows, log_every=max(steps, 1), generated=0,
                  target=str(ASSETS / "target"), out=str(out_dir), save_dtype="float32",
                  device="cuda" if torch.device(device).type == "cuda" else "cpu")
    summary = train_head(run)
    _, head, _ = load_model_pair(ASSETS / "target", out_dir, dtype="float32", device=device)
    return head, {"steps": steps, "seconds": round(time.perf_counter() - t0, 1),
                  "heldout": summary["heldout"], "batch": WEAK_HEAD_BATCH, "seed": seed}


def accept_lengths(target, head, prompts, configs, *, new_tokens: int, device,
                   head_name: str = "shipped") -> list[dict]:
    """(a): mean accept length per config and temperature (one batch of all prompts); rows
    carry `head` = head_name."""
    rows = []
    for steps, topk, n in configs:
        spec = TreeSpec(steps, topk, n)
        for temp in (0.0, 0.7):
            r = TreeRunner(target, head, spec, max_bs=len(prompts), page_size=16,
                           max_context_len=min(256, target.config.max_position_embeddings),
                           enforce_eager=True, kernels=target.kernels.with_backend("torch"),
                           sampling=temp > 0, seed=0)
            _, acc = r.generate(prompts, new_tokens, temperature=temp)
            rows.append({"config": {"steps": steps, "topk": topk, "num_draft_tokens": n},
                         "head": head_name, "temperature": temp,
                         "accept_mean": round(sum(acc) / len(acc), 4), "verifies": len(acc)})
            del r
    return rows


def cycle_times(target, head, configs, batches, *, prompt_len: int, device, reps: int,
                ctx: int, deadline: float = float("inf")) -> list[dict]:
    """(b): median graph-replay time (ms) of the whole cycle per config and bs; configs not
    started by `deadline` (time.perf_counter) are skipped (printed)."""
    rows = []
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    max_bs = max(batches)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
               for _ in range(max_bs)]
    for steps, topk, n in configs:
        spec = TreeSpec(steps, topk, n)
        t0 = time.perf_counter()
        if t0 > deadline:
            print(f"  {steps}/{topk}/{n}: skipped (time budget spent)", flush=True)
            continue
        r = TreeRunner(target, head, spec, max_bs=max_bs, page_size=16, max_context_len=ctx,
                       cuda_graph_bs=batches)
        r.capture_graphs()
        cap = time.perf_counter() - t0
        r.add(prompts, ctx - prompt_len - n - spec.P - 2)
        snap = r.state_snapshot()
        for bs in batches:
            one = functools.partial(r.graphs.run, bs, padded_bs=bs)
            r.restore_state(snap)  # every bs starts from the prefilled state
            ms = statistics.median(time_us(one, warmup=3, reps=reps, device=device)) / 1e3
            rows.append({"config": {"steps": steps, "topk": topk, "num_draft_tokens": n},
                         "bs": bs, "cycle_ms": round(ms, 4), "capture_s": round(cap, 2)})
            print(f"  {steps}/{topk}/{n} bs {bs}: {ms:.3f} ms", flush=True)
        r.reset()
        del r
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _tokens_per_s(row: dict, accept: float | None) -> float | None:
    """bs * accept / cycle time: tokens per second of the batch."""
    return None if accept is None else round(row["bs"] * accept / row["cycle_ms"] * 1e3, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="perf/out")
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU (script check)")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="start no (b) config after this many seconds (default 200)")
    p.add_argument("--weak-head-steps", type=int, default=None,
                   help=f"also measure (a) with a head trained this many steps here (0: off; "
                        f"default {WEAK_HEAD_STEPS}, smoke 1)")
    p.add_argument("--accept-only", action="store_true",
                   help="(a) only: no 8B-shape cycle timing (e.g. choosing --weak-head-steps "
                        "on the CPU: accept lengths are not timings)")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if not args.smoke and device != "cuda" and not args.accept_only:
        p.error("needs a CUDA GPU (use --smoke for a CPU check of the script, --accept-only "
                "for accept lengths on the CPU)")
    if args.weak_head_steps is not None and args.weak_head_steps < 0:
        p.error(f"argument --weak-head-steps: expected an int >= 0, got {args.weak_head_steps}")
    weak_steps = args.weak_head_steps if args.weak_head_steps is not None else (
        1 if args.smoke else WEAK_HEAD_STEPS)
    weak = None
    t_start = time.perf_counter()
    if args.smoke:
        from graphdraft.config import ModelConfig
        from graphdraft.models.random_models import random_model_pair
        tc = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         intermediate_size=64, num_hidden_layers=4, vocab_size=61,
                         max_position_embeddings=512, rope_theta=10000.0,
                         aux_hidden_state_layer_ids=(0, 1, 2))
        hc = tc.replace(num_hidden_layers=1, intermediate_size=48, num_aux_hidden_states=3)
        pair = random_model_pair(tc, hc, torch.float32, 0, std=0.5)
        prompts = [[1, 2, 3, 4], [5, 6, 7]]
        configs, cyc_configs, batches = CONFIGS[:1] + CONFIGS[2:3], CONFIGS[:1] + CONFIGS[2:3], [1, 2]
        acc = accept_lengths(*pair, prompts, configs, new_tokens=6, device=device)
        if weak_steps:  # the weak head trains for the shipped target (its config is fixed)
            weak = _weak_accept(weak_steps, prompts, configs[:1], 6, device, smoke=True)
        cyc = cycle_times(*pair, cyc_configs, batches, prompt_len=8, device=device, reps=1, ctx=64)
    else:
        from graphdraft.io.checkpoint import load_model_pair
        from graphdraft.train.evaluate import prompt_ids
        from perf.models_8b import build_pair
        target, head, _ = load_model_pair(ASSETS / "target", ASSETS / "eagle3", dtype="float32",
                                          device=device)
        prompts = prompt_ids(16, 96)
        configs, cyc_configs, batches = CONFIGS, CYCLE_CONFIGS, BATCHES
        print("(a) accept length, shipped pair, 16 held-out prompts, 64 new tokens", flush=True)
        acc = accept_lengths(target, head, prompts, configs, new_tokens=64, device=device)
        if weak_steps:
            weak = _weak_accept(weak_steps, prompts, configs, 64, device)
        del target, head
        if args.accept_only:
            cyc = []
            _report(args, device, t_start, acc, cyc, weak)
            return 0
        print(f"(b) 8B-shape cycle ({time.perf_counter() - t_start:.0f} s so far)", flush=True)
        target, head = build_pair(device)
        cyc = cycle_times(target, head, cyc_configs, batches, prompt_len=PROMPT_LEN, device=device,
                          reps=20, ctx=1024, deadline=t_start + args.budget_s)
    _report(args, device, t_start, acc, cyc, weak)
    return 0


def _weak_accept(steps: int, prompts, configs, new_tokens: int, device, smoke: bool = False):
    """Train the weak head (`train_weak_head`) and measure (a) with it: (rows, summary)."""
    import tempfile

    from graphdraft.io.checkpoint import load_model_pair
    print(f"(a) weak head: training {steps} steps for the shipped target", flush=True)
    with tempfile.TemporaryDirectory(prefix="weak-head-") as d:
        kw = dict(context=32, eval_windows=2) if smoke else {}
        head, summary = train_weak_head(steps, device, Path(d), **kw)
    target, _, _ = load_model_pair(ASSETS / "target", ASSETS / "eagle3", dtype="float32",
                                   device=device)
    if prompts and max(max(p) for p in prompts) >= target.config.vocab_size:
        raise ValueError("prompts: expected byte ids of the shipped target")
    rows = accept_lengths(target, head, prompts, configs, new_tokens=new_tokens, device=device,
                          head_name=f"weak ({steps} steps)")
    print(f"  weak head: {summary['seconds']} s, held-out {summary['heldout']}", flush=True)
    return rows, summary


def _report(args, device, t_start, acc, cyc, weak) -> None:
    if weak is not None:
        acc = acc + weak[0]
    by_cfg = {}
    for a in acc:
        if a["head"] != "shipped":
            continue
        key = tuple(a["config"].values())
        by_cfg.setdefault(key, {})[a["temperature"]] = a["accept_mean"]
    rows = []
    for c in cyc:
        key = tuple(c["config"].values())
        a0, a7 = by_cfg.get(key, {}).get(0.0), by_cfg.get(key, {}).get(0.7)
        rows.append({**c, "accept_mean": a0, "accept_mean_t07": a7,
                     "tokens_per_s": _tokens_per_s(c, a0), "tokens_per_s_t07": _tokens_per_s(c, a7)})
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    path = write_json(args.out, f"{date}-h200-tree.json",
                      {"device": name, "smoke": args.smoke, "rows": rows, "accept": acc,
                       "weak_head": None if weak is None else weak[1],
                       "seconds": round(time.perf_counter() - t_start, 1)})
    note = ", smoke: not a timing" if args.smoke else ""
    print(f"\n(a) mean accept length, shipped target ({name}{note})")
    table: dict = {}
    for a in acc:
        key = (a["head"], "/".join(map(str, a["config"].values())))
        table.setdefault(key, {})[a["temperature"]] = a["accept_mean"]
    print(f"{'head':>16} {'K/k/n':>8} {'greedy':>8} {'T=0.7':>8}")
    for (h, key), v in table.items():
        print(f"{h:>16} {key:>8} {v.get(0.0, float('nan')):>8.3f} {v.get(0.7, float('nan')):>8.3f}")
    print(f"\n(b, c) cycle ms and projected tokens/s ({name}{note})")
    print(f"{'K/k/n':>8} {'bs':>4} {'cycle ms':>9} {'accept':>7} {'tok/s':>9} {'tok/s T.7':>10}")
    for r in rows:
        key = "/".join(map(str, r["config"].values()))
        print(f"{key:>8} {r['bs']:>4} {r['cycle_ms']:>9.3f} {r['accept_mean'] or 0:>7.3f} "
              f"{r['tokens_per_s'] or 0:>9.1f} {r['tokens_per_s_t07'] or 0:>10.1f}")
    print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    raise SystemExit(main())
