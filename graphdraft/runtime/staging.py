"""Host values to the device without a host sync: a ring of pinned staging memory.

A Python number or list written into a CUDA tensor the plain way (`t[i] = 0`, `t.copy_(
torch.tensor(values))`, `torch.tensor(values, device="cuda")`) copies from pageable memory:
the copy waits for the stream, so the host stalls behind every launched step. `pin_memory()`
per copy avoids the wait but pays a pinned allocation each time. `HostStaging` keeps one
pinned buffer and hands out regions of it in order; each region's copy is stream-ordered
(`non_blocking`), and a region is written again only after the copies issued from it have
completed (one event per segment of the buffer, recorded when the writer moves past it:
with the default sizes that wait is almost always already over).

On a CPU device the same calls are plain tensor copies (nothing is pinned).
Not for use while a CUDA graph is being captured (a captured copy would replay from a region
the ring reuses): `RuntimeError` then.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 16  # bytes: every region starts aligned for any dtype used here

Values = Sequence[int] | Sequence[float] | np.ndarray


class HostStaging:
    """Pinned staging ring for stream-ordered host -> `device` copies of small host values.

    `capacity` bytes in `segments` equal segments (a request larger than one segment is
    copied through its own pinned tensor instead)."""

    def __init__(self, device: str | torch.device, capacity: int = 1 << 21,
                 segments: int = 4) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if segments < 2 or capacity < segments * _ALIGN:
            raise ValueError(f"segments / capacity: expected >= 2 segments of >= {_ALIGN} "
                             f"bytes, got {segments} / {capacity}")
        self.segment_bytes = capacity // segments // _ALIGN * _ALIGN
        self.segments = segments
        self._buf = torch.empty(self.segment_bytes * segments, dtype=torch.uint8,
                                pin_memory=self.cuda)
        self._np = self._buf.numpy()
        self._seg, self._off = 0, 0
        self._events: list[list[torch.cuda.Event]] = [[] for _ in range(segments)]
        self._streams: set[torch.cuda.Stream] = set()  # streams that copied from this segment

    # --- public ---------------------------------------------------------------------------
    def tensor(self, values: Values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A new device tensor `[len(values)]` of `dtype` holding `values` (one copy)."""
        return self.pack((values, dtype))[0]

    def copy_into(self, dst: torch.Tensor, values: Values) -> torch.Tensor:
        """`dst[:len(values)] = values` (`dst` a 1-D device tensor; its dtype); returns that
        view."""
        n = len(values)
        out = dst[:n]
        if n == 0:
            return out
        if not self.cuda:
            _np_dtype(dst.dtype)
            out.copy_(torch.as_tensor(np.asarray(values), dtype=dst.dtype))
            return out
        (src,) = self._stage([(values, dst.dtype)])
        out.copy_(src, non_blocking=True)
        self._used()
        return out

    def pack(self, *pieces: tuple[Values, torch.dtype]) -> list[torch.Tensor]:
        """Each `(values, dtype)` as a new 1-D device tensor, all through one copy."""
        for _, dt in pieces:
            _np_dtype(dt)
        if not self.cuda:
            return [torch.as_tensor(np.asarray(v), dtype=dt).reshape(-1).to(self.device)
                    for v, dt in pieces]
        staged = self._stage(pieces)
        if not staged:
            return [torch.empty(0, dtype=dt, device=self.device) for _, dt in pieces]
        if not self._is_ring(staged[0]):  # over one segment: each its own pinned tensor
            return [s.to(self.device, non_blocking=True) for s in staged]
        # byte offsets in the ring from storage offsets (an empty view's data_ptr() is 0)
        offs = [s.storage_offset() * s.element_size() for s in staged]
        start = offs[0]
        end = max(o + s.nbytes for o, s in zip(offs, staged, strict=True))
        dev = torch.empty(end - start, dtype=torch.uint8, device=self.device)
        dev.copy_(self._buf[start:end], non_blocking=True)
        self._used()
        return [dev[o - start: o - start + s.nbytes].view(dt)
                for o, s, (_, dt) in zip(offs, staged, pieces, strict=True)]

    # --- the ring ---------------------------------------------------------------------------
    def _stage(self, pieces) -> list[torch.Tensor]:
        """Write `pieces` into consecutive aligned regions of the pinned buffer; returns the
        pinned views (a larger request: its own pinned tensors)."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("HostStaging: a host copy while a CUDA graph is being captured")
        arrays = [np.asarray(v, dtype=_np_dtype(dt)).reshape(-1) for v, dt in pieces]
        sizes = [-(-a.nbytes // _ALIGN) * _ALIGN for a in arrays]
        total = sum(sizes)
        if total == 0:
            return []
        if total > self.segment_bytes:
            return [torch.from_numpy(a).pin_memory() for a in arrays]
        off = self._reserve(total)
        views = []
        for a, size in zip(arrays, sizes, strict=True):
            region = self._np[off: off + a.nbytes].view(a.dtype)
            region[:] = a
            views.append(self._buf[off: off + a.nbytes].view(_torch_dtype(a.dtype)))
            off += size
        return views

    def _reserve(self, nbytes: int) -> int:
        """Byte offset of a free region of `nbytes` (<= one segment)."""
        end_of_segment = (self._seg + 1) * self.segment_bytes
        if self._off + nbytes > end_of_segment:
            self._events[self._seg] = [self._record(s) for s in self._streams]
            self._streams = set()
            self._seg = (self._seg + 1) % self.segments
            for ev in self._events[self._seg]:  # the copies last issued from this segment
                ev.synchronize()
            self._events[self._seg] = []
            self._off = self._seg * self.segment_bytes
        off = self._off
        self._off += nbytes
        return off

    def _is_ring(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == self._buf.untyped_storage().data_ptr()

    def _used(self) -> None:
        self._streams.add(torch.cuda.current_stream(self.device))

    @staticmethod
    def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev


_NP = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
       torch.int16: np.int16, torch.uint8: np.uint8, torch.float64: np.float64}
_TORCH = {np.dtype(v): k for k, v in _NP.items()}


def _np_dtype(dtype: torch.dtype):
    try:
        return _NP[dtype]
    except KeyError:
        raise ValueError(f"dtype: expected one of {sorted(map(str, _NP))}, got {dtype}") from None


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return _TORCH[np.dtype(dtype)]
