"""Capture time and pool memory of the whole default graph schedule at the 8B head shape.

One drafter (page size 16, KV 512) captures its first-step and multi-step graphs
for every size of `batch_size_schedule(64)` (1, 2, 4, 8, 16, 24, ..., 64), largest
first into one pool; the record's `extra_info["schedule"]` holds per-size seconds
and pool bytes, and `perf.report` prints the totals.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from capture import batch_size_schedule
from perf.draft_group import GroupCache, build_group

MAX_BS = 64


def test_capture_full_schedule(head: torch.nn.Module, groups: GroupCache, benchmark: Any,
                               device_info: dict[str, Any]) -> None:
    groups.close()  # one group alive at a time
    sizes = batch_size_schedule(MAX_BS)
    t0 = time.perf_counter()
    group = build_group(head, 16, 512, sizes)
    wall = time.perf_counter() - t0
    d = group.drafter
    fs, ms = d.decode_graphs.stats, d.multi_step_graphs.stats
    per_size = {bs: {"decode_s": fs.capture_seconds.get(bs), "multi_s": ms.capture_seconds.get(bs),
                     "pool_bytes": fs.pool_bytes.get(bs, 0) + ms.pool_bytes.get(bs, 0)}
                for bs in sizes}
    info = {"schedule": sizes, "schedule_per_size": per_size,
            "schedule_capture_s": fs.total_capture_seconds + ms.total_capture_seconds,
            "schedule_pool_bytes": fs.total_pool_bytes + ms.total_pool_bytes,
            "schedule_build_s": wall, "gpu": device_info["gpu"]}
    benchmark.extra_info.update(info)
    print(f"\n[perf] schedule {sizes}: capture {info['schedule_capture_s']:.2f} s, "
          f"pool {info['schedule_pool_bytes'] / 2**20:.1f} MiB (drafter build {wall:.1f} s)")
    assert d.decode_graphs.captured_sizes == sizes
    assert d.multi_step_graphs.captured_sizes == sizes
    del group, d
    torch.cuda.empty_cache()
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
