"""Compiled variants of the attention split kernels: one per tile, whatever the mode.

Every mode a capture or a prefill launches (decode: one split or several, q rows gathered by
q_index or not; extend: uniform or ragged rows, one split or several) runs under one Triton
specialization key per tile, recorded on the host (`kernels.keys.KeyRecorder`, a dry run with a
CUDA device's launch options: `perf.compile_census.gpu_launch_options`), so a cold start
compiles each kernel once per tile. A mode flag made a constexpr again, specialized as an int
(1 vs 0), or a pointer whose dtype changes with the mode gives these launches a second key.
"""

from __future__ import annotations

import torch

from graphdraft.kernels.decode_attention import paged_decode_attention
from graphdraft.kernels.extend_attention import TILE_CASES, paged_extend_attention
from perf.compile_census import gpu_dry_keys

DECODE, EXTEND = "decode_attention._decode_split_kernel", "extend_attention._extend_split_kernel"
COMBINE = "decode_attention._combine_kernel"  # decode's and extend's stage 2
HQ, HKV, D, PAGE = 32, 8, 128, 16  # the 8B target's attention
MAX_KV = 4096


def _cache():
    kc = torch.zeros(64 * PAGE, HKV, D, dtype=torch.bfloat16)
    return kc, torch.zeros_like(kc), torch.zeros(8, MAX_KV // PAGE, dtype=torch.int32)


def test_decode_split_kernel_has_one_key_for_every_mode():
    """One split (64 rows fill the GPU) or several (1 row), q rows gathered (int64 q_index, as
    the drafter's gather_ids) or not: one key."""
    kc, vc, r2p = _cache()

    def run():
        for rows in (1, 64):
            req = torch.zeros(rows, dtype=torch.int64)
            lens = torch.ones(rows, dtype=torch.int32)
            for q_index in (None, torch.arange(rows)):
                q = torch.zeros(rows, HQ, D, dtype=torch.bfloat16)
                paged_decode_attention(q, kc, vc, req, lens, r2p, PAGE, 0.1, max_kv_len=MAX_KV,
                                       q_index=q_index)

    rec = gpu_dry_keys(run)
    assert rec.launches[DECODE] == 4
    assert rec.launches[COMBINE] == 2  # the 1-row launches took several splits
    assert len(rec.keys[DECODE]) == 1 and len(rec.keys[COMBINE]) == 1


def test_extend_split_kernel_has_one_key_per_tile():
    """Uniform rows (the captured verify) and ragged rows (prefill chunks; int32 extend_lens,
    int64 q_starts, as the runtime passes them), each with one split and with several, at
    every tile: one key per tile, the verify's and the prefill's alike."""
    kc, vc, r2p = _cache()
    g_pad = HQ // HKV

    def run():
        for bm in TILE_CASES:
            n = bm // g_pad  # tokens per row of this tile
            for rows in (1, 64):
                req = torch.zeros(rows, dtype=torch.int64)
                seq = torch.full((rows,), n, dtype=torch.int32)
                q = torch.zeros(rows * n, HQ, D, dtype=torch.bfloat16)
                paged_extend_attention(q, kc, vc, req, seq, None, None, r2p, PAGE, 0.1,
                                       max_kv_len=MAX_KV, uniform_n=n)
                ext = seq.clone()
                starts = torch.cumsum(ext, 0, dtype=torch.int64) - ext
                for splits in (1, 3):
                    paged_extend_attention(q, kc, vc, req, seq, ext, starts, r2p, PAGE, 0.1,
                                           max_kv_len=MAX_KV, max_extend=n, num_splits=splits)

    rec = gpu_dry_keys(run)
    assert rec.launches[EXTEND] == len(TILE_CASES) * 2 * 3
    assert rec.launches[COMBINE] == len(TILE_CASES) * 3  # several splits: 1 uniform row, splits=3
    assert len(rec.keys[COMBINE]) == 1
    keys = rec.keys[EXTEND]
    assert len(keys) == len(TILE_CASES)
    assert sorted(dict(k)["BLOCK_M"][1] for k in keys) == list(TILE_CASES)


def test_decode_and_extend_share_one_combine_kernel():
    """Stage 2 of decode attention (splits a row's length reaches) and of extend attention
    (every split) launch one compiled combine kernel."""
    kc, vc, r2p = _cache()

    def run():
        req = torch.zeros(1, dtype=torch.int64)
        lens = torch.full((1,), 700, dtype=torch.int32)
        paged_decode_attention(torch.zeros(1, HQ, D, dtype=torch.bfloat16), kc, vc, req, lens, r2p,
                               PAGE, 0.1, max_kv_len=MAX_KV)
        paged_extend_attention(torch.zeros(4, HQ, D, dtype=torch.bfloat16), kc, vc, req, lens,
                               None, None, r2p, PAGE, 0.1, max_kv_len=MAX_KV, uniform_n=4)

    rec = gpu_dry_keys(run)
    assert rec.launches[COMBINE] == 2 and len(rec.keys[COMBINE]) == 1
