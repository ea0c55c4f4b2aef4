"""perf/sampling.py (issue #43's benchmark) on the CPU: the JSON carries the issue's keys and
both variants ran (structure only: CPU timings mean nothing)."""

from __future__ import annotations

import json

import pytest

from perf import sampling


def test_smoke_writes_the_rows_with_the_issue_keys(tmp_path, capsys):
    assert sampling.main(["--smoke", "--out", str(tmp_path), "--tag", "t", "--repeats", "1"]) == 0
    doc = json.loads((tmp_path / "t-cpu-sampling.json").read_text(encoding="utf-8"))
    assert doc["card"] == "cpu" and doc["smoke"] is True
    assert [r["bs"] for r in doc["rows"]] == [1, 2]
    for r in doc["rows"]:
        assert set(sampling.ROW_KEYS) <= set(r)
        assert r["plain_step_ms"] > 0 and r["controls_step_ms"] > 0
        assert r["step_ratio"] == pytest.approx(r["controls_step_ms"] / r["plain_step_ms"])
    c = doc["controls"]
    assert c["min_p"] > 0 and c["repetition_penalty"] != 1 and c["frequency_penalty"] != 0
    assert c["presence_penalty"] != 0 and c["logprobs"] == 5
    assert len(c["logit_bias"]) == sampling.BIAS_ENTRIES
    assert "| variant | bs | plain_ms | controls_ms |" in capsys.readouterr().out
    assert "breakdown" not in doc


def test_breakdown_rows_name_their_variant(tmp_path):
    assert sampling.main(["--smoke", "--breakdown", "--out", str(tmp_path), "--tag", "t",
                          "--repeats", "1"]) == 0
    doc = json.loads((tmp_path / "t-cpu-sampling.json").read_text(encoding="utf-8"))
    assert [(r["variant"], r["bs"]) for r in doc["breakdown"]] == [
        (v, bs) for bs in (1, 2) for v in sampling.BREAKDOWN]
    assert all(set(sampling.ROW_KEYS) <= set(r) for r in doc["breakdown"])


def test_variants_differ_only_in_the_controls():
    p = sampling.variant_params(97)
    plain, ctl = p["plain"].__dict__, p["controls"].__dict__
    diff = {k for k in plain if plain[k] != ctl[k]}
    assert diff == set(sampling.CONTROLS) | {"logit_bias"}
    for name, keep in sampling.BREAKDOWN.items():  # each group: its own fields, the controls'
        one = p[name].__dict__
        assert {k for k in plain if plain[k] != one[k]} == set(keep)
        assert all(one[k] == ctl[k] for k in keep)


def test_repeats_below_one_named():
    with pytest.raises(SystemExit):
        sampling.main(["--smoke", "--repeats", "0"])
