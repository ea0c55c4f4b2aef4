"""The first draft step's inputs of a prefill / mixed batch in one launch (`EagleDrafter`'s
set-up before the first step: ids, accept lengths, row kinds, token padding, accepted tokens).

Batch: `ne` prefill rows (their chunks, `npt` tokens, lengths `extend_lens[:ne]` int32, each
>= 1), then `nd` decode rows of `n` tokens: `t = npt + nd * n` tokens, `bs = ne + nd` rows,
padded to `rows` >= bs rows and `tokens` >= t tokens (the unpadded step: rows = bs,
tokens = t).
Inputs: `shifted [>= npt]` int64 (the prompt shifted one left, -1 where it is the target's
output), `output_tokens [ne + nd * n]` int64 or int32 (the acceptance's: a prefill row's
token, then each decode row's n), `accept [bs]` int32 or int64 (each contiguous).
Writes:
  ids [tokens] int64: ids[:npt] = shifted[:npt], except at each prefill row's last token,
      where a negative shifted id becomes the row's output token; ids[npt:t] =
      output_tokens[ne:]; ids[t:tokens] = `pad_id`
  accept_out [bs] int32 = accept
  row_kind [rows] int32: `ROW_PREFILL` for rows < ne, `ROW_DECODE` up to bs, `ROW_PAD` after
  accepted [>= bs, n] int64 (optional): accepted[r, 0] = output_tokens[r] (r < ne),
      accepted[ne + d] = output_tokens[ne + d * n: ne + (d + 1) * n]; other entries kept.

`mixed_draft_inputs_ref` (torch: the drafter's former op sequence) is the torch path and the
kernel's oracle; `mixed_draft_inputs` (Triton) writes the same values in one launch, its
sizes runtime values (not specialised on). No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphdraft.checks import expect_int, expect_tensor
from graphdraft.kernels.config import KernelConfig

__all__ = ["mixed_draft_inputs", "mixed_draft_inputs_ref"]

_BLOCK = 256
_INDEX = (torch.int32, torch.int64)


def _check(ne: int, nd: int, n: int, npt: int, rows: int, tokens: int, shifted, extend_lens,
           output_tokens, accept, ids, accept_out, row_kind, accepted) -> tuple[int, int]:
    """Every argument (module doc); -> (bs, t)."""
    for name, v, lo in (("ne", ne, 0), ("nd", nd, 0), ("n", n, 1), ("npt", npt, 0)):
        expect_int(name, v, lo)
    bs, t = ne + nd, npt + nd * n
    expect_int("rows", rows, bs)
    expect_int("tokens", tokens, t)
    expect_tensor("output_tokens", output_tokens, shape=(ne + nd * n,), dtypes=_INDEX,
                  layout="contiguous")
    dev = output_tokens.device
    for name, x, size, dt in (("shifted", shifted, npt, torch.int64),
                              ("extend_lens", extend_lens, ne, torch.int32),
                              ("accept", accept, bs, _INDEX),
                              ("ids", ids, tokens, torch.int64),
                              ("accept_out", accept_out, bs, torch.int32),
                              ("row_kind", row_kind, rows, torch.int32)):
        expect_tensor(name, x, shape=("len",), dtypes=dt, device=dev, layout="contiguous")
        if x.shape[0] < size:
            raise ValueError(f"{name}: expected at least {size} entries, got {x.shape[0]}")
    if accepted is not None:
        expect_tensor("accepted", accepted, shape=("R", n), dtypes=torch.int64, device=dev,
                      layout="contiguous")
        if accepted.shape[0] < bs:
            raise ValueError(f"accepted: expected at least {bs} rows, got {accepted.shape[0]}")
    return bs, t


def mixed_draft_inputs_ref(ne: int, nd: int, n: int, npt: int, rows: int, tokens: int,
                           shifted: torch.Tensor, extend_lens: torch.Tensor,
                           output_tokens: torch.Tensor, accept: torch.Tensor, *,
                           ids: torch.Tensor, accept_out: torch.Tensor, row_kind: torch.Tensor,
                           accepted: torch.Tensor | None, kinds: tuple[int, int, int],
                           pad_id: int) -> None:
    """Torch version (module doc); `kinds` (ROW_PREFILL, ROW_DECODE, ROW_PAD)."""
    bs, t = _check(ne, nd, n, npt, rows, tokens, shifted, extend_lens, output_tokens, accept,
                   ids, accept_out, row_kind, accepted)
    accept_out[:bs].copy_(accept)
    first = ids[:t]
    first[:npt].copy_(shifted[:npt])
    last = torch.cumsum(extend_lens[:ne].long(), 0) - 1
    first[last] = torch.where(first[last] < 0, output_tokens[:ne].long(), first[last])
    first[npt:].copy_(output_tokens[ne:])
    if accepted is not None:
        accepted[:ne, 0].copy_(output_tokens[:ne])
        if nd:
            accepted[ne: bs].copy_(output_tokens[ne:].view(nd, n))
    if ne:
        row_kind[:ne].fill_(kinds[0])
    if ne < bs:
        row_kind[ne:bs].fill_(kinds[1])
    if rows > bs:
        row_kind[bs:rows].fill_(kinds[2])
    if tokens > t:
        ids[t:tokens].fill_(pad_id)


@triton.jit(do_not_specialize=["ne", "bs", "npt", "t", "rows", "tokens"],
            do_not_specialize_on_alignment=["shifted_ptr", "lens_ptr", "out_ptr", "acc_in_ptr"])
def _inputs_kernel(shifted_ptr, lens_ptr, out_ptr, acc_in_ptr, ids_ptr, acc_out_ptr, kind_ptr,
                   accepted_ptr, ne, bs, npt, t, rows, tokens, n, stride_acc,
                   K_PREFILL: tl.constexpr, K_DECODE: tl.constexpr, K_PAD: tl.constexpr,
                   PAD_ID: tl.constexpr, HAS_ACCEPTED: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # tokens: the prefill rows' shifted ids, each row's last one its output when negative
    in_p = i < npt
    v = tl.load(shifted_ptr + i, mask=in_p, other=0).to(tl.int64)
    end = tl.zeros([BLOCK], dtype=tl.int64)
    last_of = tl.full([BLOCK], -1, dtype=tl.int64)
    for r in range(0, ne):
        end += tl.load(lens_ptr + r).to(tl.int64)
        last_of = tl.where(i == end - 1, r, last_of)
    use_out = in_p & (last_of >= 0) & (v < 0)
    v = tl.where(use_out, tl.load(out_ptr + last_of, mask=use_out, other=0).to(tl.int64), v)
    in_d = (i >= npt) & (i < t)
    d = tl.load(out_ptr + ne + (i - npt), mask=in_d, other=0).to(tl.int64)
    v = tl.where(in_d, d, v)
    v = tl.where(i >= t, PAD_ID, v)
    tl.store(ids_ptr + i, v, mask=i < tokens)
    # rows: kinds, accept lengths
    kind = tl.where(i < ne, K_PREFILL, tl.where(i < bs, K_DECODE, K_PAD))
    tl.store(kind_ptr + i, kind.to(tl.int32), mask=i < rows)
    tl.store(acc_out_ptr + i, tl.load(acc_in_ptr + i, mask=i < bs), mask=i < bs)
    if HAS_ACCEPTED:
        p = tl.load(out_ptr + i, mask=i < ne).to(tl.int64)
        tl.store(accepted_ptr + i * stride_acc, p, mask=i < ne)
        j = tl.where(in_d, i - npt, 0)
        at = (ne + j // n) * stride_acc + j % n
        tl.store(accepted_ptr + at, d, mask=in_d)


def mixed_draft_inputs(ne: int, nd: int, n: int, npt: int, rows: int, tokens: int,
                       shifted: torch.Tensor, extend_lens: torch.Tensor,
                       output_tokens: torch.Tensor, accept: torch.Tensor, *, ids: torch.Tensor,
                       accept_out: torch.Tensor, row_kind: torch.Tensor,
                       accepted: torch.Tensor | None, kinds: tuple[int, int, int], pad_id: int,
                       kernels: KernelConfig | None = None) -> None:
    """Triton version of `mixed_draft_inputs_ref`: one launch. `kernels`: the launch settings
    (None: the default; this launch reads none)."""
    bs, t = _check(ne, nd, n, npt, rows, tokens, shifted, extend_lens, output_tokens, accept,
                   ids, accept_out, row_kind, accepted)
    span = max(tokens, rows)
    if span == 0:
        return
    def some(x, stand_in):  # an empty tensor's pointer is never read: pass a real one
        return x if x.numel() else stand_in

    out = some(output_tokens, ids)
    _inputs_kernel[(triton.cdiv(span, _BLOCK),)](
        some(shifted, ids), some(extend_lens, row_kind), out, some(accept, row_kind), ids,
        some(accept_out, row_kind), row_kind,
        accepted if accepted is not None else ids, ne, bs, npt, t, rows, tokens, n,
        accepted.stride(0) if accepted is not None else 0, K_PREFILL=kinds[0],
        K_DECODE=kinds[1], K_PAD=kinds[2], PAD_ID=pad_id, HAS_ACCEPTED=accepted is not None,
        BLOCK=_BLOCK, num_warps=4)
