"""Tensor parallelism on CPU: 2 gloo ranks (torch.multiprocessing.spawn, FileStore) vs 1 rank.

The same scenario function runs unsharded in this process (the reference) and sharded on
each of 2 spawned ranks (one spawn for every scenario: process start-up dominates). Greedy
tokens and drafts must be equal, logits close: |tp - ref| <= 1e-5 * max|ref| per step.
The models are float64, but the ops' torch path computes RMSNorm statistics, RoPE and
attention in float32, so the different summation order of the row-parallel all-reduce
(~1e-16) flips float32 roundings: measured max 3e-6 here (with float64 internals the same
runs agree to 1e-14). The two ranks must agree bit for bit (every activation after a
collective is replicated).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from graphdraft.config import ModelConfig
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.layers import init_random_
from graphdraft.models.llama import LlamaForCausalLM
from graphdraft.parallel import TensorParallel, init_tensor_parallel, shard_, vocab_rows
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import HEAD, TARGET, make_models, runtime

WORLD = 2
REL_TOL = 1e-5  # relative to max|logit|; see the module docstring
PROMPTS = [[5, 17, 3, 44, 9, 12], [60, 1, 2], [33, 33, 8, 19, 50, 7, 21, 4, 11], [0, 59]]


# ---------------------------------------------------------------------------
# The scenarios (identical code for 1 rank and for each of the 2 ranks)
# ---------------------------------------------------------------------------
def _record(eng: Engine) -> tuple[list, list]:
    """Wrap the decode mode's eager target forward (`DecodeMode.target_forward`: every step on
    a CPU is eager) and the drafter's prefill / mixed-step drafting (`draft_mixed`) to keep
    every step's logits and those steps' drafts."""
    logits, drafts = [], []
    target_forward = eng.mode.target_forward

    def fwd(ctx, rows, capture_aux, *args, **kwargs):
        out = target_forward(ctx, rows, capture_aux, *args, **kwargs)
        logits.append(out.logits.clone())
        return out

    eng.mode.target_forward = fwd
    if eng.drafter is not None:
        draft_mixed = eng.drafter.draft_mixed

        def draft(*a, **kw):
            out = draft_mixed(*a, **kw)
            drafts.append(out.clone())
            return out

        eng.drafter.draft_mixed = draft
    return logits, drafts


def _serve(eng: Engine, params: SamplingParams) -> dict:
    logits, drafts = _record(eng)
    out = eng.generate(PROMPTS, params)
    return {"tokens": out, "logits": logits, "drafts": drafts,
            "kv_heads": eng.kv.k[0].shape[1],
            "draft_kv_heads": eng.drafter.kv_pool.k[0].shape[1] if drafts else None,
            "accept": eng.stats.mean_accept_length}


def _scenarios(tp: TensorParallel | None, which: str) -> dict:
    """`which` "ref": only what differs from the unsharded run (replicated == sharded head)."""
    res = {}
    greedy = SamplingParams(max_new_tokens=8)
    sampled = SamplingParams(max_new_tokens=8, temperature=0.8, seed=11)
    cfg = runtime(speculative_num_steps=2, max_num_batched_tokens=16)  # chunked prefill too

    target, head = make_models(3, draft_vocab=40)  # vocab 61: padded shards (31 + 30 + 1 pad)
    memo: dict = {}
    shard_(target, tp, memo=memo)
    res["target_only"] = _serve(Engine(target, cfg), greedy)
    res["spec_replicated_head"] = _serve(Engine(target, cfg, head), greedy)
    res["sampled_replicated_head"] = _serve(Engine(target, cfg, head), sampled)
    if which != "ref":
        shard_(head, tp, memo=memo)  # shares the target's embedding shard
        res["head_shares_embedding"] = head.embed_tokens is target.embed_tokens
        res["spec_sharded_head"] = _serve(Engine(target, cfg, head), greedy)
    del memo

    tied_cfg = TARGET.replace(tie_word_embeddings=True, num_attention_heads=8,
                              num_key_value_heads=4, head_dim=4)
    tied = LlamaForCausalLM(tied_cfg, torch.float64)
    init_random_(tied, 5, std=0.5)
    shard_(tied, tp)
    res["tied_lm_head_is_embedding"] = tied.lm_head is tied.embed_tokens
    res["tied_target_only"] = _serve(Engine(tied, cfg), greedy)
    return res


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        res = _scenarios(TensorParallel.from_group(), "tp")
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    torch.multiprocessing.spawn(_worker, args=(str(d / "store"), str(d)), nprocs=WORLD, join=True)
    ranks = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return _scenarios(None, "ref"), ranks


def _close(ref: torch.Tensor, got: torch.Tensor) -> None:
    assert ref.shape == got.shape
    scale = ref.abs().max().item()
    err = (ref - got).abs().max().item()
    assert err <= REL_TOL * scale, f"max |tp - ref| = {err:.3g} > {REL_TOL} * {scale:.3g}"


def _same_run(ref: dict, got: dict) -> None:
    assert got["tokens"] == ref["tokens"]
    assert len(got["logits"]) == len(ref["logits"])
    for a, b in zip(ref["logits"], got["logits"], strict=True):
        _close(a, b)
    assert len(got["drafts"]) == len(ref["drafts"])
    for a, b in zip(ref["drafts"], got["drafts"], strict=True):
        assert torch.equal(a, b)
    assert got["accept"] == ref["accept"]


# ---------------------------------------------------------------------------
# 2 ranks == 1 rank, through the unchanged Engine
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["target_only", "tied_target_only", "spec_replicated_head",
                                  "sampled_replicated_head"])
def test_two_ranks_match_one_rank(runs, name):
    ref, ranks = runs
    for got in ranks:
        _same_run(ref[name], got[name])
    # each rank's KV pool holds its own KV heads (the engine sized it from model.config)
    assert all(got[name]["kv_heads"] * WORLD == ref[name]["kv_heads"] for got in ranks)
    if name.startswith(("spec", "sampled")):  # replicated head: full KV heads on every rank
        assert ref[name]["drafts"]
        assert all(got[name]["draft_kv_heads"] == ref[name]["draft_kv_heads"] for got in ranks)


def test_sharded_head_matches_one_rank(runs):
    ref, ranks = runs
    for got in ranks:
        _same_run(ref["spec_replicated_head"], got["spec_sharded_head"])
        assert got["spec_sharded_head"]["draft_kv_heads"] * WORLD == ref[
            "spec_replicated_head"]["draft_kv_heads"]
        assert got["head_shares_embedding"] and got["tied_lm_head_is_embedding"]
    assert ref["tied_lm_head_is_embedding"]


def test_ranks_agree_bit_for_bit(runs):
    _, (r0, r1) = runs
    for name, a in r0.items():
        if isinstance(a, dict):
            b = r1[name]
            assert a["tokens"] == b["tokens"]
            for x, y in zip(a["logits"] + a["drafts"], b["logits"] + b["drafts"], strict=True):
                assert torch.equal(x, y)


# ---------------------------------------------------------------------------
# Sharding without processes (slicing needs no communication)
# ---------------------------------------------------------------------------
def _fake(rank: int, world: int = WORLD) -> TensorParallel:
    return TensorParallel(rank, world)  # group None: never used by shard_


def test_shard_slices_reassemble_the_full_weights():
    full, _ = make_models(0)
    shards = []
    for r in range(WORLD):
        m, _ = make_models(0)
        shards.append(shard_(m, _fake(r)))
    cfg, d = TARGET, TARGET.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    for i, layer in enumerate(full.layers):
        parts = [s.layers[i] for s in shards]
        ql, kvl = q // WORLD, kv // WORLD
        qkv = [p.self_attn.qkv_proj for p in parts]
        assert all(w.shape == (ql + 2 * kvl, cfg.hidden_size) for w in qkv)
        rebuilt = torch.cat([torch.cat([w[:ql] for w in qkv]), torch.cat([w[ql:ql + kvl] for w in qkv]),
                             torch.cat([w[ql + kvl:] for w in qkv])])
        assert torch.equal(rebuilt, layer.self_attn.qkv_proj)
        assert torch.equal(torch.cat([p.self_attn.o_proj for p in parts], 1), layer.self_attn.o_proj)
        f = cfg.intermediate_size // WORLD
        gu = [p.mlp.gate_up_proj for p in parts]
        assert torch.equal(torch.cat([w[:f] for w in gu] + [w[f:] for w in gu]),
                           layer.mlp.gate_up_proj)
        assert torch.equal(torch.cat([p.mlp.down_proj for p in parts], 1), layer.mlp.down_proj)
        assert torch.equal(parts[0].input_layernorm.weight, layer.input_layernorm.weight)
        assert parts[1].self_attn.num_heads == 2 and parts[1].self_attn.num_kv_heads == 1
    emb = torch.cat([s.embed_tokens for s in shards])
    assert emb.shape == (62, cfg.hidden_size)  # 61 rows + 1 zero pad row on the last rank
    assert torch.equal(emb[:61], full.embed_tokens) and not emb[61].any()
    assert torch.equal(torch.cat([s.lm_head for s in shards])[:61], full.lm_head)
    s = shards[1]
    assert s.config.num_key_value_heads == 1 and s.config.num_attention_heads == 2
    assert s.config.intermediate_size == 32 and s.config.vocab_size == 61
    assert s.global_config == TARGET and s.tp == _fake(1)
    assert s.embed_tokens.untyped_storage().nbytes() == s.embed_tokens.nbytes  # no full copy kept


def test_single_rank_is_untouched():
    target, head = make_models(0)
    before = {n: p for n, p in target.named_parameters()}
    for tp in (None, TensorParallel(0, 1)):
        assert shard_(target, tp) is target and shard_(head, tp) is head
        assert target.tp is None and head.tp is None and target.config is TARGET
        assert all(a is before[n] for n, a in target.named_parameters())
        assert all(m.tp is None for m in target.modules() if hasattr(m, "tp"))


@pytest.mark.parametrize("changes, name", [
    ({"num_attention_heads": 3, "num_key_value_heads": 3}, "num_attention_heads"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_attention_heads": 4, "num_key_value_heads": 1}, "num_key_value_heads"),
    ({"intermediate_size": 63}, "intermediate_size"),
])
def test_indivisible_shapes_raise_naming_the_field(changes, name):
    cfg = TARGET.replace(**changes)
    target = LlamaForCausalLM(cfg, torch.float64)
    before = {n: p for n, p in target.named_parameters()}
    with pytest.raises(ValueError, match=name):
        shard_(target, _fake(0))
    # nothing changed: the model still runs unsharded
    assert target.tp is None and target.config is cfg
    assert all(a is before[n] for n, a in target.named_parameters())
    head = Eagle3DraftHead(HEAD.replace(**changes), torch.float64)
    with pytest.raises(ValueError, match=name):
        shard_(head, _fake(1))
    assert head.tp is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        TensorParallel(2, 2)
    with pytest.raises(ValueError, match="world_size"):
        TensorParallel(0, 0)
    target, _ = make_models(0)
    shard_(target, _fake(0))
    with pytest.raises(ValueError, match="already sharded"):
        shard_(target, _fake(0))
    with pytest.raises(ValueError, match="model"):
        shard_(torch.nn.Linear(2, 2), _fake(0))


def test_vocab_shards_cover_the_vocab_once():
    w = torch.arange(7.0).unsqueeze(1)
    for world in (1, 2, 3, 4, 8):
        parts = [vocab_rows(w, _fake(r, world)) for r in range(world)]
        assert all(p.shape[0] == -(-7 // world) for p in parts)
        assert torch.equal(torch.cat(parts)[:7], w) and not torch.cat(parts)[7:].any()
    cfg = ModelConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, vocab_size=7,
                      intermediate_size=8)
    assert TensorParallel(1, 2).vocab_shard(cfg.vocab_size) == (4, 7, 4)


def test_head_refuses_a_sharded_embedding():
    """A head built over a sharded target's embedding (load the head before sharding) fails
    loudly instead of looking up the wrong rows."""
    target, _ = make_models(0)
    shard_(target, _fake(0))
    with pytest.raises(ValueError, match="embed_tokens"):
        Eagle3DraftHead(HEAD, torch.float64, embed_tokens=target.embed_tokens.data)


def test_init_without_torchrun_is_single_rank(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    tp, device = init_tensor_parallel(device="cpu")
    assert tp == TensorParallel(0, 1) and not tp.is_parallel and device == "cpu"
    assert not dist.is_initialized()


def test_sharded_models_cannot_be_saved_or_host_a_head(tmp_path):
    from graphdraft.io.checkpoint import load_eagle3_head, save_eagle3_head, save_target
    from graphdraft.parallel import TensorParallel, shard_
    from tests.engine_harness import make_models

    target, head = make_models(0)
    save_eagle3_head(head, tmp_path / "head")
    shard_(target, TensorParallel(rank=0, world_size=2, group=None))  # slicing needs no group
    assert target.tp is not None
    with pytest.raises(ValueError, match="model"):
        save_target(target, tmp_path / "t")
    with pytest.raises(ValueError, match="target"):
        load_eagle3_head(tmp_path / "head", target)


def test_tp_demo_pair_keeps_the_targets_embedding():
    """scripts/tp_demo.py's random pair: the head shares the target's embedding, and building the
    head does not re-initialise it (it once drew the head's weights into the shared table)."""
    import importlib.util
    from pathlib import Path

    from graphdraft.models.layers import init_random_
    from graphdraft.models.llama import LlamaForCausalLM

    path = Path(__file__).resolve().parents[1] / "scripts" / "tp_demo.py"
    spec = importlib.util.spec_from_file_location("tp_demo", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    target, head = mod.random_pair(torch.float32, seed=5)
    alone = LlamaForCausalLM(target.config, torch.float32)
    init_random_(alone, 5, std=0.1)
    assert head.embed_tokens is target.embed_tokens
    assert torch.equal(target.embed_tokens, alone.embed_tokens)
