"""graphdraft.checks: each helper passes what it should, and each rejection kind names the
argument, the expectation and what it got."""

from __future__ import annotations

import re

import pytest
import torch

from graphdraft.checks import describe, expect_int, expect_one_of, expect_tensor, expectation


def test_expect_tensor_passes_and_returns_the_tensor():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert expect_tensor("x", x, shape=(4, 8), dtypes=torch.bfloat16, device="cpu",
                         layout="contiguous") is x
    assert expect_tensor("x", x, shape=(None, "N"), dtypes=(torch.float16, torch.bfloat16),
                         device=torch.device("cpu"), layout="rows") is x
    assert expect_tensor("x", x) is x  # nothing asked: any tensor


def test_expect_tensor_rejects_a_non_tensor():
    with pytest.raises(ValueError, match=r"^x: expected a \[4\] tensor, got list$"):
        expect_tensor("x", [0, 1, 2, 3], shape=(4,))


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(4, 8, 1)])
def test_expect_tensor_rejects_the_wrong_number_of_dims(bad):
    with pytest.raises(ValueError, match=r"^x: expected a \[4, \*\] tensor, got float32 \["):
        expect_tensor("x", bad, shape=(4, None))


def test_expect_tensor_rejects_a_wrong_size_and_names_free_sizes():
    with pytest.raises(ValueError, match=re.escape(
            "ws: expected a float32 [split, 3, 5] tensor, got float32 [2, 3, 6] on cpu")):
        expect_tensor("ws", torch.zeros(2, 3, 6), shape=("split", 3, 5), dtypes=torch.float32)


def test_expect_tensor_rejects_a_dtype_outside_the_set():
    with pytest.raises(ValueError, match=re.escape(
            "index: expected an int32/int64 [3] tensor, got float32 [3] on cpu")):
        expect_tensor("index", torch.zeros(3), shape=(3,), dtypes=(torch.int32, torch.int64))


def test_expect_tensor_rejects_the_wrong_device():
    # "meta" stands in for another device on a CPU-only machine
    t = torch.zeros(3, device="meta")
    with pytest.raises(ValueError, match=re.escape(
            "out: expected a [3] tensor on cpu, got float32 [3] on meta")):
        expect_tensor("out", t, shape=(3,), device=torch.device("cpu"))


def test_expect_tensor_rejects_a_non_contiguous_tensor():
    t = torch.zeros(8, 4).t()
    with pytest.raises(ValueError, match=re.escape(
            "w: expected a contiguous [4, 8] tensor, got float32 [4, 8] on cpu with strides (1, 4)")):
        expect_tensor("w", t, shape=(4, 8), layout="contiguous")


def test_rows_layout_is_unit_column_stride_with_any_row_stride():
    buf = torch.zeros(6, 16)
    view = buf[:4, 2:10]  # row stride 16, column stride 1: not contiguous, but rows
    assert not view.is_contiguous()
    assert expect_tensor("h_out", view, shape=(4, 8), layout="rows") is view
    with pytest.raises(ValueError, match=re.escape(
            "h_out: expected a [4, 8] tensor with unit column stride, got float32 [4, 8] on cpu "
            "with strides (1, 4)")):
        expect_tensor("h_out", torch.zeros(8, 4).t(), shape=(4, 8), layout="rows")
    # strict: a single column with a non-unit stride is not "rows" (callers relax it themselves)
    with pytest.raises(ValueError, match="^c: "):
        expect_tensor("c", torch.zeros(1, 3).t(), layout="rows")


def test_expect_tensor_rejects_an_unknown_layout():
    with pytest.raises(ValueError, match="^layout: expected one of"):
        expect_tensor("x", torch.zeros(2), layout="dense")


def test_expectation_reads_like_a_sentence():
    assert (expectation(shape=(4, 64), dtypes=torch.bfloat16, device="cuda:0", layout="contiguous")
            == "a contiguous bfloat16 [4, 64] tensor on cuda:0")
    assert expectation() == "a tensor"
    assert describe(3) == "int"


def test_expect_int_passes_in_range():
    assert expect_int("n", 3, 0, 3) == 3
    assert expect_int("n", 0, 0) == 0
    assert expect_int("n", -7) == -7
    assert expect_int("n", 5, hi=5) == 5


@pytest.mark.parametrize("value, lo, hi, want", [
    (True, 0, None, "an int >= 0"),        # a bool is not an int here
    (1.0, 0, None, "an int >= 0"),         # nor is a float
    ("2", None, None, "an int"),
    (-1, 0, None, "an int >= 0"),          # below lo
    (9, 0, 8, "an int in [0, 8]"),         # above hi
    (9, None, 8, "an int <= 8"),
])
def test_expect_int_rejects(value, lo, hi, want):
    with pytest.raises(ValueError, match="^n: expected " + re.escape(want) + ", got " + re.escape(repr(value)) + "$"):
        expect_int("n", value, lo, hi)


def test_expect_one_of():
    assert expect_one_of("act", None, (None, "silu_mul")) is None
    with pytest.raises(ValueError, match=re.escape("act: expected one of [None, 'silu_mul'], got 'gelu'")):
        expect_one_of("act", "gelu", (None, "silu_mul"))


def test_a_device_without_an_index_matches_its_type():
    t = torch.zeros(2)
    assert expect_tensor("t", t, device="cpu") is t
    assert expect_tensor("t", t, device=torch.device("cpu")) is t
    with pytest.raises(ValueError, match=re.escape("t: expected a tensor on cuda, got float32 [2] on cpu")):
        expect_tensor("t", t, device="cuda")
    # an index must match exactly (cuda:0 vs a cuda:1 tensor cannot be built here; meta vs cpu
    # stands in for "another device")
    with pytest.raises(ValueError, match="^t: expected a tensor on meta, got"):
        expect_tensor("t", t, device="meta")


def test_expectation_article():
    assert expectation(dtypes=torch.int64) == "an int64 tensor"
    assert expectation(dtypes=torch.uint8) == "a uint8 tensor"
    assert expectation(shape=(2,)) == "a [2] tensor"


# The kernel wrappers speak through these helpers: one rejection per family, pinned to the
# argument's name, the expectation and what was passed (all raise before any launch).
def _kernel_rejections():
    from graphdraft.kernels.argmax import argmax_with_map
    from graphdraft.kernels.cache_loc import compute_out_cache_loc_uniform
    from graphdraft.kernels.decode_attention import paged_decode_attention
    from graphdraft.kernels.fused_inputs import SplitK
    from graphdraft.kernels.gemv import linear_small_m, linear_small_m_residual_norm
    from graphdraft.kernels.norm import rms_norm, rms_norm_cat
    from graphdraft.kernels.rope import rope_and_store_kv_partials

    i32, i64 = torch.int32, torch.int64
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    kv = torch.zeros(16, 2, 4)
    return [
        (lambda: linear_small_m(x, w, torch.empty(2, 4)),
         "out: expected a float32 [2, 3] tensor with unit column stride, got float32 [2, 4] on cpu"),
        (lambda: linear_small_m_residual_norm(x, w, torch.randn(5, 3), torch.ones(3), 1e-5,
                                              residual_index=torch.zeros(2)),
         "residual_index: expected a contiguous int32/int64 [2] tensor on cpu, got float32 [2]"),
        (lambda: argmax_with_map(torch.randn(4, 10), tokens_out=torch.empty(3, dtype=i32)),
         "tokens_out: expected an int32/int64 [4] tensor on cpu, got int32 [3] on cpu"),
        (lambda: rms_norm(x, torch.ones(8), 1e-5, out=torch.empty(8, 2).t()),
         "out: expected a float32 [2, 8] tensor on cpu with unit column stride, "
         "got float32 [2, 8] on cpu with strides (1, 2)"),
        (lambda: rms_norm_cat(x, torch.ones(8), 1e-5, SplitK(torch.zeros(1, 2, 8), torch.float32),
                              torch.ones(8), 1e-5),
         "b_out: expected a float32 [2, 8] tensor on cpu, got NoneType"),
        (lambda: rope_and_store_kv_partials(SplitK(torch.zeros(1, 2, 24, dtype=torch.float16),
                                                   torch.float32),
                                            torch.zeros(2, dtype=i64), torch.zeros(8, 4), kv, kv,
                                            torch.zeros(2, dtype=i64)),
         "qkv: expected a contiguous float32 [split, 2, 24] tensor on cpu, got float16 [1, 2, 24]"),
        (lambda: compute_out_cache_loc_uniform(torch.zeros(4, dtype=i64), torch.zeros(2, dtype=i32),
                                               torch.zeros(2, dtype=i32),
                                               torch.ones(3, 4, dtype=i32), 0, 2),
         "page_size: expected an int >= 1, got 0"),
        (lambda: paged_decode_attention(torch.zeros(2, 4, 4, dtype=torch.float64), kv, kv,
                                        torch.zeros(2, dtype=i32), torch.ones(2, dtype=i32),
                                        torch.ones(3, 4, dtype=i32), 1, 1.0, max_kv_len=4),
         "q: expected a float32/float16/bfloat16 [T, Hq, D] tensor with unit column stride, "
         "got float64 [2, 4, 4]"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_kernel_wrappers_use_the_common_wording(case):
    call, message = _kernel_rejections()[case]
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        call()


def test_kernel_wrappers_keep_their_layout_edges():
    """What was accepted before the move still is: a column stride nobody reads is free."""
    from graphdraft.kernels.argmax import argmax_with_map
    from graphdraft.kernels.norm import rms_norm, rms_norm_torch

    # no rows: argmax reads no column, any column stride passes
    empty = torch.empty_strided((0, 5), (1, 3))
    assert argmax_with_map(empty).shape == (0,)
    # one column: RMSNorm never steps along it
    x = torch.randn(2, 2)[:, :1].t().contiguous().t()  # [2, 1] with strides (1, 2)
    assert x.stride() == (1, 2)
    w = torch.ones(1)
    assert torch.allclose(rms_norm(x, w, 1e-5), rms_norm_torch(x, w, 1e-5))
    # but gemv's x must have unit column stride even for one column (as before)
    from graphdraft.kernels.gemv import linear_small_m
    with pytest.raises(ValueError, match=r"^x: expected a \[M, K\] tensor with unit column stride"):
        linear_small_m(x, torch.randn(3, 1))
