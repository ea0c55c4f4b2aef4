"""scripts/tree_oracle.py's judging on hand-made candidate stores (TreeSpec(2, 2, n): M = 6,
level 1 = candidates 0-1, level 2 = 2-5)."""

from __future__ import annotations

import math

import pytest

from graphdraft.runtime.tree import TreeSpec
from scripts.tree_oracle import (
    accept_of,
    analyze,
    calibration,
    depth_cal_score,
    fit_depth_calibration,
    judged,
    loss_kind,
    select,
)

TOK = [5, 6, 7, 8, 9, 5]
SCORE = [-0.1, -2.5, -0.5, -1.0, -3.0, -4.0]


def _rec(parents, n, cont, score=SCORE):
    spec = TreeSpec(2, 2, n)
    order = sorted(range(6), key=lambda m: (-score[m], m))[: n - 1]
    node = [0] * 6
    for i, m in enumerate(sorted(order)):
        node[m] = i + 1
    raw = {"row": 0, "pos": 0, "score": score, "tok": TOK, "parent": parents, "node": node}
    (rec,) = judged([raw], [[1] + cont], spec)
    rec["accept"] = accept_of(rec, [m for m in range(6) if node[m]])
    return spec, rec


BEAMS = [-1, -1, 0, 0, 1, 1]     # both level-1 candidates expanded
ONE = [-1, -1, 0, 0, 0, 0]       # only candidate 0 expanded (1 pruned)


@pytest.mark.parametrize("parents,n,cont,accept,oracle,kind", [
    (BEAMS, 4, [5, 8], 3, 3, "depth cap"),
    (BEAMS, 4, [6, 9], 1, 3, "not selected"),   # 6 -> 9 drafted (score -3) but left out
    (BEAMS, 4, [5, 4], 2, 2, "draft miss"),     # 5 expanded, 4 not among its children
    (ONE, 6, [6, 1], 2, 2, "pruned"),           # 6 accepted, never expanded
])
def test_judging(parents, n, cont, accept, oracle, kind):
    spec, rec = _rec(parents, n, cont)
    assert rec["accept"] == accept
    assert rec["depth"] == [1, 1, 2, 2, 2, 2]
    assert loss_kind(rec, spec) == kind
    res = analyze([rec], spec)
    assert res["tree"] == accept and res["oracle"] == oracle
    assert res["loss_at_stop"][kind] == 1.0
    assert res["replay"]["cum"] == accept        # the shipped rule replayed offline


def test_select_rejects_a_rule_that_breaks_closure():
    _, rec = _rec(BEAMS, 4, [5, 8])
    bad = [-5.0, -5.0, 0.0, 0.0, 0.0, 0.0]      # children above their parents
    with pytest.raises(ValueError, match="score"):
        select(rec, 4, bad)


def test_calibration_and_depth_cal():
    spec, rec = _rec(BEAMS, 4, [5, 8])
    cal = calibration([rec], spec)
    assert cal[1]["candidates"] == 2 and cal[1]["cum_accept"] == 0.5
    assert cal[1]["cum_q"] == pytest.approx((math.exp(-0.1) + math.exp(-2.5)) / 2)
    # given the parent matched: only candidate 0's children (2, 3) at depth 2; 3 matched
    assert cal[2]["given_parent"] == 2 and cal[2]["local_accept"] == 0.5
    table = fit_depth_calibration([rec], spec, bins=4)
    assert len(table) == 2 and all(len(t) == 4 for t in table)
    assert all(a <= b for t in table for a, b in zip(t, t[1:], strict=False))   # monotone in q
    s = depth_cal_score(rec, table)
    assert all(s[m] <= s[p] for m, p in enumerate(rec["parent"]) if p >= 0)
