"""Tests for graphdraft.kernels.cache_loc: kernels against their torch references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphdraft.kernels import pdl
from graphdraft.kernels.cache_loc import (
    advance_positions_and_seq_lens,
    advance_positions_and_seq_lens_ref,
    compute_out_cache_loc_uniform,
    compute_out_cache_loc_uniform_ref,
)
from graphdraft.kernels.config import TRITON

I32, I64 = torch.int32, torch.int64


def _table(gen: torch.Generator, max_reqs: int, max_pages: int, n_phys: int = 1000) -> torch.Tensor:
    """Random page table ``[max_reqs, max_pages]`` int32; row 0 all zeros (padding slot)."""
    t = torch.randint(1, n_phys, (max_reqs, max_pages), generator=gen, dtype=I32)
    t[0] = 0
    return t


def _run_uniform(rtp, reqs, starts, page_size, length, layout):
    bs = reqs.shape[0]
    kw = {} if layout == "row" else {"out_stride_req": 1, "out_stride_tok": bs}
    got = torch.full((bs * length,), -7, dtype=I64, device=reqs.device)
    exp = torch.full((bs * length,), -7, dtype=I64, device=reqs.device)
    compute_out_cache_loc_uniform(got, reqs, starts, rtp, page_size, length, **kw)
    compute_out_cache_loc_uniform_ref(exp, reqs, starts, rtp, page_size, length, **kw)
    return got, exp


# --------------------------------------------------------------------------- random vs reference


@pytest.mark.parametrize("layout", ["row", "step"])
@pytest.mark.parametrize("idx_dtype", [I32, I64])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_uniform_matches_ref(page_size, idx_dtype, layout):
    gen = torch.Generator().manual_seed(page_size * 10 + (idx_dtype == I64))
    max_reqs, max_pages, bs, length = 8, 16, 5, 7
    rtp = _table(gen, max_reqs, max_pages)
    reqs = torch.randint(1, max_reqs, (bs,), generator=gen).to(idx_dtype)
    # Starts just before a page boundary, so runs cross into the next page.
    starts = (torch.randint(1, 4, (bs,), generator=gen) * page_size - 3).clamp(min=0)
    got, exp = _run_uniform(rtp, reqs, starts.to(idx_dtype), page_size, length, layout)
    assert torch.equal(got, exp)
    assert (got > 0).all()


def test_uniform_layouts_are_transposes():
    gen = torch.Generator().manual_seed(3)
    rtp = _table(gen, 6, 4)
    reqs = torch.tensor([1, 4, 2], dtype=I32)
    starts = torch.tensor([14, 0, 30], dtype=I64)
    row, _ = _run_uniform(rtp, reqs, starts, 16, 5, "row")
    step, _ = _run_uniform(rtp, reqs, starts, 16, 5, "step")
    assert torch.equal(row.view(3, 5).t(), step.view(5, 3))


def test_uniform_long_run_loops_over_blocks():
    gen = torch.Generator().manual_seed(4)
    rtp = _table(gen, 4, 40)
    reqs = torch.tensor([3, 1], dtype=I64)
    starts = torch.tensor([5, 0], dtype=I32)
    got, exp = _run_uniform(rtp, reqs, starts, 1, 300, "step")  # 300 > 128-token block
    assert torch.equal(got, exp)


@pytest.mark.parametrize("delta", [1, 3, -2])
@pytest.mark.parametrize("bs", [1, 5, 37])
def test_advance_matches_ref(bs, delta):
    gen = torch.Generator().manual_seed(bs)
    seq = torch.randint(0, 1000, (bs,), generator=gen, dtype=I32)
    pos = torch.randint(0, 1 << 40, (bs,), generator=gen, dtype=I64)
    eseq, epos = advance_positions_and_seq_lens_ref(seq.clone(), pos.clone(), delta)
    advance_positions_and_seq_lens(seq, pos, delta)
    assert torch.equal(seq, eseq) and torch.equal(pos, epos)


def test_advance_strided_views():
    buf32 = torch.arange(20, dtype=I32).view(10, 2)
    buf64 = torch.arange(30, dtype=I64).view(10, 3)
    seq, pos = buf32[:, 1], buf64[:, 2]  # non-contiguous [10] views
    advance_positions_and_seq_lens(seq, pos)
    assert torch.equal(buf32[:, 1], torch.arange(1, 20, 2, dtype=I32) + 1)
    assert torch.equal(buf32[:, 0], torch.arange(0, 20, 2, dtype=I32))
    assert torch.equal(buf64[:, 2], torch.arange(2, 30, 3) + 1)
    assert torch.equal(buf64[:, :2], torch.arange(30).view(10, 3)[:, :2])


def test_empty_inputs_do_nothing():
    rtp = torch.ones(2, 2, dtype=I32)
    empty = torch.empty(0, dtype=I64)
    out = torch.full((4,), -7, dtype=I64)
    compute_out_cache_loc_uniform(out, empty, empty, rtp, 16, 3)
    compute_out_cache_loc_uniform(out, torch.ones(2, dtype=I32), torch.zeros(2, dtype=I32), rtp, 16, 0)
    advance_positions_and_seq_lens(torch.empty(0, dtype=I32), empty)
    assert (out == -7).all()


# --------------------------------------------------------------------------- dummy-slot rules


def test_dummy_slot_rules():
    ps = 4
    rtp = torch.tensor(
        [[0, 0], [5, 0], [-3, 7]],  # row 0: padding slot; row 1: page 0 at idx 1; row 2: negative page
        dtype=I32,
    )
    reqs = torch.tensor([1, 2, 0, 2, -1, 3], dtype=I32)  # -1 and 3 are outside the table rows
    starts = torch.tensor([0, 0, 0, -2, 0, 0], dtype=I64)
    length = 12  # positions 8..11 are past the 2-page table
    got, exp = _run_uniform(rtp, reqs, starts, ps, length, "row")
    assert torch.equal(got, exp)
    got = got.view(6, length)
    z4 = [0] * 4
    assert got[0].tolist() == [20, 21, 22, 23] + z4 + z4
    assert got[1].tolist() == z4 + [28, 29, 30, 31] + z4
    assert got[2].tolist() == [0] * 12  # padded row: all-zero page-table row
    assert got[3].tolist() == [0, 0] + z4 + [28, 29, 30, 31] + [0, 0]  # negative positions
    assert got[4].tolist() == [0] * 12 and got[5].tolist() == [0] * 12


def test_one_kernel_for_two_table_widths():
    gen = torch.Generator().manual_seed(11)
    wide = _table(gen, 6, 16)
    reqs = torch.tensor([2, 5, 1], dtype=I32)
    for width in (3, 10):
        rtp = wide[:, :width]  # row stride 16 != width: strides are honoured
        starts = torch.tensor([0, 2 * 16 - 1, width * 16 - 10], dtype=I64)
        got, exp = _run_uniform(rtp, reqs, starts, 16, 12, "step")
        assert torch.equal(got, exp)
        assert (got.view(12, 3)[-2:, 2] == 0).all()  # last positions run past the table


# --------------------------------------------------------------------------- validation


def _uniform_args(**over):
    args = dict(
        out=torch.zeros(6, dtype=I64),
        req_pool_indices=torch.ones(2, dtype=I32),
        cache_start=torch.zeros(2, dtype=I64),
        req_to_page=torch.ones(3, 4, dtype=I32),
        page_size=16,
        length=3,
    )
    args.update(over)
    return args


META = torch.device("meta")


@pytest.mark.parametrize(
    "over, name",
    [
        ({"out": torch.zeros(6, dtype=I32)}, "out"),
        ({"out": torch.zeros(5, dtype=I64)}, "out"),
        ({"out": torch.zeros(12, dtype=I64)[::2]}, "out"),
        ({"out": torch.zeros(6, dtype=I64, device=META)}, "out"),
        ({"req_to_page": torch.ones(3, 4, dtype=I64)}, "req_to_page"),
        ({"req_to_page": torch.ones(12, dtype=I32)}, "req_to_page"),
        ({"req_pool_indices": torch.ones(2)}, "req_pool_indices"),
        ({"req_pool_indices": torch.ones(2, dtype=I32, device=META)}, "req_pool_indices"),
        ({"cache_start": torch.zeros(3, dtype=I64)}, "cache_start"),
        ({"page_size": 0}, "page_size"),
        ({"length": -1}, "length"),
        ({"out_stride_req": -1}, "out_stride_req"),
        ({"out_stride_req": 1, "out_stride_tok": 3}, "out"),  # needs 1 + 2*3 + 1 = 8 > 6
    ],
)
def test_uniform_bad_input(over, name):
    with pytest.raises(ValueError, match=name):
        compute_out_cache_loc_uniform(**_uniform_args(**over))


@pytest.mark.parametrize(
    "seq, pos, delta, name",
    [
        (torch.zeros(3, dtype=I64), torch.zeros(3, dtype=I64), 1, "seq_lens"),
        (torch.zeros(3, dtype=I32), torch.zeros(3, dtype=I32), 1, "positions"),
        (torch.zeros(3, dtype=I32), torch.zeros(4, dtype=I64), 1, "positions"),
        (torch.zeros(3, dtype=I32), torch.zeros(3, dtype=I64, device=META), 1, "positions"),
        (torch.zeros(3, dtype=I32), torch.zeros(3, dtype=I64), 1.0, "delta"),
    ],
)
def test_advance_bad_input(seq, pos, delta, name):
    with pytest.raises(ValueError, match=name):
        advance_positions_and_seq_lens(seq, pos, delta)


# --------------------------------------------------------------------------- property test


@settings(max_examples=25, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 3, 16]),
    max_pages=st.integers(1, 5),
    idx_dtype=st.sampled_from([I32, I64]),
    rows=st.lists(
        st.tuples(st.integers(-1, 4), st.integers(-3, 90)), min_size=1, max_size=4
    ),
    length=st.integers(0, 9),
    layout=st.sampled_from(["row", "step"]),
    seed=st.integers(0, 2**16),
)
def test_property_matches_ref(page_size, max_pages, idx_dtype, rows, length, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    rtp = torch.randint(-2, 50, (4, max_pages), generator=gen, dtype=I32)  # includes 0 / negative ids
    reqs = torch.tensor([r[0] for r in rows], dtype=idx_dtype)
    starts = torch.tensor([r[1] for r in rows], dtype=idx_dtype)
    got, exp = _run_uniform(rtp, reqs, starts, page_size, length, layout)
    assert torch.equal(got, exp)


# --------------------------------------------------------------------------- GPU: CUDA-graph capture


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(21)
    rtp = _table(gen, 8, 8).to(dev)
    bs, steps, ps = 4, 5, 16
    reqs = torch.tensor([3, 1, 0, 6], dtype=I32, device=dev)
    seq = torch.tensor([10, 15, 0, 40], dtype=I32, device=dev)
    pos = seq.to(I64)
    out_u = torch.zeros(bs * steps, dtype=I64, device=dev)

    def body():
        compute_out_cache_loc_uniform(
            out_u, reqs, seq, rtp, ps, steps, out_stride_req=1, out_stride_tok=bs
        )
        advance_positions_and_seq_lens(seq, pos, 2)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()  # warm-up: compiles outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()

    for new_seq in ([7, 30, 1, 100], [0, 63, 64, 5]):
        seq.copy_(torch.tensor(new_seq, dtype=I32))
        pos.copy_(seq.to(I64))
        eu = compute_out_cache_loc_uniform_ref(
            out_u.clone(), reqs, seq, rtp, ps, steps, out_stride_req=1, out_stride_tok=bs
        )
        eseq, epos = seq + 2, pos + 2
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_u, eu)
        assert torch.equal(seq, eseq) and torch.equal(pos, epos)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_compiled_kernels_match_ref_on_gpu(page_size):
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(page_size)
    wide = _table(gen, 8, 12)
    for width, idx_dtype in ((3, I32), (10, I64)):
        rtp = wide.to(dev)[:, :width]  # row stride 12 != width
        reqs = torch.tensor([3, 0, 7, -1, 5], dtype=idx_dtype, device=dev)
        starts = torch.tensor([page_size - 2, 0, -3, 4, width * page_size - 5], dtype=idx_dtype, device=dev)
        for layout in ("row", "step"):
            got, exp = _run_uniform(rtp, reqs, starts, page_size, 9, layout)
            assert got.is_cuda and torch.equal(got, exp)


@pytest.mark.gpu
def test_one_compiled_kernel_across_table_widths():
    from graphdraft.kernels import cache_loc

    kernel = cache_loc._uniform_kernel
    if not hasattr(kernel, "device_caches"):
        pytest.skip("this triton has no JITFunction.device_caches")
    dev = torch.device("cuda")
    reqs = torch.tensor([1, 2, 3], dtype=I64, device=dev)
    starts = torch.tensor([0, 5, 17], dtype=I32, device=dev)
    counts = []
    for width in (1, 3, 7, 16, 33):
        rtp = _table(torch.Generator().manual_seed(width), 4, width).to(dev)
        got, exp = _run_uniform(rtp, reqs, starts, 16, 4, "step")
        assert torch.equal(got, exp)
        counts.append(sum(len(c[0]) for c in kernel.device_caches.values()))
    assert len(set(counts)) == 1, counts


@pytest.mark.parametrize("early", [False, True])
def test_early_loads_off_and_on(early):
    """`KernelConfig.pdl_early_loads` (the metadata loaded before the PDL wait; under the
    interpreter it is on by default): the uniform kernel over several blocks with the
    first-step outputs, and the advance kernel, equal their references both ways."""
    kernels = TRITON.replace(pdl_early_loads=early)
    gen = torch.Generator().manual_seed(9)
    rtp = _table(gen, 4, 40)
    reqs = torch.tensor([3, 1, 2], dtype=I64)
    starts = torch.tensor([5, 0, 17], dtype=I32)
    for length in (2, 300):  # one block; 300 > the 128-token block
        got, exp = (torch.full((3 * length,), -7, dtype=I64) for _ in range(2))
        outs = [(torch.zeros(3, dtype=I64), torch.zeros(3, dtype=I32)) for _ in range(2)]
        compute_out_cache_loc_uniform(got, reqs, starts, rtp, 1, length,
                                      positions_out=outs[0][0], seq_lens_out=outs[0][1],
                                      kernels=kernels)
        compute_out_cache_loc_uniform_ref(exp, reqs, starts, rtp, 1, length,
                                          positions_out=outs[1][0], seq_lens_out=outs[1][1])
        assert torch.equal(got, exp)
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    seq, pos = torch.arange(5, dtype=I32), torch.arange(5, dtype=I64) * 3
    eseq, epos = advance_positions_and_seq_lens_ref(seq.clone(), pos.clone(), 2)
    advance_positions_and_seq_lens(seq, pos, 2, kernels=kernels)
    assert torch.equal(seq, eseq) and torch.equal(pos, epos)


def test_launch_options_early_flag(monkeypatch):
    cpu = torch.device("cpu")
    off1 = {"PDL": False, "pdl_trigger": 1}
    assert pdl.launch_options(cpu, 1) == off1  # no EARLY for kernels without it
    assert pdl.launch_options(cpu, 1, early=True) == off1 | {"EARLY": True}  # interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pdl.launch_options(cpu, 1, early=True) == off1 | {"EARLY": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    off = TRITON.replace(pdl_early_loads=False)
    assert pdl.launch_options(cpu, 1, early=True, kernels=off) == off1 | {"EARLY": False}
