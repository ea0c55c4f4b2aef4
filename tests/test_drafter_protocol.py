"""The Engine talks to its drafter through `graphdraft.runtime.drafter_protocol`, not `isinstance`."""

from __future__ import annotations

import pytest

from graphdraft.runtime.drafter import EagleDrafter
from graphdraft.runtime.drafter_protocol import (
    DRAFTER_MEMBERS,
    DefersDraftKV,
    DraftBinding,
    TokenDrafter,
    check_drafter,
)
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import ScriptedDrafter, make_models, runtime
from tests.test_engine import prompts, target_only


class _DelegatingDrafter:
    """A drafter that is not an `EagleDrafter` (nor a subclass): it builds one over the
    buffers `bind` hands it and forwards every protocol member to it."""

    capturable = True
    variable_draft_length = True

    def __init__(self, head) -> None:
        self.head, self.inner, self.draft_calls = head, None, 0

    def bind(self, binding: DraftBinding) -> None:
        self.inner = EagleDrafter(self.head, binding.cfg, req_to_page=binding.req_to_page,
                                  input_buffers=binding.inputs, runtime_states=binding.states,
                                  graph_pool=binding.graph_pool, on_oom=binding.on_oom)
        self.inner.bind(binding)

    def graphs(self):
        return self.inner.graphs()

    def reset_neutral(self) -> None:
        self.inner.reset_neutral()

    def hidden_buffer(self, bs, n):
        return self.inner.hidden_buffer(bs, n)

    def accepted_tokens(self, rows, n):
        return self.inner.accepted_tokens(rows, n)

    def accept_lengths(self, rows):
        return self.inner.accept_lengths(rows)

    def draft(self, bs, k):
        self.draft_calls += 1
        return self.inner.draft(bs, k)

    def draft_mixed(self, ctx, hidden, output_tokens, accept_lengths):
        return self.inner.draft_mixed(ctx, hidden, output_tokens, accept_lengths)

    def on_cycle(self, k):
        self.inner.on_cycle(k)


def test_a_drafter_that_is_not_an_eagle_drafter_runs_inside_the_cycle():
    target, head = make_models(3)
    ps = prompts(5, 3)
    cfg = runtime(speculative_num_steps=3)
    ref = Engine(target, cfg, head)
    expected = ref.generate(ps, SamplingParams(max_new_tokens=10))
    proxy = _DelegatingDrafter(head)
    eng = Engine(target, cfg, drafter=proxy)
    assert eng.generate(ps, SamplingParams(max_new_tokens=10)) == expected
    assert eng.stats.mean_accept_length == ref.stats.mean_accept_length
    assert proxy.draft_calls == eng.graph_summary()["spec_cycle"][1] > 0  # drafted in the cycle
    assert "draft_multi_step" in eng.graph_summary()  # its graphs are registered
    assert proxy.inner.stats.decode_calls == ref.drafter.stats.decode_calls


def test_an_eagle_drafter_of_another_engine_is_rejected():
    target, head = make_models(3)
    other = Engine(target, runtime(), head)
    with pytest.raises(ValueError, match="^drafter: expected the EagleDrafter built over this"):
        Engine(target, runtime(), drafter=other.drafter)


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
    eager = eng.graph_summary()["draft_decode"]
    assert eager[0] == 0 and eager[1] > 0  # not capturable: its draft ran eagerly


class _NoRun:
    capturable = False
    variable_draft_length = False

    def __getattr__(self, name):
        if name in DRAFTER_MEMBERS[2:] and name != "draft_mixed":
            return lambda *a, **kw: None
        raise AttributeError(name)


@pytest.mark.parametrize("bad, missing", [
    (_NoRun(), "lacks draft_mixed"),
    (object(), "lacks " + ", ".join(DRAFTER_MEMBERS)),
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


@pytest.mark.parametrize("flag", ["capturable", "variable_draft_length"])
def test_the_protocol_flags_must_be_bools(flag):
    class Truthy(ScriptedDrafter):
        pass

    setattr(Truthy, flag, 1)
    with pytest.raises(ValueError, match=f"^drafter: expected {flag} to be a bool"):
        check_drafter(Truthy.__new__(Truthy))


def test_deferring_the_draft_kv_is_a_typed_capability():
    """The chain cycle defers the k = 0 draft KV only for a drafter meeting `DefersDraftKV`
    (the EagleDrafter), not for one that reads no hidden state."""
    assert all(callable(getattr(EagleDrafter, m)) for m in ("defer_kv", "rebuild_deferred_kv"))
    assert issubclass(EagleDrafter, DefersDraftKV)
    assert not isinstance(TokenDrafter(), DefersDraftKV)
    assert not isinstance(ScriptedDrafter.__new__(ScriptedDrafter), DefersDraftKV)
