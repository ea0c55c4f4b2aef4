"""perf/useless_draft.py on the CPU (a check that its rows are built, never a timing): the
row keys perf/long.py reads, the deadline, the plan's token budget and bad arguments."""

from __future__ import annotations

import pytest

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
