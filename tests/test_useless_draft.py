"""The deferred draft KV of k = 0 cycles (`runtime/deferred_kv.py`, issue #42's useless draft):
a k = 0 cycle runs no draft forward at all (its KV-only step's inputs are kept), and when
drafting resumes (a k > 0 cycle, a prefill / mixed step) or the ring is full, the kept
positions' draft KV is written: the same draft KV (up to the matmul's rounding: the rebuild
runs `store_kv` over bs * P rows at once), the same drafts and the same tokens as an engine
that runs the KV-only step in every k = 0 cycle, with joins and leaves; greedy output equals
target-only. CPU, eager, float32 and float64."""

from __future__ import annotations

import pytest
import torch

from graphdraft.runtime.deferred_kv import DeferredDraftKV
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime
from tests.test_engine import prompts, target_only
from tests.test_policy_engine import ForcedPolicy, _draft_kv_rows

P = 4  # ring columns: the k = 0 stretches below run past it (rebuilds of a full ring)
# k = 0 stretches of 3 (< P), 9 (two full rings), 4 (exactly P), then resumes of k = 1 / 3
KS = [3, 0, 0, 0, 1, 3] + [0] * 9 + [3, 1] + [0] * 4 + [1, 3] + [0] * 2 + [3] * 200
JOINS = {0: [0, 1], 3: [2], 8: [3]}  # mixed steps in and after stretches
NEW = (26, 20, 24, 16)  # max_new_tokens of the prompts


def _engine(target, head, deferred: int, dtype: str) -> Engine:
    cfg = runtime(dtype=dtype, speculative_policy="adaptive", deferred_draft_kv=deferred,
                  max_context_len=64)
    eng = Engine(target, cfg, head)
    eng.set_policy(ForcedPolicy(KS))
    return eng


def _live_draft_kv(eng: Engine, reqs) -> dict[int, torch.Tensor]:
    """Draft KV of every committed position of each running request, by request index."""
    return {i: _draft_kv_rows(eng, r.slot, int(eng.states.valid_cache_lengths[r.slot]))
            for i, r in enumerate(reqs) if r.slot is not None and not r.finished}


def _lockstep(deferred_engine: Engine, always_engine: Engine, ps, params, tol: float):
    """Step both engines together; after every step on which the deferred engine's ring is
    empty (its draft KV whole), compare every live request's draft KV; compare drafts and
    outputs at the end. Returns (outputs, steps compared, rebuilds seen)."""
    reqs = ([], [])
    compared, step = 0, 0
    ring = deferred_engine.mode.deferred
    while step in JOINS or deferred_engine.has_work or always_engine.has_work:
        for eng, rs in zip((deferred_engine, always_engine), reqs, strict=True):
            for j in JOINS.get(step, []):
                rs.append(eng.add_request(ps[j], params[j]))
            eng.step()
        if ring.pending == 0:
            a, b = _live_draft_kv(deferred_engine, reqs[0]), _live_draft_kv(always_engine, reqs[1])
            assert a.keys() == b.keys(), step
            for i in a:
                torch.testing.assert_close(a[i], b[i], rtol=tol, atol=tol, msg=f"step {step} req {i}")
            assert torch.equal(deferred_engine.slots.drafts, always_engine.slots.drafts), step
            compared += 1
        step += 1
    outs = [[r.output for r in rs] for rs in reqs]
    assert outs[0] == outs[1]
    return outs[0], compared


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-5),
                                       pytest.param("float64", 1e-12, marks=pytest.mark.slow)])
def test_skip_then_resume_equals_kv_only_step_every_cycle(dtype, tol):
    target, head = make_models(7, dtype=getattr(torch, dtype), draft_vocab=40)
    ps = prompts(19, len(NEW), lo=4, hi=12)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in NEW]
    deferred, always = _engine(target, head, P, dtype), _engine(target, head, 0, dtype)
    calls = {"store_kv": 0}
    skv = head.store_kv

    def counting(*a, **kw):
        calls["store_kv"] += 1
        return skv(*a, **kw)

    rebuild = deferred.graph_registry.get("draft_kv_rebuild")
    assert rebuild is not None and always.graph_registry.get("draft_kv_rebuild") is None
    outs, compared = _lockstep(deferred, always, ps, params, tol)
    assert compared >= 8
    assert sum(rebuild.stats.eager.values()) >= 5  # full rings, resumes, mixed steps
    # k = 0 cycles of the deferred engine call no head function at all
    head.store_kv = counting
    try:
        eng = _engine(target, head, P, dtype)
        eng.set_policy(ForcedPolicy([3] + [0] * 3 + [3]))
        eng.add_request(ps[0], SamplingParams(max_new_tokens=30))
        eng.step()  # prefill (no k = 0 yet)
        eng.step()  # k = 3
        eng.drain()
        before = calls["store_kv"]
        for _ in range(3):
            eng.step()  # k = 0: stashed, no store_kv
        eng.drain()
        assert calls["store_kv"] == before and eng.mode.deferred.pending == 3
        eng.step()  # k = 3: one rebuild (one store_kv over bs * P rows), then the cycle
        eng.drain()
        assert calls["store_kv"] == before + 1 and eng.mode.deferred.pending == 0
    finally:
        del head.store_kv
    if dtype == "float32":  # greedy speculative output == target-only (the verify decides)
        cfg = runtime(dtype=dtype)
        want = {tuple(p): target_only(target, cfg, [p], m.max_new_tokens)[0]
                for p, m in zip(ps, params, strict=True)}
        assert outs == [want[tuple(p)] for p in ps[: len(outs)]]


def test_kept_positions_have_no_draft_kv_until_the_rebuild():
    """The skip is real: during a k = 0 stretch the kept positions' draft KV is not written
    (their slots still hold what the last k = 3 cycle's draft steps left there, for the
    drafts it verified); the first k > 0 cycle writes it before its draft step, equal to the
    KV-only step's."""
    target, head = make_models(3, dtype=torch.float64)
    ps = prompts(5, 1, lo=6, hi=6)
    engines = []
    for d in (P, 0):
        eng = Engine(target, runtime(speculative_policy="adaptive", deferred_draft_kv=d), head)
        eng.set_policy(ForcedPolicy([3, 0, 0, 0, 3, 3]))
        engines.append((eng, eng.add_request(ps[0], SamplingParams(max_new_tokens=40))))
    for _ in range(2):  # prefill, k = 3
        for eng, _ in engines:
            eng.step()
    for eng, _ in engines:
        eng.drain()
    (d, rd), (a, ra) = engines
    start = int(d.states.valid_cache_lengths[rd.slot])
    for _ in range(3):  # k = 0 x 3
        for eng, _ in engines:
            eng.step()
    for eng, _ in engines:
        eng.drain()
    end = int(d.states.valid_cache_lengths[rd.slot])
    assert end == start + 3 and d.mode.deferred.pending == 3
    kept_d = _draft_kv_rows(d, rd.slot, end)[:, start - 1: end - 1]  # positions stashed
    kept_a = _draft_kv_rows(a, ra.slot, end)[:, start - 1: end - 1]
    assert kept_a.abs().sum(-1).min() > 0 and not torch.allclose(kept_d, kept_a)
    for eng, _ in engines:
        eng.step()  # k = 3: rebuild, then the cycle
        eng.drain()
    torch.testing.assert_close(_draft_kv_rows(d, rd.slot, end), _draft_kv_rows(a, ra.slot, end),
                               rtol=1e-12, atol=1e-12)
    assert rd.output == ra.output


def test_state_snapshot_carries_the_ring():
    """`state_snapshot` / `restore_state` carry the ring's device tables and its host
    counters, so a restored engine rebuilds what it had kept (perf/policy.py's cells)."""
    target, head = make_models(2, dtype=torch.float64)
    eng = Engine(target, runtime(speculative_policy="adaptive", deferred_draft_kv=P), head)
    eng.set_policy(ForcedPolicy([3, 0, 0, 3, 0]))
    eng.add_request(prompts(1, 1)[0], SamplingParams(max_new_tokens=30))
    for _ in range(4):
        eng.step()  # prefill, k = 3, k = 0, k = 0
    eng.drain()
    ring = eng.mode.deferred
    snap = eng.state_snapshot()
    assert ring.pending == 2 and int(snap["deferred_kv.host"][0]) == 2
    kept = ring.tokens.clone()
    eng.step()  # k = 3: rebuilt
    eng.drain()
    assert ring.pending == 0 and int(ring.tokens[2].abs().sum()) == 0
    eng.restore_state(snap)
    assert ring.pending == 2 and torch.equal(ring.tokens, kept)


def test_deferred_draft_kv_config_and_ring_bad_input():
    for bad in (-1, 65, True, 2.0, None):
        with pytest.raises(ValueError, match="deferred_draft_kv: expected an int in"):
            runtime(deferred_draft_kv=bad)
    target, head = make_models(2)
    fixed = Engine(target, runtime(), head)  # fixed policy: no k = 0 cycle, no ring
    assert fixed.mode.deferred is None and fixed.graph_registry.get("draft_kv_rebuild") is None
    with pytest.raises(ValueError, match="columns: expected an int >= 1"):
        DeferredDraftKV(4, 0, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="columns: expected <= 64"):
        DeferredDraftKV(4, 65, 8, torch.float32, "cpu")
    ring = DeferredDraftKV(2, 2, 8, torch.float32, "cpu")
    ring.stashed(2)
    ring.stashed(1)
    assert ring.full and ring.rows == 2
    with pytest.raises(ValueError, match="full ring"):
        ring.stashed(2)
    eng = Engine(target, runtime(speculative_policy="adaptive"), head)
    with pytest.raises(ValueError, match="already has a deferred"):
        eng.drafter.defer_kv(4)
