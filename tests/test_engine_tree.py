"""The Engine serving tree drafting (`RuntimeConfig.speculative_eagle_topk > 1`, issue #20):
greedy output equals target-only greedy through joins, leaves, chunked prefill / mixed steps,
stop ids and max_new_tokens cut inside an accepted path; topk 1 through the new fields is the
chain bit for bit; sampled rows run and reproduce; bad configurations are rejected."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import graphdraft
from graphdraft.config import RuntimeConfig
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime

ASSETS = Path(graphdraft.__file__).resolve().parent / "assets"
# 3 running at most (so the 4th and 5th join when others leave), chunks of 24 tokens (prompts
# of 20-30 tokens prefill over two steps, beside decode rows: mixed steps)
SERVE = dict(max_running_requests=3, cuda_graph_max_bs=3, max_num_batched_tokens=24,
             max_context_len=128)
TREE = dict(speculative_eagle_topk=4, speculative_num_draft_tokens=8)


@pytest.fixture(scope="module")
def trained():
    """The shipped pair in float64: it accepts several tokens a cycle, so accepted paths,
    sibling choices and cuts inside a path all happen."""
    from graphdraft.io.checkpoint import load_model_pair
    from graphdraft.train.evaluate import prompt_ids
    target, head, _ = load_model_pair(ASSETS / "target", ASSETS / "eagle3", dtype="float64")
    prompts = [p[: 20 + 3 * i] for i, p in enumerate(prompt_ids(5, 96))]
    return target, head, prompts


def _params(max_new=(14, 9, 17, 11, 13), **kw):
    return [SamplingParams(max_new_tokens=m, **kw) for m in max_new]


def _target_only(target, prompts, params, **kw):
    return Engine(target, runtime(**SERVE, **kw), None).generate(prompts, params)


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_tree_engine_equals_target_only(trained, page_size):
    target, head, prompts = trained
    params = _params()
    ref = _target_only(target, prompts, params, page_size=page_size)
    e = Engine(target, runtime(**SERVE, **TREE, page_size=page_size), head)
    assert e.generate(prompts, params) == ref
    acc = e.metrics_snapshot()["accept_length"]
    assert acc["drafting"] == {"mode": "tree", "steps": 3, "topk": 4, "num_draft_tokens": 8}
    assert acc["mean"] > 1.5 and max(acc["histogram"]) >= 3  # the tree was walked deep
    assert max(acc["histogram"]) <= e.tree_spec.P
    assert e.stats.steps > 0 and not e.has_work
    assert e.pages.num_free_pages == e.pages.num_pages - 1  # every page came back


def _chunks(engine, prompt, params):
    """The tokens each retired step gave the request (host view), from the metrics hook."""
    sizes = []
    hook = engine.metrics.on_tokens
    engine.metrics.on_tokens = lambda rid, n, now: (sizes.append(n), hook(rid, n, now))
    try:
        out = engine.generate([prompt], params)[0]
    finally:
        engine.metrics.on_tokens = hook
    return out, sizes


def test_stop_id_and_max_new_cut_inside_the_tree(trained):
    """A stop id that the target emits in the middle of an accepted path ends the request
    there (the tokens after it are dropped), as target-only decoding does; so does
    max_new_tokens."""
    target, head, prompts = trained
    plain = _target_only(target, prompts, _params(max_new=(16,) * 5))
    e = Engine(target, runtime(**SERVE, **TREE), head)
    inside = 0
    for i, (p, out) in enumerate(zip(prompts, plain, strict=True)):
        free, sizes = _chunks(e, p, SamplingParams(max_new_tokens=16))
        assert free == out
        ends = torch.tensor(sizes).cumsum(0).tolist()
        # a stop id first emitted inside an accepted path (not at its end), else out[6]
        firsts = [j for j in range(1, 16) if out.index(out[j]) == j]
        at = next((j for j in firsts if j + 1 not in ends), out.index(out[6]))
        # the stop id and max_new_tokens cut inside paths too, as requests of one batch (each
        # row drafts and accepts as it does alone: float64 greedy, rows independent)
        cuts = [m for m in range(2, 9) if m not in ends]
        got = e.generate([p] * (1 + len(cuts)),
                         [SamplingParams(max_new_tokens=16, stop_token_ids=[out[at]])]
                         + [SamplingParams(max_new_tokens=m) for m in cuts])
        assert got[0] == out[: at + 1], i
        assert got[1:] == [out[:m] for m in cuts], i
        inside += at + 1 not in ends
    assert inside >= 1  # else this test proves little


def test_topk1_through_the_new_fields_is_the_chain_bit_for_bit():
    """speculative_eagle_topk=1 / speculative_num_draft_tokens=steps+1 given explicitly: the
    chain engine, same tokens and the same target and draft KV bytes."""
    target, head = make_models(seed=1)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    params = _params(max_new=(9, 12, 7))
    engines = [Engine(target, runtime(**kw), head) for kw in
               ({}, dict(speculative_eagle_topk=1, speculative_num_draft_tokens=4))]
    outs = [e.generate(prompts, params) for e in engines]
    assert outs[0] == outs[1]
    a, b = engines
    assert b.tree_spec is None and b.mode.name == "chain" and b.n_row == a.n_row == 4
    for la, lb in zip(a.kv.k + a.kv.v, b.kv.k + b.kv.v, strict=True):
        assert torch.equal(la, lb)
    assert torch.equal(a.drafter.kv_pool.k[0], b.drafter.kv_pool.k[0])
    assert a.stats == b.stats
    assert a.metrics_snapshot()["accept_length"]["drafting"]["mode"] == "chain"


def test_sampled_rows_run_reproduce_and_leave_greedy_rows_exact(trained):
    """Sampled requests (temperature 0.8, top-p 0.9) beside greedy ones: the greedy rows still
    equal target-only greedy (one-hot rows of the sampled cycle), sampled outputs are valid
    ids of the right length and the same seeds give the same tokens."""
    target, head, prompts = trained
    greedy = _target_only(target, prompts[:2], _params(max_new=(12, 12)))
    params = _params(max_new=(12, 12)) + [SamplingParams(max_new_tokens=12, temperature=0.8,
                                                         top_p=0.9, seed=s) for s in (1, 2, 3)]
    runs = []
    for _ in range(2):
        e = Engine(target, runtime(**SERVE, **TREE), head, seed=5)
        runs.append(e.generate(prompts, params))
    assert runs[0] == runs[1]
    assert runs[0][:2] == greedy
    vocab = target.config.vocab_size
    assert all(len(o) == 12 and all(0 <= t < vocab for t in o) for o in runs[0][2:])
    graphs = e.metrics_snapshot()["graphs"]
    assert graphs["tree_cycle_sampled"]["eager"]  # the sampled cycle ran (eagerly on the CPU)


def test_adaptive_policy_falls_back_to_fixed_under_trees(trained, caplog):
    target, head, _ = trained
    with caplog.at_level("INFO", logger="graphdraft.serving.engine"):
        e = Engine(target, runtime(**SERVE, **TREE, speculative_policy="adaptive"), head)
    assert e.steps == (3,) and e.policy.mode == "fixed"
    assert "tree drafting" in caplog.text


def test_tree_engine_rejects_what_it_cannot_serve():
    from tests.engine_harness import ScriptedDrafter
    target, head = make_models(seed=0)
    cfg = runtime(**TREE)
    with pytest.raises(ValueError, match="speculative_eagle_topk: expected 1 with a caller's"):
        Engine._check_tree(cfg, None, ScriptedDrafter.__new__(ScriptedDrafter))
    plain = Engine(target, cfg, None)  # target-only: the tree fields are unused
    assert plain.tree_spec is None and plain.n_row == 1
    with pytest.raises(ValueError, match="speculative_eagle_topk: expected 1 with dp_size"):
        Engine._check_tree(cfg.replace(dp_size=2), head, None)


@pytest.mark.parametrize("kw,match", [
    (dict(speculative_eagle_topk=0), "speculative_eagle_topk: expected an int >= 1"),
    (dict(speculative_eagle_topk=2.0), "speculative_eagle_topk: expected an int"),
    (dict(speculative_eagle_topk=True), "speculative_eagle_topk: expected an int"),
    (dict(speculative_num_draft_tokens=6), "with speculative_eagle_topk=1 .* expected "
                                           "speculative_num_steps \\+ 1 = 4"),
    (dict(speculative_eagle_topk=2, speculative_num_draft_tokens=1), "expected >= 2"),
    (dict(speculative_eagle_topk=4, speculative_num_draft_tokens=38),
     "expected <= 1 \\+ topk \\+ \\(steps-1\\)\\*topk\\^2 = 37"),
    (dict(speculative_eagle_topk=8, speculative_num_draft_tokens=65), "expected <= 64"),
    (dict(speculative_eagle_topk=2, speculative_num_draft_tokens="8"),
     "speculative_num_draft_tokens: expected an int or None"),
])
def test_bad_tree_configs_rejected_at_config_time(kw, match):
    with pytest.raises(ValueError, match=match):
        RuntimeConfig(device="cpu", **kw)


def test_tree_config_defaults_and_replace():
    c = RuntimeConfig(device="cpu")
    assert (c.speculative_eagle_topk, c.speculative_num_draft_tokens) == (1, None)
    assert c.tree_spec.n == 4 and c.tree_spec.is_chain
    assert c.replace(speculative_num_steps=5).tree_spec.n == 6  # the default follows steps
    t = c.replace(speculative_eagle_topk=4, speculative_num_draft_tokens=37)
    assert (t.tree_spec.topk, t.tree_spec.n, t.tree_spec.P) == (4, 37, 4)


def test_abort_between_cycles_leaves_the_others_exact(trained):
    """A request aborted while a cycle is in flight: its slot turns inert (done), the others
    keep target-only greedy text, and a request admitted into the freed slot starts clean."""
    target, head, prompts = trained
    ref = _target_only(target, prompts, _params())
    e = Engine(target, runtime(**SERVE, **TREE), head)
    reqs = [e.add_request(p, sp) for p, sp in zip(prompts[:3], _params()[:3], strict=True)]
    for _ in range(4):
        e.step()
    e.abort(reqs[1])
    late = e.add_request(prompts[3], _params()[3])
    while e.has_work:
        e.step()
    e.drain()
    assert reqs[1].finish_reason == "abort"
    assert [reqs[0].output, reqs[2].output, late.output] == [ref[0], ref[2], ref[3]]


def test_triton_path_under_the_interpreter_equals_target_only():
    """The tree Engine on the Triton kernels (interpreter; float32; two target layers): tree
    build / accept, KV move, commit_pack, beam attention; `capture_graphs` is a no-op off
    CUDA."""
    target, head = make_models(seed=0, dtype=torch.float32, layers=2)
    prompts, params = [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=5)
    ref = Engine(target, runtime(dtype="float32"), None).generate(prompts, params)
    e = Engine(target, runtime(speculative_eagle_topk=2, speculative_num_draft_tokens=5,
                               kernel_backend="triton", dtype="float32"), head)
    e.capture_graphs(progress=False)
    assert e.generate(prompts, params) == ref
    assert e.mode.name == "tree" and e.mode.trees.drafter.use_triton
