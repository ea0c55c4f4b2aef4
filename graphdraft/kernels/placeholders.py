"""Typed placeholder tensors for pointer arguments a launch's mode does not read.

A Triton kernel is compiled once per distinct argument signature, and a pointer's dtype is part
of it: a kernel whose unused pointers were filled with whatever tensor was at hand (the output
in one mode, the fp32 workspace in another) compiled once per mode even where the mode itself
is a runtime flag. `placeholder(device, dtype)` is one small tensor per (device, dtype), made
once and kept (so a CUDA graph that captured its address can replay), 16-byte aligned like
every allocation; a kernel never reads or writes it.
"""

from __future__ import annotations

import torch

__all__ = ["placeholder"]

_PLACEHOLDERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def placeholder(device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """The kept placeholder `[16]` of `dtype` on `device` (zeros; never accessed by a kernel)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.zeros(16, dtype=dtype, device=device)
    return t
