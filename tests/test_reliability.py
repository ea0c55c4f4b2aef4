"""Faults lose nothing; random batch mixes keep the drafter and the serving loop exact."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.drafter_harness import make_setup
from tests.engine_harness import TARGET, make_models, runtime
from tests.test_drafter import drive
from tests.test_engine import prompts, target_only


@pytest.mark.parametrize("where", ["target", "drafter"])
def test_failed_forward_leaves_engine_consistent(where, monkeypatch):
    """A forward that raises mid-cycle (before the commit) changes no request, page or
    per-slot device state; serving resumes exactly."""
    target, head = make_models(12)
    ps = prompts(12, 4)
    cfg = runtime(speculative_num_steps=3)
    expected = target_only(target, cfg, ps, 12)
    eng = Engine(target, cfg, head)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=12)) for p in ps]
    eng.step()
    eng.step()
    obj = eng.mode if where == "target" else eng.drafter
    name = "target_decode" if where == "target" else "_decode"  # what the cycle calls
    original = getattr(obj, name)

    def boom(*a, **k):
        raise RuntimeError("injected fault")

    eng.drain()
    state = [(r.committed, list(r.output), r.slot) for r in reqs]
    free, table = eng.pages.num_free_pages, eng.pages.req_to_page.clone()
    vcl = eng.states.valid_cache_lengths.clone()
    slot_state = {k: v.clone() for k, v in vars(eng.slots).items()}
    monkeypatch.setattr(obj, name, boom)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    eng.drain()
    assert [(r.committed, list(r.output), r.slot) for r in reqs] == state
    assert eng.pages.num_free_pages == free and torch.equal(eng.pages.req_to_page, table)
    assert torch.equal(eng.states.valid_cache_lengths, vcl)
    assert all(torch.equal(v, slot_state[k]) for k, v in vars(eng.slots).items())
    monkeypatch.setattr(obj, name, original)
    while eng.has_work:
        eng.step()
    assert [r.output for r in reqs] == expected


def test_engine_rejects_mismatched_models():
    target, head = make_models(0)  # float64
    with pytest.raises(ValueError, match="target"):
        Engine(target, runtime(dtype="float32"))
    with pytest.raises(ValueError, match="head"):
        Engine(target, runtime(), make_models(0, dtype=torch.float32)[1])
    with pytest.raises(ValueError, match="drafter"):
        Engine(target, runtime(), head, drafter=object())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.integers(1, 4), page_size=st.sampled_from([1, 3, 16]), hot=st.booleans(),
       seed=st.integers(0, 10_000),
       prompts_=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 16)), min_size=1,
                         max_size=5),
       accepts=st.lists(st.integers(0, 5), min_size=1, max_size=5))
def test_property_drafter_matches_reference(steps, page_size, hot, seed, prompts_, accepts):
    """Random mixes of prefill chunks and decode rows, accept lengths 0..N, requests joining."""
    s = make_setup(steps=steps, page_size=page_size, hot=hot, seed=seed % 97)
    choices = sorted({min(a, steps + 1) for a in accepts})
    join = {2: prompts_[-1]} if len(prompts_) > 1 else None
    drive(s, seed=seed, iters=4, prompts=prompts_[:-1] or prompts_, accept_choices=choices,
          join_at=join)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.integers(1, 4), page_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 999),
       budget=st.integers(8, 64), arrivals=st.lists(st.integers(0, 3), min_size=2, max_size=4))
def test_property_serving_loop_equals_target_only(steps, page_size, seed, budget, arrivals):
    """Requests arrive between steps (chunked prefill, mixed batches): greedy output is lossless."""
    target, head = _MODELS
    rng = random.Random(seed)
    ps = [[rng.randrange(TARGET.vocab_size) for _ in range(rng.randint(1, 16))] for _ in arrivals]
    cfg = runtime(speculative_num_steps=steps, page_size=page_size, max_num_batched_tokens=budget)
    expected = target_only(target, runtime(), ps, 6)
    eng = Engine(target, cfg, head)
    reqs = []
    for p, wait in zip(ps, arrivals, strict=True):
        reqs.append(eng.add_request(p, SamplingParams(max_new_tokens=6)))
        for _ in range(wait):
            eng.step()
    while eng.has_work:
        eng.step()
    assert [r.output for r in reqs] == expected


_MODELS = make_models(31, draft_vocab=40)
