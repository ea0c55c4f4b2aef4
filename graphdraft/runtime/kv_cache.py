"""Paged KV cache: the per-layer K/V pool, the request page table, and their allocators.

Layout: `k[layer]`, `v[layer]` are `[num_pages * page_size, num_kv_heads, head_dim]`;
`req_to_page` is `[max_reqs + 1, max_pages]` int32. The KV slot of position p of
request slot r is `req_to_page[r, p // page_size] * page_size + p % page_size`.
Page 0 is the reserved dummy page (padded rows and unmapped positions write
there) and request slot 0 the reserved dummy request (its row stays all zeros).

Allocation state lives on the host (free lists and each request's page list),
so allocating and freeing never syncs with the device; the device page table
is written only for the rows that change, from a pinned staging ring
(`runtime.staging.HostStaging`: no pinned allocation per request), and inside
`PageTable.batched()` once for every request reserved there (one copy, one scatter).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from graphdraft.kernels.cache_loc import kv_slot  # noqa: F401 - re-exported (its home: cache_loc)
from graphdraft.kernels.neutral import DUMMY_PAGE, DUMMY_REQ_SLOT
from graphdraft.runtime.staging import HostStaging


class OutOfPagesError(RuntimeError):
    """Not enough free KV pages (or request slots) for what was asked; nothing was changed."""


class KVPool:
    """K and V for `num_layers` layers over `num_pages` pages of `page_size` slots."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages: expected >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    def zero_dummy_page(self) -> None:
        """Every layer's K and V on the dummy page (`DUMMY_PAGE`) back to zeros: after captures
        over rows of no token, whose values are undefined (what they wrote there must not
        reach the inert rows that read it)."""
        page = slice(DUMMY_PAGE * self.page_size, (DUMMY_PAGE + 1) * self.page_size)
        for t in (*self.k, *self.v):
            t[page].zero_()


@dataclass
class _Request:
    pages: list[int] = field(default_factory=list)


class PageTable:
    """Request slots, their page lists, and the device table `req_to_page` they map to.

    req_to_page  [max_reqs + 1, max_pages] int32 (row 0: the dummy request, all zeros)
    """

    def __init__(self, max_reqs: int, max_pages_per_req: int, num_pages: int, page_size: int,
                 device: str | torch.device) -> None:
        self.page_size = page_size
        self.max_pages_per_req = max_pages_per_req
        self.req_to_page = torch.zeros((max_reqs + 1, max_pages_per_req), dtype=torch.int32,
                                       device=device)
        self._free_pages = list(range(num_pages - 1, DUMMY_PAGE, -1))  # pop() gives low ids first
        self._free_slots = list(range(max_reqs, DUMMY_REQ_SLOT, -1))
        self._reqs: dict[int, _Request] = {}
        self.num_pages = num_pages
        self.staging = HostStaging(device, capacity=1 << 16)
        self._pending: list[tuple[int, int, list[int]]] | None = None  # inside `batched()`

    # --- queries ---------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def capacity(self, slot: int) -> int:
        """Positions request `slot` can hold with its pages now."""
        return len(self._reqs[slot].pages) * self.page_size

    def pages_of(self, slot: int) -> list[int]:
        return list(self._reqs[slot].pages)

    def pages_needed(self, slot: int | None, length: int) -> int:
        have = 0 if slot is None else len(self._reqs[slot].pages)
        return max(0, -(-length // self.page_size) - have)

    # --- changes ---------------------------------------------------------
    def alloc_slot(self) -> int:
        if not self._free_slots:
            raise OutOfPagesError("no free request slot: all max_running_requests slots are in use")
        slot = self._free_slots.pop()
        self._reqs[slot] = _Request()
        return slot

    def reserve(self, slot: int, length: int) -> None:
        """Make request `slot` able to hold positions [0, length). All-or-nothing."""
        req = self._reqs.get(slot)
        if req is None:
            raise ValueError(f"slot: {slot} is not an allocated request slot")
        need = self.pages_needed(slot, length)
        if need == 0:
            return
        if len(req.pages) + need > self.max_pages_per_req:
            raise ValueError(f"length: {length} exceeds max_context_len "
                             f"({self.max_pages_per_req * self.page_size})")
        if need > len(self._free_pages):
            raise OutOfPagesError(f"need {need} KV pages, {len(self._free_pages)} free")
        new = [self._free_pages.pop() for _ in range(need)]
        start = len(req.pages)
        req.pages.extend(new)
        if self._pending is not None:
            self._pending.append((slot, start, new))
        else:
            self.req_to_page[slot, start:start + need] = self.staging.tensor(new, torch.int32)

    @contextmanager
    def batched(self) -> Iterator[None]:
        """Inside, `reserve` changes the host state at once and the device table on exit, for
        every request together (one staged copy and one scatter); a slot freed inside drops
        its pending writes. Nested: the outermost writes."""
        if self._pending is not None:
            yield
            return
        self._pending = []
        try:
            yield
        finally:
            pending, self._pending = self._pending, None
            self._write(pending)

    def _write(self, writes: list[tuple[int, int, list[int]]]) -> None:
        """`req_to_page[slot, start + i] = pages[i]` for every (slot, start, pages)."""
        if not writes:
            return
        rows = [slot for slot, _, pages in writes for _ in pages]
        cols = [start + i for _, start, pages in writes for i in range(len(pages))]
        vals = [page for _, _, pages in writes for page in pages]
        r, c, v = self.staging.pack((rows, torch.int64), (cols, torch.int64), (vals, torch.int32))
        self.req_to_page.index_put_((r, c), v)

    def free(self, slot: int) -> None:
        """Return a request's pages and slot; its table row becomes zeros (the dummy page)."""
        req = self._reqs.pop(slot, None)
        if req is None:
            raise ValueError(f"slot: {slot} is not an allocated request slot")
        self._free_pages.extend(reversed(req.pages))
        self._free_slots.append(slot)
        if self._pending:
            self._pending = [w for w in self._pending if w[0] != slot]
        self.req_to_page[slot].zero_()
