"""`python -m graphdraft demo` end to end on CPU (random pair and a saved checkpoint pair)."""

from __future__ import annotations

import torch

from graphdraft.__main__ import main, report_greedy_match
from graphdraft.checkpoint import save_eagle3_head, save_target
from tests.engine_harness import make_models


def test_demo_random_pair(capsys):
    assert main(["demo", "--random-models", "--num-prompts", "2", "--max-new-tokens", "8",
                 "--device", "cpu", "--max-running-requests", "4"]) == 0
    out = capsys.readouterr().out
    assert "running eagerly on the CPU" in out
    assert "mean accept length" in out and "greedy outputs identical to target-only: True" in out


def test_demo_checkpoint_pair(tmp_path, capsys):
    target, head = make_models(4, dtype=__import__("torch").float32)
    save_target(target, tmp_path / "t")
    save_eagle3_head(head, tmp_path / "d")
    assert main(["demo", "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"),
                 "--num-prompts", "2", "--max-new-tokens", "6", "--device", "cpu",
                 "--max-context-len", "256"]) == 0
    assert "identical to target-only: True" in capsys.readouterr().out


def test_demo_bad_flag_is_a_clear_error(capsys, tmp_path):
    assert main(["demo", "--target", str(tmp_path)]) == 2
    assert "--draft" in capsys.readouterr().err


def test_greedy_mismatch_fails_in_float32_and_is_explained_in_bf16(capsys):


    base, spec = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 7, 6]]
    assert report_greedy_match(base, base, torch.float32) == 0
    assert report_greedy_match(base, spec, torch.float32) == 1
    out = capsys.readouterr().out
    assert "1/2 requests identical; request 1 differs from token 1" in out
    assert report_greedy_match(base, spec, torch.bfloat16) == 0
    assert "expected in bfloat16" in capsys.readouterr().out
