"""Where a tree loses accept length against what its own draft could give (issue #20 item 2).

Greedy only (the target's greedy continuation is known once the run is over: greedy tree
decoding emits exactly the target's greedy tokens). `trace` runs `TreeRunner` eagerly (torch
kernel path; the CPU in fp32 is fine: accept lengths are not timings) and records, at every
verify of a live row, the drafter's whole candidate store (`cand_score / cand_tok /
cand_parent [M]`) and which candidates the tree build selected (`cand_node [M]`), with the
index of the row's root in its output. `analyze` then judges every candidate against the
target's continuation:

- oracle: the deepest candidate whose root-to-node tokens equal the continuation (the best
  n-1-node ancestor-closed subset of ALL drafted candidates holds its path: depth <= K <= n-1
  whenever K < n) against the depth the tree accepted;
- loss at the level the tree stopped: `depth cap` (accepted K drafts), `not selected` (the
  right token was a drafted child of the accepted node but outside the n-1 nodes), `pruned`
  (the accepted node was not kept as a beam, so it had no drafted children), `draft miss`
  (it was expanded, the right token was not among its top k);
- calibration per depth: draft cumulative probability exp(cand_score) against the measured
  acceptance (path matched), and the local probability exp(score - parent's score) against
  the acceptance given the parent's, over candidates whose parent matched;
- selection rules replayed offline on the same candidate stores (exact for greedy: the verify
  decides; a rule only picks which n-1 candidates are verified): `cum` (the shipped rule: top
  n-1 by cumulative log-prob), `depth_cal` (cumulative log of the per-depth calibrated local
  probabilities, fitted on OTHER prompts: `--fit` windows from training documents).

Findings (2026-12-04, CPU fp32, 16 held-out prompts, 64 new tokens, tree 7/4/8, greedy):
- shipped head: tree 4.521, oracle 5.507; at the tree's stop the right token was drafted but
  not among the 7 verified nodes in 57 % of verifies (no verify budget holds every branch),
  depth cap 11 %, never drafted under the accepted node (draft miss or pruned, not split in
  that run) 32 %; cumulative probability calibrated per depth
  (e.g. depth 3: 0.043 drafted vs 0.053 accepted; depth 7: 0.015 vs 0.015);
- weak head (240 steps, trained on the CPU): tree 2.985, oracle 3.538; draft miss 59 % (the
  accepted node's top 4 lacked the target's token), not selected 37 %, depth cap 3 %, pruned
  0; the head is underconfident at depth (local 0.162 drafted vs 0.230 accepted at depth 7),
  and the depth-calibrated rule replayed on the same stores gives 2.994 (+0.3 %): the
  selection is not where the tree loses; the draft's top k is.
No defect found: ties (`score_key`), vocab map (covered by `tests/test_tree_build.py`; the
shipped pair has none), level-K candidates verified (selected per depth > 0 at depth K),
beams never pruned under a node the tree accepted (`pruned` 0).

Run: `PYTHONPATH=. python scripts/tree_oracle.py --head weak:/path/to/head --configs 7/4/8 5/4/8`
(`--head shipped` for the shipped head; a weak head: `perf.tree.train_weak_head`). Prints a
table and writes `--out` JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from graphdraft.runtime.tree import TreeSpec
from graphdraft.serving.tree_cycle import TreeRunner

LOSSES = ("depth cap", "not selected", "pruned", "draft miss")


@torch.inference_mode()
def trace(target, head, spec: TreeSpec, prompts: list[list[int]], new_tokens: int) -> tuple[list, list]:
    """Greedy run of `prompts` (one batch) -> (records, outputs). A record per verify of a live
    row: {"row", "pos" (index of the root in outputs[row]), "accept", "score", "tok",
    "parent", "node" (lists of M)}. `outputs[row]`: every token the row emitted."""
    r = TreeRunner(target, head, spec, max_bs=len(prompts), page_size=16,
                   max_context_len=min(256, target.config.max_position_embeddings),
                   enforce_eager=True, kernels=target.kernels.with_backend("torch"))
    firsts = r.add(prompts, new_tokens)
    outs = [[t] for t in firsts]
    recs = []
    while not all(r.done):
        bs = r.bs
        st, tree = r.drafter.beams.rows(bs), r.drafter.tree.rows(bs)
        snap = [t.clone() for t in (st.cand_score, st.cand_tok, st.cand_parent, tree.cand_node)]
        res = r.step()
        for row in range(bs):
            if r.done[row]:
                continue
            recs.append({"row": row, "pos": len(outs[row]) - 1, "accept": res.accept[row],
                         "score": snap[0][row].tolist(), "tok": snap[1][row].tolist(),
                         "parent": snap[2][row].tolist(), "node": snap[3][row].tolist()})
            outs[row].extend(res.tokens[row])
            if len(outs[row]) >= new_tokens:
                r.finish(row)
    r.reset()
    return recs, outs


def _paths(rec: dict, spec: TreeSpec):
    """Per candidate: depth, and its tokens root-to-node (parents precede children)."""
    toks: list[tuple] = []
    for t, p in zip(rec["tok"], rec["parent"], strict=True):
        toks.append((toks[p] if p >= 0 else ()) + (t,))
    return toks


def judged(recs: list, outs: list, spec: TreeSpec) -> list[dict]:
    """Records whose continuation covers K tokens, with per candidate `depth`, `match` (path
    tokens == the target's greedy continuation) and `cont`."""
    out = []
    for rec in recs:
        cont = outs[rec["row"]][rec["pos"] + 1: rec["pos"] + 1 + spec.steps]
        if len(cont) < spec.steps:
            continue
        paths = _paths(rec, spec)
        match = [list(p) == cont[: len(p)] for p in paths]
        out.append({**rec, "depth": [len(p) for p in paths], "match": match, "cont": cont})
    return out


def accept_of(rec: dict, chosen: list[int]) -> int:
    """Greedy accept length (drafts + bonus) of verifying candidates `chosen` (closed under
    ancestors): 1 + the deepest matched chosen candidate."""
    return 1 + max((rec["depth"][m] for m in chosen if rec["match"][m]), default=0)


def select(rec: dict, n: int, score: list[float]) -> list[int]:
    """Top n-1 candidates by `score` (ties to the lower index), closed under ancestors by
    construction when `score` never increases along a path."""
    order = sorted(range(len(score)), key=lambda m: (-score[m], m))
    chosen = order[: n - 1]
    got = set(chosen)
    for m in chosen:
        p = rec["parent"][m]
        if p >= 0 and p not in got:
            raise ValueError("score: expected a rule that never increases along a path "
                             "(a selected candidate's parent was left out)")
    return chosen


def loss_kind(rec: dict, spec: TreeSpec) -> str:
    """Why the tree stopped where it did (module doc)."""
    sel = [m for m, v in enumerate(rec["node"]) if v > 0]
    d = rec["accept"] - 1
    oracle = max((rec["depth"][m] for m in range(len(rec["match"])) if rec["match"][m]), default=0)
    if d == spec.steps:
        return "depth cap"
    if oracle <= d:
        # the accepted node's right child was never drafted: expanded (root or beam) or not
        at = -1 if d == 0 else next(m for m in sel if rec["match"][m] and rec["depth"][m] == d)
        kids = [m for m, p in enumerate(rec["parent"]) if p == at]
        return "draft miss" if kids else "pruned"
    return "not selected"


def calibration(recs: list[dict], spec: TreeSpec) -> dict:
    """Per depth: mean draft cumulative probability vs the fraction of candidates matched;
    mean local probability vs matched given the parent matched (over those candidates)."""
    rows = {}
    for d in range(1, spec.steps + 1):
        cum_q = cum_a = loc_q = loc_a = 0.0
        cnt = cnt_l = 0
        for rec in recs:
            for m, dm in enumerate(rec["depth"]):
                if dm != d:
                    continue
                s, p = rec["score"][m], rec["parent"][m]
                cum_q += math.exp(s)
                cum_a += rec["match"][m]
                cnt += 1
                if p < 0 or rec["match"][p]:
                    loc_q += math.exp(s - (rec["score"][p] if p >= 0 else 0.0))
                    loc_a += rec["match"][m]
                    cnt_l += 1
        rows[d] = {"candidates": cnt, "cum_q": cum_q / max(cnt, 1), "cum_accept": cum_a / max(cnt, 1),
                   "given_parent": cnt_l, "local_q": loc_q / max(cnt_l, 1),
                   "local_accept": loc_a / max(cnt_l, 1)}
    return rows


def fit_depth_calibration(recs: list[dict], spec: TreeSpec, bins: int = 10) -> list[list[float]]:
    """Per depth, a monotone map of the local draft probability to the measured acceptance
    given the parent's (`bins` equal-width bins of q, pooled adjacent violators so that the
    map never decreases in q; a bin with no data takes its neighbour's value): `[K][bins]`."""
    table = []
    for d in range(1, spec.steps + 1):
        acc = [0.0] * bins
        cnt = [0.0] * bins
        for rec in recs:
            for m, dm in enumerate(rec["depth"]):
                p = rec["parent"][m]
                if dm == d and (p < 0 or rec["match"][p]):
                    q = math.exp(rec["score"][m] - (rec["score"][p] if p >= 0 else 0.0))
                    b = min(int(q * bins), bins - 1)
                    acc[b] += rec["match"][m]
                    cnt[b] += 1
        # pool adjacent violators (weighted), ignoring empty bins
        blocks = [[acc[b] + 0.5 * ((b + 0.5) / bins), cnt[b] + 0.5, [b]] for b in range(bins)]
        i = 0
        while i < len(blocks) - 1:
            a, b = blocks[i], blocks[i + 1]
            if a[0] / a[1] > b[0] / b[1]:
                blocks[i: i + 2] = [[a[0] + b[0], a[1] + b[1], a[2] + b[2]]]
                i = max(i - 1, 0)
            else:
                i += 1
        val = [0.0] * bins
        for s, c, bs_ in blocks:
            for b in bs_:
                val[b] = s / c
        table.append(val)
    return table


def depth_cal_score(rec: dict, table: list[list[float]]) -> list[float]:
    """Cumulative log of the calibrated local probabilities along each candidate's path."""
    bins = len(table[0])
    out: list[float] = []
    for m, (s, p) in enumerate(zip(rec["score"], rec["parent"], strict=True)):
        q = math.exp(s - (rec["score"][p] if p >= 0 else 0.0))
        c = table[rec["depth"][m] - 1][min(int(q * bins), bins - 1)]
        out.append((out[p] if p >= 0 else 0.0) + math.log(max(c, 1e-12)))
    return out


def analyze(recs: list[dict], spec: TreeSpec, table=None) -> dict:
    n = spec.n
    losses = {k: 0 for k in LOSSES}
    tree = oracle = 0
    by_depth_sel = [0] * (spec.steps + 1)
    replay = {"cum": 0}
    if table is not None:
        replay["depth_cal"] = 0
    for rec in recs:
        sel = [m for m, v in enumerate(rec["node"]) if v > 0]
        a_tree = accept_of(rec, sel)
        if a_tree != rec["accept"]:
            raise AssertionError(f"replayed accept {a_tree} != measured {rec['accept']}")
        a_orc = 1 + min(n - 1, max((d for d, mt in zip(rec["depth"], rec["match"], strict=True) if mt), default=0))
        tree += a_tree
        oracle += a_orc
        losses[loss_kind(rec, spec)] += 1
        for m in sel:
            by_depth_sel[rec["depth"][m]] += 1
        replay["cum"] += accept_of(rec, select(rec, n, rec["score"]))
        if table is not None:
            replay["depth_cal"] += accept_of(rec, select(rec, n, depth_cal_score(rec, table)))
    v = max(len(recs), 1)
    return {"verifies": len(recs), "tree": tree / v, "oracle": oracle / v,
            "loss_at_stop": {k: c / v for k, c in losses.items()},
            "selected_per_depth": [c / v for c in by_depth_sel[1:]],
            "replay": {k: c / v for k, c in replay.items()},
            "calibration": calibration(recs, spec)}


def training_windows(count: int, length: int = 96) -> list[list[int]]:
    """Prompts from TRAINING documents (for fitting a calibration without the held-out ones):
    the window at a third of each of the first `count` documents (name order)."""
    from graphdraft.io.bytes_tokenizer import ByteTokenizer
    from graphdraft.io.corpus import documents, is_held_out
    tok, out = ByteTokenizer(), []
    for name, d in documents(lambda nm: not is_held_out(nm)):
        if not name.endswith(".py"):
            continue
        start = d.find(b"\n", len(d) // 3) + 1
        chunk = d[start: start + length]
        if start > 0 and len(chunk) == length:
            out.append(tok.encode(chunk))
        if len(out) == count:
            break
    return out


def main(argv=None) -> int:
    from graphdraft.io.checkpoint import load_model_pair
    from perf.tree import ASSETS, heldout_windows
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="shipped", help="shipped, or NAME:DIR of a trained head")
    ap.add_argument("--configs", nargs="+", default=["7/4/8", "5/4/8"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--fit", type=int, default=16, help="training-document prompts to fit depth_cal")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="/tmp/tree_oracle.json")
    a = ap.parse_args(argv)
    head_dir = ASSETS / "eagle3" if a.head == "shipped" else Path(a.head.split(":", 1)[1])
    target, head, _ = load_model_pair(ASSETS / "target", head_dir, dtype="float32", device="cpu")
    prompts, _ = heldout_windows(a.prompts)
    fit_prompts = training_windows(a.fit) if a.fit else []
    result = {}
    for c in a.configs:
        spec = TreeSpec(*map(int, c.split("/")))
        t0 = time.perf_counter()
        table = None
        if fit_prompts:
            fr, fo = trace(target, head, spec, fit_prompts, a.new_tokens)
            table = fit_depth_calibration(judged(fr, fo, spec), spec)
        recs, outs = trace(target, head, spec, prompts, a.new_tokens)
        res = analyze(judged(recs, outs, spec), spec, table)
        res["depth_cal_table"] = table
        result[c] = res
        print(f"== {a.head.split(':')[0]} {c}: {res['verifies']} verifies ({time.perf_counter() - t0:.0f} s)")
        print(f"   tree {res['tree']:.3f}  oracle {res['oracle']:.3f}  replay {res['replay']}")
        print("   stop: " + ", ".join(f"{k} {v:.3f}" for k, v in res["loss_at_stop"].items()))
        print("   selected per depth: " + " ".join(f"{x:.2f}" for x in res["selected_per_depth"]))
        for d, row in res["calibration"].items():
            print(f"   depth {d}: cum q {row['cum_q']:.3f} acc {row['cum_accept']:.3f} | local q "
                  f"{row['local_q']:.3f} acc {row['local_accept']:.3f} (n {row['given_parent']})")
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
