"""The Engine talks to its drafter through `graphdraft.runtime.drafter_protocol`, not `isinstance`."""

from __future__ import annotations

import pytest

from graphdraft.runtime.drafter import EagleDrafter
from graphdraft.runtime.drafter_protocol import check_drafter
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import ScriptedDrafter, make_models, runtime
from tests.test_engine import prompts, target_only


class _DelegatingCycleDrafter:
    """A cycle drafter that is not an `EagleDrafter` (nor a subclass): every protocol member
    forwards to one built after the Engine (the drafter needs the Engine's buffers)."""

    supports_cycle = True
    inner: EagleDrafter | None = None

    def __init__(self) -> None:
        self.cycle_calls = 0

    stats = property(lambda self: self.inner.stats if self.inner else None)
    decode_graphs = property(lambda self: self.inner.decode_graphs if self.inner else None)
    multi_step_graphs = property(lambda self: self.inner.multi_step_graphs if self.inner else None)

    def run(self, *args, **kw):
        return self.inner.run(*args, **kw)

    def capture_graphs(self, progress: bool = True) -> None:
        self.inner.capture_graphs(progress)

    def decode_hidden_buffer(self, bs):
        return self.inner.decode_hidden_buffer(bs)

    def cycle_tokens(self, rows):
        return self.inner.cycle_tokens(rows)

    def cycle_accept_lengths(self):
        return self.inner.cycle_accept_lengths()

    def draft_staged(self, bs):
        self.cycle_calls += 1
        return self.inner.draft_staged(bs)

    def reset_neutral(self) -> None:
        self.inner.reset_neutral()


def test_a_cycle_drafter_that_is_not_an_eagle_drafter_runs_inside_the_cycle():
    target, head = make_models(3)
    ps = prompts(5, 3)
    cfg = runtime(speculative_num_steps=3)
    ref = Engine(target, cfg, head)
    expected = ref.generate(ps, SamplingParams(max_new_tokens=10))
    proxy = _DelegatingCycleDrafter()
    eng = Engine(target, cfg, drafter=proxy)
    proxy.inner = EagleDrafter(head, eng.cfg, req_to_page=eng.pages.req_to_page,
                               input_buffers=eng.inputs, runtime_states=eng.states,
                               graph_pool=eng.graph_pool)
    assert eng.generate(ps, SamplingParams(max_new_tokens=10)) == expected
    assert eng.stats.mean_accept_length == ref.stats.mean_accept_length
    assert proxy.cycle_calls == eng.graph_summary()["spec_cycle"][1] > 0  # drafted in the cycle
    assert "draft_decode" in eng.graph_summary()  # its graphs are reported
    assert proxy.inner.stats.decode_calls == ref.drafter.stats.decode_calls


def test_a_drafter_without_the_cycle_runs_eagerly_and_stays_exact():
    target, _ = make_models(3)
    ps = prompts(7, 3)
    cfg = runtime(speculative_num_steps=3)
    expected = target_only(target, cfg, ps, 12)
    eng = Engine(target, cfg, drafter=ScriptedDrafter.__new__(ScriptedDrafter))
    eng.drafter.__init__(eng, "oracle", seed=3,
                         expected={tuple(p): p + e for p, e in zip(ps, expected, strict=True)})
    assert check_drafter(eng.drafter) is eng.drafter
    assert eng.generate(ps, SamplingParams(max_new_tokens=12)) == expected
    assert eng.stats.mean_accept_length > 3.5  # the oracle's drafts were used
    assert eng.drafter.stats.calls == eng.drafter.calls > 0
    assert "draft_decode" not in eng.graph_summary()


class _NoRun:
    supports_cycle = False
    stats = None

    def capture_graphs(self, progress=True):
        pass

    def decode_hidden_buffer(self, bs):
        return None


class _HalfCycle(ScriptedDrafter):
    supports_cycle = True  # claims the cycle seam without its members


@pytest.mark.parametrize("bad, missing", [
    (_NoRun(), "lacks run"),
    (object(), "lacks run, capture_graphs, decode_hidden_buffer, stats, supports_cycle"),
    (_HalfCycle.__new__(_HalfCycle), "CycleDrafter protocol (graphdraft.runtime.drafter_protocol), "
     "_HalfCycle lacks cycle_tokens, cycle_accept_lengths, draft_staged, reset_neutral, "
     "decode_graphs, multi_step_graphs"),
])
def test_an_object_missing_protocol_members_is_rejected_naming_drafter(bad, missing):
    target, _ = make_models(3)
    target.set_kernels(target.kernels.with_backend("triton"))  # the Engine would set its own
    with pytest.raises(ValueError, match="^drafter: expected an object meeting the ") as e:
        Engine(target, runtime(), drafter=bad)
    assert missing in str(e.value)
    assert all(m.use_triton for m in target.modules() if hasattr(m, "use_triton"))  # unchanged
    with pytest.raises(ValueError, match="^drafter: "):
        check_drafter(bad)


def test_supports_cycle_must_be_a_bool():
    class Truthy(ScriptedDrafter):
        supports_cycle = 1

    with pytest.raises(ValueError, match="^drafter: expected supports_cycle to be a bool"):
        check_drafter(Truthy.__new__(Truthy))
