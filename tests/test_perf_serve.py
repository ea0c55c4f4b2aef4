"""perf/serve.py's offline baseline on the CPU (issue #41): the closed loop keeps at most c
requests in the system under either admission rule, serves every token, counts its steps
as the server's /metrics does, and "grouped-D" admits in groups (fewer prefill / mixed steps);
the row takes the better rule's figure and names it. No timing: CPU figures mean nothing."""

from __future__ import annotations

import pytest

from perf import serve

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def engine():
    from graphdraft.serving.cli import build_parser
    from graphdraft.serving.cli.serve import build_engine
    eng, _ = build_engine(build_parser().parse_args(["serve", "--device", "cpu", "--quiet"]))
    return eng


class Watch:
    """Wraps `engine.add_request` / `step`: requests in the system after every call, and the
    sizes of the groups added between two steps (with whether any request was live then)."""

    def __init__(self, engine, monkeypatch) -> None:
        self.live, self.peak, self.groups, self.pending = 0, 0, [], 0
        add, step = engine.add_request, engine.step

        def add_request(*args, **kwargs):
            self.live += 1
            self.pending += 1
            self.peak = max(self.peak, self.live)
            return add(*args, **kwargs)

        def stepped():
            if self.pending:
                self.groups.append((self.pending, self.live - self.pending))
            self.pending = 0
            done = step()
            self.live -= len(done)
            return done

        monkeypatch.setattr(engine, "add_request", add_request)
        monkeypatch.setattr(engine, "step", stepped)


def _prompts() -> list[list[int]]:
    return [[(7 * i + j) % 200 + 10 for j in range(12 + i % 5)] for i in range(9)]


@pytest.mark.parametrize("rule", ["immediate", "grouped-4"])
def test_the_engine_serves_every_token_with_c_in_the_system(engine, monkeypatch, rule):
    from graphdraft.serving.verify import SamplingParams
    params = SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True)
    c, n = 4, 10
    w = Watch(engine, monkeypatch)
    out = serve.closed_loop_offline(engine, _prompts(), params, c, n, admission=rule)
    assert out["tokens"] == n * MAX_TOKENS
    assert w.peak == c and w.live == 0 and not engine.has_work
    assert sum(size for size, _ in w.groups) == n
    assert out["steps"] == out["decode_cycles"] + out["mixed_steps"]
    assert out["decode_cycles"] > 0 and out["mixed_steps"] >= 1
    assert 0 < out["prefill_step_s"] < out["step_s"]


class StaggeredEngine:
    """The Engine's loop interface with request i finishing `2 + i % 7` steps after the step
    that admitted it (read back by that step, as `Engine.step` returns it); a step that
    admits is a prefill / mixed step, the others decode cycles (`graph_summary`)."""

    def __init__(self) -> None:
        self.waiting, self.running, self.cycles, self.added = [], {}, 0, 0
        self.stats = type("Stats", (), {"prefill_tokens": 0})()

    def add_request(self, prompt, params):
        self.waiting.append(self.added)
        self.added += 1
        return self.added - 1

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list:
        self.cycles += not self.waiting
        self.stats.prefill_tokens += 16 * len(self.waiting)
        for i in self.waiting:
            self.running[i] = 2 + i % 7
        self.waiting = []
        done = [i for i, left in self.running.items() if left == 1]
        self.running = {i: left - 1 for i, left in self.running.items() if left > 1}
        return [type("R", (), {"output": [0] * MAX_TOKENS})() for _ in done]

    def graph_summary(self) -> dict:
        return {"spec_cycle": (self.cycles, 0)}


def test_grouped_admits_a_quarter_of_c_at_once_in_fewer_steps(monkeypatch):
    """Finishes spread over the steps: "immediate" admits after nearly every step,
    "grouped-4" only when a quarter of c is due (or nothing is live), in fewer steps."""
    c, n = 16, 200
    runs = {}
    for rule in ("immediate", "grouped-4"):
        eng = StaggeredEngine()
        with monkeypatch.context() as mp:
            w = Watch(eng, mp)
            out = serve.closed_loop_offline(eng, _prompts(), None, c, n, admission=rule)
        assert out["tokens"] == n * MAX_TOKENS and w.peak == c and w.live == 0
        assert out["mixed_steps"] == len(w.groups)
        runs[rule] = w.groups
    assert all(size >= c // 4 or live == 0 for size, live in runs["grouped-4"])
    assert any(size < c // 4 for size, _ in runs["immediate"])
    assert len(runs["grouped-4"]) < 0.6 * len(runs["immediate"]), runs


def test_decode_cycles_count_the_cycle_family(engine):
    assert serve.decode_cycles({"spec_cycle": (5, 2), "draft_kv_rebuild": (9, 9)}) == 7
    assert serve.decode_cycles({}) == 0
    assert serve.decode_cycles({"target_verify": (3, 1), "eagle3_draft": (4, 0)}) == 4
    assert serve.decode_cycles(engine.graph_summary()) >= 0


def test_graph_runs_read_from_metrics_samples():
    m = {'graphdraft_graph_replays_total{forward="spec_cycle"}': 10.0,
         'graphdraft_eager_runs_total{forward="spec_cycle"}': 2.0,
         'graphdraft_graph_replays_total{forward="draft_kv_rebuild"}': 4.0,
         "graphdraft_engine_steps_total": 30.0,
         'graphdraft_requests_total{endpoint="completions",status="200"}': 5.0}
    assert serve.graph_runs(m) == {"spec_cycle": (10, 2), "draft_kv_rebuild": (4, 0)}
    assert serve.decode_cycles(serve.graph_runs(m)) == 12


def test_group_sizes_and_unknown_rules_named(engine):
    assert serve.admission_group("immediate", 128) == 1
    assert serve.admission_group("grouped-4", 128) == 32
    assert serve.admission_group("grouped-8", 12) == 2 and serve.admission_group("grouped-8", 1) == 1
    for bad in ("eager", "grouped", "grouped-1", "grouped-x", "batched-4"):
        with pytest.raises(ValueError, match="admission"):
            serve.closed_loop_offline(engine, _prompts(), None, 2, 2, admission=bad)
    for flag in ("eager", ",", "immediate,grouped-0"):
        with pytest.raises(SystemExit):
            serve.main(["--offline-admission", flag])


@pytest.mark.parametrize("counts", ["0", "2,x", ","])
def test_bad_api_server_counts_are_named(counts, capsys):
    with pytest.raises(SystemExit):
        serve.main(["--api-server-counts", counts])
    assert "--api-server-counts" in capsys.readouterr().err


def test_the_report_names_the_servers_admission_group():
    from graphdraft.serving.openai_api.engine_core import ADMISSION_GROUP_DEFAULT
    assert serve.server_admission_group(["--device", "cpu"]) == ADMISSION_GROUP_DEFAULT
    assert serve.server_admission_group(["--admission-group", "0"]) == 0
    with pytest.raises(SystemExit):
        serve.server_admission_group(["--admission-group", "x"])


def test_the_row_takes_the_better_rule_and_names_it():
    offline = {"torch_threads": 4,
               "immediate": {8: {"tps": 100.0, "steps": 40, "mixed_steps": 20}},
               "grouped-4": {8: {"tps": 150.0, "steps": 30, "mixed_steps": 6}}}
    row = {"concurrency": 8, "server_tps": 120.0}
    serve.add_offline(row, offline)
    assert row["offline_tps"] == 150.0 and row["offline_admission_best"] == "grouped-4"
    assert row["server_over_offline"] == 0.8
    assert row["offline_by_admission"]["immediate"]["mixed_steps"] == 20
    one = {"concurrency": 8, "server_tps": 120.0}
    serve.add_offline(one, {"immediate": offline["immediate"]})
    assert one["offline_tps"] == 100.0 and one["offline_admission_best"] == "immediate"


def test_the_offline_engine_gets_the_engine_process_threads(monkeypatch):
    """`engine_core.leave_a_cpu` (called by the engine process and by the offline phase):
    the CPUs less one, never more than before, never below one; OMP_NUM_THREADS wins."""
    import os

    import torch

    from graphdraft.serving.openai_api.engine_core import leave_a_cpu
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3)), raising=False)
        torch.set_num_threads(8)
        leave_a_cpu()
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
        leave_a_cpu()
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        torch.set_num_threads(3)
        leave_a_cpu()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_mixed_step_phases_count_each_kind_of_step_and_restore_the_methods(engine):
    """perf.mixed_step's phase timer: every phase wrapper comes off again, the steps are
    split into mixed (a prompt to prefill) and other, and a mixed step spent time in the
    target forward and the draft (no figure: CPU)."""
    from graphdraft.runtime.drafter import EagleDrafter
    from graphdraft.serving.cycles.base import DecodeMode
    from graphdraft.serving.verify import SamplingParams
    from perf import mixed_step

    before = (DecodeMode.target_forward, EagleDrafter.draft_mixed, engine.step)
    ph = mixed_step.phase_times(engine, _prompts(), SamplingParams(max_new_tokens=MAX_TOKENS,
                                                                   ignore_eos=True), 2, 4)
    assert (DecodeMode.target_forward, EagleDrafter.draft_mixed, engine.step) == before
    assert ph["mixed_steps"] >= 2 and ph["other_steps"] >= 1
    assert set(ph["mixed_ms"]) == {name for name, _, _ in mixed_step.PHASES}
    assert ph["mixed_ms"]["target_forward"] > 0 and ph["mixed_ms"]["draft_mixed"] > 0
    assert ph["other_ms"]["target_forward"] == 0


def test_cpu_use_and_core_deltas_per_level():
    passes = [{"wall_s": 2.0, "client_cpu_s": [0.5, 1.0]}, {"wall_s": 2.0, "client_cpu_s": [0.5, 0.2]}]
    cpu = serve.cpu_use({"http": 1.0, "http_7": 1.0, "engine": 3.0},
                        {"http": 4.0, "http_7": 4.0, "engine": 5.0}, passes)
    assert cpu == {"wall_s": 4.0, "http": 0.75, "http_busiest": 0.75, "engine": 0.5,
                   "client_busiest": 0.3, "clients": 0.55}
    two = serve.cpu_use({"http": 1.0, "http_7": 0.4, "http_8": 0.5, "engine": 3.0},
                        {"http": 5.0, "http_7": 2.4, "http_8": 2.5, "engine": 5.0}, passes)
    assert two["http"] == 1.0 and two["http_busiest"] == 0.5  # (a supervisor's 0.1 s in http)
    before = {"seconds": {"step_mixed": 1.0}, "counts": {"turns": 10},
              "requests": {"arrival_to_engine_s": 0.0, "arrival_to_first_ids_s": 1.0,
                           "handed_over": 0, "first_ids": 100}}
    after = {"seconds": {"step_mixed": 1.5}, "counts": {"turns": 30},
             "requests": {"arrival_to_engine_s": 0.01, "arrival_to_first_ids_s": 1.5,
                          "handed_over": 10, "first_ids": 150}}
    d = serve.core_delta(before, after)
    assert d["seconds"] == {"step_mixed": 0.5} and d["counts"] == {"turns": 20}
    assert d["arrival_to_engine_ms"] == 1.0 and d["arrival_to_first_ids_ms"] == 10.0
    m = "graphdraft_time_to_first_token_seconds"
    assert serve.http_ttft_ms({m + "_sum": 1.0, m + "_count": 10},
                              {m + "_sum": 1.5, m + "_count": 20}) == 50.0
    assert serve.core_delta(before, None) == {} and serve.http_ttft_ms({}, {}) is None
