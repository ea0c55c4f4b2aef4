"""perf/studies/tree_launches.py (counted launches per phase of a decode cycle) and the beams'
fewer-launch ranking (`runtime.beams.best_k`, `scratch_table`) it led to."""

from __future__ import annotations

import os

import pytest
import torch

from graphdraft.kernels.tree_build import score_key
from graphdraft.runtime.beams import SORT_MAX, best_k, scratch_table
from graphdraft.runtime.tree import TreeSpec
from perf.studies import tree_launches as tl


def _adversarial(g: torch.Generator, rows: int, width: int) -> torch.Tensor:
    """Few distinct values (ties everywhere), signed zeros, NaN and infinities."""
    pool = torch.tensor([0.0, -0.0, 1.5, -1.5, float("nan"), float("inf"), float("-inf"), -3.0])
    return pool[torch.randint(0, len(pool), (rows, width), generator=g)]


@pytest.mark.parametrize("width", [4, SORT_MAX, SORT_MAX + 1, 300])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_best_k_is_topk_of_score_key(width, k):
    g = torch.Generator().manual_seed(width * 10 + k)
    for x in (_adversarial(g, 16, width), torch.randn(16, width, generator=g),
              torch.randint(0, 3, (16, width), generator=g).float()):
        want = torch.topk(score_key(x), k, dim=-1).indices
        assert torch.equal(best_k(x, k), want)


def test_best_k_takes_lower_index_on_ties_and_nan_last():
    x = torch.tensor([[-1.0, float("nan"), -1.0, 0.0, -0.0, float("-inf"), -3.0]])
    assert best_k(x, 7).tolist() == [[3, 4, 0, 2, 6, 1, 5]]  # score_key's documented order


def test_scratch_table_is_the_scratch_slot_formula():
    spec = TreeSpec(5, 3, 10)
    t = scratch_table(spec, 40, 4, "cpu")
    assert t.shape == (4, 4 * 3)
    for j in range(1, 5):
        for r in range(4):
            for b in range(3):
                assert int(t[j - 1, r * 3 + b]) == int(spec.scratch_slot(40, torch.tensor(r), b, j))


def test_attribute_trace_charges_the_innermost_phase():
    ev = [{"ph": "X", "name": "tl:draft setup", "cat": "user_annotation", "ts": 0, "dur": 100,
           "tid": 1},
          {"ph": "X", "name": "tl:draft head", "cat": "user_annotation", "ts": 10, "dur": 20,
           "tid": 1},
          {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 15, "dur": 1,
           "tid": 1, "args": {"correlation": 7}},
          {"ph": "X", "name": "cuLaunchKernelEx", "cat": "cuda_driver", "ts": 50, "dur": 1,
           "tid": 1, "args": {"correlation": 8}},
          {"ph": "X", "name": "cudaMemsetAsync", "cat": "cuda_runtime", "ts": 200, "dur": 1,
           "tid": 1, "args": {"correlation": 9}},
          {"ph": "X", "name": "k1", "cat": "kernel", "ts": 300, "dur": 4.0,
           "args": {"correlation": 7}},
          {"ph": "X", "name": "k2", "cat": "kernel", "ts": 310, "dur": 6.0,
           "args": {"correlation": 8}}]
    launched, gpu_us = tl.attribute_trace(ev)
    assert launched == {"draft head": 1, "draft setup": 1, "other": 1}
    assert gpu_us == {"draft head": 4.0, "draft setup": 6.0}


@pytest.fixture(scope="module")
def tiny_rows():
    """Counts of one steady cycle per mode: tiny shapes, the Triton kernels (interpreted on
    the CPU: the kernels a GPU launches; the torch path's references launch other ops)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path on the CPU needs TRITON_INTERPRET=1")
    modes = [tl.TINY_MODES[m] for m in ("chain3", "tree4")]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return {r["mode"]: r for r in tl.study(modes, [1], device=dev, shape="tiny", iters=3,
                                            warmup=1, backend="triton", prompt_len=6)}


def test_study_counts_every_phase_of_a_cycle(tiny_rows):
    chain, tree = tiny_rows["chain S=3"], tiny_rows["tree 4/2/6"]
    for row in (chain, tree):
        assert row["counted"]["target fwd"] > 0 and row["counted"]["draft head"] > 0
        assert row["counted"]["commit"] > 0 and sum(row["syncs"].values()) == 0
        assert ("cycle_ms" in row) == torch.cuda.is_available()  # never a CPU timing
    for phase in ("beams", "tree build", "compaction", "store", "stop cut"):
        assert tree["counted"].get(phase, 0) > 0, phase
    # the tree cycle launches more than the chain's: deeper drafts, beams, tree bookkeeping
    assert sum(tree["counted"].values()) > sum(chain["counted"].values())
    # ... and its bookkeeping stays bounded (the reductions of issue #40: one ranking per
    # beam level, no per-step index arithmetic)
    assert tree["counted"]["beams"] <= 20 * (4 - 1) + 15


def test_main_rejects_bad_arguments():
    with pytest.raises(SystemExit, match="--modes"):
        tl.main(["--device", "cpu", "--tiny", "--modes", "tree9"])
    with pytest.raises(SystemExit, match="--bs"):
        tl.main(["--device", "cpu", "--tiny", "--bs", "0"])
