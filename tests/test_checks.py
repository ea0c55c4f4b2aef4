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
            "index: expected a int32/int64 [3] tensor, got float32 [3] on cpu")):
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
