"""The tree-kernel benchmark script runs end to end on tiny shapes (CPU: a check, not a timing)."""

from __future__ import annotations

import json

from perf import tree_kernels


def test_tree_kernels_smoke(tmp_path, capsys):
    assert tree_kernels.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "tree_kernels.json").read_text())
    kernels = {r["kernel"] for r in data["rows"]}
    assert {"build", "accept_sampled", "kv_move", "hid_gather", "beams_step"} <= kernels
    assert {r["config"]["topk"] for r in data["rows"]} == {1, 4}
    assert all(r["us"] > 0 for r in data["rows"])
    assert "tree kernels" in capsys.readouterr().out
