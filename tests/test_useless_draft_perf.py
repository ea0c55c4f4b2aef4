"""perf/useless_draft.py on the CPU (a check that its rows are built, never a timing): the
row keys perf/long.py reads, the deadline, the plan's token budget and bad arguments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from perf import useless_draft as ud


@pytest.mark.slow  # about 15 s of eager decode steps on 2 cores
def test_rows_of_a_tiny_run(monkeypatch):
    monkeypatch.setattr(ud, "MAX_BLOCK", 2)
    monkeypatch.setattr(ud, "MIN_BLOCK", 2)
    info = {}
    rows = ud.run_rows((2,), 600.0, device="cpu", pair=ud._tiny_pair("cpu"), prompt_len=6,
                       warmup=2, reps=2, info=info)
    assert [r["bs"] for r in rows] == [2] and info["skipped_bs"] == []
    for r in rows:
        assert r["regime"] == "useless" and r["adaptive_tps"] > 0 and r["target_only_tps"] > 0
        assert r["finished_early"] == 0 and sum(r["k_histogram"].values()) == 2 * 2
        assert len(r["per_round"]) == 2 and 1.0 <= r["accept_mean"] <= 4.0
        assert r["context_gap"] >= 0.0 and len(r["k0_per_round"]) == 2


class _FakeEngine:
    """Rows whose contexts grow `per_step` tokens a step (the useless draft: one)."""

    def __init__(self, contexts: list[int], per_step: int = 1) -> None:
        self.running = [SimpleNamespace(prompt=[0] * c, output=[]) for c in contexts]
        self.per_step, self.n_steps = per_step, 0

    def step(self):
        self.n_steps += 1
        for r in self.running:
            r.output.extend([1] * self.per_step)

    def drain(self):
        return []


class _Costs(dict):
    def measured(self):
        return dict(self)


def test_contexts_are_levelled_before_the_timed_pairs():
    base, spec = _FakeEngine([10, 12]), _FakeEngine([14, 16])  # spec 4 tokens ahead
    assert ud._mean_context(spec) - ud._mean_context(base) == 4
    ud._level_contexts(base, spec)
    assert (base.n_steps, spec.n_steps) == (4, 0)
    assert ud._mean_context(spec) == ud._mean_context(base)
    ud._level_contexts(spec, base)  # either way round
    assert (base.n_steps, spec.n_steps) == (4, 0)
    assert ud._mean_context(_FakeEngine([])) == 0.0


def test_every_speculative_block_is_paired_with_a_target_only_block_at_its_context(monkeypatch):
    """The measurement loop takes as many target-only steps as speculative ones: each timed
    pair starts at the same context (the 2026-12-06d loop let the speculative rows run ahead
    by a block and a lead a round)."""
    base, spec = _FakeEngine([8, 8]), _FakeEngine([8, 8])
    starts = []

    def block(engine, steps):
        starts.append((engine is spec, ud._mean_context(engine)))
        for _ in range(steps):
            engine.step()
        return {"tps": 1.0, "acc_tok": steps * 2, "acc_rows": steps * 2, "ks": [0] * steps}

    monkeypatch.setattr(ud, "timed_block", block)
    monkeypatch.setattr(ud, "_reach_decode", lambda e, bs: None)
    monkeypatch.setattr(ud, "_abort_all", lambda e: None)
    policy = SimpleNamespace(stats=lambda: {"probes": 0, "alpha": 0.0}, probe_interval=lambda b: 1,
                             estimator=SimpleNamespace(lower_bound=lambda: 0.0))
    monkeypatch.setattr(ud, "SpeculationPolicy", lambda *a, **k: policy)
    spec.steps, spec.policy_history = (0, 1, 3), []
    spec.set_policy = lambda p: None
    spec.add_request = base.add_request = lambda p, params: SimpleNamespace(finished=False)
    s = SimpleNamespace(target=SimpleNamespace(config=SimpleNamespace(vocab_size=11)),
                        base=base, spec=spec, costs=_Costs({}),
                        cfg=SimpleNamespace(deferred_draft_kv=8))
    monkeypatch.setattr(ud, "_rebuilds", lambda e: 0)
    row = ud._measure_bs(s, 2, 8, warmup=3, reps=3, rng=torch.Generator().manual_seed(0))
    assert len(starts) == 12 and row["context_gap"] == 0.0
    for (is_spec_a, ctx_a), (is_spec_b, ctx_b) in zip(starts[::2], starts[1::2], strict=True):
        assert (is_spec_a, is_spec_b) == (False, True) and ctx_a == ctx_b
    assert base.n_steps == spec.n_steps


def test_deadline_plan_and_bad_arguments():
    skipped = {}  # past the deadline once the engines are built: no row starts
    assert ud.run_rows((1,), 1e-9, device="cpu", pair=ud._tiny_pair("cpu"), prompt_len=6,
                       warmup=2, reps=2, info=skipped) == []
    assert skipped["skipped_bs"] == [1] and set(skipped["cost_ms"]) == {0, 1, 3}
    assert [ud.block_steps(b) for b in (1, 8, 64, 256)] == [64, 32, 32, 32]
    # one token a step per request, 1.25x + 16: both speculative cells and the warm-up
    assert ud._new_tokens(256, 40, 8, 2) == int(1.25 * (40 + 2 * 8 * 40)) + 16
    for bad in ((), (0,), (True,)):
        with pytest.raises(ValueError, match="bs_list"):
            ud.run_rows(bad, 10.0, device="cpu")
    with pytest.raises(ValueError, match="deadline_s"):
        ud.run_rows((1,), 0.0, device="cpu")
