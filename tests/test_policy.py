"""The speculation policy: accept-rate estimate, cost table, decisions (graphdraft/serving/policy.py)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphdraft.serving.policy import (
    AcceptRateEstimator,
    CostTable,
    CycleTimer,
    SpeculationPolicy,
    check_speculative_policy,
    expected_tokens,
    measure_replay_ms,
)


def truncated_geometric(rng: np.random.Generator, alpha: float, k: int, rows: int) -> np.ndarray:
    """Accept lengths of `rows` chains of k drafts, each draft matching with probability alpha
    given the earlier ones did: 1 + the leading matches."""
    match = rng.random((rows, k)) < alpha
    lead = np.cumprod(match, axis=1).sum(axis=1) if k else np.zeros(rows, dtype=np.int64)
    return (1 + lead).astype(np.int64)


# ---------------------------------------------------------------- expected tokens
def test_expected_tokens_closed_form_vs_sum():
    for alpha in (0.0, 0.3, 0.8, 0.999, 1.0):
        for k in range(6):
            direct = sum(alpha ** j for j in range(k + 1))  # P(commit >= j + 1) summed
            assert expected_tokens(alpha, k) == pytest.approx(direct, rel=1e-9)
    assert expected_tokens(1.0, 3) == 4.0 and expected_tokens(0.0, 3) == 1.0


def test_expected_tokens_bad_input():
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens(1.5, 2)
    with pytest.raises(ValueError, match="k"):
        expected_tokens(0.5, -1)


# ---------------------------------------------------------------- estimator
@settings(max_examples=20, deadline=None)
@given(alpha=st.floats(0.05, 0.95), k=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_estimator_converges_on_truncated_geometric(alpha, k, seed):
    rng = np.random.default_rng(seed)
    est = AcceptRateEstimator(prior_alpha=0.5, prior_weight=4, decay=1.0)
    for _ in range(50):
        est.observe(truncated_geometric(rng, alpha, k, 64), k)
    # 3200 rows, >= 3200 trials: the MLE's sd is <= sqrt(a(1-a)/3200) < 0.009
    assert abs(est.alpha - alpha) < 0.04
    assert est.upper_bound() >= est.alpha


def test_estimator_decay_tracks_a_regime_change():
    rng = np.random.default_rng(1)
    est = AcceptRateEstimator(prior_alpha=0.7, decay=0.9)
    for _ in range(100):
        est.observe(truncated_geometric(rng, 0.9, 3, 32), 3)
    assert est.alpha > 0.85
    for _ in range(100):
        est.observe(truncated_geometric(rng, 0.1, 3, 32), 3)
    assert est.alpha < 0.15


def test_estimator_counts_and_prior():
    est = AcceptRateEstimator(prior_alpha=0.6, prior_weight=10, decay=1.0)
    assert est.alpha == pytest.approx(0.6)  # cold start: the prior
    assert est.upper_bound() > 0.6
    # k = 2: a=1 -> 0 of 1 trial, a=2 -> 1 of 2, a=3 (all matched) -> 2 of 2
    est.observe([1, 2, 3], 2)
    assert est.successes == pytest.approx(6 + 3) and est.trials == pytest.approx(10 + 5)
    est.observe(torch.tensor([1, 1], dtype=torch.int32), 0)  # k = 0: no information
    assert est.trials == pytest.approx(15) and est.observed_steps == 1


def test_estimator_per_slot():
    rng = np.random.default_rng(2)
    est = AcceptRateEstimator(decay=1.0, max_slots=4)
    for _ in range(200):
        a_hi, a_lo = truncated_geometric(rng, 0.9, 3, 1), truncated_geometric(rng, 0.2, 3, 1)
        est.observe(np.concatenate([a_hi, a_lo]), 3, slots=[1, 3])
    per = est.slot_alpha()
    assert abs(per[1] - 0.9) < 0.06 and abs(per[3] - 0.2) < 0.06
    assert per[0] == pytest.approx(est.prior_alpha) and per[2] == pytest.approx(est.prior_alpha)
    est.reset_slot(1)
    assert est.slot_alpha([1])[0] == pytest.approx(est.prior_alpha)


def test_estimator_bad_input_changes_nothing():
    est = AcceptRateEstimator(max_slots=4)
    before = (est.successes, est.trials)
    with pytest.raises(ValueError, match="accept_lengths"):
        est.observe([1, 5], 3)  # 5 > k + 1
    with pytest.raises(ValueError, match="accept_lengths"):
        est.observe([0, 1], 3)
    with pytest.raises(ValueError, match="accept_lengths"):
        est.observe([[1, 2]], 3)
    with pytest.raises(ValueError, match="slots"):
        est.observe([1, 2], 3, slots=[0])
    with pytest.raises(ValueError, match="slots"):
        est.observe([1, 2], 3, slots=[0, 4])
    with pytest.raises(ValueError, match="slots"):
        est.observe([1, 2], 3, slots=[2, 2])
    with pytest.raises(ValueError, match="k"):
        est.observe([1], -1)
    assert (est.successes, est.trials) == before
    for kw, name in (({"prior_alpha": 0.0}, "prior_alpha"), ({"prior_weight": 0}, "prior_weight"),
                     ({"decay": 1.5}, "decay"), ({"z": -1}, "z"), ({"max_slots": 0}, "max_slots")):
        with pytest.raises(ValueError, match=name):
            AcceptRateEstimator(**kw)
    with pytest.raises(ValueError, match="slots"):
        AcceptRateEstimator().observe([1], 1, slots=[0])


# ---------------------------------------------------------------- cost table
def test_cost_table_interpolates():
    t = CostTable({(1, 0): 5.0, (64, 0): 7.0, (1, 3): 6.0, (64, 3): 13.0, (1, 1): 5.5})
    assert t.cost(64, 3) == 13.0
    assert t.cost(32, 0) == pytest.approx(5.0 + 2.0 * 31 / 63)
    assert t.cost(128, 0) == pytest.approx(7.0 + 2.0 * 64 / 63)  # extrapolated from the ends
    assert t.cost(8, 1) == 5.5  # one entry for k = 1: flat in bs
    # k = 2 has no entry: halfway between k = 1 and k = 3 at that bs
    assert t.cost(1, 2) == pytest.approx((5.5 + 6.0) / 2)
    with pytest.raises(ValueError, match="k"):
        t.cost(1, 4)  # no measured k above
    t.set(32, 0, 1.0)  # a new measurement replaces the interpolation
    assert t.cost(32, 0) == 1.0 and t.cost(16, 0) == pytest.approx(5.0 + (1.0 - 5.0) * 15 / 31)


def test_cost_table_bad_input():
    with pytest.raises(ValueError, match="cost_ms"):
        CostTable({(1, 0): -1.0})
    with pytest.raises(ValueError, match="cost_ms"):
        CostTable({(1, 0): float("nan")})
    with pytest.raises(ValueError, match="padded_bs"):
        CostTable({(0, 0): 1.0})
    with pytest.raises(ValueError, match="costs"):
        CostTable({1: 1.0})
    t = CostTable({(1, 0): 1.0})
    with pytest.raises(ValueError, match="k"):
        t.set(1, -1, 1.0)
    assert t.measured() == {(1, 0): 1.0}


# ---------------------------------------------------------------- decisions
def _table(bss=(1, 8, 64, 256), steps=3, seed=0) -> dict[tuple[int, int], float]:
    rng = np.random.default_rng(seed)
    return {(bs, k): float(rng.uniform(1, 10)) for bs in bss for k in range(steps + 1)}


def _policy_at(alpha: float, costs, steps=3, **kw) -> SpeculationPolicy:
    """The policy with its estimate pinned at alpha and, by default, no cost probes (these
    tables stay static: no real cycle is ever timed)."""
    est = AcceptRateEstimator(prior_alpha=max(alpha, 1e-6), prior_weight=1e6, decay=1.0)
    return SpeculationPolicy("adaptive", steps, costs, estimator=est,
                             **{"cost_probe_margin": 0.0, **kw})


@settings(max_examples=40, deadline=None)
@given(alpha=st.floats(0.0, 1.0), seed=st.integers(0, 1000), bs=st.sampled_from([1, 8, 64, 256]))
def test_decision_matches_brute_force(alpha, seed, bs):
    costs = _table(seed=seed)
    pol = _policy_at(alpha, costs, hysteresis=0.0, spec_margin=0.0)
    a = pol.estimator.alpha
    rates = {k: sum(a ** j for j in range(k + 1)) / costs[(bs, k)] for k in range(4)}
    best = max(rates.values())
    want = min(k for k, r in rates.items() if r >= best * (1 - 1e-12))
    got = pol.decide(bs)
    assert rates[got] == pytest.approx(best, rel=1e-9)
    assert got == want or math.isclose(rates[got], rates[want], rel_tol=1e-9)


def test_alpha_zero_picks_target_only_alpha_one_picks_all():
    costs = {(bs, k): 5.0 + 0.1 * k for bs in (1, 64) for k in range(4)}  # cheap drafts
    assert _policy_at(0.0, costs).decide(1) == 0
    assert _policy_at(0.02, costs).decide(64) == 0
    assert _policy_at(1.0, costs).decide(1) == 3
    assert _policy_at(0.99, costs).decide(64) == 3


def test_fixed_mode_always_configured_steps():
    pol = SpeculationPolicy("fixed", 3)
    pol.observe([1, 1, 1], 3)  # alpha falling changes nothing in fixed mode
    assert [pol.decide(bs) for bs in (1, 8, 256)] == [3, 3, 3]
    assert pol.stats()["steps_chosen"] == {1: {3: 1}, 8: {3: 1}, 256: {3: 1}}


def test_safety_rule_cold_start_speculates_and_low_upper_bound_stops():
    costs = {(1, k): 5.0 * (1 + 0.3 * k) for k in range(4)}  # each draft adds 30% to the cycle
    pol = SpeculationPolicy("adaptive", 3, costs, estimator=AcceptRateEstimator(prior_alpha=0.7),
                            cost_probe_margin=0.0)
    assert pol.decide(1) > 0  # cold start: the prior speculates
    rng = np.random.default_rng(3)
    for _ in range(30):
        pol.observe(truncated_geometric(rng, 0.05, pol._current[1] or 1, 16), pol._current[1] or 1)
        pol.decide(1)
    est = pol.estimator
    assert all(expected_tokens(est.upper_bound(), k) / costs[(1, k)] <= 1 / costs[(1, 0)]
               for k in (1, 2, 3))
    assert pol.decide(1) == 0


def test_hysteresis_holds_then_switches():
    # k = 1 and k = 3 nearly tie around alpha ~ 0.6 with these costs
    costs = {(1, 0): 10.0, (1, 1): 11.0, (1, 2): 40.0, (1, 3): 14.6}
    est = AcceptRateEstimator(prior_alpha=0.6, prior_weight=1e6, decay=1.0)
    pol = SpeculationPolicy("adaptive", 3, costs, estimator=est, hysteresis=0.05, probe_every=0,
                            cost_probe_margin=0.0)
    k0 = pol.decide(1)
    sc = pol.scores(1)
    other = 3 if k0 == 1 else 1
    assert abs(sc[other] / sc[k0] - 1) < 0.05  # within the margin
    # nudge alpha so that `other` becomes best by less than the margin: no switch
    for a in np.linspace(0.55, 0.65, 21):
        est.successes, est.trials = a * 1e6, 1e6
        s = pol.scores(1)
        if s[other] > s[k0] and s[other] < s[k0] * 1.05:
            assert pol.decide(1) == k0
    assert pol.stats()["switches"].get(1, 0) == 0
    # far past the margin: switch once
    est.successes = (0.95 if other == 3 else 0.3) * 1e6
    assert pol.best(1) == other and pol.decide(1) == other
    assert pol.stats()["switches"][1] == 1
    # alpha flapping between 0.53 (k = 1 ahead by 3.6%) and 0.62 (k = 3 ahead by 4.3%):
    # no switch with a 5% margin, one per decision without a margin
    for h, want in ((0.05, 0), (0.0, 3)):
        pol = SpeculationPolicy("adaptive", 3, costs, estimator=est, hysteresis=h, probe_every=0,
                                cost_probe_margin=0.0)
        for a in (0.53, 0.62, 0.53, 0.62):
            est.successes = a * 1e6
            pol.decide(1)
        assert pol.stats()["switches"].get(1, 0) == want


def test_probe_refreshes_the_estimate_at_target_only():
    costs = {(1, k): 5.0 * (1 + 0.3 * k) for k in range(4)}
    est = AcceptRateEstimator(prior_alpha=0.7, prior_weight=8, decay=0.9)
    pol = SpeculationPolicy("adaptive", 3, costs, estimator=est, probe_every=16,
                            probe_budget=0)
    for _ in range(20):  # a regime where nothing matches
        pol.observe([1] * 16, 1)
    ks = [pol.decide(1) for _ in range(18)]
    # one probe = two k = 1 cycles (the first verifies the filler a k = 0 cycle left)
    assert ks[:16] == [0] * 16 and ks[16:] == [1, 1] and pol.stats()["probes"] == 1
    assert pol.stats()["current"][1] == 0  # a probe is not a switch
    assert est.alpha < 0.05 and est.trials < 0.2 * 16 / 0.1  # aged while at k = 0
    pol.observe([2] * 16, 1)  # the regime changed: the probe saw full accepts
    assert est.alpha > 0.3
    for _ in range(30):
        k = pol.decide(1)
        if k:
            pol.observe([k + 1] * 16, k)
    assert est.alpha > 0.9 and pol.decide(1) == 3
    assert pol.stats()["switches"][1] >= 1


def test_probe_interval_stretched_by_its_cost():
    """The expected loss of a probe in k = 0 cycles: r - 1 on its first cycle (filler), and
    max(r - E(alpha, 1), 0) on the second; probes at most `probe_budget` of the time."""
    costs = {(1, 0): 10.0, (1, 1): 10.5, (256, 0): 10.0, (256, 1): 14.7, (1, 3): 12.0, (256, 3): 30.0}
    pol = _policy_at(0.0, costs, probe_every=16, probe_budget=0.005)
    assert pol.probe_interval(1) == 20  # two 5% cycles that gain nothing: 10% every 20 = 0.5%
    assert pol.probe_interval(256) == 188  # two 47% cycles: at most 0.5% of the time
    one = _policy_at(0.0, costs, probe_every=16, probe_budget=0.005, probe_cycles=1)
    assert one.probe_interval(1) == 16 and one.probe_interval(256) == 94
    # alpha 0.3: the second probe cycle gains 1.3 tokens for 1.05 (bs 1: no loss) or 1.47
    # (priced at alpha's Wilson lower bound: just under 0.3 with 1e6 pseudo-trials)
    mid = _policy_at(0.3, costs, probe_every=16, probe_budget=0.005)
    lo = mid.estimator.lower_bound()
    assert 0.299 < lo < 0.3
    assert mid.probe_interval(1) == 16
    assert mid.probe_interval(256) == math.ceil((0.47 + 0.47 - lo) / 0.005 - 1e-9) == 129
    # the further below break-even, the rarer: alpha 0 probes less often than alpha 0.3
    assert pol.probe_interval(256) > mid.probe_interval(256)
    # extra_ms (the same for every k) shrinks the ratio, so probes come sooner
    assert pol.probe_interval(256, extra_ms=10.0) == math.ceil((2 * 4.7 / 20) / 0.005)
    est = pol.estimator
    ks = [pol.decide(256) for _ in range(191)]
    assert ks.count(1) == 2 and ks[188:190] == [1, 1] and set(ks[:188]) == {0} and ks[190] == 0
    assert pol.stats()["probes"] == 1 and est.alpha < 1e-5


def test_policy_bad_input():
    costs = {(1, k): 1.0 + k for k in range(4)}
    with pytest.raises(ValueError, match="--speculative-policy"):
        SpeculationPolicy("greedy", 3, costs)
    with pytest.raises(ValueError, match="num_steps"):
        SpeculationPolicy("fixed", -1)
    with pytest.raises(ValueError, match="steps"):
        SpeculationPolicy("adaptive", 3, costs, steps=[1, 3])  # no 0
    with pytest.raises(ValueError, match="steps"):
        SpeculationPolicy("adaptive", 3, costs, steps=[0, 4])
    with pytest.raises(ValueError, match="costs"):
        SpeculationPolicy("adaptive", 3)
    with pytest.raises(ValueError, match="k"):
        SpeculationPolicy("adaptive", 3, {(1, 0): 1.0, (1, 2): 2.0})  # k = 3 unpriceable
    with pytest.raises(ValueError, match="hysteresis"):
        SpeculationPolicy("adaptive", 3, costs, hysteresis=-0.1)
    with pytest.raises(ValueError, match="probe_every"):
        SpeculationPolicy("adaptive", 3, costs, probe_every=-1)
    with pytest.raises(ValueError, match="probe_budget"):
        SpeculationPolicy("adaptive", 3, costs, probe_budget=float("inf"))
    with pytest.raises(ValueError, match="probe_cycles"):
        SpeculationPolicy("adaptive", 3, costs, probe_cycles=0)
    pol = SpeculationPolicy("adaptive", 3, costs)
    with pytest.raises(ValueError, match="padded_bs"):
        pol.decide(0)
    with pytest.raises(ValueError, match="accept_lengths"):
        pol.observe([9], 3)
    assert pol.stats()["steps_chosen"] == {}


def test_check_speculative_policy():
    assert check_speculative_policy("adaptive") == "adaptive"
    assert check_speculative_policy("fixed") == "fixed"
    for bad in ("Adaptive", None, 3):
        with pytest.raises(ValueError, match="--speculative-policy"):
            check_speculative_policy(bad)


def test_stats_is_plain():
    import json

    pol = SpeculationPolicy("adaptive", 3, {(1, k): 1.0 + 0.1 * k for k in range(4)})
    pol.decide(1)
    pol.observe([1, 4], 3)
    pol.observe_cost(1, 3, 1.5)
    json.dumps(pol.stats())  # plain types only
    assert pol.stats()["cost_ms_online"] == {3: {1: 1.5}}


# ---------------------------------------------------------------- capture-time timing
@pytest.mark.gpu
def test_measure_replay_ms_times_a_graph():
    x = torch.randn(2048, 2048, device="cuda")
    y = torch.empty_like(x)
    torch.mm(x, x, out=y)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(4):
            torch.mm(x, x, out=y)
    one = measure_replay_ms(g.replay)
    assert 0 < one < 100


def test_measure_replay_ms_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    with pytest.raises(ValueError, match="CUDA"):
        measure_replay_ms(lambda: None)


# ---------------------------------------------------------------- the issue's goals, simulated
# Cycle costs shaped like the 8B measurement on one H200 (perf/RESULTS.md): target-only step and the
# k = 3 cycle at bs 1 and 64; k = 1, 2 interpolate in k; bs 256 extrapolates.
COSTS_8B = {(1, 0): 4.87, (64, 0): 7.22, (1, 3): 6.60, (64, 3): 13.59}


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("bs", [1, 64, 256])
def test_simulated_adaptive_meets_the_goals(alpha, bs):
    """Truncated-geometric accepts at match rate alpha, accept lengths observed one cycle late
    (as the zero-sync engine reads them): adaptive >= 0.98 x target-only and >= 0.97 x the best
    fixed k, in expected tokens per ms."""
    rng = np.random.default_rng(int(alpha * 100) + bs)
    table = CostTable(COSTS_8B)
    pol = SpeculationPolicy("adaptive", 3, table)
    rows = min(bs, 64)
    tokens = ms = 0.0
    pending = None
    for _ in range(1500):
        k = pol.decide(bs)
        if pending is not None:
            pol.observe(*pending)
        pending = (truncated_geometric(rng, alpha, k, rows), k) if k else None
        tokens += expected_tokens(alpha, k)
        ms += table.cost(bs, k)
    adaptive = tokens / ms
    fixed = {k: expected_tokens(alpha, k) / table.cost(bs, k) for k in range(4)}
    assert adaptive >= 0.98 * fixed[0]
    assert adaptive >= 0.97 * max(fixed.values())


# ---------------------------------------------------------------- online costs
def test_cost_table_online_median_replaces_the_capture_time_figure():
    t = CostTable({(1, 0): 4.0, (1, 1): 4.4, (8, 0): 5.0, (8, 1): 5.6}, window=3)
    assert t.cost(1, 1) == 4.4 and t.online() == {}
    t.observe(1, 1, 5.2)  # the first real cycle replaces the replay-only figure outright
    assert t.cost(1, 1) == 5.2 and t.measured()[(1, 1)] == 4.4
    t.observe(1, 1, 5.0)  # then the median of the last `window` cycles
    assert t.cost(1, 1) == pytest.approx(5.1) and t.online_counts() == {(1, 1): 2}
    t.observe(1, 1, 50.0)  # one slow cycle moves nothing
    assert t.cost(1, 1) == pytest.approx(5.2)
    t.observe(1, 1, 6.0)  # window (5.0, 50.0, 6.0): a lasting change moves it
    t.observe(1, 1, 6.2)
    assert t.cost(1, 1) == pytest.approx(6.2) and t.online_counts()[(1, 1)] == 5
    assert t.cost(4, 1) == pytest.approx(4.4 + 1.2 * 3 / 7)  # interpolation: capture-time entries
    # an unobserved k > 0 at that bs is repriced by the nearest observed k > 0's ratio;
    # k = 0 is not (its table figure stands until a k = 0 cycle is timed)
    t3 = CostTable({(1, 0): 4.0, (1, 1): 4.4, (1, 3): 5.0, (8, 0): 5.0, (8, 3): 9.0})
    t3.observe(1, 0, 4.4)
    assert t3.cost(1, 3) == pytest.approx(5.0 * 1.1) and t3.cost(8, 3) == 9.0  # k = 0's ratio
    t3.observe(1, 1, 4.84)
    assert t3.cost(1, 3) == pytest.approx(5.0 * 1.1) and t3.cost(1, 2) == pytest.approx(4.7 * 1.1)
    t3.observe(1, 1, 5.28)  # median of (4.84, 5.28): 5.06, ratio 1.15
    assert t3.cost(1, 3) == pytest.approx(5.0 * 5.06 / 4.4)
    assert t3.cost_at_capture(1, 3) == 5.0 and t3.cost(1, 0) == 4.4
    before = (t.online(), t.online_counts())
    for bad in ((1, 1, 0.0), (1, 1, float("nan")), (0, 1, 1.0), (1, -1, 1.0)):
        with pytest.raises(ValueError):
            t.observe(*bad)
    assert (t.online(), t.online_counts()) == before
    with pytest.raises(ValueError, match="window"):
        CostTable({(1, 0): 1.0}, window=0)


# 2026-12-04e H200 run, bs 128 p = 0.9 (alpha 0.9): real cycles k = 1 8.36 ms, k = 3 14.36 ms;
# k = 3 scores about 5 % above k = 1, so it should run throughout. The adaptive cell ran k = 1 in
# 35 of 60 timed cycles: one slow k = 3 cycle (an EMA of weight 0.2 let it lift k = 3's cost past
# the hysteresis) priced k = 3 out, and an unchosen k is never timed again.
TABLE_128E = {(128, 0): 5.38, (128, 1): 6.94, (128, 3): 12.14}
TRUE_128E = {0: 5.54, 1: 8.36, 3: 14.36}


def _settle_with_outliers(pol: SpeculationPolicy, alpha: float, steps: int, slow,
                          slow_ms: float) -> Counter:
    """Decide / observe at bs 128 for `steps` cycles with accept lengths drawn at `alpha`;
    cycle i at draft length k takes `slow_ms` where `slow(i, k)` (a slow cycle: the first after
    an idle GPU), else its true cost. -> the k chosen per cycle over the second half."""
    ks = Counter()
    rng = np.random.default_rng(0)
    for i in range(steps):
        k = pol.decide(128)
        if k:
            m = np.minimum(rng.geometric(1.0 - alpha, 128) - 1, k)
            pol.observe(m + 1, k)
        pol.observe_cost(128, k, slow_ms if slow(i, k) else TRUE_128E[k])
        if i >= steps // 2:
            ks[k] += 1
    return ks


def test_one_slow_cycle_does_not_price_a_close_k_out_for_good():
    # the median ignores slow cycles (every 12th here): k = 3 throughout the second half, but
    # for the cost refreshes of k = 1 (close: within the 10 % probe margin)
    pol = SpeculationPolicy("adaptive", 3, TABLE_128E, steps=[0, 1, 3])
    ks = _settle_with_outliers(pol, 0.9, 400, lambda i, k: i % 12 == 11, slow_ms=26.0)
    assert ks[1] <= pol.stats()["cost_refreshes"] * pol.cost_probe_cycles
    assert ks[3] >= 180 and pol.stats()["current"] == {128: 3}
    # with a window of 1 (the last cycle only) one slow k = 3 cycle (16 ms: past the hysteresis,
    # within the probe margin) moves the policy to k = 1 for good (the 04e symptom) ...
    once = lambda i, k: i == 20 and k == 3  # noqa: E731
    pol0 = SpeculationPolicy("adaptive", 3, CostTable(TABLE_128E, window=1), steps=[0, 1, 3],
                             cost_refresh=0)
    assert _settle_with_outliers(pol0, 0.9, 400, once, slow_ms=16.0) == Counter({1: 200})
    # ... unless the cost refresh re-times k = 3 (3 cycles, a fresh window) within a few
    # dozen decisions (the default: 0.5 % of the time at the score gap)
    pol1 = SpeculationPolicy("adaptive", 3, CostTable(TABLE_128E, window=1), steps=[0, 1, 3])
    ks1 = _settle_with_outliers(pol1, 0.9, 400, once, slow_ms=16.0)
    assert pol1.stats()["cost_refreshes"] > 0 and ks1[3] >= 180
    # a whole window of slow k = 3 cycles (a slow spell): refreshed too
    pol2 = SpeculationPolicy("adaptive", 3, TABLE_128E, steps=[0, 1, 3])
    ks2 = _settle_with_outliers(pol2, 0.9, 400, lambda i, k: 20 <= i < 30, slow_ms=17.5)
    assert ks2[3] >= 180 and pol2.stats()["current"] == {128: 3}
    for name in ("cost_refresh", "cost_probe_cycles", "cost_refresh_budget"):
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            SpeculationPolicy("adaptive", 3, TABLE_128E, steps=[0, 1, 3], **{name: -1})


def test_cost_refreshes_spend_at_most_their_budget():
    # k = 1 best, k = 3 within the probe margin: k = 3 is refreshed (3 cycles each), and the
    # refreshes cost about `cost_refresh_budget` of the throughput, never more than twice it
    table = {(8, 0): 5.0, (8, 1): 5.5, (8, 3): 7.2}
    for budget, floor in ((0.005, 16), (0.02, 4)):
        pol = SpeculationPolicy("adaptive", 3, table, steps=[0, 1, 3], cost_refresh=floor,
                                cost_refresh_budget=budget,
                                estimator=AcceptRateEstimator(0.45, 1e9, 1.0))
        ks = []
        for _ in range(640):
            k = pol.decide(8)
            ks.append(k)
            pol.observe_cost(8, k, table[(8, k)])
        point = pol.scores(8)
        gap = 1 - point[3] / point[1]
        assert pol.stats()["current"] == {8: 1} and 0 < gap < pol.cost_probe_margin
        assert pol.refresh_interval(point, 1, 3) == max(floor, math.ceil(3 * gap / budget))
        loss = ks.count(3) * gap / len(ks)
        assert 0.5 * budget <= loss <= 2 * budget, (loss, budget)
        assert pol.stats()["cost_refreshes"] * 3 == ks.count(3) - 3  # (+ the first probe)
    off = SpeculationPolicy("adaptive", 3, table, steps=[0, 1, 3], cost_refresh=0)
    assert off.refresh_interval({1: 1.0, 3: 0.95}, 1, 3) == math.inf


def test_observe_cost_takes_the_kv_term_out_and_fixed_ignores_it():
    pol = SpeculationPolicy("adaptive", 3, {(1, k): 4.0 + 0.2 * k for k in range(4)})
    pol.observe_cost(1, 1, 5.5, extra_ms=0.5)  # decide adds extra_ms back to every k
    assert pol.costs.cost(1, 1) == pytest.approx(5.0)
    assert pol.scores(1, 0.5, extra_ms=0.5)[1] == pytest.approx(1.5 / 5.5)
    pol.observe_cost(1, 0, 0.1, extra_ms=0.5)  # never below 5% of the measured time
    assert pol.costs.cost(1, 0) == pytest.approx(0.005)
    for bad in ({"ms": -1.0}, {"ms": float("inf")}, {"extra_ms": -1.0}):
        kw = {"ms": 1.0, "extra_ms": 0.0} | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            pol.observe_cost(1, 1, **kw)
    fixed = SpeculationPolicy("fixed", 3)
    fixed.observe_cost(1, 3, 5.0)  # no table: nothing to correct
    assert fixed.costs is None


class FakeEvent:
    """A host stand-in for a CUDA timing event over a test clock; waiting raises."""

    def __init__(self, clock: list[float], done: list[bool]) -> None:
        self.clock, self.done, self.t = clock, done, None

    def record(self) -> None:
        self.t = self.clock[0]

    def query(self) -> bool:
        return self.done[0]

    def elapsed_time(self, other: FakeEvent) -> float:
        if not (self.done[0] and other.done[0]):
            raise RuntimeError("cudaErrorNotReady")  # what torch raises: never reached
        return other.t - self.t

    def synchronize(self) -> None:
        raise AssertionError("CycleTimer must never wait for an event")

    wait = synchronize


def test_cycle_timer_reads_completed_events_only_and_never_waits():
    clock, done = [0.0], [False]
    timer = CycleTimer(2, event_factory=lambda: FakeEvent(clock, done))
    assert timer.elapsed_ms(0) is None  # nothing launched
    timer.begin(0)
    clock[0] = 3.5
    timer.end(0)
    assert timer.elapsed_ms(0) is None  # not completed: None, nothing waited for
    done[0] = True
    assert timer.elapsed_ms(0) == 3.5
    assert timer.elapsed_ms(0) is None  # read once
    timer.begin(1)
    clock[0] = 10.0
    timer.end(1)
    assert timer.elapsed_ms(1) == 6.5
    with pytest.raises(ValueError, match="slot"):
        timer.begin(2)


# ---------------------------------------------------------------- the H200 cells, simulated
# Per cell: the capture-time (replay-only) table the policy starts from, the true cost of a
# real cycle (ms, from the 2026-12-04c run: tokens/s and accepts of target-only, fixed and
# k0 cells; k = 1 at bs 128 / 256 estimated), and the match rate p.
TABLE_1 = {(1, 0): 4.34, (1, 1): 4.74, (1, 3): 5.12}
TRUE_1 = {0: 4.35, 1: 5.10, 3: 5.51}
TABLE_128 = {(128, 0): 5.49, (128, 1): 7.19, (128, 3): 12.19}
TRUE_128 = {0: 5.65, 1: 8.60, 3: 14.6}
TABLE_256 = {(256, 0): 7.64, (256, 1): 12.83, (256, 3): 23.04}
TRUE_256 = {0: 8.17, 1: 15.0, 3: 28.5}
CELLS = [(1, 0.2, TABLE_1, TRUE_1), (128, 0.2, TABLE_128, TRUE_128),
         (128, 0.9, TABLE_128, TRUE_128), (256, 0.9, TABLE_256, TRUE_256),
         (256, 0.6, TABLE_256, TRUE_256), (256, 0.2, TABLE_256, TRUE_256)]


def simulate_engine(pol: SpeculationPolicy, bs: int, p: float, true: dict[int, float],
                    cycles: int, seed: int) -> tuple[float, list[int]]:
    """The policy driven as the Engine drives it: decide, then the previous cycle retired
    (accepts with the drafts really drafted for the row, and its true device time through
    `observe_cost`); after a k = 0 cycle nothing was drafted. -> (tokens per ms, ks)."""
    rng = np.random.default_rng(seed)
    rows = bs
    made, pending, ks, tokens, ms = 3, None, [], 0.0, 0.0
    for _ in range(cycles):
        k = pol.decide(bs)
        ks.append(k)
        if pending is not None:
            acc, real, kk = pending
            pol.observe(acc, real)
            pol.observe_cost(bs, kk, true[kk])
        real, made = min(k, made), k
        acc = np.minimum(truncated_geometric(rng, p, k, rows), real + 1)
        pending = (acc, real, k)
        tokens += expected_tokens(p, real)
        ms += true[k]
    return tokens / ms, ks


@pytest.mark.parametrize("bs,p,table,true", CELLS)
def test_h200_failing_cells_meet_the_goals_with_online_costs(bs, p, table, true):
    """The six cells the 2026-12-04c H200 run missed: from the replay-only table, with the
    real cycles' times fed back, the adaptive policy's tokens per ms (expected accepts) is
    >= 0.98 x target-only (the k = 0 cycle at most 1% dearer than a target-only step) and
    >= 0.97 x the best fixed k, over a cold start and 600 cycles."""
    target_only = 1.0 / (true[0] / 1.01)
    best_fixed = max(expected_tokens(p, k) / true[k] for k in true)
    for seed in range(3):
        rate, ks = simulate_engine(SpeculationPolicy("adaptive", 3, table, steps=[0, 1, 3]),
                                   bs, p, true, 600, seed)
        assert rate >= 0.98 * target_only, (seed, rate / target_only, ks[-40:])
        assert rate >= 0.97 * best_fixed, (seed, rate / best_fixed, ks[-40:])


def test_bs1_low_rate_picks_target_only_once_the_real_k1_cost_is_known():
    """bs 1, p = 0.2: the replay-only table (k = 1 at 1.09x) says k = 1 gains at the measured
    alpha 0.109, the real k = 1 cycle (1.18x) says it loses: after one real k = 1 cycle the
    policy picks k = 0 (the measured alpha deciding; at the true rate 0.2 k = 1 and k = 0 are
    within 2.5% of each other: `test_h200_failing_cells_meet_the_goals_with_online_costs`)."""
    est = AcceptRateEstimator(prior_alpha=0.109, prior_weight=1e4, decay=1.0)
    # without the margin (the old rule) the replay-only table picks k = 1 ...
    pol = SpeculationPolicy("adaptive", 3, TABLE_1, steps=[0, 1, 3], estimator=est,
                            probe_every=0, spec_margin=0.0)
    assert pol.decide(1) == 1
    pol.observe_cost(1, 1, TRUE_1[1])  # ... until one real k = 1 cycle is timed
    assert pol.decide(1) == 0
    # the default margin alone already says k = 0 there (1.5% gain on the replay-only table)
    pol = SpeculationPolicy("adaptive", 3, TABLE_1, steps=[0, 1, 3], estimator=est,
                            probe_every=0)
    assert pol.decide(1) == 0
    pol.observe_cost(1, 1, TRUE_1[1])
    assert pol.decide(1) == 0  # measured alpha 0.109 at the real cost: k = 1 loses 6%


def test_bs128_high_rate_no_flapping_between_k1_and_k3():
    """bs 128, p = 0.9 with the real costs: k = 3 beats k = 1 by 7%; the policy settles on
    k = 3 and stays (few switches, no alternation), and once there it does not leave it for
    k = 1 at estimates inside the hysteresis band (k = 1, within the probe margin, runs only
    as a cost refresh: one cycle per `cost_refresh` decisions)."""
    for seed in range(3):
        pol = SpeculationPolicy("adaptive", 3, TABLE_128, steps=[0, 1, 3])
        _, ks = simulate_engine(pol, 128, 0.9, TRUE_128, 300, seed)
        assert ks[20:].count(1) <= pol.stats()["cost_refreshes"] * pol.cost_probe_cycles, ks[:40]
        assert set(ks[20:]) <= {1, 3} and pol.stats()["switches"].get(128, 0) <= 2
    costs = {(128, k): TRUE_128[k] for k in (0, 1, 3)}
    est = AcceptRateEstimator(prior_alpha=0.9, prior_weight=1e6, decay=1.0)
    pol = SpeculationPolicy("adaptive", 3, costs, steps=[0, 1, 3], estimator=est,
                            cost_probe_margin=0.0)  # static costs: no cost probe
    assert pol.decide(128) == 3
    for a in (0.84, 0.86, 0.84, 0.86, 0.85):  # k = 1 up to 2.5% ahead of k = 3 here
        est.successes = a * est.trials
        sc = pol.scores(128)
        assert sc[1] < sc[3] * 1.03
        assert pol.decide(128) == 3
    assert pol.stats()["switches"] == {}


def test_probes_cost_under_the_goal_where_target_only_is_right():
    """bs 256, p = 0.05 (k = 0 right): probes and all, adaptive keeps >= 0.99 x the k = 0 rate
    over a long run (the probe budget is 0.3%), and it probes rarely."""
    pol = SpeculationPolicy("adaptive", 3, TABLE_256, steps=[0, 1, 3])
    rate, ks = simulate_engine(pol, 256, 0.05, TRUE_256, 3000, 0)
    assert rate >= 0.99 / TRUE_256[0]
    assert 2 <= ks.count(1) <= 2 * (3000 // 200) and 3 not in ks[50:]


# 2026-12-04d H200 run, bs 128: replay-only table and the real cycles (k = 1 online EMA 8.14
# ms; fixed's k = 3 cycle 128 x 3.42 / 31053 tok/s = 14.1 ms)
TABLE_128D = {(128, 0): 5.37, (128, 1): 6.93, (128, 3): 12.42}
TRUE_128D = {0: 5.55, 1: 8.14, 3: 14.1}


def test_close_k_is_timed_once_instead_of_extrapolated():
    """bs 128, p = 0.9 as the 04d run saw it: starting at k = 1 (the prior says so), k = 3's
    cost extrapolated from k = 1's real / replay ratio (14.6 ms) keeps it inside the hysteresis
    band and the policy stayed at k = 1 (0.90x fixed). With a cost probe k = 3 runs once, its
    real 14.1 ms is measured, and the policy moves to k = 3; without it (margin 0) it stays."""
    best_fixed = max(expected_tokens(0.9, k) / TRUE_128D[k] for k in TRUE_128D)
    for margin, settles_on in ((0.1, 3), (0.0, 1)):
        pol = SpeculationPolicy("adaptive", 3, TABLE_128D, steps=[0, 1, 3],
                                cost_probe_margin=margin)
        rate, ks = simulate_engine(pol, 128, 0.9, TRUE_128D, 300, 0)
        # (a close k > 0 also runs as a cost refresh: one cycle per `cost_refresh` decisions)
        refreshed = pol.stats()["cost_refreshes"] * pol.cost_probe_cycles
        assert ks[0] == 1 and ks[-50:].count(settles_on) >= 50 - refreshed, ks[:30]
        if settles_on == 3:
            assert rate >= 0.97 * best_fixed
            assert pol.stats()["cost_probes"] == [(128, 3)]
        else:
            assert rate < 0.97 * best_fixed  # the defect the probe removes
    with pytest.raises(ValueError, match="^cost_probe_margin: expected"):
        SpeculationPolicy("adaptive", 3, TABLE_128D, steps=[0, 1, 3], cost_probe_margin=-0.1)


def test_saved_costs_load_back_only_when_complete_and_valid(tmp_path):
    """The capture-time cost cache (`save_costs` / `load_costs`): a table loads back equal;
    a schedule it lacks, a corrupt file, a bad cost or no file give None (measure again)."""
    from graphdraft.serving.policy import load_costs, save_costs

    table = {(1, 0): 4.2, (1, 3): 5.1, (8, 0): 4.7, (8, 3): 5.6}
    path = tmp_path / "sub" / "costs.json"
    assert save_costs(path, table)
    assert load_costs(path, list(table)) == table
    assert load_costs(path, [(1, 0), (16, 3)]) is None  # another schedule
    assert load_costs(tmp_path / "none.json", list(table)) is None and load_costs(None, []) is None
    path.write_text("{not json")
    assert load_costs(path, list(table)) is None
    path.write_text('{"costs": [[1, 0, -2.0]]}')
    assert load_costs(path, [(1, 0)]) is None
    blocked = tmp_path / "file"
    blocked.write_text("x")
    assert not save_costs(blocked / "costs.json", table)  # a file where the folder would be
