"""The deferred draft KV in the cycle graph (issue #42): on the GPU, CUDA graphs captured, an
engine that defers the k = 0 cycles' draft KV (`deferred_draft_kv` 4: stretches past a full
ring, resumes, joins) equals, after every step, its eager twin bit for bit on every state
tensor (draft KV included; the ring by its counters: the graph path runs the eager code), and
equals an engine that runs the KV-only step in every k = 0 cycle in its drafts and tokens
(draft KV to the matmul's rounding) and greedy target-only in its output; the rebuild is
replayed from its graph, never run eagerly.

Run on the GPU machine with `make test-gpu` (or `pytest -m gpu tests/test_useless_draft_gpu.py`).
"""

from __future__ import annotations

import pytest
import torch

from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime
from tests.test_cycle_gpu import _state
from tests.test_engine import prompts, target_only
from tests.test_policy_engine import ForcedPolicy, _draft_kv_rows
from tests.test_useless_draft import JOINS, KS, NEW

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(target, head, deferred: int, **kw) -> Engine:
    cfg = runtime(device="cuda", dtype="float32", speculative_policy="adaptive",
                  deferred_draft_kv=deferred, max_context_len=64, cuda_graph_bs=(1, 2, 4, 8),
                  cuda_graph_max_bs=8, max_running_requests=8, **kw)
    eng = Engine(target, cfg, head, seed=3)
    eng.capture_graphs(progress=False)
    eng.set_policy(ForcedPolicy(KS))
    return eng


def test_deferred_draft_kv_in_the_cycle_graph():
    target, head = make_models(7, dtype=torch.float32, device="cuda", draft_vocab=40)
    ps = prompts(19, len(NEW), lo=4, hi=12)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in NEW]
    graph, eager = _engine(target, head, 4), _engine(target, head, 4, enforce_eager=True)
    always = _engine(target, head, 0)
    engines = (graph, eager, always)
    reqs = ([], [], [])
    step, compared = 0, 0
    while step in JOINS or any(e.has_work for e in engines):
        for eng, rs in zip(engines, reqs, strict=True):
            for j in JOINS.get(step, []):
                rs.append(eng.add_request(ps[j], params[j]))
            eng.step()
        torch.cuda.synchronize()
        a, b = _state(graph), _state(eager)
        for k in a:
            assert torch.equal(a[k], b[k]), (step, k)
        # the ring's live entries sit in other columns (capture warm-ups moved the graph
        # engine's column) and its inert rows hold dummy-page values: its counters compared
        assert torch.equal(graph.mode.deferred.host, eager.mode.deferred.host), step
        if graph.mode.deferred.pending == 0:
            for x, y in zip(reqs[0], reqs[2], strict=True):
                if x.slot is None or x.finished:
                    continue
                n = int(graph.states.valid_cache_lengths[x.slot])
                torch.testing.assert_close(_draft_kv_rows(graph, x.slot, n),
                                           _draft_kv_rows(always, y.slot, n),
                                           rtol=1e-4, atol=1e-4, msg=f"step {step}")
            assert torch.equal(graph.slots.drafts, always.slots.drafts), step
            compared += 1
        step += 1
    outs = [[r.output for r in rs] for rs in reqs]
    assert outs[0] == outs[1] == outs[2] and compared >= 8
    want = {tuple(p): target_only(target, runtime(device="cuda", dtype="float32"), [p],
                                  m.max_new_tokens)[0] for p, m in zip(ps, params, strict=True)}
    assert outs[0] == [want[tuple(p)] for p in ps]
    rebuild = graph.graph_registry.get("draft_kv_rebuild")
    assert rebuild.stats.total_replays >= 5 and rebuild.stats.total_eager == 0
    cycles = graph.graph_registry.family("spec_cycle")
    assert all(f.stats.total_eager == 0 for f in cycles.values())
