"""Programmatic dependent launch (PDL) for the draft chain's Triton kernels (CUDA only).

A kernel launched with PDL (`launch_pdl=True`) may start while the kernel before it on the
stream is still running, which hides the launch gap between the short kernels of a draft step.
It must wait (`griddepcontrol.wait`) before it touches memory: every chain kernel starts with
`pdl_enter(PDL)`, which waits for the previous kernel and then lets the next one launch, so at
most one kernel waits ahead. The GEMV waits first too but lets the next launch start only after
its K loop (`kernels.gemv`). Under CUDA graphs the launches become programmatic edges.

Early loads (`EARLY`, the kernels that take it: attention's split and combine, RoPE + KV store,
the uniform cache-location and advance kernels): a kernel may load, before `pdl_enter`, what
the kernel launched just before it does not write; that one may still be running, every
kernel before it has finished (it waited before letting this one launch). These kernels
load their metadata there: positions, cache locations, seq lens, request rows, the page table
and the rope table, which every caller writes at least two launches earlier (a forward's
metadata is written before its first layer runs; the drafter's refresh kernels run at least
two launches before the next RoPE and attention). Stores always come after `pdl_enter`.
`tests/test_pdl_order.py` traces the drafter's and the engine's launches and checks the rule.

Settings (`kernels/config.KernelConfig`, passed as `kernels=`; a launch without one uses
`kernel_config.default()`): `pdl` (off: the small kernels launch plainly; the GEMV has its own
switch, `gemv_pdl`), `pdl_max_rows` (small kernels over more rows launch plainly: 4, measured
on an H200, perf/RESULTS.md third session run 8: PDL on every small kernel took a draft call
from 642 to 633 us at bs 1, but from 685 to 710 us at bs 8; the cause at bs 8 is not known)
and `pdl_early_loads` (kernels that take `EARLY` load their metadata before waiting; off: after).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.config import default as default_config


def interpreting() -> bool:
    """Triton's interpreter is on (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def supported(device: torch.device) -> bool:
    """A CUDA device, not Triton's interpreter (which has no griddepcontrol)."""
    return device.type == "cuda" and not interpreting()


def launch_options(device: torch.device, rows: int, *, early: bool = False,
                   kernels: KernelConfig | None = None) -> dict:
    """Keyword arguments of a launch over `rows` rows under `kernels` (None: the default
    config): `PDL` (the constexpr) and `launch_pdl`; with `early` (a kernel that takes the
    `EARLY` constexpr) also `EARLY`: on with PDL, and under Triton's interpreter (where the
    wait is a no-op)."""
    kc = kernels if kernels is not None else default_config()
    on = kc.pdl and rows <= kc.pdl_max_rows and supported(device)
    opts = {"PDL": on, "launch_pdl": True} if on else {"PDL": False}
    if early:  # under the interpreter too: the CPU tests run the code small GPU batches run
        opts["EARLY"] = kc.pdl_early_loads and (on or interpreting())
    return opts


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a chain kernel: wait for the previous kernel, then let the next launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
