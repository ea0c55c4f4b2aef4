"""Tree vs chain drafting: accept length on the shipped pair, 8B-shape cycle time, tokens/s.

(a) Mean accept length (tokens per verify: accepted drafts + bonus) of the shipped byte-level
    pair (graphdraft/assets, float32) on PROMPTS held-out prompts (`heldout_windows`), greedy
    and temperature 0.7, through `TreeRunner` (eager, torch kernel path: the pair is tiny and
    needs no Triton compile), for chain configs
    (steps 3 / n 4, steps 7 / n 8) and tree configs (topk 4 with n 8 and n 16; with the weak
    head also SHAPES_N8). Every tree row with a chain of the same n carries `vs_chain`: the
    ratio of mean accept lengths and its 95 % bootstrap interval over held-out documents
    (`accept_ratio_ci`), so that 1.14 and 1.15 can be told apart or said not to be. RANK_AB:
    weak-head trees at T 0.7 drafted again with candidates scored at T 1 (`vs_rank_t1`:
    what scoring sampled rows at their temperature changes).
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
"tokens_per_s_t07"}], "accept": [...per head, config and temperature: accept_mean, verifies,
per_prompt (each prompt's accept lengths, one string of space-separated ints per prompt:
the file stays small), vs_chain {chain, ratio, lo, hi, se, prompts, groups,
reps}...], "prompt_groups": [document of each prompt], "weak_head": {...}}
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
RANK_AB = [(7, 4, 8), (5, 4, 8)]
"""Weak head, temperature 0.7: these trees also drafted with candidates scored at T 1 (the
rule before sampled rows were scored at their temperature: `runtime.beams`, "Scores"), the
control of `vs_rank_t1`."""
SHAPES_N8 = [(4, 2, 8), (5, 2, 8), (6, 2, 8), (7, 2, 8), (4, 3, 8), (5, 3, 8), (6, 3, 8),
             (7, 3, 8), (4, 4, 8), (6, 4, 8)]
"""More tree shapes at n = 8 (topk 2-4, steps 4-7), measured with the weak head only (where
chain and tree differ enough to rank them): which tree is best at the chain 7/1/8's budget."""
PROMPTS = 64
"""Held-out prompts of (a) (`heldout_windows`: 43 held-out documents, a second window from
21 of them); one batch."""
PROMPT_BYTES = 96
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


def heldout_windows(count: int, length: int = PROMPT_BYTES) -> tuple[list[list[int]], list[int]]:
    """`count` byte-token prompts of `length` bytes from the held-out documents of
    `graphdraft.io.corpus`, and the index of the document each came from (`[count]`: the
    bootstrap of `accept_ratio_ci` resamples documents, since two windows of one document are
    not independent). Round 1 takes, from every document (Python sources first, in name
    order), the window at the first line start at or after a third of it (the Python ones are
    `train.evaluate.prompt_ids`' prompts); later rounds the windows at 2/3, 1/6, 1/2, 5/6,
    each kept only if full length, not overlapping a window already taken from that
    document and not equal to any window taken (two held-out codec tables share text).
    Deterministic. ValueError if the corpus has fewer such windows."""
    from graphdraft.io.bytes_tokenizer import ByteTokenizer
    from graphdraft.io.corpus import documents, is_held_out
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count: expected an int >= 1, got {count!r}")
    docs = documents(is_held_out)
    docs = [d for d in docs if d[0].endswith(".py")] + [d for d in docs if not d[0].endswith(".py")]
    tok = ByteTokenizer()
    taken: list[list[int]] = [[] for _ in docs]
    prompts, groups, seen = [], [], set()
    for frac in (1 / 3, 2 / 3, 1 / 6, 1 / 2, 5 / 6):
        for g, (_, d) in enumerate(docs):
            start = d.find(b"\n", int(len(d) * frac)) + 1
            chunk = d[start: start + length]
            if (start == 0 or len(chunk) != length or chunk in seen
                    or any(abs(start - t) < length for t in taken[g])):
                continue
            taken[g].append(start)
            seen.add(chunk)
            prompts.append(tok.encode(chunk))
            groups.append(g)
            if len(prompts) == count:
                return prompts, groups
    raise ValueError(f"count: only {len(prompts)} held-out windows of {length} bytes, asked for {count}")


def accept_ratio_ci(tree_rows: list[list[int]], chain_rows: list[list[int]],
                    groups: list[int] | None = None, *, reps: int = 4000, level: float = 0.95,
                    seed: int = 0) -> dict:
    """Ratio of mean accept lengths tree / chain (mean = accepted tokens / verifies over all
    prompts, as `accept_mean`) with a bootstrap over prompts: `tree_rows[i]` / `chain_rows[i]`
    the accept lengths of prompt i's verifies under each config (same prompts, in the same
    order: a paired bootstrap); `groups [prompts]` (optional) a cluster id per prompt, whole
    clusters resampled (prompts cut from one document). `reps` resamples (seeded).
    Returns {"ratio", "lo", "hi" (percentile interval at `level`), "se" (bootstrap standard
    error), "prompts", "groups", "reps"}."""
    if len(tree_rows) != len(chain_rows) or not tree_rows:
        raise ValueError(f"tree_rows, chain_rows: expected the same number (>= 1) of prompts, "
                         f"got {len(tree_rows)} and {len(chain_rows)}")
    if any(not r for r in tree_rows) or any(not r for r in chain_rows):
        raise ValueError("tree_rows, chain_rows: expected at least one verify per prompt")
    if groups is None:
        groups = list(range(len(tree_rows)))
    if len(groups) != len(tree_rows):
        raise ValueError(f"groups: expected one id per prompt ({len(tree_rows)}), got {len(groups)}")
    if not 0 < level < 1:
        raise ValueError(f"level: expected in (0, 1), got {level}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 10:
        raise ValueError(f"reps: expected an int >= 10, got {reps!r}")
    ids = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    gi = torch.tensor([ids[g] for g in groups])
    ng = len(ids)
    stats = torch.zeros(ng, 4, dtype=torch.float64)        # tree sum, tree n, chain sum, chain n
    per = torch.tensor([[sum(t), len(t), sum(c), len(c)] for t, c in zip(tree_rows, chain_rows, strict=True)],
                       dtype=torch.float64)
    stats.index_add_(0, gi, per)
    gen = torch.Generator().manual_seed(seed)
    draw = torch.randint(0, ng, (reps, ng), generator=gen)
    w = torch.zeros(reps, ng, dtype=torch.float64).scatter_add_(
        1, draw, torch.ones(reps, ng, dtype=torch.float64))
    agg = w @ stats                                          # [reps, 4]
    boot = (agg[:, 0] / agg[:, 1]) / (agg[:, 2] / agg[:, 3])
    tot = stats.sum(0)
    ratio = float((tot[0] / tot[1]) / (tot[2] / tot[3]))
    a = (1 - level) / 2
    lo, hi = torch.quantile(boot, torch.tensor([a, 1 - a], dtype=torch.float64)).tolist()
    return {"ratio": round(ratio, 4), "lo": round(lo, 4), "hi": round(hi, 4),
            "se": round(float(boot.std()), 4), "prompts": len(tree_rows), "groups": ng,
            "reps": reps}


def add_chain_ratios(rows: list[dict], groups: list[int] | None) -> None:
    """Each tree row of `rows` (accept_lengths' rows with `per_prompt`) gets `vs_chain` =
    `accept_ratio_ci` against the chain of the same n (steps n-1, topk 1), same head and
    temperature, where that chain was measured (else None)."""
    chains = {(r["head"], r["temperature"], r["config"]["num_draft_tokens"]): r for r in rows
              if r["config"]["topk"] == 1 and r.get("rank_at_temperature", True)}
    for r in rows:
        if r["config"]["topk"] == 1:
            continue
        c = chains.get((r["head"], r["temperature"], r["config"]["num_draft_tokens"]))
        r["vs_chain"] = None if c is None else {
            "chain": "/".join(map(str, c["config"].values())),
            **accept_ratio_ci(r["per_prompt"], c["per_prompt"], groups)}


def add_rank_ratios(rows: list[dict], groups: list[int] | None) -> None:
    """Each row scored at its temperature with a control row (`rank_at_temperature` False:
    same head, config and temperature) gets `vs_rank_t1` = `accept_ratio_ci` against it."""
    ctl = {(r["head"], r["temperature"], tuple(r["config"].values())): r for r in rows
           if not r.get("rank_at_temperature", True)}
    for r in rows:
        c = ctl.get((r["head"], r["temperature"], tuple(r["config"].values())))
        if c is not None and r.get("rank_at_temperature", True):
            r["vs_rank_t1"] = accept_ratio_ci(r["per_prompt"], c["per_prompt"], groups)


def accept_lengths(target, head, prompts, configs, *, new_tokens: int, device,
                   head_name: str = "shipped", temps=(0.0, 0.7),
                   rank_at_temperature: bool = True) -> list[dict]:
    """(a): mean accept length per config and temperature (one batch of all prompts); rows
    carry `head` = head_name, `rank_at_temperature` (False: the control of `RANK_AB`, sampled
    rows' candidates scored at T 1) and `per_prompt` (every prompt's accept lengths, for
    `accept_ratio_ci`)."""
    rows = []
    for steps, topk, n in configs:
        spec = TreeSpec(steps, topk, n)
        for temp in temps:
            r = TreeRunner(target, head, spec, max_bs=len(prompts), page_size=16,
                           max_context_len=min(256, target.config.max_position_embeddings),
                           enforce_eager=True, kernels=target.kernels.with_backend("torch"),
                           sampling=temp > 0, seed=0)
            r.drafter.rank_at_temperature = rank_at_temperature
            t0 = time.perf_counter()
            _, per = r.generate(prompts, new_tokens, temperature=temp, by_row=True)
            acc = [a for row in per for a in row]
            rows.append({"config": {"steps": steps, "topk": topk, "num_draft_tokens": n},
                         "head": head_name, "temperature": temp,
                         "rank_at_temperature": rank_at_temperature,
                         "accept_mean": round(sum(acc) / len(acc), 4), "verifies": len(acc),
                         "per_prompt": per})
            print(f"  {head_name} {steps}/{topk}/{n} T {temp}"
                  f"{'' if rank_at_temperature else ' (ranked at T 1)'}: "
                  f"{rows[-1]['accept_mean']:.3f} ({time.perf_counter() - t0:.1f} s)", flush=True)
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
    p.add_argument("--prompts", type=int, default=PROMPTS,
                   help=f"held-out prompts of (a) (default {PROMPTS}; `heldout_windows`)")
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
        prompts, groups = [[1, 2, 3, 4], [5, 6, 7], [8, 9]], [0, 0, 1]
        configs, cyc_configs, batches = CONFIGS[:1] + CONFIGS[2:3], CONFIGS[:1] + CONFIGS[2:3], [1, 2]
        acc = accept_lengths(*pair, prompts, configs + [(3, 2, 4)], new_tokens=6, device=device)
        acc += accept_lengths(*pair, prompts, [(3, 2, 4)], new_tokens=6, device=device,
                              temps=(0.7,), rank_at_temperature=False)
        if weak_steps:  # the weak head trains for the shipped target (its config is fixed)
            weak = _weak_accept(weak_steps, prompts, configs[:1], 6, device, smoke=True)
        cyc = cycle_times(*pair, cyc_configs, batches, prompt_len=8, device=device, reps=1, ctx=64)
    else:
        from graphdraft.io.checkpoint import load_model_pair
        from perf.models_8b import build_pair
        target, head, _ = load_model_pair(ASSETS / "target", ASSETS / "eagle3", dtype="float32",
                                          device=device)
        want = args.prompts
        while True:  # the corpus is this machine's stdlib: a stripped one may hold fewer windows
            try:
                prompts, groups = heldout_windows(want)
                break
            except ValueError as e:
                if want <= 8:
                    raise
                print(f"  {e}: trying {want - 8}", flush=True)
                want -= 8
        configs, cyc_configs, batches = CONFIGS, CYCLE_CONFIGS, BATCHES
        print(f"(a) accept length, shipped pair, {len(prompts)} held-out prompts "
              f"({len(set(groups))} documents), 64 new tokens", flush=True)
        acc = accept_lengths(target, head, prompts, configs, new_tokens=64, device=device)
        if weak_steps:
            weak = _weak_accept(weak_steps, prompts, configs + SHAPES_N8, 64, device)
        del target, head
        if args.accept_only:
            cyc = []
            _report(args, device, t_start, acc, cyc, weak, groups)
            return 0
        print(f"(b) 8B-shape cycle ({time.perf_counter() - t_start:.0f} s so far)", flush=True)
        target, head = build_pair(device)
        cyc = cycle_times(target, head, cyc_configs, batches, prompt_len=PROMPT_LEN, device=device,
                          reps=20, ctx=1024, deadline=t_start + args.budget_s)
    _report(args, device, t_start, acc, cyc, weak, groups)
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
    if not smoke:
        rows += accept_lengths(target, head, prompts, RANK_AB, new_tokens=new_tokens,
                               device=device, head_name=f"weak ({steps} steps)", temps=(0.7,),
                               rank_at_temperature=False)
    print(f"  weak head: {summary['seconds']} s, held-out {summary['heldout']}", flush=True)
    return rows, summary


def _report(args, device, t_start, acc, cyc, weak, groups) -> None:
    if weak is not None:
        acc = acc + weak[0]
    add_chain_ratios(acc, groups)
    add_rank_ratios(acc, groups)
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
                      {"device": name, "smoke": args.smoke, "rows": rows,
                       "accept": [{**a, "per_prompt": [" ".join(map(str, p)) for p in a["per_prompt"]]}
                                  for a in acc],
                       "prompts": len(groups), "prompt_groups": groups,
                       "weak_head": None if weak is None else weak[1],
                       "seconds": round(time.perf_counter() - t_start, 1)})
    note = ", smoke: not a timing" if args.smoke else ""
    print(f"\n(a) mean accept length, shipped target ({name}{note})")
    table: dict = {}
    for a in acc:
        key = (a["head"], "/".join(map(str, a["config"].values()))
               + ("" if a.get("rank_at_temperature", True) else " rank T1"))
        table.setdefault(key, {})[a["temperature"]] = a
    ci = lambda a: ("" if a is None or not a.get("vs_chain") else
                    "{ratio:.3f}x [{lo:.3f}, {hi:.3f}]".format(**a["vs_chain"]))
    mean = lambda a: float("nan") if a is None else a["accept_mean"]
    print(f"{'head':>16} {'K/k/n':>15} {'greedy':>8} {'vs chain (95% CI)':>24} {'T=0.7':>8} "
          f"{'vs chain (95% CI)':>24}")
    for (h, key), v in table.items():
        g, t = v.get(0.0), v.get(0.7)
        print(f"{h:>16} {key:>15} {mean(g):>8.3f} {ci(g):>24} {mean(t):>8.3f} {ci(t):>24}")
    for a in acc:
        if a.get("vs_rank_t1"):
            print("{} {} T {}: scored at T vs at T 1: {ratio:.3f}x [{lo:.3f}, {hi:.3f}]".format(
                a["head"], "/".join(map(str, a["config"].values())), a["temperature"],
                **a["vs_rank_t1"]))
    print(f"\n(b, c) cycle ms and projected tokens/s ({name}{note})")
    print(f"{'K/k/n':>8} {'bs':>4} {'cycle ms':>9} {'accept':>7} {'tok/s':>9} {'tok/s T.7':>10}")
    for r in rows:
        key = "/".join(map(str, r["config"].values()))
        print(f"{key:>8} {r['bs']:>4} {r['cycle_ms']:>9.3f} {r['accept_mean'] or 0:>7.3f} "
              f"{r['tokens_per_s'] or 0:>9.1f} {r['tokens_per_s_t07'] or 0:>10.1f}")
    print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    raise SystemExit(main())
