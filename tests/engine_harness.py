"""Tiny model pairs and test drafters (oracle and random) for serving-loop tests."""

from __future__ import annotations

import torch

from capture import GraphRegistry
from graphdraft.config import ModelConfig, RuntimeConfig
from graphdraft.models.random_models import random_model_pair
from graphdraft.runtime.batch import ForwardContext
from graphdraft.runtime.drafter import DrafterStats
from graphdraft.serving.engine import Engine

TARGET = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     intermediate_size=64, num_hidden_layers=4, vocab_size=61,
                     max_position_embeddings=512, rope_theta=10000.0)
HEAD = TARGET.replace(num_hidden_layers=1, intermediate_size=48, num_aux_hidden_states=3)


def make_models(seed: int = 0, dtype: torch.dtype = torch.float64, device: str = "cpu",
                draft_vocab: int | None = None, layers: int = 4):
    """The tiny pair (`TARGET`, `HEAD`; std 0.5). `layers`: the target's layer count, 4 or
    2 (aux ids (1, 1, 1) then). 2 for the interpreted Triton paths: every layer launches the
    same kernels (an aux capture keeps a reference, it launches nothing), so the first layer
    and a later one launch them all, at half the interpreted time of four."""
    if layers not in (2, 4):
        raise ValueError(f"layers: expected 2 or 4, got {layers!r}")
    hot = None
    target_cfg = TARGET if layers == 4 else TARGET.replace(
        num_hidden_layers=2, aux_hidden_state_layer_ids=(1, 1, 1))
    head_cfg = HEAD
    if draft_vocab is not None:
        head_cfg = HEAD.replace(draft_vocab_size=draft_vocab)
        hot = torch.randperm(TARGET.vocab_size, generator=torch.Generator().manual_seed(seed))[
            :draft_vocab]
    # std 0.5: peaked logits, so greedy text is not one token repeated
    target, head = random_model_pair(target_cfg, head_cfg, dtype, seed, std=0.5,
                                     hot_token_ids=hot)
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
    Column 0 follows the drafter contract (the last verified token). It reads tensors on
    the host, so it is not `capturable`: the Engine runs its `draft` eagerly (the split
    cycle) and only with k = S.
    """

    capturable = False
    variable_draft_length = False

    def __init__(self, engine: Engine, mode: str, seed: int = 0,
                 expected: dict[tuple, list[int]] | None = None) -> None:
        self.engine, self.mode = engine, mode
        self.gen = torch.Generator().manual_seed(seed)
        self.expected = expected or {}
        self.steps = engine.cfg.speculative_num_steps
        self.calls = 0

    # --- `graphdraft.runtime.drafter_protocol.Drafter` ---------------------------------
    def bind(self, binding) -> None:
        mb, n = binding.cfg.max_bs, binding.cfg.spec_num_tokens
        dev = binding.cfg.device
        self.inputs = binding.inputs
        self.tokens = torch.zeros(mb * n, dtype=torch.int64, device=dev)
        self.accept = torch.zeros(mb, dtype=torch.int32, device=dev)

    def graphs(self) -> GraphRegistry:
        return GraphRegistry()

    def reset_neutral(self) -> None:
        self.tokens.zero_()
        self.accept.zero_()

    def hidden_buffer(self, bs: int, n: int) -> None:
        return None

    def accepted_tokens(self, rows: int, n: int) -> torch.Tensor:
        return self.tokens[: rows * n].view(rows, n)

    def accept_lengths(self, rows: int) -> torch.Tensor:
        return self.accept[:rows]

    def draft(self, bs: int, k: int) -> torch.Tensor:
        ctx = ForwardContext(bs=bs, num_extends=0, input_num_tokens=bs * (self.steps + 1))
        return self.run(ctx, None, self.tokens[: bs * (k + 1)], self.accept[:bs])

    def draft_mixed(self, ctx, hidden, output_tokens, accept_lengths) -> torch.Tensor:
        return self.run(ctx, hidden, output_tokens, accept_lengths)

    def on_cycle(self, k: int) -> None:
        pass

    @property
    def stats(self) -> DrafterStats:
        return DrafterStats(calls=getattr(self, "calls", 0))

    def run(self, ctx, hidden, output_tokens, accept_lengths):
        n, ne = self.steps + 1, ctx.num_extends
        ib = self.inputs
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
            if slots[i] == 0:  # an inert row (padded, or done on device, not yet retired)
                drafts = [0] * (n - 1)
            elif self.mode == "oracle":
                exp = self.expected[tuple(by_slot[slots[i]])]
                drafts = [exp[p] if p < len(exp) else 0 for p in range(c + 1, c + n)]
            else:
                drafts = torch.randint(0, self.engine.target.config.vocab_size, (n - 1,),
                                       generator=self.gen).tolist()
            out[i] = torch.tensor([col0] + drafts, dtype=torch.int32)
        return out.to(output_tokens.device)
