"""Library defaults a user meets: the KV budget, degenerate aux layer ids, RoPE tables on the
model's device, random init on the parameters' device."""

from __future__ import annotations

import logging

import pytest
import torch

from graphdraft import config as config_mod
from graphdraft.config import ModelConfig, RuntimeConfig
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.layers import init_random_
from graphdraft.models.llama import LlamaForCausalLM
from graphdraft.ops import rope_cos_sin_cache

LLAMA_8B = ModelConfig(num_hidden_layers=32)  # 8 KV heads x 128


def test_default_kv_pool_is_a_budget_not_every_slot_at_max_context():
    cfg = RuntimeConfig(device="cpu")
    per_token = LLAMA_8B.kv_bytes_per_token("bfloat16")
    assert per_token == 2 * 32 * 8 * 128 * 2 == 131072
    full = cfg.total_kv_pages  # every slot at max context: the old reservation
    assert (full - 1) * cfg.page_size * per_token > 34e9
    pages = cfg.kv_pages(per_token)
    assert (pages - 1) * cfg.page_size * per_token <= cfg.kv_cache_memory_gb * 1e9
    assert (pages - 1) * cfg.page_size * per_token > cfg.kv_cache_memory_gb * 1e9 - cfg.page_size * per_token
    assert pages - 1 >= cfg.max_pages_per_req  # one request of max context fits


def test_kv_pages_small_model_explicit_pages_and_bad_budget():
    small = RuntimeConfig(device="cpu", max_running_requests=4, cuda_graph_max_bs=4,
                          max_context_len=256, page_size=16)
    assert small.kv_pages(1024) == 4 * 16 + 1  # the budget pays for more: every slot at max
    assert small.replace(num_kv_pages=7).kv_pages(131072) == 8  # explicit pages win
    with pytest.raises(ValueError, match="kv_cache_memory_gb: expected >= "):
        small.replace(kv_cache_memory_gb=1e-6).kv_pages(131072)
    with pytest.raises(ValueError, match="bytes_per_token: expected an int >= 1"):
        small.kv_pages(0)
    for bad in (0, -1.0, "4", True):
        with pytest.raises(ValueError, match="kv_cache_memory_gb: expected a number > 0"):
            RuntimeConfig(device="cpu", kv_cache_memory_gb=bad)


def test_engine_pool_follows_the_budget_and_requests_wait_for_pages():
    """The Engine sizes its KV pool once from `kv_cache_memory_gb`: a budget of about two
    requests at max context gives a pool of that many pages; more requests queue for pages and
    all finish (none lost)."""
    from graphdraft.serving.engine import Engine
    from graphdraft.serving.verify import SamplingParams
    from tests.engine_harness import make_models, runtime

    target, head = make_models(2)
    tc = target.config
    per_token = tc.kv_bytes_per_token(target.dtype)
    base = runtime()
    budget_pages = 2 * base.max_pages_per_req
    gb = budget_pages * base.page_size * per_token / 1e9
    eng = Engine(target, base.replace(kv_cache_memory_gb=gb * 1.0001), head)
    assert eng.cfg.num_kv_pages == budget_pages
    assert eng.kv.num_pages == budget_pages + 1 and eng.pages.num_free_pages == budget_pages
    assert Engine(target, base, head).cfg.num_kv_pages == base.max_running_requests * base.max_pages_per_req
    prompts = [[1 + i, 2, 3] * 40 for i in range(base.max_running_requests)]  # 120 tokens each
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert [len(o) for o in outs] == [30] * len(prompts)
    assert eng.pages.num_free_pages == budget_pages


@pytest.mark.parametrize("layers", [2, 3, 4, 5, 6])
def test_degenerate_default_aux_layer_ids_warn(layers, caplog, monkeypatch):
    monkeypatch.setattr(config_mod, "_WARNED_AUX_LAYERS", set())
    with caplog.at_level(logging.WARNING, logger="graphdraft.config"):
        ids = ModelConfig(num_hidden_layers=layers).aux_layer_ids()
    assert list(ids) != sorted(set(ids))
    assert any("repeated or descending" in r.message for r in caplog.records)


def test_sound_or_named_aux_layer_ids_do_not_warn(caplog, monkeypatch):
    monkeypatch.setattr(config_mod, "_WARNED_AUX_LAYERS", set())
    with caplog.at_level(logging.WARNING, logger="graphdraft.config"):
        assert ModelConfig(num_hidden_layers=32).aux_layer_ids() == (2, 16, 29)
        assert ModelConfig(num_hidden_layers=7).aux_layer_ids() == (2, 3, 4)
        assert ModelConfig(num_hidden_layers=4, aux_hidden_state_layer_ids=(0, 1, 3)
                           ).aux_layer_ids() == (0, 1, 3)
    assert not caplog.records


def test_rope_table_follows_the_default_device():
    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=48, num_hidden_layers=3, vocab_size=64,
                      max_position_embeddings=64, rope_theta=10000.0,
                      aux_hidden_state_layer_ids=(0, 1, 2))
    # meta stands in for cuda here: before, the table was built on the CPU whatever the context
    with torch.device("meta"):
        assert rope_cos_sin_cache(8, 16, 10000.0).device.type == "meta"
        target = LlamaForCausalLM(cfg, torch.float32)
        head = Eagle3DraftHead(cfg.replace(num_hidden_layers=1), torch.float32)
    assert target.cos_sin.device.type == "meta" and head.cos_sin.device.type == "meta"
    on_cpu = rope_cos_sin_cache(8, 16, 10000.0)
    assert on_cpu.device.type == "cpu"
    assert torch.equal(on_cpu, rope_cos_sin_cache(8, 16, 10000.0, device="cpu"))


def _old_init(module, seed, std):
    """The host-fp32 initialisation before the change (for the CPU bit-compatibility check)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("norm.weight") or "layernorm" in name or name.endswith("hidden_norm.weight"):
            vals = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            vals = std * torch.randn(p.shape, generator=gen)
        with torch.no_grad():
            p.copy_(vals.to(p.dtype))


def test_init_random_on_cpu_keeps_its_values_and_distribution():
    cfg = ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, num_hidden_layers=2, vocab_size=128,
                      aux_hidden_state_layer_ids=(0, 1, 1))
    a, b = LlamaForCausalLM(cfg, torch.bfloat16), LlamaForCausalLM(cfg, torch.bfloat16)
    init_random_(a, 5, std=0.3)
    _old_init(b, 5, 0.3)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    w = next(p for n, p in a.named_parameters() if "mlp" in n)
    assert abs(w.float().std().item() - 0.3) < 0.03


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_init_random_draws_on_the_gpu():
    cfg = ModelConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                      intermediate_size=1024, num_hidden_layers=2, vocab_size=1024,
                      aux_hidden_state_layer_ids=(0, 1, 1))
    with torch.device("cuda"):
        m = LlamaForCausalLM(cfg, torch.bfloat16)
    assert m.cos_sin.device.type == "cuda"
    init_random_(m, 3, std=0.2)
    w = m.embed_tokens
    assert w.device.type == "cuda" and abs(w.float().std().item() - 0.2) < 0.01
    again = LlamaForCausalLM(cfg, torch.bfloat16).cuda()
    init_random_(again, 3, std=0.2)
    assert torch.equal(again.embed_tokens, m.embed_tokens)  # deterministic on the device


def test_the_precompile_workers_default_is_stated_once(monkeypatch, capsys):
    """`precompile_workers=None`: min(PRECOMPILE_WORKERS_CAP, CPU count) on CUDA, the value
    `startup.spec.default_workers` computes and the words --help prints (one constant)."""
    import os
    from types import SimpleNamespace

    from graphdraft.serving.cli import build_parser
    from graphdraft.startup.spec import default_workers

    monkeypatch.delenv(config_mod.PRECOMPILE_WORKERS_ENV, raising=False)
    cuda = SimpleNamespace(precompile_workers=None, device="cuda", dp_size=1)
    for cpus, want in ((64, config_mod.PRECOMPILE_WORKERS_CAP), (3, 3)):
        monkeypatch.setattr(os, "cpu_count", lambda c=cpus: c)
        assert default_workers(cuda) == want
    words = f"min({config_mod.PRECOMPILE_WORKERS_CAP}, CPU count)"
    assert words in RuntimeConfig.precompile_workers_default == config_mod.PRECOMPILE_WORKERS_DEFAULT
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    assert words in " ".join(capsys.readouterr().out.split())  # --help wraps lines
