"""perf/policy.py on the CPU with tiny models: the rows, the accept-rate control through the
Engine's draft hook, the output name. Timings on a CPU mean nothing (not checked)."""

from __future__ import annotations

import torch

from perf import policy as perf_policy
from tests.engine_harness import make_models


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
