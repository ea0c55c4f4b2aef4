"""The EAGLE-3 draft head: one Llama decoder layer over [embedding ; target hidden].

Weights (HF layout, `[out, in]`):
  embed_tokens  [V, H]          may be the target's (shared, not copied)
  fc            [H, k*H]        projects the k concatenated target hidden states
  midlayer      input_layernorm [H], hidden_norm [H], self_attn (qkv [(Hq+2Hkv)*D, 2H], o [H, Hq*D]),
                post_attention_layernorm [H], mlp (gate_up [2F, H], down [H, F])
  norm          [H]
  lm_head       [Vd, H]         over the draft vocab; its own (`lm_head_source` "own", trained and
                                shipped) or the target's (`lm_head_source` "target": the target's
                                lm_head rows at hot_token_ids, gathered by `tie_lm_head_`, frozen,
                                not shipped: `target_lm_head_rows`)
  hot_token_ids [Vd] int64      draft id -> target id (absent when Vd == V)

One step over T tokens (positions `[T]`, KV slots `[T]`):
  e = embed(ids);  h = fc(hidden) if hidden is k*H wide else hidden
  KV of every token from qkv(cat(input_layernorm(e), hidden_norm(h)))
  then, for the B gathered rows only: attention -> o_proj, + h, post-norm, MLP, + residual
  -> pre-norm hidden `[B, H]` (the next step's hidden input) and logits of norm(pre-norm) `[B, Vd]`.
Because the head has a single layer, the non-gathered rows only feed the KV cache,
so only the gathered rows run attention, MLP and LM head.
`store_kv` is the KV-only step (the drafter's k = 0 cycle): the same prefix up to and
including the KV write (same code, the qkv projection over the k / v rows only: the same cache
entries), then nothing.

Tensor parallelism, two ways (see `graphdraft.parallel`):
  replicated  (the default) every rank runs the full head on its full weights: its inputs,
              the target's aux hidden states and output tokens, are replicated on every
              rank (the target's row-parallel all-reduces and logits all-gather make them
              so), so every rank drafts the same tokens with no communication at all.
              A head sharing the target's embedding keeps the full table.
  sharded     `parallel.shard_(head, tp)`: attention heads / KV heads, MLP and the
              draft-vocab LM head split like the target's (fc, norms and hot_token_ids
              replicated; an LM head gathered from the target's is the head's own [Vd, H]
              parameter by then, split the same way); `config` becomes rank-local, so the
              drafter's KV pool holds this rank's KV heads. Costs 2 all-reduces + 1
              embedding all-reduce + 1 logits all-gather per draft step.
  data-parallel  `data_parallel.shard_dense_(head, dp)`: only the MLP is split; it runs over
              the rows of every data-parallel rank (all-gather + reduce-scatter, 2 collectives
              per draft step); attention, embedding and LM head stay whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from graphdraft import ops
from graphdraft.checks import expect_tensor
from graphdraft.config import ModelConfig
from graphdraft.kernels import gemv
from graphdraft.kernels.argmax import check_ids_out
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.config import default as default_kernels
from graphdraft.kernels.rope import rope_cos_sin_cache
from graphdraft.models.attention import AttentionMetadata, PagedAttentionBackend
from graphdraft.models.layers import MLP, Attention, KernelsMixin, RMSNorm, _param, set_kernels
from graphdraft.models.logits import LogitsOutput, LogitsProcessor

if TYPE_CHECKING:
    from graphdraft.parallel import TensorParallel

LM_HEAD_SOURCES = ("own", "target")
"""Where a head's LM head comes from: "own" (its own weights, trained and saved) or "target"
(the target's lm_head rows at the draft vocabulary's target ids: frozen, never saved)."""


def target_lm_head_rows(lm_head: torch.Tensor, hot_token_ids: torch.Tensor | None,
                        cfg: ModelConfig) -> torch.Tensor:
    """The draft LM head a head of `cfg` takes from its target: `lm_head` (the target's
    `[V, H]` LM head weight, its embedding when tied) rows at `hot_token_ids` (`[Vd]` int,
    draft id -> target id; None: the identity, Vd == V) -> `[Vd, H]`, a new tensor on
    `lm_head`'s device in its dtype. ValueError naming the argument: `lm_head` not `[V, H]`
    of cfg's vocab_size / hidden_size (a target of another vocabulary or width),
    `hot_token_ids` not `[Vd]` or outside [0, V), or None with Vd != V."""
    v, h, vd = cfg.vocab_size, cfg.hidden_size, cfg.output_vocab_size
    if lm_head.ndim != 2 or tuple(lm_head.shape) != (v, h):
        raise ValueError(f"lm_head: expected the target's LM head of shape ({v}, {h}) (the "
                         f"head's vocab_size, hidden_size), got {tuple(lm_head.shape)}")
    if hot_token_ids is None:
        if vd != v:
            raise ValueError(f"hot_token_ids: required for a draft vocabulary of {vd} ids "
                             f"(the target's has {v}): the target rows the LM head takes")
        return lm_head.detach().clone()
    if hot_token_ids.shape != (vd,) or hot_token_ids.dtype.is_floating_point:
        raise ValueError(f"hot_token_ids: expected an integer tensor of shape ({vd},), got "
                         f"{hot_token_ids.dtype} {tuple(hot_token_ids.shape)}")
    ids = hot_token_ids.to(lm_head.device, torch.int64)
    if vd and (int(ids.min()) < 0 or int(ids.max()) >= v):
        raise ValueError(f"hot_token_ids: target ids must lie in [0, {v}) (the target's "
                         f"vocabulary), got [{int(ids.min())}, {int(ids.max())}]")
    return lm_head.detach().index_select(0, ids)


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, 2 * h, dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(h, cfg.intermediate_size, dtype)


@dataclass
class DraftStepOutput:
    """ids int64 `[B]` (target vocab), hidden `[B, H]` (pre-norm), logits `[B, Vd]`."""

    ids: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor


class Eagle3DraftHead(KernelsMixin, nn.Module):
    """The head. `kernels`: the kernel settings its layers and LM head run under (None: the
    default config, the torch path); `set_kernels(cfg.kernels)` sets them once after
    construction. `lm_head_source` (`LM_HEAD_SOURCES`): "target" marks an LM head taken
    from the target (`tie_lm_head_` fills it; trainers freeze it, the saver omits it)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                 embed_tokens: torch.Tensor | None = None,
                 hot_token_ids: torch.Tensor | None = None, *,
                 kernels: KernelConfig | None = None, lm_head_source: str = "own") -> None:
        super().__init__()
        if lm_head_source not in LM_HEAD_SOURCES:
            raise ValueError(f"lm_head_source: expected one of {LM_HEAD_SOURCES}, got "
                             f"{lm_head_source!r}")
        self.lm_head_source = lm_head_source
        self.config, self.dtype = cfg, dtype
        self.global_config = cfg
        self.tp: TensorParallel | None = None
        self.dp = None  # a data_parallel.DataParallel after data_parallel.shard_dense_
        h, k = cfg.hidden_size, cfg.num_aux_hidden_states
        if embed_tokens is not None and tuple(embed_tokens.shape) != (cfg.vocab_size, h):
            raise ValueError(f"embed_tokens: expected shape ({cfg.vocab_size}, {h}) (a full "
                             f"table: share the target's before sharding it), got "
                             f"{tuple(embed_tokens.shape)}")
        self.embed_tokens = (nn.Parameter(embed_tokens, requires_grad=False)
                             if embed_tokens is not None else _param(cfg.vocab_size, h, dtype=dtype))
        self.fc = _param(h, k * h, dtype=dtype)
        self.midlayer = Eagle3MidLayer(cfg, dtype)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.lm_head = _param(cfg.output_vocab_size, h, dtype=dtype)
        if hot_token_ids is not None:
            if hot_token_ids.shape != (cfg.output_vocab_size,):
                raise ValueError(f"hot_token_ids: expected shape ({cfg.output_vocab_size},), "
                                 f"got {tuple(hot_token_ids.shape)}")
            self.register_buffer("hot_token_ids", hot_token_ids.to(torch.int64))
        else:
            self.hot_token_ids = None
        self.register_buffer("cos_sin", rope_cos_sin_cache(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling),
            persistent=False)
        self.kernels: KernelConfig = kernels if kernels is not None else default_kernels()
        self._kv_rows_cache: dict = {}  # (T, kernel settings, qkv shape) -> (row start, settings)
        self.logits_processor = LogitsProcessor(self.hot_token_ids, kernels=self.kernels)
        self.set_kernels(self.kernels)

    def set_kernels(self, kernels: KernelConfig) -> None:
        """Run every layer and the LM head under `kernels` (once, at construction)."""
        set_kernels(self, kernels)
        self.logits_processor.kernels = kernels

    def _apply(self, fn, recurse=True):  # keep the logits processor's map on the module's device
        out = super()._apply(fn, recurse)
        self.logits_processor.hot_token_ids = self.hot_token_ids
        return out

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def target_hidden_width(self) -> int:
        return self.config.num_aux_hidden_states * self.config.hidden_size

    @torch.no_grad()
    def shard_(self, tp: TensorParallel, memo: dict) -> None:
        """Keep this rank's slices (use `parallel.shard_`, which also handles tp None / 1)."""
        from graphdraft import parallel

        local = parallel.local_config(self.config, tp)  # raises before anything changes
        parallel.shard_attention_(self.midlayer.self_attn, tp)
        parallel.shard_mlp_(self.midlayer.mlp, tp)
        shard = lambda w: parallel.vocab_rows(w, tp)
        self.embed_tokens = parallel.shared_shard(memo, self.embed_tokens, shard)
        self.lm_head = parallel.shared_shard(memo, self.lm_head, shard)
        self.config, self.tp = local, tp

    @torch.no_grad()
    def tie_lm_head_(self, target_lm_head: torch.Tensor) -> None:
        """Take the LM head from the target: `lm_head` <- `target_lm_head_rows(target_lm_head,
        hot_token_ids)` (`target_lm_head` `[V, H]`, the target's full, unsharded weight), cast
        to the head's dtype, copied in place (the same Parameter: modules and engines built on
        the head stay valid), frozen (requires_grad False); `lm_head_source` becomes "target".
        Before any sharding: ValueError on a sharded head."""
        if self.tp is not None or self.dp is not None:
            raise ValueError("head: already sharded; take the target's LM head before sharding "
                             "(graphdraft.parallel.shard_)")
        rows = target_lm_head_rows(target_lm_head, self.hot_token_ids, self.config)
        self.lm_head.data.copy_(rows)
        self.lm_head.requires_grad_(False)
        self.lm_head_source = "target"

    def map_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids."""
        return self.hot_token_ids[draft_ids] if self.hot_token_ids is not None else draft_ids

    def _qkv(self, input_ids: torch.Tensor, hidden: torch.Tensor, *, kv_only: bool = False):
        """The step's prefix shared by `forward` and `store_kv`: embedding, fc (when hidden is
        k*H wide), the two input norms and the qkv projection over all T tokens.
        -> (qkv `[T, (Hq + 2 Hkv) * D]` or its `ops.SplitK`, hidden `[T, H]` (fc's output)).
        `kv_only`: the projection over `_kv_rows` only (`[T, (1 + 2 Hkv) * D]`)."""
        layer = self.midlayer
        if self.tp is None:  # the embedding lookup happens inside the norm kernel
            embeds, embed_index = self.embed_tokens, input_ids
        else:
            embeds, embed_index = self.tp.embed(input_ids, self.embed_tokens), None
        kc = self.kernels
        b = hidden
        if hidden.shape[-1] != self.config.hidden_size:
            # fc; on the GEMV path a SplitK, which the norm kernel sums (hidden: that sum)
            b = ops.linear_partials(hidden, self.fc, kernels=kc)
        norm_e, norm_h = layer.input_layernorm, layer.hidden_norm
        x, hidden = ops.rms_norm_cat(embeds, norm_e.weight, norm_e.eps, b, norm_h.weight,
                                     norm_h.eps, a_index=embed_index, kernels=kc)
        if kv_only:
            w, akc = self._kv_rows(x.shape[0])
            return ops.linear_partials(x, w, kernels=akc), hidden
        return layer.self_attn.qkv(x), hidden

    def _kv_rows(self, t: int) -> tuple[torch.Tensor, KernelConfig]:
        """The KV-only step's projection for T = t tokens: the rows of qkv_proj that the KV
        write reads, the last q head then the k and v heads (`[(1 + 2 Hkv) * D, 2H]`, a
        contiguous row slice: `rope_and_store_qkv` needs one q head, which it rotates and the
        step drops), about a third of the weight for the 8B head; and the kernel settings
        under which their product has the bits of the same columns of the full qkv product:
        where the Triton GEMV runs (t <= small_m_max) its K split depends on N, so the split
        and BLOCK_K of the full product are forced (when that gives the full product's tiles;
        else the full rows, still exact). cuBLAS (larger t) may pick another kernel for the
        narrower product: the same values up to its rounding (tests/test_eagle3_store_kv.py)."""
        attn = self.midlayer.self_attn
        kc, w = attn.kernels, attn.qkv_proj
        key = (t, kc, w.shape)
        hit = self._kv_rows_cache.get(key)
        if hit is not None:
            return w[hit[0]:], hit[1]
        hkv, d = self.config.num_key_value_heads, self.config.head_dim
        start = w.shape[0] - (2 * hkv + 1) * d
        akc = kc
        if kc.use_triton and 1 <= t <= kc.small_m_max:
            full = gemv.gemv_config(t, w.shape[0], w.shape[1], kernels=kc)
            forced = kc.replace(gemv_split=full.split, gemv_block_k=full.block_k)
            if gemv.gemv_config(t, w.shape[0] - start, w.shape[1], kernels=forced) == full:
                akc = forced
            else:
                start = 0
        self._kv_rows_cache[key] = (start, akc)
        return w[start:], akc

    def store_kv(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                 out_cache_loc: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The KV-only step: writes the draft KV of the T tokens as `forward` does (the same
        `_qkv` prefix, projected over the k / v rows of qkv_proj only (`_kv_rows`), the same
        RoPE + KV-store op: bit-identical cache entries on the torch path and the Triton GEMV
        path) and stops there: no q, attention, o_proj, MLP, final norm or LM head, no draft
        token.
        input_ids `[T]` (target vocab), positions `[T]`, hidden `[T, k*H]` or `[T, H]`,
        out_cache_loc `[T]`. The drafter's k = 0 cycle (nothing drafted, the KV kept whole)."""
        t = input_ids.shape[0]
        for name, x in (("positions", positions), ("out_cache_loc", out_cache_loc)):
            if x.shape != (t,):
                raise ValueError(f"{name}: expected shape ({t},) (one per input id), got "
                                 f"{tuple(x.shape)}")
        if hidden.shape[0] != t or hidden.shape[-1] not in (self.config.hidden_size,
                                                            self.target_hidden_width):
            raise ValueError(f"hidden: expected shape ({t}, {self.target_hidden_width}) or "
                             f"({t}, {self.config.hidden_size}), got {tuple(hidden.shape)}")
        qkv, _ = self._qkv(input_ids, hidden, kv_only=True)
        k_cache, v_cache = kv
        attn = self.midlayer.self_attn  # q lanes of forward's RoPE launch: one compiled kernel
        ops.rope_and_store_qkv(qkv, positions, self.cos_sin, k_cache, v_cache, out_cache_loc,
                               kernels=attn.kernels, max_q_heads=attn.num_heads)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                out_cache_loc: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                backend: PagedAttentionBackend, metadata: AttentionMetadata,
                gather_ids: torch.Tensor | None = None, *, ids_out: torch.Tensor | None = None,
                tokens_out: torch.Tensor | None = None,
                hidden_out: torch.Tensor | None = None) -> DraftStepOutput:
        """input_ids `[T]` (target vocab), positions `[T]`, hidden `[T, k*H]` or `[T, H]`,
        out_cache_loc `[T]`; metadata has one row per gathered token (B = len(gather_ids) or T).

        Optional destinations (written by the kernels that compute them, no extra copy on the
        fused path): `ids_out` int64 `[B]`, `tokens_out` int32/int64 `[B]` (any stride: a
        column of the drafter's `next_tokens`), `hidden_out` `[B, H]` (the pre-norm hidden)."""
        rows = input_ids.shape[0] if gather_ids is None else gather_ids.shape[0]
        check_ids_out(ids_out, tokens_out, rows, input_ids.device)  # before anything is written
        if hidden_out is not None:
            expect_tensor("hidden_out", hidden_out, shape=(rows, self.config.hidden_size),
                          dtypes=self.dtype, device=input_ids.device, layout="rows")
        layer = self.midlayer
        tp = self.tp
        attn_layer, mlp = layer.self_attn, layer.mlp
        kc = self.kernels
        qkv, hidden = self._qkv(input_ids, hidden)
        attn = attn_layer.attend(qkv, positions, out_cache_loc, kv, self.cos_sin, backend,
                                 metadata, gather_ids)
        if tp is None and mlp.dp is None:  # o_proj and down_proj fused with residual + RMSNorm
            post, final = layer.post_attention_layernorm, self.norm
            normed, residual = ops.linear_residual_rms_norm(  # residual: hidden's gathered rows
                attn, attn_layer.o_proj, hidden, post.weight, post.eps, residual_index=gather_ids,
                kernels=kc)
            normed, prenorm = ops.linear_residual_rms_norm(
                mlp.gate_up(normed), mlp.down_proj, residual, final.weight, final.eps,
                act="silu_mul", h_out=hidden_out, kernels=kc)
        else:  # row-parallel outputs all-reduced before the residual add; vocab-parallel LM head
            residual = hidden if gather_ids is None else hidden.index_select(0, gather_ids)
            normed, residual = layer.post_attention_layernorm(layer.self_attn.project(attn), residual)
            normed, prenorm = self.norm(layer.mlp(normed), residual)
            if tp is None:  # data-parallel dense layers (MLP over every rank's rows); LM head whole
                if hidden_out is not None:
                    prenorm = hidden_out.copy_(prenorm)
                out = self.logits_processor(normed, self.lm_head, ids_out=ids_out,
                                            tokens_out=tokens_out)
                return DraftStepOutput(out.next_token_ids, prenorm, out.next_token_logits)
            logits = tp.gather_vocab(ops.linear(normed, self.lm_head, kernels=kc),
                                     self.config.output_vocab_size)
            ids = ops.argmax_with_map(logits, self.hot_token_ids, out=ids_out,
                                      tokens_out=tokens_out, kernels=kc)
            if hidden_out is not None:
                prenorm = hidden_out.copy_(prenorm)
            return DraftStepOutput(ids, prenorm, logits)
        out: LogitsOutput = self.logits_processor(normed, self.lm_head, ids_out=ids_out,
                                                  tokens_out=tokens_out)
        return DraftStepOutput(out.next_token_ids, prenorm, out.next_token_logits)
