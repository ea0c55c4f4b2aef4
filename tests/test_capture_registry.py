"""capture.GraphRegistry: keys, capture order, per-family merged statistics (CPU: eager)."""

from __future__ import annotations

import pytest
import torch

from capture import CapturedForward, GraphRegistry


def _fwd(name: str) -> CapturedForward:
    buf = torch.zeros(4)
    return CapturedForward(name, lambda bs: buf[:bs] + 1, [1, 2, 4], enabled=False)


def test_order_families_and_lookup():
    reg = GraphRegistry()
    a3, a1, b = _fwd("cycle_k3"), _fwd("cycle_k1"), _fwd("multi")
    reg.add("cycle", 3, a3)
    reg.add("multi", None, b)
    reg.add("cycle", 1, a1)
    assert reg.forwards() == [a3, b, a1]
    assert reg.families() == ["cycle", "multi"]
    assert reg.family("cycle") == {3: a3, 1: a1}
    assert reg.get("cycle", 1) is a1 and reg.get("cycle", 2) is None
    assert reg[("multi", None)] is b and ("cycle", 3) in reg and len(reg) == 3


@pytest.mark.parametrize(("family", "k", "fwd", "match"), [
    ("", 1, None, "family"), ("x", -1, None, "k must"), ("x", True, None, "k must"),
    ("x", 1, object(), "CapturedForward"),
])
def test_add_rejects_bad_arguments(family, k, fwd, match):
    reg = GraphRegistry()
    with pytest.raises(ValueError, match=match):
        reg.add(family, k, fwd if fwd is not None else _fwd("f"))
    assert len(reg) == 0


def test_duplicate_key_rejected_and_registry_unchanged():
    reg = GraphRegistry()
    f = reg.add("cycle", 3, _fwd("a"))
    with pytest.raises(ValueError, match="already registered"):
        reg.add("cycle", 3, _fwd("b"))
    assert reg.forwards() == [f]


def test_merged_stats_sum_the_family():
    reg = GraphRegistry()
    a, b, c = _fwd("a"), _fwd("b"), _fwd("c")
    reg.add("cycle", 3, a)
    reg.add("cycle", 1, b)
    reg.add("verify", None, c)
    a.run(2), a.run(3), b.run(1), c.run(4)
    summary = reg.summary()
    assert summary == {"cycle": (0, 3), "verify": (0, 1)}
    merged = {st.name: st for st in reg.merged_stats()}
    assert merged["cycle"].eager["disabled"] == 3
