"""`Eagle3DraftHead.store_kv` (the k = 0 cycle's KV-only step): it projects only the qkv rows
the KV write reads, with the bits of the full projection (tests/test_drafter.py checks the
cache entries bit for bit against the full step on the torch and Triton paths)."""

from __future__ import annotations

import pytest
import torch

from graphdraft.kernels import gemv
from graphdraft.kernels.config import KernelConfig
from graphdraft.models.eagle3 import Eagle3DraftHead
from perf.models_8b import LLAMA31_8B_HEAD
from tests.drafter_harness import make_setup


def _meta_head(kernels: KernelConfig) -> Eagle3DraftHead:
    with torch.device("meta"):
        return Eagle3DraftHead(LLAMA31_8B_HEAD, torch.bfloat16, kernels=kernels)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_8b_head_kv_rows_are_a_third_of_qkv_with_the_full_tiles(backend):
    """At the 8B shape (32 q heads, 8 kv heads, D 128): the KV-only projection reads the last
    q head and the k / v rows, 2176 of 6144 rows, at every T; where the Triton GEMV runs
    (T <= small_m_max) with the full product's tiles (so the same K split: the same bits)."""
    kc = KernelConfig(backend=backend)
    head = _meta_head(kc)
    w = head.midlayer.self_attn.qkv_proj
    assert tuple(w.shape) == (6144, 8192)
    for t in (1, 2, 7, 32, 33, 256):
        rows, akc = head._kv_rows(t)
        assert rows.shape[0] == (1 + 2 * 8) * 128 and rows.is_contiguous()
        assert rows.storage_offset() == (6144 - 2176) * 8192  # the row slice, no copy
        if backend == "triton" and t <= kc.small_m_max:
            full = gemv.gemv_config(t, 6144, 8192, kernels=kc)
            assert gemv.gemv_config(t, 2176, 8192, kernels=akc) == full
            assert akc.gemv_split == full.split
        else:
            assert akc is kc
    assert len(head._kv_rows_cache) == 6


@pytest.mark.parametrize("kernel_backend,tokens", [("torch", 5), ("triton", 3), ("triton", 34)])
def test_store_kv_projects_only_the_kv_rows(kernel_backend, tokens):
    """The KV-only step's projection is one matmul over the kv row slice (the q rows are
    never read): recorded at `ops.linear_partials`."""
    from graphdraft import ops

    s = make_setup(steps=3, seed=44, kernel_backend=kernel_backend, max_running_requests=40,
                   max_num_batched_tokens=160)
    head, d = s.head, s.drafter
    cfg = head.config
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
    hidden = torch.randn(tokens, head.target_hidden_width, generator=g).to(head.dtype)
    positions = torch.randint(0, 150, (tokens,), generator=g)
    k, v = d.kv_pool.layer(0)
    locs = 1 + torch.randperm(k.shape[0] - 1, generator=g)[:tokens]
    seen = []
    orig = ops.linear_partials

    def spy(x, weight, **kw):
        seen.append(tuple(weight.shape))
        return orig(x, weight, **kw)

    ops.linear_partials = spy
    try:
        head.store_kv(ids, positions, hidden, locs, (k, v))
    finally:
        ops.linear_partials = orig
    qkv = head.midlayer.self_attn.qkv_proj
    kv_rows = (1 + 2 * cfg.num_key_value_heads) * cfg.head_dim
    assert kv_rows < qkv.shape[0]
    assert seen[-1] == (kv_rows, qkv.shape[1])
