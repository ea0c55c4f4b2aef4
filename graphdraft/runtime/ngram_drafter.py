"""N-gram (prompt-lookup) drafting: drafts from the request's own tokens, no head.

`NgramDrafter` meets `graphdraft.runtime.drafter_protocol.Drafter` (a `TokenDrafter`). It
keeps, per request slot, the token history on the device: `history [R, max_context_len]` int32 (the token at
position p in column p: the prompt, then every accepted token) and `lengths [R]` int32. The
drafts of a row are the tokens that followed the most recent earlier occurrence of its last n
tokens, n from `ngram_max` down to `ngram_min` (`ops.ngram_propose`, `kernels/ngram.py`).

Writes, all inside `draft` / `draft_mixed` (torch ops and one kernel: no host sync, fixed
addresses, so `draft` runs inside the cycle graph):
  decode rows (slot s, accept a, `valid_cache_lengths[s] = v` before the commit): the
    accepted tokens go to positions v + 1 .. v + a (position v holds the last verified
    token), lengths[s] = v + 1 + a;
  prefill rows (`draft_mixed`): the chunk's tokens at their positions, the target's token
    after the chunk at position `seq_len` (a later chunk overwrites it with the prompt's;
    after the last chunk it is the first output token), lengths[s] = seq_len + 1.
Inert rows (slot 0: padded, done, flagged) write slot 0 only, whose length stays 0 (it never
matches). A slot reused by a new request is rewritten by its prefill before it is read.

A lookup draft is a point mass (q = one-hot): the acceptance (`kernels/accept.py`) samples
the target's token at each position and accepts a draft exactly when it equals it, which is
the speculative-sampling rule for a one-hot q, so greedy output equals target-only decoding
and sampled output follows the target's distribution.

Filler. Columns past a row's match (fewer than k tokens follow it, or no match) repeat its
last draft (`found [max_bs]` counts the real ones); they are not a sentinel that is never
accepted, because none exists cleanly and none is needed:
- no valid id is never accepted: every id in [0, V) can be the target's argmax or its sample,
  and the drafts are also the verify forward's input ids, so an id outside [0, V) would read
  past the embedding (the acceptance flags it as `ERR_TOKEN` and the step fails);
- a per-row cap (accept at most found + 1) would be a new input of every acceptance path
  (chain and tree, greedy and sampled, eager and inside the cycle graph) only to discard tokens;
- accepting a filler is exact: like every lookup draft it is a point mass fixed by the
  committed tokens alone (independent of the uniforms that sample its position), and the
  acceptance takes it exactly when it equals the target's own token there (greedy: the argmax;
  sampled: probability p(filler), the speculative-sampling rule for q = one-hot), so an accepted
  filler is a token target-only decoding emits too, for free.
The cost of filler is the verify's extra columns, which the adaptive policy prices: rows whose
filler is rejected lower the accept estimate it picks k from.
"""

from __future__ import annotations

import torch

from graphdraft import ops
from graphdraft.runtime.batch import ForwardContext
from graphdraft.runtime.drafter_protocol import DraftBinding, TokenDrafter


class NgramDrafter(TokenDrafter):
    """Prompt-lookup drafts for any k in 0..S, capturable; `ngram_min` / `ngram_max` from the
    bound `RuntimeConfig`. `found [max_bs]`: the real drafts of each row of the last draft."""

    def bind(self, binding: DraftBinding) -> None:
        super().bind(binding)
        cfg = binding.cfg
        self.kernels = cfg.kernels
        self.ngram_min, self.ngram_max = cfg.ngram_min, cfg.ngram_max
        rows = cfg.max_running_requests + 1  # slot 0: the dummy slot
        dev = cfg.device
        self.history = torch.zeros(rows, cfg.max_context_len, dtype=torch.int32, device=dev)
        self.lengths = torch.zeros(rows, dtype=torch.int32, device=dev)     # [R]
        self.found = torch.zeros(cfg.max_bs, dtype=torch.int32, device=dev)  # [max_bs]

    def reset_neutral(self) -> None:
        super().reset_neutral()
        self.found.zero_()
        self.lengths[0] = 0

    # --- history writes ---------------------------------------------------------------------
    def _write(self, slots: torch.Tensor, pos: torch.Tensor, toks: torch.Tensor,
               ok: torch.Tensor) -> None:
        """history[slots, pos] = toks where `ok` (same shapes); the rest go to slot 0."""
        s = torch.where(ok, slots, torch.zeros_like(slots))
        p = torch.where(ok, pos, torch.zeros_like(pos)).clamp(0, self.history.shape[1] - 1)
        self.history.index_put_((s, p), toks.to(torch.int32))

    def _append_decode(self, slots: torch.Tensor, toks: torch.Tensor,
                       accept: torch.Tensor) -> None:
        """Decode rows: `slots [rows]`, `toks [rows, n]`, `accept [rows]` (>= 1; inert rows'
        slot is 0) -> positions v + 1 .. v + a and lengths (module docstring)."""
        rows, n = toks.shape
        slots = slots.long()
        live = slots != 0
        base = self.binding.states.valid_cache_lengths[slots].long() + 1     # [rows]
        j = torch.arange(n, device=toks.device)
        a = accept.long().clamp(max=n)
        pos = base[:, None] + j                                               # [rows, n]
        ok = live[:, None] & (j[None, :] < a[:, None]) & (pos < self.history.shape[1])
        self._write(slots[:, None].expand(rows, n), pos, toks, ok)
        new_len = torch.where(live, (base + a).clamp(max=self.history.shape[1]), 0)
        self.lengths.index_put_((torch.where(live, slots, 0),), new_len.to(torch.int32))

    def _propose(self, slots: torch.Tensor, k: int) -> torch.Tensor:
        bs = slots.shape[0]
        out = self.next[:bs]
        ops.ngram_propose(self.history, self.lengths, slots, k, self.ngram_min, self.ngram_max,
                          out=out, found=self.found[:bs], kernels=self.kernels)
        return out

    # --- the protocol's drafts ----------------------------------------------------------------
    def draft(self, bs: int, k: int) -> torch.Tensor:
        """Append the accepted tokens of `bs` rows, then look up k drafts -> `[bs, S + 1]`."""
        slots = self.binding.inputs.req_pool_indices[:bs]
        self._append_decode(slots, self.accepted_tokens(bs, k + 1), self.accept[:bs])
        return self._propose(slots, k)

    def draft_mixed(self, ctx: ForwardContext, hidden_states, output_tokens: torch.Tensor,
                    accept_lengths: torch.Tensor) -> torch.Tensor:
        """Prefill rows' chunks and output tokens, decode rows' accepted tokens, then k = S
        drafts for every row (eager; no host sync)."""
        ib, ne, bs, n = self.binding.inputs, ctx.num_extends, ctx.bs, self.S + 1
        slots = ib.req_pool_indices[:bs]
        npt = ctx.input_num_tokens - (bs - ne) * n
        if ne:
            row = torch.repeat_interleave(torch.arange(ne, device=slots.device),
                                          ib.extend_lens[:ne].long(), output_size=npt)
            ps = slots[:ne].long()
            live = ps != 0
            tok_slots = ps[row]
            self._write(tok_slots, ib.positions[:npt].long(), ib.input_ids[:npt],
                        tok_slots != 0)
            end = ib.seq_lens[:ne].long()
            self._write(ps, end, output_tokens[:ne], live & (end < self.history.shape[1]))
            new_len = torch.where(live, (end + 1).clamp(max=self.history.shape[1]), 0)
            self.lengths.index_put_((torch.where(live, ps, 0),), new_len.to(torch.int32))
        if bs > ne:
            self._append_decode(slots[ne:bs], output_tokens[ne:].view(bs - ne, n),
                                accept_lengths[ne:bs])
        return self._propose(slots, self.S)

def configured_drafter(cfg, head, drafter):
    """The drafter an Engine runs for `cfg.speculative_algorithm`: "ngram" -> a new
    `NgramDrafter` (ValueError naming `speculative_algorithm` when a head or a drafter is
    given too); "eagle3" -> `drafter` unchanged (the Engine builds the head's own)."""
    if cfg.speculative_algorithm != "ngram":
        return drafter
    if head is not None or drafter is not None:
        raise ValueError("speculative_algorithm: expected 'eagle3' with a head or a caller's "
                         "drafter ('ngram' drafts without either), got 'ngram'")
    return NgramDrafter()
