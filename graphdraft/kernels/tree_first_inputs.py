"""The tree drafter's first draft step inputs, in one launch.

Per row r of `B` (request slot `req[r]`, `L = prefix_len[r]` the accepted path's first
position, `acc = clamp(accept_len[r], 1, P)`), the first step runs over the P tokens of the
path (chain's layout, width P):

    pos[r*P + d]  = L + d                       (rope positions, d < P)
    loc[r*P + d]  = the KV slot of L + d        (`kernels.cache_loc`'s rule: page table,
                                                 the dummy slot 0 where unmapped)
    gather[r]     = r*P + acc - 1               (the LM-head row: the path's last token)
    prefix[r]     = L + acc                     (int32: the draft prefix every beam sees)

Shapes: req / prefix_len / accept_len `[B]` (int32 or int64), pos / loc `[B*P]` int64,
gather `[B]` int64, prefix `[B]` int32, req_to_page `[reqs, pages]` int32.
`first_inputs_ref` (torch) is the torch path and the kernel's oracle (the same values).
Fixed shapes, no host sync: graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import INDEX_DTYPES, expect_int, expect_tensor
from graphdraft.kernels.cache_loc import _slot, compute_out_cache_loc_uniform_ref
from graphdraft.kernels.config import KernelConfig

__all__ = ["first_inputs", "first_inputs_ref"]


def _check(req, prefix_len, accept_len, req_to_page, page_size, p, pos, loc, gather, prefix):
    expect_int("P", p, 1)
    expect_int("page_size", page_size, 1)
    expect_tensor("req", req, shape=("B",), dtypes=INDEX_DTYPES)
    bs, dev = req.shape[0], req.device
    for name, t in (("prefix_len", prefix_len), ("accept_len", accept_len)):
        expect_tensor(name, t, shape=(bs,), dtypes=INDEX_DTYPES, device=dev)
    expect_tensor("req_to_page", req_to_page, shape=("reqs", "pages"), device=dev)
    for name, t in (("pos", pos), ("loc", loc)):
        expect_tensor(name, t, shape=(bs * p,), dtypes=torch.int64, device=dev,
                      layout="contiguous")
    expect_tensor("gather", gather, shape=(bs,), dtypes=torch.int64, device=dev,
                  layout="contiguous")
    expect_tensor("prefix", prefix, shape=(bs,), dtypes=torch.int32, device=dev,
                  layout="contiguous")
    return bs


def first_inputs_ref(req: torch.Tensor, prefix_len: torch.Tensor, accept_len: torch.Tensor,
                     req_to_page: torch.Tensor, page_size: int, p: int, pos: torch.Tensor,
                     loc: torch.Tensor, gather: torch.Tensor, prefix: torch.Tensor) -> None:
    """Torch version (module doc)."""
    bs = _check(req, prefix_len, accept_len, req_to_page, page_size, p, pos, loc, gather, prefix)
    acc = accept_len.clamp(1, p)
    d = torch.arange(p, device=req.device)
    torch.add(prefix_len.unsqueeze(1), d, out=pos.view(bs, p))
    compute_out_cache_loc_uniform_ref(loc, req, prefix_len, req_to_page, page_size, p,
                                      out_stride_req=p, out_stride_tok=1)
    torch.add(torch.arange(bs, device=req.device) * p - 1, acc, out=gather)
    torch.add(prefix_len, acc, out=prefix)


@triton.jit
def _first_inputs_kernel(req_ptr, plen_ptr, acc_ptr, page_ptr, n_reqs, max_pages, stride_pr,
                         stride_pc, page_size, pos_ptr, loc_ptr, gather_ptr, prefix_ptr, P,
                         PB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ptr + r).to(tl.int64)
    L = tl.load(plen_ptr + r).to(tl.int64)
    acc = tl.minimum(tl.maximum(tl.load(acc_ptr + r).to(tl.int64), 1), P)
    d = tl.arange(0, PB)
    pos = L + d.to(tl.int64)
    tl.store(pos_ptr + r * P + d, pos, mask=d < P)
    loc = _slot(page_ptr, req, pos, d < P, n_reqs, max_pages, stride_pr, stride_pc, page_size)
    tl.store(loc_ptr + r * P + d, loc, mask=d < P)
    tl.store(gather_ptr + r, r * P - 1 + acc)
    tl.store(prefix_ptr + r, (L + acc).to(tl.int32))


def first_inputs(req: torch.Tensor, prefix_len: torch.Tensor, accept_len: torch.Tensor,
                 req_to_page: torch.Tensor, page_size: int, p: int, pos: torch.Tensor,
                 loc: torch.Tensor, gather: torch.Tensor, prefix: torch.Tensor,
                 kernels: KernelConfig | None = None) -> None:
    """Triton version (module doc): one program per row. `kernels`: the launch settings
    (None: the default; this launch reads none)."""
    bs = _check(req, prefix_len, accept_len, req_to_page, page_size, p, pos, loc, gather, prefix)
    if bs == 0:
        return
    _first_inputs_kernel[(bs,)](req, prefix_len, accept_len, req_to_page, req_to_page.shape[0],
                                req_to_page.shape[1], req_to_page.stride(0),
                                req_to_page.stride(1), page_size, pos, loc, gather, prefix, p,
                                PB=triton.next_power_of_2(p), num_warps=1)
