"""The engine core's time breakdown (`engine_core.CoreTimes`) over a fake Engine: each turn's
parts and step kinds counted, a request's arrival -> hand-over -> first ids measured once,
arrivals of requests that end without ids dropped, the JSON written where
$GRAPHDRAFT_CORE_TIMES points. No timing figure: only the bookkeeping."""

from __future__ import annotations

import json
import types

from graphdraft.serving.openai_api.engine_core import CORE_TIMES_ENV, CoreTimes, EngineCore
from graphdraft.serving.openai_api.wire import socket_pair


class _Request:
    def __init__(self, prompt: list[int]) -> None:
        self.prompt, self.output, self.finish_reason = prompt, [], None
        self.logprobs = self.prompt_ranks = None
        self.prefilling = True

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Engine:
    """Admits requests; each step prefills them, then emits one token a step until 3."""

    cfg = types.SimpleNamespace(speculative_num_steps=3)
    pages = types.SimpleNamespace(num_pages=10, num_free_pages=9)
    metrics = types.SimpleNamespace(reset=lambda: None)

    def __init__(self) -> None:
        self.running, self.waiting = [], []

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def add_request(self, prompt, params, seed_stream=None) -> _Request:
        r = _Request(prompt)
        self.running.append(r)
        return r

    def step(self) -> None:
        for r in list(self.running):
            if r.prefilling:
                r.prefilling = False
                continue
            r.output.append(7)
            if len(r.output) == 3:
                r.finish_reason = "length"
                self.running.remove(r)

    def abort(self, r: _Request) -> None:
        r.finish_reason = "abort"
        self.running.remove(r)

    def metrics_snapshot(self) -> dict:
        return {"accept_length": {"histogram": {}}}


def test_turns_steps_and_a_requests_first_ids_are_counted_once(tmp_path, monkeypatch):
    path = tmp_path / "core.json"
    monkeypatch.setenv(CORE_TIMES_ENV, str(path))
    http, core_end = socket_pair()
    core_end.setblocking(False)
    core = EngineCore(_Engine(), core_end)
    core._apply(core.peers[0], ("add", [(1, [5, 6], {"max_new_tokens": 3}, None),
                         (2, [5], {"max_new_tokens": 3}, None)]))
    core._apply(core.peers[0], ("abort", [2]))  # ends before its hand-over: its arrival is dropped
    assert set(core.times.arrived) == {1}
    for _ in range(6):
        core.turn()
    t = core.times
    assert t.counts["turns"] == 6 and t.counts["steps_mixed"] == 1
    assert t.counts["steps_decode"] == 3  # one token a step until the third
    assert t.requests["handed_over"] == 1 and t.requests["first_ids"] == 1
    assert t.requests["arrival_to_first_ids_s"] >= t.requests["arrival_to_engine_s"] >= 0
    assert t.arrived == {} and all(v >= 0 for v in t.seconds.values())
    t.write()
    saved = json.loads(path.read_text())
    assert set(saved) == {"seconds", "counts", "requests"}
    assert set(saved["seconds"]) == set(CoreTimes.PARTS)
    http.close()
    core_end.close()


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(CORE_TIMES_ENV, raising=False)
    times = CoreTimes(None)
    times.add("send", 0.0)
    times.write()  # no path: nothing, no error
    assert times.seconds["send"] > 0 and list(tmp_path.iterdir()) == []
