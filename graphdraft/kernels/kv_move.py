"""After tree acceptance: compact the accepted path to the front (KV and hidden states).

KV move, per layer (K and V together): the accepted path's node `path[d]` was verified at
logical position `L + path[d]`; its KV moves to `L + d` for `d = 1 .. accept_len - 1` (node 0,
the root, already sits at `L`). Logical position p of row r maps to the slot
`req_to_page[req[r], p // page_size] * page_size + p % page_size` (a page past the table's
width maps to the dummy slot 0). Moves with `src == dst` are skipped. A destination can be
another depth's source (path `[0, 2, 3]`: 2 -> 1 and 3 -> 2), so each program (row, block of
the `Hkv * D` elements) loads all P source rows before it stores any.

    k_layers, v_layers  list of `[slots, Hkv, D]` (one per layer; each slot's Hkv*D contiguous)
    req_to_page         `[max_reqs + 1, max_pages]` int32
    req                 `[B]` int32/int64 request-pool slot of each row
    prefix_len          `[B]` int32/int64 `L` (the root's logical position)
    accept_index        `[B, P]` int64 path node ids, -1 padded; accept_len `[B]` int32 in 1..P

Hidden gather: `hid_c [B*P, kH] = aux_hidden[r*n + path[d]]` (aux_hidden `[B*n, kH]`, the
target's captured hidden states at every tree node); rows `d >= accept_len` repeat the last
path node (valid, never read); node ids are clamped to `[0, n)`, so garbage in a padded row
never reads out of bounds. The next cycle's first draft step reads `hid_c` with chain's
layout of width P.

Fixed shapes, no host sync. `move_accepted_kv` / `gather_accepted_hidden` (Triton) and the
`_ref` versions (torch) write the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import INDEX_DTYPES, expect_tensor
from graphdraft.kernels.cache_loc import kv_slot
from graphdraft.kernels.config import KernelConfig

__all__ = ["move_accepted_kv", "move_accepted_kv_ref", "gather_accepted_hidden",
           "gather_accepted_hidden_ref"]


def _check_rows(req, prefix_len, accept_index, accept_len) -> tuple[int, int]:
    expect_tensor("accept_index", accept_index, shape=("B", "P"), dtypes=torch.int64,
                  layout="contiguous")
    bs, p = accept_index.shape
    for name, t in (("req", req), ("prefix_len", prefix_len), ("accept_len", accept_len)):
        expect_tensor(name, t, shape=(bs,), dtypes=INDEX_DTYPES, layout="contiguous")
    return bs, p


def _check_kv(k_layers, v_layers, req_to_page, page_size) -> None:
    if len(k_layers) != len(v_layers) or not k_layers:
        raise ValueError(f"k_layers, v_layers: expected the same number (>= 1) of layers, got "
                         f"{len(k_layers)} and {len(v_layers)}")
    expect_tensor("k_layers[0]", k_layers[0], shape=("slots", "Hkv", "D"))
    shape, dtype = k_layers[0].shape, k_layers[0].dtype
    for name, layers in (("k_layers", k_layers), ("v_layers", v_layers)):
        for i, t in enumerate(layers):
            # like k_layers[0]
            expect_tensor(f"{name}[{i}]", t, shape=tuple(shape), dtypes=dtype, layout="rows")
            if t.stride(1) != t.shape[2]:
                raise ValueError(f"{name}[{i}]: expected each slot [Hkv, D] contiguous, got "
                                 f"strides {t.stride()}")
    expect_tensor("req_to_page", req_to_page, shape=("max_reqs + 1", "max_pages"),
                  dtypes=torch.int32, layout="rows")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected an int >= 1, got {page_size!r}")


def _slots_ref(req_to_page, req, pos, page_size):
    """Slot of logical positions `pos [B, P]` of rows `req [B]` (dummy slot 0 past the table)."""
    inside = pos // page_size < req_to_page.shape[1]
    slot = kv_slot(req_to_page, req.long()[:, None], pos, page_size)
    return torch.where(inside, slot, torch.zeros_like(pos))


def move_accepted_kv_ref(k_layers: list[torch.Tensor], v_layers: list[torch.Tensor],
                         req_to_page: torch.Tensor, req: torch.Tensor, prefix_len: torch.Tensor,
                         accept_index: torch.Tensor, accept_len: torch.Tensor, page_size: int) -> None:
    """Torch version (module doc); reads every source before writing."""
    _check_kv(k_layers, v_layers, req_to_page, page_size)
    bs, p = _check_rows(req, prefix_len, accept_index, accept_len)
    d = torch.arange(p, device=accept_index.device)[None, :]
    L = prefix_len.long()[:, None]
    src = _slots_ref(req_to_page, req, L + accept_index.clamp(min=0), page_size)
    dst = _slots_ref(req_to_page, req, L + d, page_size)
    move = (d >= 1) & (d < accept_len.long()[:, None]) & (src != dst)
    src_m, dst_m = src[move], dst[move]
    for t in (*k_layers, *v_layers):
        t[dst_m] = t[src_m]   # gathers all sources first: overlap-safe


@triton.jit
def _path_moves(r, page_ptr, stride_page, max_pages, req_ptr, plen_ptr, idx_ptr, len_ptr, P,
                page_size, PB: tl.constexpr):
    """Row r's moves `[PB]` (module doc): (source slot, destination slot, whether to move)."""
    d = tl.arange(0, PB)
    L = tl.load(plen_ptr + r).to(tl.int64)
    acc = tl.load(len_ptr + r).to(tl.int64)
    row = tl.load(req_ptr + r).to(tl.int64)
    node = tl.load(idx_ptr + r * P + d, mask=d < P, other=0)
    node = tl.maximum(node, 0)
    src_pos = L + node
    dst_pos = L + d.to(tl.int64)
    sp = src_pos // page_size
    dp = dst_pos // page_size
    s_page = tl.load(page_ptr + row * stride_page + tl.minimum(sp, max_pages - 1)).to(tl.int64)
    d_page = tl.load(page_ptr + row * stride_page + tl.minimum(dp, max_pages - 1)).to(tl.int64)
    src = tl.where(sp < max_pages, s_page * page_size + src_pos % page_size, 0)
    dst = tl.where(dp < max_pages, d_page * page_size + dst_pos % page_size, 0)
    move = (d >= 1) & (d.to(tl.int64) < acc) & (src != dst)
    return src, dst, move


@triton.jit
def _move_kv_kernel(k_ptr, v_ptr, stride_slot, page_ptr, stride_page, max_pages, req_ptr, plen_ptr,
                    idx_ptr, len_ptr, P, page_size, HD,
                    PB: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src, dst, move = _path_moves(r, page_ptr, stride_page, max_pages, req_ptr, plen_ptr, idx_ptr,
                                 len_ptr, P, page_size, PB)
    m2 = move[:, None] & (e < HD)[None, :]
    s_off = src[:, None] * stride_slot + e[None, :]
    d_off = dst[:, None] * stride_slot + e[None, :]
    kk = tl.load(k_ptr + s_off, mask=m2)     # every source row loaded before any store
    vv = tl.load(v_ptr + s_off, mask=m2)
    tl.debug_barrier()
    tl.store(k_ptr + d_off, kk, mask=m2)
    tl.store(v_ptr + d_off, vv, mask=m2)


def move_accepted_kv(k_layers: list[torch.Tensor], v_layers: list[torch.Tensor],
                     req_to_page: torch.Tensor, req: torch.Tensor, prefix_len: torch.Tensor,
                     accept_index: torch.Tensor, accept_len: torch.Tensor, page_size: int,
                     block: int = 1024, kernels: KernelConfig | None = None) -> None:
    """Triton version (module doc; `graphdraft.ops.move_accepted_kv` chooses): one launch per
    layer, grid (B, cdiv(Hkv*D, block)). `kernels`: the launch settings (None: the default; this launch reads none)."""
    _check_kv(k_layers, v_layers, req_to_page, page_size)
    bs, p = _check_rows(req, prefix_len, accept_index, accept_len)
    if bs == 0 or p < 2:
        return
    hd = k_layers[0].shape[1] * k_layers[0].shape[2]
    blk = min(block, triton.next_power_of_2(hd))
    grid = (bs, triton.cdiv(hd, blk))
    for kt, vt in zip(k_layers, v_layers, strict=True):
        _move_kv_kernel[grid](kt, vt, kt.stride(0), req_to_page, req_to_page.stride(0),
                              req_to_page.shape[1], req, prefix_len, accept_index, accept_len, p,
                              page_size, hd, PB=triton.next_power_of_2(p), BLOCK=blk, num_warps=4)


def _check_hidden(aux_hidden, hid_c, bs, p, n):
    expect_tensor("aux_hidden", aux_hidden, shape=(bs * n, "kH"), layout="rows")  # [B*n, kH]
    expect_tensor("hid_c", hid_c, shape=(bs * p, aux_hidden.shape[1]), dtypes=aux_hidden.dtype,
                  layout="contiguous")  # [B*P, kH]


def _hidden_rows_ref(accept_index, accept_len, n):
    bs, p = accept_index.shape
    last = accept_index.gather(1, (accept_len.long() - 1).clamp(0, p - 1)[:, None])
    d = torch.arange(p, device=accept_index.device)[None, :]
    node = torch.where(d < accept_len.long()[:, None], accept_index, last).clamp(0, n - 1)
    return (torch.arange(bs, device=accept_index.device)[:, None] * n + node).reshape(-1)


def gather_accepted_hidden_ref(aux_hidden: torch.Tensor, accept_index: torch.Tensor,
                               accept_len: torch.Tensor, n: int, hid_c: torch.Tensor) -> None:
    """Torch version: `hid_c[r*P + d] = aux_hidden[r*n + path[min(d, accept_len - 1)]]`."""
    bs, p = _check_rows(accept_len, accept_len, accept_index, accept_len)
    _check_hidden(aux_hidden, hid_c, bs, p, n)
    torch.index_select(aux_hidden, 0, _hidden_rows_ref(accept_index, accept_len, n), out=hid_c)


@triton.jit
def _gather_hidden_kernel(src_ptr, stride_src, dst_ptr, idx_ptr, len_ptr, n, P, W,
                          BLOCK: tl.constexpr):
    q = tl.program_id(0).to(tl.int64)          # output row r*P + d
    blk = tl.program_id(1)
    r = q // P
    d = q % P
    acc = tl.load(len_ptr + r).to(tl.int64)
    dd = tl.minimum(d, tl.maximum(acc, 1) - 1)
    node = tl.minimum(tl.maximum(tl.load(idx_ptr + r * P + dd), 0), n - 1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    m = cols < W
    x = tl.load(src_ptr + (r * n + node) * stride_src + cols, mask=m)
    tl.store(dst_ptr + q * W + cols, x, mask=m)


def gather_accepted_hidden(aux_hidden: torch.Tensor, accept_index: torch.Tensor,
                           accept_len: torch.Tensor, n: int, hid_c: torch.Tensor,
                           block: int = 1024, kernels: KernelConfig | None = None) -> None:
    """Triton version of `gather_accepted_hidden_ref` (`graphdraft.ops.gather_accepted_hidden`
    chooses): grid (B*P, cdiv(kH, block)). `kernels`: the launch settings (None: the default; this launch reads none)."""
    bs, p = _check_rows(accept_len, accept_len, accept_index, accept_len)
    _check_hidden(aux_hidden, hid_c, bs, p, n)
    if bs == 0:
        return
    w = aux_hidden.shape[1]
    blk = min(block, triton.next_power_of_2(w))
    _gather_hidden_kernel[(bs * p, triton.cdiv(w, blk))](
        aux_hidden, aux_hidden.stride(0), hid_c, accept_index, accept_len, n, p, w, BLOCK=blk,
        num_warps=4)
