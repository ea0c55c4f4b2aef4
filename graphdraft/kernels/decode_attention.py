"""Paged, GQA-grouped, split-KV decode attention (flash-decoding).

Each query row t attends to positions ``[0, kv_lens[t])`` of request
``req_pool_indices[t]``; the cache slot of position p of request r is
``req_to_page[r, p // page_size] * page_size + p % page_size``. Nothing past
``kv_lens[t]`` is read (neither page-table entries nor KV).

Stage 1, grid ``(T, Hkv, num_splits)``: one program takes the G = Hq / Hkv query
heads that share one kv head (padded to >= 16 rows for ``tl.dot``), so KV is read
once per group, and runs an fp32 online softmax over its chunk of
``chunk = roundup(ceil(max_kv_len / num_splits), BLOCK_N)`` positions, looping
only up to ``kv_lens[t]`` (the last split also takes anything past
``num_splits * chunk``, so ``max_kv_len`` affects speed, never correctness).
Stage 2, grid ``(T, Hq)``: combines the splits with their log-sum-exp (`combine_splits`, the
one combine kernel of decode and extend attention), reading only the splits the row's length
reaches, each block of `COMBINE_SB` splits' partials beside their log-sum-exps. With one split,
stage 1 writes the output directly; with the fused combine (below) stage 1's last program does.

Splits that follow each row's length (long contexts): ``max_kv_len`` is a host bound (the
context limit, fixed when a graph is captured), so a chunk sized from it leaves a short row of a
long-context engine on a few splits (a 4k row of a 128k engine: 8 of 264). Past
`ROW_SPLITS_FROM` (or with ``row_splits=True``) the grid keeps the split count chosen for
``max_kv_len`` (the most any row uses) and each program computes its own row's chunk on the
device from ``kv_lens[t]`` (`row_chunk`: `default_num_splits`' rule for that length, read inside
the graph at every replay); the splits past the row's last exit at once, and the combine reads
the ones that wrote. A row of length ``max_kv_len`` gets the host's own chunk.

Fused form: ``q_index`` ``[T]`` reads row t's query from ``q[q_index[t]]`` (the gather of the
attending rows out of all the step's tokens, instead of an ``index_select`` launch before).

One compiled stage-1 kernel serves every mode of a config: one split or several and the q_index
gather are runtime choices of its prologue / epilogue (`num_splits == 1`, the `gather` flag, not
specialized), never of its KV loop, and its pointers keep one dtype each (the output, the fp32
partials and log-sum-exps, int64 q_index: a `placeholders.placeholder` where a mode reads none).

Second segment (tree drafting's beams, `graphdraft.runtime.beams`): with ``extra_slots`` ``[T, W]``
int64 and ``num_extra`` (host int, ``0 <= num_extra <= W``) row t also attends to the cache
slots ``extra_slots[t, :num_extra]`` (token granular: a beam's ancestors in the draft scratch
region), in the same online softmax: the split holding the row's last prefix position walks
them after its chunk, so the combine is unchanged.

Fused combine (`KernelConfig.decode_fused_combine`, off by default; issue #42: at bs 1 and long
contexts the second launch and its dependency gap are a large share of a layer's attention):
with several splits there is no stage 2. Each stage-1 program that the row reaches
(``split < reached``, ``reached = min(cdiv(kv_len, chunk), num_splits)`` over the row's chunk,
`row_chunk`'s, computed on the device; the programs past it exit early and are never counted;
a row of length 0, outside the contract, gets no output) stores its partials and
log-sum-exps as above, then adds 1 (``sem="acq_rel"``, after a CTA barrier) to the split counter
of its (row t, kv head); the program that reads ``reached - 1`` back is the last: it sets the
counter to 0 again and combines the G query heads of that kv head itself (`combine_row`, the
combine's math written once: the same function `_combine_kernel` calls, so the output equals
the two-launch form's; its loads bypass L1, ``.cg``). With one split nothing changes.
The split counters (`split_counters`): one persistent int32 buffer per device, zeros, at least
``T * Hkv`` entries (counter of (t, kvh) at ``t * Hkv + kvh``), kept in `_COUNTERS` (device ->
buffer; a larger need makes a larger buffer and keeps the old one alive, since a captured graph
holds its address). Contract: every counter is 0 between calls (each launch leaves what it
found), so a CUDA graph replays with no reset of its own; two launches that may run at the same
time on one device (different streams) must not both be fused (they would share counters: the
runtime's attention runs on one stream). A buffer is never made while a graph is being
captured (its zeros would only be written at replay): the first fused call on a device, and
any larger one, must run eagerly first, as an engine's first launches do (else RuntimeError).
`FUSE` is a constexpr, not a runtime flag like `gather`: registers are allocated for a kernel's
whole body, so a runtime branch would put the combine's ``[SB, D_PAD]`` fp32 tile into the
unfused kernel too; the flag is one config's for all its launches, so a config still compiles
one stage-1 variant for every mode (two configs: two).

Settings (`kernels.config.KernelConfig`, `kernels=`; None: the default config): `decode_block_n`
(BLOCK_N, 64), `decode_fused_combine` and the PDL switches (`kernels.pdl`). The torch reference
(`paged_decode_attention_ref`, over `paged_attention_torch`) is the op's torch path
(`graphdraft.ops.paged_attention`): fixed shapes, no host sync, capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import INDEX_DTYPES, expect_tensor
from graphdraft.kernels.argmax import num_sms
from graphdraft.kernels.cache_loc import kv_slots
from graphdraft.kernels.config import KernelConfig, resolve
from graphdraft.kernels.pdl import interpreting, launch_options, pdl_enter
from graphdraft.kernels.placeholders import placeholder

__all__ = ["paged_decode_attention", "paged_decode_attention_ref", "paged_attention_torch",
           "default_num_splits", "row_split_fill", "row_chunk_host", "split_counters",
           "ROW_SPLITS_FROM"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REF_DTYPES = (*_DTYPES, torch.float64)
"""The torch references also take float64 (the torch path of float64 models)."""
_LOG2E = 1.4426950408889634
# Fixed launch parameters (BLOCK_N is `KernelConfig.decode_block_n`).
MAX_CHUNK = 256  # preferred upper bound on positions per split (see default_num_splits)
NUM_WARPS = 4
NUM_STAGES = 3
ROW_SPLITS_FROM = 8192
"""Largest `max_kv_len` that keeps one host-chosen chunk for every row; above it each row's chunk
follows its own length (`row_chunk`). Contexts up to 8192 (the default `max_context_len` 4096,
the verify study's kv 4096 + 64) launch exactly as before."""
ROW_MAX_CHUNK = tl.constexpr(MAX_CHUNK)
"""`MAX_CHUNK` as the kernels read it (`row_chunk`'s max_chunk in decode attention)."""
COMBINE_SB = 64
"""Splits the combine kernel (decode's and extend's) reads per block: one value for every split
count (a per-count power of two compiled a variant per batch size; at fewer splits the extra
lanes are masked loads in a kernel that reads `splits * D` floats per (row, head)). 64, not 16:
a block costs one memory round trip and a program walks its blocks one after the other, so a
bs-1 row of a 128k context (256 active splits, the 32 programs of its heads) took 16 round
trips a layer at 16 (perf/RESULTS.md 2026-12-06f: the bs-1 attention rows)."""


@triton.jit
def attend_block(q, k, v, valid, m_i, l_i, acc, scale_log2, DOT_FP32: tl.constexpr,
                 MASKED: tl.constexpr, SAFE: tl.constexpr):
    """One KV block of an online softmax: scores `q @ k^T` scaled (positions where `valid` is
    False -> -inf when MASKED), then the running max `m_i`, sum `l_i` and output `acc`
    updated with the block's `p @ v`. SAFE: a row that has seen nothing yet (max -inf) keeps
    finite weights. Shared by the decode and extend kernels (inlined by Triton)."""
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        s = tl.where(valid, s * scale_log2, float("-inf"))
    else:
        s = s * scale_log2
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if SAFE:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def row_chunk(kv_len, chunk, num_splits, row_fill, max_chunk, block):
    """KV positions per split for a row of `kv_len` positions: `chunk` (the host's, sized for
    max_kv_len) when `row_fill` is 0; else the host rule evaluated on the device for this row's
    own length (`row_chunk_host`): splits = min(max(row_fill, cdiv(kv_len, max_chunk)),
    num_splits, cdiv(kv_len, block)), at least 1, chunk = roundup(cdiv(kv_len, splits), block).
    Shared by the decode split kernel, the combine and the extend kernel (`max_chunk` and
    `block` constexprs there, runtime ints in the combine, which serves both)."""
    if row_fill > 0:
        n = tl.maximum(kv_len, 1)
        want = tl.maximum(row_fill, tl.cdiv(n, max_chunk))
        s = tl.maximum(tl.minimum(tl.minimum(want, num_splits), tl.cdiv(n, block)), 1)
        chunk = tl.cdiv(tl.cdiv(n, s), block) * block
    return chunk


@triton.jit
def combine_row(part_ptr, lse_ptr, row, active, per_row, D: tl.constexpr, D_PAD: tl.constexpr,
                SB: tl.constexpr, CACHE: tl.constexpr):
    """The log-sum-exp weighted sum of one (row, head)'s split partials, fp32 ``[D_PAD]``: the
    combine math, written once (`_combine_kernel`'s program and the fused epilogue of
    `_decode_split_kernel` call it). Splits ``[0, active)`` of the partials at
    ``part_ptr + (row + s) * D`` and log-sum-exps (log2 domain) at ``lse_ptr + row + s``, in
    blocks of SB with an online rescale (max-subtracted weights); a split whose log-sum-exp is
    -inf weighs 0 whatever its partial holds, and with `per_row` 0 (every split of a ragged
    extend) its partial is not even loaded. `CACHE`: the loads' cache modifier ("" or ".cg",
    L2 only: the fused epilogue reads partials other programs of the same launch wrote)."""
    d = tl.arange(0, D_PAD)
    dmask = d < D
    denom = tl.sum(tl.zeros([SB], tl.float32), axis=0)  # fp32 scalars (typed loop carries)
    m = denom + float("-inf")
    acc = tl.zeros([D_PAD], tl.float32)
    for s0 in range(0, active, SB):  # online rescale over blocks of SB splits
        sp = s0 + tl.arange(0, SB)
        smask = sp < active
        lse = tl.load(lse_ptr + row + sp, mask=smask, other=float("-inf"), cache_modifier=CACHE)
        live = lse > float("-inf")
        pmask = smask
        if per_row == 0:  # every split of a ragged extend: load only those that wrote
            pmask = smask & live
        part = tl.load(part_ptr + (row + sp)[:, None] * D + d[None, :],
                       mask=pmask[:, None] & dmask[None, :], other=0.0, cache_modifier=CACHE)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every split so far empty
        alpha = tl.exp2(m - m_safe)
        w = tl.where(live, tl.exp2(lse - m_safe), 0.0)
        part = tl.where(live[:, None], part, 0.0)  # an unwritten partial may hold NaN
        acc = acc * alpha + tl.sum(part * w[:, None], axis=0)
        denom = denom * alpha + tl.sum(w, axis=0)
        m = m_new
    return acc / denom


# The split count follows the rows (about 2 programs per SM): not specialized (1 / % 16 would
# compile per batch size). One split or several is decided at run time, in the epilogue; the
# partials' rows are strided by the count, so no vector access depends on its divisibility.
# `gather` (1: q_index, 0: none) is not specialized either: one kernel for both.
@triton.jit(do_not_specialize=["pdl_trigger", "num_splits", "gather", "row_fill"])
def _decode_split_kernel(
    q_ptr, sq_t, sq_h, q_index_ptr, gather,
    k_ptr, sk_s, sk_h,
    v_ptr, sv_s, sv_h,
    req_ptr, lens_ptr, page_ptr, s_page_r, s_page_p,
    o_ptr, so_t, so_h,  # final output [T, Hq, D] (written with one split)
    part_ptr, lse_ptr,  # fp32 [T, Hq, S, D], [T, Hq, S] (log2 domain), contiguous: several splits
    scale_log2, chunk, num_splits, row_fill,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, DOT_FP32: tl.constexpr,
    pdl_trigger, PDL: tl.constexpr, EARLY: tl.constexpr,
    extra_ptr, s_extra, num_extra, EXTRA: tl.constexpr, XB: tl.constexpr,
    cnt_ptr, FUSE: tl.constexpr, SB: tl.constexpr,
):
    """FUSE (several splits): the fused combine (module doc): `cnt_ptr` the split counters
    ``[>= T * Hkv]`` int32, zero on entry and on exit; SB the combine's block (`COMBINE_SB`).
    EARLY (with PDL): the row's length, request, query row and first block's page ids are
    loaded before waiting for the kernel before (pdl module doc); q and KV after; a program
    whose split the row does not reach exits before waiting. Splits are dispatched last
    first (program 0 takes split num_splits - 1): a short row of a long bound's grid (a 4k row
    of a 128k engine at bs 1: 1,848 of 2,112 programs) has its empty programs come and go
    while the kernel before runs, not after its own work. `row_fill` > 0: the row's own chunk
    (`row_chunk`, max chunk `MAX_CHUNK`)."""
    if not EARLY:
        pdl_enter(PDL, pdl_trigger)
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = num_splits - 1 - tl.program_id(2)  # the last first: past a short row, they exit
    kv_len = tl.load(lens_ptr + t).to(tl.int32)
    chunk = row_chunk(kv_len, chunk, num_splits, row_fill, ROW_MAX_CHUNK, BLOCK)
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)
    if split == num_splits - 1:
        end = kv_len
    req = tl.load(req_ptr + t).to(tl.int64)
    page_row = page_ptr + req * s_page_r
    q_row = t.to(tl.int64)
    if gather:
        q_row = tl.load(q_index_ptr + t).to(tl.int64)
    n = tl.arange(0, BLOCK)
    if EARLY:  # the first block's page ids (the loop's own loads stay index-only: pipelined)
        if start >= kv_len:  # nothing of this row here (the combine ignores this split): exit
            return  # without waiting, while the kernel before still runs
        first_page = tl.load(page_row + ((start + n) // PAGE_SIZE).to(tl.int64) * s_page_p,
                             mask=start + n < end, other=0)
        pdl_enter(PDL, pdl_trigger)
    if start >= kv_len:  # nothing of this row here; the combine ignores this split
        return

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < G
    dmask = d < D
    heads = (kvh * G + g).to(tl.int64)
    q = tl.load(
        q_ptr + q_row * sq_t + heads[:, None] * sq_h + d[None, :],
        mask=gmask[:, None] & dmask[None, :], other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = k_ptr + kvh.to(tl.int64) * sk_h
    v_base = v_ptr + kvh.to(tl.int64) * sv_h

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for off in range(start, end, BLOCK):
        pos = off + n
        pmask = pos < end
        if EARLY:  # the first block (pos < start + BLOCK) has its page ids already
            later = pos >= start + BLOCK
            page = tl.load(page_row + (pos // PAGE_SIZE).to(tl.int64) * s_page_p,
                           mask=pmask & later, other=0)
            page = tl.where(later, page, first_page)
        else:
            page = tl.load(page_row + (pos // PAGE_SIZE).to(tl.int64) * s_page_p, mask=pmask,
                           other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + (pos % PAGE_SIZE)
        kvmask = pmask[:, None] & dmask[None, :]
        k = tl.load(k_base + slot[:, None] * sk_s + d[None, :], mask=kvmask, other=0.0)
        v = tl.load(v_base + slot[:, None] * sv_s + d[None, :], mask=kvmask, other=0.0)
        m_i, l_i, acc = attend_block(q, k, v, pmask[None, :], m_i, l_i, acc, scale_log2,
                                     DOT_FP32, True, False)

    if EXTRA:  # the second segment: explicit slots, walked by the split of the last position
        last_split = tl.minimum((kv_len + chunk - 1) // chunk, num_splits) - 1
        if split == last_split:
            xi = tl.arange(0, XB)
            xmask = xi < num_extra
            slot = tl.load(extra_ptr + t.to(tl.int64) * s_extra + xi, mask=xmask, other=0)
            kvmask = xmask[:, None] & dmask[None, :]
            k = tl.load(k_base + slot[:, None] * sk_s + d[None, :], mask=kvmask, other=0.0)
            v = tl.load(v_base + slot[:, None] * sv_s + d[None, :], mask=kvmask, other=0.0)
            m_i, l_i, acc = attend_block(q, k, v, xmask[None, :], m_i, l_i, acc, scale_log2,
                                         DOT_FP32, True, False)

    out = acc / l_i[:, None]
    omask = gmask[:, None] & dmask[None, :]
    if num_splits == 1:
        o = o_ptr + t.to(tl.int64) * so_t + heads[:, None] * so_h + d[None, :]
        tl.store(o, out.to(o_ptr.dtype.element_ty), mask=omask)
    else:
        row = (t.to(tl.int64) * (G * tl.num_programs(1)) + heads) * num_splits + split  # [G_PAD]
        tl.store(part_ptr + row[:, None] * D + d[None, :], out, mask=omask)
        tl.store(lse_ptr + row, m_i + tl.log2(l_i), mask=gmask)
        if FUSE:  # the last of the row's reached splits to get here combines its G heads
            reached = tl.minimum((kv_len + chunk - 1) // chunk, num_splits)
            cnt = cnt_ptr + (t * tl.num_programs(1) + kvh)
            tl.debug_barrier()  # every thread's partials stored before the release below
            done = tl.atomic_add(cnt, 1, sem="acq_rel")
            if done == reached - 1:  # the others' partials are visible after the acquire
                tl.store(cnt, 0)  # zero again for the next call / replay (no one else adds)
                for g2 in tl.static_range(G):
                    head = (kvh * G + g2).to(tl.int64)
                    base = (t.to(tl.int64) * (G * tl.num_programs(1)) + head) * num_splits
                    o = combine_row(part_ptr, lse_ptr, base, reached, 1, D, D_PAD, SB, ".cg")
                    tl.store(o_ptr + t.to(tl.int64) * so_t + head * so_h + d,
                             o.to(o_ptr.dtype.element_ty), mask=dmask)


@triton.jit(do_not_specialize=["pdl_trigger", "num_splits", "per_row", "row_div", "lens_stride",
                               "row_fill", "max_chunk", "block"])  # SB: always COMBINE_SB
def _combine_kernel(
    part_ptr, lse_ptr, lens_ptr, per_row, row_div, lens_stride, o_ptr, so_t, so_h,
    chunk, num_splits, row_fill, max_chunk, block,
    D: tl.constexpr, D_PAD: tl.constexpr, SB: tl.constexpr,
    pdl_trigger, PDL: tl.constexpr, EARLY: tl.constexpr,
):
    """Program (t, h): the log-sum-exp weighted sum of the partial outputs of row t's splits
    for head h, the stage 2 of decode and extend attention alike. `per_row` (decode, extend's
    uniform rows): the splits read are those the length ``lens[(t // row_div) * lens_stride]``
    reaches (`chunk` positions each, or with `row_fill` > 0 that row's own chunk, `row_chunk`
    over `max_chunk` and `block`), the others are not read, and a split's partial is loaded
    beside its log-sum-exp (one memory round trip a block of SB splits; a split that wrote
    -inf, an empty one of extend's, is weighted 0 whatever its unwritten partial holds); else
    (extend's ragged rows; lens unread) every split, a partial only where its log-sum-exp is
    finite. EARLY (with PDL): the row's length is loaded before waiting for the split kernel;
    the partials after."""
    if not EARLY:
        pdl_enter(PDL, pdl_trigger)
    t = tl.program_id(0)
    kv_len = tl.load(lens_ptr + (t // row_div) * lens_stride, mask=per_row != 0,
                     other=0).to(tl.int32)
    if EARLY:
        pdl_enter(PDL, pdl_trigger)
    active = num_splits
    if per_row:
        kv_len = tl.maximum(kv_len, 1)
        chunk = row_chunk(kv_len, chunk, num_splits, row_fill, max_chunk, block)
        active = tl.minimum((kv_len + chunk - 1) // chunk, num_splits)  # the splits that wrote
    t = tl.cast(t, tl.int64)  # int64 offsets
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, D_PAD)
    out = combine_row(part_ptr, lse_ptr, (t * tl.num_programs(1) + h) * num_splits, active,
                      per_row, D, D_PAD, SB, "")
    tl.store(o_ptr + t * so_t + h * so_h + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


def combine_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
                   lens: torch.Tensor | None, chunk: int, kernels: KernelConfig,
                   row_fill: int = 0, *, row_div: int = 1, max_chunk: int = MAX_CHUNK,
                   block: int | None = None) -> None:
    """`_combine_kernel` over `out [T, Hq, D]` from `part [T, Hq, S, D]` / `lse [T, Hq, S]`
    (fp32). `lens`: each row's length (decode: `kv_lens [T]`; extend's uniform rows:
    `seq_lens [R]`, any stride, token t in row ``t // row_div``) with the split `chunk` and
    `row_fill` (> 0: each row's own chunk over `max_chunk` and `block`, None: the config's
    `decode_block_n`, as the split kernel computed it): only the splits the row reaches are
    read; None (extend's ragged rows): every split."""
    T, Hq, splits, D = part.shape
    per_row = lens is not None
    _combine_kernel[(T, Hq)](
        part, lse, lens if per_row else placeholder(out.device, torch.int32), int(per_row),
        max(1, int(row_div)), lens.stride(0) if per_row else 0,
        out, out.stride(0), out.stride(1), chunk, splits, row_fill, int(max_chunk),
        int(block if block is not None else resolve(kernels).decode_block_n),
        D=D, D_PAD=max(16, triton.next_power_of_2(D)), SB=COMBINE_SB, num_warps=4,
        **launch_options(out.device, T, early=True, kernels=kernels),
    )


def default_num_splits(num_rows: int, num_kv_heads: int, max_kv_len: int, device: torch.device,
                       *, kernels: KernelConfig | None = None) -> int:
    """Split count for ``T * Hkv`` (row, kv head) pairs and a ``max_kv_len`` bound.

    1 when ``T * Hkv`` alone reaches 2 programs per SM. Otherwise enough splits for
    2 programs per SM, and more if needed to keep chunks <= ``MAX_CHUNK`` positions
    (a program walks its chunk serially, one memory round trip per block, so
    short chunks matter more than exact fill); at most ~16 programs per SM in
    all, and never more splits than ``kernels.decode_block_n`` blocks in ``max_kv_len``.
    """
    block_n = resolve(kernels).decode_block_n
    programs = max(1, num_rows * num_kv_heads)
    target = 2 * num_sms(device)
    if programs >= target:
        return 1
    max_kv_len = max(1, max_kv_len)
    want = max(triton.cdiv(target, programs), triton.cdiv(max_kv_len, MAX_CHUNK))
    return max(1, min(want, triton.cdiv(8 * target, programs), triton.cdiv(max_kv_len, block_n)))


def row_split_fill(programs: int, splits: int, max_kv_len: int, device: torch.device,
                   row_splits: bool | None = None) -> int:
    """The kernels' `row_fill` for a grid of `splits` splits over `programs` (row, kv head)
    programs: 0 (every row on the host's chunk) with one split, with ``row_splits`` False, or
    (``row_splits`` None) when ``max_kv_len <= ROW_SPLITS_FROM``; else the splits that fill 2
    programs per SM, ``cdiv(2 * SMs, programs)`` (>= 1), from which each row's chunk follows
    its length (`row_chunk`)."""
    if splits <= 1 or row_splits is False or (row_splits is None
                                              and max_kv_len <= ROW_SPLITS_FROM):
        return 0
    return max(1, triton.cdiv(2 * num_sms(device), max(1, programs)))


def row_chunk_host(kv_len: int, chunk: int, splits: int, row_fill: int, max_chunk: int,
                   block: int) -> int:
    """`row_chunk` on the host (the same integers): the chunk a row of `kv_len` positions
    walks."""
    if row_fill <= 0:
        return chunk
    n = max(kv_len, 1)
    s = max(1, min(max(row_fill, triton.cdiv(n, max_chunk)), splits, triton.cdiv(n, block)))
    return triton.cdiv(triton.cdiv(n, s), block) * block


def check_paged_kv(q, k_cache, v_cache, req_to_page, page_size, dtypes=_DTYPES) -> None:
    """ValueError naming the argument unless q `[T, Hq, D]` (one of `dtypes`, unit column
    stride), the paged caches `[num_slots, Hkv, D]` (q's dtype and device, Hkv dividing Hq),
    `req_to_page` `[max_reqs, max_pages]` int32 and `page_size` fit together (decode and extend
    attention)."""
    expect_tensor("q", q, shape=("T", "Hq", "D"), dtypes=dtypes, layout="rows")
    Hq, D = q.shape[1], q.shape[2]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        expect_tensor(name, c, shape=("num_slots", "Hkv", D), dtypes=q.dtype, device=q.device,
                      layout="rows")
    expect_tensor("v_cache", v_cache, shape=tuple(k_cache.shape))  # the shape of k_cache
    if Hq % k_cache.shape[1]:
        raise ValueError(f"k_cache: Hq={Hq} is not a multiple of Hkv={k_cache.shape[1]}")
    expect_tensor("req_to_page", req_to_page, shape=("max_reqs", "max_pages"), dtypes=torch.int32,
                  device=q.device)
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")


def check_out(out, q, rows: int) -> None:
    """`out`, when given: `[rows, Hq, D]` in q's dtype on q's device, unit column stride."""
    if out is not None:
        expect_tensor("out", out, shape=(rows, q.shape[1], q.shape[2]), dtypes=q.dtype,
                      device=q.device, layout="rows")


def _check(q, k_cache, v_cache, req_pool_indices, kv_lens, req_to_page, page_size, out,
           q_index, dtypes=_DTYPES) -> int:
    """Returns T, the number of query rows."""
    check_paged_kv(q, k_cache, v_cache, req_to_page, page_size, dtypes)
    T = q.shape[0]
    if q_index is not None:
        expect_tensor("q_index", q_index, shape=("T",), dtypes=INDEX_DTYPES, device=q.device,
                      layout="contiguous")
        T = q_index.shape[0]
    for name, t in (("req_pool_indices", req_pool_indices), ("kv_lens", kv_lens)):
        expect_tensor(name, t, shape=(T,), dtypes=INDEX_DTYPES, device=q.device, layout="contiguous")
    check_out(out, q, T)
    return T


def _check_extra(extra_slots, num_extra, rows: int, device) -> None:
    """`extra_slots` `[rows, W]` int64 (unit column stride), `0 <= num_extra <= W` (host int)."""
    if isinstance(num_extra, bool) or not isinstance(num_extra, int) or num_extra < 0:
        raise ValueError(f"num_extra: expected an int >= 0, got {num_extra!r}")
    if extra_slots is None:
        if num_extra:
            raise ValueError(f"extra_slots: expected a [T, W] int64 tensor with num_extra="
                             f"{num_extra}, got None")
        return
    expect_tensor("extra_slots", extra_slots, shape=(rows, "W"), dtypes=torch.int64,
                  device=device, layout="rows")
    if num_extra > extra_slots.shape[1]:
        raise ValueError(f"num_extra: expected <= extra_slots' width {extra_slots.shape[1]}, "
                         f"got {num_extra}")


COUNTERS_MIN = 4096
"""Fewest entries of a device's split counters buffer (16 KiB: 512 rows of 8 kv heads; a fused
launch has several splits only below 2 programs per SM unless `num_splits` forces them)."""
_COUNTERS: dict[torch.device, torch.Tensor] = {}
"""device -> its split counters (int32 zeros, module doc "Fused combine")."""
_RETIRED: list[torch.Tensor] = []
"""Smaller buffers a larger need replaced: kept, since a captured graph may hold their address."""


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """The device's split counters, int32 ``[>= n]``, zero between calls (module doc "Fused
    combine"). Made (or replaced by a larger one, ``max(n, 2 * old, COUNTERS_MIN)``) only
    outside CUDA-graph capture: RuntimeError when capturing and the kept one is too small."""
    buf = _COUNTERS.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"decode_fused_combine: the split counters of {device} hold "
            f"{0 if buf is None else buf.numel()} (row, kv head) pairs, this launch needs {n}; "
            "they cannot be made while a CUDA graph is being captured: run this launch once "
            "eagerly before capturing it")
    size = max(n, COUNTERS_MIN, 2 * buf.numel() if buf is not None else 0)
    if buf is not None:
        _RETIRED.append(buf)
    _COUNTERS[device] = buf = torch.zeros(size, dtype=torch.int32, device=device)
    return buf


def fit_splits(splits: int, max_kv_len: int, block_n: int) -> tuple[int, int]:
    """(splits, chunk) for `splits` wanted over `max_kv_len` keys: chunks a multiple of
    `block_n`, no split left empty at the bound."""
    chunk = triton.cdiv(triton.cdiv(max(1, max_kv_len), splits), block_n) * block_n
    return max(1, min(splits, triton.cdiv(max(1, max_kv_len), chunk))), chunk


def _split_plan(T: int, Hkv: int, max_kv_len: int, device: torch.device, kc: KernelConfig,
                num_splits: int | None) -> tuple[int, int]:
    """(splits, chunk) of a decode launch sized for `max_kv_len`: `num_splits` or
    :func:`default_num_splits`, fitted by :func:`fit_splits`."""
    splits = (default_num_splits(T, Hkv, max_kv_len, device, kernels=kc) if num_splits is None
              else max(1, int(num_splits)))
    return fit_splits(splits, max_kv_len, kc.decode_block_n)


def _work_buffers(T: int, Hq: int, Hkv: int, splits: int, D: int, device: torch.device,
                  fuse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(partials fp32 `[T, Hq, splits, D]`, log-sum-exps fp32 `[T, Hq, splits]`, split
    counters int32 `[>= T * Hkv]` (`split_counters`)) of a launch; placeholders where it reads
    none (one split: no partials; not fused: no counters)."""
    if splits == 1:
        part = lse = placeholder(device, torch.float32)
    else:
        part = torch.empty((T, Hq, splits, D), dtype=torch.float32, device=device)
        lse = torch.empty((T, Hq, splits), dtype=torch.float32, device=device)
    counters = (split_counters(device, T * Hkv) if fuse and splits > 1
                else placeholder(device, torch.int32))
    return part, lse, counters


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    req_to_page: torch.Tensor,
    page_size: int,
    sm_scale: float,
    *,
    max_kv_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    q_index: torch.Tensor | None = None,
    extra_slots: torch.Tensor | None = None,
    num_extra: int = 0,
    row_splits: bool | None = None,
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """Decode attention of q ``[T, Hq, D]`` over a paged KV cache; returns ``[T, Hq, D]``.

    k_cache/v_cache ``[num_slots, Hkv, D]`` (q's dtype), req_pool_indices ``[T]``
    int32/int64, kv_lens ``[T]`` int32 (each >= 1), req_to_page
    ``[max_reqs, max_pages]`` int32. ``max_kv_len`` (host int, an upper bound on
    kv_lens such as the context limit) only sizes the splits; ``num_splits``
    overrides :func:`default_num_splits`. All last dims must be contiguous; other
    strides are free. CUDA-graph capturable (with splits it allocates fp32
    work buffers ``[T, Hq, S, D]`` and ``[T, Hq, S]``). With ``q_index`` ``[T]``
    (int32/int64, contiguous) row t's query is ``q[q_index[t]]`` (q is then any
    ``[R, Hq, D]``; index values must lie in ``[0, R)``). ``extra_slots`` ``[T, W]`` int64
    (unit column stride) and ``num_extra``: the second segment (module doc). ``row_splits``:
    each row's chunk from its own length (True), the host's chunk for every row (False), or
    True past `ROW_SPLITS_FROM` (None; module doc). ``kernels``: BLOCK_N, the fused combine
    (one launch with several splits: module doc, "Fused combine") and PDL (None: the default
    config).
    """
    kc = resolve(kernels)
    block_n = kc.decode_block_n
    T = _check(q, k_cache, v_cache, req_pool_indices, kv_lens, req_to_page, page_size, out, q_index)
    _check_extra(extra_slots, num_extra, T, q.device)
    _, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    if out is None:
        out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    splits, chunk = _split_plan(T, Hkv, max_kv_len, q.device, kc, num_splits)
    one = splits == 1
    row_fill = row_split_fill(T * Hkv, splits, max_kv_len, q.device, row_splits)
    d_pad = max(16, triton.next_power_of_2(D))
    fuse = kc.decode_fused_combine  # a constexpr of every launch of this config (module doc)
    part, lse, counters = _work_buffers(T, Hq, Hkv, splits, D, q.device, fuse)
    # Triton's interpreter multiplies bf16 dot operands as raw integers: use fp32 there.
    dot_fp32 = q.dtype == torch.float32 or interpreting()
    extra = extra_slots is not None and num_extra > 0
    rest = dict(launch_options(q.device, T, early=True, kernels=kc))
    pdl, early = rest.pop("PDL"), rest.pop("EARLY")
    _decode_split_kernel[(T, Hkv, splits)](
        q, q.stride(0), q.stride(1),
        placeholder(q.device, torch.int64) if q_index is None else q_index, int(q_index is not None),
        k_cache, k_cache.stride(0), k_cache.stride(1),
        v_cache, v_cache.stride(0), v_cache.stride(1),
        req_pool_indices, kv_lens, req_to_page, req_to_page.stride(0), req_to_page.stride(1),
        out, out.stride(0), out.stride(1),
        part, lse,
        float(sm_scale) * _LOG2E, chunk, splits, row_fill,
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, D_PAD=d_pad,
        PAGE_SIZE=page_size, BLOCK=block_n, DOT_FP32=dot_fp32,
        PDL=pdl, EARLY=early,
        extra_ptr=extra_slots if extra else placeholder(q.device, torch.int64),  # unread without EXTRA
        s_extra=extra_slots.stride(0) if extra else 0, num_extra=int(num_extra), EXTRA=extra,
        XB=max(16, triton.next_power_of_2(extra_slots.shape[1])) if extra else 16,
        cnt_ptr=counters, FUSE=fuse, SB=COMBINE_SB,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, **rest,
    )
    if not one and not fuse:
        combine_splits(part, lse, out, kv_lens, chunk, kc, row_fill)
    return out


REF_CHUNK_ELEMS = 1 << 27
"""Most elements of the K (and of the V) `paged_attention_torch` gathers at once: 512 MiB each
in fp32."""


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          req_pool_indices: torch.Tensor, kv_lens: torch.Tensor,
                          req_to_page: torch.Tensor, page_size: int, sm_scale: float,
                          max_kv_len: int, *, seen: torch.Tensor | None = None,
                          extra_slots: torch.Tensor | None = None,
                          num_extra: int = 0, chunk_elems: int = REF_CHUNK_ELEMS) -> torch.Tensor:
    """The plain torch attention (decode and extend references; fixed shapes, no host sync:
    CUDA-graph capturable): q ``[T, Hq, D]`` -> ``[T, Hq, D]``, row t over positions
    ``[0, kv_lens[t])`` of request ``req_pool_indices[t]`` (gathered up to ``max_kv_len``, an
    upper bound of kv_lens; with ``seen`` ``[T, max_kv_len]`` bool only where it is True), then
    over the cache slots ``extra_slots[t, :num_extra]``. fp32 scores and softmax; a row that
    sees nothing gets zeros. Rows run in chunks whose gathered K (and V) ``[rows, L, Hkv, D]``
    hold at most ``chunk_elems`` elements (default `REF_CHUNK_ELEMS`; a 1,500-token prefill
    chunk at L = 2048 gathered 13 GB of fp32 K at once). No checks (the callers check)."""
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    if t == 0:
        return torch.empty_like(q)
    rows = max(1, chunk_elems // ((max_kv_len + num_extra) * hkv * d))
    if t > rows:  # row chunks: the gathered K and V stay within chunk_elems each
        def part(x: torch.Tensor | None, i: int) -> torch.Tensor | None:
            return None if x is None else x[i:i + rows]

        return torch.cat([paged_attention_torch(
            q[i:i + rows], k_cache, v_cache, req_pool_indices[i:i + rows], kv_lens[i:i + rows],
            req_to_page, page_size, sm_scale, max_kv_len, seen=part(seen, i),
            extra_slots=part(extra_slots, i), num_extra=num_extra, chunk_elems=chunk_elems)
            for i in range(0, t, rows)])
    pos = torch.arange(max_kv_len, device=q.device)
    slots = kv_slots(req_to_page, req_pool_indices.long().unsqueeze(1), pos.unsqueeze(0),
                     page_size)                                       # [T, L]
    valid = pos.unsqueeze(0) < kv_lens.long().unsqueeze(1)            # [T, L]
    if seen is not None:
        valid = valid & seen
    if num_extra:
        slots = torch.cat([slots, extra_slots[:, :num_extra].long()], 1)
        valid = torch.cat([valid, torch.ones(t, num_extra, dtype=torch.bool, device=q.device)], 1)
    k = k_cache[slots].float()                                        # [T, L', Hkv, D]
    v = v_cache[slots].float()
    qg = q.float().view(t, hkv, hq // hkv, d)                         # [T, Hkv, G, D]
    scores = torch.einsum("thgd,tlhd->thgl", qg, k) * sm_scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(valid[:, None, None, :], probs, torch.zeros_like(probs))  # NaN-safe
    v = torch.where(valid[:, :, None, None], v, torch.zeros_like(v))  # garbage past kv_lens stays out
    out = torch.einsum("thgl,tlhd->thgd", probs, v)
    return out.reshape(t, hq, d).to(q.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    req_to_page: torch.Tensor,
    page_size: int,
    sm_scale: float,
    *,
    max_kv_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    q_index: torch.Tensor | None = None,
    extra_slots: torch.Tensor | None = None,
    num_extra: int = 0,
    row_splits: bool | None = None,
) -> torch.Tensor:
    """The op's torch reference (`paged_decode_attention`'s arguments and checks; the torch
    path of `graphdraft.ops.paged_attention`): `paged_attention_torch` of the rows, whose
    kv_lens must not exceed ``max_kv_len`` (the kernel reads past it; this reads up to it).
    It also takes float64. ``num_splits`` and ``row_splits`` are ignored."""
    del num_splits, row_splits
    T = _check(q, k_cache, v_cache, req_pool_indices, kv_lens, req_to_page, page_size, out, q_index,
               REF_DTYPES)
    _check_extra(extra_slots, num_extra, T, q.device)
    if q_index is not None:
        q = q.index_select(0, q_index)
    res = paged_attention_torch(q, k_cache, v_cache, req_pool_indices, kv_lens, req_to_page,
                                page_size, sm_scale, max_kv_len, extra_slots=extra_slots,
                                num_extra=num_extra if extra_slots is not None else 0)
    if out is None:
        return res
    out.copy_(res)
    return out
