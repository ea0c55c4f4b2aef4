"""Long contexts: split-KV attention whose chunk follows each row's length, on the device.

A long-context engine captures its graphs with `max_kv_len` = the context limit (say 128k); the
decode and extend kernels then keep the split count chosen for that bound as their grid and
compute each row's chunk from the row's own length inside the kernel (`row_chunk`), so a 4k row
spreads over as many splits as a 4k engine's would, replay after replay, with no re-capture.
CPU: Triton's interpreter with small blocks (BLOCK_N 16), lengths across block, page and split
edges, rows of different lengths in one call, against the plain torch reference. GPU: the same
at the 8B shape with a captured graph replayed over new lengths.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from graphdraft.kernels.config import TRITON
from graphdraft.kernels.decode_attention import (
    MAX_CHUNK,
    ROW_SPLITS_FROM,
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    row_chunk_host,
    row_split_fill,
)
from graphdraft.kernels.extend_attention import paged_extend_attention, paged_extend_attention_ref
from graphdraft.runtime.kv_cache import kv_slot

HAS_CUDA = torch.cuda.is_available()
CPU = torch.device("cpu")
SMALL = TRITON.replace(decode_block_n=16, extend_tiles=((16, 16, 4),) * 4)
TOL = {torch.float32: dict(rtol=1e-5, atol=2e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _cache(lens: dict[int, int], hkv: int, d: int, page_size: int, dtype, max_len: int,
           seed: int = 0):
    """Shuffled pages (page 0 unused), NaN everywhere but the positions [0, lens[r]) of each
    request r: a read past a row's length shows as NaN."""
    g = torch.Generator().manual_seed(seed)
    per = math.ceil(max_len / page_size) + 1
    reqs = max(lens) + 1
    pages = torch.randperm(reqs * per, generator=g) + 1
    r2p = pages.view(reqs, per).to(torch.int32)
    kc = torch.full(((reqs * per + 1) * page_size, hkv, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    for r, n in lens.items():
        slots = kv_slot(r2p, r, torch.arange(n), page_size)
        kc[slots] = torch.randn(n, hkv, d, generator=g).to(dtype)
        vc[slots] = torch.randn(n, hkv, d, generator=g).to(dtype)
    return kc, vc, r2p, g


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("rows,hkv", [(1, 8), (8, 8), (32, 8), (3, 1)])
def test_row_chunk_is_the_host_rule_at_the_rows_own_length(rows, hkv):
    """A row of length L gets the chunk the host would choose for max_kv_len = L (within the
    grid's split count), covers [0, L) with at most the grid's splits, and a row at the
    bound gets the host's own chunk."""
    bound, block = 131072 + 1024, 64
    splits = default_num_splits(rows, hkv, bound, CPU)
    host_chunk = triton.cdiv(triton.cdiv(bound, splits), block) * block
    fill = row_split_fill(rows * hkv, splits, bound, CPU)
    assert fill == triton.cdiv(2 * 132, rows * hkv) or splits == 1
    for n in (1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 4095, 4096, 4097, 8192, 32768, 131072,
              bound):
        chunk = row_chunk_host(n, host_chunk, splits, fill, MAX_CHUNK, block)
        active = triton.cdiv(n, chunk)
        assert chunk % block == 0 and chunk >= block
        assert 1 <= active <= splits and active * chunk >= n
        if splits > 1 and fill:
            own = default_num_splits(rows, hkv, n, CPU)
            assert chunk == triton.cdiv(triton.cdiv(n, min(own, splits)), block) * block
    assert row_chunk_host(bound, host_chunk, splits, fill, MAX_CHUNK, block) == host_chunk


def test_row_splits_switch():
    """Off up to ROW_SPLITS_FROM (short-context launches as before), on past it; forced either
    way by `row_splits`; never with one split."""
    assert row_split_fill(8, 33, ROW_SPLITS_FROM, CPU) == 0
    assert row_split_fill(8, 33, ROW_SPLITS_FROM + 1, CPU) == 33
    assert row_split_fill(8, 33, 100, CPU, row_splits=True) == 33
    assert row_split_fill(8, 33, 1 << 17, CPU, row_splits=False) == 0
    assert row_split_fill(8, 1, 1 << 17, CPU) == 0
    assert row_split_fill(1000, 2, 1 << 17, CPU) == 1


def test_a_4k_row_of_a_128k_engine_splits_as_a_4k_engine_would():
    """The case that motivated the rule: bs 1, 8 kv heads, a 131k bound."""
    bound, block = 131072 + 1024, 64
    splits = default_num_splits(1, 8, bound, CPU)
    host_chunk = triton.cdiv(triton.cdiv(bound, splits), block) * block
    assert triton.cdiv(4096, host_chunk) == 8  # the host's chunk: 8 of 264 splits work
    fill = row_split_fill(8, splits, bound, CPU)
    chunk = row_chunk_host(4096, host_chunk, splits, fill, MAX_CHUNK, block)
    own = default_num_splits(1, 8, 4096, CPU)  # 33: a 4k engine's chunk of 128, 32 splits work
    assert chunk == triton.cdiv(triton.cdiv(4096, own), block) * block == 128
    assert triton.cdiv(4096, chunk) == 32


# --------------------------------------------------------------------------- decode kernel


# Every pair of values of (split count, page size, dtype) once at least: 6 cases, not the 12 of
# the full product.
@pytest.mark.parametrize("splits,page_size,dtype", [
    (None, 1, torch.float32), (None, 16, torch.bfloat16), (3, 16, torch.float32),
    (3, 1, torch.bfloat16), (8, 1, torch.float32), (8, 16, torch.bfloat16)])
def test_decode_rows_of_different_lengths_follow_their_own_chunk(dtype, page_size, splits):
    """One launch config (max_kv_len 200) over rows of 1..130 positions: each row's chunk from
    its own length (row_splits), against the reference; then new lengths at the same host
    arguments (what a replayed graph sees)."""
    lens = {1: 130, 2: 17, 3: 64, 4: 1, 5: 33}
    kc, vc, r2p, g = _cache(lens, 2, 16, page_size, dtype, 200, seed=page_size)
    req = torch.tensor([1, 2, 3, 4, 5, 1], dtype=torch.int32)
    for kv in ([130, 17, 64, 1, 33, 16], [129, 16, 63, 1, 32, 65], [48, 1, 15, 1, 17, 130]):
        q = torch.randn(len(kv), 8, 16, generator=g).to(dtype)
        kv_lens = torch.tensor(kv, dtype=torch.int32)
        args = (q, kc, vc, req, kv_lens, r2p, page_size, 0.25)
        ref = paged_decode_attention_ref(*args, max_kv_len=200)
        assert not ref.isnan().any()
        out = paged_decode_attention(*args, max_kv_len=200, num_splits=splits, row_splits=True,
                                     kernels=SMALL)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_decode_row_splits_with_the_beams_second_segment():
    """Tree drafting's extra slots are walked by the split holding the row's last position,
    which the row's own chunk now decides."""
    lens = {1: 90, 2: 40}
    kc, vc, r2p, g = _cache(lens, 1, 16, 4, torch.float32, 120, seed=3)
    extra_src = {1: list(range(90, 96)), 2: list(range(40, 46))}
    for r, pos in extra_src.items():  # the scratch slots: more positions of the same requests
        slots = kv_slot(r2p, r, torch.tensor(pos), 4)
        kc[slots] = torch.randn(len(pos), 1, 16, generator=g)
        vc[slots] = torch.randn(len(pos), 1, 16, generator=g)
    req = torch.tensor([1, 2, 2], dtype=torch.int64)
    kv_lens = torch.tensor([90, 40, 17], dtype=torch.int32)
    extra = torch.stack([kv_slot(r2p, int(r), torch.tensor(extra_src[int(r)]), 4) for r in req])
    q = torch.randn(3, 4, 16, generator=g)
    args = (q, kc, vc, req, kv_lens, r2p, 4, 0.3)
    ref = paged_decode_attention_ref(*args, max_kv_len=120, extra_slots=extra, num_extra=5)
    for splits in (None, 4):
        out = paged_decode_attention(*args, max_kv_len=120, extra_slots=extra, num_extra=5,
                                     num_splits=splits, row_splits=True, kernels=SMALL)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_row_splits_past_the_bound_still_cover_the_row():
    """kv_lens above max_kv_len (the bound only sizes the grid): the row's chunk grows so its
    splits still cover it."""
    lens = {1: 150}
    kc, vc, r2p, g = _cache(lens, 1, 16, 16, torch.float32, 160, seed=4)
    q = torch.randn(2, 2, 16, generator=g)
    args = (q, kc, vc, torch.tensor([1, 1]), torch.tensor([150, 3], dtype=torch.int32), r2p, 16,
            0.25)
    ref = paged_decode_attention_ref(*args, max_kv_len=150)
    out = paged_decode_attention(*args, max_kv_len=40, num_splits=2, row_splits=True,
                                 kernels=SMALL)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


# --------------------------------------------------------------------------- extend kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 3])
def test_verify_rows_follow_their_own_chunk(dtype, splits):
    """Uniform rows of N = 4 (the captured verify) at lengths across blocks and pages, one
    launch config, two sets of lengths."""
    lens = {1: 140, 2: 70, 3: 30}
    kc, vc, r2p, g = _cache(lens, 2, 16, 16, dtype, 200, seed=5)
    req = torch.tensor([1, 2, 3], dtype=torch.int64)
    for seq in ([140, 21, 4], [69, 70, 30]):
        q = torch.randn(12, 4, 16, generator=g).to(dtype)
        seq_lens = torch.tensor(seq, dtype=torch.int32)
        args = (q, kc, vc, req, seq_lens, None, None, r2p, 16, 0.25)
        ref = paged_extend_attention_ref(*args, max_kv_len=200, uniform_n=4)
        out = paged_extend_attention(*args, max_kv_len=200, uniform_n=4, num_splits=splits,
                                     row_splits=True, kernels=SMALL)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_ragged_rows_with_mask_bits_follow_their_own_chunk():
    """Ragged rows (a prefill chunk, a tree row with mask bits, a decode row) in row mode."""
    lens = {1: 100, 2: 60, 3: 20}
    kc, vc, r2p, g = _cache(lens, 1, 16, 4, torch.float32, 128, seed=6)
    seq, ext = [100, 60, 20], [20, 5, 1]
    ext_t = torch.tensor(ext, dtype=torch.int32)
    q_starts = (torch.cumsum(ext_t, 0) - ext_t).to(torch.int64)
    q = torch.randn(sum(ext), 2, 16, generator=g)
    bits = torch.tensor([(1 << (j + 1)) - 1 for e in ext for j in range(e)], dtype=torch.int64)
    bits[20:25] = torch.tensor([1, 3, 5, 9, 17])  # row 2: a tree (each node sees the root)
    args = (q, kc, vc, torch.tensor([1, 2, 3]), torch.tensor(seq, dtype=torch.int32), ext_t,
            q_starts, r2p, 4, 0.3)
    for mask in (None, bits):
        ref = paged_extend_attention_ref(*args, max_kv_len=128, max_extend=20, mask_bits=mask)
        out = paged_extend_attention(*args, max_kv_len=128, max_extend=20, mask_bits=mask,
                                     num_splits=4, row_splits=True, kernels=SMALL)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


def _combine_case(splits: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    part = torch.randn(4, 2, splits, d, generator=g)
    lse = torch.randn(4, 2, splits, generator=g) * 3
    return part, lse


def _combine_torch(part, lse, active):
    """Token t's log-sum-exp weighted sum over its splits [0, active[t]) with finite lse."""
    out = torch.zeros(part.shape[0], part.shape[1], part.shape[3])
    for t, a in enumerate(active):
        w = torch.softmax(lse[t, :, :a] * math.log(2), dim=-1)  # log2 domain
        w = torch.where(lse[t, :, :a] > float("-inf"), w, 0.0)
        out[t] = torch.einsum("hs,hsd->hd", w, torch.nan_to_num(part[t, :, :a]) * (w[..., None] > 0))
    return out


@pytest.mark.parametrize("row_fill", [0, 2])
def test_combine_reads_only_the_splits_each_row_reaches(row_fill):
    """The combine (extend's uniform rows: 2 rows of 2 tokens, `row_div` 2, strided seq_lens)
    reads the splits the row's length reaches (`row_chunk` over the given max chunk and block):
    NaN partials and finite log-sum-exps past them change nothing, and an empty split inside
    them (lse -inf, its partial unwritten: NaN here) weighs 0. More splits than one block of
    `COMBINE_SB`."""
    from graphdraft.kernels.decode_attention import COMBINE_SB, combine_splits

    splits, block, max_chunk = COMBINE_SB + 6, 16, 16
    part, lse = _combine_case(splits, 16, seed=row_fill)
    seq_store = torch.tensor([[splits * 16 - 5, 0], [37, 0]], dtype=torch.int32)
    seq_lens = seq_store[:, 0]  # stride 2
    chunk = 16
    active = []
    for n in seq_lens.tolist():
        c = row_chunk_host(n, chunk, splits, row_fill, max_chunk, block)
        active += [min(-(-n // c), splits)] * 2
    assert active[0] > COMBINE_SB and active[2] < splits
    for t, a in enumerate(active):
        part[t, :, a:] = float("nan")
        lse[t, :, a:] = 50.0  # would dominate if read
    lse[1, :, 3] = float("-inf")  # an empty split of token 1
    part[1, :, 3] = float("nan")
    out = torch.empty(4, 2, 16)
    combine_splits(part, lse, out, seq_lens, chunk, TRITON, row_fill, row_div=2,
                   max_chunk=max_chunk, block=block)
    torch.testing.assert_close(out, _combine_torch(part, lse, active), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bs", [1, 8])
def test_gpu_graph_replays_follow_new_lengths(bs):
    """The 8B head shape (32 / 8 heads, D 128), a 32k bound: one captured decode attention
    replayed over rows of 100..32768 positions equals the eager reference each time."""
    dev = "cuda"
    bound, ps = 32768 + 64, 16
    per = bound // ps
    r2p = torch.zeros(bs + 1, per, dtype=torch.int32, device=dev)
    r2p[1:] = (torch.randperm(bs * per, device=dev) + 1).view(bs, per).to(torch.int32)
    kc = torch.randn((bs * per + 1) * ps, 8, 128, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(bs, 32, 128, device=dev, dtype=torch.bfloat16)
    req = torch.arange(1, bs + 1, device=dev)
    kv_lens = torch.full((bs,), 100, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    call = lambda: paged_decode_attention(q, kc, vc, req, kv_lens, r2p, ps, 0.088,
                                          max_kv_len=bound, out=out)
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for n in (100, 4096, 5000, 32768):
        kv_lens.copy_(torch.randint(max(1, n // 2), n + 1, (bs,), device=dev, dtype=torch.int32))
        graph.replay()
        ref = paged_decode_attention_ref(q, kc, vc, req, kv_lens, r2p, ps, 0.088, max_kv_len=n)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_engine_replays_long_and_short_rows_as_eager():
    """An Engine of a 20k-token context (row splits on) serving prompts of 300, 5,000 and
    17,000 tokens together: the captured cycle graphs (captured once, at the bound) give the
    eager engine's greedy text, speculative and target-only, and speculative gives the
    target's (float32)."""
    import random

    from graphdraft.config import ModelConfig, RuntimeConfig
    from graphdraft.models.random_models import random_model_pair
    from graphdraft.serving.engine import Engine
    from graphdraft.serving.verify import SamplingParams

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 2048}
    mc = ModelConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                     intermediate_size=512, num_hidden_layers=3, vocab_size=512,
                     max_position_embeddings=20480, rope_theta=500000.0, rope_scaling=scaling,
                     aux_hidden_state_layer_ids=(0, 1, 2))
    target, head = random_model_pair(mc, mc.replace(num_hidden_layers=1), torch.float32, 0,
                                     0.3, device="cuda")
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (300, 5000, 17000)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        for spec in (False, True):
            cfg = RuntimeConfig(max_running_requests=4, max_context_len=20000,
                                max_num_batched_tokens=4096, cuda_graph_max_bs=4,
                                dtype="float32", device="cuda", enforce_eager=eager,
                                speculative_policy="fixed", kv_cache_memory_gb=1.0)
            engine = Engine(target, cfg, head if spec else None)
            engine.capture_graphs()
            outs[eager, spec] = engine.generate(prompts, params)
            if not eager:  # the decode cycles replayed graphs
                assert sum(replays for replays, _ in engine.graph_summary().values()) > 0
            del engine
    assert outs[False, False] == outs[True, False]
    assert outs[False, True] == outs[True, True]
    assert outs[False, True] == outs[False, False]  # float32: greedy speculative == target
