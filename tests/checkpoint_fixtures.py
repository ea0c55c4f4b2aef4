"""Helpers for checkpoint tests: an engine-free forward, weight-file surgery, comparisons."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from graphdraft.kernels.config import TORCH
from graphdraft.models.attention import AttentionMetadata, PagedAttentionBackend
from graphdraft.runtime.kv_cache import KVPool, PageTable, kv_slot


def _paged_forward(target, lengths: list[int], kernels, page_size: int):
    """A fresh paged KV pool with one request slot per length (no Engine, no scheduler) and
    `run(ids, pos, req, meta)`: the target's logits for those tokens, written into it, under
    `kernels`. Returns `(run, slots, backend)`."""
    cfg, dev = target.config, target.embed_tokens.device
    pages = -(-max(lengths) // page_size)
    table = PageTable(len(lengths), pages, len(lengths) * pages + 1, page_size, dev)
    slots = [table.alloc_slot() for _ in lengths]
    for s, n in zip(slots, lengths, strict=True):
        table.reserve(s, n)
    kv = KVPool(cfg.num_hidden_layers, len(lengths) * pages + 1, page_size,
                cfg.num_key_value_heads, cfg.head_dim, target.dtype, dev)
    backend = PagedAttentionBackend(table.req_to_page, page_size, pages * page_size,
                                    kernels=kernels)
    target.set_kernels(kernels)

    def run(ids, pos, req, meta):
        loc = kv_slot(table.req_to_page, req, pos, page_size)
        return target(torch.tensor(ids, device=dev), pos, loc, kv, backend, meta, None,
                      capture_aux=False).logits
    return run, slots, backend


@torch.no_grad()
def full_logits(target, ids: list[int], page_size: int = 4) -> torch.Tensor:
    """Logits `[len(ids), V]` of every position of one prompt: one prefill forward over a
    fresh paged KV pool (no Engine, no scheduler), torch path."""
    run, (slot,), _ = _paged_forward(target, [len(ids)], TORCH, page_size)
    dev = target.embed_tokens.device
    pos = torch.arange(len(ids), device=dev)
    req = torch.full((len(ids),), slot, dtype=torch.int64, device=dev)
    return run(ids, pos, req, AttentionMetadata(req, (pos + 1).to(torch.int32)))


@torch.no_grad()
def verify_logits(target, rows: list[list[int]], n: int, kernels, page_size: int = 4
                  ) -> torch.Tensor:
    """Logits `[len(rows) * n, V]` of the target's verify forward: each row's first
    `len(row) - n` tokens prefilled into a paged KV pool (one forward, per-token metadata),
    then its last `n` tokens as one verify row (`uniform_row_metadata`: the multi-token
    attention), all rows in one forward, under `kernels`."""
    run, slots, backend = _paged_forward(target, [len(r) for r in rows], kernels, page_size)
    dev = target.embed_tokens.device
    ids, pos, req = [], [], []
    for s, r in zip(slots, rows, strict=True):
        ids += r[:-n]
        pos.append(torch.arange(len(r) - n, device=dev))
        req.append(torch.full((len(r) - n,), s, dtype=torch.int64, device=dev))
    pos, req = torch.cat(pos), torch.cat(req)
    run(ids, pos, req, AttentionMetadata(req, (pos + 1).to(torch.int32)))  # the prefixes
    ids = [t for r in rows for t in r[-n:]]
    pos = torch.cat([torch.arange(len(r) - n, len(r), device=dev) for r in rows])
    rows_req = torch.tensor(slots, dtype=torch.int64, device=dev)
    seq_lens = torch.tensor([len(r) for r in rows], dtype=torch.int32, device=dev)
    return run(ids, pos, rows_req.repeat_interleave(n),
               backend.uniform_row_metadata(rows_req, seq_lens, n))


def read_all(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(file), framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}


def rewrite(file: Path, drop=(), put: dict[str, torch.Tensor] | None = None) -> None:
    """Rewrite a safetensors file without `drop` and with `put` (added or replaced)."""
    tensors = {n: t for n, t in read_all(file).items() if n not in drop}
    tensors.update(put or {})
    save_file(tensors, str(file), metadata={"format": "pt"})


def named_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = dict(module.named_parameters(remove_duplicate=False))
    state.update(dict(module.named_buffers(remove_duplicate=False)))
    return state


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = named_state(a), named_state(b)
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name
