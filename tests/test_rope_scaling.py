"""Llama-3.1's rope scaling (HF `rope_type: "llama3"`) for 128k contexts.

The table `rope_cos_sin_cache` builds against a plain reference written from Hugging Face's
definition (`_compute_llama3_parameters`: each frequency kept, divided by `factor` or blended
by its wavelength against the original context), at positions up to 131071; transformers'
own inverse frequencies when it is installed; the target model's table; the Triton RoPE kernel
reading the scaled table at 128k positions (interpreter); bad parameters named.
"""

from __future__ import annotations

import math

import pytest
import torch

from graphdraft.config import ModelConfig
from graphdraft.kernels.config import TRITON
from graphdraft.kernels.rope import (
    llama3_inv_freq,
    rope_and_store_kv,
    rope_and_store_kv_ref,
    rope_cos_sin_cache,
)
from graphdraft.models.llama import LlamaForCausalLM
from perf.models_8b import LLAMA31_ROPE_SCALING as LLAMA31

THETA = 500000.0
POSITIONS = (0, 1, 2047, 8191, 8192, 32767, 65536, 131071)


def hf_llama3_inv_freq(dim: int, base: float, factor: float, low: float, high: float,
                       old_context: int) -> list[float]:
    """Hugging Face's llama3 rule, one frequency at a time in Python floats."""
    low_wavelen, high_wavelen = old_context / low, old_context / high
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / base ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def _reference(dim: int) -> list[float]:
    return hf_llama3_inv_freq(dim, THETA, 8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("dim", [128, 64, 16])
def test_inverse_frequencies_match_the_hf_rule(dim):
    base = 1.0 / (THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ours = llama3_inv_freq(base, LLAMA31)
    torch.testing.assert_close(ours, torch.tensor(_reference(dim), dtype=torch.float64),
                               rtol=1e-12, atol=0)
    # the three regimes all occur at D = 128: kept, divided, blended
    if dim == 128:
        ratio = (base / ours).tolist()
        assert ratio[0] == 1.0 and ratio[-1] == 8.0
        assert any(1.0 < r < 8.0 for r in ratio)


def test_table_matches_the_reference_at_128k_positions():
    dim = 128
    table = rope_cos_sin_cache(dim, 131072, THETA, LLAMA31, device="cpu")
    assert table.shape == (131072, dim) and table.dtype == torch.float32
    freqs = _reference(dim)
    for p in POSITIONS:
        cos = torch.tensor([math.cos(p * f) for f in freqs], dtype=torch.float32)
        sin = torch.tensor([math.sin(p * f) for f in freqs], dtype=torch.float32)
        torch.testing.assert_close(table[p, : dim // 2], cos, rtol=0, atol=1e-6)
        torch.testing.assert_close(table[p, dim // 2:], sin, rtol=0, atol=1e-6)
    plain = rope_cos_sin_cache(dim, 131072, THETA, None, device="cpu")
    assert not torch.equal(plain[65536], table[65536])  # the scaling changed long positions
    assert torch.equal(plain[:, 0], table[:, 0])  # the highest frequency is kept


def test_default_type_is_no_scaling():
    plain = rope_cos_sin_cache(16, 64, THETA, None, device="cpu")
    for scaling in ({"rope_type": "default"}, {"type": "default"}, {}):
        assert torch.equal(rope_cos_sin_cache(16, 64, THETA, scaling, device="cpu"), plain)


def test_transformers_gives_the_same_inverse_frequencies():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128,
                                   max_position_embeddings=131072,
                                   rope_parameters={"rope_theta": THETA, **LLAMA31})
    inv, factor = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert factor == 1.0  # cos / sin are not rescaled
    base = 1.0 / (THETA ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    torch.testing.assert_close(llama3_inv_freq(base, LLAMA31), inv.double(), rtol=1e-6, atol=0)


def test_the_target_builds_its_table_with_the_scaling():
    mc = ModelConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64, num_hidden_layers=1, vocab_size=64,
                     max_position_embeddings=131072, rope_theta=THETA, rope_scaling=LLAMA31)
    model = LlamaForCausalLM(mc, torch.float32)
    assert torch.equal(model.cos_sin, rope_cos_sin_cache(16, 131072, THETA, LLAMA31, "cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kernel_reads_the_scaled_table_at_128k_positions(dtype):
    """The Triton RoPE + KV store over positions near 131071 (int64 table offsets) equals the
    torch reference on the scaled table."""
    hq, hkv, d = 4, 2, 16
    table = rope_cos_sin_cache(d, 131072, THETA, LLAMA31, device="cpu")
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([131071, 131070, 65536, 8192, 0])
    t = len(pos)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    loc = torch.tensor([3, 7, 1, 9, 4])
    outs = []
    for fn, kw in ((rope_and_store_kv, {"kernels": TRITON}), (rope_and_store_kv_ref, {})):
        x = qkv.clone()
        q = x[:, : hq * d].view(t, hq, d)
        k = x[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        v = x[:, (hq + hkv) * d:].view(t, hkv, d)
        kc = torch.zeros(12, hkv, d, dtype=dtype)
        vc = torch.zeros_like(kc)
        fn(q, k, v, pos, table, kc, vc, loc, **kw)
        outs.append((q.clone(), kc, vc))
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "llama3"}, "'factor'"),
    ({"rope_type": "llama3", "factor": "8"}, "'factor'"),
    ({**LLAMA31, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "high_freq_factor"),
    ({**LLAMA31, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4.0}, "unsupported rope_type 'yarn'"),
    ([("factor", 8.0)], "expected a dict"),
])
def test_bad_scaling_is_named(scaling, match):
    with pytest.raises(ValueError, match="rope_scaling") as err:
        rope_cos_sin_cache(16, 8, THETA, scaling, device="cpu")
    assert match in str(err.value)
