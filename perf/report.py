"""`python -m perf.report benchmark.json`: the perf run as one markdown table.

Reads the `extra_info` that `perf/test_draft_perf.py` stores in each
pytest-benchmark record (a case's graph and compile records are merged) and
prints one row per case, the baseline's columns labelled by its mode
(`compile+graph`, `reduce-overhead`, ...), then one line with the measured copy
bandwidth and the GPU, then notes for anything that went wrong (compile
failures, baseline forwards that did not replay a graph, eager/graph
mismatches, graphs that never replayed) and the work a draft call issues
outside its graph replay.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_MODE = "compile+graph"


def columns(mode: str = DEFAULT_MODE) -> tuple[str, ...]:
    """The table's header; the baseline's columns carry its mode."""
    return ("case", "bs", "kv", "eager us", "graph us", f"{mode} us", "floor us", "graph/floor",
            "replay/floor",
            f"{mode}/graph", "eager/graph", "refresh us", "in place", "with host", "launches",
            "capture s", "pool MB",
            f"{mode} s")


COLUMNS = columns()


def merge(infos: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per case: the `extra_info` of its records (graph, compile) merged, in first-seen order."""
    cases: dict[tuple[Any, ...], dict[str, Any]] = {}
    for info in infos:
        if "bs" in info:
            cases.setdefault((info.get("page_size"), info.get("kv_len"), info["bs"]), {}).update(info)
    return list(cases.values())


def load(path: str | Path) -> list[dict[str, Any]]:
    """The merged per-case records of a pytest-benchmark JSON file."""
    data = json.loads(Path(path).read_text())
    return merge([b.get("extra_info", {}) for b in data.get("benchmarks", [])])


def load_schedule(path: str | Path) -> dict[str, Any] | None:
    """The whole-schedule capture record (perf/test_capture_schedule.py), if the run has one."""
    data = json.loads(Path(path).read_text())
    found = [b["extra_info"] for b in data.get("benchmarks", [])
             if "schedule" in b.get("extra_info", {})]
    return found[0] if found else None


def gemv_lines(path: str | Path) -> list[str]:
    """The cuBLAS vs Triton GEMV table (perf/test_gemv.py), if the run has one."""
    data = json.loads(Path(path).read_text())
    rows = [b["extra_info"] for b in data.get("benchmarks", [])
            if "gemv_shape" in b.get("extra_info", {})]
    if not rows:
        return []
    out = ["| matmul | m | cuBLAS us | triton GEMV us | floor us | cuBLAS bw | GEMV bw |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['gemv_shape']} | {r['m']} | {r['cublas_us']:.1f} | "
                   f"{r['triton_gemv_us']:.1f} | {r['weights_floor_us']:.1f} | "
                   f"{r['cublas_bw_share']:.0%} | {r['triton_bw_share']:.0%} |")
    return out


def schedule_line(s: dict[str, Any]) -> str:
    per = s.get("schedule_per_size", {})
    sizes = ", ".join(f"{bs}: {(v.get('decode_s', v.get('first_s')) or 0) + (v.get('multi_s') or 0):.2f}s"
                      for bs, v in per.items())  # first_s: runs before the one decode graph
    return (f"Whole schedule {s['schedule']}: decode + multi-step graphs captured in "
            f"{s['schedule_capture_s']:.2f} s, pool {s['schedule_pool_bytes'] / 2**20:.1f} MiB "
            f"(per size: {sizes}).")


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _compile_cell(r: dict[str, Any]) -> str:
    if "compile_error" in r:
        return "failed: " + r["compile_error"].split(":", 1)[0]
    ungraphed = r.get("compile_cudagraph_skips") or r.get("compile_graph_replayed") is False
    return _num(r.get("compile_run_us"), ".0f") + ("*" if ungraphed else "")


def _launch_cell(r: dict[str, Any]) -> str:
    """Host launches outside the graph: the default call's, then in place (runs since the
    fifth session)."""
    if "refresh_launches" not in r:
        return "failed" if "launches_error" in r else "—"
    n, gpu = r["refresh_launches"], r.get("refresh_gpu_ops")
    cell = str(n) if gpu is None or gpu == n else f"{n} ({gpu} on GPU)"
    in_place = r.get("refresh_launches_in_place")
    return cell if in_place is None else f"{cell} / {in_place}"


def refresh_us(r: dict[str, Any]) -> float | None:
    """`refresh_gpu_us` (GPU timeline), else the recorded `refresh_us` (runs before it), else
    graph run minus both replays, medians timed apart (runs before that)."""
    for key in ("refresh_gpu_us", "refresh_us"):
        if r.get(key) is not None:
            return r[key]
    parts = [r.get(k) for k in ("graph_run_us", "graph_first_us", "graph_multi_us")]
    return None if None in parts else parts[0] - parts[1] - parts[2]


def row(r: dict[str, Any]) -> list[str]:
    eager, graph, replay = r.get("eager_run_us"), r.get("graph_run_us"), r.get("graph_decode_us")
    comp, floor = r.get("compile_run_us"), r.get("floor_us")
    return [f"page{r.get('page_size', '?')}", str(r.get("bs", "?")), str(r.get("kv_len", "?")),
            _num(eager, ".0f"), _num(graph, ".0f"), _compile_cell(r), _num(floor, ".0f"),
            _num(_ratio(graph, floor), ".2f") + ("x" if graph and floor else ""),
            _num(_ratio(replay, floor), ".3f") + ("x" if replay and floor else ""),
            _num(_ratio(comp, graph), ".2f") + ("x" if comp and graph else ""),
            _num(_ratio(eager, graph), ".1f") + ("x" if eager and graph else ""),
            _num(refresh_us(r), ".1f"), _num(r.get("refresh_gpu_in_place_us"), ".1f"),
            _num(r.get("refresh_events_us"), ".1f"), _launch_cell(r),
            _num(r.get("capture_s"), ".2f"), _num(r.get("pool_bytes", 0) / 2**20, ".1f"),
            _num(r.get("compile_s"), ".1f")]


def _name(r: dict[str, Any]) -> str:
    return f"page{r.get('page_size')} kv{r.get('kv_len')} bs{r.get('bs')}"


def notes(records: Sequence[dict[str, Any]]) -> list[str]:
    out = []
    skipped = [r for r in records if r.get("compile_cudagraph_skips")]
    if skipped:
        out.append(f"- *: torch.compile skipped cudagraphs for part of the baseline in "
                   f"{len(skipped)} of {len(records)} cases (see the run's "
                   "'skipping cudagraphs due to ...' warnings); those parts ran without graphs")
    eager = [r for r in records if r.get("compile_graph_replayed") is False]
    if eager:
        out.append(f"- *: the compiled forwards did not all replay a CUDA graph in {len(eager)} "
                   f"of {len(records)} cases ({', '.join(_name(r) for r in eager)}: "
                   "eager forward calls, or a capture dropped for memory); those ran "
                   "compiled but ungraphed")
    agree = [r["compile_agreement"] for r in records if "compile_agreement" in r]
    if agree:
        out.append(f"- baseline drafts equal to the graph drafter's: {min(agree):.1%} to "
                   f"{max(agree):.1%} of draft tokens (torch path vs Triton kernels, same weights)")
    group_s = {(r.get("page_size"), r.get("kv_len")): r["compile_group_s"] for r in records
               if "compile_group_s" in r}
    if group_s:
        out.append("- baseline build (compile and capture of every bs of the group): "
                   + ", ".join(f"page{p} kv{k} {s:.1f} s" for (p, k), s in group_s.items()))
    for r in records:
        name = _name(r)
        if "compile_error" in r:
            out.append(f"- {name}: torch.compile baseline failed: {r['compile_error']}")
        if r.get("eager_equals_graph") is False:
            out.append(f"- {name}: graph replay output differs from eager output")
        if r.get("graph_replayed") is False:
            out.append(f"- {name}: no CUDA graph replayed (the 'graph' column ran eagerly)")
        if "launches_error" in r:
            out.append(f"- {name}: launch count failed: {r['launches_error']}")
        if r.get("graph_launches") not in (None, 1):
            out.append(f"- {name}: {r['graph_launches']} graph launches in one draft call "
                       "(expected 1: the decode draft)")
        if r.get("in_place_equals_copy") is False:
            out.append(f"- {name}: drafts with the hidden states in place (and not copied "
                       "out) differ from drafts with them copied")
        if r.get("launch_counts_stable") is False:
            out.append(f"- {name}: profiled draft calls issued different launch counts")
    ops = [r for r in records if r.get("refresh_ops")]
    if ops:
        seen: dict[str, list[str]] = {}
        for r in ops:
            key = ", ".join(f"{n} x{c}" for n, c in r["refresh_ops"].items())
            seen.setdefault(key, []).append(_name(r))
        for key, names in seen.items():
            out.append(f"- GPU work outside the graph replays per draft call ({', '.join(names)}): "
                       f"{key}")
    return out


def render(records: Sequence[dict[str, Any]]) -> str:
    """The markdown table, the bandwidth/GPU line and any notes."""
    if not records:
        return "No draft benchmark records (perf suite skipped: no CUDA GPU?)."
    first = records[0]
    mode = first.get("compile_mode") or DEFAULT_MODE
    mode = LEGACY_MODES.get(mode, mode)
    cols = columns("compile" if mode == "off" else mode)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in records]
    bw = first.get("copy_bw")
    lines += ["", f"Copy bandwidth (read + written): {_num(bw and bw / 1e12, '.2f')} TB/s on "
              f"{first.get('gpu', 'unknown GPU')} (torch {first.get('torch', '?')}, "
              f"triton {first.get('triton', '?')}); floor = HBM bytes per draft call "
              f"({first.get('steps', 3)} steps: weights + KV + first-step fc and hidden) / that "
              "bandwidth; times are CUDA-event medians of `drafter.run` on a decode batch "
              "(graph us: the whole call; replay: its decode graph replayed alone, without the "
              "staging and output copy); "
              f"baseline: {MODE_TEXT.get(mode, mode).format(mode=mode)}; refresh us = how much the "
              "work outside the decode replay (staging launch, output copy) lengthens a draft "
              "call on the GPU timeline (torch.profiler, median of 5 calls); in place: the "
              "same with the target's hidden states already in the drafter's buffer and the "
              "drafts returned as its view (`copy_output=False`, as the bundled Engine runs; "
              "runs before the fifth session still cloned the drafts); with "
              "host: CUDA events around the call and its replay, host gaps and two extra "
              "event records included (median); launches = kernel launches, memcpys and "
              "memsets one draft call issues outside its graph launch (host API count; "
              "default / in place)."]
    extra = notes(records)
    if extra:
        lines += ["", *extra]
    return "\n".join(lines)


LEGACY_MODES = {"static": "reduce-overhead", "dynamic": "reduce-overhead-dynamic"}
"""`compile_mode` as runs before the compile+graph baseline recorded it."""

MODE_TEXT = {
    "compile+graph": "compile+graph = torch-path drafter, torch.compile(dynamic=False) inductor "
                     "forwards captured in graphdraft's own CUDA graphs; '{mode} s' = that bs's "
                     "compile (first warm-up call) and capture",
    "reduce-overhead": "reduce-overhead = torch-path drafter, torch.compile(mode="
                       "'reduce-overhead', dynamic=False); '{mode} s' = its first three calls",
    "reduce-overhead-dynamic": "reduce-overhead-dynamic = as reduce-overhead with automatic "
                               "dynamic shapes",
    "off": "none (GRAPHDRAFT_PERF_COMPILE=0)",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m perf.report BENCHMARK_JSON", file=sys.stderr)
        return 2
    path = Path(args[0])
    if not path.exists():
        print(f"{path}: no such file (pytest-benchmark writes none when every test was skipped)")
        return 1
    print(render(load(path)))
    sched = load_schedule(path)
    if sched is not None:
        print("\n" + schedule_line(sched))
    gemv = gemv_lines(path)
    if gemv:
        print("\n" + "\n".join(gemv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
