"""After tree acceptance: the accepted path's KV to the front, every layer in one launch.

The rule is `kernels.kv_move`'s (`move_accepted_kv_ref`, the torch path and this kernel's
oracle): per row r, node `path[d]` verified at logical position `L + path[d]` moves to
`L + d` for d = 1 .. accept_len - 1 (moves with src == dst skipped; every source of a row
read before any store). `kv_move.move_accepted_kv` launches once per layer; this kernel
reads the layers' K and V base addresses from a pointer table (`kv_pointer_table`: int64
`[2 * layers]`, K of every layer then V, built once for a pool whose tensors never move)
and runs grid (B, cdiv(Hkv*D, block), 2 * layers): one launch a cycle whatever the depth.

    k_layers, v_layers  list of `[slots, Hkv, D]` (one per layer, one dtype and shape)
    table               `kv_pointer_table(k_layers, v_layers)` on their device
    req_to_page, req, prefix_len, accept_index `[B, P]`, accept_len: as `kernels.kv_move`

Fixed shapes, no host sync (graph-capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_tensor
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.kv_move import _check_kv, _check_rows, _path_moves, move_accepted_kv_ref

__all__ = ["kv_pointer_table", "move_accepted_kv_all", "move_accepted_kv_ref"]


def kv_pointer_table(k_layers: list[torch.Tensor], v_layers: list[torch.Tensor]) -> torch.Tensor:
    """`[2 * layers]` int64 on the layers' device: the K base addresses, then the V ones.
    Valid while those tensors live and are not reallocated (a KV pool's are not)."""
    if len(k_layers) != len(v_layers) or not k_layers:
        raise ValueError(f"k_layers, v_layers: expected the same number (>= 1) of layers, got "
                         f"{len(k_layers)} and {len(v_layers)}")
    ptrs = [t.data_ptr() for t in (*k_layers, *v_layers)]
    return torch.tensor(ptrs, dtype=torch.int64).to(k_layers[0].device)


@triton.jit
def _move_all_kernel(tab_ptr, ref_ptr, stride_slot, page_ptr, stride_page, max_pages, req_ptr,
                     plen_ptr, idx_ptr, len_ptr, P, page_size, HD,
                     PB: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    base = tl.load(tab_ptr + tl.program_id(2)).to(tl.pointer_type(ref_ptr.dtype.element_ty))
    src, dst, move = _path_moves(r, page_ptr, stride_page, max_pages, req_ptr, plen_ptr, idx_ptr,
                                 len_ptr, P, page_size, PB)
    m2 = move[:, None] & (e < HD)[None, :]
    x = tl.load(base + src[:, None] * stride_slot + e[None, :], mask=m2)
    tl.debug_barrier()                        # every source row loaded before any store
    tl.store(base + dst[:, None] * stride_slot + e[None, :], x, mask=m2)


def move_accepted_kv_all(k_layers: list[torch.Tensor], v_layers: list[torch.Tensor],
                         table: torch.Tensor, req_to_page: torch.Tensor, req: torch.Tensor,
                         prefix_len: torch.Tensor, accept_index: torch.Tensor,
                         accept_len: torch.Tensor, page_size: int, block: int = 1024,
                         kernels: KernelConfig | None = None) -> None:
    """Triton version (module doc): one launch for every layer's K and V. `kernels`: the
    launch settings (None: the default; this launch reads none)."""
    _check_kv(k_layers, v_layers, req_to_page, page_size)
    bs, p = _check_rows(req, prefix_len, accept_index, accept_len)
    n = 2 * len(k_layers)
    expect_tensor("table", table, shape=(n,), dtypes=torch.int64, device=k_layers[0].device,
                  layout="contiguous")
    kt = k_layers[0]
    if any(t.stride(0) != kt.stride(0) for t in (*k_layers, *v_layers)):
        raise ValueError("k_layers, v_layers: expected one slot stride for every layer")
    if bs == 0 or p < 2:
        return
    hd = kt.shape[1] * kt.shape[2]
    blk = min(block, triton.next_power_of_2(hd))
    _move_all_kernel[(bs, triton.cdiv(hd, blk), n)](
        table, kt, kt.stride(0), req_to_page, req_to_page.stride(0), req_to_page.shape[1], req,
        prefix_len, accept_index, accept_len, p, page_size, hd, PB=triton.next_power_of_2(p),
        BLOCK=blk, num_warps=4)
