"""Chunked prefill of long prompts: the chunks give the KV and the text of one pass.

A prompt longer than the token budget (`max_num_batched_tokens`) is prefilled in chunks, each
attending to the KV the earlier chunks wrote; memory per step is then bounded by the chunk, not
the prompt (the persistent token buffers hold `max_num_tokens` rows whatever the prompt).
CPU: the target's forward in three chunks against one pass (last-token logits and every KV
entry; torch path in float64 over 90 tokens, Triton under the interpreter in float32, slow); the
Engine (float64 tiny pair; the Triton path under the interpreter in float32): a 120-token prompt
through chunks of 24 / 50 (Triton: 50 tokens, chunks of 18) against one pass: the target's and the draft head's KV at every
prompt position, the greedy text (target only and speculative). GPU: a 32k-token prompt of a
small wide model prefilled in 2k chunks peaks at the memory a 4k prompt peaks at (after a
warm-up prompt) and below a bound computed from the chunk (`chunk_peak_bound`).
"""

from __future__ import annotations

import random

import pytest
import torch

from graphdraft.kernels.cache_loc import kv_slot
from graphdraft.kernels.config import TORCH, TRITON
from graphdraft.models.attention import PagedAttentionBackend
from graphdraft.runtime.kv_cache import KVPool
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime

HAS_CUDA = torch.cuda.is_available()
PROMPT = 120


def _prefilled(engine: Engine, prompt: list[int], new_tokens: int = 6):
    """Add one request, step until its prompt is prefilled; returns (request, prefill steps)."""
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    steps = 0
    while req.prefilling or req.slot is None:
        engine.step()
        steps += 1
    engine.drain()
    return req, steps


def _kv(pool, req_to_page, slot: int, n: int, page_size: int) -> list[torch.Tensor]:
    """K and V of positions [0, n) of request `slot`, every layer of `pool`."""
    slots = kv_slot(req_to_page.cpu(), slot, torch.arange(n), page_size)
    return [t[slots].clone() for t in pool.k + pool.v]


def _run(budget: int, prompt: list[int], *, head: bool, backend: str, dtype: str,
         new_tokens: int = 4):
    target, eagle = make_models(seed=3, dtype=getattr(torch, dtype))
    cfg = runtime(max_num_batched_tokens=budget, max_context_len=len(prompt) + 16,
                  kernel_backend=backend, dtype=dtype)
    engine = Engine(target, cfg, eagle if head else None)
    req, steps = _prefilled(engine, prompt, new_tokens)
    ps = cfg.page_size
    kv = _kv(engine.kv, engine.pages.req_to_page, req.slot, len(prompt), ps)
    draft_kv = (_kv(engine.drafter.kv_pool, engine.pages.req_to_page, req.slot, len(prompt), ps)
                if head else [])
    while engine.has_work:
        engine.step()
    return kv, draft_kv, req.output, steps, engine.inputs.input_ids.shape[0]


@pytest.mark.parametrize("head", [False, True])
def test_chunks_give_the_kv_and_text_of_one_pass(head):
    prompt = [random.Random(1).randrange(61) for _ in range(PROMPT)]
    one = _run(128, prompt, head=head, backend="torch", dtype="float64")
    assert one[3] == 1  # one pass
    for budget in (24, 50):
        kv, draft_kv, out, steps, rows = _run(budget, prompt, head=head, backend="torch",
                                              dtype="float64")
        assert steps == -(-PROMPT // budget)  # ceil(120 / budget) chunks
        assert rows == max(budget, 6 * 4)  # token buffers: the chunk budget, not the prompt
        assert out == one[2]
        for a, b in zip(kv + draft_kv, one[0] + one[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _model_prefill(target, prompt: list[int], cuts: list[int], backend_kind: str):
    """The target's forward over `prompt` in chunks ending at `cuts` (request slot 1, pages of
    4 shuffled): the last chunk's last-token logits and the KV pool."""
    mc, ps = target.config, 4
    pages = -(-len(prompt) // ps)
    r2p = torch.zeros(2, pages, dtype=torch.int32)
    r2p[1] = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).to(torch.int32) + 1
    pool = KVPool(mc.num_hidden_layers, pages + 1, ps, mc.num_key_value_heads, mc.head_dim,
                  target.dtype, "cpu")
    kernels = TRITON if backend_kind == "triton" else TORCH
    target.set_kernels(kernels)
    backend = PagedAttentionBackend(r2p, ps, len(prompt), kernels=kernels)
    start = 0
    for end in cuts:
        pos = torch.arange(start, end)
        meta = backend.row_metadata(torch.tensor([1]), torch.tensor([end], dtype=torch.int32),
                                    torch.tensor([end - start], dtype=torch.int32), end - start)
        out = target(torch.tensor(prompt[start:end]), pos, kv_slot(r2p, 1, pos, ps), pool,
                     backend, meta, torch.tensor([end - start - 1]), capture_aux=False)
        start = end
    return out.logits, pool


@pytest.mark.parametrize("backend_kind,dtype,cuts", [
    ("torch", torch.float64, [32, 48, 90]),
    pytest.param("triton", torch.float32, [13, 22, 40], marks=pytest.mark.slow)])  # ~10 s
def test_model_chunks_give_the_logits_and_kv_of_one_pass(backend_kind, dtype, cuts):
    """The target's forward itself: three chunks (across pages of 4 and the kernels' blocks)
    against one pass: the last token's logits and every KV entry."""
    target, _ = make_models(seed=5, dtype=dtype)
    prompt = [random.Random(3).randrange(61) for _ in range(cuts[-1])]
    one_logits, one_pool = _model_prefill(target, prompt, cuts[-1:], backend_kind)
    logits, pool = _model_prefill(target, prompt, cuts, backend_kind)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, one_logits, **tol)
    for a, b in zip(pool.k + pool.v, one_pool.k + one_pool.v, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.slow  # ~15 s of the interpreter; the kernels' own row tests are fast
def test_triton_chunks_match_one_pass():
    """The Triton path (interpreter, float32): chunked prefill's extend attention over the KV
    of earlier chunks (page and block edges: chunks of 18 over pages of 4)."""
    prompt = [random.Random(2).randrange(61) for _ in range(50)]
    one = _run(64, prompt, head=False, backend="triton", dtype="float32", new_tokens=2)
    kv, _, out, steps, _ = _run(18, prompt, head=False, backend="triton", dtype="float32",
                                new_tokens=2)
    assert steps == 3
    for a, b in zip(kv, one[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert out == one[2]


def chunk_peak_bound(mc, chunk: int, partials: int) -> int:
    """Bytes a prefill step of `chunk` tokens may hold above the engine's own allocations
    (bf16 model `mc`): twice one layer's activations held at once (hidden stream, residual,
    normed input, attention output: 4 x hidden; q / k / v; the MLP's gate, up and product:
    3 x intermediate), plus the extend attention's `partials` fp32 values and their
    log-sum-exps (one per head_dim values). Nothing in it depends on the prompt's length."""
    qkv = (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
    per_token = 4 * mc.hidden_size + qkv + 3 * mc.intermediate_size
    return 2 * chunk * per_token * 2 + partials * 4 * (mc.head_dim + 1) // mc.head_dim


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_32k_prompt_prefill_memory_is_bounded_by_the_chunk():
    """A 32k-token prompt in 2k-token chunks peaks (above the engine's own allocations, after
    one warm-up prompt took the first-run allocations) at what a 4k prompt peaks at, and
    below `chunk_peak_bound` of the chunk: nothing grows with the prompt (the extend
    attention's split partials included: `extend_attention.extend_launch`)."""
    import math

    import triton

    from graphdraft.config import ModelConfig, RuntimeConfig
    from graphdraft.kernels.extend_attention import extend_launch
    from graphdraft.models.random_models import random_model_pair

    chunk, ctx = 2048, 32768 + 256
    mc = ModelConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                     intermediate_size=1024, num_hidden_layers=2, vocab_size=1000,
                     max_position_embeddings=32768 + 512, rope_theta=500000.0)
    target, _ = random_model_pair(mc, mc.replace(num_hidden_layers=1), torch.bfloat16, 0, 0.02,
                                  device="cuda")
    cfg = RuntimeConfig(max_running_requests=2, max_context_len=ctx,
                        max_num_batched_tokens=chunk, cuda_graph_max_bs=2, device="cuda",
                        enforce_eager=True)
    engine = Engine(target, cfg)
    g = mc.num_attention_heads // mc.num_key_value_heads
    launch = extend_launch(1, mc.num_key_value_heads, triton.next_power_of_2(g), chunk, ctx,
                           ragged=True, dot_fp32=False, num_splits=None,
                           device=torch.device("cuda"), kernels=engine.backend.kernels)
    shape = launch.partials_shape(chunk, mc.num_attention_heads, mc.head_dim)
    bound = chunk_peak_bound(mc, chunk, math.prod(shape) if shape else 0)
    peaks = {}
    for label, n in (("warm-up", 4096), ("4k", 4096), ("32k", 32768)):  # warm-up: first-run
        prompt = [random.Random(label).randrange(1000) for _ in range(n)]  # allocations
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        req, steps = _prefilled(engine, prompt, new_tokens=2)
        assert steps == n // chunk
        peaks[label] = torch.cuda.max_memory_allocated() - base
        while engine.has_work:
            engine.step()
        assert len(req.output) == 2
    msg = f"peaks {peaks}, bound {bound}, launch {launch}"
    print(msg)  # -rP shows it on a pass
    assert peaks["32k"] <= 1.1 * peaks["4k"] + (1 << 20), msg
    assert peaks["32k"] <= bound, msg
