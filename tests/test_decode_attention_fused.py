"""Decode attention's fused combine (`KernelConfig.decode_fused_combine`, issue #42): one launch
in which the last split program of each (row, kv head) combines that kv head's query heads.

CPU (Triton's interpreter, BLOCK_N 16): the fused form against the two-launch form and the torch
reference over rows of different lengths (1, rows that reach only some splits, rows past a
block / page edge), GQA groups 1, 3, 4 and 8, row splits on and off, the q_index gather, the
beams' extra slots, fp32 and bf16. Fused == two-launch is asserted bitwise here: the same
partials feed the same `combine_row` in the same order (the interpreter evaluates both with
the same numpy operations); on a GPU the two compiled kernels may round differently, so the
GPU test allows fp32 rounding. After every fused call the split counters are all zero (the
contract a replayed graph relies on); a second call gives the same output. The interpreter
runs a grid's programs one after the other, so there the last to arrive is always split 0;
the GPU test covers arbitrary arrival orders. GPU: a captured fused launch replayed over new
lengths equals the eager two-launch form and the reference.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from graphdraft.kernels import decode_attention as da
from graphdraft.kernels.config import TRITON, KernelConfig
from graphdraft.kernels.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    split_counters,
)
from graphdraft.runtime.kv_cache import kv_slot

HAS_CUDA = torch.cuda.is_available()
SMALL = TRITON.replace(decode_block_n=16)
FUSED = SMALL.replace(decode_fused_combine=True)
TOL = {torch.float32: dict(rtol=1e-5, atol=2e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _pool(lens: dict[int, int], hkv: int, d: int, page_size: int, dtype, max_len: int,
          g: torch.Generator, extra: int = 0):
    """Shuffled pages (page 0 unused), NaN everywhere but positions [0, lens[r] + extra) of each
    request r (the last `extra`: room for the beams' slots past the longest row): a read past
    them shows as NaN, a read of a filled position a row must not see as a difference from the
    reference."""
    per = math.ceil((max_len + extra) / page_size) + 1
    reqs = max(lens) + 1
    r2p = (torch.randperm(reqs * per, generator=g) + 1).view(reqs, per).to(torch.int32)
    kc = torch.full(((reqs * per + 1) * page_size, hkv, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    for r, n in lens.items():
        slots = kv_slot(r2p, r, torch.arange(n + extra), page_size)
        kc[slots] = torch.randn(n + extra, hkv, d, generator=g).to(dtype)
        vc[slots] = torch.randn(n + extra, hkv, d, generator=g).to(dtype)
    return kc, vc, r2p


def _counters_zero(device) -> None:
    buf = da._COUNTERS.get(torch.device(device))
    assert buf is not None, "a fused launch with several splits made no counters"
    assert int(buf.count_nonzero()) == 0, "the split counters were not reset"


# (G, Hkv, dtype, row_splits, gather, extra, page_size, splits): every G, both dtypes, row splits
# on and off, gather and extra slots each on and off at least twice; splits None: the rule's.
CASES = [
    (1, 2, torch.float32, True, False, False, 4, 6),
    (3, 2, torch.bfloat16, False, True, False, 16, 5),
    (4, 1, torch.float32, False, False, True, 1, 7),
    (8, 1, torch.bfloat16, True, True, True, 4, 6),
    (4, 2, torch.bfloat16, True, False, True, 16, None),
    (8, 1, torch.float32, False, True, False, 4, 3),
    (3, 1, torch.float32, True, True, True, 1, 4),
    (1, 1, torch.bfloat16, False, False, False, 4, 8),
]


@pytest.mark.parametrize("G,hkv,dtype,row_splits,gather,extra,page_size,splits", CASES)
def test_fused_equals_two_launch_and_reference(G, hkv, dtype, row_splits, gather, extra,
                                               page_size, splits):
    """Random rows (lengths 1, short rows reaching only the first splits, one long row), then
    new lengths at the same host arguments (a replay), each call fused twice."""
    seed = G * 100 + hkv * 10 + int(row_splits) * 4 + int(gather) * 2 + int(extra)
    g = torch.Generator().manual_seed(seed)
    bound, d, width, num_extra = 120, 16, 3, 2 if extra else 0
    rows = 4
    reqs = torch.randperm(6, generator=g)[:rows] + 1
    lens = {int(r): bound for r in reqs}
    kc, vc, r2p = _pool(lens, hkv, d, page_size, dtype, bound, g, extra=width)
    req = reqs.to(torch.int64 if gather else torch.int32)
    for kv in ([1, 37, bound, 5], [bound - 3, 1, 16, 17]):
        kv_lens = torch.tensor(kv, dtype=torch.int32)
        q_rows = rows + 2 if gather else rows
        q = torch.randn(q_rows, G * hkv, d, generator=g).to(dtype)
        q_index = torch.randperm(q_rows, generator=g)[:rows] if gather else None
        extra_slots = (torch.stack([kv_slot(r2p, int(r), torch.arange(n, n + width), page_size)
                                    for r, n in zip(reqs, kv, strict=True)])
                       if extra else None)
        args = (q, kc, vc, req, kv_lens, r2p, page_size, 0.3)
        kw = dict(max_kv_len=bound, num_splits=splits, row_splits=row_splits, q_index=q_index,
                  extra_slots=extra_slots, num_extra=num_extra)
        ref = paged_decode_attention_ref(*args, max_kv_len=bound, q_index=q_index,
                                         extra_slots=extra_slots, num_extra=num_extra)
        assert not ref.isnan().any()
        two = paged_decode_attention(*args, **kw, kernels=SMALL)
        for _ in range(2):  # the counters left at zero: the second call is the first's equal
            out = torch.full_like(two, float("nan"))  # an unwritten head would stay NaN
            paged_decode_attention(*args, **kw, out=out, kernels=FUSED)
            _counters_zero("cpu")
            assert torch.equal(out, two)
            torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_fused_without_early_loads_and_past_the_bound():
    """The non-EARLY prologue (PDL early loads off) and rows longer than max_kv_len (the last
    split takes the rest): still one combine per (row, kv head), counters back at zero."""
    g = torch.Generator().manual_seed(7)
    kc, vc, r2p = _pool({1: 150, 2: 150}, 2, 16, 4, torch.float32, 150, g)
    q = torch.randn(3, 8, 16, generator=g)
    args = (q, kc, vc, torch.tensor([1, 2, 1]), torch.tensor([150, 3, 64], dtype=torch.int32),
            r2p, 4, 0.25)
    ref = paged_decode_attention_ref(*args, max_kv_len=150)
    for row_splits in (False, True):
        for early in (False, True):
            kc_cfg = FUSED.replace(pdl_early_loads=early)
            out = paged_decode_attention(*args, max_kv_len=40, num_splits=3, row_splits=row_splits,
                                         kernels=kc_cfg)
            _counters_zero("cpu")
            two = paged_decode_attention(*args, max_kv_len=40, num_splits=3,
                                         row_splits=row_splits, kernels=SMALL)
            assert torch.equal(out, two)
            torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_fused_with_one_split_is_the_one_split_launch():
    """One split: the fused flag changes nothing (stage 1 writes the output; no counter)."""
    g = torch.Generator().manual_seed(3)
    kc, vc, r2p = _pool({1: 40, 2: 40}, 2, 16, 4, torch.bfloat16, 40, g)
    q = torch.randn(2, 4, 16, generator=g).to(torch.bfloat16)
    args = (q, kc, vc, torch.tensor([1, 2]), torch.tensor([40, 9], dtype=torch.int32), r2p, 4, 0.25)
    one = paged_decode_attention(*args, max_kv_len=40, num_splits=1, kernels=SMALL)
    assert torch.equal(paged_decode_attention(*args, max_kv_len=40, num_splits=1, kernels=FUSED),
                       one)


def test_split_counters_grow_keep_the_old_buffer_and_refuse_capture(monkeypatch):
    """A larger need makes a larger zero buffer and keeps the smaller one alive (a graph may
    hold its address); a smaller need reuses the kept one; none is made while capturing."""
    dev = torch.device("cpu")
    monkeypatch.setattr(da, "_COUNTERS", {})
    monkeypatch.setattr(da, "_RETIRED", [])
    first = split_counters(dev, 10)
    assert first.dtype == torch.int32 and first.numel() == da.COUNTERS_MIN
    assert not first.any()
    assert split_counters(dev, da.COUNTERS_MIN) is first
    bigger = split_counters(dev, da.COUNTERS_MIN + 1)
    assert bigger.numel() == 2 * da.COUNTERS_MIN and not bigger.any()
    assert da._RETIRED == [first] and split_counters(dev, 5) is bigger
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="eagerly before capturing"):
        split_counters(torch.device("cuda", 0), 8)


def test_fused_flag_is_a_validated_config_field_off_by_default():
    assert KernelConfig().decode_fused_combine is False
    assert TRITON.replace(decode_fused_combine=True).decode_fused_combine is True
    with pytest.raises(ValueError, match="decode_fused_combine"):
        KernelConfig(decode_fused_combine=1)


def test_fused_config_has_one_split_kernel_key_and_no_combine_launch():
    """Under a fused config every mode (one split or several, gathered q rows or not) launches
    one stage-1 key, and several splits launch no combine kernel; the unfused config's key is
    another one (FUSE is a constexpr: module doc)."""
    from perf.compile_census import gpu_dry_keys

    hq, hkv, d, page, bound = 32, 8, 128, 16, 4096
    kc = torch.zeros(64 * page, hkv, d, dtype=torch.bfloat16)
    r2p = torch.zeros(8, bound // page, dtype=torch.int32)

    def run(cfg):
        def go():
            for rows in (1, 64):  # 64 rows x 8 kv heads fill the GPU: one split
                req = torch.zeros(rows, dtype=torch.int64)
                lens = torch.ones(rows, dtype=torch.int32)
                for q_index in (None, torch.arange(rows)):
                    q = torch.zeros(rows, hq, d, dtype=torch.bfloat16)
                    paged_decode_attention(q, kc, kc, req, lens, r2p, page, 0.1, max_kv_len=bound,
                                           q_index=q_index, kernels=cfg)
        return gpu_dry_keys(go)

    name = "decode_attention._decode_split_kernel"
    fused, plain = run(TRITON.replace(decode_fused_combine=True)), run(TRITON)
    assert fused.launches[name] == 4 and len(fused.keys[name]) == 1
    assert fused.launches.get("decode_attention._combine_kernel", 0) == 0
    assert plain.launches["decode_attention._combine_kernel"] == 2
    assert fused.keys[name] != plain.keys[name]


def test_perf_long_compares_both_forms_in_one_run(tmp_path):
    """`perf.long --attention-only --fused-combine both`: on the Triton path each row gets the
    fused decode columns (at the rule's split count and the sweep's) beside the two-launch
    ones; the JSON names the mode; `both` without --attention-only is refused. (CPU timings
    mean nothing: only the columns are checked.)"""
    import json

    from perf import long as perf_long

    setup = perf_long.Setup(**{**perf_long.TINY, "kv_lens": (40,), "batch_sizes": (1,),
                               "long_kv": None, "blocks": 1, "block": 1, "new_tokens": 24})
    groups, _ = perf_long.plan_groups(setup, float(8 << 30))
    (row,) = perf_long.attention_rows(setup, groups, 1e9, SMALL, compare_fused=True)
    assert row["attention_fused_ms"] > 0
    assert row["attention_fused_over_floor"] == pytest.approx(
        row["attention_fused_ms"] / row["attention_floor_ms"])
    assert row["attention_fused_speedup"] == pytest.approx(
        row["attention_ms"] / row["attention_fused_ms"])
    default = row["attention_splits_default"]
    assert default > 1 and row[f"attention_fused_ms[splits{default}]"] > 0
    sweep = lambda key: {k.removeprefix(key) for k in row if k.startswith(key + "[")}
    assert sweep("attention_fused_ms") == sweep("attention_ms")
    assert not any(k.startswith("verify_attention_fused") for k in row)  # decode only
    _counters_zero("cpu")

    assert perf_long.main(["--tiny", "--attention-only", "--no-long-row", "--out", str(tmp_path),
                           "--tag", "t", "--kv", "32", "--bs", "1", "--fused-combine",
                           "both"]) == 0
    doc = json.loads((tmp_path / "t-cpu-long-attention.json").read_text())
    assert doc["decode_fused_combine"] == "both" and "goal_misses_fused" in doc
    with pytest.raises(SystemExit):
        perf_long.parse_args(["--fused-combine", "both"])
    assert perf_long.engine_config(replace(setup, fused_combine=True),
                                   groups).kernels.decode_fused_combine


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("row_splits", [True, False])
def test_gpu_fused_graph_replays_equal_eager_and_reference(bs, row_splits):
    """The 8B head shape (32 / 8 heads, D 128), a 32k bound: a captured fused launch replayed
    over new lengths (some rows reaching a few splits, some all) equals the eager two-launch
    form (within fp32 rounding: two compiled kernels) and the reference; the counters are zero
    after every replay."""
    dev, dtype = "cuda", torch.bfloat16
    bound, ps = 32768 + 64, 16
    per = bound // ps
    r2p = torch.zeros(bs + 1, per, dtype=torch.int32, device=dev)
    r2p[1:] = (torch.randperm(bs * per, device=dev) + 1).view(bs, per).to(torch.int32)
    kc = torch.randn((bs * per + 1) * ps, 8, 128, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    q = torch.randn(bs, 32, 128, device=dev, dtype=dtype)
    req = torch.arange(1, bs + 1, device=dev)
    kv_lens = torch.full((bs,), 100, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    fused = TRITON.replace(decode_fused_combine=True)
    call = lambda: paged_decode_attention(q, kc, vc, req, kv_lens, r2p, ps, 0.088,
                                          max_kv_len=bound, out=out, row_splits=row_splits,
                                          kernels=fused)
    call()  # eager first: makes the counters outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    gen = torch.Generator(device=dev).manual_seed(bs)
    for n in (100, 4096, 5000, 32768, 1, 20000):
        kv_lens.copy_(torch.randint(max(1, n // 2), n + 1, (bs,), device=dev, dtype=torch.int32,
                                    generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _counters_zero(torch.device(dev, torch.cuda.current_device()))
        eager = paged_decode_attention(q, kc, vc, req, kv_lens, r2p, ps, 0.088, max_kv_len=bound,
                                       row_splits=row_splits, kernels=TRITON)
        ref = paged_decode_attention_ref(q, kc, vc, req, kv_lens, r2p, ps, 0.088, max_kv_len=n)
        torch.testing.assert_close(out.float(), eager.float(), rtol=8e-3, atol=1e-5)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
