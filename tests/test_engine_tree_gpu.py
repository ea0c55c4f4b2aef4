"""The Engine's tree cycle on the GPU (Triton path, bf16): the captured tree cycle graphs give
what the same functions give eagerly, bit for bit (tokens, accept histogram, target KV of the
live requests' pages), at two padded batch sizes (bs 1 and bs 3 -> padded 4, between captured
sizes), greedy and sampled rows, chunked prefill / mixed steps included (eager in both).

Run on the GPU machine with `make test-gpu` (or `pytest -m gpu tests/test_engine_tree_gpu.py`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import graphdraft
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import runtime

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ASSETS = Path(graphdraft.__file__).resolve().parent / "assets"


@pytest.fixture(scope="module")
def pair():
    from graphdraft.io.checkpoint import load_model_pair
    from graphdraft.train.evaluate import prompt_ids
    target, head, _ = load_model_pair(ASSETS / "target", ASSETS / "eagle3", dtype="bfloat16",
                                      device="cuda")
    return target, head, [p[: 20 + 5 * i] for i, p in enumerate(prompt_ids(3, 96))]


def _engine(target, head, eager: bool, spec: dict) -> Engine:
    cfg = runtime(dtype="bfloat16", device="cuda", max_running_requests=8, cuda_graph_max_bs=8,
                  cuda_graph_bs=(1, 2, 4, 8), max_context_len=256, max_num_batched_tokens=32,
                  page_size=16, enforce_eager=eager, **spec)
    e = Engine(target, head=head, cfg=cfg, seed=3)
    e.capture_graphs(progress=False)
    return e


def _serve(e: Engine, prompts, params):
    out = e.generate(prompts, params)
    torch.cuda.synchronize()
    return out, dict(e.metrics.accept_hist)


@pytest.mark.parametrize("spec", [dict(speculative_eagle_topk=4, speculative_num_draft_tokens=8),
                                  dict(speculative_num_steps=4, speculative_eagle_topk=2,
                                       speculative_num_draft_tokens=7)])
def test_tree_engine_graph_equals_eager(pair, spec):
    target, head, prompts = pair
    engines = [_engine(target, head, eager, spec) for eager in (True, False)]
    greedy = [SamplingParams(max_new_tokens=24)]
    mixed = [SamplingParams(max_new_tokens=24),
             SamplingParams(max_new_tokens=20, temperature=0.7, seed=11),
             SamplingParams(max_new_tokens=17, stop_token_ids=[32])]
    runs = []
    for e in engines:
        one = _serve(e, prompts[:1], greedy)          # padded bs 1
        three = _serve(e, prompts, mixed)             # bs 3 -> padded 4
        runs.append((one, three))
    assert runs[0] == runs[1]
    eager, graph = (e.metrics_snapshot()["graphs"] for e in engines)
    assert graph["tree_cycle"]["replays_by_bs"].get(1, 0) > 0
    assert graph["tree_cycle_sampled"]["replays_by_bs"].get(4, 0) > 0
    assert eager["tree_cycle"]["replays"] == 0
    assert max(runs[1][0][1]) >= 3  # paths were accepted deep (bf16 shipped pair)
