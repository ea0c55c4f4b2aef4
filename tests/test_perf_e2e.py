"""perf.e2e runs its whole pipeline on tiny CPU models (structure and arithmetic only)."""

from __future__ import annotations

import pytest

from perf import e2e
from tests.engine_harness import make_models


def test_e2e_rows_on_cpu():
    target, head = make_models(seed=1)
    data = e2e.measure((1, 2), pair=(target, head), device="cpu", dtype="float64", prompt_len=24)
    assert [r["bs"] for r in data["rows"]] == [1, 2]
    for r in data["rows"]:
        assert r["verify_ms"] is None and r["draft_ms"] is None  # no graphs on CPU
        assert r["cycle_ms"] > 0 and r["target_only_step_ms"] > 0
        assert r["floor_ms"] > r["decode_floor_ms"] > 0
        assert r["speedup_at_3.0"] == pytest.approx(3.0 * r["target_only_step_ms"] / r["cycle_ms"])
    assert "| bs |" in e2e.table(data)
