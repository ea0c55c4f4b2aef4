"""perf/policy.py on the CPU with tiny models: the rows, the accept-rate control through the
Engine's draft hook, the output name. Timings on a CPU mean nothing (not checked)."""

from __future__ import annotations

import pytest
import torch

from graphdraft.serving.policy import AcceptRateEstimator, SpeculationPolicy
from perf import policy as perf_policy
from perf.models_8b import make_peaked_
from tests.engine_harness import make_models, runtime
from tests.test_engine import prompts, target_only
from tests.test_policy import simulate_engine


def test_policy_benchmark_rows_and_accept_control_on_cpu():
    target, head = make_models(3)
    progress = []
    data = perf_policy.measure((2, 1), (0.9, 0.1), pair=(target, head), device="cpu",
                               dtype="float64", prompt_len=5, oracle_new=40, warmup=1, block=3,
                               reps=1, on_progress=progress.append)
    assert [len(d["rows"]) for d in progress] == [2, 4] and data["skipped_bs"] == []
    rows = data["rows"]
    assert [(r["bs"], r["p"]) for r in rows] == [(2, 0.9), (2, 0.1), (1, 0.9), (1, 0.1)]
    keys = {"bs", "regime", "target_only_tps", "fixed_tps", "adaptive_tps", "adaptive_k",
            "k0_tps", "fixed_accept", "adaptive_accept", "departed_from_oracle"}
    assert all(keys <= set(r) for r in rows)
    # float64: the speculative text is the oracle's, so p sets the accept rate
    assert all(r["departed_from_oracle"] == 0 for r in rows)
    hi = [r["fixed_accept"] for r in rows if r["p"] == 0.9]
    lo = [r["fixed_accept"] for r in rows if r["p"] == 0.1]
    assert min(hi) > max(lo) + 1.0, (hi, lo)
    assert data["captured_steps"] == [0, 1, 3] and data["cost_source"] == "analytic"
    assert "| bs | regime |" in perf_policy.table(data)
    # the peaked target (made in place): its greedy text is t -> perm[t]; the control held
    assert data["target"] == "peaked" and all(r["oracle_follows_perm"] == 1.0 for r in rows)
    assert data["goals"]["no_departures"] and data["goals"]["accept_rises_with_p"]
    assert all(r["oracle_exhausted"] == 0 for r in rows)
    for r in rows:  # draft lengths of the timed cycles only: one decision per timed step
        assert sum(r["adaptive_k"].values()) == 3 and sum(r["adaptive_k_warmup"].values()) == 1
        assert r["best_k_at_p"] in (0, 1, 3) and 0 <= r["adaptive_alpha"] <= 1
        assert abs(r["expected_accept"] - (1 - r["p"] ** 4) / (1 - r["p"])) < 1e-12


def test_start_drafts_outside_the_accept_control_are_not_observed():
    """The prefill step drafts outside the cycle graph (no accept control): the cells' common
    start state marks no draft ready, so the first cycle's verify of those drafts is no
    observation. At p = 1 every observed draft matches and the adaptive estimate ends near 1;
    counting the start drafts (the old start state) dragged it to 0.89 here."""
    target, head = make_models(3)
    data = perf_policy.measure((4,), (1.0,), pair=(target, head), device="cpu",
                               dtype="float64", prompt_len=5, oracle_new=20, warmup=2, block=2,
                               reps=1)
    r = data["rows"][0]
    assert r["fixed_accept"] == 4.0 and r["departed_from_oracle"] == 0
    assert r["adaptive_alpha"] > 0.95, r["adaptive_alpha"]


def test_policy_benchmark_alternates_group_order_and_leads_in(monkeypatch):
    """Each round runs the target-only block, then the group's cells, in reversed order every
    other round; every timed block follows `lead_steps(bs)` untimed steps of its own cell."""
    target, head = make_models(3)
    order, timed = [], perf_policy.timed_block

    def recording(engine, steps):
        pol = engine.policy
        name = "base" if engine.drafter is None else f"{pol.mode}{pol.num_steps}"
        before = engine.stats.steps
        order.append((name, engine.stats.steps - recording.last.get(id(engine), before)))
        out = timed(engine, steps)
        recording.last[id(engine)] = engine.stats.steps
        return out

    recording.last = {}
    monkeypatch.setattr(perf_policy, "timed_block", recording)
    data = perf_policy.measure((2,), (0.9,), pair=(target, head), device="cpu", dtype="float64",
                               prompt_len=5, oracle_new=40, warmup=1, block=3, reps=2)
    names = [n for n, _ in order]
    assert names == ["base", "fixed0", "base", "fixed3", "adaptive3",
                     "base", "fixed0", "base", "adaptive3", "fixed3"]
    r = data["rows"][0]
    assert len(r["adaptive_over_fixed_reps"]) == 2 and r["lead_in"] == perf_policy.lead_steps(2)
    assert sum(int(x.split("x")[1]) for x in r["adaptive_k_sequence"].split()) == 6
    assert perf_policy.cell_steps(2, 3, 2) == 2 * (3 + perf_policy.lead_steps(2))


def test_output_name():
    assert perf_policy.output_name("NVIDIA H200").endswith("-h200-policy.json")
    assert perf_policy.output_name("Some GPU 9").endswith("-some-gpu-9-policy.json")
    assert torch.__version__  # the module imports without CUDA


def test_policy_benchmark_time_budget_skips_batch_sizes():
    target, head = make_models(3)
    data = perf_policy.measure((2, 1), (0.5,), pair=(target, head), device="cpu",
                               dtype="float64", prompt_len=5, oracle_new=20, warmup=1, block=2,
                               reps=1, budget_s=0.0)
    assert data["rows"] == [] and data["skipped_bs"] == [2, 1]


def test_damp_residual_branches_scales_only_the_branch_outputs():
    target, _ = make_models(3)
    before = {n: p.clone() for n, p in target.named_parameters()}
    perf_policy.damp_residual_branches_(target, 0.5)
    for n, p in target.named_parameters():
        want = before[n] * 0.5 if n.endswith(("o_proj", "down_proj")) else before[n]
        assert torch.equal(p, want), n


def test_peaked_target_greedy_follows_the_permutation():
    """`make_peaked_`: argmax after token t is perm[t], whatever the context (greedy text of a
    target-only engine), and the LM head's rows are the permuted embedding rows x scale."""
    target, _ = make_models(11)
    emb = target.embed_tokens.detach().clone()
    perm = make_peaked_(target, seed=3, scale=4.0)
    assert sorted(perm.tolist()) == list(range(target.config.vocab_size))
    assert torch.equal(target.lm_head[perm], emb * 4.0)
    ps = prompts(12, 4)
    for p, out in zip(ps, target_only(target, runtime(), ps, 24), strict=True):
        text = p + out
        assert all(int(perm[a]) == b for a, b in zip(text[len(p) - 1:-1], text[len(p):], strict=True))


def test_make_peaked_bad_input_changes_nothing():
    target, _ = make_models(11)
    before = {n: p.clone() for n, p in target.named_parameters()}
    with pytest.raises(ValueError, match="^scale: expected a finite number > 0"):
        make_peaked_(target, scale=0.0)
    with pytest.raises(ValueError, match="^residual_scale: expected a finite number > 0"):
        make_peaked_(target, residual_scale=float("inf"))
    target.lm_head = target.embed_tokens
    with pytest.raises(ValueError, match="^target: expected an untied lm_head"):
        make_peaked_(target)
    for n, p in target.named_parameters():
        assert torch.equal(p, before[n]), n


# H200-like costs (ms) of one cycle, target-only k = 0 ~ 1.01 x (the KV-only draft step)
COSTS = {}
for _bs, _t in {1: 6.0, 8: 6.3, 64: 7.0, 256: 7.97}.items():
    COSTS[(_bs, 0)] = 1.01 * _t
    COSTS[(_bs, 1)] = _t * {1: 1.04, 8: 1.05, 64: 1.25, 256: 1.6}[_bs]
    COSTS[(_bs, 3)] = _t * {1: 1.12, 8: 1.15, 64: 1.7, 256: 2.8}[_bs]


def _simulate(p: float, bs: int, steps: int, seed: int, **est
              ) -> tuple[list[int], float, SpeculationPolicy]:
    """The default adaptive policy over the benchmark's cost table (real = replay here), driven
    as the Engine drives it (`test_policy.simulate_engine`). -> (k per cycle, the final
    estimate, the policy)."""
    pol = SpeculationPolicy("adaptive", 3, COSTS, steps=[0, 1, 3],
                            estimator=AcceptRateEstimator(**est))
    _, ks = simulate_engine(pol, bs, p, {k: COSTS[(bs, k)] for k in (0, 1, 3)}, steps, seed)
    return ks, pol.estimator.alpha, pol


@pytest.mark.parametrize("bs,p", [(8, 0.2), (64, 0.2), (256, 0.2), (256, 0.6), (8, 0.9),
                                  (1, 0.9)])
def test_adaptive_settles_within_the_benchmark_warmup(bs, p):
    """With the default estimator (prior alpha 0.7, weight 2, decay 0.99) the adaptive policy
    picks the best k for the true rate in every timed cycle after perf/policy.py's WARMUP but
    for cost refreshes of a close k (`cost_probe_cycles` each, about 0.5 % of the time) and the
    accept-rate probes at k = 0 (`probe_cycles` each)."""
    best = perf_policy.best_k_at(COSTS, [0, 1, 3], bs, p)
    timed = perf_policy.WARMUP + perf_policy.cell_steps(bs)
    for seed in range(3):
        ks, _, pol = _simulate(p, bs, timed, seed)
        other = sum(k != best for k in ks[perf_policy.WARMUP:])
        st = pol.stats()
        refreshed = st["cost_refreshes"] * pol.cost_probe_cycles
        assert other <= refreshed + st["probes"] * pol.probe_cycles, (seed, ks, best)
        assert refreshed <= timed * 0.1 and st["probes"] * pol.probe_cycles <= max(2, timed * 0.03)


def test_bs1_low_rate_estimate_settles_with_the_default_prior():
    """bs 1, p = 0.2: one row a cycle. By the end of the warm-up the default prior (weight 2)
    has the estimate near p (the old weight 8 kept it near 0.45); the k it picks over the
    timed cycles is mostly the best one (k = 1 and k = 3 are within 3% of each other there)."""
    alphas, old, picks = [], [], []
    best = perf_policy.best_k_at(COSTS, [0, 1, 3], 1, 0.2)
    for seed in range(8):
        ks, a, _ = _simulate(0.2, 1, perf_policy.WARMUP, seed)
        alphas.append(a)
        old.append(_simulate(0.2, 1, perf_policy.WARMUP, seed, prior_weight=8.0)[1])
        ks, _, _ = _simulate(0.2, 1, perf_policy.WARMUP + 15, seed)
        picks += ks[perf_policy.WARMUP:]
    assert sum(alphas) / 8 < 0.33 < sum(old) / 8
    assert best == 1 and picks.count(best) > len(picks) / 2
