"""Dense training-mode forwards over the runtime modules' own parameters.

`target_forward` runs a `graphdraft.models.llama.LlamaForCausalLM` and `head_ttt_forward` an
`graphdraft.models.eagle3.Eagle3DraftHead` over dense `[B, L]` batches with
`F.scaled_dot_product_attention`, reading exactly the parameters the paged runtime reads
(fused `qkv_proj` rows [q; k; v], fused `gate_up_proj` rows [gate; up], HF RMSNorm, NeoX
RoPE from `graphdraft.ops.rope_cos_sin_cache`). Trained weights therefore load into the
runtime unchanged; `tests/test_trained_pair.py` checks that both paths give the same logits.

EAGLE-3 training-time test (TTT), for every start position t of a sequence at once:
  step 1   input (token t+1, target aux hidden at t) at position t; it attends to the
           step-1 keys of positions <= t (plain causal attention).
  step k   input (the head's own step k-1 argmax token, its own step k-1 pre-norm hidden)
           at position t+k-1; it attends to the step-1 keys of positions <= t plus the keys
           its own chain wrote at positions t+1 .. t+k-1 (steps 2..k).
This is what `graphdraft.runtime.drafter.EagleDrafter` computes at inference: the first step over
the accepted prefix, then chain steps writing their own KV.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphdraft.kernels.norm import rms_norm_torch
from graphdraft.kernels.rope import rope_rotate_torch
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.layers import MLP, Attention
from graphdraft.models.llama import LlamaForCausalLM
from graphdraft.ops import rope_cos_sin_cache

rms_norm = rms_norm_torch
"""HF Llama RMSNorm (`kernels.norm.rms_norm_torch`, the runtime's torch path)."""


def rope(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE: x `[B, heads, L, D]`, positions `[L]` -> rotated x."""
    half = x.shape[-1] // 2
    cs = cos_sin[positions]                            # [L, D] fp32: cos | sin
    return rope_rotate_torch(x, cs[:, :half], cs[:, half:])


def _qkv(attn: Attention, x: torch.Tensor):
    """x `[B, L, in]` -> q `[B, Hq, L, D]`, k, v `[B, Hkv, L, D]` (before RoPE)."""
    b, n, _ = x.shape
    qkv = F.linear(x, attn.qkv_proj)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    d = attn.head_dim
    return (q.view(b, n, attn.num_heads, d).transpose(1, 2),
            k.view(b, n, attn.num_kv_heads, d).transpose(1, 2),
            v.view(b, n, attn.num_kv_heads, d).transpose(1, 2))


def _attend(attn: Attention, q, k, v, *, causal: bool = False, mask=None) -> torch.Tensor:
    """-> o_proj(attention) `[B, L, H]`; GQA: query head h reads KV head h // (Hq / Hkv)."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                         scale=attn.sm_scale, enable_gqa=True)
    b, _, n, _ = out.shape
    return F.linear(out.transpose(1, 2).reshape(b, n, attn.q_size), attn.o_proj)


def _mlp(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, mlp.gate_up_proj).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, mlp.down_proj)


def target_forward(model: LlamaForCausalLM, ids: torch.Tensor, *, capture_aux: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids `[B, L]` (positions 0..L-1) -> (logits `[B, L, V]`, aux hidden `[B, L, k*H]` or None).

    aux hidden: the residual stream entering each of `model.aux_layer_ids`, concatenated
    (the same tensor the runtime's forward returns as `aux_hidden`).
    """
    cfg = model.config
    eps = cfg.rms_norm_eps
    pos = torch.arange(ids.shape[1], device=ids.device)
    x = F.embedding(ids, model.embed_tokens)
    aux = {}
    for i, layer in enumerate(model.layers):
        if capture_aux and i in model.aux_layer_ids:
            aux[i] = x
        q, k, v = _qkv(layer.self_attn, rms_norm(x, layer.input_layernorm.weight, eps))
        q, k = rope(q, model.cos_sin, pos), rope(k, model.cos_sin, pos)
        x = x + _attend(layer.self_attn, q, k, v, causal=True)
        x = x + _mlp(layer.mlp, rms_norm(x, layer.post_attention_layernorm.weight, eps))
    logits = F.linear(rms_norm(x, model.norm.weight, eps), model.lm_head)
    aux_hidden = torch.cat([aux[i] for i in model.aux_layer_ids], -1) if capture_aux else None
    return logits, aux_hidden


def ttt_mask(n: int, steps: int, device=None) -> torch.Tensor:
    """Boolean `[n, steps * n]` attention mask of chain step `steps` (True: may attend).

    Key block 0 holds the step-1 keys of positions 0..n-1 (causal: start t sees s <= t);
    block j >= 1 holds step j+1's keys, one per chain (start t sees only its own: s == t).
    """
    t = torch.arange(n, device=device)
    blocks = [t[None, :] <= t[:, None]] + [t[None, :] == t[:, None]] * (steps - 1)
    return torch.cat(blocks, dim=1)


def head_step(head: Eagle3DraftHead, ids: torch.Tensor, hidden: torch.Tensor,
              positions: torch.Tensor, keys: list, values: list, mask: torch.Tensor | None,
              causal: bool, cos_sin: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One head forward over `[B, n]` chains; appends this step's K/V to `keys`/`values`.

    hidden: `[B, n, k*H]` (target aux, through fc) or `[B, n, H]` (the head's own pre-norm).
    -> (logits `[B, n, Vd]`, pre-norm hidden `[B, n, H]`).
    """
    layer, eps = head.midlayer, head.config.rms_norm_eps
    emb = F.embedding(ids, head.embed_tokens)
    if hidden.shape[-1] != head.config.hidden_size:
        hidden = F.linear(hidden, head.fc)
    x = torch.cat([rms_norm(emb, layer.input_layernorm.weight, eps),
                   rms_norm(hidden, layer.hidden_norm.weight, eps)], dim=-1)
    q, k, v = _qkv(layer.self_attn, x)
    cos_sin = head.cos_sin if cos_sin is None else cos_sin
    q, k = rope(q, cos_sin, positions), rope(k, cos_sin, positions)
    keys.append(k)
    values.append(v)
    attn = _attend(layer.self_attn, q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                   causal=causal, mask=mask)
    residual = attn + hidden
    prenorm = _mlp(layer.mlp, rms_norm(residual, layer.post_attention_layernorm.weight, eps)) + residual
    logits = F.linear(rms_norm(prenorm, head.norm.weight, eps), head.lm_head)
    return logits, prenorm


def head_ttt_forward(head: Eagle3DraftHead, ids: torch.Tensor, aux_hidden: torch.Tensor,
                     steps: int) -> list[torch.Tensor]:
    """Unrolled TTT over every start position; ids `[B, L]`, aux_hidden `[B, L, k*H]`.

    Chain t (t = 0..L-2) starts with (ids[:, t+1], aux_hidden[:, t]) at position t; step k's
    logits `[B, L-1, Vd]` (list index k-1) predict the token at position t+k+1. Step k > 1
    feeds back the head's own argmax ids (mapped to the target vocab) and pre-norm hidden.
    """
    n = ids.shape[1] - 1
    base = torch.arange(n, device=ids.device)
    tok, hidden = ids[:, 1:], aux_hidden[:, :-1]
    cos_sin = head.cos_sin
    if cos_sin.shape[0] < n + steps:  # chain positions run past the trained context: their
        cfg = head.config             # losses are masked, but RoPE must still be defined there
        cos_sin = rope_cos_sin_cache(cfg.head_dim, n + steps, cfg.rope_theta, cfg.rope_scaling,
                                     device=ids.device)
    keys, values, out = [], [], []
    for k in range(1, steps + 1):
        mask = None if k == 1 else ttt_mask(n, k, ids.device)
        logits, hidden = head_step(head, tok, hidden, base + (k - 1), keys, values, mask,
                                   causal=k == 1, cos_sin=cos_sin)
        out.append(logits)
        tok = head.map_to_target(logits.detach().argmax(-1))
    return out
