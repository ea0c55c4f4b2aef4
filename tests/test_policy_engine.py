"""The speculation policy inside the Engine (CPU, eager functions, float64 / float32).

Whatever k sequence the policy picks (forced switches every step, random sequences, k = 0
stretches), with joins and leaves: greedy output == target-only, cycle == split mode on every
state tensor, seeded sampled rows == target-only sampled rows; k = 0 cycles keep the draft
KV complete; accept lengths reach the policy one step late with filler drafts not counted;
metrics; bad configuration rejected naming the field / flag."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphdraft.config import RuntimeConfig
from graphdraft.serving.engine import Engine
from graphdraft.serving.policy import CycleTimer, SpeculationPolicy, analytic_cost_table
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime
from tests.test_cycle import _state
from tests.test_engine import prompts, target_only


class ForcedPolicy:
    """Decides k from a fixed sequence (cycled); records every decision and observation."""

    def __init__(self, ks) -> None:
        self.ks, self.i = list(ks), 0
        self.decided: list[tuple[int, int]] = []
        self.observed: list[tuple[list[int], int]] = []

    def decide(self, padded_bs: int) -> int:
        k = self.ks[self.i % len(self.ks)]
        self.i += 1
        self.decided.append((padded_bs, k))
        return k

    def observe(self, accept_lengths, k: int) -> None:
        self.observed.append((list(accept_lengths), k))

    def stats(self) -> dict:
        return {"mode": "forced", "decisions": len(self.decided)}


def _adaptive(**kw) -> RuntimeConfig:
    return runtime(speculative_policy="adaptive", **kw)


JOINS = {0: [0, 1, 2], 2: [3, 4], 5: [5, 6]}  # joins at steps 0, 2, 5; leaves as they finish


def _run_lockstep(engines, ps, params, joins=JOINS, compare=True):
    reqs = [[] for _ in engines]
    step = 0
    while step in joins or any(e.has_work for e in engines):
        for i, e in enumerate(engines):
            for j in joins.get(step, []):
                reqs[i].append(e.add_request(ps[j], params[j]))
            e.step()
        if compare:
            a = _state(engines[0])
            for e in engines[1:]:
                b = _state(e)
                for k in a:
                    assert torch.equal(a[k], b[k]), (step, k)
        step += 1
    return [[r.output for r in rs] for rs in reqs]


# ---------------------------------------------------------------- exactness
def test_default_captured_steps_and_policy_modes():
    target, head = make_models(2)
    assert Engine(target, _adaptive(), head).steps == (0, 1, 3)
    assert Engine(target, runtime(), head).steps == (3,)  # fixed
    assert Engine(target, _adaptive(speculative_num_steps=1), head).steps == (0, 1)
    eng = Engine(target, _adaptive(speculative_policy_steps=(0, 2, 3)), head)
    assert eng.steps == (0, 2, 3) and eng.policy.mode == "adaptive"
    cycles = eng.graph_registry.family("spec_cycle")
    assert [cycles[k].name for k in sorted(cycles)] == ["spec_cycle_k0", "spec_cycle_k2",
                                                        "spec_cycle"]
    assert list(cycles) == [3, 2, 0]  # captured widest first (the shared pool's reuse)
    assert eng.cycle_graphs is cycles[3]
    base = Engine(target, _adaptive())  # target-only: one cycle of width 1, k = 0
    assert base.steps == (0,) and base.policy.mode == "fixed"



def _forced_cycle_and_split(target, head, ps, params, ks) -> list[Engine]:
    """A cycle-mode and a split-mode engine forced through the draft lengths `ks`, run in lock
    step over `ps` (cycle == split on every state tensor after every step, `_run_lockstep`);
    both emit what target-only greedy emits. -> [cycle engine, split engine]."""
    engines = []
    for flag in (True, False):
        e = Engine(target, _adaptive(cycle_graph=flag, cuda_graph_bs=(1, 2, 4, 6)), head)
        e.set_policy(ForcedPolicy(ks))
        engines.append(e)
    outs = _run_lockstep(engines, ps, params)
    assert outs[0] == outs[1]
    expected = [target_only(target, runtime(), [p], m.max_new_tokens)[0]
                for p, m in zip(ps, params, strict=True)]
    assert outs[0] == expected
    return engines

def test_forced_switches_every_step_greedy_equals_target_only_cycle_equals_split():
    """k cycles through 0, 3, 1, 3, 0, 0, 1 every step while requests join and leave: the
    cycle and the split mode agree on every state tensor after every step, and the greedy
    output is target-only's."""
    target, head = make_models(4, draft_vocab=40)
    ps = prompts(41, 7)
    params = [SamplingParams(max_new_tokens=m) for m in (9, 14, 6, 12, 11, 8, 10)]
    engines = _forced_cycle_and_split(target, head, ps, params, [0, 3, 1, 3, 0, 0, 1])
    ks = {k for _, k in engines[0].policy.decided}
    assert ks == {0, 1, 3}
    g = engines[0].metrics_snapshot()["graphs"]
    assert all(g["spec_cycle"]["by_k"][k]["eager"] > 0 for k in (0, 1, 3))
    s = engines[1].metrics_snapshot()["graphs"]
    assert all(s["target_verify"]["by_k"][k]["eager"] > 0 for k in (0, 1, 3))
    assert all(s["draft_decode"]["by_k"][k]["eager"] > 0 for k in (0, 1, 3))


def test_long_k0_stretches_greedy_equals_target_only_cycle_equals_split():
    """Long stretches of k = 0 (the KV-only draft step, nothing drafted) between short k > 0
    runs, with joins and leaves: cycle == split mode on every state tensor (draft KV
    included) after every step, greedy == target-only."""
    target, head = make_models(9, draft_vocab=40)
    ps = prompts(43, 7)
    params = [SamplingParams(max_new_tokens=m) for m in (22, 30, 17, 26, 24, 19, 21)]
    ks = [0] * 7 + [3, 3] + [0] * 11 + [1] + [0] * 5 + [1, 3, 3]
    engines = _forced_cycle_and_split(target, head, ps, params, ks)
    decided = [k for _, k in engines[0].policy.decided]
    assert decided.count(0) > 20 and {0, 1, 3} <= set(decided)


@settings(max_examples=6, deadline=None)
@given(ks=st.lists(st.sampled_from([0, 1, 2, 3]), min_size=1, max_size=9),
       stretch=st.integers(0, 12), seed=st.integers(0, 1000))
def test_any_k_sequence_greedy_equals_target_only_float32(ks, stretch, seed):
    ks = ks + [0] * stretch  # a k = 0 stretch closes each cycle of the forced sequence
    target, head = make_models(5, dtype=torch.float32)
    ps = prompts(seed, 4)
    cfg = _adaptive(dtype="float32", speculative_policy_steps=(0, 1, 2, 3))
    expected = target_only(target, cfg, ps, 10)
    eng = Engine(target, cfg, head)
    eng.set_policy(ForcedPolicy(ks))
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=10)) for p in ps[:2]]
    eng.step()
    eng.step()
    reqs += [eng.add_request(p, SamplingParams(max_new_tokens=10)) for p in ps[2:]]
    while eng.has_work:
        eng.step()
    assert [r.output for r in reqs] == expected


def test_sampled_rows_reproducible_whatever_k():
    """Sampled tokens are keyed by (seed, position): forced switches give the target-only
    engine's sampled stream, and the same forced run twice gives the same tokens."""
    target, head = make_models(6)
    ps = prompts(6, 3)
    params = [SamplingParams(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.95, seed=s)
              for s in (7, 8, 9)]
    base = Engine(target, runtime()).generate(ps, params)
    outs = []
    for _ in range(2):
        eng = Engine(target, _adaptive(), head)
        eng.set_policy(ForcedPolicy([3, 0, 1, 0, 3, 3, 1]))
        outs.append(eng.generate(ps, params))
    assert outs[0] == outs[1] == base


def test_adaptive_policy_end_to_end_greedy_equals_target_only():
    target, head = make_models(3, draft_vocab=40)
    ps = prompts(9, 5)
    expected = target_only(target, runtime(), ps, 16)
    eng = Engine(target, _adaptive(), head)
    assert eng.generate(ps, SamplingParams(max_new_tokens=16)) == expected
    snap = eng.metrics_snapshot()["speculation"]
    cycles = eng.graph_summary()["spec_cycle"][1]
    assert sum(sum(c.values()) for c in snap["steps_chosen"].values()) == cycles > 0
    assert snap["observed_rows"] > 0 and snap["cost_source"] == "analytic"


# ---------------------------------------------------------------- k = 0 and the draft KV
def _draft_kv_rows(eng: Engine, slot: int, length: int) -> torch.Tensor:
    """The draft KV (K and V) of positions 0..length-1 of `slot`, through the page table."""
    ps = eng.cfg.page_size
    pos = torch.arange(length, device=eng.pages.req_to_page.device)
    locs = eng.pages.req_to_page[slot, pos // ps] * ps + pos % ps
    pool = eng.drafter.kv_pool
    return torch.stack([pool.k[0][locs], pool.v[0][locs]])


def _decode_until(eng: Engine, reqs, committed: int) -> None:
    while any(r.slot is None or int(eng.states.valid_cache_lengths[r.slot]) < committed
              for r in reqs):
        eng.step()
    eng.drain()


def test_k0_stretch_keeps_draft_kv_complete():
    """After stretches of k = 0 cycles the draft KV of every committed position equals that
    of a run that never used k = 0 (the KV-only draft step writes the accepted token's
    draft KV); drafts made after the stretches are the same too."""
    target, head = make_models(7)
    ps = prompts(17, 3, lo=5, hi=12)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    runs = {}
    stretched = [3, 3] + [0] * 8 + [3] * 2 + [0] * 12 + [1] + [0] * 3 + [3] * 1000
    for name, ks in (("never0", [3]), ("stretch0", stretched)):
        eng = Engine(target, _adaptive(max_context_len=160), head)
        pol = ForcedPolicy(ks)
        eng.set_policy(pol)
        reqs = [eng.add_request(p, params) for p in ps]
        _decode_until(eng, reqs, max(len(p) for p in ps) + 30)
        runs[name] = (eng, reqs, pol)
    (a, ra, _), (b, rb, pol) = runs["never0"], runs["stretch0"]
    assert sum(k == 0 for _, k in pol.decided) == 23
    for x, y in zip(ra, rb, strict=True):
        n = min(int(a.states.valid_cache_lengths[x.slot]), int(b.states.valid_cache_lengths[y.slot]))
        assert n > len(x.prompt) + 20
        kv_a, kv_b = _draft_kv_rows(a, x.slot, n), _draft_kv_rows(b, y.slot, n)
        assert kv_a.abs().sum(-1).min() > 0  # every position written
        torch.testing.assert_close(kv_a, kv_b, rtol=1e-9, atol=1e-9)
        m = min(len(x.output), len(y.output))
        assert x.output[:m] == y.output[:m]


@pytest.mark.parametrize("deferred", [0, 8])
def test_k0_cycle_drafts_nothing_and_runs_the_kv_only_step(deferred):
    """A k = 0 cycle runs the head's KV-only step (`store_kv`; with `deferred_draft_kv` > 0
    not in the cycle: its inputs are kept for a later rebuild, tests/test_useless_draft.py),
    never its full forward, and drafts nothing: every draft column is filler (the last
    verified token); its verify is one token per row (the pack's other token columns are 0)."""
    target, head = make_models(8)
    eng = Engine(target, _adaptive(deferred_draft_kv=deferred), head)
    eng.set_policy(ForcedPolicy([0]))
    r = eng.add_request(prompts(3, 1)[0], SamplingParams(max_new_tokens=20))
    eng.step()  # prefill (the full first step and multi-step)
    calls = {"forward": 0, "store_kv": 0}
    fwd, skv = head.forward, head.store_kv

    def counting(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    head.forward, head.store_kv = counting("forward", fwd), counting("store_kv", skv)
    try:
        for _ in range(3):
            eng.step()
        eng.drain()
    finally:
        del head.forward, head.store_kv
    assert calls == {"forward": 0, "store_kv": 0 if deferred else 3}
    d = eng.slots.drafts[r.slot]
    assert torch.equal(d, eng.slots.last_token[r.slot].expand_as(d).to(d.dtype))
    assert torch.equal(eng.cycle.pack[0, 1: eng.n_row], torch.zeros(eng.n_row - 1, dtype=torch.int32))
    assert int(eng.cycle.pack[0, eng.n_row]) == 1  # accept length 1


# ---------------------------------------------------------------- observations
def test_accept_lengths_observed_one_step_late_without_filler():
    """Each retired decode cycle reports its row's accept length with the number of drafts
    really drafted for it: after a k = 0 cycle (nothing drafted) a k = 3 cycle counts as
    k = 0, after a k = 1 cycle as k = 1; a k = 0 cycle reports k = 0 (nothing learnt);
    lengths never exceed that k + 1."""
    target, head = make_models(3)
    eng = Engine(target, _adaptive(), head)
    pol = ForcedPolicy([3, 0, 3, 3, 1, 3, 0, 0, 3])
    eng.set_policy(pol)
    eng.generate(prompts(21, 1), SamplingParams(max_new_tokens=30, ignore_eos=True))
    made, expect = 3, []  # the prefill drafted S
    for _, k in pol.decided:
        expect.append(min(k, made))
        made = k
    got = [k for _, k in pol.observed]
    assert len(got) >= len(expect) - 1  # the last cycle may end in the length cut
    assert got == expect[: len(got)]
    assert 1 in got and 0 in got
    for accepts, k in pol.observed:
        assert len(accepts) == 1 and 1 <= accepts[0] <= k + 1


def test_observe_feeds_the_adaptive_estimator():
    target, head = make_models(3)
    eng = Engine(target, _adaptive(), head)
    assert isinstance(eng.policy, SpeculationPolicy) and eng.policy.estimator.observed_rows == 0
    eng.generate(prompts(4, 3), SamplingParams(max_new_tokens=12))
    assert eng.policy.estimator.observed_rows > 0
    assert eng.metrics.accept_hist  # the same packs feed both


# ---------------------------------------------------------------- metrics
def test_metrics_snapshot_speculation_section():
    target, head = make_models(3)
    eng = Engine(target, _adaptive(), head)
    pol = ForcedPolicy([1, 3, 0])
    eng.set_policy(pol)
    eng.generate(prompts(5, 2), SamplingParams(max_new_tokens=10))
    snap = eng.metrics_snapshot()
    assert set(snap["graphs"]) == {"spec_cycle", "target_verify", "draft_decode",
                                   "draft_multi_step", "draft_kv_rebuild"}
    by_k = snap["graphs"]["spec_cycle"]["by_k"]
    assert sum(v["eager"] for v in by_k.values()) == snap["graphs"]["spec_cycle"]["eager"]["disabled"]
    assert [by_k[k]["eager"] for k in (0, 1, 3)] == [sum(1 for _, k2 in pol.decided if k2 == k)
                                                     for k in (0, 1, 3)]
    spec = snap["speculation"]
    assert spec["mode"] == "forced" and spec["steps_captured"] == [0, 1, 3]
    assert [tuple(d) for d in spec["decisions"]] == pol.decided
    # the adaptive policy's own stats
    eng2 = Engine(target, _adaptive(), head)
    eng2.generate(prompts(5, 2), SamplingParams(max_new_tokens=10))
    s2 = eng2.metrics_snapshot()["speculation"]
    assert s2["mode"] == "adaptive" and {"steps_chosen", "switches", "alpha", "probes",
                                         "cost_ms", "cost_source"} <= set(s2)
    assert set(s2["cost_ms"]) == {0, 1, 3}
    import json
    json.dumps(eng2.metrics_snapshot())  # plain JSON


class _TickEvent:
    """A host stand-in for a CUDA timing event: `record` reads a tick clock and advances it by
    one, so each launched cycle's begin -> end spans 1.0 ms; waiting on it raises."""

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.t = clock, None

    def record(self) -> None:
        self.t = self.clock[0]
        self.clock[0] += 1.0

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return other.t - self.t

    def synchronize(self) -> None:
        raise AssertionError("the engine must not wait for a timing event")

    wait = synchronize


class TimedForcedPolicy(ForcedPolicy):
    def __init__(self, ks) -> None:
        super().__init__(ks)
        self.costs: list[tuple[int, int, float, float]] = []
        self.retired_when: list[int] = []

    def observe_cost(self, padded_bs: int, k: int, ms: float, extra_ms: float) -> None:
        self.costs.append((padded_bs, k, ms, extra_ms))
        self.retired_when.append(len(self.decided))


def test_cycle_times_reach_the_policy_one_step_late_without_a_sync(monkeypatch):
    """With a cycle timer (CUDA events on a GPU; an injected host clock here) every retired
    decode cycle's device time reaches `policy.observe_cost` with its (padded bs, k), one step
    after its launch; mixed (prefill) steps are not timed; nothing waits on the events."""
    target, head = make_models(3)
    eng = Engine(target, _adaptive(), head)
    assert eng.cycle_timer is None  # CPU: no CUDA events, no online costs
    clock = [0.0]
    eng.cycle_timer = CycleTimer(2, event_factory=lambda: _TickEvent(clock))
    pol = TimedForcedPolicy([3, 0, 1, 3, 0])
    eng.set_policy(pol)
    eng.generate(prompts(9, 2), SamplingParams(max_new_tokens=14, ignore_eos=True))
    assert len(pol.costs) == len(pol.decided) >= 5
    assert [(b, k) for b, k, _, _ in pol.costs] == pol.decided
    assert all(ms == 1.0 and extra == 0.0 for _, _, ms, extra in pol.costs)
    # cycle i is retired after decision i + 1 was taken (or at the final drain)
    assert pol.retired_when[:-1] == list(range(2, len(pol.decided) + 1))
    # the adaptive policy: its online costs replace the analytic ones, the KV term taken out;
    # decode steps (decide, launch, retire, observe, observe_cost) never read a device scalar
    eng2 = Engine(target, _adaptive(), head)
    eng2.cycle_timer = CycleTimer(2, event_factory=lambda: _TickEvent(clock))
    for p in prompts(9, 2):
        eng2.add_request(p, SamplingParams(max_new_tokens=14, ignore_eos=True))
    while any(r.prefilling for r in eng2.running) or eng2.waiting:
        eng2.step()

    def no_sync(*a, **kw):
        raise AssertionError("a host sync in the decode path")

    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    while eng2.has_work:
        eng2.step()
    monkeypatch.undo()
    online = eng2.policy.costs.online()
    assert online and all(0 < ms <= 1.0 for ms in online.values())
    assert all(eng2.policy.costs.cost(b, k) == ms for (b, k), ms in online.items())


def test_analytic_costs_order_and_cover_the_schedule():
    target, head = make_models(3)
    sched, steps = (1, 2, 4, 6), (0, 1, 3)
    t = analytic_cost_table(target, head, sched, steps)
    assert set(t) == {(b, k) for b in sched for k in steps}
    assert all(t[(b, 0)] <= t[(b, 1)] < t[(b, 3)] for b in sched)
    base = analytic_cost_table(target, None, sched, (0,))
    assert all(v > 0 for v in base.values())
    # k = 0: the KV-only draft step (fc, norms, qkv) costs less than a full head forward
    base2 = analytic_cost_table(target, None, [2 * b for b in sched], (0,))
    assert all(0 < t[(b, 0)] - base[(b, 0)] < t[(b, 1)] - base2[(2 * b, 0)] for b in sched)


def test_measure_costs_is_a_noop_without_cuda():
    target, head = make_models(3)
    eng = Engine(target, _adaptive(), head)
    assert eng.measure_costs() == {} and eng.cost_source == "analytic"
    eng.capture_graphs(progress=False)
    assert eng.cost_source == "analytic"


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw, match", [
    ({"speculative_policy": "sometimes"}, "speculative_policy: expected 'adaptive' or 'fixed'"),
    ({"speculative_policy": None}, "speculative_policy"),
    ({"speculative_policy_steps": (1, 3)}, "speculative_policy_steps: expected"),
    ({"speculative_policy_steps": (0, 4)}, "speculative_policy_steps"),
    ({"speculative_policy_steps": (0, 1, 1)}, "speculative_policy_steps"),
    ({"speculative_policy_steps": (0, True)}, "speculative_policy_steps"),
])
def test_bad_policy_config_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        runtime(**kw)


def test_bad_policy_object_and_bad_decision_rejected():
    target, head = make_models(3)
    eng = Engine(target, _adaptive(), head)
    before = eng.policy
    with pytest.raises(ValueError, match="policy: expected an object with decide"):
        eng.set_policy(object())
    assert eng.policy is before
    eng.set_policy(ForcedPolicy([2]))  # 2 is not captured (0, 1, 3)
    eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=8))
    eng.step()  # prefill: no decision
    with pytest.raises(ValueError, match=r"policy: decide\(1\) returned 2"):
        eng.step()


def test_forced_switches_on_the_triton_kernels_interpreted():
    """The Triton path (prepare, verify attention of k + 1 tokens a row, accept, first draft
    step of k + 1 tokens, commit) under the interpreter: greedy == target-only through k = 0,
    1 and 3."""
    target, head = make_models(3, dtype=torch.float32, draft_vocab=40, layers=2)
    ps = prompts(5, 2, lo=3, hi=8)
    cfg = _adaptive(dtype="float32", kernel_backend="triton", cuda_graph_bs=(1, 2))
    expected = target_only(target, cfg.replace(kernel_backend="torch"), ps, 7)
    eng = Engine(target, cfg, head)
    eng.set_policy(ForcedPolicy([0, 3, 1, 0, 1, 3]))
    assert eng.generate(ps, SamplingParams(max_new_tokens=7)) == expected
    assert {k for _, k in eng.policy.decided} == {0, 1, 3}


def test_extra_ms_shifts_the_choice_toward_longer_drafts():
    """Work the cost table leaves out but every k pays (the KV reads of long contexts) makes
    the relative cost of more drafts smaller: the engine passes it as `extra_ms`."""
    costs = {(1, 0): 1.0, (1, 1): 1.1, (1, 3): 2.0}
    pol = SpeculationPolicy("adaptive", 3, costs, steps=[0, 1, 3])
    assert pol.best(1) == 1 and pol.best(1, extra_ms=10.0) == 3
    with pytest.raises(ValueError, match="extra_ms"):
        pol.decide(1, extra_ms=-1.0)
    target, head = make_models(3)
    eng = Engine(target, _adaptive(), head)
    seen = []
    real = eng.policy.decide
    eng.policy.decide = lambda bs, extra_ms=0.0: seen.append(extra_ms) or real(bs, extra_ms)
    eng.generate(prompts(5, 2), SamplingParams(max_new_tokens=6))
    per_tok = target.config.kv_bytes_per_token(target.dtype) / 4.0e12 * 1e3
    assert seen and all(x > 0 and abs(x / per_tok - round(x / per_tok)) < 1e-6 for x in seen)
