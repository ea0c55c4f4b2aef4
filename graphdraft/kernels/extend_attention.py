"""Paged attention for rows of several query tokens (verify, prefill chunks, mixed batches).

A row r holds ``E = extend_lens[r]`` new tokens of request ``req_pool_indices[r]`` whose
sequence is ``L = seq_lens[r]`` long with them (prefix ``P = L - E``). Its tokens are query
rows ``q_starts[r] + j`` (j < E) of ``q [T, Hq, D]``; token j attends to positions
``[0, max(P + j + 1, 1))`` (causal; the clamp keeps padded graph rows, L = 1 < E, on a
defined read), and with ``mask_bits [T]`` int64 it sees new token i (position ``P + i``)
only when bit i of its word is set (tree verification; bits above j are ignored: the causal
limit stays). The cache slot of position p is
``req_to_page[req, p // page_size] * page_size + p % page_size``.

Uniform rows (``uniform_n > 0``, the captured verify forward): every row has E = uniform_n
and ``q_starts[r] = r * uniform_n``; ``extend_lens`` and ``q_starts`` are not read.

Stage 1, grid ``(R, num_q_blocks, Hkv * num_splits)``: a program takes ``BLOCK_T`` tokens of
one row times the ``G = Hq / Hkv`` heads of one kv head (``BLOCK_M = BLOCK_T * G_PAD`` rows
of ``tl.dot``, row m = token ``m // G_PAD``, head ``m % G_PAD``), and walks its KV chunk in
``BLOCK_N`` blocks, each loaded once for all of them (fp32 online softmax). Positions every
token of the block sees run without a mask; the rest (the causal diagonal, the mask bits)
with one. The chunk of split s is ``[s * chunk, (s + 1) * chunk)`` cut at the block's last
token's length (the last split runs to it), ``chunk = roundup(ceil(max_kv_len / splits),
BLOCK_N)``, or past `decode_attention.ROW_SPLITS_FROM` (``row_splits``) the row's own chunk
from its ``seq_lens[r]`` on the device (`decode_attention.row_chunk` with this module's
`MAX_CHUNK`: a 4k row of a 128k-context engine spreads over as many splits as a 4k engine's
would). Programs past a row's end exit (a host bound sizes the grid: no sync).
Stage 2, grid ``(T, Hq)`` (only with several splits): the log-sum-exp combine, decode
attention's kernel (`decode_attention.combine_splits`). Every stage-1 program owning a token
writes its log-sum-exp, an empty split's -inf, and leaves its partial unwritten (a 4k row of a
128k engine's verify at bs 1 would otherwise write 16 MB of zeros a layer). Uniform rows: the
combine reads the splits the row's ``seq_lens`` reaches (token t in row ``t // uniform_n``,
its chunk by `row_chunk` as stage 1 computed it), an empty one weighted 0 (that 4k row read
the log-sum-exps of all 258 splits of a 128k bound, 17 serial blocks, where 33 wrote), and the
stage-1 programs of the splits past it exit at once; ragged rows: every split, a partial only
where its log-sum-exp is finite.

The split count (`extend_launch`, `extend_num_splits`): rows of few tokens (verify rows;
`many_query_rows` False) split to fill 2 programs per SM and to keep chunks within
`MAX_CHUNK` positions (up to ~16 programs per SM): their programs walk KV with a few query rows
each, latency bound. Rows spanning several query blocks of the largest tile (prefill chunks)
split only to fill 2 programs per SM: their query blocks are the parallelism and each KV block
is a whole tile of work. Their fp32 partials ``[T, Hq, splits, D]`` then do not grow with the
context: with P = R * query blocks * Hkv programs below 2 * SMs, splits = cdiv(2 * SMs, P) and
(for T <= R * max_extend) the partials hold fewer than ``4 * SMs * BLOCK_M * D`` floats (a
2k-token chunk at 8 / 2 heads, D 64 took 17 splits, 71 MB, at a 32k bound; now 3, 12.6 MB).

Both stages launch with programmatic dependent launch (`kernels.pdl`), waiting first thing,
as the decode kernel they replace did; over at most `KernelConfig.pdl_max_rows` tokens (verify
at bs 1) they let the next kernel launch at once.
Query blocks are walked longest first (causal prefill: the heavy blocks start first).
Size arguments are not specialized (`do_not_specialize`): one compiled kernel per tile
config (`tile_config`: BLOCK_M 16 / 32 / 64 / 128 from tokens-per-row x G; ragged rows
without mask bits 16 or 128 only; fp32 on a GPU 16 only), dtype,
page size and mask bits or none, whatever the batch size. Uniform or ragged rows and one split
or several are runtime choices of the stage-1 prologue / epilogue (`uniform_n > 0`,
`num_splits == 1`), never of its KV loops, and its pointers keep one dtype each in every mode
(`placeholders.placeholder` where a mode reads none: int32 extend_lens, int64 q_starts and
mask_bits, the fp32 partials), so the captured verify and the prefill chunks of one tile
share one compiled kernel.

Settings (`kernels.config.KernelConfig`, `kernels=`; None: the default config):
`extend_tiles` (the tile of each BLOCK_M case), `extend_num_stages` (16-64-row cases),
`extend_prefill_stages` (the 128-row case) and the PDL switches.
The torch reference (`paged_extend_attention_ref`) is the op's torch path
(`graphdraft.ops.paged_extend_attention`): it expands the rows to per-token metadata and runs
`decode_attention.paged_attention_torch` (fixed shapes, no host sync, capturable).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphdraft.checks import INDEX_DTYPES, expect_tensor
from graphdraft.kernels.argmax import num_sms
from graphdraft.kernels.config import KernelConfig, resolve
from graphdraft.kernels.decode_attention import (
    _DTYPES,
    REF_DTYPES,
    attend_block,
    check_out,
    check_paged_kv,
    combine_splits,
    fit_splits,
    paged_attention_torch,
    row_chunk,
    row_split_fill,
)
from graphdraft.kernels.pdl import interpreting, launch_options, pdl_enter
from graphdraft.kernels.placeholders import placeholder

__all__ = ["FMA_TILE_CASES", "RAGGED_TILE_CASES", "TILE_CASES", "ExtendLaunch", "paged_extend_attention",
           "paged_extend_attention_ref", "extend_launch", "extend_num_splits", "many_query_rows",
           "tile_config"]

_LOG2E = 1.4426950408889634
MAX_MASK_TOKENS = 64
"""mask_bits words are int64: at most 64 new tokens per row with a mask."""
MAX_CHUNK = 512
"""Preferred upper bound on positions per split. 512, not the decode kernel's 256: one
layer's N = 4 verify attention at bs 8, kv 4096 (64 programs) was faster at 8 splits than at
the 16 that 256 asked for (H200, perf/RESULTS.md 2026-12-05e); where programs are few (bs 1)
the programs-per-SM term sets the splits either way."""
ROW_MAX_CHUNK = tl.constexpr(MAX_CHUNK)
"""`MAX_CHUNK` as the kernel reads it (`row_chunk`'s max_chunk)."""
TILE_CASES = (16, 32, 64, 128)
"""The BLOCK_M cases of `tile_config`, in the order of `KernelConfig.extend_tiles`."""
RAGGED_TILE_CASES = (16, 128)
"""The cases ragged rows without mask bits (eager prefill chunks, mixed batches) use: the
smallest (rows of a few tokens, as a verify row's) or the largest. Rows of 5-31 tokens
(G = 4) take the 128-row tile rather than a 32- or 64-row one of their own: their attention
is short either way, and a cold start compiles two fewer tiles that no captured graph
launches (seconds of a worker each: perf/RESULTS.md 2026-12-05 and "Figures moved out of the code")."""
FMA_TILE_CASES = (16,)
"""The case fp32 dots compiled for a GPU use (an fp32 model, exact: no TF32), whatever the rows'
length (with more grouped heads, the smallest case that holds them). Those dots run on the
FMA units with a whole tile's operands and accumulators in registers: compiled for sm_90
(Triton 3.6, `perf.kernel_resources`), the 128-row tile spills at D = 32 (the shipped pair's
prefill) and far more at D = 128, the 32-row tile at D = 128 (at 8 warps: nothing), the 16-row
tile nothing (perf/RESULTS.md 2026-12-05f: the spills and compile seconds). The
prefill then shares the verify's compiled kernel; a tile of more rows (more than 16 grouped
heads) gets at least 4 warps a 16 rows."""


def tile_config(max_extend: int, g_pad: int, *, kernels: KernelConfig | None = None,
                ragged: bool = False, fma: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for rows of at most `max_extend` tokens and `g_pad`
    (power of two) grouped heads: the case BLOCK_M = next_pow2(max_extend * g_pad) within
    [16, 128], whose tile `kernels.extend_tiles` gives (None: the default config); `ragged`
    rows: that case if it is the smallest, else 128 (`RAGGED_TILE_CASES`); `fma` (fp32 dots
    compiled for a GPU): the smallest case, whatever the rows (`FMA_TILE_CASES`). ValueError
    naming `kernels` when that tile's BLOCK_M is below `g_pad` (not one token per program)."""
    bm = min(128, max(16, g_pad, triton.next_power_of_2(max(1, max_extend) * g_pad)))
    if fma:
        bm = max(FMA_TILE_CASES[-1], g_pad)
    elif ragged and bm > max(16, g_pad):
        bm = RAGGED_TILE_CASES[-1]
    tile = resolve(kernels).extend_tiles[TILE_CASES.index(bm)]
    if tile[0] < g_pad:
        raise ValueError(f"kernels: expected extend_tiles' BLOCK_M >= the {g_pad} grouped heads "
                         f"(case {bm}), got {tile}")
    if fma:  # at least 4 warps a 16 rows (FMA_TILE_CASES)
        tile = (tile[0], tile[1], max(tile[2], tile[0] // 4))
    return tile


@triton.jit(do_not_specialize=["pdl_trigger", "seq_stride", "uniform_n", "chunk", "num_splits", "num_q_blocks",
                               "hkv", "row_fill"])
def _extend_split_kernel(
    q_ptr, sq_t, sq_h,
    k_ptr, sk_s, sk_h,
    v_ptr, sv_s, sv_h,
    req_ptr, seq_ptr, seq_stride, ext_ptr, qs_ptr, bits_ptr,
    page_ptr, s_page_r, s_page_p,
    o_ptr, so_t, so_h,  # final output [T, Hq, D] (written with one split)
    part_ptr, lse_ptr,  # fp32 [T, Hq, S, D], [T, Hq, S] (log2 domain), contiguous: several splits
    scale_log2, uniform_n, chunk, num_splits, num_q_blocks, hkv, row_fill,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_BITS: tl.constexpr, DOT_FP32: tl.constexpr, pdl_trigger, PDL: tl.constexpr,
):
    pdl_enter(PDL, pdl_trigger)  # with PDL: wait for the kernel before (few rows: let the next launch)
    BLOCK_T: tl.constexpr = BLOCK_M // G_PAD
    r = tl.program_id(0)
    qb = num_q_blocks - 1 - tl.program_id(1)  # longest blocks first
    kvh = tl.program_id(2) % hkv
    split = tl.program_id(2) // hkv
    seq_len = tl.load(seq_ptr + r * seq_stride).to(tl.int32)
    chunk = row_chunk(seq_len, chunk, num_splits, row_fill, ROW_MAX_CHUNK, BLOCK_N)
    if uniform_n > 0:  # uniform rows: extend_lens / q_starts unread
        ext = uniform_n
        q_start = r.to(tl.int64) * uniform_n
    else:
        ext = tl.load(ext_ptr + r).to(tl.int32)
        q_start = tl.load(qs_ptr + r).to(tl.int64)
    j0 = qb * BLOCK_T
    if j0 >= ext:  # past this row's end
        return
    if (uniform_n > 0) & (split * chunk >= tl.maximum(seq_len, 1)):  # the combine reads no
        return  # split past a uniform row's length (module doc)
    prefix = seq_len - ext
    j_last = tl.minimum(j0 + BLOCK_T, ext) - 1
    block_end = tl.maximum(prefix + j_last + 1, 1)  # the block's longest token's length
    start = split * chunk
    end = tl.minimum(start + chunk, block_end)
    if split == num_splits - 1:
        end = block_end

    m = tl.arange(0, BLOCK_M)
    tok = j0 + m // G_PAD  # [BLOCK_M] token index in the row
    g = m % G_PAD
    d = tl.arange(0, D_PAD)
    dmask = d < D
    rmask = (tok < ext) & (g < G)
    heads = (kvh * G + g).to(tl.int64)
    tok_row = q_start + tok.to(tl.int64)
    tok_len = tl.maximum(prefix + tok + 1, 1)  # [BLOCK_M] positions each row sees
    if MASK_BITS:
        bits = tl.load(bits_ptr + tok_row, mask=tok < ext, other=0)
        # positions below `full` need no mask: every token sees them
        full = tl.minimum(tl.maximum(prefix, 0), end)
    else:
        bits = tok_row  # unused
        full = tl.minimum(tl.maximum(prefix + j0 + 1, 1), end)
    full = tl.maximum(start + ((full - start) // BLOCK_N) * BLOCK_N, start)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    if start < end:
        q = tl.load(q_ptr + tok_row[:, None] * sq_t + heads[:, None] * sq_h + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        k_base = k_ptr + kvh.to(tl.int64) * sk_h
        v_base = v_ptr + kvh.to(tl.int64) * sv_h
        page_row = page_ptr + tl.load(req_ptr + r).to(tl.int64) * s_page_r
        n = tl.arange(0, BLOCK_N)
        # 1) blocks every token sees whole: no mask
        for off in range(start, full, BLOCK_N):
            pos = off + n
            page = tl.load(page_row + (pos // PAGE_SIZE).to(tl.int64) * s_page_p)
            slot = page.to(tl.int64) * PAGE_SIZE + (pos % PAGE_SIZE)
            k = tl.load(k_base + slot[:, None] * sk_s + d[None, :], mask=dmask[None, :], other=0.0)
            v = tl.load(v_base + slot[:, None] * sv_s + d[None, :], mask=dmask[None, :], other=0.0)
            m_i, l_i, acc = attend_block(q, k, v, 0, m_i, l_i, acc, scale_log2, DOT_FP32,
                                         False, False)
        # 2) the rest: causal limit per token, mask bits over the row's new tokens
        for off in range(full, end, BLOCK_N):
            pos = off + n
            pmask = pos < end
            page = tl.load(page_row + (pos // PAGE_SIZE).to(tl.int64) * s_page_p, mask=pmask,
                           other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + (pos % PAGE_SIZE)
            kvmask = pmask[:, None] & dmask[None, :]
            k = tl.load(k_base + slot[:, None] * sk_s + d[None, :], mask=kvmask, other=0.0)
            v = tl.load(v_base + slot[:, None] * sv_s + d[None, :], mask=kvmask, other=0.0)
            seen = pos[None, :] < tok_len[:, None]
            if MASK_BITS:
                i = pos[None, :] - prefix  # new-token index of the position
                bit = (bits[:, None] >> tl.minimum(tl.maximum(i, 0), 63).to(tl.int64)) & 1
                seen = seen & ((i < 0) | (bit != 0))
            # SAFE: a token row with nothing seen yet keeps finite weights
            m_i, l_i, acc = attend_block(q, k, v, seen, m_i, l_i, acc, scale_log2, DOT_FP32,
                                         True, True)

    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    omask = rmask[:, None] & dmask[None, :]
    # + 0 from a value of the loop (l_i >= 0): the two epilogues' addresses are computed here,
    # not hoisted before the KV loops and kept live through them (Triton 3.6, sm_90, BLOCK_M 32:
    # 186 -> 149 registers, `perf.kernel_resources`)
    tok_row = tok_row + (l_i < 0).to(tl.int64)
    if num_splits == 1:
        o = o_ptr + tok_row[:, None] * so_t + heads[:, None] * so_h + d[None, :]
        tl.store(o, out.to(o_ptr.dtype.element_ty), mask=omask)
    else:
        row = (tok_row * (G * hkv) + heads) * num_splits + split  # [BLOCK_M]
        tl.store(part_ptr + row[:, None] * D + d[None, :], out, mask=omask & nonempty[:, None])
        tl.store(lse_ptr + row, tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)),
                                         float("-inf")), mask=rmask)


def extend_num_splits(programs: int, max_kv_len: int, block_n: int, device: torch.device, *,
                      many_queries: bool = False) -> int:
    """Splits for `programs` (row, query block, kv head) programs: 1 once they reach 2 per SM;
    otherwise enough for 2 per SM and chunks of <= MAX_CHUNK positions, at most ~16 programs
    per SM, never more than the BLOCK_N blocks of `max_kv_len`. `many_queries` (rows of
    several query blocks of the largest tile, `many_query_rows`: prefill chunks): only the 2
    per SM, whatever `max_kv_len` (the partials' bound, module doc)."""
    programs = max(1, programs)
    target = 2 * num_sms(device)
    if programs >= target:
        return 1
    max_kv_len = max(1, max_kv_len)
    blocks = triton.cdiv(max_kv_len, block_n)
    if many_queries:
        return max(1, min(triton.cdiv(target, programs), blocks))
    want = max(triton.cdiv(target, programs), triton.cdiv(max_kv_len, MAX_CHUNK))
    return max(1, min(want, triton.cdiv(8 * target, programs), blocks))


def many_query_rows(max_extend: int, g_pad: int) -> bool:
    """Whether rows of up to `max_extend` tokens (times `g_pad` grouped heads) span several
    query blocks of the largest tile (`TILE_CASES`, 128 rows): prefill chunks; verify rows
    (chain or tree) only past 128 / g_pad tokens (32 at 4 grouped heads)."""
    return max_extend * g_pad > TILE_CASES[-1]


def _check(q, k_cache, v_cache, req_pool_indices, seq_lens, extend_lens, q_starts, req_to_page,
           page_size, max_extend, uniform_n, mask_bits, out, dtypes=_DTYPES) -> int:
    """Returns R, the number of rows. ValueError naming the argument; nothing is written."""
    check_paged_kv(q, k_cache, v_cache, req_to_page, page_size, dtypes)
    T = q.shape[0]
    expect_tensor("req_pool_indices", req_pool_indices, shape=("R",), dtypes=INDEX_DTYPES,
                  device=q.device, layout="contiguous")
    R = req_pool_indices.shape[0]
    expect_tensor("seq_lens", seq_lens, shape=(R,), dtypes=INDEX_DTYPES, device=q.device)
    if not isinstance(uniform_n, int) or uniform_n < 0:
        raise ValueError(f"uniform_n: expected an int >= 0, got {uniform_n!r}")
    if uniform_n:
        if R * uniform_n != T:
            raise ValueError(f"uniform_n: expected R * uniform_n == T ({R} * {uniform_n} != {T})")
        max_extend = uniform_n
    else:
        for name, x in (("extend_lens", extend_lens), ("q_starts", q_starts)):
            # required (None rejected): rows of different lengths need it
            expect_tensor(name, x, shape=(R,), dtypes=INDEX_DTYPES, device=q.device,
                          layout="contiguous")
    if not isinstance(max_extend, int) or max_extend < 1:
        raise ValueError(f"max_extend: expected a positive int (an upper bound of extend_lens), "
                         f"got {max_extend!r}")
    if mask_bits is not None:
        expect_tensor("mask_bits", mask_bits, shape=(T,), dtypes=torch.int64, device=q.device,
                      layout="contiguous")
        if max_extend > MAX_MASK_TOKENS:
            raise ValueError(f"max_extend: at most {MAX_MASK_TOKENS} tokens per row with "
                             f"mask_bits, got {max_extend}")
    check_out(out, q, T)
    return R


class ExtendLaunch(NamedTuple):
    """`paged_extend_attention`'s launch (`extend_launch`): the tile (BLOCK_M, BLOCK_N,
    num_warps), query blocks a row, KV splits, KV positions a split, and `row_fill`
    (`decode_attention.row_split_fill`)."""

    block_m: int
    block_n: int
    warps: int
    query_blocks: int
    splits: int
    chunk: int
    row_fill: int

    def partials_shape(self, tokens: int, q_heads: int, head_dim: int) -> tuple[int, ...] | None:
        """The fp32 partials ``[T, Hq, splits, D]`` the launch allocates (None: one split,
        none; the log-sum-exps ``[T, Hq, splits]`` beside them)."""
        return None if self.splits == 1 else (tokens, q_heads, self.splits, head_dim)

    def partials(self, tokens: int, q_heads: int, head_dim: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 partials and log-sum-exps the kernel writes (`partials_shape`; one split:
        a placeholder for both, unread)."""
        shape = self.partials_shape(tokens, q_heads, head_dim)
        if shape is None:
            return placeholder(device, torch.float32), placeholder(device, torch.float32)
        return (torch.empty(shape, dtype=torch.float32, device=device),
                torch.empty(shape[:3], dtype=torch.float32, device=device))


def extend_launch(R: int, Hkv: int, g_pad: int, max_extend: int, max_kv_len: int, *,
                  ragged: bool, dot_fp32: bool, num_splits: int | None, device: torch.device,
                  kernels: KernelConfig | None = None, row_splits: bool | None = None
                  ) -> ExtendLaunch:
    """The launch of `R` rows of at most `max_extend` tokens over `Hkv` kv heads of `g_pad`
    grouped heads (padded) and a `max_kv_len` bound: the tile (`tile_config`; ragged rows
    without mask bits, prefill chunks: the 16- or 128-row tile only; fp32 dots compiled for a
    GPU: the 16-row tile, FMA_TILE_CASES), `num_splits` or `extend_num_splits` (the SM term
    only for `many_query_rows`), fitted by `fit_splits`. Pure host arithmetic."""
    kc = resolve(kernels)
    block_m, block_n, warps = tile_config(max_extend, g_pad, kernels=kc, ragged=ragged,
                                          fma=dot_fp32 and not interpreting())
    n_qb = triton.cdiv(max_extend, block_m // g_pad)
    splits = (extend_num_splits(R * n_qb * Hkv, max_kv_len, block_n, device,
                                many_queries=many_query_rows(max_extend, g_pad))
              if num_splits is None else max(1, int(num_splits)))
    splits, chunk = fit_splits(splits, max_kv_len, block_n)
    row_fill = row_split_fill(R * n_qb * Hkv, splits, max_kv_len, device, row_splits)
    return ExtendLaunch(block_m, block_n, warps, n_qb, splits, chunk, row_fill)


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor | None,
    q_starts: torch.Tensor | None,
    req_to_page: torch.Tensor,
    page_size: int,
    sm_scale: float,
    *,
    max_kv_len: int,
    max_extend: int = 0,
    uniform_n: int = 0,
    mask_bits: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    row_splits: bool | None = None,
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """Attention of the rows' tokens q ``[T, Hq, D]`` over a paged KV cache -> ``[T, Hq, D]``.

    req_pool_indices / seq_lens / extend_lens / q_starts ``[R]`` int32/int64 (seq_lens may be
    strided); with ``uniform_n > 0`` every row has that many tokens at ``r * uniform_n`` (then
    extend_lens / q_starts may be None and ``R * uniform_n == T``). ``max_extend`` (host int)
    bounds extend_lens (sizes the grid and picks the tile); ``max_kv_len`` bounds seq_lens
    (sizes the splits). ``mask_bits`` ``[T]`` int64: module doc. Rows must cover the tokens
    they name; query rows of q no row names are left as they are in ``out`` with one split
    (with several, the combine writes every query row: garbage where no row names it).
    CUDA-graph capturable (with splits it allocates fp32 work buffers). ``row_splits``: each
    row's chunk from its own seq_len (True), the host's for every row (False), or True past
    `decode_attention.ROW_SPLITS_FROM` (None). ``kernels``: tiles, stages and PDL (None: the
    default config).
    """
    kc = resolve(kernels)
    R = _check(q, k_cache, v_cache, req_pool_indices, seq_lens, extend_lens, q_starts,
               req_to_page, page_size, max_extend, uniform_n, mask_bits, out)
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    if out is None:
        out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if T == 0 or R == 0:
        return out
    max_extend = uniform_n or max_extend
    g_pad = triton.next_power_of_2(G)
    dot_fp32 = q.dtype == torch.float32 or interpreting()
    launch = extend_launch(R, Hkv, g_pad, max_extend, max_kv_len,
                           ragged=not uniform_n and mask_bits is None, dot_fp32=dot_fp32,
                           num_splits=num_splits, device=q.device, kernels=kc,
                           row_splits=row_splits)
    block_m, block_n, warps, n_qb, splits, chunk, row_fill = launch
    one = splits == 1
    d_pad = max(16, triton.next_power_of_2(D))
    part, lse = launch.partials(T, Hq, D, q.device)
    # unread tensors: dummies of the dtypes the runtime's ragged rows pass (one compiled kernel)
    ext = extend_lens if extend_lens is not None else placeholder(q.device, torch.int32)
    qs = q_starts if q_starts is not None else placeholder(q.device, torch.int64)
    _extend_split_kernel[(R, n_qb, Hkv * splits)](
        q, q.stride(0), q.stride(1),
        k_cache, k_cache.stride(0), k_cache.stride(1),
        v_cache, v_cache.stride(0), v_cache.stride(1),
        req_pool_indices, seq_lens, seq_lens.stride(0), ext, qs,
        mask_bits if mask_bits is not None else placeholder(q.device, torch.int64),
        req_to_page, req_to_page.stride(0), req_to_page.stride(1),
        out, out.stride(0), out.stride(1),
        part, lse,
        float(sm_scale) * _LOG2E, uniform_n, chunk, splits, n_qb, Hkv, row_fill,
        G=G, G_PAD=g_pad, D=D, D_PAD=d_pad, PAGE_SIZE=page_size, BLOCK_M=block_m,
        BLOCK_N=block_n, MASK_BITS=mask_bits is not None,
        DOT_FP32=dot_fp32, num_warps=warps,
        num_stages=kc.extend_prefill_stages if block_m == 128 else kc.extend_num_stages,
        **launch_options(q.device, T, kernels=kc),
    )
    if not one:  # uniform rows: the splits each row's length reaches; ragged: every split
        combine_splits(part, lse, out, seq_lens if uniform_n else None, chunk, kc, row_fill,
                       row_div=uniform_n or 1, max_chunk=MAX_CHUNK, block=block_n)
    return out


def paged_extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor | None,
    q_starts: torch.Tensor | None,
    req_to_page: torch.Tensor,
    page_size: int,
    sm_scale: float,
    *,
    max_kv_len: int,
    max_extend: int = 0,
    uniform_n: int = 0,
    mask_bits: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    row_splits: bool | None = None,
) -> torch.Tensor:
    """The op's torch reference (`paged_extend_attention`'s arguments and checks; the torch
    path of `graphdraft.ops.paged_extend_attention`): each token's row, index j in it and
    prefix P found on the device (fixed shapes, no host sync), then
    `decode_attention.paged_attention_torch` per token over its ``max(P + j + 1, 1)``
    positions (and the mask bits), which must not exceed ``max_kv_len``. Query rows no row
    names keep ``out``'s values (zeros without ``out``). It also takes float64. ``num_splits``
    and ``row_splits`` are ignored."""
    del num_splits, row_splits
    R = _check(q, k_cache, v_cache, req_pool_indices, seq_lens, extend_lens, q_starts,
               req_to_page, page_size, max_extend, uniform_n, mask_bits, out, REF_DTYPES)
    T, dev = q.shape[0], q.device
    if T == 0 or R == 0:
        return out if out is not None else torch.zeros_like(q)
    if uniform_n:
        tok = torch.arange(T, device=dev)
        row, j, covered = tok // uniform_n, tok % uniform_n, None
        ext = torch.full((R,), uniform_n, dtype=torch.int64, device=dev)
    else:
        ext = extend_lens.long()
        # token -> row: row r names q rows q_starts[r] + j, j < extend_lens[r] (the rest: T, dropped)
        jj = torch.arange(max_extend, device=dev)
        dest = q_starts.long()[:, None] + jj                                 # [R, max_extend]
        dest = torch.where((jj < ext[:, None]) & (dest >= 0) & (dest < T), dest, T)
        owner = torch.full((T + 1,), -1, dtype=torch.int64, device=dev)
        owner.scatter_(0, dest.reshape(-1), torch.arange(R, device=dev).repeat_interleave(max_extend))
        covered = owner[:T] >= 0
        row = owner[:T].clamp(min=0)
        j = torch.arange(T, device=dev) - q_starts.long()[row]
    prefix = seq_lens.long()[row] - ext[row]
    kv_lens = torch.clamp(prefix + j + 1, min=1)
    seen = None
    if mask_bits is not None:
        i = torch.arange(max_kv_len, device=dev)[None, :] - prefix[:, None]  # [T, L]
        seen = (i < 0) | (((mask_bits[:, None] >> i.clamp(0, 63)) & 1) != 0)
    res = paged_attention_torch(q, k_cache, v_cache, req_pool_indices[row], kv_lens, req_to_page,
                                page_size, sm_scale, max_kv_len, seen=seen)
    if covered is not None:
        keep = out if out is not None else torch.zeros_like(q)
        res = torch.where(covered[:, None, None], res, keep)
    if out is None:
        return res
    out.copy_(res)
    return out
