"""Serving metrics: the recorder's arithmetic, and the Engine feeding it; generate is atomic."""

from __future__ import annotations

import pytest

from graphdraft.serving.engine import Engine
from graphdraft.serving.metrics import ServingMetrics
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime


def test_recorder_latencies_and_histogram():
    m = ServingMetrics()
    m.on_request_added(0, 10.0)
    m.on_request_added(1, 10.5)
    m.on_tokens(0, 1, 11.0)          # ttft 1.0
    m.on_tokens(1, 2, 12.5)          # ttft 2.0
    m.on_tokens(0, 4, 13.0)          # itl (13 - 11) / 4 = 0.5
    m.on_tokens(0, 0, 14.0)          # nothing emitted: ignored
    for a in (1, 4, 4, 2):
        m.on_decode_accept(a)
    m.on_request_finished(0)
    snap = m.snapshot()
    assert snap["requests"] == 1 and snap["output_tokens"] == 7
    assert snap["ttft_s"]["count"] == 2 and snap["ttft_s"]["mean"] == pytest.approx(1.5)
    assert snap["itl_s"]["p50"] == pytest.approx(0.5)
    assert snap["tokens_per_s"] == pytest.approx(7 / 3.0)
    assert snap["accept_length"] == {"mean": pytest.approx(11 / 4), "histogram": {1: 1, 2: 1, 4: 2}}


def test_engine_metrics_match_outputs():
    target, head = make_models(seed=3)
    eng = Engine(target, runtime(), head)
    outs = eng.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=9))
    snap = eng.metrics_snapshot()
    assert snap["output_tokens"] == sum(len(o) for o in outs) == 18
    assert snap["requests"] == 2 and snap["ttft_s"]["count"] == 2
    hist = snap["accept_length"]["histogram"]
    assert sum(hist.values()) == eng.stats.decode_rows
    assert sum(k * v for k, v in hist.items()) == eng.stats.accepted_tokens
    assert set(snap["graphs"]) == {"spec_cycle", "target_verify", "draft_decode", "draft_multi_step"}
    cycles = eng.graph_summary()["spec_cycle"][1]  # decode cycles: one forward each
    assert cycles > 0 and snap["graphs"]["spec_cycle"]["eager"] == {"disabled": cycles}
    assert snap["graphs"]["spec_cycle"]["hit_rate"] == 0.0  # graphs off on a CPU


def test_graph_hit_rate_counts_replays_over_all_runs():
    from capture.graphs import GraphStats
    st = GraphStats("f")
    assert ServingMetrics().snapshot([st])["graphs"]["f"]["hit_rate"] is None
    st.replays.update({1: 3, 4: 5})
    st.eager["disabled"] = 2
    g = ServingMetrics().snapshot([st])["graphs"]["f"]
    assert g["replays"] == 8 and g["replays_by_bs"] == {1: 3, 4: 5}
    assert g["eager"] == {"disabled": 2} and g["hit_rate"] == pytest.approx(0.8)


def test_generate_checks_every_prompt_before_queueing_any():
    target, head = make_models(seed=3)
    eng = Engine(target, runtime(), head)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt"):
        eng.generate([[1, 2, 3], [10_000], [4, 5]], SamplingParams(max_new_tokens=4))
    assert not eng.waiting and not eng.running
    with pytest.raises(ValueError, match="params: expected one SamplingParams per prompt"):
        eng.generate([[1, 2, 3]], [SamplingParams(), SamplingParams()])
    assert eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3)) != []
