"""The trained byte-level pair shipped in graphdraft/assets (see its MODEL_CARD.md).

- it loads through `load_model_pair` (bf16 on disk, float32 here) with the shapes it claims;
- the dense training forwards (`graphdraft.train.forward`) and the paged runtime (`Engine`)
  give the same logits: the target's at every decoded position, the head's at every draft
  step (first step and chain steps), max |diff| <= LOGITS_ATOL in float32 on the CPU;
- the shipped head's mean accept length (greedy, 3 draft steps, held-out stdlib prompts,
  through `Engine`) is above TRAINED_MIN_ACCEPT, and a random head's is below RANDOM_MAX_ACCEPT
  (measured by `graphdraft.train.evaluate.mean_accept_length`, which gives the model card's
  figures too);
- `python -m graphdraft demo` uses the pair by default, `--random-models` the random pair.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import graphdraft
from graphdraft.__main__ import main
from graphdraft.io.bytes_tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE
from graphdraft.io.checkpoint import load_model_pair, read_config
from graphdraft.io.corpus import documents, heldout_prompts, is_held_out
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.layers import init_random_
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from graphdraft.train.evaluate import mean_accept_length, prompt_ids, runtime_config
from graphdraft.train.forward import head_ttt_forward, target_forward

ASSETS = Path(graphdraft.__file__).resolve().parent / "assets"
TARGET_DIR, DRAFT_DIR = ASSETS / "target", ASSETS / "eagle3"

LOGITS_ATOL = 5e-4        # float32, dense SDPA vs paged attention (measured: ~1e-5)
TRAINED_MIN_ACCEPT = 2.5  # tokens per verify, N = 4: measured 3.61 here (MODEL_CARD.md)
RANDOM_MAX_ACCEPT = 1.1   # a random head: measured 1.00
STEPS = 3
NUM_PROMPTS, PROMPT_BYTES, NEW_TOKENS = 4, 96, 64


@pytest.fixture(scope="module")
def pair():
    target, head, info = load_model_pair(TARGET_DIR, DRAFT_DIR, torch.float32, "cpu")
    return target, head, info


@pytest.fixture(scope="module")
def prompts():
    return prompt_ids(NUM_PROMPTS, PROMPT_BYTES)


def runtime(max_running_requests: int):
    return runtime_config(max_running_requests, steps=STEPS, device="cpu")


def test_shipped_pair_loads(pair):
    target, head, info = pair
    tc, hc = target.config, head.config
    assert (tc.vocab_size, tc.hidden_size, tc.num_hidden_layers) == (VOCAB_SIZE, 256, 6)
    assert target.aux_layer_ids == (1, 3, 5) == hc.aux_hidden_state_layer_ids
    assert hc.num_hidden_layers == 1 and head.hot_token_ids is None  # full vocab, no d2t
    assert head.embed_tokens is target.embed_tokens                  # shared, not shipped
    assert info.eos_token_ids == (EOS_ID,) and info.extras.bos_token_id == BOS_ID
    assert info.extras.raw.get("graphdraft_tokenizer") == "bytes"
    for d in (TARGET_DIR, DRAFT_DIR):
        assert read_config(d)[1].dtype == torch.bfloat16
    size = sum(p.stat().st_size for d in (TARGET_DIR, DRAFT_DIR) for p in d.iterdir())
    assert size < 20 * 2**20
    assert (ASSETS / "MODEL_CARD.md").is_file()


def test_prompts_are_held_out():
    held = documents(is_held_out)
    assert held and not any(n.startswith("test/") for n, _ in held)
    for text in heldout_prompts(NUM_PROMPTS, PROMPT_BYTES):
        assert any(text in d for _, d in held)


def test_new_head_leaves_the_target_intact(pair):
    """A fresh training head shares the target's embedding without re-initialising it."""
    from graphdraft.train.train import head_config, new_head

    target, _, _ = pair
    before = target.embed_tokens.detach().clone()
    head = new_head(target, head_config(target.config), seed=1)
    assert head.embed_tokens is target.embed_tokens
    assert torch.equal(target.embed_tokens, before)
    assert torch.equal(head.lm_head, target.lm_head)


def test_training_script_smoke(tmp_path):
    """Both trainings, one tiny step each on held-out text, write a loadable pair."""
    from graphdraft.train.data import Corpus, _concat
    from graphdraft.train.train import HeadRun, TargetRun, train_head, train_target

    docs = [d for _, d in documents(is_held_out)][:8]
    ids = _concat(docs)
    corpus = Corpus(ids, ids, len(docs), len(docs), [])
    t = train_target(TargetRun(steps=1, batch=2, context=64, eval_windows=2, compile=False,
                               device="cpu", out=str(tmp_path / "target")), corpus)
    h = train_head(HeadRun(steps=1, batch=2, context=64, eval_windows=2, compile=False,
                           device="cpu", generated=2, generated_fraction=0.5,
                           target=str(tmp_path / "target"), out=str(tmp_path / "eagle3")), corpus)
    assert t["steps"] == 1 and h["steps"] == 1
    target, head, info = load_model_pair(tmp_path / "target", tmp_path / "eagle3")
    assert head.embed_tokens is target.embed_tokens and info.extras.raw["graphdraft_tokenizer"]


def _record(module: torch.nn.Module, calls: list, rows_arg: int):
    """Forward hook: record (positions of the rows that got logits, logits) of every call."""

    def hook(mod, args, kwargs, out):
        positions = args[1]
        rows = args[rows_arg] if len(args) > rows_arg else None
        pos = positions if rows is None else positions.index_select(0, rows)
        calls.append((pos.clone(), out.logits.detach().clone()))

    return module.register_forward_hook(hook, with_kwargs=True)


@torch.no_grad()
def test_training_forward_matches_runtime_target(pair, prompts):
    target, _, _ = pair
    eng = Engine(target, runtime(1))
    calls: list = []
    handle = _record(target, calls, rows_arg=6)
    try:
        out = eng.generate([prompts[0]], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
    finally:
        handle.remove()
    seq = torch.tensor(prompts[0] + out)
    dense, _ = target_forward(target, seq[None])
    checked = 0
    for pos, logits in calls:
        keep = pos < seq.numel()
        ref = dense[0, pos[keep]]
        assert (logits[keep] - ref).abs().max().item() <= LOGITS_ATOL
        checked += int(keep.sum())
    assert checked >= 32  # the prompt's last position and every decoded one


@torch.no_grad()
def test_training_forward_matches_runtime_head(pair, prompts):
    """Every draft step of the runtime (first step over the accepted prefix, then chain steps
    over its own KV) equals the training-time-test unroll at the same chain start."""
    target, head, _ = pair
    # "sync": each step retires before the next launches, so the recorded head calls are the
    # emitted text's (a deferred engine may launch one cycle past the request's end)
    eng = Engine(target, runtime(1).replace(validation="sync"), head)
    calls: list = []
    handle = _record(head, calls, rows_arg=7)
    try:
        out = eng.generate([prompts[1]], SamplingParams(max_new_tokens=48, ignore_eos=True))[0]
    finally:
        handle.remove()
    seq = torch.tensor(prompts[1] + out)
    _, aux = target_forward(target, seq[None])
    steps = head_ttt_forward(head, seq[None], aux, STEPS)
    assert len(calls) % STEPS == 0  # one first step and STEPS - 1 chain steps per verify
    checked = 0
    for i, (pos, logits) in enumerate(calls):
        k = i % STEPS + 1
        start = int(pos[0]) - (k - 1)  # chain start t: its first step fed token t + 1
        if start + 1 >= seq.numel():
            continue  # the last draft ran past the emitted tokens
        diff = (logits[0] - steps[k - 1][0, start]).abs().max().item()
        assert diff <= LOGITS_ATOL, f"step {k} at chain start {start}: max |diff| {diff}"
        checked += 1
    assert checked >= 2 * STEPS


def test_trained_head_accepts_far_more_than_random(pair, prompts):
    target, head, _ = pair
    trained = mean_accept_length(target, head, prompts, steps=STEPS, new_tokens=NEW_TOKENS)
    rand = Eagle3DraftHead(head.config, torch.float32)  # own embedding: init_random_ must
    init_random_(rand, 0, std=0.02)                      # not overwrite the target's
    rand.embed_tokens = target.embed_tokens
    random_accept = mean_accept_length(target, rand, prompts, steps=STEPS, new_tokens=NEW_TOKENS)
    print(f"mean accept length (N = {STEPS + 1}): trained {trained:.2f}, random {random_accept:.2f}")
    assert trained >= TRAINED_MIN_ACCEPT
    assert random_accept <= RANDOM_MAX_ACCEPT


def test_demo_uses_the_shipped_pair(capsys):
    assert main(["demo", "--num-prompts", "2", "--max-new-tokens", "24", "--device", "cpu",
                 "--max-running-requests", "2"]) == 0
    cap = capsys.readouterr()
    out = cap.out  # results; status lines (the pair, the prompts) go to stderr
    assert f"model pair: {TARGET_DIR}" in cap.err and "model pair" not in out
    assert "held-out stdlib" in cap.err
    assert "sample:" in out and "speed-up over target-only" in out
    assert "greedy outputs identical to target-only: True" in out


def test_demo_random_models_flag(capsys):
    assert main(["demo", "--random-models", "--num-prompts", "2", "--max-new-tokens", "8",
                 "--device", "cpu", "--max-running-requests", "2"]) == 0
    assert "random weights" in capsys.readouterr().err  # a status line
