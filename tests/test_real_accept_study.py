"""perf/studies/real_accept.py's bookkeeping on hand-made tensors (no model): the per-depth
accept from an engine histogram, the engine-like cycle walk, and the draft-vocabulary
attribution of rejections."""

from __future__ import annotations

import torch

from perf.studies.real_accept import analyse, depth_from_hist, walk


def test_depth_from_hist_is_conditional_acceptance():
    # 2 cycles committed 1 token, 1 committed 2, 1 committed 4 (S = 3)
    assert depth_from_hist({"1": 2, "2": 1, "4": 1}) == [0.5, 0.5, 1.0]


def test_walk_commits_the_accepted_prefix_and_the_bonus():
    ok = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0],
                       [0, 0, 0], [1, 0, 1]], dtype=torch.bool)
    # row 0: 2 accepted (+1) -> row 3: 3 accepted (+1) -> row 7: 1 accepted, the 0 after it ends
    assert walk(ok) == [3, 4, 2]


def test_rejections_of_tokens_outside_the_draft_vocab_are_counted_and_lifted():
    n, steps = 6, 2
    greedy = torch.tensor([5, 6, 7, 8, 9, 10])
    in_vocab = torch.ones(16, dtype=torch.bool)
    in_vocab[7] = False  # row 2's token: draft 1 of row 1 and draft 2 of row 0 target it
    valid = torch.tensor([[r + k + 1 < n for k in range(steps)] for r in range(n)])
    ok = valid.clone()
    ok[1, 0] = ok[0, 1] = False  # the OOV token is never drafted
    res = analyse(ok, valid, greedy, in_vocab, steps, {"1": 1, "2": 1, "3": 1}, 3)
    assert res["engine_accept_mean"] == 2.0
    assert res["outside_draft_vocab"] == round(1 / 6, 4)
    assert res["rejections_by_oov_per_depth"] == [1.0, 1.0]
    # draft 1: rows 0-4 valid, row 1 rejected; draft 2: rows 0, 2, 3 reached, row 0 rejected
    assert res["depth_accept_teacher_forced"] == [0.8, 0.6667]
    # with the OOV token accepted every valid draft agrees: the ceiling is the valid drafts
    ceiling = 1 + valid.int().cumprod(-1).sum(-1).float().mean().item()
    assert res["oov_ceiling_per_position"] == round(ceiling, 4)
