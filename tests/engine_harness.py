"""Tiny model pairs and test drafters (oracle and random) for serving-loop tests."""

from __future__ import annotations

import torch

from graphdraft.config import ModelConfig, RuntimeConfig
from graphdraft.models.random_models import random_model_pair
from graphdraft.runtime.drafter import DrafterStats
from graphdraft.serving.engine import Engine

TARGET = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     intermediate_size=64, num_hidden_layers=4, vocab_size=61,
                     max_position_embeddings=512, rope_theta=10000.0)
HEAD = TARGET.replace(num_hidden_layers=1, intermediate_size=48, num_aux_hidden_states=3)


def make_models(seed: int = 0, dtype: torch.dtype = torch.float64, device: str = "cpu",
                draft_vocab: int | None = None):
    hot = None
    head_cfg = HEAD
    if draft_vocab is not None:
        head_cfg = HEAD.replace(draft_vocab_size=draft_vocab)
        hot = torch.randperm(TARGET.vocab_size, generator=torch.Generator().manual_seed(seed))[
            :draft_vocab]
    # std 0.5: peaked logits, so greedy text is not one token repeated
    target, head = random_model_pair(TARGET, head_cfg, dtype, seed, std=0.5, hot_token_ids=hot)
    return target.to(device), head.to(device)


def runtime(**kw) -> RuntimeConfig:
    # the fixed policy unless asked: tests comparing engines step by step need the same k in
    # each (an adaptive policy decides from costs and accept rates; tests/test_policy_engine.py)
    base = dict(speculative_num_steps=3, page_size=4, max_running_requests=6, max_context_len=160,
                max_num_batched_tokens=48, cuda_graph_max_bs=6, dtype="float64", device="cpu",
                speculative_policy="fixed")
    base.update(kw)
    return RuntimeConfig(**base)


class ScriptedDrafter:
    """Drafts from a script: `oracle` (the target's own greedy text) or `random` tokens.

    `expected[tuple(prompt)]` holds prompt + the target-only greedy output.
    Column 0 follows the drafter contract (the last verified token).
    """

    def __init__(self, engine: Engine, mode: str, seed: int = 0,
                 expected: dict[tuple, list[int]] | None = None) -> None:
        self.engine, self.mode = engine, mode
        self.gen = torch.Generator().manual_seed(seed)
        self.expected = expected or {}
        self.steps = engine.cfg.speculative_num_steps
        self.calls = 0

    # the rest of `graphdraft.runtime.drafter_protocol.Drafter`: no graphs, no zero-copy hidden buffer
    supports_cycle = False

    @property
    def stats(self) -> DrafterStats:
        return DrafterStats(calls=getattr(self, "calls", 0))

    def capture_graphs(self, progress: bool = True) -> None:
        pass

    def decode_hidden_buffer(self, bs: int) -> None:
        return None

    def run(self, ctx, hidden, output_tokens, accept_lengths):
        n, ne = self.steps + 1, ctx.num_extends
        ib = self.engine.inputs
        seq = ib.seq_lens[: ctx.bs].tolist()
        slots = ib.req_pool_indices[: ctx.bs].tolist()
        by_slot = {r.slot: r.prompt for r in self.engine.running}
        self.calls += 1
        out = torch.zeros(ctx.bs, n, dtype=torch.int32)
        for i in range(ctx.bs):
            if i < ne:
                col0, c = int(output_tokens[i]), seq[i]
            else:
                a = max(1, min(int(accept_lengths[i]), n))
                col0 = int(output_tokens[ne + (i - ne) * n + a - 1])
                c = seq[i] - n + int(accept_lengths[i])
            if slots[i] == 0:  # an inert row (a request done on device, not yet retired)
                drafts = [0] * (n - 1)
            elif self.mode == "oracle":
                exp = self.expected[tuple(by_slot[slots[i]])]
                drafts = [exp[p] if p < len(exp) else 0 for p in range(c + 1, c + n)]
            else:
                drafts = torch.randint(0, self.engine.target.config.vocab_size, (n - 1,),
                                       generator=self.gen).tolist()
            out[i] = torch.tensor([col0] + drafts, dtype=torch.int32)
        return out.to(output_tokens.device)
