"""kernels/segments.py (several small 1-D copies in one launch): the kernel
(TRITON_INTERPRET=1 on the CPU) writes what the torch path writes, the torch path what the
module doc says; `write_batch` through it (Triton path) fills the same buffers as one copy
per buffer."""

from __future__ import annotations

import os

import pytest
import torch

from graphdraft.config import RuntimeConfig
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.segments import MAX_SEGMENTS as MAX_PAIRS
from graphdraft.kernels.segments import copy_segments, copy_segments_ref
from graphdraft.runtime.batch import BatchRow, write_batch
from graphdraft.runtime.buffers import InputBuffers
from graphdraft.runtime.kv_cache import PageTable
from graphdraft.runtime.staging import HostStaging

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton needs CUDA or TRITON_INTERPRET=1")
DTYPES = (torch.int64, torch.int32, torch.float32, torch.int64, torch.int32, torch.int64,
          torch.int64, torch.float32, torch.int32, torch.int64, torch.int64, torch.int32)


def _pairs(g, lens, dst_len=2100):
    pairs = []
    for n, dt in zip(lens, DTYPES, strict=False):
        dst = torch.randint(-9, 9, (dst_len,), generator=g).to(dt).to(DEV)
        src = (torch.randn(n, generator=g) * 1e6).to(dt).to(DEV)
        pairs.append((dst, src))
    return pairs


def _clone(pairs):
    return [(d.clone(), s) for d, s in pairs]


def test_ref_is_the_rule():
    g = torch.Generator().manual_seed(0)
    pairs = _pairs(g, [5, 0, 17])
    before = _clone(pairs)
    copy_segments_ref(pairs)
    for (d, s), (d0, _) in zip(pairs, before, strict=True):
        n = s.shape[0]
        assert torch.equal(d[:n], s) and torch.equal(d[n:], d0[n:])


@needs_triton
@pytest.mark.parametrize("lens", [[1], [7, 0, 3], [0, 0], [2100, 1, 1025, 0, 64, 3, 1024, 9],
                                  [3, 5, 0, 2, 1, 1, 4], [4, 1, 0, 2, 9, 1, 3, 5, 1, 7, 0, 6]])
def test_kernel_matches_ref(lens):
    g = torch.Generator().manual_seed(len(lens) * 31 + sum(lens))
    pairs = _pairs(g, lens)
    a, b = _clone(pairs), _clone(pairs)
    copy_segments_ref(a)
    copy_segments(b)
    for (da, _), (db, _) in zip(a, b, strict=True):
        assert torch.equal(da, db)


def test_bad_pairs_name_themselves():
    g = torch.Generator().manual_seed(1)
    (d, s), = _pairs(g, [4])
    with pytest.raises(ValueError, match="pairs: expected at most"):
        copy_segments_ref([(d, s)] * (MAX_PAIRS + 1))
    with pytest.raises(ValueError, match=r"pairs\[0\] source"):
        copy_segments_ref([(d, s.int())])
    with pytest.raises(ValueError, match=r"pairs\[1\] source: expected at most 3"):
        copy_segments_ref([(d, s), (d[:3], s)])
    with pytest.raises(ValueError, match=r"pairs\[0\] destination"):
        copy_segments_ref([(d.view(2, 1050), s)])


def _world():
    cfg = RuntimeConfig(device=DEV, page_size=4, max_running_requests=4, max_context_len=32,
                        max_num_batched_tokens=32, cuda_graph_max_bs=4)
    pt = PageTable(4, cfg.max_pages_per_req, cfg.total_kv_pages, 4, DEV)
    a, b, c = pt.alloc_slot(), pt.alloc_slot(), pt.alloc_slot()
    for s in (a, b, c):
        pt.reserve(s, 14)
    rows = [BatchRow(a, 0, [5, 6, 7], True, [6, 7, -1]), BatchRow(c, 4, [9, 8], True, [8, 3]),
            BatchRow(b, 6, [1, 2, 3, 4], False)]
    return cfg, pt, rows


@needs_triton
def test_write_batch_through_one_launch_fills_the_same_buffers():
    cfg, pt, rows = _world()
    got = []
    for kernels in (None, KernelConfig(backend="triton")):
        ib = InputBuffers.allocate(cfg)
        ctx = write_batch(ib, pt, rows, staging=HostStaging(DEV), kernels=kernels)
        got.append((ctx, ib))
    (c0, ib0), (c1, ib1) = got
    assert c0 == c1 and (c1.bs, c1.num_extends, c1.input_num_tokens) == (3, 2, 9)
    for name in ("input_ids", "positions", "out_cache_loc", "shifted_prefill_ids", "seq_lens",
                 "req_pool_indices", "extend_lens"):
        assert torch.equal(getattr(ib0, name), getattr(ib1, name)), name
    assert ib1.shifted_prefill_ids[:5].tolist() == [6, 7, -1, 8, 3]
    assert ib1.seq_lens[:3].tolist() == [3, 6, 10] and ib1.extend_lens[:3].tolist() == [3, 2, 4]
