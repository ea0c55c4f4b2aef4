"""L2 prefetch of a weight's leading bytes on a side stream, while small kernels run.

A draft step at small batch alternates HBM-bound GEMVs with short, launch-bound
kernels (norm, RoPE + KV write, attention, argmax) during which HBM sits idle.
`WeightPrefetcher.prefetch(w, nbytes)` forks a side stream from the current one
(the prefetch starts once everything queued so far, the GEMV before it included, is
done) and issues `prefetch.global.L2` for the first `nbytes` of `w`, one per 128-byte
line; the next GEMV over `w` then finds those lines in L2. `join()` makes the current
stream wait for the side stream (a CUDA graph capture must end joined). Captured in a
graph, the prefetch is a parallel branch; run eagerly, the same stream fork.

Nothing is written and no value changes: a prefetch only moves lines into L2. GPU
only: on CPU and under TRITON_INTERPRET (no inline PTX there) it does nothing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LINE = 128  # bytes per prefetch instruction (an L2 line)
LINES_PER_PROGRAM = 1024  # 128 KiB per program: 8 prefetches per thread at 4 warps


@triton.jit
def _prefetch_l2_kernel(base_ptr, nbytes, sink_ptr, BLOCK: tl.constexpr, LINE_BYTES: tl.constexpr):
    """Program p issues L2 prefetches for bytes `[p * BLOCK * LINE_BYTES, ...)` of `base`
    (uint8), one per line, clamped to `nbytes`."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * (BLOCK * LINE_BYTES) + tl.arange(0, BLOCK).to(tl.int64) * LINE_BYTES
    offs = tl.minimum(offs, nbytes - 1)
    r = tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [base_ptr + offs], dtype=tl.int32, is_pure=False, pack=1)
    # r is always 0: the store never happens, it only keeps the asm from being dropped
    tl.store(sink_ptr + tl.arange(0, BLOCK), r, mask=r != 0)


def supported(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def prefetch_l2(w: torch.Tensor, nbytes: int, sink: torch.Tensor) -> None:
    """Prefetch the first `min(nbytes, w's bytes)` of contiguous `w` into L2 on the current
    stream; `sink` int32 `[LINES_PER_PROGRAM]` on `w`'s device (never written)."""
    if not w.is_contiguous():
        raise ValueError(f"w: expected a contiguous tensor, got strides {w.stride()}")
    nbytes = min(int(nbytes), w.numel() * w.element_size())
    if nbytes <= 0 or not supported(w.device):
        return
    grid = (triton.cdiv(nbytes, LINES_PER_PROGRAM * LINE),)
    _prefetch_l2_kernel[grid](w.view(-1).view(torch.uint8), nbytes, sink,
                              BLOCK=LINES_PER_PROGRAM, LINE_BYTES=LINE, num_warps=4)


class WeightPrefetcher:
    """Side-stream L2 prefetches of weights, joined back into the current stream on `join()`.

    `budget` bytes per `prefetch` call at most (0: off). Keep it under the L2 size (50 MB
    on an H100/H200): lines prefetched past it evict each other before the GEMV reads them.
    """

    def __init__(self, budget: int = 0) -> None:
        self.budget = int(budget)
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        self._sink: dict[torch.device, torch.Tensor] = {}
        self._forked: set[torch.device] = set()

    def prefetch(self, w: torch.Tensor, nbytes: int | None = None) -> None:
        """Fork a side stream off the current one and prefetch `min(nbytes, budget)` leading
        bytes of `w` there (no-op when off, on CPU, or interpreting)."""
        nbytes = self.budget if nbytes is None else min(int(nbytes), self.budget)
        if nbytes <= 0 or not supported(w.device):
            return
        dev = w.device
        if dev not in self._side:
            self._side[dev] = torch.cuda.Stream(dev)
            self._sink[dev] = torch.zeros(LINES_PER_PROGRAM, dtype=torch.int32, device=dev)
        side = self._side[dev]
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            prefetch_l2(w, nbytes, self._sink[dev])
        self._forked.add(dev)

    def join(self) -> None:
        """Make each current stream wait for the prefetches forked off it."""
        for dev in self._forked:
            torch.cuda.current_stream(dev).wait_stream(self._side[dev])
        self._forked.clear()
