"""Llama-family target model over the paged KV pool.

RMSNorm, RoPE (optional Llama-3 scaling), GQA, SwiGLU, tied or untied embeddings.
A forward returns logits for the sampled rows only and, for EAGLE-3, the
residual stream entering the configured aux layers, concatenated:
`aux_hidden [T, k*H]`.

Tensor parallelism: `parallel.shard_(model, tp)` slices the loaded weights (see
`graphdraft.parallel`); afterwards `config` is the rank-local shape (the engine sizes its
KV pool from it), `global_config` the checkpoint's, and the forward adds a vocab-parallel
embedding lookup, the all-reduces of the row-parallel layers and the all-gather of the
LM-head logits. The outputs (logits over the full vocab, aux hidden) are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from graphdraft import ops
from graphdraft.config import ModelConfig
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.config import default as default_kernels
from graphdraft.kernels.rope import rope_cos_sin_cache
from graphdraft.models.attention import AttentionMetadata, PagedAttentionBackend
from graphdraft.models.layers import MLP, Attention, KernelsMixin, RMSNorm, _param
from graphdraft.runtime.kv_cache import KVPool

if TYPE_CHECKING:
    from graphdraft.parallel import TensorParallel


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, cfg.hidden_size, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype)


@dataclass
class TargetOutput:
    """logits `[B, V]` of the sampled rows; aux_hidden `[T, k*H]` (None when not asked)."""

    logits: torch.Tensor
    aux_hidden: torch.Tensor | None


class LlamaForCausalLM(KernelsMixin, nn.Module):
    """The target. `kernels`: the kernel settings its layers run under (None: the default
    config, the torch path); `set_kernels(cfg.kernels)` sets them once after construction."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, *,
                 kernels: KernelConfig | None = None) -> None:
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.global_config = cfg
        self.tp: TensorParallel | None = None
        self.dp = None  # a data_parallel.DataParallel after data_parallel.shard_dense_
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.register_buffer("cos_sin", rope_cos_sin_cache(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling),
            persistent=False)
        self.aux_layer_ids = cfg.aux_layer_ids()
        if not all(0 <= i < cfg.num_hidden_layers for i in self.aux_layer_ids):
            raise ValueError(f"aux_hidden_state_layer_ids: expected ids in [0, "
                             f"{cfg.num_hidden_layers}), got {self.aux_layer_ids}")
        self.kernels: KernelConfig = default_kernels()
        self.set_kernels(kernels if kernels is not None else self.kernels)

    @property
    def aux_hidden_width(self) -> int:
        return len(self.aux_layer_ids) * self.config.hidden_size

    @torch.no_grad()
    def shard_(self, tp: TensorParallel, memo: dict) -> None:
        """Keep this rank's slices (use `parallel.shard_`, which also handles tp None / 1)."""
        from graphdraft import parallel

        local = parallel.local_config(self.config, tp)  # raises before anything changes
        for layer in self.layers:
            parallel.shard_attention_(layer.self_attn, tp)
            parallel.shard_mlp_(layer.mlp, tp)
        tied = self.lm_head is self.embed_tokens
        shard = lambda w: parallel.vocab_rows(w, tp)
        self.embed_tokens = parallel.shared_shard(memo, self.embed_tokens, shard)
        self.lm_head = (self.embed_tokens if tied
                        else parallel.shared_shard(memo, self.lm_head, shard))
        self.config, self.tp = local, tp

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                out_cache_loc: torch.Tensor, kv_pool: KVPool, backend: PagedAttentionBackend,
                metadata: AttentionMetadata, logits_rows: torch.Tensor | None = None,
                capture_aux: bool = True, aux_out: torch.Tensor | None = None) -> TargetOutput:
        """input_ids/positions/out_cache_loc `[T]`; metadata per token (causal kv lens);
        logits_rows `[B]` int64 (None: every token). `aux_out` `[T, k*H]` (contiguous, the
        model's dtype): the aux hidden states are written there (e.g. into the drafter's
        `decode_hidden_buffer`, which then needs no copy)."""
        if aux_out is not None:
            shape = (input_ids.shape[0], self.aux_hidden_width)
            if (not capture_aux or tuple(aux_out.shape) != shape or not aux_out.is_contiguous()
                    or aux_out.dtype != self.embed_tokens.dtype
                    or aux_out.device != input_ids.device):
                raise ValueError(f"aux_out: expected a contiguous {self.embed_tokens.dtype} "
                                 f"{list(shape)} on {input_ids.device} (with capture_aux), got "
                                 f"{aux_out.dtype} {list(aux_out.shape)} on {aux_out.device}")
        tp = self.tp
        hidden = self.embed_tokens[input_ids] if tp is None else tp.embed(input_ids,
                                                                          self.embed_tokens)
        # o_proj and down_proj fused with the residual add and the next RMSNorm (the GEMV's
        # finisher at few rows, `ops.linear_residual_rms_norm`: the unfused ops' bits, fewer
        # launches); tensor / data parallel: the outputs are reduced before the residual add
        fused = tp is None and all(layer.mlp.dp is None for layer in self.layers)
        residual = hidden  # the residual stream entering layer i
        aux: dict[int, torch.Tensor] = {}
        x = self.layers[0].input_layernorm(hidden)
        for i, layer in enumerate(self.layers):
            if capture_aux and i in self.aux_layer_ids:
                aux[i] = residual
            attn_layer, mlp, post = layer.self_attn, layer.mlp, layer.post_attention_layernorm
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            attn = attn_layer.attend(attn_layer.qkv(x), positions, out_cache_loc, kv_pool.layer(i),
                                     self.cos_sin, backend, metadata)
            if fused:
                x, residual = ops.linear_residual_rms_norm(attn, attn_layer.o_proj, residual,
                                                           post.weight, post.eps,
                                                           kernels=self.kernels)
                x, residual = ops.linear_residual_rms_norm(mlp.gate_up(x), mlp.down_proj, residual,
                                                           after.weight, after.eps,
                                                           act="silu_mul", kernels=self.kernels)
            else:
                x, residual = post(attn_layer.project(attn), residual)
                x, residual = after(mlp(x), residual)
        normed = x
        if logits_rows is not None:
            normed = normed.index_select(0, logits_rows)
        # the target's LM head runs on cuBLAS on either path (as it always has: not the GEMV)
        logits = ops.linear(normed, self.lm_head, kernels=self.kernels.with_backend("torch"))
        if tp is not None:
            logits = tp.gather_vocab(logits, self.config.vocab_size)
        aux_hidden = (torch.cat([aux[i] for i in self.aux_layer_ids], -1, out=aux_out)
                      if capture_aux else None)
        return TargetOutput(logits, aux_hidden)
