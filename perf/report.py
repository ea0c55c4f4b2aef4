"""`python -m perf.report benchmark.json`: the perf run as one markdown table.

Reads the `extra_info` that `perf/test_draft_perf.py` stores in each
pytest-benchmark record (a case's graph and compile records are merged) and
prints one row per case, then one line with the
measured copy bandwidth and the GPU, then notes for anything that went wrong
(compile failures, eager/graph mismatches, graphs that never replayed).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = ("case", "bs", "kv", "eager us", "graph us", "compile us", "floor us", "graph/floor",
           "graph vs compile", "eager/graph", "capture s", "pool MB")


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
    sizes = ", ".join(f"{bs}: {(v.get('first_s') or 0) + (v.get('multi_s') or 0):.2f}s"
                      for bs, v in per.items())
    return (f"Whole schedule {s['schedule']}: first-step + multi-step graphs captured in "
            f"{s['schedule_capture_s']:.2f} s, pool {s['schedule_pool_bytes'] / 2**20:.1f} MiB "
            f"(per size: {sizes}).")


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def row(r: dict[str, Any]) -> list[str]:
    eager, graph = r.get("eager_run_us"), r.get("graph_run_us")
    comp, floor = r.get("compile_run_us"), r.get("floor_us")
    if "compile_error" in r:
        comp_cell = "failed: " + r["compile_error"].split(":", 1)[0]
    else:
        comp_cell = _num(comp, ".0f") + ("*" if r.get("compile_cudagraph_skips") else "")
    return [f"page{r.get('page_size', '?')}", str(r.get("bs", "?")), str(r.get("kv_len", "?")),
            _num(eager, ".0f"), _num(graph, ".0f"), comp_cell, _num(floor, ".0f"),
            _num(_ratio(graph, floor), ".2f") + ("x" if graph and floor else ""),
            _num(_ratio(comp, graph), ".2f") + ("x" if comp and graph else ""),
            _num(_ratio(eager, graph), ".1f") + ("x" if eager and graph else ""),
            _num(r.get("capture_s"), ".2f"), _num(r.get("pool_bytes", 0) / 2**20, ".1f")]


def notes(records: Sequence[dict[str, Any]]) -> list[str]:
    out = []
    skipped = [r for r in records if r.get("compile_cudagraph_skips")]
    if skipped:
        out.append(f"- *: torch.compile skipped cudagraphs for part of the baseline in "
                   f"{len(skipped)} of {len(records)} cases (see the run's "
                   "'skipping cudagraphs due to ...' warnings); those parts ran without graphs")
    for r in records:
        name = f"page{r.get('page_size')} kv{r.get('kv_len')} bs{r.get('bs')}"
        if "compile_error" in r:
            out.append(f"- {name}: torch.compile baseline failed: {r['compile_error']}")
        if r.get("eager_equals_graph") is False:
            out.append(f"- {name}: graph replay output differs from eager output")
        if r.get("graph_replayed") is False:
            out.append(f"- {name}: no CUDA graph replayed (the 'graph' column ran eagerly)")
    return out


def render(records: Sequence[dict[str, Any]]) -> str:
    """The markdown table, the bandwidth/GPU line and any notes."""
    if not records:
        return "No draft benchmark records (perf suite skipped: no CUDA GPU?)."
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in records]
    first = records[0]
    bw = first.get("copy_bw")
    lines += ["", f"Copy bandwidth (read + written): {_num(bw and bw / 1e12, '.2f')} TB/s on "
              f"{first.get('gpu', 'unknown GPU')} (torch {first.get('torch', '?')}, "
              f"triton {first.get('triton', '?')}); floor = HBM bytes per draft call "
              f"({first.get('steps', 3)} steps: weights + KV + first-step fc and hidden) / that "
              "bandwidth; times are CUDA-event medians of `drafter.run` on a decode batch; "
              f"torch.compile shapes: {first.get('compile_mode', '?')}."]
    extra = notes(records)
    if extra:
        lines += ["", *extra]
    return "\n".join(lines)


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
