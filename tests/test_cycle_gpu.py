"""The speculative cycle on the GPU: graph == eager bit for bit at every captured size and
between sizes (joins and leaves), == split mode, greedy spec == target greedy in float32,
seeded sampling reproducible, GRAPHDRAFT_EAGER=1 turns every graph off.

Run on the GPU machine with `make test-gpu` (or `pytest -m gpu tests/test_cycle_gpu.py`).
"""

from __future__ import annotations

import random

import pytest
import torch

from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = (1, 2, 4, 8)


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(61) for _ in range(rng.randint(3, 30))] for _ in range(count)]


def _params(i: int) -> SamplingParams:
    if i % 3 == 1:
        return SamplingParams(max_new_tokens=10 + i % 7, temperature=0.9, top_k=12, top_p=0.9,
                              seed=i)
    if i % 3 == 2:
        return SamplingParams(max_new_tokens=8 + i % 5, temperature=1.2)
    return SamplingParams(max_new_tokens=12 + i % 4)


def _state(eng: Engine) -> dict[str, torch.Tensor]:
    out = {f"slots.{k}": v.clone() for k, v in vars(eng.slots).items()}
    out["valid_cache_lengths"] = eng.states.valid_cache_lengths.clone()
    out["pack"] = eng.cycle.pack.clone()
    # page 0 is the dummy page inert rows write (warm-up and capture too): not compared
    p = eng.kv.page_size
    out["kv"] = torch.stack([torch.stack([k[p:], v[p:]])
                             for k, v in zip(eng.kv.k, eng.kv.v, strict=True)])
    dkv = eng.drafter.kv_pool
    out["draft_kv"] = torch.stack([dkv.k[0][dkv.page_size:], dkv.v[0][dkv.page_size:]])
    # drafts of the rows that committed tokens (pack's accept column > 0): inert padded rows
    # draft from the dummy page, whose contents warm-up left (their drafts are discarded)
    live = eng.cycle.pack[:, eng.n_row] > 0
    out["next_tokens"] = eng.drafter.bufs.next_tokens[: live.shape[0]][live]
    return out


def _lockstep(engines, prompts, joins, params=_params):
    """Step the engines in lockstep, adding prompts per `joins[step]` (sampling parameters
    `params(i)` for prompt i); compare every state tensor after each step. Returns the
    outputs."""
    reqs = [[] for _ in engines]
    step = 0
    while step in joins or any(e.has_work for e in engines):
        for i, e in enumerate(engines):
            for j in joins.get(step, []):
                reqs[i].append(e.add_request(prompts[j], params(j)))
            e.step()
        torch.cuda.synchronize()
        ref = _state(engines[0])
        for e in engines[1:]:
            got = _state(e)
            for k in ref:
                assert torch.equal(ref[k], got[k]), (step, k)
        step += 1
    return [[r.output for r in rs] for rs in reqs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cycle_graph_equals_eager_and_split_every_size(dtype):
    """Batches grow through 1, 2, 4, 8 (joins), shrink as requests finish and pass between
    captured sizes (3, 5-7 pad up): graph cycle == eager cycle == split mode on every state
    tensor after every step."""
    target, head = make_models(2, dtype=getattr(torch, dtype), device="cuda")
    ps = _prompts(3, 10)
    engines = []
    for kw in ({}, {"enforce_eager": True}, {"cycle_graph": False}):
        cfg = runtime(device="cuda", dtype=dtype, cuda_graph_bs=SIZES, cuda_graph_max_bs=8,
                      max_running_requests=8, **kw)
        e = Engine(target, cfg, head, seed=7)
        e.capture_graphs(progress=False)
        engines.append(e)
    joins = {0: [0], 3: [1], 5: [2, 3], 8: [4, 5, 6, 7], 12: [8], 14: [9]}
    outs = _lockstep(engines, ps, joins)
    assert outs[0] == outs[1] == outs[2]
    g, e, s = (x.graph_summary() for x in engines)
    assert g["spec_cycle"][0] > 0 and set(engines[0].cycle_graphs.stats.replays) >= {1, 2, 4, 8}
    assert sum(r for r, _ in e.values()) == 0
    assert s["spec_cycle"] == (0, 0) and s["target_verify"][0] > 0 and s["draft_decode"][0] > 0


def test_greedy_speculative_equals_target_greedy_float32():
    target, head = make_models(5, dtype=torch.float32, device="cuda")
    ps = _prompts(4, 6)
    cfg = runtime(device="cuda", dtype="float32", kernel_backend="torch")
    base = Engine(target, cfg)
    base.capture_graphs(progress=False)
    spec = Engine(target, cfg, head)
    spec.capture_graphs(progress=False)
    params = SamplingParams(max_new_tokens=20)
    assert spec.generate(ps, params) == base.generate(ps, params)
    assert spec.graph_summary()["spec_cycle"][0] > 0


def test_seeded_sampling_reproducible_graph_batches():
    target, head = make_models(6, dtype=torch.bfloat16, device="cuda")
    ps = _prompts(5, 5)
    p = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=16, top_p=0.95, seed=21)
    alone = Engine(target, runtime(device="cuda", dtype="bfloat16"), head)
    alone.capture_graphs(progress=False)
    a = alone.generate([ps[0]], p)[0]
    mixed = Engine(target, runtime(device="cuda", dtype="bfloat16", cuda_graph_bs=(6,)), head)
    mixed.capture_graphs(progress=False)
    out = mixed.generate(ps, [p] + [SamplingParams(max_new_tokens=12, temperature=1.0)] * 4)
    assert out[0] == a


def test_eager_env_turns_every_graph_off(monkeypatch):
    monkeypatch.setenv("GRAPHDRAFT_EAGER", "1")
    target, head = make_models(2, dtype=torch.bfloat16, device="cuda")
    eng = Engine(target, runtime(device="cuda", dtype="bfloat16"), head)
    eng.capture_graphs(progress=False)
    eng.generate(_prompts(6, 3), SamplingParams(max_new_tokens=8))
    assert all(replays == 0 for replays, _ in eng.graph_summary().values())
    assert eng.graph_summary()["spec_cycle"][1] > 0
