"""The speculation policy on the GPU: for every captured (padded bs, k) the cycle graph equals
the eager cycle (and the split mode) bit for bit on every state tensor under forced k switches
(k = 0 stretches included) with joins and leaves; greedy speculative output equals target-only
in float32 under forced switches and under the adaptive policy with its measured cost table;
the head's KV-only step (k = 0) writes the full step's KV bit for bit in bf16 on the kernels.

Run on the GPU machine with `make test-gpu` (or `pytest -m gpu tests/test_policy_gpu.py`).
"""

from __future__ import annotations

import random

import pytest
import torch

from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime
from tests.test_cycle_gpu import _lockstep, _state
from tests.test_policy_engine import ForcedPolicy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = (1, 2, 4, 8)
KS = [0, 3, 1, 3, 3, 0, 1, 1, 0, 0, 0, 0, 0, 0, 3, 1]  # every k after every other k; a k = 0 stretch


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(61) for _ in range(rng.randint(3, 30))] for _ in range(count)]


def _params(i: int) -> SamplingParams:
    if i % 3 == 1:
        return SamplingParams(max_new_tokens=12 + i % 7, temperature=0.9, top_k=12, top_p=0.9,
                              seed=i)
    return SamplingParams(max_new_tokens=14 + i % 4)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_every_captured_bs_and_k_graph_equals_eager_and_split(dtype):
    target, head = make_models(2, dtype=getattr(torch, dtype), device="cuda")
    ps = _prompts(3, 10)
    engines = []
    for kw in ({}, {"enforce_eager": True}, {"cycle_graph": False}):
        cfg = runtime(device="cuda", dtype=dtype, cuda_graph_bs=SIZES, cuda_graph_max_bs=8,
                      max_running_requests=8, speculative_policy="adaptive", **kw)
        e = Engine(target, cfg, head, seed=7)
        e.capture_graphs(progress=False)
        e.set_policy(ForcedPolicy(KS))
        engines.append(e)
    joins = {0: [0], 3: [1], 5: [2, 3], 8: [4, 5, 6, 7], 12: [8], 14: [9]}
    outs = _lockstep(engines, ps, joins, _params)
    assert outs[0] == outs[1] == outs[2]
    g = engines[0]
    for k, f in g.graph_registry.family("spec_cycle").items():  # every k replayed, no cycle of the graph engine eager
        assert f.stats.total_replays > 0 and f.stats.total_eager == 0, k
    # cycle mode captured no split-mode graphs; the split engine captured them per k
    assert all(not f.captured_sizes for f in g.graph_registry.family("target_verify").values())
    assert all(not f.captured_sizes for f in g.graph_registry.family("draft_decode").values())
    s = engines[2]
    assert all(f.stats.total_replays > 0 for f in s.graph_registry.family("target_verify").values())
    assert all(f.stats.total_replays > 0 for f in s.graph_registry.family("draft_decode").values())


def test_graph_equals_eager_at_each_captured_bs_for_each_k():
    """For each captured size, exactly that many requests decode through the whole k cycle
    (each k at least twice): graph == eager on every state tensor after every step."""
    target, head = make_models(3, dtype=torch.bfloat16, device="cuda")
    engines = []
    for kw in ({}, {"enforce_eager": True}):
        cfg = runtime(device="cuda", dtype="bfloat16", cuda_graph_bs=SIZES, cuda_graph_max_bs=8,
                      max_running_requests=8, max_num_batched_tokens=64,
                      speculative_policy="adaptive", **kw)
        e = Engine(target, cfg, head, seed=3)
        e.capture_graphs(progress=False)
        e.set_policy(ForcedPolicy(KS))
        engines.append(e)
    rng = random.Random(5)
    for bs in SIZES:
        ps = [[rng.randrange(61) for _ in range(6)] for _ in range(bs)]
        p = SamplingParams(max_new_tokens=2 * len(KS) * 4 + 4, ignore_eos=True)
        outs = []
        for e in engines:
            outs.append([e.add_request(x, p) for x in ps])
        while any(e.has_work for e in engines):
            for e in engines:
                e.step()
            torch.cuda.synchronize()
            ref, got = _state(engines[0]), _state(engines[1])
            for k in ref:
                assert torch.equal(ref[k], got[k]), (bs, k)
        assert [r.output for r in outs[0]] == [r.output for r in outs[1]]
    for k, f in engines[0].graph_registry.family("spec_cycle").items():
        assert set(f.stats.replays) >= set(SIZES), (k, dict(f.stats.replays))


def test_measured_costs_cover_every_captured_bs_and_k():
    target, head = make_models(2, dtype=torch.bfloat16, device="cuda")
    cfg = runtime(device="cuda", dtype="bfloat16", cuda_graph_bs=SIZES, cuda_graph_max_bs=8,
                  max_running_requests=8, speculative_policy="adaptive")
    eng = Engine(target, cfg, head)
    eng.capture_graphs(progress=False)
    # timed here, or by an earlier engine of this shape in this Triton cache (the cost cache)
    assert eng.cost_source in ("measured", "cached")
    table = eng.policy.costs.measured()
    assert set(table) == {(b, k) for b in SIZES for k in eng.steps}
    assert all(v > 0 for v in table.values())
    # the tables are neutral after timing: a run is still exact
    ps = _prompts(9, 4)
    base = Engine(target, cfg.replace(speculative_policy="fixed"))
    base.capture_graphs(progress=False)
    p = SamplingParams(max_new_tokens=12)
    assert eng.generate(ps, p) == base.generate(ps, p)
    # every decode cycle was timed by its CUDA events, read at retirement: the online costs
    # cover the (padded bs, k) the policy ran, and replace the capture-time figures there
    assert eng.cycle_timer is not None
    online = eng.policy.costs.online()
    ran = {(b, k) for b, k in eng.policy_history}
    assert online and set(online) == ran
    for key, ms in online.items():
        assert 0 < ms < 1000 and eng.policy.costs.cost(*key) == ms
    assert eng.metrics_snapshot()["speculation"]["cost_ms_online"]


@pytest.mark.parametrize("forced", [True, False])
def test_greedy_speculative_equals_target_greedy_float32(forced):
    target, head = make_models(5, dtype=torch.float32, device="cuda")
    ps = _prompts(4, 6)
    cfg = runtime(device="cuda", dtype="float32", kernel_backend="torch",
                  speculative_policy="adaptive")
    base = Engine(target, cfg)
    base.capture_graphs(progress=False)
    spec = Engine(target, cfg, head)
    spec.capture_graphs(progress=False)
    if forced:
        spec.set_policy(ForcedPolicy(KS))
    params = SamplingParams(max_new_tokens=20)
    assert spec.generate(ps, params) == base.generate(ps, params)
    assert spec.graph_summary()["spec_cycle"][0] > 0


@pytest.mark.parametrize("tokens", [1, 4, 32, 256])
def test_store_kv_equals_the_full_steps_kv_bf16(tokens):
    """`Eagle3DraftHead.store_kv` (the k = 0 cycle's KV-only step, projecting the kv rows of
    qkv_proj only) writes the KV the full first step writes on the GPU kernels in bf16: bit for
    bit on the Triton GEMV path (tokens <= small_m_max: the full product's K split forced);
    above it cuBLAS multiplies a narrower matrix and may choose another kernel, so there the
    entries agree within bf16 rounding (at most 2 ulp of the value), and the run says whether
    they were bit-identical (values within 2 bf16 ulp; near zero, 2^-7 of the largest)."""
    from tests.drafter_harness import make_setup

    s = make_setup(steps=3, seed=43, dtype="bfloat16", device="cuda", kernel_backend="auto",
                   max_running_requests=256, max_num_batched_tokens=1024, cuda_graph_max_bs=8)
    head, d = s.head, s.drafter
    g = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.randint(0, head.config.vocab_size, (tokens,), generator=g, device="cuda")
    hidden = torch.randn(tokens, head.target_hidden_width, generator=g, device="cuda").to(head.dtype)
    positions = torch.randint(0, 150, (tokens,), generator=g, device="cuda")
    k, v = d.kv_pool.layer(0)
    locs = 1 + torch.randperm(k.shape[0] - 1, generator=g, device="cuda")[:tokens]
    meta = d.backend.bind_metadata(torch.zeros(tokens, dtype=torch.int64, device="cuda"),
                                   torch.full((tokens,), 7, dtype=torch.int32, device="cuda"))
    start = (k.clone(), v.clone())
    head(ids, positions, hidden, locs, (k, v), d.backend, meta)
    full = (k.clone(), v.clone())
    k.copy_(start[0])
    v.copy_(start[1])
    head.store_kv(ids, positions, hidden, locs, (k, v))
    torch.cuda.synchronize()
    assert not torch.equal(full[0], start[0])
    gemv_path = head.midlayer.self_attn.kernels.use_triton and tokens <= \
        head.midlayer.self_attn.kernels.small_m_max
    exact = torch.equal(k, full[0]) and torch.equal(v, full[1])
    if gemv_path:
        assert exact
    else:
        print(f"store_kv at {tokens} tokens (cuBLAS): bit-identical to the full step: {exact}")
        for got, want in ((k, full[0]), (v, full[1])):
            scale = float(want.float().abs().max())
            torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -6,
                                       atol=2.0 ** -7 * scale)
        untouched = torch.ones(k.shape[0], dtype=torch.bool, device="cuda")
        untouched[locs] = False
        assert torch.equal(k[untouched], start[0][untouched])
