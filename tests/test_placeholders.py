"""Typed placeholder tensors (`graphdraft.kernels.placeholders`): one kept tensor per device and
dtype, all of a device's made at its first request."""

from __future__ import annotations

import pytest
import torch

from graphdraft.kernels import placeholders
from graphdraft.kernels.placeholders import placeholder


def test_one_kept_tensor_per_device_and_dtype():
    a = placeholder("cpu", torch.int64)
    assert a.dtype == torch.int64 and a.device.type == "cpu" and a.shape == (16,)
    assert a.data_ptr() % 16 == 0 and not a.any()
    assert placeholder(torch.device("cpu"), torch.int64) is a  # kept: a graph may hold it
    made = {dt for (dev, dt) in placeholders._PLACEHOLDERS if torch.device(dev).type == "cpu"}
    assert made >= {torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64}
    assert placeholder("cpu", torch.float32) is not a
    odd = placeholder("cpu", torch.uint8)  # a dtype outside the set: made on its request
    assert odd.dtype == torch.uint8 and placeholder("cpu", torch.uint8) is odd


@pytest.mark.gpu
def test_cuda_placeholders_resolve_the_current_device():
    assert placeholder("cuda", torch.int32) is placeholder(
        torch.device("cuda", torch.cuda.current_device()), torch.int32)
