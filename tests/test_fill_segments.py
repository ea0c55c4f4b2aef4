"""kernels/segments.py (several constant fills in one launch): the kernel
(TRITON_INTERPRET=1 on the CPU) writes what the torch path writes, the torch path what
`fill_` writes; `buffers.neutral_fills` through it writes what `fill_neutral` writes."""

from __future__ import annotations

import os

import pytest
import torch

from graphdraft.config import RuntimeConfig
from graphdraft.kernels.segments import MAX_SEGMENTS as MAX_FILLS
from graphdraft.kernels.segments import fill_segments, fill_segments_ref
from graphdraft.runtime.buffers import (
    NEUTRAL_DRAFT_ROW,
    NEUTRAL_DRAFT_TOKEN,
    NEUTRAL_ROW,
    DraftBuffers,
    InputBuffers,
    fill_neutral,
    neutral_fills,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton needs CUDA or TRITON_INTERPRET=1")
DTYPES = (torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.float64, torch.int64,
          torch.int32, torch.float16, torch.int64, torch.int32, torch.float32, torch.int64)


def _fills(g, lens, values):
    out = []
    for n, v, dt in zip(lens, values, DTYPES, strict=False):
        buf = (torch.randn(n + 7, generator=g) * 100).to(dt).to(DEV)
        out.append((buf, buf[3: 3 + n], v))
    return out


def _run(fn, fills):
    bufs = [b.clone() for b, _, _ in fills]
    fn([(b[3: 3 + d.shape[0]], v) for b, (_, d, v) in zip(bufs, fills, strict=True)])
    return bufs


@pytest.mark.parametrize("lens", [[1], [5, 0, 1030], [0, 0], [3, 7, 1, 9, 2, 4, 1, 8, 5, 3, 2, 6]])
def test_ref_is_fill(lens):
    g = torch.Generator().manual_seed(len(lens))
    values = [(-1) ** i * i for i in range(len(lens))]
    fills = _fills(g, lens, values)
    got = _run(fill_segments_ref, fills)
    for (buf, dst, v), b in zip(fills, got, strict=True):
        want = buf.clone()
        want[3: 3 + dst.shape[0]].fill_(v)
        assert torch.equal(b, want)


@needs_triton
@pytest.mark.parametrize("lens", [[1], [5, 0, 1030], [3, 7, 1, 9, 2, 4, 1, 8, 5, 3, 2, 6],
                                  [2100, 1, 64]])
def test_kernel_matches_ref(lens):
    g = torch.Generator().manual_seed(len(lens) + 10)
    values = [(i * 37) % 11 - 5 for i in range(len(lens))]
    fills = _fills(g, lens, values)
    for a, b in zip(_run(fill_segments_ref, fills), _run(fill_segments, fills), strict=True):
        assert torch.equal(a, b)


def test_bad_fills_name_themselves():
    d = torch.zeros(4, device=DEV)
    with pytest.raises(ValueError, match="fills: expected at most"):
        fill_segments_ref([(d, 0)] * (MAX_FILLS + 1))
    with pytest.raises(ValueError, match=r"fills\[1\] value"):
        fill_segments_ref([(d, 0), (d, 0.5)])
    with pytest.raises(ValueError, match=r"fills\[0\] value"):
        fill_segments_ref([(d, 2**40)])
    with pytest.raises(ValueError, match=r"fills\[0\] destination"):
        fill_segments_ref([(d.view(2, 2), 1)])


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_neutral_fills_write_what_fill_neutral_writes(backend):
    cfg = RuntimeConfig(device=DEV, page_size=4, max_running_requests=6, max_context_len=32,
                        max_num_batched_tokens=32, cuda_graph_max_bs=6)
    g = torch.Generator().manual_seed(3)
    bufs = [(InputBuffers.allocate(cfg), DraftBuffers.allocate(cfg, 5, 15, torch.float32))
            for _ in range(2)]
    for objs in zip(*bufs, strict=True):  # both copies the same random values
        for name in vars(objs[0]):
            if isinstance(getattr(objs[0], name), torch.Tensor):
                t = getattr(objs[0], name)
                x = (torch.randn(t.shape, generator=g) * 50).to(t.dtype)
                for obj in objs:
                    getattr(obj, name).copy_(x)
    (ia, da), (ib_, db_) = bufs
    fill_neutral(ia, NEUTRAL_ROW, 2, 5)
    fill_neutral(da, NEUTRAL_DRAFT_TOKEN, 8, 17)
    fill_neutral(da, NEUTRAL_DRAFT_ROW, 2, 5)
    fills = (neutral_fills(ib_, NEUTRAL_ROW, 2, 5) + neutral_fills(db_, NEUTRAL_DRAFT_TOKEN, 8, 17)
             + neutral_fills(db_, NEUTRAL_DRAFT_ROW, 2, 5) + neutral_fills(db_, NEUTRAL_ROW, 3, 3))
    (fill_segments if backend == "triton" else fill_segments_ref)(fills)
    for a, b in ((ia, ib_), (da, db_)):
        for name in vars(a):
            if isinstance(getattr(a, name), torch.Tensor):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
