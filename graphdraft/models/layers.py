"""Llama building blocks shared by the target model and the EAGLE-3 head.

Weights are plain `nn.Parameter`s in HF layout (`[out_features, in_features]`),
with q/k/v and gate/up fused: `qkv_proj [(Hq + 2 Hkv) * D, in]`,
`gate_up_proj [2 F, H]`. Each layer calls `graphdraft.ops` with the `KernelConfig` its model
holds (`kernels`: the Triton or torch path, tiles, PDL, thresholds), set once for the whole
model by `set_kernels` (the models' `set_kernels`, called at construction).

Tensor parallelism (`graphdraft.parallel`): `Attention` and `MLP` hold `tp = None`
(single device: no collective, today's code path) or, after `parallel.shard_`, their
rank's column slices of qkv / gate_up and row slices of o / down, with the head counts and
intermediate size set to the rank-local ones; their output is then all-reduced over the
tensor-parallel group (`dist.all_reduce` on the current stream, capturable with NCCL).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from graphdraft import ops
from graphdraft.config import ModelConfig
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.config import default as default_kernels
from graphdraft.models.attention import AttentionMetadata, PagedAttentionBackend

if TYPE_CHECKING:
    from graphdraft.parallel import TensorParallel


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.kernels: KernelConfig = default_kernels()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`[M, H]`; with residual: `(norm(x + residual), x + residual)`."""
        return ops.rms_norm(x, self.weight, self.eps, residual, kernels=self.kernels)


class Attention(nn.Module):
    """GQA self-attention with RoPE over the paged KV cache.

    forward: x `[T, input_size]` -> `[B, H]` (B = len(gather_ids), else T).
    KV of all T tokens is written first; only the gathered query rows attend.
    Tensor-parallel (`tp` set by `parallel.shard_attention_`): num_heads / num_kv_heads are
    this rank's (the KV cache holds only them); the o_proj partial sums are all-reduced.
    """

    def __init__(self, cfg: ModelConfig, input_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, input_size, dtype=dtype)
        self.o_proj = _param(cfg.hidden_size, self.q_size, dtype=dtype)
        self.sm_scale = self.head_dim ** -0.5
        self.kernels: KernelConfig = default_kernels()
        self.tp: TensorParallel | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], cos_sin: torch.Tensor,
                backend: PagedAttentionBackend, metadata: AttentionMetadata,
                gather_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.project(self.attend(self.qkv(x), positions, out_cache_loc, kv, cos_sin, backend,
                                        metadata, gather_ids))

    def project(self, attn: torch.Tensor) -> torch.Tensor:
        """o_proj of `attend`'s output `[B, Hq * D] -> [B, H]`, all-reduced when tensor-parallel."""
        out = ops.linear(attn, self.o_proj, kernels=self.kernels)
        return out if self.tp is None else self.tp.all_reduce(out)

    def qkv(self, x: torch.Tensor) -> torch.Tensor | ops.SplitK:
        """`[T, input_size] -> [T, (Hq + 2 Hkv) * D]` (`attend`'s input); where the Triton path
        runs the GEMV, the same product as an `ops.SplitK`, which `attend`'s RoPE kernel sums
        (`ops.linear_partials`: the same bits, one launch fewer). Pass it to `attend` as is."""
        return ops.linear_partials(x, self.qkv_proj, kernels=self.kernels)

    def attend(self, qkv: torch.Tensor | ops.SplitK, positions: torch.Tensor, out_cache_loc: torch.Tensor,
               kv: tuple[torch.Tensor, torch.Tensor], cos_sin: torch.Tensor,
               backend: PagedAttentionBackend, metadata: AttentionMetadata,
               gather_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Between qkv and o_proj: RoPE, KV write of all T tokens, attention of the gathered
        rows -> `[B, Hq * D]`. qkv is `qkv`'s output (`[T, (Hq + 2 Hkv) * D]` or its
        `SplitK`)."""
        k_cache, v_cache = kv
        q = ops.rope_and_store_qkv(qkv, positions, cos_sin, k_cache, v_cache, out_cache_loc,
                                   kernels=self.kernels)
        out = backend.attend(q, k_cache, v_cache, self.sm_scale, metadata, q_index=gather_ids)
        return out.reshape(out.shape[0], self.q_size)


class MLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`, `[M, H] -> [M, H]`.

    Tensor-parallel (`tp` set by `parallel.shard_mlp_`): intermediate_size is this rank's
    slice; the down_proj partial sums are all-reduced.
    Data-parallel (`dp` set by `data_parallel.shard_dense_`): the same slices, run over the
    rows of every rank (`DataParallel.dense`: all-gather, local MLP, reduce-scatter)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = _param(2 * intermediate_size, hidden_size, dtype=dtype)
        self.down_proj = _param(hidden_size, intermediate_size, dtype=dtype)
        self.kernels: KernelConfig = default_kernels()
        self.tp: TensorParallel | None = None
        self.dp = None  # a data_parallel.DataParallel after shard_dense_

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp is not None:
            return self.dp.dense(x, self._local)
        out = ops.linear(self.gate_up(x), self.down_proj, act="silu_mul", kernels=self.kernels)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum `[M, H]` (no collective)."""
        return ops.linear(self.gate_up(x), self.down_proj, act="silu_mul", kernels=self.kernels)

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """`[M, H] -> [M, 2F]` `[gate ; up]` (the down projection's `act="silu_mul"` input)."""
        return ops.linear(x, self.gate_up_proj, kernels=self.kernels)


def set_kernels(module: nn.Module, kernels: KernelConfig) -> None:
    """Run `module` and every layer in it (each module with a `kernels` attribute) under
    `kernels`; ValueError naming `kernels` unless it is a `KernelConfig`. Once, at
    construction: the config is frozen, the layers hold a reference to it."""
    if not isinstance(kernels, KernelConfig):
        raise ValueError(f"kernels: expected a KernelConfig, got {type(kernels).__name__}")
    for m in module.modules():
        if hasattr(m, "kernels"):
            m.kernels = kernels


class KernelsMixin:
    """`set_kernels` / `use_triton` (read only) of a model (`LlamaForCausalLM`,
    `Eagle3DraftHead`) whose layers run under `self.kernels`."""

    kernels: KernelConfig

    def set_kernels(self, kernels: KernelConfig) -> None:
        """Run every layer under `kernels` (`RuntimeConfig.kernels`; once, at construction)."""
        set_kernels(self, kernels)

    @property
    def use_triton(self) -> bool:
        """The Triton path (`kernels.use_triton`)."""
        return self.kernels.use_triton


@torch.no_grad()
def init_random_(module: nn.Module, seed: int, std: float = 0.02) -> None:
    """Fill every weight with N(0, std) (norm weights: 1 + N(0, 0.1)), deterministically.

    Drawn in fp32 with a generator on the parameters' device (one per device, seeded with
    `seed`), so a model built on a GPU is filled there (seconds for 8B weights, not minutes
    in host fp32). The same seed gives the same weights on the same device type; CPU and
    CUDA generators draw different (equally distributed) values. Meta parameters are skipped.
    """
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        if p.device.type == "meta":
            continue
        gen = gens.get(p.device)
        if gen is None:
            gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        vals = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        if name.endswith("norm.weight") or "layernorm" in name or name.endswith("hidden_norm.weight"):
            vals.mul_(0.1).add_(1.0)
        else:
            vals.mul_(std)
        with torch.no_grad():
            p.copy_(vals)
