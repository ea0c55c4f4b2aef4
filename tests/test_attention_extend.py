"""The multi-token paged attention kernel (`kernels.extend_attention`) against its torch reference.

CPU: Triton's interpreter with small tiles (BLOCK_M 16, BLOCK_N 16) so that a few positions cross
block, page and split edges. GPU (`gpu` marker): realistic sizes with the shipped tiles, and a
captured CUDA graph against the eager call, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphdraft import ops
from graphdraft.kernels.config import TORCH, TRITON, KernelConfig
from graphdraft.kernels.extend_attention import (
    extend_launch,
    extend_num_splits,
    paged_extend_attention,
    paged_extend_attention_ref,
    tile_config,
)
from graphdraft.runtime.kv_cache import kv_slot

HAS_CUDA = torch.cuda.is_available()
TOL = {torch.float32: dict(rtol=1e-5, atol=2e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}
SMALL = TRITON.replace(extend_tiles=((16, 16, 4),) * 4)
"""Every tile case on BLOCK_M 16, BLOCK_N 16 (`KernelConfig.extend_tiles`)."""


def _close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])  # NaN never passes


def _setup(seq_lens, ext_lens, reqs, Hq, Hkv, D, page_size, dtype, device="cpu", max_reqs=5,
           max_len=80, seed=0):
    """Rows (seq_lens, ext_lens, request slots) laid out in order; a cache full of NaN except
    the positions some token may read; shuffled pages (page 0 unused)."""
    g = torch.Generator().manual_seed(seed)
    pages_per_req = math.ceil(max_len / page_size) + 1
    num_pages = max_reqs * pages_per_req + 1
    r2p = (torch.randperm(num_pages - 1, generator=g)[: max_reqs * pages_per_req] + 1)
    r2p = r2p.view(max_reqs, pages_per_req).to(torch.int32)
    kc = torch.full((num_pages * page_size, Hkv, D), float("nan"), dtype=dtype)
    vc = kc.clone()
    need: dict[int, int] = {}
    for r, n, e in zip(reqs, seq_lens, ext_lens, strict=True):
        need[r] = max(need.get(r, 0), max(n, 1 + max(n - e, 0)), 2)
    for r, n in need.items():
        pos = torch.arange(n)
        slots = kv_slot(r2p, r, pos, page_size)
        kc[slots] = torch.randn(n, Hkv, D, generator=g).to(dtype)
        vc[slots] = torch.randn(n, Hkv, D, generator=g).to(dtype)
    T = sum(ext_lens)
    q = torch.randn(T, Hq, D, generator=g).to(dtype)
    ext = torch.tensor(ext_lens, dtype=torch.int32)
    qs = (torch.cumsum(ext, 0) - ext).to(torch.int64)
    t = lambda x, dt: torch.tensor(x, dtype=dt)
    dev = lambda x: x.to(device)
    return (dev(q), dev(kc), dev(vc), dev(t(reqs, torch.int64)), dev(t(seq_lens, torch.int32)),
            dev(ext), dev(qs), dev(r2p))


def _tree_bits(ext_lens, seed):
    """Random ancestor sets: token j sees itself and a random subset of tokens before it."""
    g = torch.Generator().manual_seed(seed)
    words = []
    for e in ext_lens:
        for j in range(e):
            w = 1 << j
            for i in range(j):
                if torch.rand((), generator=g) < 0.5:
                    w |= 1 << i
            words.append(w)
    return torch.tensor(words, dtype=torch.int64)


F32, BF16 = torch.float32, torch.bfloat16
# Every pair of values of (GQA heads, split count, page size, dtype) once at least (an
# orthogonal array L9(3^4), page size and dtype folded to two levels): 9 cases, not the 36 of
# the full product; the property test below draws the other combinations.
RAGGED_CASES = [((2, 2), None, 1, F32), ((2, 2), 1, 16, BF16), ((2, 2), 3, 1, F32),
                ((4, 1), None, 16, F32), ((4, 1), 1, 1, F32), ((4, 1), 3, 1, BF16),
                ((8, 1), None, 1, BF16), ((8, 1), 1, 1, F32), ((8, 1), 3, 16, F32)]


@pytest.mark.parametrize("heads,splits,page_size,dtype", RAGGED_CASES)
def test_ragged_rows(dtype, page_size, heads, splits):
    """Prefill chunks, verify rows and decode rows in one batch; lengths around the 16-position
    blocks and pages, N = 1..16 tokens per row, a prefix-free prefill (P = 0)."""
    Hq, Hkv = heads
    seq = [17, 33, 16, 5, 64]
    ext = [16, 4, 1, 5, 3]
    reqs = [1, 0, 3, 2, 4]
    args = _setup(seq, ext, reqs, Hq, Hkv, 16, page_size, dtype, seed=page_size + Hq)
    kw = dict(max_kv_len=80, max_extend=16, num_splits=splits)
    out = paged_extend_attention(*args, page_size, 0.25, **kw, kernels=SMALL)
    _close(out, paged_extend_attention_ref(*args, page_size, 0.25, **kw), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 4, 7])
def test_uniform_rows_match_ragged(dtype, n):
    """The verify form (uniform_n, no extend_lens / q_starts) gives the ragged form's bits; a
    padded row (seq len 1 < N) reads position 0 (and 1..) of its request, clamped like the
    per-token metadata it replaces."""
    seq = [40, 16 + n, 1]
    args = _setup(seq, [n] * 3, [2, 1, 0], 8, 2, 16, 16, dtype, seed=n)
    q, kc, vc, req, sl, ext, qs, r2p = args
    for splits in (None, 2):
        ragged = paged_extend_attention(*args, 16, 0.25, max_kv_len=64, max_extend=n,
                                        num_splits=splits, kernels=SMALL)
        uniform = paged_extend_attention(q, kc, vc, req, sl, None, None, r2p, 16, 0.25,
                                         max_kv_len=64, uniform_n=n, num_splits=splits,
                                         kernels=SMALL)
        assert torch.equal(ragged, uniform)
    ref = paged_extend_attention_ref(q, kc, vc, req, sl, None, None, r2p, 16, 0.25, max_kv_len=64,
                                     uniform_n=n)
    _close(uniform, ref, dtype)
    torch_path = ops.paged_extend_attention(q, kc, vc, req, sl, None, None, r2p, 16, 0.25, 64,
                                            uniform_n=n)
    _close(torch_path, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_mask_bits(dtype, splits):
    """Tree masks over the row's new tokens; the prefix stays fully visible."""
    seq, ext = [30, 20, 9], [8, 3, 9]
    args = _setup(seq, ext, [1, 2, 3], 8, 2, 16, 1, dtype, seed=7)
    bits = _tree_bits(ext, seed=splits)
    kw = dict(max_kv_len=40, max_extend=9, mask_bits=bits)
    out = paged_extend_attention(*args, 1, 0.25, num_splits=splits, **kw, kernels=SMALL)
    ref = paged_extend_attention_ref(*args, 1, 0.25, **kw)
    _close(out, ref, dtype)
    causal = paged_extend_attention_ref(*args, 1, 0.25, max_kv_len=40, max_extend=9)
    assert not torch.allclose(ref.float(), causal.float())  # the mask changes the result
    _close(ops.paged_extend_attention(*args, 1, 0.25, 40, max_extend=9, mask_bits=bits), ref, dtype)
    full = torch.full_like(bits, -1)  # every bit: the causal result
    _close(paged_extend_attention(*args, 1, 0.25, max_kv_len=40, max_extend=9, mask_bits=full,
                                  kernels=SMALL), causal, dtype)


def test_torch_path_matches_per_token_attention():
    """ops' torch path is the per-token plain attention over the expanded rows (the metadata
    the engine used to build), bit for bit."""
    seq, ext = [21, 7, 12], [5, 7, 1]
    q, kc, vc, req, sl, e, qs, r2p = _setup(seq, ext, [0, 1, 2], 4, 2, 16, 4, torch.float32)
    out = ops.paged_extend_attention(q, kc, vc, req, sl, e, qs, r2p, 4, 0.25, 32, max_extend=7)
    tok_req = torch.repeat_interleave(req, e.long())
    tok_kv = torch.tensor([s - n + j + 1 for s, n in zip(seq, ext, strict=True) for j in range(n)],
                          dtype=torch.int32)
    assert torch.equal(out, ops.paged_attention(q, kc, vc, tok_req, tok_kv, r2p, 4, 0.25, 32))


@pytest.mark.parametrize("extra", [0, 2])
def test_torch_reference_in_row_chunks(extra):
    """`paged_attention_torch` gathers K and V for a bounded number of rows at a time
    (`chunk_elems`): chunks of 1 or 3 rows give the result of all rows at once, with a
    `seen` mask and extra slots."""
    from graphdraft.kernels.decode_attention import paged_attention_torch

    seq, ext = [30, 20, 9], [8, 3, 9]
    q, kc, vc, req, sl, e, qs, r2p = _setup(seq, ext, [1, 2, 3], 8, 2, 16, 1, torch.float32, seed=7)
    g = torch.Generator().manual_seed(extra)
    t, L = q.shape[0], 40
    rows = torch.repeat_interleave(req, e.long())
    kv_lens = torch.repeat_interleave(sl.long() - e.long(), e.long()) + torch.cat(
        [torch.arange(1, n + 1) for n in ext])
    seen = torch.rand(t, L, generator=g) < 0.7
    slots = kv_slot(r2p, rows[:, None], (kv_lens - 1).clamp(min=0)[:, None].expand(t, 2), 1)
    kw = dict(seen=seen, extra_slots=slots, num_extra=extra)
    whole = paged_attention_torch(q, kc, vc, rows, kv_lens, r2p, 1, 0.25, L, **kw)
    assert not whole.isnan().any()
    for n in (1, 3):
        chunked = paged_attention_torch(q, kc, vc, rows, kv_lens, r2p, 1, 0.25, L,
                                        chunk_elems=n * (L + extra) * 2 * 16, **kw)
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


def test_extend_num_splits():
    """Splits: 1 once the programs reach 2 per SM (132 SMs on a CPU: an H200's); else enough
    for 2 per SM and chunks of <= MAX_CHUNK (512) positions, never more than the KV blocks."""
    cpu = torch.device("cpu")
    assert extend_num_splits(512, 4096, 64, cpu) == 1  # bs 64 x 8 kv heads
    assert extend_num_splits(64, 4096, 64, cpu) == 8  # bs 8: the chunk term, 4096 / 512
    assert extend_num_splits(64, 512, 64, cpu) == 5  # the SM term, 264 / 64
    assert extend_num_splits(8, 4096, 64, cpu) == 33  # bs 1
    assert extend_num_splits(8, 100, 64, cpu) == 2  # at most the 2 KV blocks
    # rows of several query blocks (prefill chunks): the SM term only, whatever the bound
    for bound in (4096, 32768, 1 << 17):
        assert extend_num_splits(128, bound, 64, cpu, many_queries=True) == 3  # 264 / 128
    assert extend_num_splits(8, 100, 64, cpu, many_queries=True) == 2
    assert extend_num_splits(512, 1 << 17, 64, cpu, many_queries=True) == 1


def test_prefill_chunk_partials_do_not_grow_with_the_context():
    """The partials of a 2k-token prefill chunk (the GPU memory test's model: 8 query / 2 kv
    heads, D 64, bf16) are the same at a 4k, 32k and 128k bound and below 4 x SMs tiles of
    BLOCK_M x D floats (the chunk term gave 17 splits, 71 MB, at 32k); a verify row keeps its
    chunk term (splits follow the bound)."""
    cpu = torch.device("cpu")
    shapes = set()
    for bound in (4096 + 256, 32768 + 256, 131072 + 256):
        launch = extend_launch(1, 2, 4, 2048, bound, ragged=True, dot_fp32=False,
                               num_splits=None, device=cpu, kernels=TORCH)
        shape = launch.partials_shape(2048, 8, 64)
        assert launch.query_blocks == 64 and launch.row_fill in (0, 3)
        assert math.prod(shape) < 4 * 132 * launch.block_m * 64
        shapes.add(shape)
    assert shapes == {(2048, 8, 3, 64)}  # 12.6 MB of fp32
    verify = [extend_launch(8, 8, 4, 4, bound, ragged=False, dot_fp32=False, num_splits=None,
                            device=cpu, kernels=TORCH).splits for bound in (4096 + 64, 32768 + 64)]
    assert verify == [9, 33]  # bs 8, N = 4: the chunk term, then the ~16 programs per SM cap
    one = extend_launch(1, 8, 4, 8192, 8192, ragged=True, dot_fp32=False, num_splits=None,
                        device=cpu, kernels=TORCH)
    assert one.partials_shape(8192, 32, 128) is None  # the 8B shape's 8k prefill: one split


@pytest.mark.parametrize("row_splits", [False, True])
def test_prefill_chunks_on_the_default_splits(row_splits):
    """Rows of several query blocks (40 and 33 tokens x 4 grouped heads > 128) beside a verify
    row, on the default split count (the SM term: several splits at this size), each row's
    chunk from the bound or from its own length."""
    seq, ext = [70, 45, 20], [40, 33, 4]
    args = _setup(seq, ext, [1, 2, 3], 8, 2, 16, 16, torch.float32, seed=11)
    kw = dict(max_kv_len=80, max_extend=40)
    launch = extend_launch(3, 2, 4, 40, 80, ragged=True, dot_fp32=True, num_splits=None,
                           device=torch.device("cpu"), kernels=SMALL, row_splits=row_splits)
    assert launch.splits > 1 and (launch.row_fill > 0) == row_splits
    out = paged_extend_attention(*args, 16, 0.25, **kw, row_splits=row_splits, kernels=SMALL)
    _close(out, paged_extend_attention_ref(*args, 16, 0.25, **kw), torch.float32)


def test_tile_config():
    assert tile_config(4, 4, kernels=TORCH)[0] == 16  # verify N = 4, G = 4: one 16-row tile per row
    assert tile_config(4, 8, kernels=TORCH)[0] == 32
    assert tile_config(16, 4, kernels=TORCH)[0] == 64
    assert tile_config(8192, 4, kernels=TORCH) == (128, 64, 4)
    assert tile_config(1, 1, kernels=TORCH) == (16, 64, 4)
    # ragged rows (prefill chunks): the smallest case or the largest, never 32 / 64
    assert tile_config(4, 4, kernels=TORCH, ragged=True)[0] == 16
    assert tile_config(5, 4, kernels=TORCH, ragged=True)[0] == 128
    assert tile_config(16, 4, kernels=TORCH, ragged=True)[0] == 128
    assert tile_config(2, 8, kernels=TORCH, ragged=True)[0] == 16
    assert tile_config(4, 8, kernels=TORCH, ragged=True)[0] == 128
    assert tile_config(1, 32, kernels=TORCH, ragged=True)[0] == 32  # 32 heads: the smallest case
    assert tile_config(8192, 4, kernels=TORCH, ragged=True) == (128, 64, 4)
    # fp32 dots on a GPU (FMA units, no spills): the smallest case, uniform or ragged rows
    for n, g in ((1, 1), (4, 4), (16, 4), (8192, 4), (8192, 2), (64, 8)):
        assert tile_config(n, g, kernels=TORCH, fma=True) == (16, 64, 4), (n, g)
        assert tile_config(n, g, kernels=TORCH, fma=True, ragged=True) == (16, 64, 4), (n, g)
    # 32 grouped heads: the smallest case that holds them, 4 warps a 16 rows (no spills)
    assert tile_config(4, 32, kernels=TORCH, fma=True) == (32, 64, 8)
    assert tile_config(1, 32, kernels=TORCH) == (32, 64, 4)  # bf16: as configured


def test_fp32_rows_on_a_gpu_take_the_fma_tile(monkeypatch):
    """`paged_extend_attention` asks for the FMA tile when it compiles fp32 dots for a GPU (not
    under the interpreter, which compiles nothing) and for bf16 never: the launch's BLOCK_M for
    a 40-token prefill chunk and a verify of 16-token rows, G = 4, recorded without running."""
    from graphdraft.kernels import extend_attention as ea

    seen = []
    monkeypatch.setattr(ea, "interpreting", lambda: False)
    monkeypatch.setattr(ea._extend_split_kernel, "run",
                        lambda *a, grid, warmup, **kw: seen.append(kw["BLOCK_M"]), raising=False)
    monkeypatch.setattr(ea, "launch_options", lambda *a, **kw: {})
    for dtype in (torch.float32, torch.bfloat16):
        for ext, uniform in ((40, 0), (16, 16)):
            q = torch.zeros(ext, 32, 128, dtype=dtype)
            kc = vc = torch.zeros(5 * 16, 8, 128, dtype=dtype)
            e = torch.tensor([ext], dtype=torch.int32)
            paged_extend_attention(q, kc, vc, torch.zeros(1, dtype=torch.int64),
                                   torch.tensor([ext + 20], dtype=torch.int32),
                                   None if uniform else e,
                                   None if uniform else torch.zeros(1, dtype=torch.int64),
                                   torch.arange(5, dtype=torch.int32).view(1, 5), 16, 0.1,
                                   max_kv_len=80, max_extend=ext, uniform_n=uniform,
                                   num_splits=1, kernels=TORCH)
    assert seen == [16, 16, 128, 64]


def test_fp32_prefill_tile_compiles_for_sm90_without_spills(tmp_path):
    """The tile an fp32 prefill chunk launches on a GPU (recorded under the GPU's launch
    options, `perf.compile_census.gpu_launch_options`), compiled by Triton for sm_90 on this
    machine (`perf.kernel_resources`' compile phase: no GPU needed): 16 rows, no register
    spills (the 128-row tile it took before spilled 110 KB a thread at D = 128)."""
    from graphdraft.kernels import extend_attention as ea
    from graphdraft.kernels.keys import KeyRecorder
    from perf.compile_census import gpu_launch_options
    from perf.kernel_resources import compile_entries, encode_entry

    ext, g = 300, torch.Generator().manual_seed(0)
    q = torch.randn(ext, 32, 128, generator=g)
    kc = vc = torch.randn(20 * 16, 8, 128, generator=g)
    name = "extend_attention._extend_split_kernel"
    with KeyRecorder({name: ea._extend_split_kernel}, launch=False,
                     keep=lambda j: True) as rec, gpu_launch_options():
        paged_extend_attention(q, kc, vc, torch.zeros(1, dtype=torch.int64),
                               torch.tensor([ext], dtype=torch.int32),
                               torch.tensor([ext], dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int64),
                               torch.randperm(20).add(1).to(torch.int32).view(1, 20), 16, 0.088,
                               max_kv_len=ext, max_extend=ext, num_splits=1)
    (_, _, args, kwargs, _, _), = rec.kept
    assert kwargs["BLOCK_M"] == 16 and kwargs["DOT_FP32"]
    (row,) = compile_entries([encode_entry(name, args, kwargs, ["test"])], tmp_path)
    assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
    assert 8 <= row["registers"] <= 255


def test_tiles_come_from_the_config():
    """`KernelConfig.extend_tiles` (one tile per BLOCK_M case) and `extend_num_stages` replace
    the module globals a benchmark used to patch: the defaults are the shipped tiles, the
    environment variable is read once, a tile too small for the grouped heads is refused."""
    assert KernelConfig().extend_tiles == ((16, 64, 4), (32, 64, 4), (64, 64, 4), (128, 64, 4))
    assert KernelConfig().extend_num_stages == 2
    tuned = KernelConfig.from_env({"GRAPHDRAFT_EXTEND_TILES": "16x32x4,32x64x4,64x64x4,64x128x4",
                                   "GRAPHDRAFT_EXTEND_NUM_STAGES": "4"})
    assert tile_config(8192, 4, kernels=tuned) == (64, 128, 4)
    assert tile_config(4, 4, kernels=tuned) == (16, 32, 4) and tuned.extend_num_stages == 4
    with pytest.raises(ValueError, match="^kernels: "):
        tile_config(1, 32, kernels=SMALL)  # 32 grouped heads: BLOCK_M 16 holds no token
    for bad in ("16x64x4", "16x64x4,32x64x4,64x64x4,128x64x3", "a,b,c,d"):
        with pytest.raises(ValueError, match="^GRAPHDRAFT_EXTEND_TILES: "):
            KernelConfig.from_env({"GRAPHDRAFT_EXTEND_TILES": bad})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_rows_with_gaps(dtype, splits):
    """Rows that do not cover q in order (a gap, rows out of order): the kernel attends the
    named rows as the torch reference does; with one split both leave the other rows as they
    are in `out` (with several the kernel's combine writes every row: its docstring)."""
    seq, ext = [21, 9, 12], [5, 3, 2]
    q, kc, vc, req, sl, e, _, r2p = _setup(seq, ext, [0, 1, 2], 4, 2, 16, 4, dtype, seed=3)
    q = torch.cat([q, torch.randn(5, 4, 16).to(dtype)])        # T = 15: rows at 9, 0 and 5
    qs = torch.tensor([9, 0, 5])
    named = torch.zeros(15, dtype=torch.bool)
    named[[9, 10, 11, 12, 13, 0, 1, 2, 5, 6]] = True
    out = torch.full_like(q, 7.0)
    paged_extend_attention(q, kc, vc, req, sl, e, qs, r2p, 4, 0.25, max_kv_len=32, max_extend=5,
                           out=out, num_splits=splits, kernels=SMALL)
    ref = torch.full_like(q, 7.0)
    paged_extend_attention_ref(q, kc, vc, req, sl, e, qs, r2p, 4, 0.25, max_kv_len=32,
                               max_extend=5, out=ref)
    _close(out[named], ref[named], dtype)
    assert (ref[~named] == 7.0).all() and not (ref[named] == 7.0).any()
    if splits == 1:
        assert (out[~named] == 7.0).all()


def test_bad_input_names_the_argument():
    args = _setup([10, 6], [3, 2], [0, 1], 4, 2, 16, 1, torch.float32)
    q, kc, vc, req, sl, ext, qs, r2p = args
    out = torch.full_like(q, 7.0)
    cases = {
        "q": (q.double(), kc, vc, req, sl, ext, qs, r2p),
        "k_cache": (q, kc[:, :, :8], vc, req, sl, ext, qs, r2p),
        "seq_lens": (q, kc, vc, req, sl[:1], ext, qs, r2p),
        "extend_lens": (q, kc, vc, req, sl, None, qs, r2p),
        "q_starts": (q, kc, vc, req, sl, ext, qs.float(), r2p),
        "req_to_page": (q, kc, vc, req, sl, ext, qs, r2p.long()),
    }
    for name, a in cases.items():
        with pytest.raises(ValueError, match=f"^{name}: "):
            paged_extend_attention(*a, 1, 0.25, max_kv_len=16, max_extend=3, out=out)
    with pytest.raises(ValueError, match="^max_extend: "):
        paged_extend_attention(*args, 1, 0.25, max_kv_len=16, max_extend=0, out=out)
    with pytest.raises(ValueError, match="^uniform_n: "):
        paged_extend_attention(*args, 1, 0.25, max_kv_len=16, uniform_n=3, out=out)  # 2 * 3 != 5
    with pytest.raises(ValueError, match="^mask_bits: "):
        paged_extend_attention(*args, 1, 0.25, max_kv_len=16, max_extend=3,
                               mask_bits=torch.zeros(5, dtype=torch.int32), out=out)
    with pytest.raises(ValueError, match="^max_extend: "):
        paged_extend_attention(*args, 1, 0.25, max_kv_len=16, max_extend=65,
                               mask_bits=torch.zeros(5, dtype=torch.int64), out=out)
    with pytest.raises(ValueError, match="^out: "):
        paged_extend_attention(*args, 1, 0.25, max_kv_len=16, max_extend=3, out=out[:4])
    assert (out == 7.0).all()  # nothing written


@st.composite
def _rows(draw, max_len: int, max_rows: int = 4):
    """Ragged rows for the property tests: per row N = 1..16 new tokens and a prefix drawn
    around the 16-position block (and page) edges, or anywhere below `max_len`; the request
    slots a permutation (a row need not sit at its slot's index)."""
    n_rows = draw(st.integers(1, max_rows))
    ext, seq = [], []
    for _ in range(n_rows):
        n = draw(st.integers(1, 16))
        edge = draw(st.sampled_from([0, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64]))
        prefix = draw(st.one_of(st.just(edge), st.integers(0, max_len - 16)))
        prefix = min(prefix, max_len - n)
        ext.append(n)
        seq.append(prefix + n)
    reqs = draw(st.permutations(range(n_rows)))
    return seq, ext, list(reqs)


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=_rows(max_len=80), page_size=st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
       heads=st.sampled_from([(2, 2), (4, 1), (8, 1), (8, 2)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       splits=st.sampled_from([None, 1, 2, 3, 5]), masked=st.booleans(),
       seed=st.integers(0, 2**16))
def test_property_rows_against_reference(rows, page_size, heads, dtype, splits, masked, seed):
    """Any page size, GQA ratio 1 / 4 / 8, N = 1..16 tokens a row, prefixes at and around the
    block / page / split edges, any split count, with or without tree mask bits: the kernel
    equals the torch reference (the interpreter's small tiles: BLOCK_M 16, BLOCK_N 16)."""
    seq, ext, reqs = rows
    (Hq, Hkv) = heads
    args = _setup(seq, ext, reqs, Hq, Hkv, 16, page_size, dtype, max_reqs=len(reqs), seed=seed)
    kw = dict(max_kv_len=80, max_extend=max(ext), num_splits=splits,
              mask_bits=_tree_bits(ext, seed) if masked else None)
    out = paged_extend_attention(*args, page_size, 0.25, **kw, kernels=SMALL)
    _close(out, paged_extend_attention_ref(*args, page_size, 0.25, **kw), dtype)


# --------------------------------------------------------------------------- GPU


def _gpu_rows(bs, n, kv, Hq, Hkv, page_size, dtype, seed=0):
    """bs uniform rows of n tokens over kv positions each (random pages), on CUDA."""
    g = torch.Generator().manual_seed(seed)
    dev = "cuda"
    pages_per_req = math.ceil((kv + n) / page_size)
    num_pages = bs * pages_per_req + 1
    r2p = (torch.randperm(num_pages - 1, generator=g) + 1).view(bs, pages_per_req).to(torch.int32)
    kc = torch.randn(num_pages * page_size, Hkv, 128, generator=g).to(dtype)
    vc = torch.randn(num_pages * page_size, Hkv, 128, generator=g).to(dtype)
    q = torch.randn(bs * n, Hq, 128, generator=g).to(dtype)
    req = torch.arange(bs)
    sl = torch.randint(max(1, kv - 200), kv + 1, (bs,), generator=g).to(torch.int32) + n
    return [x.to(dev) for x in (q, kc, vc, req, sl, r2p)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bs,n,kv", [(1, 4, 4000), (8, 4, 700), (64, 4, 500), (3, 16, 1000)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_uniform_against_torch(dtype, bs, n, kv, page_size):
    q, kc, vc, req, sl, r2p = _gpu_rows(bs, n, kv, 32, 8, page_size, dtype, seed=bs)
    out = paged_extend_attention(q, kc, vc, req, sl, None, None, r2p, page_size, 0.088,
                                 max_kv_len=kv + n, uniform_n=n)
    ref = ops.paged_extend_attention(q, kc, vc, req, sl, None, None, r2p, page_size, 0.088,
                                     kv + n, uniform_n=n)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=3e-3, atol=3e-3)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_ragged_prefill_and_mask(dtype):
    """A long prefill chunk (several 128-row query blocks), a short chunk with a long prefix,
    verify rows with tree masks; G = 4 and 8."""
    g = torch.Generator().manual_seed(3)
    for Hq, Hkv in ((32, 8), (32, 4)):
        seq, ext = [1500, 2000, 36, 520], [1500, 40, 4, 16]
        T, R, page = sum(ext), len(seq), 16
        pages = math.ceil(2048 / page)
        r2p = (torch.randperm(R * pages, generator=g) + 1).view(R, pages).to(torch.int32)
        kc = torch.randn((R * pages + 1) * page, Hkv, 128, generator=g).to(dtype)
        vc = torch.randn((R * pages + 1) * page, Hkv, 128, generator=g).to(dtype)
        q = torch.randn(T, Hq, 128, generator=g).to(dtype)
        e = torch.tensor(ext, dtype=torch.int32)
        qs = torch.cumsum(e, 0) - e
        args = [x.cuda() for x in (q, kc, vc, torch.arange(R), torch.tensor(seq, dtype=torch.int32),
                                   e, qs, r2p)]
        out = paged_extend_attention(*args, page, 0.088, max_kv_len=2048, max_extend=1500)
        ref = ops.paged_extend_attention(*args, page, 0.088, 2048, max_extend=1500)
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=3e-3, atol=3e-3)
        torch.testing.assert_close(out.float(), ref.float(), **tol)
        vargs = args[:3] + [a[2:] for a in args[3:6]] + [args[6][2:] - args[6][2], args[7]]
        vargs[0] = args[0][1540:]
        bits = _tree_bits(ext[2:], seed=1).cuda()
        out = paged_extend_attention(*vargs, page, 0.088, max_kv_len=2048, max_extend=16,
                                     mask_bits=bits)
        ref = ops.paged_extend_attention(*vargs, page, 0.088, 2048, max_extend=16, mask_bits=bits)
        torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.gpu
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=_rows(max_len=1200, max_rows=6), page_size=st.sampled_from([1, 8, 16, 32, 64]),
       heads=st.sampled_from([(8, 8), (32, 8), (32, 4)]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       splits=st.sampled_from([None, 1, 3]), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_gpu_property_rows_against_torch(rows, page_size, heads, dtype, splits, masked, seed):
    """The shipped tiles at D = 128: any page size, GQA 1 / 4 / 8, N = 1..16 a row, prefixes
    up to 1,200 positions (several 64-position blocks and 512-position splits), mask bits or
    none, against the torch path."""
    seq, ext, reqs = rows
    Hq, Hkv = heads
    args = _setup(seq, ext, reqs, Hq, Hkv, 128, page_size, dtype, device="cuda",
                  max_reqs=len(reqs), max_len=1200, seed=seed)
    bits = _tree_bits(ext, seed).cuda() if masked else None
    out = paged_extend_attention(*args, page_size, 0.088, max_kv_len=1200, max_extend=max(ext),
                                 num_splits=splits, mask_bits=bits)
    ref = ops.paged_extend_attention(*args, page_size, 0.088, 1200, max_extend=max(ext),
                                     mask_bits=bits)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=3e-3, atol=3e-3)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 64])
def test_gpu_graph_equals_eager(bs):
    """A captured call replays the eager call's bits, with the metadata changed in place."""
    q, kc, vc, req, sl, r2p = _gpu_rows(bs, 4, 900, 32, 8, 16, torch.bfloat16, seed=5)
    out = torch.empty_like(q)
    call = lambda: paged_extend_attention(q, kc, vc, req, sl, None, None, r2p, 16, 0.088,
                                          max_kv_len=1024, uniform_n=4, out=out)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    sl.sub_(37)
    graph.replay()
    replay = out.clone()
    call()
    assert torch.equal(replay, out)
