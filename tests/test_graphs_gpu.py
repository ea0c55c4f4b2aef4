"""CUDA-graph replay equals eager, bit for bit; padding never leaks; long runs stay flat.

Run on the GPU machine with `make test-gpu`. Eager runs use the same drafter
with `GRAPHDRAFT_EAGER=1` (re-read at every call), on the same buffers and a
restored KV pool, so the two paths see identical state.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.drafter_harness import FakeServingLoop, make_setup
from tests.engine_harness import make_models, runtime

pytestmark = pytest.mark.gpu


def _run_both(s, ctx, hidden, tokens, accept):
    """Graph run and eager run from the same state: (next_g, next_e, kv_g, kv_e, kv_before)."""
    k, v = s.drafter.kv_pool.layer(0)
    k0, v0 = k.clone(), v.clone()
    next_g = s.drafter.run(ctx, hidden, tokens, accept)
    kv_g = (k.clone(), v.clone())
    k.copy_(k0)
    v.copy_(v0)
    os.environ["GRAPHDRAFT_EAGER"] = "1"
    try:
        next_e = s.drafter.run(ctx, hidden, tokens, accept)
    finally:
        del os.environ["GRAPHDRAFT_EAGER"]
    return next_g, next_e, kv_g, (k.clone(), v.clone()), (k0, v0)


def _assert_graph_equals_eager(s, ctx, hidden, tokens, accept):
    """Run the decode batch replayed and eagerly; assert equal drafts and KV writes.
    Returns (graph drafts, graph-run KV, KV before)."""
    ng, ne_, kv_g, kv_e, kv0 = _run_both(s, ctx, hidden, tokens, accept)
    assert torch.equal(ng, ne_), f"bs={ctx.bs}: graph drafts != eager drafts"
    for a, b in zip(kv_g, kv_e, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), f"bs={ctx.bs}: KV writes differ"
    return ng, kv_g, kv0


def _changed_slots(before, after):
    diff = (before != after)
    diff = diff | (before.isnan() ^ after.isnan())
    return set(torch.nonzero(diff.flatten(1).any(1)).flatten().tolist())


@pytest.mark.parametrize("page_size,hot,dtype", [(1, False, "bfloat16"), (16, True, "bfloat16"),
                                                  (16, False, "float32")])
def test_replay_bit_identical_to_eager_every_bs(page_size, hot, dtype):
    s = make_setup(steps=3, page_size=page_size, hot=hot, seed=page_size, dtype=dtype,
                   device="cuda", max_running_requests=12, cuda_graph_max_bs=8)
    s.drafter.capture_graphs()
    assert s.drafter.decode_graphs.captured_sizes == [1, 2, 4, 8]
    loop = FakeServingLoop(s, seed=page_size)
    bystander = loop.add(40, 64)  # a request outside the decode batches below
    rows, order, ctx, hidden, tokens, accept = loop.prepare()
    loop.commit(rows, order, tokens, accept, s.drafter.run(ctx, hidden, tokens, accept))
    loop.reqs.remove(bystander)
    by_pages = set(s.pages.pages_of(bystander.slot))
    rng = random.Random(0)
    for bs in range(1, 10):  # every captured size, sizes between them, and one above (eager)
        while len(loop.reqs) < bs:
            loop.add(rng.randint(3, 30), 64)
        while len(loop.reqs) > bs:
            loop.finish(loop.reqs[-1])
        for _ in range(3):
            rows, order, ctx, hidden, tokens, accept = loop.prepare(list(range(0, 5)))
            if ctx.num_extends:  # prefill new requests (eager), then test decode batches
                loop.commit(rows, order, tokens, accept, s.drafter.run(ctx, hidden, tokens, accept))
                continue
            ng, kv_g, kv0 = _assert_graph_equals_eager(s, ctx, hidden, tokens, accept)
            ps = s.cfg.page_size
            allowed = {0} | {p for r in loop.reqs for p in s.pages.pages_of(r.slot)}
            for before, after in zip(kv0, kv_g, strict=True):
                pages = {slot // ps for slot in _changed_slots(before, after)}
                assert pages <= allowed, f"bs={bs}: wrote pages {pages - allowed}"
                assert not pages & by_pages, "a request outside the batch was written"
            loop.commit(rows, order, tokens, accept, ng)
    st = s.drafter.decode_graphs.stats
    assert st.total_replays > 0 and st.eager["above_max"] > 0


def _decode_batch_after_prefill(bs, seed):
    """A bf16 drafter with graphs captured (bs 1..8), `bs` requests prefilled through it, and
    the next decode batch: (setup, ctx, hidden, tokens, accept)."""
    s = make_setup(steps=3, page_size=16, hot=True, seed=seed, device="cuda", dtype="bfloat16",
                   max_running_requests=8, cuda_graph_max_bs=8)
    s.drafter.capture_graphs()
    loop = FakeServingLoop(s, seed=bs)
    for _ in range(bs):
        loop.add(20, 64)
    rows, order, ctx, hidden, tokens, accept = loop.prepare()
    loop.commit(rows, order, tokens, accept, s.drafter.run(ctx, hidden, tokens, accept))
    _, _, ctx, hidden, tokens, accept = loop.prepare(list(range(0, 5)))
    assert ctx.num_extends == 0
    return s, ctx, hidden, tokens, accept


@pytest.mark.parametrize("bs", [1, 3, 8])
def test_pdl_launches_draft_like_plain_launches(bs, monkeypatch):
    """Graphs captured with programmatic dependent launch (the default) vs an eager run whose
    head kernels all launch plainly (`KernelConfig(pdl=False, gemv_pdl=False)`): identical
    drafts and KV writes (griddepcontrol.wait guards every read of a previous kernel's output).
    The drafter's own index kernels and attention launch under the default config either way
    (they take no `kernels` from the drafter yet)."""
    s, ctx, hidden, tokens, accept = _decode_batch_after_prefill(bs, seed=bs)
    head = s.drafter.head
    with_pdl = head.kernels
    assert with_pdl.use_triton and with_pdl.pdl and with_pdl.gemv_pdl
    plain = with_pdl.replace(pdl=False, gemv_pdl=False)
    real_run = s.drafter.run

    def run(*args):
        if os.environ.get("GRAPHDRAFT_EAGER") != "1":
            return real_run(*args)  # the replay: graphs keep their PDL edges
        head.set_kernels(plain)  # the eager half launches plainly
        try:
            return real_run(*args)
        finally:
            head.set_kernels(with_pdl)

    monkeypatch.setattr(s.drafter, "run", run)
    _assert_graph_equals_eager(s, ctx, hidden, tokens, accept)


@pytest.mark.parametrize("bs", [1, 3, 8])
def test_hidden_in_the_drafter_buffer_replays_like_a_copy(bs):
    """Replays fed through `decode_hidden_buffer` (no hidden copy) == replays fed a separate
    tensor == eager, drafts and KV writes."""
    s, ctx, hidden, tokens, accept = _decode_batch_after_prefill(bs, seed=bs + 40)
    copied, kv_copied, kv0 = _assert_graph_equals_eager(s, ctx, hidden, tokens, accept)
    k, v = s.drafter.kv_pool.layer(0)
    k.copy_(kv0[0])
    v.copy_(kv0[1])
    view = s.drafter.decode_hidden_buffer(bs)
    view.copy_(hidden)
    in_place, kv_in_place, _ = _assert_graph_equals_eager(s, ctx, view, tokens, accept)
    assert torch.equal(copied, in_place)
    for a, b in zip(kv_copied, kv_in_place, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    # the zero-copy call (hidden in place, drafts returned as the buffer's view) replays alike
    k.copy_(kv0[0])
    v.copy_(kv0[1])
    replays = s.drafter.decode_graphs.stats.total_replays
    out = s.drafter.run(ctx, view, tokens, accept, copy_output=False)
    assert s.drafter.decode_graphs.stats.total_replays == replays + 1
    assert out.data_ptr() == s.drafter.bufs.next_tokens.data_ptr() and torch.equal(out, copied)


def test_ten_thousand_replays_no_growth_no_recapture():
    s = make_setup(steps=3, page_size=16, seed=3, device="cuda", dtype="bfloat16",
                   validate_inputs=False)
    s.drafter.capture_graphs()
    loop = FakeServingLoop(s, seed=3)
    for _ in range(5):
        loop.add(12, 64)
    rows, order, ctx, hidden, tokens, accept = loop.prepare()
    loop.commit(rows, order, tokens, accept, s.drafter.run(ctx, hidden, tokens, accept))
    rows, order, ctx, hidden, tokens, accept = loop.prepare()
    captured = dict(s.drafter.decode_graphs.stats.capture_seconds)
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_allocated()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for i in range(10_000):
        accept.copy_(torch.randint(0, 5, accept.shape, device="cuda", generator=gen))
        tokens.copy_(torch.randint(0, 97, tokens.shape, device="cuda", generator=gen))
        s.drafter.run(ctx, hidden, tokens, accept)
        if i == 100:
            torch.cuda.synchronize()
            mem1 = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= max(mem0, mem1)
    assert s.drafter.decode_graphs.stats.capture_seconds == captured
    assert s.drafter.decode_graphs.stats.replays[8] == 10_000
    assert s.drafter.multi_step_graphs.stats.total_eager == 0


@pytest.mark.parametrize("cycle_graph", [True, False])
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_graphs_lossless_float64(steps, page_size, cycle_graph):
    """Speculative greedy through graphs == target-only: the whole-cycle graph, or (cycle_graph
    off) the split graphs (target verify + both draft forwards)."""
    from graphdraft.serving.engine import Engine
    from graphdraft.serving.verify import SamplingParams

    target, head = make_models(steps, device="cuda", draft_vocab=40 if steps % 2 else None)
    cfg = runtime(device="cuda", kernel_backend="torch", speculative_num_steps=steps,
                  page_size=page_size, cycle_graph=cycle_graph)
    rng = random.Random(1)
    prompts = [[rng.randrange(61) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    base = Engine(target, cfg)
    base.capture_graphs()
    spec = Engine(target, cfg, head)
    spec.capture_graphs()
    params = SamplingParams(max_new_tokens=20)
    assert spec.generate(prompts, params) == base.generate(prompts, params)
    summary = spec.graph_summary()
    if cycle_graph:
        assert summary["spec_cycle"][0] > 0, summary
    else:
        assert summary["spec_cycle"][0] == 0, summary
        assert all(replays > 0 for name, (replays, _) in summary.items()
                   if name != "spec_cycle" and (steps > 1 or name != "draft_multi_step")), summary


def test_engine_graphs_equal_enforce_eager_bf16_triton():
    from graphdraft.serving.engine import Engine
    from graphdraft.serving.verify import SamplingParams

    target, head = make_models(2, dtype=torch.bfloat16, device="cuda")
    rng = random.Random(2)
    prompts = [[rng.randrange(61) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    outs = []
    for eager in (False, True):
        cfg = runtime(device="cuda", dtype="bfloat16", enforce_eager=eager)
        eng = Engine(target, cfg, head)
        eng.capture_graphs()
        outs.append(eng.generate(prompts, SamplingParams(max_new_tokens=24)))
        replays = sum(r for r, _ in eng.graph_summary().values())
        assert (replays == 0) == eager
    assert outs[0] == outs[1]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.integers(1, 4), page_size=st.sampled_from([1, 16]), hot=st.booleans(),
       seed=st.integers(0, 10_000),
       ops=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(1, 16)),
                    min_size=4, max_size=14))
def test_property_graph_replay_equals_eager(steps, page_size, hot, seed, ops):
    """Requests joining (prompt 1..40, chunk 1..16) and leaving at random, prefill chunks mixed
    with decode rows, accept lengths 0..N, decode batches across, between and above the
    captured sizes: every decode draft call gives the same drafts and KV writes replayed as
    run eagerly."""
    s = make_setup(steps=steps, page_size=page_size, hot=hot, seed=seed % 89, dtype="bfloat16",
                   device="cuda", max_running_requests=12, cuda_graph_max_bs=8)
    s.drafter.capture_graphs()
    loop = FakeServingLoop(s, seed=seed)
    rng = random.Random(seed)
    accepts = list(range(0, steps + 2))
    for op, prompt_len, chunk in ops:
        if op == 0 and len(loop.reqs) < 11:
            loop.add(prompt_len, chunk)
        elif op == 1 and loop.reqs:
            loop.finish(rng.choice(loop.reqs))
        if not loop.reqs:
            continue
        rows, order, ctx, hidden, tokens, accept = loop.prepare(accepts)
        if ctx.num_extends:
            loop.commit(rows, order, tokens, accept, s.drafter.run(ctx, hidden, tokens, accept))
            continue
        ng, _, _ = _assert_graph_equals_eager(s, ctx, hidden, tokens, accept)
        loop.commit(rows, order, tokens, accept, ng)
