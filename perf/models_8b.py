"""Llama-3.1-8B-shaped target (and its EAGLE-3 head) with random bf16 weights, built on the device.

For the end-to-end, verify and capture benchmarks: 32 layers, hidden 4096, 32/8 heads of 128,
ffn 14336, vocab 128256 (16.1 GB of bf16 weights). Weights are drawn on the device
(N(0, std), norm weights 1 + N(0, 0.1)): host initialisation of 8 G values takes minutes.
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
