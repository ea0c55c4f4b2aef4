"""The zero-sync speculative cycle through the Engine (CPU, float64, eager functions).

cycle == split mode bit for bit on every state tensor with joins and leaves; seeded sampling
reproducible across batch compositions and padded sizes; stop tokens / max_new mid-accept;
the device error word names the argument and leaves the other requests exact; no host read
of a device value while a step launches."""

from __future__ import annotations

import pytest
import torch

from capture import padded_batch_size
from graphdraft.runtime.slot_state import StopTableFullError
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import TARGET, ScriptedDrafter, make_models, runtime
from tests.test_engine import prompts, target_only


def _state(eng: Engine) -> dict[str, torch.Tensor]:
    out = {f"slots.{k}": v.clone() for k, v in vars(eng.slots).items()}
    out["valid_cache_lengths"] = eng.states.valid_cache_lengths.clone()
    out["pack"] = eng.cycle.pack.clone()
    for i, (k, v) in enumerate(zip(eng.kv.k, eng.kv.v, strict=True)):
        out[f"kv{i}"] = torch.cat([k, v])
    if eng.drafter is not None and hasattr(eng.drafter, "kv_pool"):
        out["draft_kv"] = torch.cat([eng.drafter.kv_pool.k[0], eng.drafter.kv_pool.v[0]])
        out["next_tokens"] = eng.drafter.bufs.next_tokens.clone()
    return out


def test_cycle_equals_split_mode_bit_exact_with_joins_and_leaves():
    target, head = make_models(4, draft_vocab=40)
    ps = prompts(41, 7)
    mk = [Engine(target, runtime(cycle_graph=flag, cuda_graph_bs=(1, 2, 4, 6)), head, seed=5)
          for flag in (True, False)]
    params = [SamplingParams(max_new_tokens=m, temperature=t, top_k=k, top_p=tp, seed=sd)
              for m, t, k, tp, sd in [(9, 0.0, 0, 1.0, None), (14, 0.9, 0, 1.0, 3),
                                      (6, 1.1, 8, 0.9, None), (12, 0.0, 0, 1.0, None),
                                      (11, 0.7, 5, 1.0, 3), (8, 0.0, 0, 1.0, None),
                                      (10, 1.0, 0, 0.8, 9)]]
    reqs = [[], []]
    plan = {0: [0, 1, 2], 2: [3, 4], 5: [5, 6]}  # joins at steps 0, 2, 5; leaves as they finish
    step = 0
    while step in plan or any(e.has_work for e in mk):
        for i, e in enumerate(mk):
            for j in plan.get(step, []):
                reqs[i].append(e.add_request(ps[j], params[j]))
            e.step()
        a, b = _state(mk[0]), _state(mk[1])
        for k in a:
            assert torch.equal(a[k], b[k]), (step, k)
        step += 1
    assert [r.output for r in reqs[0]] == [r.output for r in reqs[1]]
    assert mk[0].graph_summary()["spec_cycle"][1] > 0
    assert mk[1].graph_summary()["spec_cycle"] == (0, 0)
    assert mk[1].graph_summary()["draft_decode"][1] > 0


def _sampled(seed=None, **kw):
    base = dict(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.95, seed=seed)
    base.update(kw)
    return SamplingParams(**base)


def test_seeded_request_reproducible_across_batches_and_padded_sizes():
    target, head = make_models(6)
    p = prompts(6, 1)[0]
    others = prompts(16, 4)
    alone = Engine(target, runtime(), head).generate([p], _sampled(7))[0]
    # in a batch with greedy and unseeded sampled requests joining mid-run, other schedule
    eng = Engine(target, runtime(cuda_graph_bs=(3, 6), max_num_batched_tokens=20), head, seed=1)
    eng.add_request(others[0], SamplingParams(max_new_tokens=9))
    eng.step()
    r = eng.add_request(p, _sampled(7))
    eng.add_request(others[1], _sampled(None))
    eng.step()
    eng.add_request(others[2], _sampled(None, temperature=1.3))
    while eng.has_work:
        eng.step()
    assert r.output == alone
    # speculation does not change a seeded stream: target-only gives the same tokens
    assert Engine(target, runtime()).generate([p], _sampled(7))[0] == alone


def test_requests_sharing_seeded_params_get_distinct_reproducible_streams():
    target, head = make_models(7)
    p = prompts(7, 1)[0]
    params = _sampled(11, top_k=0, top_p=1.0, temperature=1.5, max_new_tokens=16)
    a = Engine(target, runtime(), head).generate([p, p, p], params)
    b = Engine(target, runtime(), head).generate([p, p, p], params)
    assert a == b
    assert len({tuple(x) for x in a}) == 3
    assert a[0] == Engine(target, runtime(), head).generate([p], params)[0]


def test_unseeded_sampled_requests_distinct_and_engine_seed_reproducible():
    target, head = make_models(7)
    p = prompts(8, 1)[0]
    params = _sampled(None, top_k=0, top_p=1.0, temperature=1.5, max_new_tokens=16)
    a = Engine(target, runtime(), head, seed=3).generate([p, p], params)
    b = Engine(target, runtime(), head, seed=3).generate([p, p], params)
    assert a == b and a[0] != a[1]


def _oracle_engine(target, cfg, ps, max_new):
    expected = target_only(target, cfg, ps, max_new)
    exp_map = {tuple(p): p + e for p, e in zip(ps, expected, strict=True)}
    eng = Engine(target, cfg, drafter=ScriptedDrafter.__new__(ScriptedDrafter))
    eng.drafter.__init__(eng, "oracle", seed=3, expected=exp_map)
    return eng, expected


def test_stop_token_and_max_new_mid_accept():
    """Every draft is accepted (oracle drafts): a stop token or the length limit inside an
    accepted block cuts it; the tokens after are never emitted, and the other request
    (sharing the batch, KV pool and pages) stays exact."""
    target, _ = make_models(3)
    ps = prompts(9, 3)
    cfg = runtime(speculative_num_steps=3)
    eng, expected = _oracle_engine(target, cfg, ps, 16)
    full = expected[0]
    stop = full[6]
    cut = full.index(stop) + 1
    r_stop = eng.add_request(ps[0], SamplingParams(max_new_tokens=16, stop_token_ids=(stop,)))
    r_len = eng.add_request(ps[1], SamplingParams(max_new_tokens=6))
    r_other = eng.add_request(ps[2], SamplingParams(max_new_tokens=16))
    while eng.has_work:
        eng.step()
    assert eng.stats.mean_accept_length > 3  # blocks of 4 accepted: the cuts fall inside them
    assert r_stop.output == full[:cut] and r_stop.finish_reason == "stop"
    assert r_len.output == expected[1][:6] and r_len.finish_reason == "length"
    assert r_other.output == expected[2] and r_other.finish_reason == "length"
    assert int(eng.states.valid_cache_lengths.abs().sum()) == 0


def test_eos_is_a_device_stop_unless_ignored():
    target, head = make_models(8)
    p = prompts(10, 1)[0]
    full = target_only(target, runtime(), [p], 12)[0]
    eos = full[4]
    eng = Engine(target, runtime(), head, eos_token_id=eos)
    a = eng.add_request(p, SamplingParams(max_new_tokens=12))
    b = eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True))
    while eng.has_work:
        eng.step()
    assert a.output == full[: full.index(eos) + 1] and a.finish_reason == "stop"
    assert b.output == full


def test_stop_table_overflow_rejected_at_add_request():
    target, head = make_models(8)
    eng = Engine(target, runtime(stop_table_width=2), head, eos_token_id=1)
    with pytest.raises(StopTableFullError, match="stop_token_ids"):
        eng.add_request([3, 4], SamplingParams(stop_token_ids=(5, 6)))
    assert not eng.waiting
    eng.add_request([3, 4], SamplingParams(stop_token_ids=(5, 6), ignore_eos=True))


class _BadDrafter(ScriptedDrafter):
    """Oracle drafts, except an out-of-vocab draft for one prompt after `after` calls."""

    def __init__(self, engine, bad_prompt, after, **kw):
        super().__init__(engine, "oracle", **kw)
        self.bad_prompt, self.after = tuple(bad_prompt), after

    def run(self, ctx, hidden, output_tokens, accept_lengths):
        out = super().run(ctx, hidden, output_tokens, accept_lengths)
        slots = self.engine.inputs.req_pool_indices[: ctx.bs].tolist()
        by_slot = {r.slot: tuple(r.prompt) for r in self.engine.running}
        if self.calls > self.after:
            for i, s in enumerate(slots):
                if by_slot.get(s) == self.bad_prompt:
                    out[i, 2] = TARGET.vocab_size + 5
        return out


def test_bad_draft_caught_by_error_word_names_argument_others_exact():
    target, _ = make_models(3)
    ps = prompts(11, 3)
    cfg = runtime(speculative_num_steps=3)
    expected = target_only(target, cfg, ps, 14)
    exp_map = {tuple(p): p + e for p, e in zip(ps, expected, strict=True)}
    eng = Engine(target, cfg, drafter=_BadDrafter.__new__(_BadDrafter))
    eng.drafter.__init__(eng, ps[1], 3, seed=0, expected=exp_map)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=14)) for p in ps]
    raised = []
    while eng.has_work:
        try:
            eng.step()
        except ValueError as e:
            raised.append(str(e))
    assert len(raised) == 1 and raised[0].startswith("drafts: expected token ids")
    assert f"request {reqs[1].rid}" in raised[0]
    assert reqs[1].finish_reason == "error"
    assert reqs[1].output == expected[1][: len(reqs[1].output)]  # nothing wrong was emitted
    assert [reqs[0].output, reqs[2].output] == [expected[0], expected[2]]
    assert eng.pages.num_free_slots == cfg.max_running_requests


def test_validation_sync_raises_in_the_same_step():
    target, _ = make_models(3)
    ps = prompts(11, 2)
    cfg = runtime(speculative_num_steps=3, validation="sync")
    expected = target_only(target, cfg, ps, 14)
    exp_map = {tuple(p): p + e for p, e in zip(ps, expected, strict=True)}
    eng = Engine(target, cfg, drafter=_BadDrafter.__new__(_BadDrafter))
    eng.drafter.__init__(eng, ps[1], 2, seed=0, expected=exp_map)
    eng.add_request(ps[0], SamplingParams(max_new_tokens=14))
    eng.add_request(ps[1], SamplingParams(max_new_tokens=14))
    calls = []
    with pytest.raises(ValueError, match="^drafts"):
        while eng.has_work:
            eng.step()
            calls.append(eng.drafter.calls)
    assert not eng._in_flight  # sync mode keeps nothing in flight


def test_launch_reads_no_device_value(monkeypatch):
    """A steady decode step's launch (cycle) and a mixed step's launch do no host read of a
    device value: every read path of torch.Tensor is trapped while `launch` runs."""
    target, head = make_models(3)
    ps = prompts(12, 3)
    cfg = runtime(speculative_num_steps=3)  # the torch path (the interpreter reads on the host)
    expected = target_only(target, cfg, ps, 8)
    eng = Engine(target, cfg, head)
    real_launch = eng.launch

    def trap(*a, **k):
        raise AssertionError("host read of a device value during launch")

    def launch(*a, **k):
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__int__", "__bool__", "__float__", "numpy"):
                m.setattr(torch.Tensor, name, trap)
            return real_launch(*a, **k)

    eng.launch = launch
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=8)) for p in ps[:2]]
    eng.step()  # prefill
    eng.step()  # decode
    reqs.append(eng.add_request(ps[2], SamplingParams(max_new_tokens=8)))
    while eng.has_work:
        eng.step()
    assert [r.output for r in reqs] == expected


def test_state_snapshot_restore_replays_a_cycle_identically():
    """A benchmark replaying the cycle alone restores the committed state between replays:
    the same cycle then commits the same tokens again."""
    target, head = make_models(3)
    eng = Engine(target, runtime(), head)
    for p in prompts(13, 3):
        eng.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.drain()
    snap = eng.state_snapshot()
    pbs = padded_batch_size(eng.schedule, 3)  # as Engine.launch pads
    first = eng.cycle_graphs.run(pbs).clone()
    after = eng.state_snapshot()
    eng.restore_state(snap)
    again = eng.cycle_graphs.run(pbs).clone()
    assert torch.equal(first, again)
    assert all(torch.equal(after[k], v) for k, v in eng.state_snapshot().items())
    assert not torch.equal(after["valid_cache_lengths"], snap["valid_cache_lengths"])


@pytest.mark.parametrize("cycle_graph", [True, False])
def test_every_forward_runs_at_exactly_the_staged_padded_size(cycle_graph):
    """The engine and the drafter stage rows up to the schedule's padded size and ask for that
    size exactly (`run(pbs, padded_bs=pbs)`): a size dropped at capture (OOM) then runs eagerly
    instead of replaying a larger graph over rows nobody staged (stale slots, stale KV targets)."""
    target, head = make_models(3)
    eng = Engine(target, runtime(cycle_graph=cycle_graph, cuda_graph_bs=(2, 4, 6)), head)
    calls = []
    forwards = eng.graph_registry.forwards()
    for f in forwards:
        def record(bs, padded_bs=None, _run=f.run, _name=f.name):
            calls.append((_name, bs, padded_bs))
            return _run(bs, padded_bs)
        f.run = record
    eng.generate(prompts(11, 5), SamplingParams(max_new_tokens=9))
    names = {name for name, _, _ in calls}
    assert ({"spec_cycle"} if cycle_graph else {"target_verify", "draft_decode"}) <= names
    assert "draft_multi_step" in names
    assert calls and all(p == bs and bs in (2, 4, 6) for _, bs, p in calls), calls
