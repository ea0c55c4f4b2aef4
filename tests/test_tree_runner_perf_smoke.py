"""perf/tree.py runs end to end on tiny models (CPU: a check of the script, not a timing)."""

from __future__ import annotations

import json

import pytest

from perf import tree


def test_tree_perf_smoke(tmp_path, capsys):
    assert tree.main(["--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-h200-tree.json")
    data = json.loads(path.read_text())
    assert data["smoke"] is True
    for r in data["rows"]:
        assert set(r) >= {"config", "bs", "accept_mean", "cycle_ms", "tokens_per_s"}
        assert set(r["config"]) == {"steps", "topk", "num_draft_tokens"}
        assert r["cycle_ms"] > 0 and r["accept_mean"] >= 1.0 and r["tokens_per_s"] > 0
    assert {r["config"]["topk"] for r in data["rows"]} == {1, 4}
    assert {a["temperature"] for a in data["accept"]} == {0.0, 0.7}
    # (a) for the shipped-config head and a weak head trained in the same run, rows named
    assert {a["head"] for a in data["accept"]} == {"shipped", "weak (1 steps)"}
    assert data["weak_head"]["steps"] == 1 and data["weak_head"]["seconds"] > 0
    # per-prompt accept lengths and, for a tree with a chain of its n, the bootstrap ratio
    assert data["prompt_groups"] == [0, 0, 1]
    for a in data["accept"]:
        per = [list(map(int, x.split())) for x in a["per_prompt"]]
        assert len(per) == 3 and sum(map(len, per)) == a["verifies"]
        assert sum(map(sum, per)) / a["verifies"] == pytest.approx(a["accept_mean"], abs=1e-4)
    (t,) = [a for a in data["accept"] if a["config"]["topk"] == 2 and a["temperature"] == 0.0]
    vc = t["vs_chain"]
    assert vc["chain"] == "3/1/4" and vc["groups"] == 2 and vc["lo"] <= vc["ratio"] <= vc["hi"]
    # the control of scoring sampled rows at their temperature: same tree scored at T 1
    (ctl,) = [a for a in data["accept"] if not a["rank_at_temperature"]]
    assert (ctl["config"]["topk"], ctl["temperature"]) == (2, 0.7)
    (ab,) = [a for a in data["accept"] if "vs_rank_t1" in a]
    assert ab["config"] == ctl["config"] and ab["temperature"] == 0.7 and ab["rank_at_temperature"]
    assert "projected tokens/s" in capsys.readouterr().out
