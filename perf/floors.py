"""HBM floors: the fewest bytes a call must read, over the copy bandwidth measured in the same run.

One draft call (`floor_bytes`, `floor_info`), and the target's steps at a context length
(`target_read_bytes`, `decode_floor_bytes`, `cycle_floor_bytes`, `attention_floor_bytes`: the
long-context benchmark, perf/long.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphdraft.config import ModelConfig
from perf.cases import STEPS


def weight_bytes_per_step(mc: ModelConfig, dtype_bytes: int = 2) -> int:
    """Weights every draft step reads: qkv, o, gate_up, down, lm_head (norms/embedding rows ~0)."""
    h, d, hq, hkv = mc.hidden_size, mc.head_dim, mc.num_attention_heads, mc.num_key_value_heads
    qkv = (hq + 2 * hkv) * d * 2 * h  # input is [embeds ; hidden], 2H wide
    o = h * hq * d
    gate_up = 2 * mc.intermediate_size * h
    down = h * mc.intermediate_size
    lm_head = mc.output_vocab_size * h
    return (qkv + o + gate_up + down + lm_head) * dtype_bytes


@dataclass(frozen=True)
class FloorBytes:
    """The fewest HBM bytes one draft call (first step + `steps - 1` multi-steps) must read."""

    weights_per_step: int
    fc: int
    """First step only: the `[H, k*H]` projection of the target hidden states."""
    kv_per_step: int
    """`bs * kv_len * 2 (K, V) * Hkv * D * dtype_bytes`."""
    hidden_in: int
    """First step only: the target hidden states, `bs * N * k*H * dtype_bytes`."""
    steps: int

    @property
    def first_step(self) -> int:
        return self.weights_per_step + self.fc + self.kv_per_step + self.hidden_in

    @property
    def multi_step(self) -> int:
        return (self.steps - 1) * (self.weights_per_step + self.kv_per_step)

    @property
    def total(self) -> int:
        return self.first_step + self.multi_step

    @property
    def weights_only(self) -> int:
        """The anchor floor: `steps` x the per-step weights (no fc, KV or hidden)."""
        return self.steps * self.weights_per_step


def floor_bytes(mc: ModelConfig, bs: int, kv_len: int, steps: int = STEPS,
                dtype_bytes: int = 2) -> FloorBytes:
    h = mc.hidden_size
    return FloorBytes(
        weights_per_step=weight_bytes_per_step(mc, dtype_bytes),
        fc=h * mc.num_aux_hidden_states * h * dtype_bytes,
        kv_per_step=bs * kv_len * 2 * mc.num_key_value_heads * mc.head_dim * dtype_bytes,
        hidden_in=bs * (steps + 1) * mc.num_aux_hidden_states * h * dtype_bytes,
        steps=steps)


def floor_info(mc: ModelConfig, bs: int, kv_len: int, bandwidth: float,
               steps: int = STEPS) -> dict[str, float]:
    """The floor's bytes and times (us) at `bandwidth` bytes/s, as benchmark extra_info."""
    fb = floor_bytes(mc, bs, kv_len, steps)
    us = 1e6 / bandwidth
    return {"floor_bytes": fb.total, "floor_us": fb.total * us,
            "floor_first_us": fb.first_step * us, "floor_multi_us": fb.multi_step * us,
            "weights_floor_us": fb.weights_only * us}



def kv_bytes_per_token(mc: ModelConfig, dtype_bytes: int = 2) -> int:
    """K and V of one token over every layer of `mc` (Llama-3.1-8B in bf16: 128 KiB)."""
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * dtype_bytes


def target_read_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one target forward reads: every distinct parameter once, less an untied
    embedding table (gathered a row a token, not read whole; as perf/verify.py counts it)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    emb, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if emb is not None and head is not emb:
        total -= emb.numel() * emb.element_size()
    return total


def attention_floor_bytes(mc: ModelConfig, bs: int, kv_len: float, dtype_bytes: int = 2) -> float:
    """Every row's KV read once over every layer: `bs * kv_len * kv_bytes_per_token`."""
    return bs * kv_len * kv_bytes_per_token(mc, dtype_bytes)


def decode_floor_bytes(target: torch.nn.Module, bs: int, kv_len: float) -> float:
    """A target-only decode step: the target's weights (`target_read_bytes`) and its KV once."""
    return target_read_bytes(target) + attention_floor_bytes(
        target.config, bs, kv_len, target.dtype.itemsize)


def cycle_floor_bytes(target: torch.nn.Module, head_cfg: ModelConfig, bs: int, kv_len: float,
                      steps: int = STEPS, dtype_bytes: int = 2) -> float:
    """A speculative cycle: the verify (target weights, KV of `kv_len + steps + 1` positions a
    row) plus the draft call (`floor_bytes`: head weights each step, fc once, draft KV each
    step, the hidden states in), as perf/e2e.py's `floor_ms` counts it but for the gathered
    embedding table."""
    verify = target_read_bytes(target) + attention_floor_bytes(
        target.config, bs, kv_len + steps + 1, target.dtype.itemsize)
    return verify + floor_bytes(head_cfg, bs, int(round(kv_len)), steps, dtype_bytes).total
