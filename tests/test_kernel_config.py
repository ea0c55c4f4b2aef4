"""KernelConfig (`graphdraft/kernels/config.py`): the one home of the kernel settings.

Read from the environment once, at construction; frozen; passed down from `RuntimeConfig` to
the models, the ops and the kernel wrappers; two configs that only move launch options or
tiles give the same numbers (the interpreter on CPU).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

from graphdraft import ops
from graphdraft.config import ModelConfig, RuntimeConfig
from graphdraft.kernels import config as kernel_config
from graphdraft.kernels import gemv, pdl
from graphdraft.kernels.config import ENV_VARS, TORCH, TRITON, KernelConfig
from graphdraft.kernels.gemv import gemv_config
from graphdraft.kernels.keys import KeyRecorder
from graphdraft.models.attention import AttentionMetadata, PagedAttentionBackend
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.layers import init_random_
from graphdraft.runtime.kv_cache import kv_slot

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_env(monkeypatch):
    for var, _ in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_defaults_are_todays_settings(clean_env):
    kc = KernelConfig.from_env()
    assert kc == KernelConfig() == TORCH
    assert (kc.small_m_max, kc.finish_norm_max_m, kc.pdl_max_rows, kc.finish_maxnreg) == (32, 1, 4, 128)
    assert kc.gemv_pdl and kc.stream_evict_first and kc.pdl and kc.pdl_early_loads
    assert kc.gemv_tiles == "wide" and kc.gemv_split is None and kc.gemv_block_k is None
    assert kc.gemv_num_stages is None and kc.gemv_swap_ab
    assert TRITON == kc.replace(backend="triton") and TRITON.use_triton and not kc.use_triton


def test_every_env_var_sets_its_field(clean_env):
    values = {"GRAPHDRAFT_GEMV_TILES": ("uniform", "uniform"), "GRAPHDRAFT_GEMV_SPLIT": ("3", 3),
              "GRAPHDRAFT_GEMV_BLOCK_K": ("64", 64), "GRAPHDRAFT_GEMV_NUM_STAGES": ("2", 2),
              "GRAPHDRAFT_GEMV_SWAP_AB": ("off", False),
              "GRAPHDRAFT_SMALL_M_MAX": ("0", 0), "GRAPHDRAFT_GEMM_MAX_M": ("512", 512),
              "GRAPHDRAFT_GEMV_PDL": ("off", False), "GRAPHDRAFT_STREAM_EVICT_FIRST": ("0", False),
              "GRAPHDRAFT_FINISH_MAXNREG": ("none", None), "GRAPHDRAFT_FINISH_NORM_MAX_M": ("16", 16),
              "GRAPHDRAFT_PDL": ("False", False), "GRAPHDRAFT_PDL_MAX_ROWS": ("8", 8),
              "GRAPHDRAFT_PDL_EARLY_LOADS": ("no", False),
              "GRAPHDRAFT_DECODE_BLOCK_N": ("16", 16),
              "GRAPHDRAFT_DECODE_FUSED_COMBINE": ("on", True),
              "GRAPHDRAFT_EXTEND_TILES": ("16x16x4, 32X32x2,64x64x4,128x64x8",
                                          ((16, 16, 4), (32, 32, 2), (64, 64, 4), (128, 64, 8))),
              "GRAPHDRAFT_EXTEND_NUM_STAGES": ("3", 3),
              "GRAPHDRAFT_EXTEND_PREFILL_STAGES": ("4", 4)}
    assert set(values) == {var for var, _ in ENV_VARS.values()}  # the table names them all
    for field, (var, _) in ENV_VARS.items():
        raw, want = values[var]
        assert getattr(KernelConfig.from_env({var: raw}), field) == want, var
        clean_env.setenv(var, raw)
        assert getattr(KernelConfig.from_env(), field) == want, var
        clean_env.delenv(var)
    assert KernelConfig.from_env({"GRAPHDRAFT_FINISH_MAXNREG": "0"}).finish_maxnreg is None
    assert KernelConfig.from_env({"GRAPHDRAFT_PDL": ""}).pdl  # empty: the default
    # overrides win over the environment
    assert KernelConfig.from_env({"GRAPHDRAFT_PDL": "0"}, pdl=True).pdl


@pytest.mark.parametrize("var,raw", [
    ("GRAPHDRAFT_GEMV_TILES", "narrow"), ("GRAPHDRAFT_GEMV_SPLIT", "0"),
    ("GRAPHDRAFT_GEMV_BLOCK_K", "48"), ("GRAPHDRAFT_GEMV_NUM_STAGES", "9"),
    ("GRAPHDRAFT_GEMV_SWAP_AB", "sometimes"),
    ("GRAPHDRAFT_SMALL_M_MAX", "65"),
    ("GRAPHDRAFT_SMALL_M_MAX", "lots"), ("GRAPHDRAFT_GEMV_PDL", "maybe"),
    ("GRAPHDRAFT_STREAM_EVICT_FIRST", "2"), ("GRAPHDRAFT_FINISH_MAXNREG", "-1"),
    ("GRAPHDRAFT_FINISH_NORM_MAX_M", "4.5"), ("GRAPHDRAFT_PDL", "yes please"),
    ("GRAPHDRAFT_PDL_MAX_ROWS", "-3"), ("GRAPHDRAFT_PDL_EARLY_LOADS", "O"),
    ("GRAPHDRAFT_DECODE_BLOCK_N", "48"), ("GRAPHDRAFT_DECODE_FUSED_COMBINE", "half"), ("GRAPHDRAFT_EXTEND_NUM_STAGES", "0"),
    ("GRAPHDRAFT_EXTEND_TILES", "16x64x4,32x64x4,64x64x4"),
    ("GRAPHDRAFT_EXTEND_TILES", "16x64x4,32x64x4,64x64x4,256x64x8"),
])
def test_bad_env_value_raises_naming_the_variable(clean_env, var, raw):
    with pytest.raises(ValueError, match=f"^{var}: expected .*, got {re.escape(repr(raw))}"):
        KernelConfig.from_env({var: raw})
    clean_env.setenv(var, raw)
    with pytest.raises(ValueError, match=f"^{var}: "):
        RuntimeConfig(device="cpu")  # the runtime's config reads it at construction


@pytest.mark.parametrize("field,value", [("backend", "cuda"), ("gemv_tiles", "narrow"),
                                         ("small_m_max", 65), ("small_m_max", True),
                                         ("pdl", 1), ("finish_maxnreg", 0), ("gemv_block_k", 24),
                                         ("pdl_max_rows", -1), ("gemv_split", 0),
                                         ("gemv_num_stages", 0),
                                         ("decode_block_n", 24), ("extend_num_stages", 0),
                                         ("extend_tiles", ((16, 64, 4),) * 3)])
def test_bad_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=f"^{field}: expected "):
        KernelConfig(**{field: value})
    with pytest.raises(ValueError, match=f"^{field}: expected "):
        TRITON.replace(**{field: value})
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(TRITON, field, value)  # frozen: a config never changes under a model


def test_env_is_read_once_at_construction(clean_env):
    """A config built from the environment keeps its values when the environment changes
    later: the RuntimeConfig's (and its replace()), and the module default of wrappers called
    without one (before: `GRAPHDRAFT_GEMV_TILES` was read at every GEMV call)."""
    clean_env.setenv("GRAPHDRAFT_PDL", "0")
    clean_env.setenv("GRAPHDRAFT_GEMV_TILES", "uniform")
    cfg = RuntimeConfig(device="cpu")
    built = cfg.kernels
    assert not built.pdl and built.gemv_tiles == "uniform"
    default = kernel_config.default()
    wide_or_not = gemv_config(1, 4096, 4096)
    clean_env.setenv("GRAPHDRAFT_PDL", "1")
    clean_env.setenv("GRAPHDRAFT_GEMV_TILES", "wide" if default.gemv_tiles == "uniform" else "uniform")
    assert cfg.kernels is built and not cfg.kernels.pdl and cfg.kernels.gemv_tiles == "uniform"
    assert cfg.replace(page_size=8).kernels.pdl is False  # replace keeps the settings
    assert kernel_config.default() is default  # built once
    assert gemv_config(1, 4096, 4096) == wide_or_not
    assert RuntimeConfig(device="cpu").kernels.pdl  # a new config reads the new value


def test_runtime_config_backend_follows_kernel_backend(clean_env):
    assert RuntimeConfig(device="cpu").kernels.backend == "torch"
    tuned = TRITON.replace(small_m_max=16, gemv_tiles="uniform")
    cfg = RuntimeConfig(device="cpu", kernels=tuned)
    assert cfg.kernels == tuned.replace(backend="torch") and not cfg.use_triton  # auto on CPU
    tri = cfg.replace(kernel_backend="triton")
    assert tri.use_triton and tri.kernels.small_m_max == 16 and tri.kernels.gemv_tiles == "uniform"
    assert tri.replace(kernel_backend="torch").kernels == cfg.kernels
    with pytest.raises(ValueError, match="^kernels: expected None or a KernelConfig"):
        RuntimeConfig(device="cpu", kernels={"pdl": False})


def test_launch_options_follow_the_config(monkeypatch):
    """PDL on a CUDA device (not interpreting: computed on the host, no GPU needed) at every
    row count (one compiled variant), the early trigger up to `pdl_max_rows` rows (a runtime
    argument); off with `pdl=False`; EARLY with `pdl_early_loads`."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cuda = torch.device("cuda")
    on = {"PDL": True, "launch_pdl": True, "pdl_trigger": 1}
    late = {"PDL": True, "launch_pdl": True, "pdl_trigger": 0}
    assert pdl.launch_options(cuda, 4, kernels=TRITON) == on
    assert pdl.launch_options(cuda, 5, kernels=TRITON) == late
    assert pdl.launch_options(cuda, 8, kernels=TRITON.replace(pdl_max_rows=8)) == on
    assert pdl.launch_options(cuda, 1, kernels=TRITON.replace(pdl=False)) == {
        "PDL": False, "pdl_trigger": 1}
    assert pdl.launch_options(cuda, 1, early=True, kernels=TRITON) == on | {"EARLY": True}
    assert pdl.launch_options(cuda, 64, early=True, kernels=TRITON) == late | {"EARLY": True}
    assert (pdl.launch_options(cuda, 1, early=True, kernels=TRITON.replace(pdl_early_loads=False))
            == on | {"EARLY": False})


def test_gemv_tiles_and_thresholds_follow_the_config():
    uniform = TRITON.replace(gemv_tiles="uniform")
    assert gemv_config(1, 4096, 4096, kernels=TRITON) != gemv_config(1, 4096, 4096, kernels=uniform)
    assert gemv_config(1, 4096, 4096, kernels=uniform) == gemv_config(4, 4096, 4096)
    x, w = torch.randn(20, 64), torch.randn(48, 64)
    gemv_kernels = {"gemv": gemv._gemv_kernel}
    for small_m_max, launches in ((32, 1), (16, 0)):  # 20 rows: GEMV, or cuBLAS above 16
        with KeyRecorder(gemv_kernels) as rec:
            y = ops.linear(x, w, kernels=TRITON.replace(small_m_max=small_m_max))
        assert rec.launches["gemv"] == launches
        torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)


def _head(dtype, seed=0, device="cpu"):
    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=48, vocab_size=97, draft_vocab_size=53,
                      max_position_embeddings=64, rope_theta=10000.0, num_aux_hidden_states=3)
    g = torch.Generator().manual_seed(seed)
    head = Eagle3DraftHead(cfg, dtype, hot_token_ids=torch.randperm(97, generator=g)[:53])
    init_random_(head, seed, std=0.3)
    req_to_page = (torch.randperm(24, generator=g) + 1).to(torch.int32).view(3, 8)
    kv = tuple(torch.randn(25 * 4, 2, 8, generator=g).to(dtype) for _ in range(2))
    head.to(device)
    return head, req_to_page.to(device), tuple(c.to(device) for c in kv), g


def _draft_two_steps(head, req_to_page, kv, g, kernels):
    """A first step (fc, 3 tokens per row, gathered rows) and a second (1 row: the M == 1 GEMV
    tiles) of `head` under `kernels`: ids, hidden, logits of both and the KV written."""
    head.set_kernels(kernels)
    backend = PagedAttentionBackend(req_to_page, 4, 32, kernels=kernels)
    dev = req_to_page.device
    reqs, starts, n = torch.tensor([1, 2], device=dev), torch.tensor([5, 2], device=dev), 3
    positions = (starts[:, None] + torch.arange(n, device=dev)).reshape(-1)
    loc = kv_slot(req_to_page, reqs.repeat_interleave(n), positions, 4)
    ids = torch.randint(0, 97, (2 * n,), generator=torch.Generator().manual_seed(1)).to(dev)
    hidden = torch.randn(2 * n, 96, generator=torch.Generator().manual_seed(2)).to(head.dtype)
    cache = tuple(c.clone() for c in kv)
    first = head(ids, positions, hidden.to(dev), loc, cache, backend,
                 AttentionMetadata(reqs, (starts + n).to(torch.int32)),
                 torch.tensor([2, 5], device=dev))
    r, pos = reqs[:1], (starts + n)[:1]
    second = head(first.ids[:1], pos, first.hidden[:1], kv_slot(req_to_page, r, pos, 4), cache,
                  backend, AttentionMetadata(r, (pos + 1).to(torch.int32)))
    return (first.ids, first.hidden, first.logits, second.ids, second.hidden, second.logits, *cache)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_configs_draft_the_same_numbers(dtype, device):
    """PDL on/off and GEMV tiles wide/uniform (with the K split forced, so the sums are split)
    move launch options and tiles, not numbers: the head's two draft steps give the same bits
    (CPU: the Triton interpreter; GPU: real PDL launches)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    head, req_to_page, kv, g = _head(dtype, device=device)
    split = TRITON.replace(gemv_split=2, gemv_block_k=16)
    outs = {name: _draft_two_steps(head, req_to_page, kv, g, kc) for name, kc in {
        "pdl": split, "plain": split.replace(pdl=False, gemv_pdl=False, pdl_early_loads=False),
        "uniform": split.replace(gemv_tiles="uniform"),
    }.items()}
    for name in ("plain", "uniform"):
        for a, b in zip(outs["pdl"], outs[name], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name
    if device != "cpu":
        return  # the torch comparison below: the interpreter's (the GPU tests compare elsewhere)
    torch_out = _draft_two_steps(head, req_to_page, kv, g, TORCH)
    tol = 1e-4 if dtype == torch.float32 else 0.1  # bf16: the interpreter truncates
    for a, b in zip(outs["pdl"], torch_out, strict=True):  # and close to the torch path
        if a.is_floating_point():
            assert float((a.float() - b.float()).norm() / b.float().norm()) < tol


def test_models_hold_the_config_they_were_built_with():
    kc = TRITON.replace(small_m_max=8)
    head = Eagle3DraftHead(_head(torch.float32)[0].config, torch.float32, kernels=kc)
    holders = [m for m in head.modules() if hasattr(m, "kernels")]
    assert len(holders) > 5 and all(m.kernels is kc for m in holders)
    assert head.logits_processor.kernels is kc and head.use_triton
    head.set_kernels(TORCH)
    assert all(m.kernels is TORCH for m in holders) and head.logits_processor.kernels is TORCH
    assert not hasattr(head, "set_use_triton")  # no flag form left: a config or nothing
    with pytest.raises(ValueError, match="^kernels: expected a KernelConfig"):
        head.set_kernels("triton")
    assert PagedAttentionBackend(torch.zeros(1, 1, dtype=torch.int32), 1, 1, kernels=kc).kernels is kc
    with pytest.raises(ValueError, match="^kernels: expected a KernelConfig"):
        PagedAttentionBackend(torch.zeros(1, 1, dtype=torch.int32), 1, 1, kernels=True)
    with pytest.raises(TypeError):  # the positional use_triton flag is gone
        PagedAttentionBackend(torch.zeros(1, 1, dtype=torch.int32), 1, 1, True)
    for op in (ops.out_cache_loc_uniform, ops.advance_positions_and_seq_lens,
               ops.decode_draft_indices, ops.stage_decode_inputs, ops.prepare_rows,
               ops.accept_tokens, ops.commit_pack, ops.build_tree, ops.tree_accept,
               ops.move_accepted_kv, ops.gather_accepted_hidden, ops.accept_control):
        params = inspect.signature(op).parameters
        assert "use_triton" not in params and "kernels" in params, op.__name__
    from graphdraft.kernels import (
        accept,
        accept_control,
        cycle_kernels,
        kv_move,
        tree_accept,
        tree_build,
    )

    for wrapper in (accept.accept_tokens, cycle_kernels.prepare_rows, cycle_kernels.commit_pack,
                    tree_build.build_tree, tree_accept.tree_accept, kv_move.move_accepted_kv,
                    kv_move.gather_accepted_hidden, accept_control.accept_control):
        params = inspect.signature(wrapper).parameters  # the Triton wrappers: one call shape
        assert "use_triton" not in params and "kernels" in params, wrapper.__name__


_SETTING_NAMES = ("SMALL_M_MAX", "GEMV_PDL", "STREAM_EVICT_FIRST", "FINISH_MAXNREG",
                  "FINISH_NORM_MAX_M", "ENABLED", "MAX_ROWS", "EARLY_LOADS", "TILES_ENV",
                  "BLOCK_N", "TILES")
_KERNEL_MODULES = sorted(p.stem for p in (ROOT / "graphdraft" / "kernels").glob("*.py")) + ["ops"]


def test_no_kernel_setting_is_a_module_global():
    """The settings live in KernelConfig only: no module keeps one (the attention kernels'
    BLOCK_N and tiles included: `decode_block_n`, `extend_tiles`, `extend_num_stages`), and
    nothing in the repo assigns an upper-case name on a kernel module (`setattr(module,
    "NAME", ...)`, `monkeypatch.setattr(module, "NAME", ...)`, `module.NAME = / .update(`)."""
    from graphdraft.kernels import buckets, decode_attention, extend_attention

    for mod in (ops, gemv, pdl, buckets, decode_attention, extend_attention):
        assert not [n for n in _SETTING_NAMES if hasattr(mod, n)], mod.__name__
    assert not hasattr(extend_attention, "NUM_STAGES")  # `extend_num_stages`
    mods = "|".join(_KERNEL_MODULES)
    pattern = re.compile(rf"setattr\(\s*({mods})\s*,\s*[\"'][A-Z_]+[\"']"
                         rf"|\b({mods})\.[A-Z][A-Z_]*\s*(=[^=]|\.(update|clear|pop)\()")
    assert pattern.search('monkeypatch.setattr(extend_attention, "TILES", {})')  # can fail
    assert pattern.search("    decode_attention.BLOCK_N = 16")
    hits = [f"{p.relative_to(ROOT)}:{i}" for base in ("graphdraft", "tests", "perf", "scripts")
            for p in (ROOT / base).rglob("*.py") if p.name != "test_kernel_config.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_attention_settings_default_to_the_shipped_launches():
    """The attention kernels' settings default to the measured tiles and stages (the values
    `KernelConfig`'s docstrings cite); env vars read once, bad values named."""
    kc = KernelConfig()
    assert (kc.decode_block_n, kc.extend_num_stages, kc.extend_prefill_stages) == (64, 2, 3)
    assert kc.extend_tiles == ((16, 64, 4), (32, 64, 4), (64, 64, 4), (128, 64, 4))
    env = {"GRAPHDRAFT_DECODE_BLOCK_N": "32", "GRAPHDRAFT_EXTEND_NUM_STAGES": "4"}
    assert KernelConfig.from_env(env).replace(decode_block_n=64, extend_num_stages=2) == kc
    for var, bad in (("GRAPHDRAFT_DECODE_BLOCK_N", "48"), ("GRAPHDRAFT_DECODE_FUSED_COMBINE", "half"), ("GRAPHDRAFT_DECODE_BLOCK_N", "8"),
                     ("GRAPHDRAFT_EXTEND_NUM_STAGES", "0"), ("GRAPHDRAFT_EXTEND_TILES", "16x64")):
        with pytest.raises(ValueError, match=f"^{var}: expected"):
            KernelConfig.from_env({var: bad})
    with pytest.raises(ValueError, match="^extend_tiles: expected"):
        KernelConfig(extend_tiles=[(16, 64, 4)] * 4)  # a list: not hashable, not frozen
