"""The engine core's admission grouping (`engine_core.admit_now`, `--admission-group`): the
rule's table, and an `EngineCore` over the shipped pair on the CPU driven turn by turn through
its socket: a request arriving while the Engine only decodes waits at most as many decode steps
as a mixed step costs (`EngineCore.hold_steps`, measured; one step when set so),
enough arrivals (or a step that prefills anyway) go at once, a held request can be aborted,
and the held requests' outputs equal the Engine's own."""

from __future__ import annotations

import pytest

from graphdraft.serving.openai_api import engine_core
from graphdraft.serving.openai_api.engine_core import (
    ADMISSION_GROUP_DEFAULT,
    EngineCore,
    admit_now,
)
from graphdraft.serving.openai_api.wire import FrameReader, Outbox, socket_pair
from graphdraft.serving.verify import SamplingParams


def test_admit_now_rule():
    # held, waited steps, running, mixed anyway, D
    assert admit_now(1, 0, 8, False, 0)            # D = 0: never held
    assert admit_now(1, 0, 0, False, 4)            # nothing runs: no decode step to wait behind
    assert admit_now(1, 0, 8, True, 4)             # the next step prefills anyway
    assert admit_now(1, 1, 8, False, 4)            # waited one step: never longer
    assert not admit_now(1, 0, 8, False, 4)        # 1 < ceil(8 / 4)
    assert admit_now(2, 0, 8, False, 4)            # 2 >= ceil(8 / 4)
    assert not admit_now(3, 0, 33, False, 4)       # ceil(33 / 4) = 9
    assert admit_now(9, 0, 33, False, 4)
    assert admit_now(1, 0, 7, False, 8)            # ceil(7 / 8) = 1
    with pytest.raises(ValueError, match="admission_group"):
        admit_now(1, 0, 1, False, -1)


def test_serve_flag_default_is_the_core_default():
    from graphdraft.serving.cli import build_parser
    from graphdraft.serving.cli.serve import ADMISSION_GROUP_DEFAULT as CLI_DEFAULT
    assert CLI_DEFAULT == ADMISSION_GROUP_DEFAULT
    assert build_parser().parse_args(["serve"]).admission_group == ADMISSION_GROUP_DEFAULT
    assert build_parser().parse_args(["serve", "--admission-group", "0"]).admission_group == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--admission-group", "-1"])


@pytest.fixture(scope="module")
def engine():
    from graphdraft.serving.cli import build_parser
    from graphdraft.serving.cli.serve import build_engine
    e, _ = build_engine(build_parser().parse_args(["serve", "--device", "cpu", "--quiet"]))
    return e


class Client:
    """The HTTP process's end of the socket: sends commands, gathers every output."""

    def __init__(self, sock) -> None:
        sock.setblocking(False)
        self.reader, self.outbox = FrameReader(sock), Outbox(sock)
        self.ids: dict[int, list[int]] = {}
        self.finish: dict[int, str] = {}

    def add(self, *items: tuple[int, list[int]], max_tokens: int = 6) -> None:
        fields = {"max_new_tokens": max_tokens, "ignore_eos": True}
        self.outbox.put(("add", [(rid, prompt, fields, None) for rid, prompt in items]))
        assert self.outbox.flush()

    def abort(self, rid: int) -> None:
        self.outbox.put(("abort", [rid]))
        assert self.outbox.flush()

    def read(self) -> None:
        for m in self.reader.read():
            if m[0] == "out":
                for rid, ids, fin, *_ in m[1]:
                    self.ids.setdefault(rid, []).extend(ids)
                    if fin is not None:
                        self.finish[rid] = fin


PROMPTS = {i: [ord(ch) for ch in f"def f{i}(x):\n    return x"] for i in range(9)}


def test_held_requests_wait_at_most_one_decode_step(engine, monkeypatch):
    http, theirs = socket_pair()
    theirs.setblocking(False)
    core, client = EngineCore(engine, theirs, admission_group=2), Client(http)
    monkeypatch.setattr(engine_core, "STEP_COST_EMA", 0.0)  # the step costs stay as set
    core.step_cost = {"mixed": 1.0, "decode": 1.0}  # a mixed step costs one decode step
    client.add(*[(i, PROMPTS[i]) for i in range(4)], max_tokens=24)  # running throughout
    core.turn()  # nothing ran: all four go to the Engine at once, in one prefill step
    assert not core.held and len(engine.running) == 4
    while any(r.prefilling for r in engine.running) or engine.waiting:
        core.turn()
    core.turn()
    prefilled = engine.stats.prefill_tokens
    client.add((4, PROMPTS[4]))  # 1 < ceil(4 / 2): held for one decode step
    core.turn()
    assert list(core.held) == [4] and engine.stats.prefill_tokens == prefilled
    assert core.state()["waiting"] == 1
    core.turn()  # waited one step: admitted, prefilled in this turn's step
    assert not core.held and engine.stats.prefill_tokens > prefilled
    while any(r.prefilling for r in engine.running) or engine.waiting:
        core.turn()
    client.add((5, PROMPTS[5]))
    core.turn()
    assert list(core.held) == [5]
    client.abort(5)  # a held request aborts without reaching the Engine
    assert len(engine.running) == 5
    client.add((6, PROMPTS[6]), (7, PROMPTS[7]), (8, PROMPTS[8]))  # 3 >= ceil(5 / 2)
    core.turn()
    assert not core.held and set(core.live) >= {6, 7, 8} and 5 not in core.live
    while engine.has_work or core.held:
        core.turn()
    client.read()
    served = [i for i in range(9) if i != 5]
    assert client.finish == dict.fromkeys(served, "length") | {5: "abort"}
    assert client.ids[5] == [] and all(len(client.ids[i]) == 6 for i in (4, 6, 7, 8))
    want = engine.generate([PROMPTS[i] for i in served],
                           SamplingParams(max_new_tokens=6, ignore_eos=True))
    for i, w in zip(served, want, strict=True):
        assert client.ids[i][:6] == w, i
    assert engine.pages.num_free_pages == engine.pages.num_pages - 1
    http.close()
    theirs.close()


def test_hold_steps_follow_the_measured_step_costs(engine, monkeypatch):
    """A held request waits as many decode steps as a mixed step costs (rounded, 1..8)."""
    http, theirs = socket_pair()
    theirs.setblocking(False)
    core, client = EngineCore(engine, theirs, admission_group=8), Client(http)
    assert core.hold_steps == 1  # nothing measured yet
    client.add(*[(i, PROMPTS[i]) for i in range(4)], max_tokens=120)  # running throughout
    while not core.live or any(r.prefilling for r in engine.running) or engine.waiting:
        core.turn()
    core.turn()
    assert core.step_cost["mixed"] > 0 and core.step_cost["decode"] > 0  # measured here
    monkeypatch.setattr(engine_core, "STEP_COST_EMA", 0.0)
    for mixed, want in ((100.0, engine_core.MAX_HOLD_STEPS), (0.4, 1), (2.6, 3)):
        core.step_cost = {"mixed": mixed, "decode": 1.0}
        assert core.hold_steps == want
    prefilled = engine.stats.prefill_tokens
    client.add((4, PROMPTS[4]), max_tokens=120)  # 1 >= ceil(4 / 8): at once
    core.turn()
    assert not core.held and engine.stats.prefill_tokens > prefilled
    while any(r.prefilling for r in engine.running) or engine.waiting:
        core.turn()
    core.admission_group = 2  # ceil(5 / 2) = 3 needed to start at once
    client.add((5, PROMPTS[5]), max_tokens=120)
    held_turns = 0
    while core.held or 5 not in core.live:
        core.turn()
        held_turns += bool(core.held)
    assert held_turns == 3  # held three decode steps (2.6 rounds to 3), then admitted
    while engine.has_work or core.held:
        core.turn()
    client.read()
    assert all(client.finish[i] == "length" for i in range(6))
    assert engine.pages.num_free_pages == engine.pages.num_pages - 1
    with pytest.raises(ValueError, match="hold_steps"):
        engine_core.admit_now(1, 0, 1, False, 2, 0)
    http.close()
    theirs.close()


def test_group_zero_admits_each_request_at_once(engine):
    http, theirs = socket_pair()
    theirs.setblocking(False)
    core, client = EngineCore(engine, theirs, admission_group=0), Client(http)
    client.add((0, PROMPTS[0]))
    core.turn()
    while any(r.prefilling for r in engine.running) or engine.waiting:
        core.turn()
    client.add((1, PROMPTS[1]))
    core.turn()
    assert not core.held and 1 in core.live
    while engine.has_work:
        core.turn()
    client.read()
    assert client.finish == {0: "length", 1: "length"}
    with pytest.raises(ValueError, match="admission_group"):
        EngineCore(engine, theirs, admission_group=-2)
    http.close()
    theirs.close()
