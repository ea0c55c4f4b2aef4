"""perf/tree.py's measurement helpers: the bootstrap interval of the tree / chain accept ratio
(`accept_ratio_ci`, `add_chain_ratios`) and the held-out prompt windows (`heldout_windows`)."""

from __future__ import annotations

import random

import pytest

from perf.tree import accept_ratio_ci, add_chain_ratios, heldout_windows


def _rows(n_prompts: int, mean: float, seed: int, verifies: int = 20) -> list[list[int]]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n_prompts):
        m = mean + rnd.uniform(-0.6, 0.6)                    # prompts differ in difficulty
        out.append([max(1, min(8, round(rnd.gauss(m, 1.0)))) for _ in range(verifies)])
    return out


def test_ratio_is_the_ratio_of_pooled_means():
    tree = [[3, 4], [2], [5, 5, 5]]
    chain = [[2, 2, 2], [1, 1], [4]]
    r = accept_ratio_ci(tree, chain, reps=200)
    want = (sum(map(sum, tree)) / 6) / (sum(map(sum, chain)) / 6)
    assert r["ratio"] == pytest.approx(want, abs=1e-4)
    assert r["lo"] <= r["ratio"] <= r["hi"] and r["se"] > 0
    assert (r["prompts"], r["groups"], r["reps"]) == (3, 3, 200)


def test_exact_scaling_has_a_zero_width_interval():
    """Every prompt's tree mean is exactly 1.25x its chain mean: every resample says 1.25."""
    chain = [[4, 4, 4, 4], [2, 2], [4, 4]]
    tree = [[5, 5, 5, 5], [2, 3], [5, 5]]
    r = accept_ratio_ci(tree, chain, reps=500)
    assert r["ratio"] == r["lo"] == r["hi"] == 1.25 and r["se"] == 0


def test_interval_covers_the_truth_and_shrinks_with_prompts():
    """Synthetic pairs with a known ratio: the 95 % interval holds it, and 4x the prompts
    halve its width (about 1/sqrt(prompts))."""
    widths = []
    for n in (16, 64):
        chain = _rows(n, 2.6, seed=n)
        tree = [[a + (1 if j % 7 == 0 else 0) for j, a in enumerate(row)] for row in chain]
        truth = sum(map(sum, tree)) / sum(map(sum, chain))
        r = accept_ratio_ci(tree, chain, reps=2000, seed=1)
        assert r["ratio"] == pytest.approx(truth, abs=1e-4)
        assert r["lo"] < truth < r["hi"]
        widths.append(r["hi"] - r["lo"])
    assert 0.3 < widths[1] / widths[0] < 0.75


def test_unpaired_noise_gives_a_wider_interval_than_paired_rows():
    """The bootstrap keeps prompts paired: independent draws per config vary more than the
    same prompts' difficulty shared by both."""
    chain = _rows(40, 2.6, seed=3)
    paired = [[a + (1 if j % 5 == 0 else 0) for j, a in enumerate(row)] for row in chain]
    unpaired = _rows(40, 2.6 * 1.08, seed=4)
    w_p = accept_ratio_ci(paired, chain, reps=2000)
    w_u = accept_ratio_ci(unpaired, chain, reps=2000)
    assert (w_p["hi"] - w_p["lo"]) < 0.6 * (w_u["hi"] - w_u["lo"])


def test_groups_resample_whole_documents():
    """Each prompt duplicated: as one document per pair the bootstrap equals the undoubled one
    (same seed, same draws); as independent prompts it is falsely narrower."""
    chain = _rows(12, 2.5, seed=5)
    tree = _rows(12, 2.9, seed=6)
    base = accept_ratio_ci(tree, chain, reps=1000, seed=2)
    grouped = accept_ratio_ci(tree + tree, chain + chain, list(range(12)) * 2, reps=1000, seed=2)
    for key in ("ratio", "lo", "hi", "se"):
        assert grouped[key] == pytest.approx(base[key], abs=2e-4)
    assert grouped["groups"] == 12 and grouped["prompts"] == 24
    naive = accept_ratio_ci(tree + tree, chain + chain, reps=1000, seed=2)
    assert naive["se"] < 0.85 * base["se"]


@pytest.mark.parametrize("kw,match", [
    (dict(tree_rows=[[2]], chain_rows=[[1], [1]]), "same number"),
    (dict(tree_rows=[], chain_rows=[]), "same number"),
    (dict(tree_rows=[[2], []], chain_rows=[[1], [1]]), "at least one verify"),
    (dict(tree_rows=[[2]], chain_rows=[[1]], groups=[0, 1]), "groups"),
    (dict(tree_rows=[[2]], chain_rows=[[1]], level=1.0), "level"),
    (dict(tree_rows=[[2]], chain_rows=[[1]], reps=3), "reps"),
])
def test_bad_input_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        accept_ratio_ci(**kw)


def test_add_chain_ratios_pairs_same_head_temperature_and_n():
    def row(steps, topk, n, head, temp, per):
        return {"config": {"steps": steps, "topk": topk, "num_draft_tokens": n}, "head": head,
                "temperature": temp, "per_prompt": per}
    rows = [row(7, 1, 8, "weak", 0.0, [[2, 2], [2]]), row(7, 1, 8, "weak", 0.7, [[1, 1], [1]]),
            row(5, 4, 8, "weak", 0.0, [[3, 3], [3]]), row(5, 4, 8, "weak", 0.7, [[2, 2], [2]]),
            row(5, 4, 8, "shipped", 0.0, [[3, 3], [3]]), row(3, 4, 16, "weak", 0.0, [[4], [4]])]
    add_chain_ratios(rows, [0, 1])
    assert rows[2]["vs_chain"]["ratio"] == 1.5 and rows[2]["vs_chain"]["chain"] == "7/1/8"
    assert rows[3]["vs_chain"]["ratio"] == 2.0
    assert rows[4]["vs_chain"] is None and rows[5]["vs_chain"] is None   # no chain measured
    assert "vs_chain" not in rows[0]


def test_heldout_windows_distinct_documents_first():
    from graphdraft.train.evaluate import prompt_ids
    prompts, groups = heldout_windows(64)
    assert len(prompts) == len(groups) == 64
    assert all(len(p) == 96 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 64
    ndocs = len(set(groups))
    assert groups[:ndocs] == sorted(set(groups))        # one window per document first
    ev = prompt_ids(39, 96)             # round 1 = evaluate's prompts, duplicates dropped
    assert [p for p in prompts[:ndocs] if p in ev] == [p for i, p in enumerate(ev) if p not in ev[:i]]
    with pytest.raises(ValueError, match="count"):
        heldout_windows(10_000)
