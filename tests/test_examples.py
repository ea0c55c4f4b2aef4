"""examples/ run as shipped: `embed_drafter.py` embeds EagleDrafter in a loop of its own
(public API only) and matches the target alone."""

from __future__ import annotations

import ast
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EMBED = ROOT / "examples" / "embed_drafter.py"


def test_embed_drafter_uses_only_the_public_api():
    tree = ast.parse(EMBED.read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m.split(".")[0] in ("tests", "capture") for m in modules), modules
    assert all(m.split(".")[0] in ("graphdraft", "torch", "argparse", "dataclasses", "pathlib",
                                   "__future__") for m in modules), modules


def test_embed_drafter_runs_and_matches_the_target_alone(capsys):
    module = runpy.run_path(str(EMBED), run_name="example")
    assert module["main"](["--max-new-tokens", "12", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "identical to the target alone (greedy): True" in out
    accept = float(out.split("mean accept length: ")[1].split()[0])
    assert 1.0 <= accept <= 4.0
