"""HBM floors of one draft call: the fewest bytes it must read, over the measured copy bandwidth."""

from __future__ import annotations

from dataclasses import dataclass

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

