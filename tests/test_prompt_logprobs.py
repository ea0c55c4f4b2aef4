"""Prompt tokens' ranks (serving/prompt_logprobs.py): `token_ranks` counts the entries strictly
above each token's logit (ties share a rank, any chunking, the logits' own dtype), and an
Engine's `Request.prompt_ranks` equal the ranks in a plain torch log_softmax of the prompt
(prompts over several prefill chunks, speculative and target-only)."""

from __future__ import annotations

import pytest
import torch

from graphdraft.serving import prompt_logprobs
from graphdraft.serving.engine import Engine
from graphdraft.serving.prompt_logprobs import token_ranks
from graphdraft.serving.verify import SamplingParams
from tests.checkpoint_fixtures import full_logits
from tests.engine_harness import make_models, runtime


def _reference(logits: torch.Tensor, tokens: torch.Tensor) -> list[int]:
    lsm = torch.log_softmax(logits.double(), -1)
    return [1 + int((row > row[t]).sum()) for row, t in zip(lsm, tokens.tolist(), strict=True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1 << 26, 7 * 37])  # one pass; 7 rows at a time
def test_token_ranks_count_strictly_larger_entries(dtype, chunk, monkeypatch):
    monkeypatch.setattr(prompt_logprobs, "RANK_CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(23, 37, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, 37, (23,), generator=g)
    logits[0, tokens[0]] = logits[0].max() + 1          # the likeliest: rank 1
    logits[1, tokens[1]] = logits[1].min() - 1          # the least likely: rank V
    logits[2] = 0.5                                     # all tied: rank 1
    best = logits[3].argmax()
    logits[3, tokens[3]] = logits[3, best]              # tied for the best: rank 1
    got = token_ranks(logits, tokens)
    assert got.dtype == torch.int32 and got.shape == (23,)
    assert got.tolist() == _reference(logits.float(), tokens)
    assert got[:4].tolist() == [1, 37, 1, 1]


@pytest.mark.parametrize("head", [False, True], ids=["target-only", "speculative"])
def test_engine_prompt_ranks_equal_the_log_softmax_ranks(head):
    """Prompts of 30-50 tokens under a 24-token prefill budget (chunks of several steps)."""
    target, draft = make_models(seed=3, dtype=torch.float32)
    e = Engine(target, runtime(dtype="float32", max_num_batched_tokens=24),
               draft if head else None)
    g = torch.Generator().manual_seed(1)
    vocab = target.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (30, 50)]
    params = [SamplingParams(max_new_tokens=3, prompt_logprobs=w) for w in (2, 0)]
    for r in e.generate_requests(prompts, params):
        assert r.prompt_ranks[0] is None and len(r.prompt_ranks) == len(r.prompt)
        logits = full_logits(target, r.prompt)[:-1]
        want = _reference(logits, torch.tensor(r.prompt[1:]))
        assert r.prompt_ranks[1:] == want
        assert len(set(want)) > 5  # random prompts: ranks all over the vocabulary
