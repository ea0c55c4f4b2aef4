"""The compile census (`perf/compile_census.py`): its dry run records the keys real launches
record, the reasons it gives, and the pinned totals of a small schedule (a change that
multiplies compiled variants with the batch size fails here).

On the tiny pair of `tests/test_precompile_workers.py` under the interpreter; the 8B-shaped
census (82 keys to 64 before issue 19's cuts, the count the H200 run of 2026-12-04d built in one
process; 29 with the prefill probes after them) is `python -m perf.compile_census`.
"""

from __future__ import annotations

import pytest

from perf.compile_census import census, explain, gpu_forwards, report
from tests.test_precompile_workers import SHALLOW, _full_engine, engine_to_8_and_its_census


@pytest.fixture(scope="module")
def engine():
    return _full_engine()  # schedule 1, 2, 4; S = 3; adaptive policy: k = 0, 1, 3


def test_gpu_forwards_are_the_cycle_graphs_and_the_multi_step(engine):
    names = sorted(f.name for f in gpu_forwards(engine).values())
    assert names == ["draft_kv_rebuild", "draft_multi_step", "spec_cycle", "spec_cycle_k0",
                     "spec_cycle_k1"]


def test_dry_run_records_the_keys_of_real_launches():
    """A dry run (launches skipped) sees exactly the keys, per kernel and per (forward, bs),
    that real launches see: the forwards' host code reads no device values. Schedule to 8
    (1, 2, 4, 8); the real census is the one the plan's check in test_precompile_workers
    reads (launched once per test process), the dry run's engine a fresh one of the same
    config (a dry run zeroes the integer tensors its skipped launches would have written)."""
    _, real = engine_to_8_and_its_census()
    dry = census(_full_engine(SHALLOW, max_running_requests=8, cuda_graph_max_bs=8),
                 launch=False, gpu_like=False)
    assert real.total() > 20
    assert dict(real.keys) == dict(dry.keys)
    assert {n: dict(w) for n, w in real.where.items()} == {n: dict(w) for n, w in dry.where.items()}
    assert dict(real.launches) == dict(dry.launches)


def test_gpu_like_launches_one_pdl_variant_at_every_size():
    """With the launch options of a CUDA device (PDL on, its early trigger a runtime argument
    up to 4 rows) a kernel that takes PDL launches another variant than on the interpreter
    (PDL off everywhere), and still one at a schedule that crosses 4 rows."""
    eng = _full_engine(max_running_requests=16, cuda_graph_max_bs=16)
    cpu = census(eng, gpu_like=False)
    gpu = census(eng, gpu_like=True)
    assert len(cpu.keys["cache_loc._advance_kernel"]) == 1
    assert len(gpu.keys["cache_loc._advance_kernel"]) == 1  # bs 1, 2, 4 and 8, 16 alike
    assert gpu.keys["cache_loc._advance_kernel"] != cpu.keys["cache_loc._advance_kernel"]


# The pinned census of the tiny pair's schedule 1, 2, 4 (and to 16) with a GPU's launch options.
# Raise these only with a reason (a new kernel or a new functional variant), never because
# the schedule's sizes compile their own variants.
PINNED_TOTAL = {4: 33, 16: 33}  # 32 / 32 before the log-probabilities' two launches (a V-split
# pass and a combine: one key more); 32 / 33 before the deferred draft KV (issue #42): the KV-only
# step's projection runs over bs * P rows in the rebuild, no longer over bs rows in the k = 0
# cycle (at 16 one GEMV bucket fewer); 25 / 26 before issue 43's kernels: the logit controls'
# bias (target / draft vocabulary), penalty (verify / draft window) and count kernels, the
# log-probabilities, the drafter's argmax first stage (its pick redone under the controls);
# 41 / 56, then 33 / 38, then 26 / 27 before that: a PDL variant per
# side of its row limit, pointer alignments per row offset, the GEMV's norm tile where it has
# no norm; then every mode flag of a kernel (GEMV, attention, RoPE, norms, argmax, commit) a
# constexpr; then the fused-norm finisher at 2-4 rows (now single rows only)


@pytest.mark.parametrize("top", [4, 16])
def test_census_total_is_pinned(top):
    eng = _full_engine(max_running_requests=top, cuda_graph_max_bs=top)
    rec = census(eng, gpu_like=True)
    rep = report(rec)
    per_size = {}
    for name, k in rep["kernels"].items():
        for where in k["by_key"]:
            assert where, name  # every key was launched by some (forward, bs)
        per_size[name] = k["keys"]
    assert rec.total() == PINNED_TOTAL[top], (rec.total(), per_size)


def test_demo_census_is_pinned_and_fp32_prefill_shares_the_verify_tile():
    """`graphdraft demo`'s two engines (the shipped pair in fp32, graphs to 8) with a GPU's
    launch options: 35 keys (32 before the mixed step's host set-up kernels, one key each:
    the admission's `slot_admit`, write_batch's `segments`, the draft set-up's
    `mixed_draft_inputs`; 31 before the log-probabilities' V-split pass, one key, beside
    its combine, two: NP 1 and 4; 24 before issue 43: the logit controls' bias and count kernels
    one key each, the penalty kernel two (the verify's candidates, the draft's window), the
    log-probabilities two (its pack row width NP: 1 for the target-only engine, 4 for the
    speculative one), the drafter's argmax first stage (its pick redone under the controls);
    25 while the fp32 prefill took the 128-row
    extend tile, the demo's longest compile: `extend_attention.FMA_TILE_CASES`); one
    extend-attention key, launched by the prefill probes and the cycle graphs alike."""
    from perf.compile_census import demo_census

    rec, (base, spec) = demo_census()
    assert base.drafter is None and spec.drafter is not None
    assert rec.total() == 35, report(rec)["kernels"]
    (key,) = rec.keys["extend_attention._extend_split_kernel"]
    where = {f for f, _ in rec.where["extend_attention._extend_split_kernel"][key]}
    assert "prefill" in where and any(f.startswith("spec_cycle") for f in where), where


def test_census_grows_by_buckets_not_sizes():
    """Schedule to 16 (1, 2, 4, 8, 16): the per-row control and metadata kernels launch one
    key per PDL bucket, whatever the draft length k (N = k + 1 tokens a row) and the row
    count (the attention combines, whose split count follows the rows, run at the 8B shape
    only: `python -m perf.compile_census`)."""
    eng = _full_engine(max_running_requests=16, cuda_graph_max_bs=16)
    rec = census(eng, gpu_like=True)
    for name in ("accept._accept_kernel", "accept._token_kernel",
                 "cycle_kernels._commit_pack_kernel", "cycle_kernels._prepare_kernel",
                 "draft_indices._decode_draft_indices_kernel", "cache_loc._advance_kernel"):
        assert name in rec.keys, name
        pdl = {dict(x for x in k if not isinstance(x[1], tuple)).get("launch_pdl", False)
               for k in rec.keys[name]}
        # one key per PDL bucket (on up to 4 rows), none per draft length k or split count
        assert len(rec.keys[name]) == len(pdl), (name, explain(rec.keys[name]))


def test_explain_names_the_argument_and_the_kind():
    ints = [(("x_ptr", ("*fp32", "D")), ("n", ("constexpr", 1)), ("B", ("constexpr", 16))),
            (("x_ptr", ("*fp32", "D")), ("n", ("i32", "D")), ("B", ("constexpr", 16))),
            (("x_ptr", ("*fp32", "")), ("n", ("i32", "")), ("B", ("constexpr", 32)), ("num_warps", 4))]
    lines = explain(ints)
    assert any(line.startswith("n: int ==1 / %16") for line in lines), lines
    assert any(line.startswith("x_ptr: align") for line in lines), lines
    assert any(line.startswith("B: constexpr") for line in lines), lines
    assert any(line.startswith("num_warps: option") for line in lines), lines
    assert explain(ints[:1]) == []
