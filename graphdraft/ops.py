"""The hot-path operations, each with a plain-torch path and a Triton path.

A model picks one path at construction (`use_triton`): Triton kernels on CUDA,
torch on CPU (and as the reference the kernel tests compare against). Both
paths are CUDA-graph capturable: no host sync, no data-dependent shapes.
The torch paths are vectorised and run on any device; `graphdraft.kernels`
holds the Triton kernels.

Shapes: T query/token rows, B gathered rows, Hq/Hkv heads, D head_dim.

Launches saved by handing a producer's last step to its consumer: `linear_partials` leaves the
Triton GEMV's split-K sum to an op that accepts the fp32 partials `[split, M, N]` (summed as
`sum_partials` does, so the same bits as `linear`); row-index arguments (`a_index`, ...) gather
rows inside the consuming kernel instead of an `index_select` before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------
# RMSNorm (HF Llama semantics: fp32 statistics, cast before the weight multiply)
# ---------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             *, residual_out: torch.Tensor | None = None, use_triton: bool = False):
    """`[M, N] -> [M, N]`; with `residual`: `h = x + residual`, returns `(norm(h), h)`, h written
    into `residual_out` `[M, N]` when given (on the Triton path by the norm kernel itself)."""
    if use_triton:
        from graphdraft.kernels.norm import rms_norm as rms_norm_triton
        return rms_norm_triton(x, weight, eps, residual=residual, residual_out=residual_out)
    from graphdraft.kernels.norm import rms_norm_torch

    if residual is not None:
        x = x + residual
        if residual_out is not None:
            x = residual_out.copy_(x)
    normed = rms_norm_torch(x, weight, eps)
    return (normed, x) if residual is not None else normed


def rms_norm_cat(a: torch.Tensor, weight_a: torch.Tensor, eps_a: float, b: torch.Tensor,
                 weight_b: torch.Tensor, eps_b: float, *, a_index: torch.Tensor | None = None,
                 b_out: torch.Tensor | None = None, use_triton: bool = False) -> torch.Tensor:
    """`cat([rms_norm(a), rms_norm(b)], -1)`: `[M, N]` twice -> `[M, 2N]`. With `a_index` `[M]`
    (int32/int64) the first input is `a.index_select(0, a_index)` (a any `[R, N]` table, such as
    an embedding; the Triton path gathers inside the norm kernel). b may be split partials
    `[split, M, N]` (`linear_partials`): b is then `sum_partials(b, a.dtype)`, also written to
    `b_out` `[M, N]` (required then)."""
    if use_triton:
        from graphdraft.kernels.norm import rms_norm_cat as rms_norm_cat_triton
        return rms_norm_cat_triton(a, weight_a, eps_a, b, weight_b, eps_b, a_index=a_index,
                                   b_out=b_out)
    if a_index is not None:
        a = a.index_select(0, a_index)
    if b.dim() == 3:
        if b_out is None:
            raise ValueError("b_out: expected an [M, N] tensor for the sum of b's split partials")
        b = b_out.copy_(sum_partials(b, a.dtype))
    return torch.cat([rms_norm(a, weight_a, eps_a), rms_norm(b, weight_b, eps_b)], dim=-1)


# ---------------------------------------------------------------------------
# RoPE (NeoX / HF rotate_half) fused with the KV write
# ---------------------------------------------------------------------------
def rope_cos_sin_cache(head_dim: int, max_positions: int, theta: float,
                       scaling: dict | None = None, device: str | torch.device | None = None
                       ) -> torch.Tensor:
    """`[max_positions, head_dim]` fp32: cos in the first half of the columns, sin in the second.

    `scaling` supports HF's Llama-3 rope scaling (`rope_type: "llama3"`). `device` None: the
    current default device (`torch.get_default_device()`), so a model built under
    `with torch.device("cuda"):` gets its table there. Computed in float64 on the host either
    way (the same values on every device).
    """
    if device is None:
        device = torch.get_default_device()
    cpu = torch.device("cpu")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu)
                                / head_dim))
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            factor = scaling["factor"]
            low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
            old_ctx = scaling.get("original_max_position_embeddings", 8192)
            low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
            wavelen = 2 * torch.pi / inv_freq
            smooth = (old_ctx / wavelen - low) / (high - low)
            scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
            mid = (1 - smooth) * scaled / factor + smooth * scaled
            is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
            inv_freq = torch.where(is_mid, mid, scaled)
        elif kind not in (None, "default"):
            raise ValueError(f"rope_scaling: unsupported rope_type {kind!r} (expected 'llama3')")
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64, device=cpu), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.float32).to(device)


def rope_and_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out_cache_loc: torch.Tensor, *, use_triton: bool = False) -> None:
    """Rotate q `[T, Hq, D]` in place; write rotated k and v (`[T, Hkv, D]`) to the cache slots."""
    if use_triton:
        from graphdraft.kernels.rope import rope_and_store_kv as rope_triton
        rope_triton(q, k, v, positions, cos_sin, k_cache, v_cache, out_cache_loc)
        return
    from graphdraft.kernels.rope import rope_rotate_torch

    half = q.shape[-1] // 2
    cs = cos_sin[positions].unsqueeze(1)
    cos, sin = cs[..., :half], cs[..., half:]
    q.copy_(rope_rotate_torch(q, cos, sin))
    k_cache[out_cache_loc] = rope_rotate_torch(k, cos, sin)
    v_cache[out_cache_loc] = v


def rope_and_store_kv_partials(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor,
                               out_cache_loc: torch.Tensor, *, use_triton: bool = False
                               ) -> torch.Tensor:
    """`rope_and_store_kv` of a fused qkv given as split partials `[split, T, (Hq + 2 Hkv) * D]`
    (`linear_partials`; Hkv and D are the cache's), summed like `sum_partials` into the cache
    dtype (the Triton path while loading); returns the rotated q `[T, Hq, D]`, a new tensor."""
    if use_triton:
        from graphdraft.kernels.rope import rope_and_store_kv_partials as rope_partials_triton
        return rope_partials_triton(qkv, positions, cos_sin, k_cache, v_cache, out_cache_loc)
    t, hkv, d = qkv.shape[1], k_cache.shape[1], k_cache.shape[2]
    q, k, v = sum_partials(qkv, k_cache.dtype).view(t, -1, d).split(
        [qkv.shape[2] // d - 2 * hkv, hkv, hkv], dim=1)
    rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, out_cache_loc)
    return q


# ---------------------------------------------------------------------------
# Paged attention: query row t attends to positions [0, kv_lens[t]) of its request
# ---------------------------------------------------------------------------
def kv_slots(req_to_page: torch.Tensor, req_pool_indices: torch.Tensor, positions: torch.Tensor,
             page_size: int) -> torch.Tensor:
    """Slots of `positions` (`kv_cache.kv_slot`); `req_pool_indices` broadcasts against it;
    the dummy slot 0 where unmapped: a negative position, one past the table, a page id <= 0."""
    from graphdraft.runtime.kv_cache import kv_slot

    inside = (positions >= 0) & (positions < req_to_page.shape[1] * page_size)
    slot = kv_slot(req_to_page, req_pool_indices, positions, page_size)
    return torch.where(inside & (slot >= page_size), slot, torch.zeros_like(slot))  # page > 0


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    req_pool_indices: torch.Tensor, kv_lens: torch.Tensor, req_to_page: torch.Tensor,
                    page_size: int, sm_scale: float, max_kv_len: int, *,
                    q_index: torch.Tensor | None = None, use_triton: bool = False) -> torch.Tensor:
    """q `[T, Hq, D]` -> `[T, Hq, D]`; row t reads exactly positions `[0, kv_lens[t])`.

    `max_kv_len` is a host upper bound of `kv_lens` (static: the context limit). With `q_index`
    `[T]` (int32/int64) the queries are `q.index_select(0, q_index)` (the Triton path gathers
    inside the attention kernel).
    """
    if use_triton:
        from graphdraft.kernels.decode_attention import paged_decode_attention
        return paged_decode_attention(q, k_cache, v_cache, req_pool_indices, kv_lens, req_to_page,
                                      page_size, sm_scale, max_kv_len=max_kv_len, q_index=q_index)
    if q_index is not None:
        q = q.index_select(0, q_index)
    return _paged_attention_torch(q, k_cache, v_cache, req_pool_indices, kv_lens, req_to_page,
                                  page_size, sm_scale, max_kv_len)


def _paged_attention_torch(q, k_cache, v_cache, req_pool_indices, kv_lens, req_to_page, page_size,
                           sm_scale, max_kv_len, seen: torch.Tensor | None = None) -> torch.Tensor:
    """The plain torch attention: row t over positions `[0, kv_lens[t])` (and, with `seen`
    `[T, max_kv_len]` bool, only where it is True)."""
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    if t == 0:
        return torch.empty_like(q)
    pos = torch.arange(max_kv_len, device=q.device)
    slots = kv_slots(req_to_page, req_pool_indices.long().unsqueeze(1), pos.unsqueeze(0), page_size)
    valid = pos.unsqueeze(0) < kv_lens.unsqueeze(1)                  # [T, L]
    if seen is not None:
        valid = valid & seen
    k = k_cache[slots].float()                                        # [T, L, Hkv, D]
    v = v_cache[slots].float()
    qg = q.float().view(t, hkv, hq // hkv, d)                         # [T, Hkv, G, D]
    scores = torch.einsum("thgd,tlhd->thgl", qg, k) * sm_scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(valid[:, None, None, :], probs, torch.zeros_like(probs))  # NaN-safe
    v = torch.where(valid[:, :, None, None], v, torch.zeros_like(v))  # garbage past kv_lens stays out
    out = torch.einsum("thgl,tlhd->thgd", probs, v)
    return out.reshape(t, hq, d).to(q.dtype)


def paged_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                           extend_lens: torch.Tensor | None, q_starts: torch.Tensor | None,
                           req_to_page: torch.Tensor, page_size: int, sm_scale: float,
                           max_kv_len: int, *, max_extend: int = 0, uniform_n: int = 0,
                           mask_bits: torch.Tensor | None = None,
                           use_triton: bool = False) -> torch.Tensor:
    """Rows of several query tokens: q `[T, Hq, D]` -> `[T, Hq, D]`
    (`graphdraft.kernels.extend_attention` has the semantics). Row r (`[R]` metadata) holds
    `extend_lens[r]` tokens (or `uniform_n` each) at q rows from `q_starts[r]`; token j sees
    `max(seq_lens[r] - extend_lens[r] + j + 1, 1)` positions, and with `mask_bits` `[T]` int64
    only the row's new tokens whose bit is set. The torch path expands the rows to per-token
    metadata (rows laid out in order: `q_starts` the exclusive cumsum of `extend_lens`) and runs
    the same plain attention as `paged_attention`; the Triton path reads each KV block once per
    (row, query block, kv head)."""
    if use_triton:
        from graphdraft.kernels.extend_attention import paged_extend_attention as kernel
        return kernel(q, k_cache, v_cache, req_pool_indices, seq_lens, extend_lens, q_starts,
                      req_to_page, page_size, sm_scale, max_kv_len=max_kv_len,
                      max_extend=max_extend, uniform_n=uniform_n, mask_bits=mask_bits)
    t = q.shape[0]
    tok = torch.arange(t, device=q.device)
    if uniform_n:
        row = tok // uniform_n
        j = tok % uniform_n
        prefix = seq_lens.long()[row] - uniform_n
    else:
        row = torch.repeat_interleave(torch.arange(extend_lens.shape[0], device=q.device),
                                      extend_lens.long(), output_size=t)
        j = tok - q_starts.long()[row]
        prefix = seq_lens.long()[row] - extend_lens.long()[row]
    kv_lens = torch.clamp(prefix + j + 1, min=1)
    seen = None
    if mask_bits is not None:
        i = torch.arange(max_kv_len, device=q.device)[None, :] - prefix[:, None]  # [T, L]
        seen = (i < 0) | (((mask_bits[:, None] >> i.clamp(0, 63)) & 1) != 0)
    return _paged_attention_torch(q, k_cache, v_cache, req_pool_indices[row], kv_lens,
                                  req_to_page, page_size, sm_scale, max_kv_len, seen)


# ---------------------------------------------------------------------------
# Greedy sampling fused with the draft->target vocab map
# ---------------------------------------------------------------------------
def argmax_with_map(logits: torch.Tensor, hot_token_ids: torch.Tensor | None = None, *,
                    out: torch.Tensor | None = None, tokens_out: torch.Tensor | None = None,
                    use_triton: bool = False) -> torch.Tensor:
    """`[B, V]` -> int64 `[B]`: index of the row max (ties: lowest index), mapped by `hot_token_ids`;
    written into `out` (int64 `[B]`) and copied into `tokens_out` (int32/int64 `[B]`, any stride)
    when given (on the Triton path by the argmax kernels themselves)."""
    if use_triton:
        from graphdraft.kernels.argmax import argmax_with_map as argmax_triton
        return argmax_triton(logits, hot_token_ids, out=out, tokens_out=tokens_out)
    ids = torch.argmax(logits, dim=-1)
    if hot_token_ids is not None:
        ids = hot_token_ids[ids]
    if out is not None:
        ids = out.copy_(ids)
    if tokens_out is not None:
        tokens_out.copy_(ids)
    return ids


# ---------------------------------------------------------------------------
# KV write locations
# ---------------------------------------------------------------------------
def out_cache_loc_uniform(out: torch.Tensor, req_pool_indices: torch.Tensor,
                          cache_start: torch.Tensor, req_to_page: torch.Tensor, page_size: int,
                          length: int, *, positions_out: torch.Tensor | None = None,
                          seq_lens_out: torch.Tensor | None = None,
                          use_triton: bool = False) -> None:
    """Write slots of positions `cache_start[r] + j` into `out` laid out `[length, bs]`; given
    `positions_out` int64 / `seq_lens_out` int32 `[bs]`, also `cache_start` and `cache_start + 1`
    there (the first decode step's position and KV length)."""
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    if use_triton:
        from graphdraft.kernels.cache_loc import compute_out_cache_loc_uniform
        compute_out_cache_loc_uniform(out, req_pool_indices, cache_start, req_to_page, page_size,
                                      length, out_stride_req=1, out_stride_tok=bs,
                                      positions_out=positions_out, seq_lens_out=seq_lens_out)
        return
    from graphdraft.kernels.cache_loc import check_first_step_outputs

    first = check_first_step_outputs(positions_out, seq_lens_out, out.device, bs)
    if length:
        pos = cache_start.long().unsqueeze(0) + torch.arange(length, device=out.device).unsqueeze(1)
        out[: length * bs].view(length, bs).copy_(
            kv_slots(req_to_page, req_pool_indices.long().unsqueeze(0), pos, page_size))
    if first:
        positions_out.copy_(cache_start)
        seq_lens_out.copy_(cache_start + 1)


# ---------------------------------------------------------------------------
# Matmuls: cuBLAS, or for small M on the Triton path the GEMV kernels with fused epilogues
# ---------------------------------------------------------------------------
SMALL_M_MAX = 32
"""Rows at or below which the Triton path runs `kernels.gemv` instead of cuBLAS (0: never).
Measured on an H200 (perf/RESULTS.md, fourth session): 32 drafts bs 32 in 773 us instead of
819 (16); 64 was slower from bs 8 up (qkv at 64 rows: 40 us on the GEMV, 31 on cuBLAS)."""


def _small_m(x: torch.Tensor, weight: torch.Tensor, use_triton: bool) -> bool:
    return (use_triton and 1 <= x.shape[0] <= SMALL_M_MAX and x.dim() == 2 and x.stride(-1) == 1
            and weight.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def apply_act(x: torch.Tensor, act: str | None, *, use_triton: bool = False) -> torch.Tensor:
    """A matmul input's activation: None -> x; "silu_mul" -> `silu(gate) * up` of `[gate ; up]`
    (on the Triton path, for a 2-D x with unit column stride, one launch: `gemv.silu_mul`)."""
    if act is None:
        return x
    if act != "silu_mul":
        raise ValueError(f"act: expected None or 'silu_mul', got {act!r}")
    if use_triton and x.dim() == 2 and x.stride(-1) == 1:
        from graphdraft.kernels.gemv import silu_mul
        return silu_mul(x)
    k = x.shape[-1] // 2
    return F.silu(x[..., :k]) * x[..., k:]


def linear(x: torch.Tensor, weight: torch.Tensor, *, act: str | None = None,
           use_triton: bool = False) -> torch.Tensor:
    """`act(x) [M, K] @ weight [N, K]^T -> [M, N]` (no bias). act "silu_mul": x is
    `[gate ; up]` `[M, 2K]` and the product reads `silu(gate) * up`."""
    if _small_m(x, weight, use_triton):
        from graphdraft.kernels.gemv import linear_small_m
        return linear_small_m(x, weight, act=act)
    return F.linear(apply_act(x, act, use_triton=use_triton), weight)


def linear_partials(x: torch.Tensor, weight: torch.Tensor, *, use_triton: bool = False) -> torch.Tensor:
    """`linear(x, weight)` `[M, N]`, except where the Triton path runs the GEMV: there its unsummed
    fp32 split-K partials `[split, M, N]` (split >= 1; one launch fewer), for an op that accepts
    them (`rms_norm_cat`'s b, `rope_and_store_kv_partials`) and sums them as the GEMV would
    (`sum_partials` in torch): the same bits as `linear`'s output."""
    if _small_m(x, weight, use_triton):
        from graphdraft.kernels.gemv import linear_small_m_partials
        return linear_small_m_partials(x, weight)
    return linear(x, weight, use_triton=use_triton)


def sum_partials(ws: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 split-K partials `[split, M, N]` -> `[M, N]` in `dtype`, summed in the kernels' order
    (`kernels.fused_inputs`: split 1 as is, else s = 0, 1, ... onto 0.0) and rounded once; a new
    tensor (never a view of ws)."""
    if ws.shape[0] == 1:
        return ws[0].to(dtype, copy=True)
    acc = torch.zeros_like(ws[0])
    for part in ws:
        acc = acc + part
    return acc.to(dtype)


def linear_residual_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                             norm_weight: torch.Tensor, eps: float, *, act: str | None = None,
                             h_out: torch.Tensor | None = None,
                             residual_index: torch.Tensor | None = None,
                             use_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = linear(x, weight, act) + residual` `[M, N]`; returns `(rms_norm(h), h)`, `h` written
    into `h_out` when given. With `residual_index` `[M]` (int32/int64) the residual is
    `residual.index_select(0, residual_index)` (gathered inside the norm on the Triton GEMV path)."""
    if _small_m(x, weight, use_triton):
        from graphdraft.kernels.gemv import linear_small_m_residual_norm
        return linear_small_m_residual_norm(x, weight, residual, norm_weight, eps, act=act,
                                            h_out=h_out, residual_index=residual_index)
    if residual_index is not None:
        residual = residual.index_select(0, residual_index)
    return rms_norm(linear(x, weight, act=act, use_triton=use_triton), norm_weight, eps, residual,
                    residual_out=h_out, use_triton=use_triton)


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, hot_token_ids: torch.Tensor | None = None,
                  *, ids_out: torch.Tensor | None = None, tokens_out: torch.Tensor | None = None,
                  use_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """LM head and greedy pick: `(logits [M, N], ids int64 [M])`, ids mapped by `hot_token_ids`;
    ids written into `ids_out` (int64 `[M]`) and copied into `tokens_out` (int32/int64 `[M]`,
    any stride) when given."""
    if _small_m(x, weight, use_triton):
        from graphdraft.kernels.gemv import linear_small_m_argmax
        return linear_small_m_argmax(x, weight, hot_token_ids, ids_out=ids_out,
                                     tokens_out=tokens_out)
    from graphdraft.kernels.argmax import check_ids_out

    check_ids_out(ids_out, tokens_out, x.shape[0], x.device)  # before the matmul runs
    logits = linear(x, weight, use_triton=use_triton)
    return logits, argmax_with_map(logits, hot_token_ids, out=ids_out, tokens_out=tokens_out,
                                   use_triton=use_triton)


def decode_draft_indices(accept: torch.Tensor, target_seq_lens: torch.Tensor, req: torch.Tensor,
                         valid_cache_lengths: torch.Tensor, n: int, token_offset: int,
                         gather_ids: torch.Tensor, seq_lens: torch.Tensor, write_start: torch.Tensor,
                         tokens: torch.Tensor | None = None, last_token: torch.Tensor | None = None,
                         *, use_triton: bool = False) -> None:
    """First draft step, decode rows: write `gather_ids`, `seq_lens`, `write_start` `[bs]` and,
    given the step's input ids `tokens`, `last_token = tokens[gather_ids]` (formulas in
    `graphdraft.kernels.draft_indices`)."""
    from graphdraft.kernels import draft_indices

    fn = draft_indices.decode_draft_indices if use_triton else draft_indices.decode_draft_indices_ref
    fn(accept, target_seq_lens, req, valid_cache_lengths, n, token_offset, gather_ids, seq_lens,
       write_start, tokens, last_token)


def stage_decode_inputs(bs: int, pbs: int, n: int, accept_src: torch.Tensor, tokens_src: torch.Tensor,
                        hidden_src: torch.Tensor, *, use_triton: bool = False, **buffers) -> None:
    """Copy a decode batch's draft inputs into the persistent buffers and pad rows/tokens up to
    `pbs` (writes and buffer names in `graphdraft.kernels.stage_inputs`)."""
    from graphdraft.kernels import stage_inputs

    fn = stage_inputs.stage_decode_inputs if use_triton else stage_inputs.stage_decode_inputs_ref
    fn(bs, pbs, n, accept_src, tokens_src, hidden_src, **buffers)


def advance_positions_and_seq_lens(seq_lens: torch.Tensor, positions: torch.Tensor, delta: int = 1,
                                   *, use_triton: bool = False) -> None:
    """In place: `seq_lens += delta`, `positions += delta` (the seq-len alias refresh between steps)."""
    if use_triton:
        from graphdraft.kernels.cache_loc import advance_positions_and_seq_lens as advance_triton
        advance_triton(seq_lens, positions, delta)
        return
    seq_lens.add_(delta)
    positions.add_(delta)
