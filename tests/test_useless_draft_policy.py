"""The adaptive policy with a useless head (issue #42): at zero acceptance it settles on k = 0
within the cycles its docstring states, then probes at most `probe_budget` of the time (the
probe schedule priced at alpha's lower bound), and returns to k > 0 when acceptance
recovers. Host arithmetic only, driven as the Engine drives it: decisions per padded bs,
accept lengths observed one step late, a cycle after a k = 0 cycle verifies filler (its
observation carries no drafts)."""

from __future__ import annotations

import math

import pytest

from graphdraft.serving.policy import SpeculationPolicy

# cycle costs (ms) of an 8B-like shape: k = 1 costs r = 1.05 / 1.1 / 1.3 / 2.0 x k = 0
COSTS = {(1, 0): 4.0, (1, 1): 4.2, (1, 3): 4.5,
         (8, 0): 4.2, (8, 1): 4.62, (8, 3): 5.2,
         (64, 0): 5.0, (64, 1): 6.5, (64, 3): 9.0,
         (256, 0): 12.0, (256, 1): 24.0, (256, 3): 40.0}


class Loop:
    """The Engine's loop around a policy: `decide`, then the previous cycle's observation."""

    def __init__(self, policy: SpeculationPolicy, bs: int) -> None:
        self.policy, self.bs = policy, bs
        self.ready = 3  # drafts the rows hold (after prefill: a full draft)
        self.late = None  # (k really drafted, accept length) of the cycle in flight
        self.ks: list[int] = []
        self.observed = 0  # observations with drafts (k > 0 really verified)

    def step(self, accept_of) -> int:
        k = self.policy.decide(self.bs)
        real = min(k, self.ready)
        self.ready = k
        if self.late is not None:
            kr, a = self.late
            self.policy.observe([a] * self.bs, kr)
            self.observed += kr > 0
        self.late = (real, min(accept_of(real), real + 1))
        self.ks.append(k)
        return k


def useless(k: int) -> int:
    return 1


def perfect(k: int) -> int:
    return k + 1


@pytest.mark.parametrize("bs,settle", [(1, 20), (8, 3), (64, 1), (256, 1)])
def test_settles_on_k0_within_the_stated_cycles(bs, settle):
    """Docstring: at zero acceptance k = 0 from the 20th observed cycle on at bs 1 (cost
    ratio >= 1.05), the 3rd at bs 8: the policy's own choice (`current`) is 0 at the latest
    once that many cycles were observed, and every later k > 0 is a probe."""
    pol = SpeculationPolicy("adaptive", 3, COSTS)
    loop = Loop(pol, bs)
    for _ in range(400):
        seen = loop.observed  # observations the next decision sees
        loop.step(useless)
        if pol.stats()["current"].get(bs) == 0:
            break
    assert pol.stats()["current"][bs] == 0 and seen <= settle, (bs, loop.ks)
    settled_at = len(loop.ks)
    probes, switches = pol.stats()["probes"], pol.stats()["switches"].get(bs, 0)
    ks = [loop.step(useless) for _ in range(400)]
    assert ks.count(1) == 2 * (pol.stats()["probes"] - probes) and 3 not in ks
    assert pol.stats()["switches"].get(bs, 0) == switches  # settled, never left
    assert settled_at <= settle + 2  # decisions: an observation arrives two decisions late


@pytest.mark.parametrize("bs", [1, 8, 64, 256])
def test_probes_cost_at_most_the_budget_at_zero_acceptance(bs):
    """After settling, probes (2 cycles of k = 1, every `probe_interval` decisions) lose at
    most `probe_budget` (0.3 %) of the target-only time; the interval is the worst case's
    max(16, ceil(2 (r - 1) / budget)) once alpha's lower bound has fallen to 0."""
    pol = SpeculationPolicy("adaptive", 3, COSTS)
    loop = Loop(pol, bs)
    for _ in range(200):
        loop.step(useless)
    r = COSTS[(bs, 1)] / COSTS[(bs, 0)]
    want = max(16, math.ceil(2 * (r - 1) / 0.003 - 1e-9))
    assert pol.probe_interval(bs) >= 0.9 * want  # the point estimate's would be 16 at bs 1
    ks = [loop.step(useless) for _ in range(6000)]
    assert set(ks) <= {0, 1}
    time = sum(COSTS[(bs, k)] for k in ks)
    lost = time / (len(ks) * COSTS[(bs, 0)]) - 1.0  # tokens are one a row a cycle either way
    assert lost <= 0.003 + 2 * (r - 1) / len(ks), (bs, lost, pol.stats()["probes"])
    assert pol.stats()["probes"] >= 6000 // (want + 2) - 1  # it still probes


@pytest.mark.parametrize("bs", [1, 8, 64, 256])
def test_returns_to_speculation_when_acceptance_recovers(bs):
    """A long useless stretch, then every draft matches: the next probe sees it and the
    policy speculates again (k = 3 soon after) within one probe interval and a few cycles."""
    pol = SpeculationPolicy("adaptive", 3, COSTS)
    loop = Loop(pol, bs)
    for _ in range(3000):
        loop.step(useless)
    want = max(16, math.ceil(2 * (COSTS[(bs, 1)] / COSTS[(bs, 0)] - 1) / 0.003))
    assert loop.ks[-200:].count(0) >= 200 - 2 * (200 // (0.9 * want) + 1)
    wait = pol.probe_interval(bs) + 8
    ks = [loop.step(perfect) for _ in range(wait + 20)]
    assert 3 in ks[: wait + 10], (bs, ks)
    assert ks[-10:] == [3] * 10
    assert pol.stats()["current"][bs] == 3
