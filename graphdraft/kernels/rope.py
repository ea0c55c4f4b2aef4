"""Rotary embedding (NeoX / HF-Llama rotate_half) fused with the KV-cache store.

For each token t, with ``c = cos_sin_cache[positions[t], :D/2]`` and
``s = cos_sin_cache[positions[t], D/2:]``, every head vector x is rotated as
``out[i] = x[i]*c[i] - x[i+D/2]*s[i]`` and ``out[i+D/2] = x[i+D/2]*c[i] + x[i]*s[i]``
(fp32 math, stored in x's dtype). q is rotated in place; rotated k and raw v are
written to ``k_cache[out_cache_loc[t]]`` / ``v_cache[out_cache_loc[t]]``; k itself
is left unchanged. One program per token handles all heads.

Fused form: `rope_and_store_kv_partials` takes qkv as the qkv GEMV's fp32 split-K partials
`[split, T, (Hq + 2 Hkv) * D]` (`gemv.linear_small_m_partials`) and sums them while loading
(`fused_inputs.sum_partials`, rounded to the cache dtype: the bits `gemv.linear_small_m` would
have written), replacing the GEMV's split-sum launch; rotated q goes to a separate `[T, Hq, D]`.
Both forms, any split count and any q head count up to the q lanes (`max_q_heads`: the
KV-only step's one head) launch one compiled kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import INDEX_DTYPES, expect_tensor
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.fused_inputs import SplitK, check_partials, sum_partials
from graphdraft.kernels.pdl import launch_options, pdl_enter

__all__ = ["llama3_inv_freq", "rope_and_store_kv", "rope_and_store_kv_partials",
           "rope_and_store_kv_ref", "rope_and_store_kv_torch", "rope_cos_sin_cache",
           "rope_rotate_torch"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rotate(x1, x2, c, s):
    """Rotate the two halves [H, D/2] (fp32) by cos/sin [1, D/2]."""
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _load_input(ptrs, mask, split_stride, split, PARTIALS: tl.constexpr):
    """q/k/v values: loaded, or (PARTIALS) the fp32 sum of `split` split-K partials."""
    if PARTIALS:
        x = sum_partials(ptrs, split_stride, mask, split)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def _rope_heads(q_ptr, k_ptr, v_ptr, oq, ok, ov, mq, mkv, split_stride, split, c, s, po, pkc, pvc,
                HALF: tl.constexpr, PARTIALS: tl.constexpr):
    """One token: q (`q_ptr + oq`, mask mq) rotated into `po`, k (`k_ptr + ok`) rotated into
    `pkc`, v (`v_ptr + ov`) copied into `pvc` (masks mkv); each offset / pointer block is the
    `[H, D/2]` first half of its heads, the second half HALF further on. PARTIALS: the inputs
    are fp32 split-K partials, each summed and rounded to the cache dtype."""
    dtype = pkc.dtype.element_ty
    q1 = _load_input(q_ptr + oq, mq, split_stride, split, PARTIALS).to(dtype)
    q2 = _load_input(q_ptr + oq + HALF, mq, split_stride, split, PARTIALS).to(dtype)
    o1, o2 = _rotate(q1.to(tl.float32), q2.to(tl.float32), c, s)
    tl.store(po, o1.to(dtype), mask=mq)
    tl.store(po + HALF, o2.to(dtype), mask=mq)
    k1 = _load_input(k_ptr + ok, mkv, split_stride, split, PARTIALS).to(dtype)
    k2 = _load_input(k_ptr + ok + HALF, mkv, split_stride, split, PARTIALS).to(dtype)
    o1, o2 = _rotate(k1.to(tl.float32), k2.to(tl.float32), c, s)
    tl.store(pkc, o1.to(dtype), mask=mkv)
    tl.store(pkc + HALF, o2.to(dtype), mask=mkv)
    v_dtype = pvc.dtype.element_ty
    v1 = _load_input(v_ptr + ov, mkv, split_stride, split, PARTIALS)
    v2 = _load_input(v_ptr + ov + HALF, mkv, split_stride, split, PARTIALS)
    tl.store(pvc, v1.to(v_dtype), mask=mkv)
    tl.store(pvc + HALF, v2.to(v_dtype), mask=mkv)


# The drafter passes per-step slices of its cache-location buffer at offsets of step * bs
# elements, 16-byte aligned only for even bs: not specialized on alignment (one scalar load per
# program). split_stride (T * width) stays specialized: width is a multiple of 16 for every
# head_dim in use, so it is always "divisible by 16", which keeps the partials' loads vectorized.
# The q head count and the split count are runtime values (not specialized): the forward and
# the KV-only step (one q head), activations and partials share one variant.
@triton.jit(do_not_specialize=["split", "hq", "pdl_trigger"],
            do_not_specialize_on_alignment=["pos_ptr", "loc_ptr"])
def _rope_store_kernel(
    q_ptr, qp_ptr, sq_t, sq_h,
    k_ptr, kp_ptr, sk_t, sk_h,
    v_ptr, vp_ptr, sv_t, sv_h,
    split, split_stride,
    qo_ptr, sqo_t, sqo_h,
    pos_ptr, cs_ptr, s_cs,
    kc_ptr, skc_s, skc_h,
    vc_ptr, svc_s, svc_h,
    loc_ptr, hq,
    HKV: tl.constexpr, HALF: tl.constexpr,
    HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    pdl_trigger, PDL: tl.constexpr, EARLY: tl.constexpr,
):
    """Program t: token t's hq q heads (of HQ_PAD lanes) and HKV k / v heads. split == 0: q/k/v
    are the activations at q_ptr / k_ptr / v_ptr (q_out may be q itself); split > 0: they are
    fp32 split-K partials at qp_ptr / kp_ptr / vp_ptr (strides of one split; `sum_partials`).
    Both kinds of pointer are always passed, each in its own dtype (the kind not read: tensors
    of the call, never read); one uniform branch picks the kind, the rest is straight-line.
    EARLY (with PDL): position, cache slot and cos/sin are loaded before waiting for the
    kernel before (pdl module doc); q/k/v after."""
    if not EARLY:
        pdl_enter(PDL, pdl_trigger)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    loc = tl.load(loc_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    dmask = d < HALF
    c = tl.load(cs_ptr + pos * s_cs + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(cs_ptr + pos * s_cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if EARLY:
        pdl_enter(PDL, pdl_trigger)

    d = d[None, :]
    h = tl.arange(0, HQ_PAD)[:, None].to(tl.int64)
    mq = (h < hq) & dmask[None, :]
    oq = t * sq_t + h * sq_h + d
    po = qo_ptr + t * sqo_t + h * sqo_h + d
    h = tl.arange(0, HKV_PAD)[:, None].to(tl.int64)
    mkv = (h < HKV) & dmask[None, :]
    ok = t * sk_t + h * sk_h + d
    ov = t * sv_t + h * sv_h + d
    pkc = kc_ptr + loc * skc_s + h * skc_h + d
    pvc = vc_ptr + loc * svc_s + h * svc_h + d
    if split > 0:
        _rope_heads(qp_ptr, kp_ptr, vp_ptr, oq, ok, ov, mq, mkv, split_stride, split, c, s, po, pkc,
                    pvc, HALF, True)
    else:
        _rope_heads(q_ptr, k_ptr, v_ptr, oq, ok, ov, mq, mkv, split_stride, split, c, s, po, pkc,
                    pvc, HALF, False)


def _check_q(name, q) -> None:
    expect_tensor(name, q, shape=("T", "Hq", "D"), dtypes=_DTYPES, layout="rows")
    if q.shape[2] % 2:
        raise ValueError(f"{name}: expected an even head_dim D, got {q.shape[2]}")


def _check_targets(q, hkv, positions, cos_sin_cache, k_cache, v_cache, out_cache_loc) -> None:
    """The caches, rows and table around q `[T, Hq, D]` (which fixes T, D, dtype and device)."""
    T, _, D = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        expect_tensor(name, t, shape=("num_slots", hkv, D), dtypes=q.dtype, device=q.device,
                      layout="rows")
    for name, t in (("positions", positions), ("out_cache_loc", out_cache_loc)):
        expect_tensor(name, t, shape=(T,), dtypes=INDEX_DTYPES, device=q.device, layout="contiguous")
    expect_tensor("cos_sin_cache", cos_sin_cache, shape=("max_pos", D), dtypes=torch.float32,
                  device=q.device, layout="rows")


def _check(q, k, v, positions, cos_sin_cache, k_cache, v_cache, out_cache_loc) -> None:
    _check_q("q", q)
    T, _, D = q.shape
    for name, t in (("k", k), ("v", v)):
        expect_tensor(name, t, shape=(T, "Hkv", D), dtypes=q.dtype, device=q.device, layout="rows")
    expect_tensor("v", v, shape=tuple(k.shape))  # the shape of k
    _check_targets(q, k.shape[1], positions, cos_sin_cache, k_cache, v_cache, out_cache_loc)


def _launch(q, k, v, split, q_out, positions, cos_sin_cache, k_cache, v_cache,
            out_cache_loc, kernels: KernelConfig | None, max_q_heads: int | None) -> None:
    """q/k/v `[T, H, D]` views of the activations (split 0) or `[split, T, H, D]` views of fp32
    partials; the pointers of the other kind get tensors of the call in their dtype, never
    read (q_out for the activations, cos_sin_cache, fp32, for the partials)."""
    T, Hq, D = q_out.shape
    Hkv, half = k_cache.shape[1], D // 2
    acts, parts = ((q_out,) * 3, (q, k, v)) if split else ((q, k, v), (cos_sin_cache,) * 3)
    _rope_store_kernel[(T,)](
        acts[0], parts[0], q.stride(-3), q.stride(-2),
        acts[1], parts[1], k.stride(-3), k.stride(-2),
        acts[2], parts[2], v.stride(-3), v.stride(-2),
        split, q.stride(0) if split else 0,
        q_out, q_out.stride(0), q_out.stride(1),
        positions, cos_sin_cache, cos_sin_cache.stride(0),
        k_cache, k_cache.stride(0), k_cache.stride(1),
        v_cache, v_cache.stride(0), v_cache.stride(1),
        out_cache_loc, Hq,
        HKV=Hkv, HALF=half,
        HQ_PAD=triton.next_power_of_2(max(Hq, max_q_heads or 0)),
        HKV_PAD=triton.next_power_of_2(Hkv), HALF_PAD=triton.next_power_of_2(half),
        num_warps=4, **launch_options(k_cache.device, T, early=True, kernels=kernels),
    )


def rope_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
    *,
    kernels: KernelConfig | None = None,
    max_q_heads: int | None = None,
) -> None:
    """Rotate q ``[T, Hq, D]`` in place; store rotated k and raw v ``[T, Hkv, D]`` into
    ``k_cache``/``v_cache`` ``[num_slots, Hkv, D]`` at slots ``out_cache_loc`` ``[T]``.

    ``positions`` ``[T]`` (int64, int32 accepted) index ``cos_sin_cache`` ``[max_pos, D]``
    fp32 (cos in the first D/2 columns, sin in the last). q/k/v may be strided views
    of one fused qkv buffer (last dim contiguous). Rows sharing a slot race (last
    write wins undefined): only padded rows aimed at a dummy slot may do that.
    ``max_q_heads``: the kernel's q lanes cover ``max(Hq, max_q_heads)`` heads (the extra
    lanes masked off); a call that rotates fewer q heads than the model's forward (the
    KV-only step: one) passes the forward's Hq, so both launch one compiled kernel.
    """
    _check(q, k, v, positions, cos_sin_cache, k_cache, v_cache, out_cache_loc)
    if q.shape[0] > 0:
        _launch(q, k, v, 0, q, positions, cos_sin_cache, k_cache, v_cache, out_cache_loc, kernels,
                max_q_heads)


def rope_and_store_kv_partials(
    qkv: SplitK,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    kernels: KernelConfig | None = None,
    max_q_heads: int | None = None,
) -> torch.Tensor:
    """:func:`rope_and_store_kv` of a fused qkv given as a `SplitK`: the qkv GEMV's fp32 split-K
    partials ``[split, T, (Hq + 2 Hkv) * D]`` (contiguous; Hkv and D are the cache's): each value is
    summed and rounded to the cache dtype while loading, the bits ``gemv.linear_small_m``
    would have written. Rotated q goes to ``q_out`` ``[T, Hq, D]`` (cache dtype, last dim
    contiguous; allocated when None), which is returned; k, v and ``max_q_heads`` as there.
    """
    expect_tensor("k_cache", k_cache, shape=("num_slots", "Hkv", "D"))
    hkv, D = k_cache.shape[1], k_cache.shape[2]
    if not isinstance(qkv, SplitK):
        raise ValueError(f"qkv: expected split-K partials (a SplitK), got {type(qkv).__name__}")
    ws = qkv.partials
    width = ws.shape[-1] if ws.dim() == 3 else 0
    if width % D or width // D <= 2 * hkv:
        raise ValueError(f"qkv: expected float32 split-K partials [split, T, (Hq + 2*{hkv}) * {D}], "
                         f"got {ws.dtype} {tuple(ws.shape)}")
    check_partials("qkv", qkv, ws.shape[1], width, k_cache.device)
    if qkv.dtype != k_cache.dtype:
        raise ValueError(f"qkv: expected split-K partials of a {k_cache.dtype} product (the "
                         f"cache's dtype), got {qkv.dtype}")
    T, Hq = ws.shape[1], width // D - 2 * hkv
    if q_out is None:
        q_out = torch.empty((T, Hq, D), dtype=k_cache.dtype, device=k_cache.device)
    _check_q("q_out", q_out)
    expect_tensor("q_out", q_out, shape=(T, Hq, D), dtypes=k_cache.dtype, device=k_cache.device)
    _check_targets(q_out, hkv, positions, cos_sin_cache, k_cache, v_cache, out_cache_loc)
    if T > 0:
        q, k, v = ws.view(ws.shape[0], T, Hq + 2 * hkv, D).split([Hq, hkv, hkv], dim=2)
        _launch(q, k, v, ws.shape[0], q_out, positions, cos_sin_cache, k_cache, v_cache,
                out_cache_loc, kernels, max_q_heads)
    return q_out


def rope_rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The RoPE rotation in torch, its one home (NeoX / HF rotate_half, in fp32, then cast):
    x `[..., D]`, cos / sin `[..., D/2]` fp32 broadcasting against x's halves -> rotated x in
    x.dtype: `[x1 cos - x2 sin, x2 cos + x1 sin]`. `ops.rope_and_store_kv`'s torch path,
    :func:`rope_and_store_kv_ref` and the training forward call it."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_and_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """Torch reference (HF ``apply_rotary_pos_emb`` in fp32, then cast); same checks and
    effects (:func:`rope_and_store_kv_torch`)."""
    _check(q, k, v, positions, cos_sin_cache, k_cache, v_cache, out_cache_loc)
    rope_and_store_kv_torch(q, k, v, positions, cos_sin_cache, k_cache, v_cache, out_cache_loc)


def rope_and_store_kv_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            out_cache_loc: torch.Tensor) -> None:
    """The op in torch, its one home (`ops.rope_and_store_qkv`'s torch path and
    :func:`rope_and_store_kv_ref`; any float dtype, no checks): q rotated in place, rotated k
    and v written at `out_cache_loc`."""
    D = q.shape[2]
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, : D // 2], cs[:, None, D // 2 :]
    q.copy_(rope_rotate_torch(q, cos, sin))
    loc = out_cache_loc.long()
    k_cache[loc] = rope_rotate_torch(k, cos, sin)
    v_cache[loc] = v


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1's rope scaling (HF `rope_type: "llama3"`) of the inverse frequencies
    `[D/2]` (float64): with `factor`, `low_freq_factor` (default 1), `high_freq_factor`
    (default 4) and `original_max_position_embeddings` (default 8192) = L, a frequency of
    wavelength `w = 2 pi / f` is kept when `w < L / high_freq_factor`, divided by `factor` when
    `w > L / low_freq_factor`, and in between blended: `(1 - s) f / factor + s f` with
    `s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)`. cos / sin are not
    rescaled (HF's attention factor for llama3 is 1). ValueError naming `rope_scaling` for a
    missing or bad parameter."""
    def number(key: str, default: float | None) -> float:
        value = scaling.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"rope_scaling: llama3 needs a number > 0 for {key!r}, got "
                             f"{value!r}")
        return float(value)

    factor = number("factor", None)
    low, high = number("low_freq_factor", 1.0), number("high_freq_factor", 4.0)
    old_ctx = number("original_max_position_embeddings", 8192)
    if high <= low:
        raise ValueError(f"rope_scaling: llama3 needs high_freq_factor > low_freq_factor, got "
                         f"{high!r} <= {low!r}")
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * torch.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_mid, mid, scaled)


def rope_cos_sin_cache(head_dim: int, max_positions: int, theta: float,
                       scaling: dict | None = None, device: str | torch.device | None = None
                       ) -> torch.Tensor:
    """The rope table `[max_positions, head_dim]` fp32: cos in the first half of the columns,
    sin in the second (the `cos_sin_cache` every RoPE path reads).

    `scaling` supports HF's Llama-3 rope scaling (`rope_type: "llama3"`, `llama3_inv_freq`;
    None, `{}` or type "default": none). `device` None: the current default device
    (`torch.get_default_device()`), so a model built under `with torch.device("cuda"):` gets
    its table there. Computed in float64 on the host either way (the same values on every
    device; angles exact to fp32 at 128k positions).
    """
    if device is None:
        device = torch.get_default_device()
    cpu = torch.device("cpu")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu)
                                / head_dim))
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ValueError(f"rope_scaling: expected a dict or None, got {scaling!r}")
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        elif kind not in (None, "default"):
            raise ValueError(f"rope_scaling: unsupported rope_type {kind!r} (expected 'llama3')")
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64, device=cpu), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.float32).to(device)
