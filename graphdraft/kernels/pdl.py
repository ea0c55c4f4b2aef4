"""Programmatic dependent launch (PDL, Hopper and newer) for the draft step's kernel chain.

A draft step is a chain of short kernels, each waiting for the one before. With PDL a
kernel launched with `launch_pdl=True` may be scheduled while its predecessor still
runs: every participating kernel first calls `gdc_launch_dependents()` (so its
successor may be scheduled once all of its programs started), does the work that
reads nothing the predecessor writes (the GEMV loads its first weight tile), then
`gdc_wait()`s (the predecessor finished and its writes are visible) before any other
load or store. A kernel after a non-PDL one (a torch op) simply starts when it ends.
CUDA-graph capture keeps the programmatic edges.

`GRAPHDRAFT_PDL=0` turns it off (read at every launch, like GRAPHDRAFT_EAGER: graphs
captured before a change keep what they captured). Off on CPU, under the Triton
interpreter and before compute capability 9.0.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "GRAPHDRAFT_PDL"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Launch this device's draft kernels with PDL?"""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get(ENV, "1").strip() in ("0", "false", "off", ""):
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())
