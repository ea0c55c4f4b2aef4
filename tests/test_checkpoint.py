"""Checkpoints: HF Llama targets and EAGLE-3 heads, round trips, error reporting, HF parity.

Parity tolerance (fp32, tests marked `transformers`): graphdraft's logits equal Hugging
Face's within max |diff| <= 1e-4 * max(1, max |logit|); greedy generation is equal token
for token. Those tests skip when transformers is not installed.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphdraft.config import RuntimeConfig
from graphdraft.io.checkpoint import (
    CONVENTION_KEY,
    INDEX_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    aux_layer_ids_from_config,
    load_eagle3_head,
    load_model_pair,
    load_target,
    open_model_pair,
    read_config,
    save_eagle3_head,
    save_target,
)
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.layers import init_random_
from graphdraft.models.llama import LlamaForCausalLM
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.checkpoint_fixtures import (
    assert_same_state,
    full_logits,
    read_all,
    rewrite,
    verify_logits,
)
from tests.engine_harness import HEAD, TARGET, make_models, runtime

PARITY_RTOL = 1e-4  # max |diff| <= PARITY_RTOL * max(1, max |logit|), fp32


def prompts(seed: int, count: int, vocab: int = TARGET.vocab_size) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 20))] for _ in range(count)]


def serve(target, head, ps, max_new=10):
    eng = Engine(target, runtime(), head)
    return eng.generate(ps, SamplingParams(max_new_tokens=max_new)), eng.stats.accepted_tokens


def tiny_target(tmp_path: Path, tied: bool = False, dtype=torch.float32, **save_kw):
    target = LlamaForCausalLM(TARGET.replace(tie_word_embeddings=tied), dtype)
    init_random_(target, 11, std=0.5)
    return target, save_target(target, tmp_path / "target", **save_kw)


def tiny_head(tmp_path: Path, target, draft_vocab: int | None = 40, **save_kw):
    cfg = HEAD.replace(draft_vocab_size=draft_vocab)
    hot = None
    if draft_vocab is not None:
        hot = torch.randperm(TARGET.vocab_size, generator=torch.Generator().manual_seed(3))[
            :draft_vocab]
    head = Eagle3DraftHead(cfg, target.dtype, embed_tokens=target.embed_tokens.data,
                           hot_token_ids=hot)
    init_random_(head, 12, std=0.5)
    head.embed_tokens = target.embed_tokens
    return head, save_eagle3_head(head, tmp_path / "head", **save_kw)


def problems_of(excinfo) -> list[str]:
    assert isinstance(excinfo.value, CheckpointError)
    return excinfo.value.problems


# ---------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("shard", [None, 3000])
def test_target_round_trip(tmp_path, tied, shard):
    target, _ = make_models(1)
    if tied:
        target = LlamaForCausalLM(TARGET.replace(tie_word_embeddings=True), torch.float64)
        init_random_(target, 1, std=0.5)
    d = save_target(target, tmp_path / "t", max_shard_bytes=shard, eos_token_id=[5, 7])
    files = sorted(p.name for p in d.iterdir())
    names = set()
    if shard is None:
        assert files == ["config.json", WEIGHTS_NAME]
        names = set(read_all(d / WEIGHTS_NAME))
    else:
        index = json.loads((d / INDEX_NAME).read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 3 and files == sorted(["config.json", INDEX_NAME, *shards])
        for s in shards:
            assert (d / s).stat().st_size <= shard + 1024 or len(read_all(d / s)) == 1
            names |= set(read_all(d / s))
        assert names == set(index["weight_map"])
    assert ("lm_head.weight" in names) == (not tied)
    assert "model.layers.3.self_attn.q_proj.weight" in names and not any("qkv" in n for n in names)

    loaded, info = load_target(d)
    assert info.dtype == torch.float64 and info.eos_token_ids == (5, 7)
    assert loaded.config == target.config
    assert_same_state(loaded, target)
    if tied:
        assert loaded.lm_head is loaded.embed_tokens
    ps = prompts(2, 3)
    assert serve(loaded, None, ps) == serve(target, None, ps)


@pytest.mark.parametrize("draft_vocab", [None, 40])
@pytest.mark.parametrize("with_embed", [False, True])
def test_head_round_trip(tmp_path, draft_vocab, with_embed):
    target, head = make_models(4, draft_vocab=draft_vocab)
    td = save_target(target, tmp_path / "t")
    hd = save_eagle3_head(head, tmp_path / "h", include_embeddings=with_embed)
    names = set(read_all(hd / WEIGHTS_NAME))
    assert ("embed_tokens.weight" in names) == with_embed
    assert ({"d2t", "t2d"} <= names) == (draft_vocab is not None)
    assert "midlayer.self_attn.q_proj.weight" in names and "fc.weight" in names
    cfg = json.loads((hd / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == (draft_vocab or TARGET.vocab_size)

    t2, h2, _ = load_model_pair(td, hd)
    assert h2.embed_tokens is t2.embed_tokens  # shared (shipped copy equals the target's)
    assert_same_state(h2, head)
    if draft_vocab is None:
        assert h2.hot_token_ids is None
    else:
        assert torch.equal(h2.hot_token_ids, head.hot_token_ids)
    ps = prompts(5, 4)
    assert serve(t2, h2, ps) == serve(target, head, ps)
    if with_embed:  # standalone: its own copy
        alone = load_eagle3_head(hd)
        assert_same_state(alone, head)
        assert alone.embed_tokens is not head.embed_tokens


def test_shipped_embedding_that_differs_is_not_shared(tmp_path):
    target, head = make_models(6)
    hd = save_eagle3_head(head, tmp_path / "h", include_embeddings=True)
    other = head.embed_tokens.detach() + 1.0
    rewrite(hd / WEIGHTS_NAME, put={"embed_tokens.weight": other})
    h2 = load_eagle3_head(hd, target=target)
    assert h2.embed_tokens is not target.embed_tokens
    assert torch.equal(h2.embed_tokens, other)


@pytest.mark.parametrize("embed", ["none", "equal", "differs"])
def test_open_pair_reads_nothing_and_an_engine_built_before_the_read_serves_the_same(
        tmp_path, monkeypatch, embed):
    """`open_model_pair` checks everything and reads no weight (only the head's small d2t /
    t2d maps); an engine built on its modules before `PendingWeights.read()` serves exactly
    what an engine on `load_model_pair`'s serves. A shipped head embedding: held apart until
    the read, then shared iff it equals the target's."""
    import graphdraft.io.checkpoint as ckpt

    target, head = make_models(4, draft_vocab=40)
    td = save_target(target, tmp_path / "t")
    hd = save_eagle3_head(head, tmp_path / "h", include_embeddings=embed != "none")
    if embed == "differs":
        rewrite(hd / WEIGHTS_NAME, put={"embed_tokens.weight": head.embed_tokens.detach() + 1.0})
    ref_t, ref_h, _ = load_model_pair(td, hd)
    reads = []
    real_read = ckpt._Weights.read
    monkeypatch.setattr(ckpt._Weights, "read", lambda self, n: reads.append(n) or real_read(self, n))
    t2, h2, info, weights = open_model_pair(td, hd)
    assert set(reads) <= {"d2t", "t2d"} and info.config == target.config
    assert (h2.embed_tokens is t2.embed_tokens) == (embed == "none")
    eng = Engine(t2, runtime(), h2)  # before the read: nothing it builds reads a weight
    weights.read()
    assert weights.read_s is not None and len(reads) > 20
    assert (h2.embed_tokens is t2.embed_tokens) == (embed != "differs")
    assert_same_state(t2, ref_t)
    assert_same_state(h2, ref_h)
    ps = prompts(5, 4)
    assert eng.generate(ps, SamplingParams(max_new_tokens=10)) == serve(ref_t, ref_h, ps)[0]
    with pytest.raises(RuntimeError, match="read already"):
        weights.read()


def test_a_failed_read_says_which_tensor_and_releases_the_files(tmp_path):
    """A problem only the data shows (a tied target's stored lm_head that differs from its
    embedding) surfaces at `read()` as the same CheckpointError `load_target` raises; the
    files are closed, and reading again says so."""
    target, td = tiny_target(tmp_path, tied=True)
    _, hd = tiny_head(tmp_path, target)
    rewrite(td / WEIGHTS_NAME, put={"lm_head.weight": target.embed_tokens.detach() * 2})
    *_, weights = open_model_pair(td, hd)
    with pytest.raises(CheckpointError, match="differs from 'model.embed_tokens.weight'"):
        weights.read()
    with pytest.raises(RuntimeError, match="closed before"):
        weights.read()
    with open_model_pair(td, hd)[3] as unread:  # a context manager: closed unread
        pass
    with pytest.raises(RuntimeError, match="closed before"):
        unread.read()


def test_head_rope_table_covers_the_target_context(tmp_path):
    """Published heads say max_position_embeddings 2048; served with a longer target they
    need RoPE rows for every target position (the table only depends on theta/scaling)."""
    target, _ = make_models(0)
    head = Eagle3DraftHead(HEAD.replace(max_position_embeddings=64), torch.float64,
                           embed_tokens=target.embed_tokens.data)
    init_random_(head, 1)
    hd = save_eagle3_head(head, tmp_path / "h", include_embeddings=True)
    assert load_eagle3_head(hd).cos_sin.shape[0] == 64
    h2 = load_eagle3_head(hd, target=target)
    assert h2.config.max_position_embeddings == 512 and h2.cos_sin.shape[0] == 512
    assert torch.equal(h2.cos_sin[:64], head.cos_sin)


def test_pair_takes_aux_layer_ids_from_the_head(tmp_path):
    ids = (1, 2, 3)  # starts with 1: only the written convention marker keeps it unambiguous
    target = LlamaForCausalLM(TARGET.replace(aux_hidden_state_layer_ids=ids), torch.float64)
    init_random_(target, 7, std=0.5)
    head = Eagle3DraftHead(HEAD.replace(aux_hidden_state_layer_ids=ids), torch.float64,
                           embed_tokens=target.embed_tokens.data)
    init_random_(head, 8, std=0.5)
    head.embed_tokens = target.embed_tokens
    plain = LlamaForCausalLM(TARGET, torch.float64)  # same weights, default ids in its config
    plain.load_state_dict(target.state_dict())
    td, hd = save_target(plain, tmp_path / "t"), save_eagle3_head(head, tmp_path / "h")
    cfg = json.loads((hd / "config.json").read_text())["eagle_config"]
    assert cfg == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], CONVENTION_KEY: "input"}

    t2, h2, info = load_model_pair(td, hd)
    assert t2.aux_layer_ids == ids and info.aux_layer_ids_source == "argument"
    alone, _ = load_target(td)
    assert alone.aux_layer_ids == TARGET.aux_layer_ids()
    ps = prompts(9, 4)
    assert serve(t2, h2, ps) == serve(target, head, ps)

    # without the marker, "auto" reads a first id of 1 as SGLang's output-of-layer ids
    raw = json.loads((hd / "config.json").read_text())
    del raw["eagle_config"][CONVENTION_KEY]
    (hd / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"\[1, 2, 3\] read in the 'output' convention"):
        load_model_pair(td, hd)
    t3, _, _ = load_model_pair(td, hd, aux_ids_convention="input")
    assert t3.aux_layer_ids == ids


def test_hand_written_layouts_fuse_in_hf_order(tmp_path):
    """Names written by hand (not by save_*): q/k/v and gate/up land in the right rows."""
    from safetensors.torch import save_file

    target, head = make_models(2, dtype=torch.float32, draft_vocab=40)
    td, hd = save_target(target, tmp_path / "t"), save_eagle3_head(head, tmp_path / "h")
    gen = torch.Generator().manual_seed(0)
    t_w = {n: torch.randn(t.shape, generator=gen) for n, t in read_all(td / WEIGHTS_NAME).items()}
    save_file(t_w, str(td / WEIGHTS_NAME))
    h_w = read_all(hd / WEIGHTS_NAME)
    h_w = {n: (torch.randn(t.shape, generator=gen) if t.is_floating_point() else t)
           for n, t in h_w.items()}
    save_file(h_w, str(hd / WEIGHTS_NAME))
    t2, _ = load_target(td)
    h2 = load_eagle3_head(hd, target=t2)
    for i in range(TARGET.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = t2.layers[i]
        assert torch.equal(layer.self_attn.qkv_proj, torch.cat(
            [t_w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
        assert torch.equal(layer.mlp.gate_up_proj, torch.cat(
            [t_w[p + "mlp.gate_proj.weight"], t_w[p + "mlp.up_proj.weight"]]))
        assert torch.equal(layer.self_attn.o_proj, t_w[p + "self_attn.o_proj.weight"])
        assert torch.equal(layer.post_attention_layernorm.weight,
                           t_w[p + "post_attention_layernorm.weight"])
    assert torch.equal(t2.lm_head, t_w["lm_head.weight"])
    assert torch.equal(t2.norm.weight, t_w["model.norm.weight"])
    m = h2.midlayer
    assert torch.equal(m.self_attn.qkv_proj, torch.cat(
        [h_w[f"midlayer.self_attn.{x}_proj.weight"] for x in "qkv"]))
    assert m.self_attn.qkv_proj.shape[1] == 2 * HEAD.hidden_size
    assert torch.equal(m.mlp.gate_up_proj, torch.cat(
        [h_w["midlayer.mlp.gate_proj.weight"], h_w["midlayer.mlp.up_proj.weight"]]))
    assert torch.equal(m.hidden_norm.weight, h_w["midlayer.hidden_norm.weight"])
    assert torch.equal(h2.fc, h_w["fc.weight"]) and torch.equal(h2.lm_head, h_w["lm_head.weight"])


# ---------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
EAGLE3_HEAD = {  # the published EAGLE-3 Llama-3.1-8B head's config.json
    "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 2048, "model_type": "llama",
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 1,
    "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
    "vocab_size": 128256, "draft_vocab_size": 32000,
}


def write_config(d: Path, cfg: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_read_config_llama31(tmp_path):
    d = write_config(tmp_path / "t", LLAMA31_8B)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009, 7]}))
    cfg, ex = read_config(d)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size) == (
        4096, 32, 8, 128, 14336, 32, 128256)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.max_position_embeddings == 131072 and cfg.rms_norm_eps == 1e-5
    assert not cfg.tie_word_embeddings and cfg.draft_vocab_size is None
    assert cfg.aux_layer_ids() == (2, 16, 29)
    assert ex.dtype == torch.bfloat16 and ex.bos_token_id == 128000
    assert ex.eos_token_ids == (128001, 128008, 128009, 7)


def test_read_config_transformers5_layout(tmp_path):
    raw = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_theta", "rope_scaling",
                                                             "torch_dtype")}
    raw["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA31_8B["rope_scaling"]}
    raw["dtype"] = "float16"
    raw["eos_token_id"] = 128009
    cfg, ex = read_config(write_config(tmp_path / "t", raw))
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["factor"] == 8.0
    assert ex.dtype == torch.float16 and ex.eos_token_ids == (128009,)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0}
    cfg, _ = read_config(write_config(tmp_path / "t", raw))
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling is None


@pytest.mark.parametrize("ids,where,convention,expected", [
    ([1, 15, 28], "eagle_config", None, ((2, 16, 29), "output")),   # SGLang-style ids
    ([2, 16, 29], "eagle_config", None, ((2, 16, 29), "input")),    # vLLM / HF hidden_states ids
    ([2, 16, 29], "top", None, ((2, 16, 29), "input")),
    ([1, 15, 28], "top", "input", ((1, 15, 28), "input")),
    ([0, 15, 28], "eagle_config", "output", ((1, 16, 29), "output")),
])
def test_read_config_eagle3_head_aux_ids(tmp_path, ids, where, convention, expected):
    raw = dict(EAGLE3_HEAD)
    if where == "top":
        raw["eagle_aux_hidden_state_layer_ids"] = ids
    else:
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    cfg, ex = read_config(write_config(tmp_path / "h", raw), aux_ids_convention=convention)
    assert (cfg.aux_hidden_state_layer_ids, ex.aux_layer_ids_convention) == expected
    assert cfg.num_aux_hidden_states == 3 and ex.aux_layer_ids_raw == tuple(ids)
    assert cfg.draft_vocab_size == 32000 and cfg.output_vocab_size == 32000
    assert cfg.rope_theta == 10000.0 and cfg.rms_norm_eps == 1e-5  # LlamaConfig defaults
    assert aux_layer_ids_from_config(ids, convention or "auto") == expected


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "qwen2"}, "model_type: expected 'llama'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_size": None}, "hidden_size: required"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"vocab_size": "big"}, "vocab_size: expected an int"),
    ({"eagle_aux_hidden_state_layer_ids": "2,3"}, "eagle_aux_hidden_state_layer_ids"),
])
def test_read_config_rejects(tmp_path, change, message):
    d = write_config(tmp_path / "t", {**LLAMA31_8B, **change})
    with pytest.raises(ValueError, match=message) as e:
        read_config(d)
    assert "config.json" in str(e.value)


def test_not_a_checkpoint_dir(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_target(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json: not found"):
        load_target(tmp_path)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------
def test_missing_extra_and_wrong_shape_reported_together(tmp_path):
    _, d = tiny_target(tmp_path)
    f = d / WEIGHTS_NAME
    rewrite(f, drop=["model.layers.2.mlp.up_proj.weight"],
            put={"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32),
                 "model.layers.9.mlp.gate_proj.weight": torch.zeros(64, 32),
                 "model.layers.1.self_attn.rotary_emb.inv_freq": torch.ones(4)})  # ignored
    with pytest.raises(ValueError) as e:
        load_target(d)
    probs = problems_of(e)
    assert len(probs) == 3
    msg = str(e.value)
    assert str(d) in msg and "3 problems" in msg
    assert "missing tensor 'model.layers.2.mlp.up_proj.weight' (expected shape [64, 32])" in msg
    assert ("'model.layers.0.self_attn.k_proj.weight': wrong shape: expected [16, 32], "
            "got [8, 32]") in msg
    assert "unexpected tensor 'model.layers.9.mlp.gate_proj.weight'" in msg


@pytest.mark.parametrize("tied", [False, True])
def test_missing_lm_head_and_tied_head_copy(tmp_path, tied):
    target, d = tiny_target(tmp_path, tied=tied)
    f = d / WEIGHTS_NAME
    if not tied:
        rewrite(f, drop=["lm_head.weight"])
        with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
            load_target(d)
        return
    rewrite(f, put={"lm_head.weight": target.embed_tokens.detach().clone()})
    loaded, _ = load_target(d)  # a stored copy equal to the embedding is accepted
    assert_same_state(loaded, target)
    rewrite(f, put={"lm_head.weight": target.embed_tokens.detach() * 2})
    with pytest.raises(ValueError, match="differs from 'model.embed_tokens.weight'"):
        load_target(d)


def test_dtype_policy(tmp_path):
    """Float weights are cast to the requested dtype; a non-float weight is an error."""
    target, d = tiny_target(tmp_path, dtype=torch.float32)
    bf, info = load_target(d, dtype="bfloat16")
    assert info.dtype == torch.bfloat16
    for (n, a), (_, b) in zip(target.named_parameters(), bf.named_parameters(), strict=True):
        assert b.dtype == torch.bfloat16 and torch.equal(b, a.to(torch.bfloat16)), n
    half = LlamaForCausalLM(TARGET, torch.float16)
    init_random_(half, 3)
    d16 = save_target(half, tmp_path / "half")
    up, info = load_target(d16, dtype=torch.float32)
    assert info.dtype == torch.float32
    assert all(torch.equal(b, a.float()) for a, b in zip(half.parameters(), up.parameters(), strict=True))
    assert load_target(d16)[1].dtype == torch.float16  # default: the config's torch_dtype

    rewrite(d / WEIGHTS_NAME, put={"model.norm.weight": torch.ones(32, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"'model.norm.weight': wrong dtype: expected a float "
                                         r"dtype \(F16, BF16, F32, F64\), got I64"):
        load_target(d)
    with pytest.raises(ValueError, match="dtype"):
        load_target(d16, dtype="int8")


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("keep", ["most", "header"])
def test_truncated_or_corrupt_file(tmp_path, sharded, keep):
    _, d = tiny_target(tmp_path, max_shard_bytes=20000 if sharded else None)
    files = sorted(d.glob("*.safetensors"))
    f = files[len(files) // 2]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100] if keep == "most" else data[:6])
    with pytest.raises(ValueError, match="truncated or corrupt") as e:
        load_target(d)
    assert str(f) in str(e.value)
    f.write_bytes(b"\xff" * 8 + b"not json" * 10)
    with pytest.raises(ValueError, match=f.name):
        load_target(d)


def test_missing_shard(tmp_path):
    _, d = tiny_target(tmp_path, max_shard_bytes=20000)
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(ValueError, match=f"lists shard\\(s\\) missing on disk: {shards[1].name}"):
        load_target(d)


def test_index_that_disagrees_with_shards(tmp_path):
    _, d = tiny_target(tmp_path, max_shard_bytes=20000)
    index = json.loads((d / INDEX_NAME).read_text())
    wm = index["weight_map"]
    shards = sorted(set(wm.values()))
    wm["model.norm.weight"] = next(s for s in shards if s != wm["model.norm.weight"])
    (d / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lists 'model.norm.weight' in model-"):
        load_target(d)


def test_pytorch_model_bin_only_is_never_unpickled(tmp_path, monkeypatch):
    target, d = tiny_target(tmp_path)
    hd = write_config(tmp_path / "head", EAGLE3_HEAD)
    torch.save({"fc.weight": torch.zeros(2, 2)}, hd / "pytorch_model.bin")
    (d / WEIGHTS_NAME).unlink()
    torch.save(target.state_dict(), d / "pytorch_model.bin")

    def refuse(*a, **k):
        raise AssertionError("a pickle was loaded")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    for path, call in ((d, load_target), (hd, load_eagle3_head)):
        with pytest.raises(ValueError, match="pytorch_model.bin but no safetensors") as e:
            call(path)
        assert "only safetensors" in str(e.value)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match="no weights found"):
        load_target(d)


def test_head_without_embedding_needs_the_target(tmp_path):
    target, _ = tiny_target(tmp_path)
    _, hd = tiny_head(tmp_path, target)
    with pytest.raises(ValueError, match="missing tensor 'embed_tokens.weight'.*pass target="):
        load_eagle3_head(hd)
    with pytest.raises(ValueError, match="dtype: expected the target's"):
        load_eagle3_head(hd, target=target, dtype="bfloat16")
    other = LlamaForCausalLM(TARGET.replace(vocab_size=70), torch.float32)
    with pytest.raises(ValueError, match=r"vocab_size: expected the target's \(70\), got 61"):
        load_eagle3_head(hd, target=other)


def test_head_errors_reported_together(tmp_path):
    target, _ = tiny_target(tmp_path)
    _, hd = tiny_head(tmp_path, target)
    rewrite(hd / WEIGHTS_NAME, drop=["midlayer.hidden_norm.weight"],
            put={"fc.weight": torch.zeros(32, 64), "d2t": torch.zeros(40)})
    with pytest.raises(ValueError) as e:
        load_eagle3_head(hd, target=target)
    msg = str(e.value)
    assert len(problems_of(e)) == 3
    assert "missing tensor 'midlayer.hidden_norm.weight'" in msg
    assert "'fc.weight': wrong shape: expected [32, 96], got [32, 64]" in msg
    assert "'d2t': wrong dtype: expected an integer dtype (I64), got F32" in msg


# ---------------------------------------------------------------------------
# d2t / t2d
# ---------------------------------------------------------------------------
def put_map(hd: Path, hot: list[int], t2d: torch.Tensor | None = None, vocab=TARGET.vocab_size):
    hot_t = torch.tensor(hot)
    d2t = hot_t - torch.arange(len(hot))
    if t2d is None:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[hot_t] = True
    rewrite(hd / WEIGHTS_NAME, put={"d2t": d2t, "t2d": t2d})


def test_d2t_offsets_become_hot_token_ids(tmp_path):
    target, _ = tiny_target(tmp_path)
    head, hd = tiny_head(tmp_path, target, draft_vocab=5)
    d2t = torch.tensor([10, 2, 48, 1, 56])  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(TARGET.vocab_size, dtype=torch.bool)
    t2d[[10, 3, 50, 4, 60]] = True
    rewrite(hd / WEIGHTS_NAME, put={"d2t": d2t, "t2d": t2d})
    h2 = load_eagle3_head(hd, target=target)
    assert h2.hot_token_ids.tolist() == [10, 3, 50, 4, 60]
    assert h2.map_to_target(torch.tensor([4, 0, 2])).tolist() == [60, 10, 50]
    rewrite(hd / WEIGHTS_NAME, drop=["t2d"])  # t2d is optional
    assert load_eagle3_head(hd, target=target).hot_token_ids.tolist() == [10, 3, 50, 4, 60]


@pytest.mark.parametrize("hot,message", [
    ([10, 3, 50, 4, 61], r"1 draft id\(s\) map outside the target vocab \[0, 61\), e.g. draft "
                         r"id 4 \+ d2t 57 = 61"),
    ([-1, 3, 50, 4, 60], r"outside the target vocab"),
    ([10, 3, 10, 4, 60], "two draft ids map to the same target id"),
])
def test_bad_d2t_rejected(tmp_path, hot, message):
    target, _ = tiny_target(tmp_path)
    _, hd = tiny_head(tmp_path, target, draft_vocab=5)
    rewrite(hd / WEIGHTS_NAME, drop=["t2d"], put={"d2t": torch.tensor(hot) - torch.arange(5)})
    with pytest.raises(ValueError, match=message):
        load_eagle3_head(hd, target=target)


def test_t2d_must_agree_and_d2t_is_required_for_a_draft_vocab(tmp_path):
    target, _ = tiny_target(tmp_path)
    _, hd = tiny_head(tmp_path, target, draft_vocab=5)
    t2d = torch.zeros(TARGET.vocab_size, dtype=torch.bool)
    t2d[[10, 3, 50, 4, 59]] = True
    put_map(hd, [10, 3, 50, 4, 60], t2d)
    with pytest.raises(ValueError, match=r"'t2d' disagrees with 'd2t' at 2 target id\(s\)"):
        load_eagle3_head(hd, target=target)
    rewrite(hd / WEIGHTS_NAME, drop=["d2t", "t2d"])
    with pytest.raises(ValueError, match=r"missing tensor 'd2t' \(expected shape \[5\]\)"):
        load_eagle3_head(hd, target=target)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_hot_token_ids_round_trip_property(data):
    vocab = TARGET.vocab_size
    vd = data.draw(st.integers(1, vocab), label="draft_vocab")
    hot = data.draw(st.permutations(range(vocab)), label="perm")[:vd]
    target = LlamaForCausalLM(TARGET, torch.float32)
    head = Eagle3DraftHead(HEAD.replace(draft_vocab_size=vd), torch.float32,
                           embed_tokens=target.embed_tokens.data,
                           hot_token_ids=torch.tensor(hot))
    init_random_(head, vd)
    with tempfile.TemporaryDirectory() as tmp:
        save_eagle3_head(head, tmp)
        d2t = read_all(Path(tmp) / WEIGHTS_NAME)["d2t"]
        assert d2t.dtype == torch.int64 and (torch.arange(vd) + d2t).tolist() == hot
        h2 = load_eagle3_head(tmp, target=target)
    assert h2.hot_token_ids.tolist() == hot


# ---------------------------------------------------------------------------
# Parity with Hugging Face transformers (skipped without it)
# ---------------------------------------------------------------------------
def hf_model(tmp_path: Path, tied=False, rope_scaling=None, seed=0):
    transformers = pytest.importorskip("transformers")
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
        intermediate_size=96, num_hidden_layers=3, vocab_size=97, rms_norm_eps=1e-5,
        max_position_embeddings=256, rope_theta=10000.0, rope_scaling=rope_scaling,
        tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger weights than the HF init: peaked logits, clear argmaxes
        for name, p in model.named_parameters():
            scale = 0.1 if "norm" in name else 0.3
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=gen))
    d = tmp_path / "hf"
    model.save_pretrained(d, safe_serialization=True)
    return model, d


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = max(1.0, ref.abs().max().item())
    diff = (ours.float() - ref.float()).abs().max().item()
    assert diff <= PARITY_RTOL * scale, f"max |diff| {diff:.3g} > {PARITY_RTOL} * {scale:.3g}"


@pytest.mark.parametrize("tied", [False, True])
def test_hf_logits_and_greedy_parity(tmp_path, tied):
    model, d = hf_model(tmp_path, tied=tied, seed=int(tied))
    target, info = load_target(d, dtype="float32")
    assert info.dtype == torch.float32 and target.config.tie_word_embeddings == tied
    ids = prompts(1, 1, vocab=97)[0] + prompts(2, 1, vocab=97)[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert_logits_close(full_logits(target, ids), ref)

    ps = prompts(3, 3, vocab=97)
    cfg = RuntimeConfig(speculative_num_steps=1, page_size=4, max_running_requests=3,
                        max_context_len=96, max_num_batched_tokens=64, cuda_graph_max_bs=3,
                        dtype="float32", device="cpu")
    ours = Engine(target, cfg).generate(ps, SamplingParams(max_new_tokens=24))
    for p, got in zip(ps, ours, strict=True):
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert got == out[0, len(p):].tolist()
    assert len({tuple(o) for o in ours}) > 1


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_hf_verify_rows_parity(tmp_path, backend):
    """The target's verify forward (rows of N = 4 new tokens over prefixes of 9, 14 and 21
    positions in the paged cache: the multi-token attention, Triton's or the torch path's)
    gives Hugging Face's logits at those positions, in fp32."""
    from graphdraft.kernels.config import TORCH, TRITON

    model, d = hf_model(tmp_path, seed=7)
    target, _ = load_target(d, dtype="float32")
    rng = random.Random(7)
    rows = [[rng.randrange(97) for _ in range(k)] for k in (13, 18, 25)]
    got = verify_logits(target, rows, 4, TRITON if backend == "triton" else TORCH)
    assert got.shape == (12, 97)
    for i, r in enumerate(rows):
        with torch.no_grad():
            ref = model(torch.tensor([r])).logits[0, -4:]
        assert_logits_close(got[4 * i:4 * i + 4], ref)


def test_hf_llama3_rope_scaling_parity(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    model, d = hf_model(tmp_path, rope_scaling=scaling, seed=5)
    target, _ = load_target(d, dtype="float32")
    assert target.config.rope_scaling["rope_type"] == "llama3"
    ids = [i % 97 for i in range(3, 3 + 7 * 60, 7)]  # 60 positions, past the original 16
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert_logits_close(full_logits(target, ids), ref)
    plain = target.config.replace(rope_scaling=None)  # the scaling matters at these positions
    unscaled = LlamaForCausalLM(plain, torch.float32)
    unscaled.load_state_dict(target.state_dict())
    assert (full_logits(unscaled, ids) - ref).abs().max() > 100 * PARITY_RTOL


def test_hf_reads_what_graphdraft_saves(tmp_path):
    transformers = pytest.importorskip("transformers")
    os.environ["HF_HUB_OFFLINE"] = "1"
    scaling = {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = TARGET.replace(rope_scaling=scaling)
    target = LlamaForCausalLM(cfg, torch.float32)
    init_random_(target, 21, std=0.3)
    d = save_target(target, tmp_path / "gd", max_shard_bytes=30000)
    model = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = prompts(4, 1)[0] * 4
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert_logits_close(full_logits(target, ids), ref)
