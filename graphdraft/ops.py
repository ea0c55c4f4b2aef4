"""The hot-path operations: a small dispatch between each op's Triton kernel and its torch path.

Every op takes `kernels` (a `kernels.config.KernelConfig`; None: `kernel_config.default()`, the
torch path with the environment's settings): `kernels.backend == "triton"` runs the op's kernel
wrapper and hands it `kernels` (its tiles, PDL, thresholds), "torch" runs the op's torch
reference. Both live in the op's module under `graphdraft/kernels/` (kernel, wrapper and one
torch reference side by side); this module only chooses. The kernel modules never import this
one. Both paths are CUDA-graph capturable: no host sync, no data-dependent shapes.

| op | module (Triton wrapper / torch reference) |
|---|---|
| `rms_norm`, `rms_norm_cat` | `kernels/norm.py` (`rms_norm_residual_torch`, `rms_norm_cat_torch`) |
| `rope_and_store_kv`, `rope_and_store_qkv` | `kernels/rope.py` (`rope_and_store_kv_torch`) |
| `argmax_with_map` | `kernels/argmax.py` (`argmax_with_map_torch`) |
| `linear`, `apply_act`, `linear_partials`, `linear_residual_rms_norm`, `linear_argmax` | `kernels/gemv.py` for at most `kernels.small_m_max` rows (`linear_ref`, `silu_mul_ref`); above, the route `kernels.gemm_routes` lists per card, shape and row bucket (`buckets.gemm_config`, up to `kernels.gemm_max_m` rows: a `kernels/gemm.py` tile or cuBLASLt, `gemm.linear_lt`), plain cuBLAS for the rest |
| `out_cache_loc_uniform`, `advance_positions_and_seq_lens` | `kernels/cache_loc.py` (`*_ref`) |
| `decode_draft_indices` | `kernels/draft_indices.py` (`*_ref`) |
| `stage_decode_inputs` | `kernels/stage_inputs.py` (`*_ref`) |
| `paged_attention` | `kernels/decode_attention.py` (`paged_decode_attention_ref`) |
| `paged_extend_attention` | `kernels/extend_attention.py` (`paged_extend_attention_ref`) |
| `prepare_rows`, `commit_pack` | `kernels/cycle_kernels.py` (`*_ref`) |
| `accept_tokens` | `kernels/accept.py` (`accept_tokens_ref`) |
| `apply_logit_controls`, `apply_draft_logit_controls`, `count_tokens` | `kernels/logit_controls.py` (`*_ref`) |
| `token_logprobs` | `kernels/logprobs.py` (`token_logprobs_ref`) |
| `ngram_propose` | `kernels/ngram.py` (`ngram_propose_ref`) |
| `build_tree` | `kernels/tree_build.py` (`build_tree_ref`) |
| `tree_accept` | `kernels/tree_accept.py` (`tree_accept_ref`) |
| `tree_stop_cut` | `kernels/tree_stop_cut.py` (`stop_cut` / `stop_cut_ref`) |
| `tree_beam_level` | `kernels/tree_beams.py` (`beam_first` / `beam_decode`, `*_ref`) |
| `tree_first_inputs` | `kernels/tree_first_inputs.py` (`first_inputs_ref`) |
| `tree_load_rows`, `tree_store_rows` | `kernels/tree_slots.py` (`load_rows_ref`, `store_rows_ref`) |
| `tree_move_accepted_kv` | `kernels/tree_kv_move.py` (`move_accepted_kv_all`; torch: `kv_move`'s ref) |
| `move_accepted_kv`, `gather_accepted_hidden` | `kernels/kv_move.py` (`*_ref`) |
| `admit_slot_rows` | `kernels/slot_admit.py` (`admit_rows_ref`) |
| `copy_segments` | `kernels/segments.py` (`copy_segments_ref`) |
| `mixed_draft_inputs` | `kernels/mixed_draft_inputs.py` (`mixed_draft_inputs_ref`) |
| `accept_control` (benchmarks' accept-rate control) | `kernels/accept_control.py` (`accept_control_ref`) |

Shapes: T query/token rows, B gathered rows, Hq/Hkv heads, D head_dim.

Launches saved by handing a producer's last step to its consumer: `linear_partials` leaves the
Triton GEMV's split-K sum to the next op as a `SplitK` value (its fp32 partials `[split, M, N]`
and the product's dtype), which `rms_norm_cat` (as b) and `rope_and_store_qkv` (as qkv) accept
beside a plain tensor and sum as the GEMV would (`SplitK.sum` in torch): the same bits as
`linear`; callers pass it on and never look inside. Row-index arguments (`a_index`, ...) gather
rows inside the consuming kernel instead of an `index_select` before it.
"""

from __future__ import annotations

import torch

from graphdraft.kernels import (
    accept,
    argmax,
    buckets,
    cache_loc,
    cycle_kernels,
    decode_attention,
    draft_indices,
    extend_attention,
    gemm,
    gemv,
    kv_move,
    logit_controls,
    logprobs,
    ngram,
    norm,
    rope,
    stage_inputs,
    tree_build,
)
from graphdraft.kernels import accept_control as accept_control_kernel
from graphdraft.kernels import mixed_draft_inputs as mixed_draft_inputs_kernel
from graphdraft.kernels import segments as segments_kernel
from graphdraft.kernels import slot_admit as slot_admit_kernel
from graphdraft.kernels import tree_accept as tree_accept_kernel
from graphdraft.kernels import tree_beams as tree_beams_kernel
from graphdraft.kernels import tree_first_inputs as tree_first_inputs_kernel
from graphdraft.kernels import tree_kv_move as tree_kv_move_kernel
from graphdraft.kernels import tree_slots as tree_slots_kernel
from graphdraft.kernels import tree_stop_cut as tree_stop_cut_kernel
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.config import resolve as _kc  # kernels, or the default config
from graphdraft.kernels.fused_inputs import SplitK
from graphdraft.kernels.rope import rope_cos_sin_cache

__all__ = ["KernelConfig", "SplitK", "accept_control", "accept_tokens",
           "admit_slot_rows", "advance_positions_and_seq_lens", "apply_act",
           "apply_draft_logit_controls",
           "apply_logit_controls",
           "argmax_with_map", "build_tree", "commit_pack", "copy_segments", "count_tokens",
           "decode_draft_indices", "gather_accepted_hidden", "linear",
           "linear_argmax", "linear_partials", "linear_residual_rms_norm", "mixed_draft_inputs",
           "move_accepted_kv",
           "out_cache_loc_uniform", "paged_attention", "paged_extend_attention", "prepare_rows",
           "rms_norm", "rms_norm_cat", "rope_and_store_kv", "rope_and_store_qkv",
           "rope_cos_sin_cache", "stage_decode_inputs", "token_logprobs", "tree_accept",
           "tree_beam_level", "tree_first_inputs", "tree_load_rows", "tree_move_accepted_kv", "tree_stop_cut",
           "tree_store_rows"]


# ---------------------------------------------------------------------------
# RMSNorm (HF Llama semantics: fp32 statistics, cast before the weight multiply)
# ---------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             *, residual_out: torch.Tensor | None = None, kernels: KernelConfig | None = None):
    """`[M, N] -> [M, N]`; with `residual`: `h = x + residual`, returns `(norm(h), h)`, h written
    into `residual_out` `[M, N]` when given (on the Triton path by the norm kernel itself)."""
    if _kc(kernels).use_triton:
        return norm.rms_norm(x, weight, eps, residual=residual, residual_out=residual_out)
    return norm.rms_norm_residual_torch(x, weight, eps, residual, residual_out=residual_out)


def rms_norm_cat(a: torch.Tensor, weight_a: torch.Tensor, eps_a: float, b: torch.Tensor | SplitK,
                 weight_b: torch.Tensor, eps_b: float, *, a_index: torch.Tensor | None = None,
                 b_out: torch.Tensor | None = None, kernels: KernelConfig | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cat([rms_norm(a), rms_norm(b)], -1), b)`: `[M, N]` twice -> `[M, 2N]`, and b as a
    `[M, N]` tensor. With `a_index` `[M]` (int32/int64) the first input is
    `a.index_select(0, a_index)` (a any `[R, N]` table, such as an embedding; the Triton path
    gathers inside the norm kernel). b may be a `SplitK` (`linear_partials`): its sum (a's
    dtype) is written to `b_out` `[M, N]` (allocated when None; by the norm kernel on the
    Triton path) and returned as b."""
    kc = _kc(kernels)
    if isinstance(b, SplitK) and b_out is None:
        b_out = torch.empty(b.shape, dtype=a.dtype, device=a.device)
    if kc.use_triton:
        out = norm.rms_norm_cat(a, weight_a, eps_a, b, weight_b, eps_b, a_index=a_index,
                                b_out=b_out, kernels=kc)
    else:
        out = norm.rms_norm_cat_torch(a, weight_a, eps_a, b, weight_b, eps_b, a_index=a_index,
                                      b_out=b_out)
    return out, (b_out if isinstance(b, SplitK) else b)


# ---------------------------------------------------------------------------
# RoPE (NeoX / HF rotate_half) fused with the KV write
# ---------------------------------------------------------------------------
def rope_and_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out_cache_loc: torch.Tensor, *, kernels: KernelConfig | None = None,
                      max_q_heads: int | None = None) -> None:
    """Rotate q `[T, Hq, D]` in place; write rotated k and v (`[T, Hkv, D]`) to the cache slots.
    `max_q_heads`: the Triton kernel's q lanes (`rope.rope_and_store_kv`; a compile hint)."""
    kc = _kc(kernels)
    if kc.use_triton:
        rope.rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, out_cache_loc,
                               kernels=kc, max_q_heads=max_q_heads)
        return
    rope.rope_and_store_kv_torch(q, k, v, positions, cos_sin, k_cache, v_cache, out_cache_loc)


def rope_and_store_qkv(qkv: torch.Tensor | SplitK, positions: torch.Tensor, cos_sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, out_cache_loc: torch.Tensor,
                       *, kernels: KernelConfig | None = None,
                       max_q_heads: int | None = None) -> torch.Tensor:
    """`rope_and_store_kv` of a fused qkv `[T, (Hq + 2 Hkv) * D]` (Hkv and D are the cache's),
    or of its `SplitK` (`linear_partials`: summed like `SplitK.sum` into the cache dtype, on the
    Triton path while loading); returns the rotated q `[T, Hq, D]` (a view of qkv, or a new
    tensor for a `SplitK`). `max_q_heads` as `rope_and_store_kv`'s."""
    kc = _kc(kernels)
    if isinstance(qkv, SplitK):
        if kc.use_triton:
            return rope.rope_and_store_kv_partials(qkv, positions, cos_sin, k_cache, v_cache,
                                                   out_cache_loc, kernels=kc,
                                                   max_q_heads=max_q_heads)
        qkv = qkv.sum()
    t, hkv, d = qkv.shape[0], k_cache.shape[1], k_cache.shape[2]
    q, k, v = qkv.view(t, -1, d).split([qkv.shape[1] // d - 2 * hkv, hkv, hkv], dim=1)
    rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, out_cache_loc, kernels=kc,
                      max_q_heads=max_q_heads)
    return q


# ---------------------------------------------------------------------------
# Paged attention: query row t attends to positions [0, kv_lens[t]) of its request
# ---------------------------------------------------------------------------
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    req_pool_indices: torch.Tensor, kv_lens: torch.Tensor, req_to_page: torch.Tensor,
                    page_size: int, sm_scale: float, max_kv_len: int, *,
                    q_index: torch.Tensor | None = None, extra_slots: torch.Tensor | None = None,
                    num_extra: int = 0, kernels: KernelConfig | None = None) -> torch.Tensor:
    """q `[T, Hq, D]` -> `[T, Hq, D]`; row t reads exactly positions `[0, kv_lens[t])`, then
    (tree drafting's beams) the cache slots `extra_slots[t, :num_extra]` (`[T, W]` int64).

    `max_kv_len` is a host upper bound of `kv_lens` (static: the context limit). With `q_index`
    `[T]` (int32/int64) the queries are `q.index_select(0, q_index)` (the Triton path gathers
    inside the attention kernel).
    """
    kc = _kc(kernels)
    args = (q, k_cache, v_cache, req_pool_indices, kv_lens, req_to_page, page_size, sm_scale)
    kw = dict(max_kv_len=max_kv_len, q_index=q_index, extra_slots=extra_slots,
              num_extra=num_extra)
    if kc.use_triton:
        return decode_attention.paged_decode_attention(*args, **kw, kernels=kc)
    return decode_attention.paged_decode_attention_ref(*args, **kw)


def paged_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                           extend_lens: torch.Tensor | None, q_starts: torch.Tensor | None,
                           req_to_page: torch.Tensor, page_size: int, sm_scale: float,
                           max_kv_len: int, *, max_extend: int = 0, uniform_n: int = 0,
                           mask_bits: torch.Tensor | None = None,
                           kernels: KernelConfig | None = None) -> torch.Tensor:
    """Rows of several query tokens: q `[T, Hq, D]` -> `[T, Hq, D]`
    (`graphdraft.kernels.extend_attention` has the semantics). Row r (`[R]` metadata) holds
    `extend_lens[r]` tokens (or `uniform_n` each) at q rows from `q_starts[r]`; token j sees
    `max(seq_lens[r] - extend_lens[r] + j + 1, 1)` positions, and with `mask_bits` `[T]` int64
    only the row's new tokens whose bit is set."""
    kc = _kc(kernels)
    args = (q, k_cache, v_cache, req_pool_indices, seq_lens, extend_lens, q_starts, req_to_page,
            page_size, sm_scale)
    kw = dict(max_kv_len=max_kv_len, max_extend=max_extend, uniform_n=uniform_n,
              mask_bits=mask_bits)
    if kc.use_triton:
        return extend_attention.paged_extend_attention(*args, **kw, kernels=kc)
    return extend_attention.paged_extend_attention_ref(*args, **kw)


# ---------------------------------------------------------------------------
# Greedy sampling fused with the draft->target vocab map
# ---------------------------------------------------------------------------
def argmax_with_map(logits: torch.Tensor, hot_token_ids: torch.Tensor | None = None, *,
                    out: torch.Tensor | None = None, tokens_out: torch.Tensor | None = None,
                    kernels: KernelConfig | None = None) -> torch.Tensor:
    """`[B, V]` -> int64 `[B]`: index of the row max (ties: lowest index; NaN never the max),
    mapped by `hot_token_ids`; written into `out` (int64 `[B]`) and copied into `tokens_out`
    (int32/int64 `[B]`, any stride) when given (on the Triton path by the argmax kernels)."""
    kc = _kc(kernels)
    if kc.use_triton:
        return argmax.argmax_with_map(logits, hot_token_ids, out=out, tokens_out=tokens_out,
                                      kernels=kc)
    return argmax.argmax_with_map_torch(logits, hot_token_ids, out=out, tokens_out=tokens_out)


# ---------------------------------------------------------------------------
# KV write locations and the seq-len alias refresh
# ---------------------------------------------------------------------------
def out_cache_loc_uniform(out: torch.Tensor, req_pool_indices: torch.Tensor,
                          cache_start: torch.Tensor, req_to_page: torch.Tensor, page_size: int,
                          length: int, *, positions_out: torch.Tensor | None = None,
                          seq_lens_out: torch.Tensor | None = None, row_major: bool = False,
                          kernels: KernelConfig | None = None) -> None:
    """Write slots of positions `cache_start[r] + j` into `out` laid out `[length, bs]`
    (`row_major`: `[bs, length]`); given `positions_out` int64 / `seq_lens_out` int32 `[bs]`,
    also `cache_start` and `cache_start + 1` there (the first decode step's position and KV
    length)."""
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    kc = _kc(kernels)
    strides = dict(out_stride_req=length, out_stride_tok=1) if row_major else dict(
        out_stride_req=1, out_stride_tok=bs)
    if kc.use_triton:
        cache_loc.compute_out_cache_loc_uniform(
            out, req_pool_indices, cache_start, req_to_page, page_size, length, **strides,
            positions_out=positions_out, seq_lens_out=seq_lens_out, kernels=kc)
        return
    cache_loc.compute_out_cache_loc_uniform_ref(
        out, req_pool_indices, cache_start, req_to_page, page_size, length, **strides,
        positions_out=positions_out, seq_lens_out=seq_lens_out)


def advance_positions_and_seq_lens(seq_lens: torch.Tensor, positions: torch.Tensor, delta: int = 1,
                                   *, kernels: KernelConfig | None = None) -> None:
    """In place: `seq_lens += delta`, `positions += delta` (the seq-len alias refresh between
    steps)."""
    kc = _kc(kernels)
    if kc.use_triton:
        cache_loc.advance_positions_and_seq_lens(seq_lens, positions, delta, kernels=kc)
        return
    cache_loc.advance_positions_and_seq_lens_ref(seq_lens, positions, delta)


# ---------------------------------------------------------------------------
# Matmuls: cuBLAS, or for small M on the Triton path the GEMV kernels with fused epilogues
# ---------------------------------------------------------------------------
def _small_m(x: torch.Tensor, weight: torch.Tensor, kc: KernelConfig) -> bool:
    """The Triton path runs `kernels.gemv` (not cuBLAS) for this matmul: at most
    `kc.small_m_max` rows, unit column stride, contiguous weight, a float dtype it takes."""
    return (kc.use_triton and 1 <= x.shape[0] <= kc.small_m_max and x.dim() == 2
            and x.stride(-1) == 1 and weight.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def apply_act(x: torch.Tensor, act: str | None, *, kernels: KernelConfig | None = None) -> torch.Tensor:
    """A matmul input's activation: None -> x; "silu_mul" -> `silu(gate) * up` of `[gate ; up]`
    (on the Triton path, for a 2-D x with unit column stride, one launch: `gemv.silu_mul`)."""
    if act is None:
        return x
    if act != "silu_mul":
        raise ValueError(f"act: expected None or 'silu_mul', got {act!r}")
    kc = _kc(kernels)
    if kc.use_triton and x.dim() == 2 and x.stride(-1) == 1:
        return gemv.silu_mul(x, kernels=kc)
    return gemv.silu_mul_ref(x)


def _mid_m(x: torch.Tensor, weight: torch.Tensor,
           kc: KernelConfig) -> gemm.GemmConfig | str | None:
    """The route the Triton path runs this (activated) matmul with (`buckets.gemm_config`:
    measured shapes and row buckets): a `kernels.gemm` tile, `gemm.CUBLASLT`, or None for
    plain cuBLAS."""
    if not (kc.use_triton and x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)):
        return None
    cfg = buckets.gemm_config(x.shape[0], weight.shape[0], weight.shape[1],
                              gemm.card_name(x.device), kernels=kc)
    if isinstance(cfg, gemm.GemmConfig) and cfg.tma and not gemm.tma_ok(x, weight):
        return None
    return cfg


def linear(x: torch.Tensor, weight: torch.Tensor, *, act: str | None = None,
           kernels: KernelConfig | None = None) -> torch.Tensor:
    """`act(x) [M, K] @ weight [N, K]^T -> [M, N]` (no bias). act "silu_mul": x is
    `[gate ; up]` `[M, 2K]` and the product reads `silu(gate) * up`."""
    kc = _kc(kernels)
    if _small_m(x, weight, kc):
        return gemv.linear_small_m(x, weight, act=act, kernels=kc)
    x = apply_act(x, act, kernels=kc)
    cfg = _mid_m(x, weight, kc)
    if cfg is None:
        return gemv.linear_ref(x, weight)
    return gemm.linear_lt(x, weight) if cfg == gemm.CUBLASLT else gemm.gemm(x, weight, cfg)


def linear_partials(x: torch.Tensor, weight: torch.Tensor, *,
                    kernels: KernelConfig | None = None) -> torch.Tensor | SplitK:
    """`linear(x, weight)` `[M, N]`, or, where the Triton path runs the GEMV, the same product
    as a `SplitK` (its unsummed fp32 split-K partials; one launch fewer) for the next op that
    accepts one (`rms_norm_cat`'s b, `rope_and_store_qkv`'s qkv), which sums them as the GEMV
    would: the same bits as `linear`'s output. Pass it on; do not look inside."""
    kc = _kc(kernels)
    if _small_m(x, weight, kc):
        return gemv.linear_small_m_partials(x, weight, kernels=kc)
    return linear(x, weight, kernels=kc)


def linear_residual_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                             norm_weight: torch.Tensor, eps: float, *, act: str | None = None,
                             h_out: torch.Tensor | None = None,
                             residual_index: torch.Tensor | None = None,
                             kernels: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = linear(x, weight, act) + residual` `[M, N]`; returns `(rms_norm(h), h)`, `h` written
    into `h_out` when given. With `residual_index` `[M]` (int32/int64) the residual is
    `residual.index_select(0, residual_index)` (gathered inside the norm on the Triton GEMV path)."""
    kc = _kc(kernels)
    if _small_m(x, weight, kc):
        return gemv.linear_small_m_residual_norm(x, weight, residual, norm_weight, eps, act=act,
                                                 h_out=h_out, residual_index=residual_index,
                                                 kernels=kc)
    if residual_index is not None:
        residual = residual.index_select(0, residual_index)
    return rms_norm(linear(x, weight, act=act, kernels=kc), norm_weight, eps, residual,
                    residual_out=h_out, kernels=kc)


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, hot_token_ids: torch.Tensor | None = None,
                  *, ids_out: torch.Tensor | None = None, tokens_out: torch.Tensor | None = None,
                  kernels: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LM head and greedy pick: `(logits [M, N], ids int64 [M])`, ids mapped by `hot_token_ids`;
    ids written into `ids_out` (int64 `[M]`) and copied into `tokens_out` (int32/int64 `[M]`,
    any stride) when given."""
    kc = _kc(kernels)
    if _small_m(x, weight, kc):
        return gemv.linear_small_m_argmax(x, weight, hot_token_ids, ids_out=ids_out,
                                          tokens_out=tokens_out, kernels=kc)
    argmax.check_ids_out(ids_out, tokens_out, x.shape[0], x.device)  # before the matmul runs
    logits = linear(x, weight, kernels=kc)
    return logits, argmax_with_map(logits, hot_token_ids, out=ids_out, tokens_out=tokens_out,
                                   kernels=kc)


# ---------------------------------------------------------------------------
# The first draft step's inputs
# ---------------------------------------------------------------------------
def decode_draft_indices(accept: torch.Tensor, target_seq_lens: torch.Tensor, req: torch.Tensor,
                         valid_cache_lengths: torch.Tensor, n: int, token_offset: int,
                         gather_ids: torch.Tensor, seq_lens: torch.Tensor, write_start: torch.Tensor,
                         tokens: torch.Tensor | None = None, last_token: torch.Tensor | None = None,
                         *, kernels: KernelConfig | None = None) -> None:
    """First draft step, decode rows: write `gather_ids`, `seq_lens`, `write_start` `[bs]` and,
    given the step's input ids `tokens`, `last_token = tokens[gather_ids]` (formulas in
    `graphdraft.kernels.draft_indices`)."""
    kc = _kc(kernels)
    args = (accept, target_seq_lens, req, valid_cache_lengths, n, token_offset, gather_ids,
            seq_lens, write_start, tokens, last_token)
    if kc.use_triton:
        draft_indices.decode_draft_indices(*args, kernels=kc)
    else:
        draft_indices.decode_draft_indices_ref(*args)


def stage_decode_inputs(bs: int, pbs: int, n: int, accept_src: torch.Tensor, tokens_src: torch.Tensor,
                        hidden_src: torch.Tensor, *, kernels: KernelConfig | None = None,
                        **buffers) -> None:
    """Copy a decode batch's draft inputs into the persistent buffers and pad rows/tokens up to
    `pbs` (writes and buffer names in `graphdraft.kernels.stage_inputs`)."""
    fn = (stage_inputs.stage_decode_inputs if _kc(kernels).use_triton
          else stage_inputs.stage_decode_inputs_ref)
    fn(bs, pbs, n, accept_src, tokens_src, hidden_src, **buffers)


# ---------------------------------------------------------------------------
# The speculative cycle: prepare, accept, commit + pack (formulas in each kernel module)
# ---------------------------------------------------------------------------
def prepare_rows(slot_rows: torch.Tensor, n: int, *, kernels: KernelConfig | None = None,
                 **tables) -> None:
    """Verify inputs of `rows = len(slot_rows)` rows of n tokens from the slot state
    (`graphdraft.kernels.cycle_kernels`: the keyword tables and their shapes, `[rows]` and
    `[rows * n]` destinations)."""
    kc = _kc(kernels)
    if kc.use_triton:
        cycle_kernels.prepare_rows(slot_rows, n, kernels=kc, **tables)
    else:
        cycle_kernels.prepare_rows_ref(slot_rows, n, **tables)


def accept_tokens(logits: torch.Tensor, cand: torch.Tensor, slots: torch.Tensor,
                  seq_lens: torch.Tensor, state, *, kernels: KernelConfig | None = None,
                  **outputs) -> None:
    """Greedy and sampled acceptance of `rows` rows of N candidates: logits `[rows * N, V]`,
    cand `[rows, N]`, slots / seq_lens `[rows]`, `state` a `SlotState`; writes `tokens`
    `[rows, N]`, `accept`, `draft_accept`, `finish` `[rows]`, ORs `err` `[rows]`
    (`graphdraft.kernels.accept`)."""
    kc = _kc(kernels)
    if kc.use_triton:
        accept.accept_tokens(logits, cand, slots, seq_lens, state, kernels=kc, **outputs)
    else:
        accept.accept_tokens_ref(logits, cand, slots, seq_lens, state, **outputs)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor,
                   widths: torch.Tensor, *, out: torch.Tensor, k: int,
                   logit_rows: torch.Tensor | None = None, done: torch.Tensor | None = None,
                   accept: torch.Tensor | None = None,
                   kernels: KernelConfig | None = None) -> None:
    """Log-probabilities of the emitted `tokens [rows, n]` and the rows' top-`widths[slot]`
    alternatives (at most k) into `out [rows, N * (1 + 2k)]` int32; `accept [rows]` or None:
    only positions `j < accept[r]` (`graphdraft.kernels.logprobs`)."""
    kc = _kc(kernels)
    args = (logits, tokens, slots, widths)
    kw = dict(out=out, k=k, logit_rows=logit_rows, done=done, accept=accept)
    if kc.use_triton:
        logprobs.token_logprobs(*args, kernels=kc, **kw)
    else:
        logprobs.token_logprobs_ref(*args, **kw)


def apply_logit_controls(logits: torch.Tensor, cand: torch.Tensor, slots: torch.Tensor, state,
                         *, path: torch.Tensor | None = None,
                         kernels: KernelConfig | None = None) -> None:
    """The rows' logit_bias and repetition / frequency / presence penalties, in place on the
    verify logits `[rows * N, V]` (candidates `cand [rows, N]`, `slots [rows]`, `state` a
    `SlotState`; `path [rows, N]` a tree's ancestor masks, None: the chain), each position
    counting the earlier candidates on its path as emitted (`graphdraft.kernels.logit_controls`).
    Called once per verify, before the acceptance (and before any log-probability)."""
    if _kc(kernels).use_triton:
        logit_controls.apply_logit_controls(logits, cand, slots, state, path=path,
                                            kernels=_kc(kernels))
    else:
        logit_controls.apply_logit_controls_ref(logits, cand, slots, state, path=path)


def apply_draft_logit_controls(logits: torch.Tensor, window: torch.Tensor, slots: torch.Tensor,
                               state, *, accepted: torch.Tensor | None = None,
                               accepted_len: torch.Tensor | None = None,
                               col_ids: torch.Tensor | None = None,
                               col_of: torch.Tensor | None = None,
                               kernels: KernelConfig | None = None) -> None:
    """The same controls on a draft step's logits `[B, Vd]` in place: each row's request as
    after its committed tokens (`state.token_counts`), this cycle's accepted tokens not yet
    counted (`accepted [A, n]`, the first `accepted_len [A]` of row `r // (B / A)`: a tree's
    beams share their request's row; both None: none pending) and the `window [B, W]`
    drafted since (target ids, -1: none); `col_ids [Vd]` the target id of each draft column,
    `col_of [V]` its inverse (-1: not in the draft vocabulary); None: the target's vocabulary
    (`graphdraft.kernels.logit_controls`)."""
    kw = dict(accepted=accepted, accepted_len=accepted_len, col_ids=col_ids, col_of=col_of)
    if _kc(kernels).use_triton:
        logit_controls.apply_draft_logit_controls(logits, window, slots, state,
                                                  kernels=_kc(kernels), **kw)
    else:
        logit_controls.apply_draft_logit_controls_ref(logits, window, slots, state, **kw)


def count_tokens(tokens: torch.Tensor, accept: torch.Tensor, slots: torch.Tensor,
                 counts: torch.Tensor, *, kernels: KernelConfig | None = None) -> None:
    """`counts[slots[r], tokens[r, j]] += 1` for j < accept[r] (`[rows, n]`, `[rows]`,
    `[R, V]` int32: `SlotState.token_counts`; the output counts, in each commit: after the
    draft, so a cycle that fails before its commit counts nothing)."""
    if _kc(kernels).use_triton:
        logit_controls.count_tokens(tokens, accept, slots, counts, kernels=_kc(kernels))
    else:
        logit_controls.count_tokens_ref(tokens, accept, slots, counts)


def ngram_propose(history: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, k: int,
                  ngram_min: int, ngram_max: int, *, out: torch.Tensor, found: torch.Tensor,
                  kernels: KernelConfig | None = None) -> None:
    """N-gram lookup drafts of `rows` rows: history `[R, L]`, lengths `[R]`, slots `[rows]`;
    writes `out [rows, S + 1]` (k drafts, filler past the match) and `found [rows]`
    (`graphdraft.kernels.ngram`)."""
    kc = _kc(kernels)
    if kc.use_triton:
        ngram.ngram_propose(history, lengths, slots, k, ngram_min, ngram_max, out=out,
                            found=found, kernels=kc)
    else:
        ngram.ngram_propose_ref(history, lengths, slots, k, ngram_min, ngram_max, out=out,
                                found=found)


def commit_pack(tokens: torch.Tensor, next_tokens: torch.Tensor | None, *,
                kernels: KernelConfig | None = None, **tables) -> None:
    """Accepted tokens `[rows, n]` (and the next drafts `[rows, S + 1]` or None) into the slot
    state, and the packed output `pack [rows, N + 3]` (`graphdraft.kernels.cycle_kernels`: the
    keyword tables, `prefill`)."""
    kc = _kc(kernels)
    if kc.use_triton:
        cycle_kernels.commit_pack(tokens, next_tokens, kernels=kc, **tables)
    else:
        cycle_kernels.commit_pack_ref(tokens, next_tokens, **tables)


# ---------------------------------------------------------------------------
# Tree drafting: build, accept, compact (formulas in each kernel module)
# ---------------------------------------------------------------------------
def build_tree(spec, cand_score: torch.Tensor, cand_tok: torch.Tensor, cand_parent: torch.Tensor,
               root: torch.Tensor, prefix_len: torch.Tensor, out: tree_build.TreeBuffers, *,
               kernels: KernelConfig | None = None) -> None:
    """The candidate store (`[B, M]` each) -> the n-node verify tree of each row, written into
    `out` (`graphdraft.kernels.tree_build`; `spec` a `runtime.tree.TreeSpec`)."""
    kc = _kc(kernels)
    args = (spec, cand_score, cand_tok, cand_parent, root, prefix_len, out)
    if kc.use_triton:
        tree_build.build_tree(*args, kernels=kc)
    else:
        tree_build.build_tree_ref(*args)


def tree_accept(spec, tokens: torch.Tensor, first_child: torch.Tensor, next_sibling: torch.Tensor,
                *, kernels: KernelConfig | None = None, **io) -> None:
    """One walk per row down the verified tree (`[B, n]` each): greedy with `target` `[B * n]`,
    sampled with `probs`, `coins`, `final_coin`; writes `accept_len`, `accept_index`,
    `out_tokens`, `bonus` (`graphdraft.kernels.tree_accept`)."""
    kc = _kc(kernels)
    if kc.use_triton:
        tree_accept_kernel.tree_accept(spec, tokens, first_child, next_sibling, kernels=kc, **io)
    else:
        tree_accept_kernel.tree_accept_ref(spec, tokens, first_child, next_sibling, **io)


def tree_stop_cut(out_tokens: torch.Tensor, accept_len: torch.Tensor, req: torch.Tensor,
                  live: torch.Tensor, stop_ids: torch.Tensor, max_new: torch.Tensor,
                  emitted: torch.Tensor, accept_out: torch.Tensor, finish_out: torch.Tensor,
                  err_out: torch.Tensor, *, rows: tuple | None = None,
                  kernels: KernelConfig | None = None) -> None:
    """The tree cycle's stop-id / max_new cut of `accept_len [B]` over the accepted paths
    `out_tokens [B, P]`; writes accept_out / finish_out / err_out `[B]` and, given `rows`
    (accept_index, n, logit_rows `[B, P]`), the path nodes' verify rows
    (`graphdraft.kernels.tree_stop_cut`)."""
    fn = tree_stop_cut_kernel.stop_cut if _kc(kernels).use_triton else tree_stop_cut_kernel.stop_cut_ref
    fn(out_tokens, accept_len, req, live, stop_ids, max_new, emitted, accept_out, finish_out,
       err_out, rows=rows)


def tree_beam_level(spec, j: int, logits: torch.Tensor, st, *,
                    kernels: KernelConfig | None = None, **io) -> None:
    """One beam level into the beams' tables `st`: j = 0 the first draft step (`logits
    [B, Vd]`), j = 1..K-1 a decode step (`logits [B*k, Vd]`); `io` the optional inputs and
    outputs (`graphdraft.kernels.tree_beams`). The kernel serves k >= 2 (one launch a level);
    k = 1 (the chain's argmax, `greedy_ids`) always takes the torch path."""
    tb = tree_beams_kernel
    if _kc(kernels).use_triton and spec.topk > 1 and io.get("greedy_ids") is None:
        io.pop("greedy_ids", None)
        if j == 0:
            tb.beam_first(spec, logits, st, kernels=_kc(kernels), **io)
        else:
            tb.beam_decode(spec, j, logits, st, kernels=_kc(kernels), **io)
    elif j == 0:
        tb.beam_first_ref(spec, logits, st, **io)
    else:
        tb.beam_decode_ref(spec, j, logits, st, **io)


def move_accepted_kv(k_layers: list[torch.Tensor], v_layers: list[torch.Tensor],
                     req_to_page: torch.Tensor, req: torch.Tensor, prefix_len: torch.Tensor,
                     accept_index: torch.Tensor, accept_len: torch.Tensor, page_size: int, *,
                     kernels: KernelConfig | None = None) -> None:
    """The accepted path's KV to the front, every layer (`[B]` rows, `accept_index [B, P]`;
    `graphdraft.kernels.kv_move`)."""
    kc = _kc(kernels)
    args = (k_layers, v_layers, req_to_page, req, prefix_len, accept_index, accept_len, page_size)
    if kc.use_triton:
        kv_move.move_accepted_kv(*args, kernels=kc)
    else:
        kv_move.move_accepted_kv_ref(*args)


def tree_first_inputs(req: torch.Tensor, prefix_len: torch.Tensor, accept_len: torch.Tensor,
                      req_to_page: torch.Tensor, page_size: int, p: int, pos: torch.Tensor,
                      loc: torch.Tensor, gather: torch.Tensor, prefix: torch.Tensor, *,
                      kernels: KernelConfig | None = None) -> None:
    """The tree drafter's first step inputs `[B*P]` / `[B]` (positions, KV slots, LM-head
    rows, prefix; `graphdraft.kernels.tree_first_inputs`; one launch on the Triton path)."""
    kc = _kc(kernels)
    args = (req, prefix_len, accept_len, req_to_page, page_size, p, pos, loc, gather, prefix)
    if kc.use_triton:
        tree_first_inputs_kernel.first_inputs(*args, kernels=kc)
    else:
        tree_first_inputs_kernel.first_inputs_ref(*args)


def tree_load_rows(slot_rows: torch.Tensor, done: torch.Tensor, vcl: torch.Tensor, tables,
                   rows, positions: torch.Tensor, retrieve_index: torch.Tensor,
                   live: torch.Tensor, req: torch.Tensor, prefix_len: torch.Tensor, *,
                   kernels: KernelConfig | None = None, **io) -> None:
    """The tree cycle's rows in: live / req / L of `slot_rows [B]`, their slots' trees
    (`tables` -> `rows`, positions, retrieve_index), optional `columns` and the verify's KV
    slots (`graphdraft.kernels.tree_slots`; one launch on the Triton path)."""
    kc = _kc(kernels)
    args = (slot_rows, done, vcl, tables, rows, positions, retrieve_index, live, req, prefix_len)
    if kc.use_triton:
        tree_slots_kernel.load_rows(*args, kernels=kc, **io)
    else:
        tree_slots_kernel.load_rows_ref(*args, **io)


def admit_slot_rows(tables, slots: torch.Tensor, stop: torch.Tensor, counted: torch.Tensor,
                    counted_off: torch.Tensor, bias_ids: torch.Tensor, bias_values: torch.Tensor,
                    bias_len: torch.Tensor, columns=(), *,
                    kernels: KernelConfig | None = None) -> None:
    """Admitted requests' rows of the `SlotState` tables (`tables` by name) at `slots [m]`:
    state reset, stop ids, prompt flags, logit bias, sampling `columns`
    (`graphdraft.kernels.slot_admit`; one launch on the Triton path)."""
    kc = _kc(kernels)
    args = (tables, slots, stop, counted, counted_off, bias_ids, bias_values, bias_len, columns)
    if kc.use_triton:
        slot_admit_kernel.admit_rows(*args, kernels=kc)
    else:
        slot_admit_kernel.admit_rows_ref(*args)


def copy_segments(pairs, *, kernels: KernelConfig | None = None) -> None:
    """`dst[:len(src)] = src` for each `(dst, src)` of `pairs` (1-D, up to 12;
    `graphdraft.kernels.segments`; one launch on the Triton path)."""
    if _kc(kernels).use_triton:
        segments_kernel.copy_segments(pairs, kernels=_kc(kernels))
    else:
        segments_kernel.copy_segments_ref(pairs)


def mixed_draft_inputs(ne: int, nd: int, n: int, npt: int, rows: int, tokens: int,
                       shifted: torch.Tensor, extend_lens: torch.Tensor,
                       output_tokens: torch.Tensor, accept: torch.Tensor, *,
                       kernels: KernelConfig | None = None, **out) -> None:
    """A prefill / mixed batch's first draft step inputs (ids, accept lengths, row kinds,
    padding, accepted tokens; `out`: ids, accept_out, row_kind, accepted, kinds, pad_id),
    `graphdraft.kernels.mixed_draft_inputs`; one launch on the Triton path."""
    args = (ne, nd, n, npt, rows, tokens, shifted, extend_lens, output_tokens, accept)
    if _kc(kernels).use_triton:
        mixed_draft_inputs_kernel.mixed_draft_inputs(*args, kernels=_kc(kernels), **out)
    else:
        mixed_draft_inputs_kernel.mixed_draft_inputs_ref(*args, **out)


def tree_store_rows(rows, req: torch.Tensor, tables, *,
                    kernels: KernelConfig | None = None) -> None:
    """The cycle's trees `rows` (six `[B, n]`) into the slots' `tables` (`[R + 1, n]`, a
    spare last row) at `req [B]`, rows of slot 0 storing nothing
    (`graphdraft.kernels.tree_slots`; one launch on the Triton path)."""
    if _kc(kernels).use_triton:
        tree_slots_kernel.store_rows(rows, req, tables, kernels=_kc(kernels))
    else:
        tree_slots_kernel.store_rows_ref(rows, req, tables)


def tree_move_accepted_kv(k_layers: list[torch.Tensor], v_layers: list[torch.Tensor],
                          table: torch.Tensor, req_to_page: torch.Tensor, req: torch.Tensor,
                          prefix_len: torch.Tensor, accept_index: torch.Tensor,
                          accept_len: torch.Tensor, page_size: int, *,
                          kernels: KernelConfig | None = None) -> None:
    """`move_accepted_kv` in one launch for every layer (`table`: the layers' pointer table,
    `graphdraft.kernels.tree_kv_move.kv_pointer_table`); the torch path is the same ref."""
    kc = _kc(kernels)
    rows = (req_to_page, req, prefix_len, accept_index, accept_len, page_size)
    if kc.use_triton:
        tree_kv_move_kernel.move_accepted_kv_all(k_layers, v_layers, table, *rows, kernels=kc)
    else:
        tree_kv_move_kernel.move_accepted_kv_ref(k_layers, v_layers, *rows)


def gather_accepted_hidden(aux_hidden: torch.Tensor, accept_index: torch.Tensor,
                           accept_len: torch.Tensor, n: int, hid_c: torch.Tensor, *,
                           kernels: KernelConfig | None = None) -> None:
    """`hid_c [B * P, kH] = aux_hidden[r * n + path[d]]` (`graphdraft.kernels.kv_move`)."""
    kc = _kc(kernels)
    if kc.use_triton:
        kv_move.gather_accepted_hidden(aux_hidden, accept_index, accept_len, n, hid_c, kernels=kc)
    else:
        kv_move.gather_accepted_hidden_ref(aux_hidden, accept_index, accept_len, n, hid_c)


def accept_control(next_tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                   oracle: torch.Tensor, p: float | torch.Tensor, seed: int, vocab_size: int, *,
                   kernels: KernelConfig | None = None) -> None:
    """Benchmarks' accept-rate control: drafts `next_tokens[:, 1:]` `[bs, S]` overwritten to
    match the oracle with probability p (`graphdraft.kernels.accept_control`)."""
    kc = _kc(kernels)
    args = (next_tokens, slots, positions, oracle, p, seed, vocab_size)
    if kc.use_triton:
        accept_control_kernel.accept_control(*args, kernels=kc)
    else:
        accept_control_kernel.accept_control_ref(*args)
