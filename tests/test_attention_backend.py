"""PagedAttentionBackend's row metadata and the engine forwards that use it.

CPU: the backend's forms against each other (torch path), and an Engine on the Triton path
under the interpreter (prefill rows, verify rows through the extend kernel) against the torch
path. GPU (`gpu` marker): the 8B-like target's verify forward through the extend kernel against
the per-token decode kernel, and its captured replay against the eager call, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from graphdraft.kernels import extend_attention
from graphdraft.kernels.config import TORCH, TRITON
from graphdraft.models.attention import AttentionMetadata, PagedAttentionBackend, RowMetadata
from graphdraft.runtime.kv_cache import kv_slot
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime


def _cache(page_size=4, max_reqs=3, pages=8, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    r2p = (torch.randperm(max_reqs * pages, generator=g) + 1).view(max_reqs, pages).to(torch.int32)
    kc = torch.randn((max_reqs * pages + 1) * page_size, hkv, d, generator=g)
    vc = torch.randn_like(kc)
    return r2p, kc, vc


def test_uniform_rows_equal_the_per_token_form():
    """Verify rows (n tokens each) give the bits of the per-token metadata the engine built
    before (clamped kv lens for padded rows, seq len 1 < n)."""
    r2p, kc, vc = _cache()
    be = PagedAttentionBackend(r2p, 4, 32, kernels=TORCH)
    req = torch.tensor([2, 0, 1])
    seq = torch.tensor([9, 1, 30], dtype=torch.int32)
    n = 4
    q = torch.randn(3 * n, 4, 8)
    meta = be.uniform_row_metadata(req, seq, n)
    assert isinstance(meta, RowMetadata) and be.metadata is meta
    out = be.attend(q, kc, vc, 0.3)
    j = torch.arange(3 * n) % n
    tok_kv = torch.clamp(seq.repeat_interleave(n) - n + j + 1, min=1).to(torch.int32)
    per_tok = be.attend(q, kc, vc, 0.3, AttentionMetadata(req.repeat_interleave(n), tok_kv))
    assert torch.equal(out, per_tok)


def test_single_token_rows_bind_the_decode_form():
    """n = 1 (target-only decode): the per-token form over the same buffers, no copies."""
    r2p, _, _ = _cache()
    be = PagedAttentionBackend(r2p, 4, 32, kernels=TORCH)
    req, seq = torch.tensor([1, 2]), torch.tensor([5, 7], dtype=torch.int32)
    meta = be.uniform_row_metadata(req, seq, 1)
    assert isinstance(meta, AttentionMetadata)
    assert meta.req_pool_indices is req and meta.kv_lens is seq


def test_ragged_rows_equal_token_metadata():
    r2p, kc, vc = _cache(seed=1)
    be = PagedAttentionBackend(r2p, 4, 32, kernels=TORCH)
    req = torch.tensor([1, 0, 2])
    seq = torch.tensor([12, 4, 20], dtype=torch.int32)
    ext = torch.tensor([7, 4, 1], dtype=torch.int32)
    q = torch.randn(12, 4, 8)
    meta = be.row_metadata(req, seq, ext, 7)
    assert meta.q_starts.tolist() == [0, 7, 11]
    out = be.attend(q, kc, vc, 0.3)
    tok = be.token_metadata(req, seq, ext, 12, torch.zeros(16, dtype=torch.int64),
                            torch.zeros(16, dtype=torch.int32))
    assert torch.equal(out, be.attend(q, kc, vc, 0.3, tok))


def test_bad_row_metadata():
    r2p, _, _ = _cache()
    be = PagedAttentionBackend(r2p, 4, 32, kernels=TORCH)
    req, seq = torch.tensor([1]), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="^n: "):
        be.uniform_row_metadata(req, seq, 0)
    with pytest.raises(ValueError, match="^max_extend: "):
        be.row_metadata(req, seq, torch.tensor([2], dtype=torch.int32), 0)
    assert be.metadata is None  # nothing bound


def test_engine_triton_path_matches_torch_path(monkeypatch):
    """Speculative greedy on the Triton path (interpreted; prefill chunks and verify rows through
    the extend kernel) emits the torch path's tokens (float32)."""
    calls = []
    kernel = extend_attention.paged_extend_attention

    def spy(*a, **kw):
        calls.append(kw.get("uniform_n", 0))
        return kernel(*a, **kw)

    monkeypatch.setattr(extend_attention, "paged_extend_attention", spy)
    target, head = make_models(3, dtype=torch.float32, layers=2)
    prompts = [[(5 * i + 3 * j) % 50 + 1 for j in range(4 + 5 * i)] for i in range(2)]
    params = SamplingParams(max_new_tokens=6)
    outs = []
    for backend in ("torch", "triton"):
        cfg = runtime(dtype="float32", kernel_backend=backend, speculative_num_steps=2,
                      max_num_batched_tokens=8)  # chunked prefill: prefill and mixed batches
        outs.append(Engine(target, cfg, head).generate(prompts, params))
    assert outs[0] == outs[1]
    assert 0 in calls and 3 in calls  # ragged rows and verify rows of N = 3 both ran


def _layer_by_layer(target, ids, pos, loc, pool, be, meta):
    """The target's forward one op at a time (o_proj and down_proj, then the residual add and
    RMSNorm as separate calls): the oracle of the fused forward. Returns (logits, aux)."""
    from graphdraft import ops

    hidden, residual, aux = target.embed_tokens[ids], None, {}
    for i, layer in enumerate(target.layers):
        if i in target.aux_layer_ids:
            aux[i] = hidden if residual is None else hidden + residual
        if residual is None:
            residual, x = hidden, layer.input_layernorm(hidden)
        else:
            x, residual = layer.input_layernorm(hidden, residual)
        hidden = layer.self_attn(x, pos, loc, pool.layer(i), target.cos_sin, be, meta)
        x, residual = layer.post_attention_layernorm(hidden, residual)
        hidden = layer.mlp(x)
    normed, _ = target.norm(hidden, residual)
    logits = ops.linear(normed, target.lm_head, kernels=target.kernels.with_backend("torch"))
    return logits, torch.cat([aux[i] for i in target.aux_layer_ids], -1)


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32),
                                          pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tokens", [4, 7])
def test_target_fused_residual_norm_equals_layer_by_layer(tokens, device, dtype):
    """The target's o_proj / down_proj fused with the residual add and the next RMSNorm (the
    GEMV's finisher at 4 rows, its second launch at 7; split K) give the separate ops' bits:
    logits and the EAGLE-3 aux hidden states (the residual stream entering the aux layers)."""
    from dataclasses import replace

    from graphdraft.config import ModelConfig
    from graphdraft.models.llama import LlamaForCausalLM
    from graphdraft.runtime.kv_cache import KVPool

    mc = ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=96, num_hidden_layers=3, vocab_size=50,
                     max_position_embeddings=256, rope_theta=10000.0)
    torch.manual_seed(tokens)
    with torch.device(device):
        target = LlamaForCausalLM(mc, dtype)
    for name, prm in target.named_parameters():
        prm.data.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.2)
    target.cos_sin = target.cos_sin.to(device)
    kc = replace(TRITON, gemv_split=2, gemv_block_k=16)  # split-K partials summed by the norm
    target.set_kernels(kc)
    ps, bs = 4, 1
    r2p = torch.arange(1, 9, dtype=torch.int32).view(1, 8)
    r2p = torch.cat([torch.zeros(1, 8, dtype=torch.int32), r2p]).to(device)
    pool = KVPool(3, 9, ps, 2, 16, dtype, device)
    pos = torch.arange(tokens, device=device)
    loc = kv_slot(r2p, torch.full((tokens,), bs, device=device), pos, ps)
    ids = torch.randint(0, 50, (tokens,)).to(device)
    be = PagedAttentionBackend(r2p, ps, 32, kernels=kc)
    req = torch.tensor([bs], device=device)
    seq = torch.tensor([tokens], dtype=torch.int32, device=device)
    with torch.inference_mode():
        meta = be.uniform_row_metadata(req, seq, tokens)
        fused = target(ids, pos, loc, pool, be, meta, None, capture_aux=True)
        logits, aux = _layer_by_layer(target, ids, pos, loc, pool, be, meta)
    assert logits.float().std() > 0.1
    assert torch.equal(fused.logits, logits)
    assert torch.equal(fused.aux_hidden, aux)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 5, 32])
def test_gpu_target_verify_extend_vs_per_token_and_graph(bs):
    """The engine's verify forward (rows of N = 4 through the extend kernel) against the same
    forward with per-token metadata (decode kernel), and its captured replay == eager."""
    from graphdraft.config import ModelConfig
    from graphdraft.models.llama import LlamaForCausalLM
    from graphdraft.runtime.kv_cache import KVPool

    mc = ModelConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                     intermediate_size=1024, num_hidden_layers=2, vocab_size=1000,
                     max_position_embeddings=4096, rope_theta=10000.0)
    torch.manual_seed(bs)
    with torch.device("cuda"):
        target = LlamaForCausalLM(mc, torch.bfloat16)
        for name, p in target.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.05)
    target.cos_sin = target.cos_sin.cuda()
    target.set_kernels(TRITON)
    n, ps, kv = 4, 16, 700
    per = -(-(kv + n) // ps)
    r2p = torch.zeros(bs + 1, per, dtype=torch.int32)
    r2p[1:] = (torch.randperm(bs * per) + 1).view(bs, per).to(torch.int32)
    pool = KVPool(2, bs * per + 1, ps, 2, 64, torch.bfloat16, "cuda")
    for t in pool.k + pool.v:
        t.normal_()
    seq = torch.randint(n + 1, kv + n, (bs,), dtype=torch.int32)
    pos = torch.cat([torch.arange(int(s) - n, int(s)) for s in seq])
    slot = torch.arange(1, bs + 1).repeat_interleave(n)
    loc = kv_slot(r2p, slot, pos, ps)
    ids = torch.randint(0, 1000, (bs * n,))
    r2p, seq, pos, loc, ids = (x.cuda() for x in (r2p, seq, pos, loc, ids))
    req = torch.arange(1, bs + 1, device="cuda")
    be = PagedAttentionBackend(r2p, ps, kv + 64, kernels=TRITON)

    def fwd(form):
        meta = (be.uniform_row_metadata(req, seq, n) if form == "rows" else
                be.token_metadata(req, seq, torch.full_like(seq, n), bs * n,
                                  torch.zeros(bs * n, dtype=torch.int64, device="cuda"),
                                  torch.zeros(bs * n, dtype=torch.int32, device="cuda")))
        return target(ids, pos, loc, pool, be, meta, None, capture_aux=True)

    with torch.inference_mode():
        rows, toks = fwd("rows"), fwd("tokens")
        assert rows.logits.float().std() > 0.5  # logits of order 1: the tolerance means something
        torch.testing.assert_close(rows.logits.float(), toks.logits.float(), rtol=0.05, atol=0.05)
        eager = fwd("rows").logits.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fwd("rows")
        graph.replay()
        assert torch.equal(out.logits, eager)
