"""A tiny drafter set-up and a fake serving loop that drives it (random target outputs)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from graphdraft.config import ModelConfig, RuntimeConfig
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.layers import init_random_
from graphdraft.runtime.batch import BatchRow, write_batch
from graphdraft.runtime.buffers import InputBuffers, RuntimeStates
from graphdraft.runtime.drafter import EagleDrafter
from graphdraft.runtime.kv_cache import PageTable

TINY = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   intermediate_size=48, vocab_size=97, max_position_embeddings=256,
                   rope_theta=10000.0, num_aux_hidden_states=3)


@dataclass
class Setup:
    drafter: EagleDrafter
    head: Eagle3DraftHead
    cfg: RuntimeConfig
    pages: PageTable
    inputs: InputBuffers
    states: RuntimeStates


def make_setup(steps: int = 3, page_size: int = 16, hot: bool = False, *, seed: int = 0,
               dtype: str = "float32", device: str = "cpu", model: ModelConfig = TINY,
               **runtime) -> Setup:
    mc = model.replace(draft_vocab_size=53) if hot else model
    gen = torch.Generator().manual_seed(seed + 1)
    hot_ids = torch.randperm(mc.vocab_size, generator=gen)[: mc.output_vocab_size] if hot else None
    cfg_kw = dict(speculative_num_steps=steps, page_size=page_size, max_running_requests=8,
                  max_context_len=192, max_num_batched_tokens=256, cuda_graph_max_bs=8,
                  dtype=dtype, device=device)
    cfg_kw.update(runtime)
    cfg = RuntimeConfig(**cfg_kw)
    head = Eagle3DraftHead(mc, cfg.torch_dtype, hot_token_ids=hot_ids)
    init_random_(head, seed, std=0.3)
    head.to(device)
    pages = PageTable(cfg.max_running_requests, cfg.max_pages_per_req, cfg.total_kv_pages,
                      page_size, device)
    inputs, states = InputBuffers.allocate(cfg), RuntimeStates.allocate(cfg)
    drafter = EagleDrafter(head, cfg, req_to_page=pages.req_to_page, input_buffers=inputs,
                           runtime_states=states)
    return Setup(drafter, head, cfg, pages, inputs, states)


@dataclass
class FakeRequest:
    slot: int
    prompt: list[int]
    chunk: int
    committed: int = 0          # KV positions committed
    last_verified: int | None = None
    drafts: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.committed < len(self.prompt)


class FakeServingLoop:
    """Schedules prefill chunks and decode rows; the 'target' outputs random tokens/hidden."""

    def __init__(self, s: Setup, seed: int) -> None:
        self.s, self.rng = s, random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.reqs: list[FakeRequest] = []

    def add(self, prompt_len: int, chunk: int) -> FakeRequest:
        slot = self.s.pages.alloc_slot()
        vocab = self.s.head.config.vocab_size
        r = FakeRequest(slot, [self.rng.randrange(vocab) for _ in range(prompt_len)], chunk)
        self.reqs.append(r)
        return r

    def finish(self, r: FakeRequest) -> None:
        self.reqs.remove(r)
        self.s.pages.free(r.slot)
        self.s.states.valid_cache_lengths[r.slot] = 0

    def prepare(self, accept_choices=None):
        """Schedule a batch and make the target's outputs: (rows, order, ctx, hidden, tokens, accept)."""
        s, n, steps = self.s, self.s.cfg.spec_num_tokens, self.s.cfg.speculative_num_steps
        vocab = s.head.config.vocab_size
        rows, order = [], sorted(self.reqs, key=lambda r: not r.prefilling)
        for r in order:
            if r.prefilling:
                end = min(r.committed + r.chunk, len(r.prompt))
                ids = r.prompt[r.committed:end]
                nxt = r.prompt[r.committed + 1: end + 1]
                nxt += [-1] * (len(ids) - len(nxt))
                rows.append(BatchRow(r.slot, r.committed, ids, True, nxt))
            else:
                rows.append(BatchRow(r.slot, r.committed, [r.last_verified] + r.drafts, False))
        for row in rows:  # room for verify tokens and the draft look-ahead
            s.pages.reserve(row.slot, row.end + n + steps)
        ctx = write_batch(s.inputs, s.pages, rows)
        ne = ctx.num_extends
        out_tokens = torch.randint(0, vocab, (ne + (ctx.bs - ne) * n,), generator=self.gen)
        hidden = torch.randn(ctx.input_num_tokens, s.head.target_hidden_width, generator=self.gen)
        accept = torch.ones(ctx.bs, dtype=torch.int32)
        for i in range(ne, ctx.bs):
            choices = accept_choices or list(range(1, n + 1))
            accept[i] = self.rng.choice(choices)
        dev = s.cfg.device
        hidden = hidden.to(s.cfg.torch_dtype).to(dev)
        return rows, order, ctx, hidden, out_tokens.to(dev), accept.to(dev)

    def commit(self, rows, order, out_tokens, accept, next_tokens) -> None:
        """The engine's job after the draft: commit accepted tokens, update valid lengths."""
        s = self.s
        for i, (row, r) in enumerate(zip(rows, order, strict=True)):
            if row.is_prefill:
                r.committed = row.end
                if not r.prefilling:
                    r.last_verified = int(out_tokens[i])
            else:
                r.committed = row.start + int(accept[i])
                r.last_verified = int(next_tokens[i, 0])
            r.drafts = [int(t) for t in next_tokens[i, 1:]]
            s.states.valid_cache_lengths[r.slot] = r.committed

    def step(self, accept_choices=None):
        """One target forward + drafter call. Returns (rows, ctx, hidden, out_tokens, accept,
        next_tokens, valid_cache_lengths before the call)."""
        rows, order, ctx, hidden, out_tokens, accept = self.prepare(accept_choices)
        snapshot = self.s.states.valid_cache_lengths.clone()
        next_tokens = self.s.drafter.run(ctx, hidden, out_tokens, accept)
        self.commit(rows, order, out_tokens, accept, next_tokens)
        return rows, ctx, hidden, out_tokens.cpu(), accept.cpu(), next_tokens.cpu(), snapshot.cpu()
