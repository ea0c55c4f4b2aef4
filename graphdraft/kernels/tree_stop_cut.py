"""The tree cycle's stop-id / max_new cut of the accept lengths, in one launch.

Per row r of `B` (request slot `req[r]`, accepted path `out_tokens[r, :acc]`, acc =
`accept_len[r]`):

    js    = the first d < acc with out_tokens[r, d] in stop_ids[req[r]] (P: none)
    jl    = the first d < acc with d + 1 >= room, room = max_new[req] - emitted[req]
            (= max(room - 1, 0) when that is < acc; P: none)
    first = min(js, jl); cut = min(acc, first + 1)
    finish = FINISH_STOP when js == first < P (a stop wins at the same position),
             FINISH_LENGTH when jl == first < js, else 0
    live rows: accept_out = cut, finish_out = finish, accept_len = cut;
    dead rows (`live` False): accept_out = 0, finish_out = 0, accept_len unchanged;
    err_out = 0 on every row;
    optionally (`rows` = (accept_index `[B, P]` int64, n, logit_rows `[B, P]` int64)) the
    verify rows of the path's nodes for the log-probabilities: logit_rows[r, d] =
    r*n + max(accept_index[r, d], 0) (-1, past the path: row r*n, never read back).

Shapes: out_tokens `[B, P]` int64 (unit column stride), accept_len `[B]` int32 (read, then
written), req `[B]` int64, live `[B]` bool, stop_ids `[R, W]` int64 (-1: unused), max_new /
emitted `[R]` int32, accept_out / finish_out / err_out `[B]` int32. Graph-capturable: host
checks only. `stop_cut_ref` is the torch formulation (the torch path and the test's oracle).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_int, expect_tensor
from graphdraft.kernels.accept import FINISH_LENGTH, FINISH_STOP

__all__ = ["stop_cut", "stop_cut_ref"]


def _check(out_tokens, accept_len, req, live, stop_ids, max_new, emitted, accept_out,
           finish_out, err_out, rows) -> tuple[int, int, tuple | None]:
    """(B, P, rows): the shapes, and `rows` checked (None: none asked)."""
    expect_tensor("out_tokens", out_tokens, shape=("B", "P"), dtypes=torch.int64)
    bs, p = out_tokens.shape
    dev = out_tokens.device
    expect_tensor("accept_len", accept_len, shape=(bs,), dtypes=torch.int32, device=dev)
    expect_tensor("req", req, shape=(bs,), dtypes=torch.int64, device=dev)
    expect_tensor("live", live, shape=(bs,), dtypes=torch.bool, device=dev)
    expect_tensor("stop_ids", stop_ids, shape=("R", "W"), dtypes=torch.int64, device=dev)
    r = stop_ids.shape[0]
    for name, t in (("max_new", max_new), ("emitted", emitted)):
        expect_tensor(name, t, shape=(r,), dtypes=torch.int32, device=dev)
    for name, t in (("accept_out", accept_out), ("finish_out", finish_out),
                    ("err_out", err_out)):
        expect_tensor(name, t, shape=(bs,), dtypes=torch.int32, device=dev)
    return bs, p, _check_rows(rows, bs, p, dev)


def _check_rows(rows, bs: int, p: int, dev) -> tuple | None:
    if rows is None:
        return None
    accept_index, n, logit_rows = rows
    expect_int("n", n, 1)
    for name, t in (("accept_index", accept_index), ("logit_rows", logit_rows)):
        expect_tensor(name, t, shape=(bs, p), dtypes=torch.int64, device=dev, layout="contiguous")
    return accept_index, n, logit_rows


def stop_cut_ref(out_tokens: torch.Tensor, accept_len: torch.Tensor, req: torch.Tensor,
                 live: torch.Tensor, stop_ids: torch.Tensor, max_new: torch.Tensor,
                 emitted: torch.Tensor, accept_out: torch.Tensor, finish_out: torch.Tensor,
                 err_out: torch.Tensor, *, rows: tuple | None = None) -> None:
    """Torch version (module doc), fixed shapes, no host sync."""
    bs, p, rows = _check(out_tokens, accept_len, req, live, stop_ids, max_new, emitted,
                         accept_out, finish_out, err_out, rows)
    if rows is not None:
        accept_index, n, logit_rows = rows
        base = torch.arange(bs, device=out_tokens.device).unsqueeze(1) * n
        torch.add(accept_index.clamp(min=0), base, out=logit_rows)
    acc = accept_len
    stops = stop_ids.index_select(0, req)                                # [B, W]
    is_stop = (out_tokens.unsqueeze(2) == stops.unsqueeze(1)).any(-1)
    j = torch.arange(p, device=out_tokens.device)
    js = torch.where(is_stop & (j < acc.unsqueeze(1)), j, p).amin(1)
    room = max_new.index_select(0, req) - emitted.index_select(0, req)
    jl = (room - 1).clamp_(min=0)
    jl = torch.where(jl < acc, jl, p)
    first = torch.minimum(js, jl)
    cut = torch.minimum(acc, first + 1)
    fin = torch.where(first >= p, 0, torch.where(js == first, FINISH_STOP, FINISH_LENGTH))
    torch.mul(cut, live, out=accept_out)
    torch.mul(fin, live, out=finish_out)
    err_out.zero_()
    accept_len.copy_(torch.where(live, cut, acc))


@triton.jit
def _stop_cut_kernel(out_ptr, stride_out, acc_ptr, req_ptr, live_ptr, stop_ptr, stride_stop,
                     max_new_ptr, emitted_ptr, accept_ptr, finish_ptr, err_ptr, P, W,
                     idx_ptr, rows_ptr, n, FIN_STOP: tl.constexpr, FIN_LEN: tl.constexpr,
                     PB: tl.constexpr, WB: tl.constexpr, HAS_ROWS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, PB)
    if HAS_ROWS:
        node = tl.load(idx_ptr + r * P + d, mask=d < P, other=0)
        tl.store(rows_ptr + r * P + d, r * n + tl.maximum(node, 0), mask=d < P)
    w = tl.arange(0, WB)
    acc = tl.load(acc_ptr + r)
    row = tl.load(req_ptr + r)
    live = tl.load(live_ptr + r) != 0
    tok = tl.load(out_ptr + r * stride_out + d, mask=d < P, other=0)
    stops = tl.load(stop_ptr + row * stride_stop + w, mask=w < W, other=0)
    eq = (tok[:, None] == stops[None, :]) & (w[None, :] < W)
    hit = tl.max(eq.to(tl.int32), axis=1) > 0
    js = tl.min(tl.where(hit & (d < acc) & (d < P), d, P), axis=0)
    room = tl.load(max_new_ptr + row) - tl.load(emitted_ptr + row)
    jl = tl.maximum(room - 1, 0)
    jl = tl.where(jl < acc, jl, P)
    first = tl.minimum(js, jl)
    cut = tl.minimum(acc, first + 1)
    fin = tl.where(first >= P, 0, tl.where(js == first, FIN_STOP, FIN_LEN))
    tl.store(accept_ptr + r, tl.where(live, cut, 0))
    tl.store(finish_ptr + r, tl.where(live, fin, 0))
    tl.store(err_ptr + r, 0)
    tl.store(acc_ptr + r, tl.where(live, cut, acc))


def stop_cut(out_tokens: torch.Tensor, accept_len: torch.Tensor, req: torch.Tensor,
             live: torch.Tensor, stop_ids: torch.Tensor, max_new: torch.Tensor,
             emitted: torch.Tensor, accept_out: torch.Tensor, finish_out: torch.Tensor,
             err_out: torch.Tensor, *, rows: tuple | None = None) -> None:
    """Triton version (module doc): one program per row."""
    bs, p, rows = _check(out_tokens, accept_len, req, live, stop_ids, max_new, emitted,
                         accept_out, finish_out, err_out, rows)
    idx, logit_rows, n = (rows[0], rows[2], rows[1]) if rows is not None else (req, req, 1)
    if bs == 0:
        return
    if out_tokens.stride(1) != 1 or stop_ids.stride(1) != 1:
        raise ValueError("out_tokens, stop_ids: expected a unit column stride")
    w = stop_ids.shape[1]
    _stop_cut_kernel[(bs,)](out_tokens, out_tokens.stride(0), accept_len, req, live, stop_ids,
                            stop_ids.stride(0), max_new, emitted, accept_out, finish_out,
                            err_out, p, w, idx, logit_rows, n, FIN_STOP=FINISH_STOP,
                            FIN_LEN=FINISH_LENGTH, PB=triton.next_power_of_2(p),
                            WB=triton.next_power_of_2(max(w, 1)), HAS_ROWS=rows is not None)
