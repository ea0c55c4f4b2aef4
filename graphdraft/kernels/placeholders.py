"""Typed placeholder tensors for pointer arguments a launch's mode does not read.

A Triton kernel is compiled once per distinct argument signature, and a pointer's dtype is part
of it: a kernel whose unused pointers were filled with whatever tensor was at hand (the output
in one mode, the fp32 workspace in another) compiled once per mode even where the mode itself
is a runtime flag. `placeholder(device, dtype)` is one small tensor per (device, dtype), made
once and kept (so a CUDA graph that captured its address can replay), 16-byte aligned like
every allocation; a kernel never reads or writes it. A device's first request makes the
placeholders of every kernel dtype at once (the first launches of an engine run eagerly, so
none is first made while a graph is being captured).
"""

from __future__ import annotations

import torch

__all__ = ["placeholder"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64)
_PLACEHOLDERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def placeholder(device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """The kept placeholder `[16]` of `dtype` on `device` (zeros; never accessed by a kernel).
    One dict lookup once made (launch wrappers call it per launch)."""
    t = _PLACEHOLDERS.get((device, dtype))
    if t is not None:
        return t
    dev = torch.device(device)
    floating = dev.type == "cuda" and dev.index is None  # "cuda": the current device's
    if floating:
        dev = torch.device("cuda", torch.cuda.current_device())
    for dt in {*_DTYPES, dtype}:
        if (dev, dt) not in _PLACEHOLDERS:
            _PLACEHOLDERS[(dev, dt)] = torch.zeros(16, dtype=dt, device=dev)
    t = _PLACEHOLDERS[(dev, dtype)]
    if not floating:
        _PLACEHOLDERS[(device, dtype)] = t  # the caller's spelling ("cpu") finds it at once
    return t
