"""The mixed step's target forward over padded (rows, tokens) buckets
(`graphdraft.serving.cycles.mixed_graphs`): the buckets; on the CPU the padded forward run
eagerly gives the unpadded Engine's greedy text (== target-only); on the GPU the captured
forward == the same padded forward run eagerly, bit for bit on every state tensor."""

from __future__ import annotations

import random

import pytest
import torch

from graphdraft.serving.cycles.mixed_graphs import MAX_TOKENS, row_buckets, token_buckets
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime
from tests.test_engine import prompts, target_only

CUDA = torch.cuda.is_available()


def test_buckets():
    assert token_buckets(4096) == [64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
                                   4096]
    assert token_buckets(300) == [64, 96, 128, 192, 256, 300]
    assert token_buckets(50) == [50]
    assert token_buckets(10 * MAX_TOKENS)[-1] == MAX_TOKENS
    assert row_buckets([1, 2, 4, 6]) == [6]
    assert row_buckets([1, 2, 4, 8, 16, 24, 32, 40]) == [8, 32, 40]
    assert row_buckets(list(range(8, 129, 8))) == [8, 32, 128]


def _padded(engine: Engine) -> list[tuple[int, int, int, int]]:
    """Turn the padded path on (eager here) and record each step's (bs, t, R, Tb)."""
    graphs = engine.mode.mixed_target
    graphs.active = True
    seen, run = [], graphs.run

    def spy(bs, t, logit_rows, bucket):
        seen.append((bs, t, *bucket))
        return run(bs, t, logit_rows, bucket)
    graphs.run = spy
    return seen


@pytest.mark.parametrize("head", [True, False])
def test_padded_mixed_forward_keeps_greedy_text(head):
    """Joins while others decode (mixed steps), chunked prompts: the padded forward's Engine
    writes what the unpadded one writes, and greedy speculative == target-only."""
    target, h = make_models(7)
    ps = prompts(11, 6)
    cfg = runtime(max_num_batched_tokens=40)
    params = SamplingParams(max_new_tokens=12)
    expected = target_only(target, cfg, ps, 12)
    engine = Engine(target, cfg, h if head else None)
    seen = _padded(engine)
    reqs = []
    for i, p in enumerate(ps):  # one join a step: every step after the first is mixed
        reqs.append(engine.add_request(p, params))
        engine.step()
        if i == 2:
            engine.step()
    while engine.has_work:
        engine.step()
    assert [r.output for r in reqs] == expected
    assert any(r > bs for bs, _, r, _ in seen) and any(tb > t for _, t, _, tb in seen)
    assert all(r >= bs and tb >= t for bs, t, r, tb in seen)


def test_prompt_logprobs_steps_take_the_unpadded_forward():
    target, head = make_models(8)
    engine = Engine(target, runtime(), head)
    seen = _padded(engine)
    req = engine.add_request([3, 4, 5, 6, 7], SamplingParams(max_new_tokens=3, prompt_logprobs=1))
    while engine.has_work:
        engine.step()
    assert seen == [] and len(req.output) == 3 and len(req.prompt_logprobs) == 5


def _state(eng: Engine) -> dict[str, torch.Tensor]:
    out = {f"slots.{k}": v.clone() for k, v in vars(eng.slots).items()}
    out["valid_cache_lengths"] = eng.states.valid_cache_lengths.clone()
    out["pack"] = eng.cycle.pack.clone()
    p = eng.kv.page_size  # page 0: the dummy page (inert rows and padded tokens write it)
    out["kv"] = torch.stack([torch.stack([k[p:], v[p:]])
                             for k, v in zip(eng.kv.k, eng.kv.v, strict=True)])
    dkv = eng.drafter.kv_pool
    out["draft_kv"] = torch.stack([dkv.k[0][dkv.page_size:], dkv.v[0][dkv.page_size:]])
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_captured_mixed_forward_equals_the_padded_eager_one(dtype):
    """Two Engines in lockstep, joins at several steps (mixed steps of several sizes): the
    one replaying the captured mixed forwards == the one running the same padded forward
    eagerly (enforce_eager), every state tensor after every step; the graphs did replay."""
    target, head = make_models(2, dtype=getattr(torch, dtype), device="cuda")
    rng = random.Random(5)
    ps = [[rng.randrange(61) for _ in range(rng.randint(3, 40))] for _ in range(12)]
    engines = []
    for kw in ({}, {"enforce_eager": True}):
        cfg = runtime(device="cuda", dtype=dtype, cuda_graph_bs=(1, 2, 4, 8),
                      cuda_graph_max_bs=8, max_running_requests=8, max_num_batched_tokens=200,
                      **kw)
        e = Engine(target, cfg, head, seed=7)
        e.capture_graphs(progress=False)
        assert e.mode.mixed_target.active  # on CUDA, graphs or not
        engines.append(e)
    assert engines[0].mode.mixed_target.by_tokens and not engines[1].mode.mixed_target.by_tokens
    joins = {0: [0, 1], 2: [2], 3: [3, 4, 5], 6: [6], 7: [7, 8], 9: [9], 12: [10, 11]}
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, seed=3)
    reqs, step = [[], []], 0
    while step in joins or any(e.has_work for e in engines):
        for i, e in enumerate(engines):
            for j in joins.get(step, []):
                reqs[i].append(e.add_request(ps[j], params))
            e.step()
        torch.cuda.synchronize()
        a, b = _state(engines[0]), _state(engines[1])
        for k in a:
            assert torch.equal(a[k], b[k]), (step, k)
        step += 1
    assert [r.output for r in reqs[0]] == [r.output for r in reqs[1]]
    replays = sum(sum(f.stats.replays.values())
                  for f in engines[0].mode.mixed_target.by_tokens.values())
    assert replays > 0 and len(engines[0].mode.mixed_target.by_tokens) == 5  # 64 .. 200
