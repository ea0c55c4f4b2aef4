"""Llama-3.1-8B-shaped target (and its EAGLE-3 head) with random bf16 weights, built on the device.

For the end-to-end, verify and capture benchmarks: 32 layers, hidden 4096, 32/8 heads of 128,
ffn 14336, vocab 128256 (16.1 GB of bf16 weights). Weights are drawn on the device
(N(0, std), norm weights 1 + N(0, 0.1)): host initialisation of 8 G values takes minutes.

`make_peaked_` turns the random target into one with a robust greedy continuation (for the
benchmarks that need the speculative text to equal a target-only oracle): same shapes, same
bytes, same work per token.
"""

from __future__ import annotations

import torch

from graphdraft.config import ModelConfig
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.layers import init_random_
from graphdraft.models.llama import LlamaForCausalLM

LLAMA31_8B = ModelConfig(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=14336, num_hidden_layers=32, vocab_size=128256,
    max_position_embeddings=8192, rope_theta=500000.0)
"""Llama-3.1-8B's shape (no rope scaling: the speed is the same)."""
LLAMA31_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""Llama-3.1-8B's config.json `rope_scaling` (perf/long.py's long contexts)."""

LLAMA31_8B_HEAD = ModelConfig(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=14336, vocab_size=128256, draft_vocab_size=32000,
    max_position_embeddings=8192, rope_theta=500000.0)
"""EAGLE-3 head shaped for Llama-3.1-8B (weights read per draft step: 748.7 MB in bf16)."""


def build_head(mc: ModelConfig, device: str | torch.device, *, dtype: torch.dtype = torch.bfloat16,
               seed: int = 0, std: float = 0.02) -> Eagle3DraftHead:
    """A head with random weights and, for a draft vocab, a random hot-token map.

    CPU: `init_random_`. CUDA: the same distribution drawn on the device (N(0, std),
    norm weights 1 + N(0, 0.1)): `init_random_` draws on the host, about 20 s for the
    8B-shaped head's 0.9 G values, which the perf budget cannot spare.
    """
    gen = torch.Generator().manual_seed(seed)
    hot = (torch.randperm(mc.vocab_size, generator=gen)[: mc.output_vocab_size]
           if mc.output_vocab_size < mc.vocab_size else None)
    head = Eagle3DraftHead(mc, dtype, hot_token_ids=hot)
    if torch.device(device).type == "cpu":
        init_random_(head, seed, std=std)
        return head
    head.to(device)
    dgen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(head.named_parameters()):
            is_norm = "norm" in name
            p.normal_(1.0 if is_norm else 0.0, 0.1 if is_norm else std, generator=dgen)
    return head


def kv_bytes_per_token(mc: ModelConfig, dtype_bytes: int = 2) -> int:
    """K and V of one token over every layer (Llama-3.1-8B bf16: 128 KiB)."""
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * dtype_bytes


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameters (a shared embedding counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


DRAFT_STEP_MATMULS = {
    "o": (4096, 4096, None, None), "down": (4096, 14336, "silu_mul", None),
    "qkv": (6144, 8192, None, None), "gate_up": (28672, 4096, None, None),
    "lm_head": (32000, 4096, None, "argmax"), "fc": (4096, 12288, None, None)}
"""The 8B head's draft-step matmuls, name: (N, K, input activation, epilogue); fc once per call."""
TARGET_LAYER_MATMULS = {
    "gate_up": (28672, 4096, None, None), "down": (4096, 14336, "silu_mul", None),
    "qkv": (6144, 4096, None, None), "o": (4096, 4096, None, None)}
"""One layer of the 8B target's matmuls (the same form): its verify and decode steps run them
on the GEMV up to `KernelConfig.small_m_max` rows (verify bs 8: 32 rows)."""


@torch.no_grad()
def build_target(device: str | torch.device = "cuda", mc: ModelConfig = LLAMA31_8B, *,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 std: float = 0.02) -> LlamaForCausalLM:
    """The target with random weights drawn on `device` (no host copy of the weights)."""
    with torch.device(device):
        model = LlamaForCausalLM(mc, dtype)
    model.to(device)  # buffers built on the host (the RoPE table)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        is_norm = "norm" in name
        p.normal_(1.0 if is_norm else 0.0, 0.1 if is_norm else std, generator=gen)
    return model


def build_pair(device: str | torch.device = "cuda", *, seed: int = 0
               ) -> tuple[LlamaForCausalLM, Eagle3DraftHead]:
    """The 8B-shaped target and its EAGLE-3 head (draft vocab 32000), the head sharing the
    target's embedding."""
    target = build_target(device, seed=seed)
    head = build_head(LLAMA31_8B_HEAD, device, seed=seed + 1)
    head.embed_tokens = target.embed_tokens
    return target, head


@torch.no_grad()
def damp_residual_branches_(target: torch.nn.Module, scale: float) -> None:
    """Scale every layer's o_proj and down_proj weights in place (the residual branches)."""
    for name, p in target.named_parameters():
        if name.endswith(("self_attn.o_proj", "mlp.down_proj")):
            p.mul_(scale)


PEAK_SCALE = 4.0
"""lm_head row perm(t) = PEAK_SCALE * embedding row t (`make_peaked_`)."""
PEAK_RESIDUAL_SCALE = 1e-3
"""o_proj / down_proj scale of the peaked target (`make_peaked_`)."""


@torch.no_grad()
def make_peaked_(target: LlamaForCausalLM, *, seed: int = 0, scale: float = PEAK_SCALE,
                 residual_scale: float = PEAK_RESIDUAL_SCALE) -> torch.Tensor:
    """Give a random-weight target a peaked, deterministic next token, in place: the LM head's
    rows become a fixed permutation of the embedding rows times `scale`
    (`lm_head[perm[t]] = scale * embed[t]`) and the residual branches (o_proj, down_proj) are
    scaled by `residual_scale`, so the last hidden state is the input token's embedding plus
    a small perturbation and argmax(logits after token t) = perm[t] by a wide margin (the
    embedding row's squared norm, ~ H * std^2, against cross products ~ sqrt(H) * std^2: about
    13x at H = 4096 with 128256 rows). Greedy text then follows t -> perm[t] whatever the
    verify width's bf16 rounding. Same shapes and bytes as before (the cost is the weights'
    bytes, not their values). Returns perm `[V]` int64 (on the target's device).
    ValueError for a tied LM head (its rows are the embedding) or a bad scale."""
    if target.lm_head is target.embed_tokens:
        raise ValueError("target: expected an untied lm_head (tie_word_embeddings=False)")
    for name, x in (("scale", scale), ("residual_scale", residual_scale)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 or x == float("inf"):
            raise ValueError(f"{name}: expected a finite number > 0, got {x!r}")
    emb = target.embed_tokens
    gen = torch.Generator(device=emb.device).manual_seed(seed)
    perm = torch.randperm(emb.shape[0], generator=gen, device=emb.device)
    target.lm_head.index_copy_(0, perm, emb * scale)
    damp_residual_branches_(target, residual_scale)
    return perm
