"""An EAGLE-3 head that takes its LM head from its target (config `graphdraft_lm_head: "target"`).

- Saved that way the file holds no `lm_head.weight`; loaded, the head's LM head is the target's
  rows at the hot-token ids, and the head's draft logits (the dense TTT forward) and the
  Engine's drafts equal those of the same head saved with its own LM head = those rows, for an
  untied and a tied (SmolLM2-like) target; greedy speculative == target-only.
- `open_model_pair` gathers the rows at `read()`, into the Parameter the head already holds.
- Tensor-parallel sharding splits the gathered LM head as it splits an own one.
- Training with `lm_head` "target" (graphdraft.train.real's stage, the byte-level head's
  `train_head`) leaves the LM head as the target's rows (out of the optimizer) and trains
  the rest; the saved head holds no LM head and loads with the target's.
- Each bad input raises its named error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graphdraft.io.checkpoint import (
    LM_HEAD_KEY,
    WEIGHTS_NAME,
    CheckpointError,
    load_eagle3_head,
    load_model_pair,
    open_model_pair,
    save_eagle3_head,
    save_target,
)
from graphdraft.models.eagle3 import Eagle3DraftHead, target_lm_head_rows
from graphdraft.models.random_models import random_model_pair
from graphdraft.parallel import TensorParallel, shard_
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from graphdraft.train.forward import head_ttt_forward, target_forward
from tests.checkpoint_fixtures import assert_same_state, read_all, rewrite
from tests.engine_harness import HEAD, TARGET, runtime

VD = 24  # draft vocab (the target's: 61)
AUX = (0, 1, 3)
T_CFG = TARGET.replace(aux_hidden_state_layer_ids=AUX)
H_CFG = HEAD.replace(draft_vocab_size=VD, aux_hidden_state_layer_ids=AUX)


def make_pair(tied: bool, seed: int = 5, dtype: torch.dtype = torch.float64):
    hot = torch.randperm(TARGET.vocab_size, generator=torch.Generator().manual_seed(seed))[:VD]
    return random_model_pair(T_CFG.replace(tie_word_embeddings=tied), H_CFG, dtype, seed,
                             std=0.5, hot_token_ids=hot)


def saved_both(tmp_path: Path, tied: bool):
    """(target dir, head dir with its own LM head = the target's rows, head dir with
    `graphdraft_lm_head: "target"`, the head object)."""
    target, head = make_pair(tied)
    td = save_target(target, tmp_path / "target")
    with torch.no_grad():
        head.lm_head.copy_(target.lm_head[head.hot_token_ids])
    own = save_eagle3_head(head, tmp_path / "own")
    head.tie_lm_head_(target.lm_head)
    tgt = save_eagle3_head(head, tmp_path / "tied")
    return td, own, tgt, head


@pytest.mark.parametrize("tied", [False, True])
def test_a_head_saved_with_the_targets_lm_head_loads_as_the_same_head(tmp_path, tied):
    td, own_dir, tgt_dir, _ = saved_both(tmp_path, tied)
    assert "lm_head.weight" in read_all(own_dir / WEIGHTS_NAME)
    assert LM_HEAD_KEY not in json.loads((own_dir / "config.json").read_text())
    names = set(read_all(tgt_dir / WEIGHTS_NAME))
    assert "lm_head.weight" not in names and {"d2t", "t2d", "fc.weight"} <= names
    assert json.loads((tgt_dir / "config.json").read_text())[LM_HEAD_KEY] == "target"
    lm_bytes = VD * TARGET.hidden_size * 8  # float64 rows
    saved = (own_dir / WEIGHTS_NAME).stat().st_size - (tgt_dir / WEIGHTS_NAME).stat().st_size
    assert lm_bytes <= saved <= lm_bytes + 200  # the rows, and a header entry

    t_own, h_own, _ = load_model_pair(td, own_dir)
    t_tgt, h_tgt, _ = load_model_pair(td, tgt_dir)
    assert h_own.lm_head_source == "own" and h_tgt.lm_head_source == "target"
    assert not h_tgt.lm_head.requires_grad and h_tgt.lm_head.dtype == t_tgt.dtype
    rows = (t_tgt.embed_tokens if tied else t_tgt.lm_head)[h_tgt.hot_token_ids]
    assert torch.equal(h_tgt.lm_head, rows)
    assert h_tgt.lm_head.data_ptr() != t_tgt.lm_head.data_ptr()  # its own [Vd, H] copy
    assert_same_state(h_tgt, h_own)
    ids = torch.randint(0, TARGET.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    _, aux = target_forward(t_own, ids)
    for a, b in zip(head_ttt_forward(h_own, ids, aux, 3), head_ttt_forward(h_tgt, ids, aux, 3),
                    strict=True):
        assert a.shape == (2, 11, VD) and torch.equal(a, b)  # [B, L - 1, Vd]
    # saved again: still the target's, still no LM head in the file
    again = save_eagle3_head(h_tgt, tmp_path / "again")
    assert "lm_head.weight" not in read_all(again / WEIGHTS_NAME)
    # in another dtype: the target's rows in the head's dtype
    t32, h32, _ = load_model_pair(td, tgt_dir, dtype="float32")
    assert h32.lm_head.dtype == torch.float32
    assert torch.equal(h32.lm_head, t32.lm_head[h32.hot_token_ids])


def test_open_pair_gathers_the_rows_when_the_weights_are_read(tmp_path):
    td, _, tgt_dir, ref = saved_both(tmp_path, tied=True)
    target, head, _, weights = open_model_pair(td, tgt_dir)
    param = head.lm_head
    weights.read()
    assert head.lm_head is param  # filled in place: an engine built before the read stays valid
    assert torch.equal(head.lm_head, target.lm_head[head.hot_token_ids])
    assert torch.equal(head.lm_head, ref.lm_head)


def test_engine_greedy_speculative_equals_target_only_and_the_own_head(tmp_path):
    td, own_dir, tgt_dir, _ = saved_both(tmp_path, tied=True)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, TARGET.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3)]
    params = SamplingParams(max_new_tokens=10)
    t_own, h_own, _ = load_model_pair(td, own_dir)
    t_tgt, h_tgt, _ = load_model_pair(td, tgt_dir)
    plain = Engine(t_tgt, runtime()).generate(prompts, params)
    eng_tgt = Engine(t_tgt, runtime(), h_tgt)
    eng_own = Engine(t_own, runtime(), h_own)
    assert eng_tgt.generate(prompts, params) == plain == eng_own.generate(prompts, params)
    assert eng_tgt.stats.accepted_tokens == eng_own.stats.accepted_tokens


@pytest.mark.parametrize("tied", [False, True])
def test_tensor_parallel_shards_the_gathered_lm_head_like_an_own_one(tmp_path, tied):
    td, own_dir, tgt_dir, _ = saved_both(tmp_path, tied)
    parts = {}
    for name, d in (("own", own_dir), ("target", tgt_dir)):
        for rank in range(2):
            target, head, _ = load_model_pair(td, d)
            memo: dict = {}
            tp = TensorParallel(rank, 2)
            shard_(target, tp, memo=memo)
            shard_(head, tp, memo=memo)
            assert head.embed_tokens is target.embed_tokens  # still shared
            assert head.lm_head is not target.lm_head
            parts[name, rank] = head.lm_head
    full, _ = make_pair(tied)
    for name in ("own", "target"):
        rebuilt = torch.cat([parts[name, 0], parts[name, 1]])
        assert rebuilt.shape == (VD, TARGET.hidden_size)  # 24 rows: 12 a rank
        assert torch.equal(rebuilt, full.lm_head[make_pair(tied)[1].hot_token_ids])
    target, head, _ = load_model_pair(td, tgt_dir)
    shard_(head, TensorParallel(0, 2))
    with pytest.raises(ValueError, match="already sharded; take the target's LM head before"):
        head.tie_lm_head_(target.lm_head)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------
def _set_key(d: Path, value) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg[LM_HEAD_KEY] = value
    (d / "config.json").write_text(json.dumps(cfg))


def test_bad_inputs_give_their_named_errors(tmp_path):
    td, own_dir, tgt_dir, head = saved_both(tmp_path, tied=False)
    target, _ = make_pair(False)
    # "target" with a file that stores an LM head
    _set_key(own_dir, "target")
    with pytest.raises(CheckpointError, match="'lm_head.weight' is stored but graphdraft_lm_head "
                                              "is 'target'") as e:
        load_model_pair(td, own_dir)
    assert not any(p.startswith("unexpected tensor") for p in e.value.problems)
    _set_key(own_dir, "shared")
    with pytest.raises(ValueError, match="graphdraft_lm_head: expected one of 'own', 'target', "
                                         "got 'shared'"):
        load_model_pair(td, own_dir)
    # no target to take it from
    with pytest.raises(CheckpointError, match="this head takes its LM head from the target, "
                                              "pass target="):
        load_eagle3_head(tgt_dir)
    # d2t missing, d2t out of the target's vocab
    f = tgt_dir / WEIGHTS_NAME
    tensors = read_all(f)
    rewrite(f, drop=["d2t", "t2d"])
    with pytest.raises(CheckpointError, match=r"missing tensor 'd2t' \(expected shape \[24\]\): "
                                              "graphdraft_lm_head is 'target'"):
        load_model_pair(td, tgt_dir)
    d2t = tensors["d2t"].clone()
    d2t[3] = TARGET.vocab_size - 3 + 5  # draft id 3 -> target id 61 + 5
    rewrite(f, drop=["t2d"], put={"d2t": d2t})
    with pytest.raises(CheckpointError, match=r"'d2t': 1 draft id\(s\) map outside the target "
                                              r"vocab \[0, 61\)"):
        load_model_pair(td, tgt_dir)
    rewrite(f, put=tensors)
    # a target of another vocabulary or width
    for field, value in (("vocab_size", 67), ("hidden_size", 48)):
        other, _ = random_model_pair(T_CFG.replace(**{field: value}, head_dim=8),
                                     H_CFG.replace(**{field: value}), torch.float64, 1, 0.5)
        with pytest.raises(ValueError, match=f"{field}: expected the target's \\({value}\\)"):
            load_eagle3_head(tgt_dir, target=other)
    # the gather itself
    with pytest.raises(ValueError, match=r"lm_head: expected the target's LM head of shape "
                                         r"\(61, 32\)"):
        target_lm_head_rows(target.lm_head[:50], head.hot_token_ids, H_CFG)
    with pytest.raises(ValueError, match=r"hot_token_ids: target ids must lie in \[0, 61\)"):
        target_lm_head_rows(target.lm_head, head.hot_token_ids + 40, H_CFG)
    with pytest.raises(ValueError, match="hot_token_ids: required for a draft vocabulary of 24"):
        target_lm_head_rows(target.lm_head, None, H_CFG)
    with pytest.raises(ValueError, match="lm_head_source: expected one of"):
        Eagle3DraftHead(H_CFG, torch.float32, lm_head_source="shared")


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------
def _samples(n: int, length: int, vocab: int, seed: int):
    from graphdraft.train.responses import Samples
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    return Samples(ids, torch.full((n,), 4), torch.full((n,), length), torch.arange(n),
                   torch.zeros(n, dtype=torch.bool), ["code"] * n)


@pytest.mark.parametrize("lm_head", ["own", "target"])
def test_real_training_freezes_the_targets_lm_head_and_trains_the_rest(tmp_path, monkeypatch,
                                                                        lm_head):
    import graphdraft.train.real as real
    from graphdraft.io.checkpoint import load_eagle3_head as load_head
    from graphdraft.train.train import HeadTraining

    target, _ = make_pair(tied=True, dtype=torch.float32)
    hot = torch.randperm(TARGET.vocab_size, generator=torch.Generator().manual_seed(9))[:VD]
    head = real.new_chat_head(target, hot, 16, seed=3, lm_head=lm_head)
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    seen = {}
    make_opt = real._optimizer
    monkeypatch.setattr(real, "_optimizer", lambda params, *a: seen.setdefault(
        "names", sorted(params)) and make_opt(params, *a))
    run = real.RealHeadRun(target="t", out=str(tmp_path / "head"), steps=3, batch=4,
                           batch_tokens=512, ttt_steps=2, lr=2e-2, warmup=1, log_every=1,
                           compile=False, device="cpu", save_dtype="float32", lm_head=lm_head)
    labels = real.DraftLabels(hot, TARGET.vocab_size)
    gen = torch.Generator().manual_seed(0)
    log = real.RunLog()
    res = real.train_stage(run, target, head, labels, _samples(8, 20, TARGET.vocab_size, 1),
                           torch.device("cpu"), "fp32", gen, None, log)
    assert res["steps"] == 3
    assert ("lm_head" in seen["names"]) == (lm_head == "own") and "fc" in seen["names"]
    after = dict(head.named_parameters())
    assert torch.equal(after["lm_head"], before["lm_head"]) == (lm_head == "target")
    for n in ("fc", "midlayer.self_attn.qkv_proj", "midlayer.mlp.down_proj"):
        assert not torch.equal(after[n], before[n]), n
    assert torch.equal(after["embed_tokens"], before["embed_tokens"])
    _, size = real._save(run, head, target, _samples(2, 20, TARGET.vocab_size, 2), labels,
                         "fp32", log)
    out = Path(run.out)
    assert ("lm_head.weight" in read_all(out / WEIGHTS_NAME)) == (lm_head == "own")
    assert (json.loads((out / "config.json").read_text()).get(LM_HEAD_KEY) == "target") == (
        lm_head == "target")
    predicted = real.predicted_head_bytes(target.config, VD, 16, "float32", lm_head)
    assert 0 <= predicted - size <= real.SAFETENSORS_HEADER_BYTES
    loaded = load_head(out, target=target)
    assert torch.equal(loaded.lm_head, head.lm_head)
    if lm_head == "target":
        assert torch.equal(loaded.lm_head, target.lm_head[hot])
    with pytest.raises(ValueError, match="lm_head: expected one of"):
        HeadTraining(lm_head="frozen")


def test_byte_level_head_training_with_the_targets_lm_head(tmp_path, monkeypatch):
    from graphdraft.models.layers import init_random_
    from graphdraft.models.llama import LlamaForCausalLM
    from graphdraft.train import train as tr
    from graphdraft.train.__main__ import parser
    from graphdraft.train.data import Corpus, _concat, documents, is_held_out

    cfg = tr.target_config(hidden=32, layers=3, heads=4, kv_heads=2, ffn=64, context=64,
                           aux_layer_ids=(0, 1, 2))
    target = LlamaForCausalLM(cfg, torch.float32)
    init_random_(target, 4, std=0.3)
    save_target(target, tmp_path / "target")
    docs = [d for _, d in documents(is_held_out)][:2]
    ids = _concat(docs)
    corpus = Corpus(ids, ids, len(docs), len(docs), [])
    saved = {}
    real_save = tr.save_eagle3_head
    monkeypatch.setattr(tr, "save_eagle3_head",
                        lambda head, out: saved.setdefault("head", head) and real_save(head, out))
    summary = tr.train_head(tr.HeadRun(steps=2, batch=2, context=32, eval_windows=2, ffn=32,
                                       lr=2e-2, warmup=1, compile=False, device="cpu",
                                       log_every=1, save_dtype="float32", lm_head="target",
                                       target=str(tmp_path / "target"),
                                       out=str(tmp_path / "eagle3")), corpus)
    head = saved["head"]
    assert head.lm_head_source == "target" and torch.equal(head.lm_head, target.lm_head)
    total = sum(p.numel() for n, p in head.named_parameters() if n != "embed_tokens")
    assert summary["parameters_trained"] == total - head.lm_head.numel()
    assert "lm_head.weight" not in read_all(tmp_path / "eagle3" / WEIGHTS_NAME)
    t2, h2, _ = load_model_pair(tmp_path / "target", tmp_path / "eagle3")
    assert torch.equal(h2.lm_head, t2.lm_head)
    assert parser().parse_args(["head", "--out", "x", "--lm-head", "target"]).lm_head == "target"


def test_cli_flags_and_the_smollm2_budget(monkeypatch, tmp_path):
    """`--lm-head target --draft-vocab 8192` reach the run; for SmolLM2-135M such a head with
    MLP 768 fits the GPU recipe's max_head_bytes (the shipped assets' 20 MB), an own LM head
    of 8,192 rows does not."""
    import graphdraft.train.real as real
    from graphdraft.io.checkpoint import read_config
    from graphdraft.serving.cli.models import SHIPPED_SMOLLM2_HEAD

    seen = {}
    monkeypatch.setattr(real, "train_real_head", lambda run: seen.setdefault("run", run))
    assert real.main(["--target", "T", "--out", "O", "--recipe", "gpu", "--lm-head", "target",
                      "--draft-vocab", "8192", "--ffn", "768"]) == 0
    run = seen["run"]
    assert (run.lm_head, run.draft_vocab, run.ffn) == ("target", 8192, 768)
    assert run.max_head_bytes == real.GPU_RECIPE["max_head_bytes"]
    record = json.loads((SHIPPED_SMOLLM2_HEAD / "training.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(record["target_config"]))
    cfg, _ = read_config(tmp_path)
    assert real.check_head_size(run, cfg) <= run.max_head_bytes
    with pytest.raises(ValueError, match=r"draft_vocab=8192, ffn=768: the head \(LM head own\)"
                                         r" .* over"):
        real.check_head_size(real.RealHeadRun(**{**vars(run), "lm_head": "own"}), cfg)
