"""The tree cycle on the GPU (Triton path): one CUDA graph per padded bs replays what eager
computes, bit for bit (tokens, accept lengths, committed lengths, target KV of the real
pages), at every captured size and between sizes, replayed with fresh data after another
size's graph, greedy and sampled; greedy tree speculative decoding == the Engine's target-only
greedy decoding in float32.

Run on the GPU machine with `make test-gpu` (or `pytest -m gpu tests/test_tree_cycle_gpu.py`).
"""

from __future__ import annotations

import random

import pytest
import torch

from graphdraft.runtime.tree import TreeSpec
from graphdraft.serving.engine import Engine
from graphdraft.serving.tree_cycle import TreeRunner
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = [1, 2, 4, 8]
SPECS = [TreeSpec(3, 1), TreeSpec(5, 4, 8), TreeSpec(3, 4, 16), TreeSpec(4, 2, 7)]


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(61) for _ in range(rng.randint(3, 30))] for _ in range(count)]


def _kv(r: TreeRunner) -> torch.Tensor:
    """Target KV of the active requests' pages (page 0, the dummy page, left out)."""
    pages = torch.tensor([p for s in r.slots for p in r.pages.pages_of(s)], device="cuda")
    ps = r.page_size
    return torch.stack([torch.stack([k.view(-1, ps, *k.shape[1:])[pages],
                                     v.view(-1, ps, *v.shape[1:])[pages]])
                        for k, v in zip(r.kv.k, r.kv.v, strict=True)])


def _trace(r: TreeRunner, prompts, steps: int, temperature):
    r.add(prompts, 40, temperature)
    out = []
    for _ in range(steps):
        res = r.step()
        out.append((res.tokens, res.accept, r.cycle.prefix_len[: r.bs].clone(), _kv(r)))
    r.reset()
    return out


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_equals_eager_bit_exact(spec, page_size):
    target, head = make_models(seed=1, dtype=torch.bfloat16, device="cuda")
    runners = [TreeRunner(target, head, spec, max_bs=8, page_size=page_size, max_context_len=160,
                          cuda_graph_bs=SIZES, enforce_eager=eager, sampling=True, seed=7)
               for eager in (True, False)]
    runners[1].capture_graphs()
    assert runners[1].graphs.captured_sizes == SIZES
    # every captured size, sizes between them, another size's graph replayed in between
    for bs, temp in ((8, 0.0), (3, 0.0), (1, 0.8), (5, [0.0, 0.7, 0.0, 1.1, 0.0]), (2, 0.0)):
        prompts = _prompts(bs * 13 + page_size, bs)
        a, b = (_trace(r, prompts, 5, temp) for r in runners)
        for sa, sb in zip(a, b, strict=True):
            assert sa[0] == sb[0] and sa[1] == sb[1]
            assert torch.equal(sa[2], sb[2])
            assert torch.equal(sa[3], sb[3])
    assert runners[1].graphs.stats.total_replays == 25
    assert runners[0].graphs.stats.total_replays == 0


@pytest.mark.parametrize("spec", [TreeSpec(3, 1), TreeSpec(5, 4, 8), TreeSpec(3, 4, 16)])
def test_greedy_tree_equals_target_greedy_fp32(spec):
    target, head = make_models(seed=2, dtype=torch.float32, device="cuda")
    prompts = _prompts(5, 6)
    eng = Engine(target, runtime(dtype="float32", device="cuda", max_context_len=160))
    ref = eng.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    r = TreeRunner(target, head, spec, max_bs=8, page_size=4, max_context_len=160,
                   cuda_graph_bs=SIZES)
    r.capture_graphs()
    outs, accepts = r.generate(prompts, 24)
    assert outs == ref
    assert all(1 <= a <= spec.P for a in accepts)
    assert r.graphs.stats.total_replays > 0
