"""The Engine's tree cycle: its rows' state in (`load_rows`) and their new trees out
(`store_rows`), one launch each.

Tables: the per request-slot trees, six `[R, n]` int64 tables in `TREE_FIELDS` order (the
`serving.tree_cycle.SlotTrees` tables, `R` slots, slot 0 the neutral root-only tree), and the
cycle's tree rows, the same six fields `[B, n]` int64 plus positions and retrieve_index
(`kernels.tree_build.TreeBuffers`).

load, per row r of `B` (`slot_rows [B]` int64, `done [R]` int32, `vcl [R]` int32):
    live[r] = slot > 0 and done[slot] == 0;  req[r] = live ? slot : 0
    prefix_len[r] = live ? vcl[req] : 0 (L)
    tree field f [r] = table f [req];  positions[r] = L + depths[r];  retrieve_index[r, i] = r*n + i
    optional `columns` (src `[R]`, dst `[B]` pairs, e.g. the sampling columns): dst[r] = src[req]
    optional `verify` (req_to_page, page_size, v_loc `[B*n]`, v_seq `[B]` int32): the verify's
    KV slots of `L + i` (`kernels.cache_loc`'s rule, row-major) and v_seq = L + n
store, per row r: req[r] > 0: table f [req[r]] = tree field f [r] (rows of slot 0 store
    nothing); `tables` are the slots' tables with one spare last row (`[R + 1, n]`; the torch
    path sends the rows it must not keep there).

`load_rows_ref` / `store_rows_ref` (torch) are the torch path and the kernels' oracle: the
same values. Fixed shapes, no host sync: graph-capturable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_int, expect_tensor
from graphdraft.kernels.cache_loc import _slot, compute_out_cache_loc_uniform_ref
from graphdraft.kernels.config import KernelConfig

__all__ = ["TREE_FIELDS", "load_rows", "load_rows_ref", "store_rows", "store_rows_ref"]

TREE_FIELDS = ("tokens", "parents", "depths", "mask", "first_child", "next_sibling")
"""The per-slot tree fields, in the order every sequence argument here lists them."""


def _check(tables: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], req: torch.Tensor,
           spare: int) -> tuple[int, int]:
    """-> (B, n); tables `[R + spare, n]`, rows `[B, n]`, each int64 contiguous."""
    if len(tables) != len(TREE_FIELDS) or len(rows) != len(TREE_FIELDS):
        raise ValueError(f"tables, rows: expected {len(TREE_FIELDS)} each ({TREE_FIELDS}), got "
                         f"{len(tables)} and {len(rows)}")
    expect_tensor("req", req, shape=("B",), dtypes=torch.int64, layout="contiguous")
    bs, dev = req.shape[0], req.device
    expect_tensor("tables[0]", tables[0], shape=("R", "n"), dtypes=torch.int64, device=dev,
                  layout="contiguous")
    r, n = tables[0].shape
    for i, (t, o) in enumerate(zip(tables, rows, strict=True)):
        expect_tensor(f"tables[{i}]", t, shape=(r, n), dtypes=torch.int64, device=dev,
                      layout="contiguous")
        expect_tensor(f"rows[{i}]", o, shape=(bs, n), dtypes=torch.int64, device=dev,
                      layout="contiguous")
    if r < 1 + spare:
        raise ValueError(f"tables: expected >= {1 + spare} rows, got {r}")
    return bs, n


# --- torch path --------------------------------------------------------------------------------

def load_rows_ref(slot_rows: torch.Tensor, done: torch.Tensor, vcl: torch.Tensor,
                  tables: Sequence[torch.Tensor], rows: Sequence[torch.Tensor],
                  positions: torch.Tensor, retrieve_index: torch.Tensor, live: torch.Tensor,
                  req: torch.Tensor, prefix_len: torch.Tensor, *,
                  columns: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
                  verify: tuple | None = None) -> None:
    """Torch version of the load (module doc); `live [B]` bool, `req`, `prefix_len [B]` int64."""
    bs, n = _check(tables, rows, slot_rows, 0)
    torch.logical_and(slot_rows > 0, done.index_select(0, slot_rows) == 0, out=live)
    torch.mul(slot_rows, live, out=req)                           # dead rows: slot 0
    torch.mul(vcl.index_select(0, req), live, out=prefix_len)
    for src, dst in columns:
        dst.copy_(src.index_select(0, req))
    for t, o in zip(tables, rows, strict=True):
        torch.index_select(t, 0, req, out=o)
    torch.add(prefix_len.unsqueeze(1), rows[2], out=positions)
    i = torch.arange(n, device=req.device)
    retrieve_index.copy_(torch.arange(bs, device=req.device).unsqueeze(1) * n + i)
    if verify is not None:
        req_to_page, page_size, v_loc, v_seq = verify
        compute_out_cache_loc_uniform_ref(v_loc, req, prefix_len, req_to_page, page_size, n,
                                          out_stride_req=n, out_stride_tok=1)
        torch.add(prefix_len, n, out=v_seq)


def store_rows_ref(rows: Sequence[torch.Tensor], req: torch.Tensor,
                   tables: Sequence[torch.Tensor]) -> None:
    """Torch version of the store (module doc): rows of slot 0 go to the spare last row."""
    _check(tables, rows, req, 1)
    spare = tables[0].shape[0] - 1
    idx = torch.where(req > 0, req, spare)
    for t, o in zip(tables, rows, strict=True):
        t.index_copy_(0, idx, o)


# --- Triton --------------------------------------------------------------------------------

@triton.jit
def _row_copy(src_ptr, dst_ptr, n, NB: tl.constexpr):
    i = tl.arange(0, NB)
    x = tl.load(src_ptr + i, mask=i < n)
    tl.store(dst_ptr + i, x, mask=i < n)
    return x


@triton.jit
def _load_kernel(slot_ptr, done_ptr, vcl_ptr, live_ptr, req_ptr, plen_ptr,
                 t0, t1, t2, t3, t4, t5, o0, o1, o2, o3, o4, o5, pos_ptr, ret_ptr, n,
                 s0, s1, s2, s3, d0, d1, d2, d3,
                 page_ptr, n_reqs, max_pages, stride_pr, stride_pc, page_size, vloc_ptr,
                 vseq_ptr, NB: tl.constexpr, NCOL: tl.constexpr, VERIFY: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    live = (slot > 0) & (tl.load(done_ptr + slot) == 0)
    req = tl.where(live, slot, 0)
    L = tl.where(live, tl.load(vcl_ptr + req).to(tl.int64), 0)
    tl.store(live_ptr + r, live.to(tl.int1))
    tl.store(req_ptr + r, req)
    tl.store(plen_ptr + r, L)
    src = req * n
    dst = r * n
    _row_copy(t0 + src, o0 + dst, n, NB)
    _row_copy(t1 + src, o1 + dst, n, NB)
    depth = _row_copy(t2 + src, o2 + dst, n, NB)
    _row_copy(t3 + src, o3 + dst, n, NB)
    _row_copy(t4 + src, o4 + dst, n, NB)
    _row_copy(t5 + src, o5 + dst, n, NB)
    i = tl.arange(0, NB)
    tl.store(pos_ptr + dst + i, L + depth, mask=i < n)
    tl.store(ret_ptr + dst + i, dst + i, mask=i < n)
    if NCOL > 0:
        tl.store(d0 + r, tl.load(s0 + req))
    if NCOL > 1:
        tl.store(d1 + r, tl.load(s1 + req))
    if NCOL > 2:
        tl.store(d2 + r, tl.load(s2 + req))
    if NCOL > 3:
        tl.store(d3 + r, tl.load(s3 + req))
    if VERIFY:
        pos = L + i.to(tl.int64)
        loc = _slot(page_ptr, req, pos, i < n, n_reqs, max_pages, stride_pr, stride_pc,
                    page_size)
        tl.store(vloc_ptr + dst + i, loc, mask=i < n)
        tl.store(vseq_ptr + r, (L + n).to(tl.int32))


@triton.jit
def _store_kernel(req_ptr, o0, o1, o2, o3, o4, o5, t0, t1, t2, t3, t4, t5, n,
                  NB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ptr + r).to(tl.int64)
    if req > 0:
        src = r * n
        dst = req * n
        _row_copy(o0 + src, t0 + dst, n, NB)
        _row_copy(o1 + src, t1 + dst, n, NB)
        _row_copy(o2 + src, t2 + dst, n, NB)
        _row_copy(o3 + src, t3 + dst, n, NB)
        _row_copy(o4 + src, t4 + dst, n, NB)
        _row_copy(o5 + src, t5 + dst, n, NB)


def load_rows(slot_rows: torch.Tensor, done: torch.Tensor, vcl: torch.Tensor,
              tables: Sequence[torch.Tensor], rows: Sequence[torch.Tensor],
              positions: torch.Tensor, retrieve_index: torch.Tensor, live: torch.Tensor,
              req: torch.Tensor, prefix_len: torch.Tensor, *,
              columns: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
              verify: tuple | None = None, kernels: KernelConfig | None = None) -> None:
    """Triton version of `load_rows_ref`: one program per row. `kernels`: the launch
    settings (None: the default; this launch reads none)."""
    bs, n = _check(tables, rows, slot_rows, 0)
    dev = slot_rows.device
    for name, t, dt in (("live", live, torch.bool), ("req", req, torch.int64),
                        ("prefix_len", prefix_len, torch.int64)):
        expect_tensor(name, t, shape=(bs,), dtypes=dt, device=dev, layout="contiguous")
    for name, t in (("done", done), ("vcl", vcl)):
        expect_tensor(name, t, shape=("R",), dtypes=torch.int32, device=dev, layout="contiguous")
    for name, t in (("positions", positions), ("retrieve_index", retrieve_index)):
        expect_tensor(name, t, shape=(bs, n), dtypes=torch.int64, device=dev,
                      layout="contiguous")
    if len(columns) > 4:
        raise ValueError(f"columns: expected at most 4 pairs, got {len(columns)}")
    for i, (src, dst) in enumerate(columns):
        expect_tensor(f"columns[{i}] source", src, shape=("R",), device=dev, layout="contiguous")
        expect_tensor(f"columns[{i}] destination", dst, shape=(bs,), device=dev,
                      layout="contiguous")
    cols = [c[0] for c in columns] + [req] * (4 - len(columns))
    cols += [c[1] for c in columns] + [req] * (4 - len(columns))
    if verify is not None:
        req_to_page, page_size, v_loc, v_seq = verify
        expect_tensor("req_to_page", req_to_page, shape=("reqs", "pages"), device=dev)
        expect_int("page_size", page_size, 1)
        expect_tensor("v_loc", v_loc, shape=(bs * n,), dtypes=torch.int64, device=dev,
                      layout="contiguous")
        expect_tensor("v_seq", v_seq, shape=(bs,), dtypes=torch.int32, device=dev,
                      layout="contiguous")
        vargs = [req_to_page, req_to_page.shape[0], req_to_page.shape[1], req_to_page.stride(0),
                 req_to_page.stride(1), page_size, v_loc, v_seq]
    else:
        vargs = [req, 1, 1, 1, 1, 1, req, req]
    if bs == 0:
        return
    _load_kernel[(bs,)](slot_rows, done, vcl, live, req, prefix_len, *tables, *rows, positions,
                        retrieve_index, n, *cols, *vargs, NB=triton.next_power_of_2(n),
                        NCOL=len(columns), VERIFY=verify is not None, num_warps=1)


def store_rows(rows: Sequence[torch.Tensor], req: torch.Tensor, tables: Sequence[torch.Tensor],
               kernels: KernelConfig | None = None) -> None:
    """Triton version of `store_rows_ref`: one program per row (the spare row unused)."""
    bs, n = _check(tables, rows, req, 1)
    if bs == 0:
        return
    _store_kernel[(bs,)](req, *rows, *tables, n, NB=triton.next_power_of_2(n), num_warps=1)
