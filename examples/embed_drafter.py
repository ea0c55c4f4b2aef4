"""Embed `graphdraft.runtime.drafter.EagleDrafter` in a serving loop of your own.

The loop below is the smallest one that uses the drafter for real: greedy speculative
decoding of a few prompts with the shipped byte-level pair (`graphdraft/assets`), the
target run eagerly over its own paged KV cache, chain verification with
`graphdraft.serving.verify.verify_greedy`, and the drafter called after every target forward.
It uses only the public modules (config, checkpoint, kv_cache, buffers, batch, attention,
drafter, verify). Run it: `python examples/embed_drafter.py [--device cpu] [--max-new-tokens 32]`;
it checks its output against the target alone (greedy: identical) and prints the mean
accept length.

What a loop owes the drafter, each step:
  1. write the batch (prefill chunks first, then decode rows of N = S + 1 tokens: the last
     verified token and the S drafts the drafter returned last time) into the shared
     `InputBuffers` with `graphdraft.runtime.batch.write_batch`;
  2. run the target over those tokens with `capture_aux=True` (hidden states of every input
     token, `[input_num_tokens, k*H]`);
  3. verify: per prefill row the target's token after its last position, per decode row N
     tokens and an accept length in 1..N;
  4. `next_tokens = drafter.run(ctx, aux_hidden, output_tokens, accept_lengths)`:
     `[bs, S + 1]`, column 0 the last verified token, columns 1.. the next drafts;
  5. commit: `RuntimeStates.valid_cache_lengths[slot]` = the request's committed KV length.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graphdraft.config import RuntimeConfig
from graphdraft.io.checkpoint import load_model_pair
from graphdraft.models.attention import PagedAttentionBackend
from graphdraft.runtime.batch import BatchRow, write_batch
from graphdraft.runtime.buffers import InputBuffers, RuntimeStates
from graphdraft.runtime.drafter import EagleDrafter
from graphdraft.runtime.kv_cache import KVPool, PageTable
from graphdraft.serving.verify import verify_greedy

ASSETS = Path(__file__).resolve().parent.parent / "graphdraft" / "assets"


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    slot: int = -1
    committed: int = 0                              # KV positions committed
    output: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # next_tokens[row, 1:] of the last step

    @property
    def prefilling(self) -> bool:
        return self.committed < len(self.prompt)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class MiniLoop:
    """Greedy speculative decoding of a fixed set of requests (no admission queue)."""

    def __init__(self, target, head, cfg: RuntimeConfig) -> None:
        self.target, self.cfg = target, cfg
        tc, dev = target.config, torch.device(cfg.device)
        self.pages = PageTable(cfg.max_running_requests, cfg.max_pages_per_req,
                               cfg.total_kv_pages, cfg.page_size, dev)
        self.kv = KVPool(tc.num_hidden_layers, cfg.total_kv_pages, cfg.page_size,
                         tc.num_key_value_heads, tc.head_dim, target.dtype, dev)
        self.inputs, self.states = InputBuffers.allocate(cfg), RuntimeStates.allocate(cfg)
        self.backend = PagedAttentionBackend(self.pages.req_to_page, cfg.page_size,
                                             cfg.max_context_len, kernels=cfg.kernels)
        target.set_kernels(cfg.kernels)
        # scratch the target's per-token attention metadata is written into
        self.tok_req = torch.zeros(cfg.max_num_tokens, dtype=torch.int64, device=dev)
        self.tok_kv = torch.ones(cfg.max_num_tokens, dtype=torch.int32, device=dev)
        self.drafter = EagleDrafter(head, cfg, req_to_page=self.pages.req_to_page,
                                    input_buffers=self.inputs, runtime_states=self.states)
        self.N = cfg.spec_num_tokens
        self.accepted, self.decode_rows = 0, 0

    def add(self, prompt: list[int], max_new_tokens: int) -> Request:
        r = Request(list(prompt), max_new_tokens, slot=self.pages.alloc_slot())
        # room for prompt + output + N verify tokens + the drafter's S look-ahead slots
        self.pages.reserve(r.slot, len(prompt) + max_new_tokens + self.N + self.cfg.speculative_num_steps)
        return r

    @torch.inference_mode()
    def step(self, reqs: list[Request]) -> None:
        live = sorted((r for r in reqs if not r.done), key=lambda r: not r.prefilling)
        rows = []
        for r in live:  # prefill rows first (one chunk: the whole prompt), then decode rows
            if r.prefilling:
                nxt = r.prompt[r.committed + 1:] + [-1]
                rows.append(BatchRow(r.slot, r.committed, r.prompt[r.committed:], True, nxt))
            else:
                rows.append(BatchRow(r.slot, r.committed, [r.output[-1]] + r.drafts, False))
        ctx = write_batch(self.inputs, self.pages, rows)
        ib, bs, ne, t = self.inputs, ctx.bs, ctx.num_extends, ctx.input_num_tokens
        meta = self.backend.token_metadata(ib.req_pool_indices[:bs], ib.seq_lens[:bs],
                                           ib.extend_lens[:bs], t, self.tok_req, self.tok_kv)
        logit_rows, tok = [], 0
        for row in rows:  # prefill: its last token; decode: all N
            logit_rows += [tok + len(row.input_ids) - 1] if row.is_prefill else list(
                range(tok, tok + self.N))
            tok += len(row.input_ids)
        idx = torch.tensor(logit_rows, device=self.tok_req.device)
        out = self.target(ib.input_ids[:t], ib.positions[:t], ib.out_cache_loc[:t], self.kv,
                          self.backend, meta, idx, capture_aux=True)
        # verify (greedy)
        first = out.logits[:ne].argmax(-1)
        accept = torch.ones(bs, dtype=torch.int32, device=first.device)
        tokens = [first]
        if bs > ne:
            cand = torch.tensor([row.input_ids for row in rows[ne:]], device=first.device)
            dec_tokens, acc = verify_greedy(cand, out.logits[ne:])
            tokens.append(dec_tokens)
            accept[ne:] = acc
        output_tokens = torch.cat(tokens).to(torch.int64)
        next_tokens = self.drafter.run(ctx, out.aux_hidden, output_tokens, accept)
        # commit
        out_h, acc_h, nxt_h = output_tokens.tolist(), accept.tolist(), next_tokens.tolist()
        for i, (row, r) in enumerate(zip(rows, live, strict=True)):
            if row.is_prefill:
                r.committed, new = row.end, [out_h[i]]
            else:
                a = acc_h[i]
                base = ne + (i - ne) * self.N
                r.committed, new = row.start + a, out_h[base: base + a]
                self.accepted += a
                self.decode_rows += 1
            r.output += new[: r.max_new_tokens - len(r.output)]
            r.drafts = nxt_h[i][1:]
            self.states.valid_cache_lengths[r.slot] = r.committed

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        reqs = [self.add(p, max_new_tokens) for p in prompts]
        while not all(r.done for r in reqs):
            self.step(reqs)
        for r in reqs:
            self.pages.free(r.slot)
            self.states.valid_cache_lengths[r.slot] = 0
        return [r.output for r in reqs]

    @property
    def mean_accept_length(self) -> float:
        return self.accepted / max(self.decode_rows, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="default: 32")
    a = p.parse_args(argv)
    cfg = RuntimeConfig(speculative_num_steps=3, page_size=16, max_running_requests=4,
                        cuda_graph_max_bs=4, max_context_len=256, max_num_batched_tokens=512,
                        dtype="float32", device=a.device)
    target, head, _ = load_model_pair(ASSETS / "target", ASSETS / "eagle3", cfg.torch_dtype,
                                      cfg.device)
    texts = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Parser:\n    def "]
    prompts = [list(t.encode()) for t in texts]
    loop = MiniLoop(target, head, cfg)
    spec = loop.generate(prompts, a.max_new_tokens)

    from graphdraft.serving.engine import Engine  # the target alone, for the exactness check
    from graphdraft.serving.verify import SamplingParams
    alone = Engine(target, cfg).generate(
        prompts, SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True))
    for t, out in zip(texts, spec, strict=True):
        print(repr(t), "->", repr(bytes(x for x in out if x < 256).decode(errors="replace")))
    print(f"mean accept length: {loop.mean_accept_length:.2f} (N = {cfg.spec_num_tokens})")
    same = spec == alone
    print(f"identical to the target alone (greedy): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
