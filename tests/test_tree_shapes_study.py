"""perf/studies/tree_shapes.py's plumbing on the CPU: the shape list's validation, the rows'
ratios, and the whole script on the shipped toy byte pair (graphdraft/assets/target +
eagle3: 1 prompt, a few tokens) writing rows with issue #40's keys, exact to target only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perf.studies import tree_shapes

ROOT = Path(__file__).resolve().parents[1]
ROW_KEYS = {"steps", "topk", "num_draft_tokens", "accept_mean", "accept_hist", "prompts",
            "new_tokens", "device", "ratio_to_chain_n8", "ratio_to_chain_s3", "greedy_identical"}


def test_default_shapes_are_all_valid_trees_at_n8():
    text = ",".join(f"{s}/{k}" for s, k in tree_shapes.SHAPES)
    assert tree_shapes.parse_shapes(text, 8) == list(tree_shapes.SHAPES)


@pytest.mark.parametrize("text,match", [
    ("2/2", r"2/2 at n = 8: speculative_num_draft_tokens: expected <= .* = 7"),  # 1 + 2 + 4
    ("4/1", "is a chain"),
    ("4x2", "expected comma-separated steps/topk pairs"),
    ("4/2,3/3,4/2", "4/2 given twice"),
])
def test_bad_shapes_name_the_flag(text, match):
    with pytest.raises(ValueError, match=match) as e:
        tree_shapes.parse_shapes(text, 8)
    assert str(e.value).startswith("--shapes: ")


def test_draftings_put_the_two_chains_first():
    ds = tree_shapes.draftings([(4, 2), (3, 3)], 8)
    assert [(d.kind, d.steps, d.topk, d.num_draft_tokens) for d in ds] == [
        ("chain", 7, 1, 8), ("chain", 3, 1, 4), ("tree", 4, 2, 8), ("tree", 3, 3, 8)]
    # n = 4: chain S = n - 1 is chain S = 3, run once
    assert [d.label for d in tree_shapes.draftings([(2, 2)], 4)] == ["chain 3/1/4", "tree 2/2/4"]


def test_ratios_and_best_tree():
    rows = [{"drafting": "chain", "steps": 7, "accept_mean": 2.0},
            {"drafting": "tree", "steps": 4, "accept_mean": 2.5},
            {"drafting": "tree", "steps": 3, "accept_mean": 2.2}]
    part = tree_shapes.with_ratios(rows, 8)  # chain S = 3 not measured yet
    assert [r["ratio_to_chain_n8"] for r in part] == [1.0, 1.25, 1.1]
    assert all(r["ratio_to_chain_s3"] is None for r in part)
    full = tree_shapes.with_ratios(rows + [{"drafting": "chain", "steps": 3,
                                            "accept_mean": 1.6}], 8)
    assert [r["ratio_to_chain_s3"] for r in full] == [1.25, 1.5625, 1.375, 1.0]
    assert tree_shapes.best_tree(full)["accept_mean"] == 2.5
    assert tree_shapes.best_tree(full[:1]) is None


@pytest.mark.parametrize("argv,message", [
    (["--shapes", "2/2"], "error: --shapes: 2/2 at n = 8"),
    (["--prompts", "0"], "argument --prompts: expected an int >= 1"),
    (["--batch", "0"], "argument --batch: expected an int >= 1"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        tree_shapes.main(["--target", "unused", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_toy_pair_rows_carry_the_keys_and_match_target_only(tmp_path):
    """The whole script on the shipped toy pair: 1 HumanEval prompt (its tail: the toy's
    context is 256), 6 new tokens, one tree; 3 rows with every key, greedy exact."""
    argv = ["--target", str(ROOT / "graphdraft/assets/target"),
            "--draft", str(ROOT / "graphdraft/assets/eagle3"), "--prompts", "1",
            "--new-tokens", "6", "--batch", "1", "--shapes", "3/2", "--threads", "1",
            "--out", str(tmp_path), "--tag", "t"]
    assert tree_shapes.main(argv) == 0
    doc = json.loads((tmp_path / "t-cpu-tree-shapes.json").read_text(encoding="utf-8"))
    assert doc["dtype"] == "float32" and doc["prompts"] == 1 and doc["new_tokens"] == 6
    rows = doc["rows"]
    assert [(r["drafting"], r["steps"], r["topk"], r["num_draft_tokens"]) for r in rows] == [
        ("chain", 7, 1, 8), ("chain", 3, 1, 4), ("tree", 3, 2, 8)]
    for r in rows:
        assert ROW_KEYS <= set(r) and r["device"] == "cpu" and r["prompts"] == 1
        assert r["greedy_identical"] == 1.0  # the engine is exact
        hist = {int(k): v for k, v in r["accept_hist"].items()}
        assert r["cycles"] == sum(hist.values()) > 0
        assert r["accept_mean"] == pytest.approx(
            sum(k * v for k, v in hist.items()) / r["cycles"], abs=1e-4)
        assert max(hist) <= min(r["steps"], r["num_draft_tokens"] - 1) + 1
        assert r["ratio_to_chain_n8"] == pytest.approx(r["accept_mean"] / rows[0]["accept_mean"],
                                                       abs=1e-4)
        assert r["ratio_to_chain_s3"] == pytest.approx(r["accept_mean"] / rows[1]["accept_mean"],
                                                       abs=1e-4)
    assert doc["best"] == rows[2]
    assert rows[0]["output_tokens"] == doc["target_output_tokens"]
