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
switch, `gemv_pdl`), `pdl_max_rows` (small kernels over more rows do not let the next kernel
launch early: 4, measured on an H200, perf/RESULTS.md third session run 8: PDL on every small
kernel sped a draft call up at bs 1 but slowed it at bs 8; the cause at bs 8 is not known) and `pdl_early_loads` (kernels that take `EARLY` load their
metadata before waiting; off: after). Every launch on CUDA carries the PDL attribute and the
row limit is a runtime argument (`pdl_trigger`), so one compiled variant serves every batch
size (a constexpr and a launch option per side of the limit had compiled each kernel twice).
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
    config): `PDL` (the constexpr), `launch_pdl` (with PDL), `pdl_trigger` (a runtime int:
    1 lets the next kernel launch as soon as this one has waited, for `rows` up to
    `kernels.pdl_max_rows`; 0 lets it launch only once this one's programs have ended, as a
    plain launch would); with `early` (a kernel that takes the `EARLY` constexpr) also
    `EARLY`: on with PDL, and under Triton's interpreter (where the wait is a no-op). Every
    size launches the same compiled variant: only `pdl_trigger` depends on `rows`."""
    kc = kernels if kernels is not None else default_config()
    on = kc.pdl and supported(device)
    opts = {"PDL": on, "pdl_trigger": int(rows <= kc.pdl_max_rows)}
    if on:
        opts["launch_pdl"] = True
    if early:  # under the interpreter too: the CPU tests run the code small GPU batches run
        opts["EARLY"] = kc.pdl_early_loads and (on or interpreting())
    return opts


@triton.jit
def pdl_enter(PDL: tl.constexpr, trigger):
    """First statement of a chain kernel: wait for the previous kernel, then (`trigger` != 0)
    let the next launch; with `trigger` 0 the next one launches once this one's programs end."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if trigger != 0:
            tl.extra.cuda.gdc_launch_dependents()
