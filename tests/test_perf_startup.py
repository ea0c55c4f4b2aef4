"""`perf/startup.py` on the CPU: both start-up paths of a checkpoint on disk run to the end
and time each phase (no figure here is a performance result: that is the GPU run's)."""

from __future__ import annotations

import json

import torch

from graphdraft.io.checkpoint import save_eagle3_head, save_target
from perf import startup
from tests.engine_harness import make_models


def test_both_start_up_paths_run_and_report_their_phases(tmp_path):
    target, head = make_models(4, dtype=torch.float32)
    save_target(target, tmp_path / "ckpt" / "target", max_shard_bytes=20000)
    save_eagle3_head(head, tmp_path / "ckpt" / "eagle3")
    assert startup.drop_page_cache(tmp_path / "ckpt")
    for mode in startup.MODES:
        out = tmp_path / f"{mode}.json"
        startup.child(mode, tmp_path / "ckpt", 4, out, device="cpu", dtype="float32",
                      max_context_len=256)
        r = json.loads(out.read_text())
        want = {"read_s", "engine_s", "capture_s", "total_s"} | (
            {"open_s", "start_and_read_s", "started"} if mode == "overlap" else set())
        assert want <= set(r) and r["mode"] == mode
        assert r["total_s"] >= r["read_s"] + r["capture_s"] - 1e-3
        if mode == "overlap":
            assert r["started"] is False  # no graphs on a CPU: no compile phase
