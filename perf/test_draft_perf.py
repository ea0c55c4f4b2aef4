"""Draft time of the 8B-shaped EAGLE-3 head: eager vs graph replay vs torch.compile, vs the HBM floor.

Two records per case (page size, KV length, bs), in this order within a group:
`graph` (eager and graph-replay times, capture stats, the between-replay refresh
time and the launches one draft call issues outside its two graph replays; its
benchmark stats time a synchronized graph-replay `drafter.run`) and then
`compile` (the torch.compile baseline; its stats time a synchronized baseline
`run`). Every record's `extra_info` holds the CUDA-event medians (`perf.bench`),
the HBM floor and the device info; `perf.report` merges the two records of a
case into one row.

Knobs: `GRAPHDRAFT_PERF_BS="1,64"` restricts the batch sizes;
`GRAPHDRAFT_PERF_COMPILE` picks the baseline: unset or `compile+graph` (inductor
forwards captured in graphdraft's own CUDA graphs), `reduce-overhead` (torch's
cudagraph trees), `reduce-overhead-dynamic` (the same, automatic dynamic shapes),
`0` none; `GRAPHDRAFT_PERF_LAUNCHES=0` skips the torch.profiler launch count.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from perf.bench import measure_case
from perf.cases import STEPS, Case, cases_from_env, ordered_params
from perf.compile_baseline import baseline_from_env, measure_compiled
from perf.draft_group import GroupCache, activate, fill_decode_batch
from perf.floors import floor_info
from perf.launches import launches_enabled
from perf.models_8b import LLAMA31_8B_HEAD

CASES = cases_from_env()
BASELINE = baseline_from_env()
COMPILE_MODE = BASELINE.mode if BASELINE is not None else "off"
ROUNDS, WARMUP_ROUNDS = 20, 2


def _us(res: dict[str, Any], key: str) -> str:
    return f"{res[key]:.1f} us" if key in res else "—"


def _graph_line(res: dict[str, Any]) -> str:
    launches = (f", {res['refresh_launches']} launches outside the graphs "
                f"({res.get('refresh_launches_in_place', '?')} in place)"
                if "refresh_launches" in res else
                f", launch count failed: {res['launches_error']}" if "launches_error" in res else "")
    return (f"eager {_us(res, 'eager_run_us')}, graph {_us(res, 'graph_run_us')} "
            f"(refresh on the GPU {_us(res, 'refresh_gpu_us')}, in place "
            f"{_us(res, 'refresh_gpu_in_place_us')}, with host {_us(res, 'refresh_events_us')}"
            f"{launches}; capture {res['capture_s']:.2f} s)")


def _compile_line(res: dict[str, Any]) -> str:
    if "compile_error" in res:
        return f"{COMPILE_MODE} FAILED {res['compile_error'][:160]}"
    line = f"{COMPILE_MODE} {_us(res, 'compile_run_us')} (compile {res.get('compile_s', 0):.1f} s"
    if "compile_graph_replayed" in res:
        line += f", replayed {res['compile_graph_replayed']}"
    if "compile_agreement" in res:
        line += f", agreement {res['compile_agreement']:.3f}"
    return line + ")"


@pytest.mark.parametrize(("case", "variant"), ordered_params(CASES, BASELINE is not None),
                         ids=lambda p: str(p))
def test_draft(case: Case, variant: str, benchmark: Any, groups: GroupCache,
               device_info: dict[str, Any]) -> None:
    group = groups.get(case.page_size, case.kv_len)
    batch = fill_decode_batch(group, case.bs)
    if variant == "graph":
        res = measure_case(group, batch, profile=launches_enabled())
        drafter = group.drafter
        line = _graph_line(res)
    else:
        assert BASELINE is not None
        res = measure_compiled(group, batch, BASELINE)
        drafter = group.baseline
        line = _compile_line(res)
    res.update(page_size=case.page_size, kv_len=case.kv_len, bs=case.bs, steps=STEPS,
               variant=variant, compile_mode=COMPILE_MODE, **device_info,
               group_build_s=groups.build_seconds.get(case.group, 0.0),
               **floor_info(LLAMA31_8B_HEAD, case.bs, case.kv_len, device_info["copy_bw"]))
    benchmark.extra_info.update(res)
    print(f"\n[perf] {case} {variant}: {line}, floor {_us(res, 'floor_us')}")

    if "compile_error" in res or drafter is None:  # keep the record: it carries the error
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)
        return

    activate(drafter)  # the shared head's backend: an eager fallback must not recompile

    def call() -> None:
        with torch.inference_mode():
            drafter.run(*batch.args)
        torch.cuda.synchronize()

    benchmark.pedantic(call, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
