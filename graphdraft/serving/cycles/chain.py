"""Chain drafting and target-only decoding as decode modes (`cycles.base.DecodeMode`).

`ChainMode` (a drafter meeting `graphdraft.runtime.drafter_protocol.Drafter`) and
`TargetOnlyMode` (no drafter: one token a row, k = 0) share one cycle:
  prepare -> verify (k + 1 tokens a row) -> accept -> draft (chain only) -> commit + pack.
Per draft length k of `steps` they register, in capture order:
  ("target_verify", k)  the verify forward alone (the split cycle; data-parallel mixed steps)
  ("draft_decode", k)   the drafter's `draft(bs, k)` alone (split cycle, chain only)
  the drafter's own forwards (`Drafter.graphs()`)
  ("spec_cycle", k)     the whole cycle as one graph
The fused cycle (`cycle_graph=True` and a capturable drafter or none) replays ("spec_cycle",
k); otherwise the split cycle replays the verify graph, runs the acceptance eagerly, replays
(or runs) the draft forward and commits eagerly: bit-identical. Which one runs is chosen at
construction (`fused`). Forward names: the family for k = S (`spec_cycle`), else
`{family}_k{k}`.

Draft lengths (the speculation policy picks k per decode cycle among `steps`): a cycle of k
drafts verifies k + 1 tokens a row (last_token and drafts[:k]) and drafts k tokens; the drafts
table's columns past k repeat the last one (filler). A row whose stored drafts are fewer than
this cycle's k verifies filler: the verify compares against the target, so it stays exact.
k = 0 (chain) is target-only decode plus the drafter's KV-only step over the one accepted
token (for `EagleDrafter`: the draft KV of the committed position, so later drafts attend over
no hole). With `cfg.deferred_draft_kv` > 0 and a drafter that can defer it (`DefersDraftKV`: the
`EagleDrafter`) the k = 0 cycle only stashes that step's inputs (`runtime/deferred_kv.py`)
and the mode registers ("draft_kv_rebuild", None), which writes them all at once; `run` and
`mixed` replay it (at the widest padded bs stashed) before a cycle with k > 0, before a
prefill / mixed step and before a stash into a full ring, so the draft KV is whole whenever
the head reads it. The decision is the host's (its counters), never a device read.
"""

from __future__ import annotations

import functools

import torch

from capture import CapturedForward
from graphdraft.runtime.batch import BatchRow, ForwardContext, write_batch
from graphdraft.runtime.drafter_protocol import DefersDraftKV, Drafter, PadsMixedDraft
from graphdraft.serving.cycles.base import CycleParts, DecodeMode
from graphdraft.serving.cycles.mixed_graphs import MixedTargetGraphs
from graphdraft.serving.data_parallel import StepPlan
from graphdraft.serving.request import Request


class ChainMode(DecodeMode):
    """Chain drafting with `drafter` (None: `TargetOnlyMode`).

    `fused`: the decode cycle is the ("spec_cycle", k) graph; else the split cycle.
    `split_graphs`: capture the split cycle's forwards too (data parallelism: its agreed
    mixed steps run a decode-only rank's rows through them)."""

    name = "chain"
    captures_aux = True

    def __init__(self, parts: CycleParts, drafter: Drafter | None, steps: tuple[int, ...], *,
                 fused: bool, split_graphs: bool) -> None:
        n_row = parts.cfg.spec_num_tokens if drafter is not None else 1
        super().__init__(parts, n_row, steps)
        self.drafter = drafter
        self.draft_hook = None
        """Benchmark only (e.g. `perf/policy.py`'s accept-rate control): when set (before
        capture: a captured graph holds what was set then), called as `draft_hook(bs,
        next_tokens [bs, S + 1])` after drafting and before the commit; it may overwrite the
        drafts in place and must be capturable."""
        on = parts.graphs_enabled
        # first in capture order: captured over the neutral rows `reset_neutral` leaves
        self.mixed_target = MixedTargetGraphs(
            parts, n_row, self.captures_aux,
            active=parts.inputs.input_ids.device.type == "cuda"
            and getattr(parts.target, "tp", None) is None and parts.cfg.dp_size == 1)
        self.padded_draft = self._pad_mixed_draft(drafter)
        """The mixed step's draft runs padded to its target forward's bucket (`PadsMixedDraft`;
        its ("draft_mixed", Tb) graphs join the registry with the drafter's)."""
        top = max(steps)
        widest_first = sorted(steps, reverse=True)
        self.verify_by_k = {k: self._add("target_verify", k, top,
                                         functools.partial(self.verify, n=k + 1),
                                         on and split_graphs) for k in widest_first}
        self.draft_by_k = {} if drafter is None else {
            k: self._add("draft_decode", k, top, functools.partial(self._draft_only, k=k),
                         on and split_graphs and drafter.capturable) for k in widest_first}
        if drafter is not None:
            parts.registry.extend(drafter.graphs())
        self.deferred, self.rebuild_kv = None, None
        if (isinstance(drafter, DefersDraftKV) and 0 in steps
                and parts.cfg.deferred_draft_kv):
            self.deferred = drafter.defer_kv(parts.cfg.deferred_draft_kv)
            self.rebuild_kv = self.forward("draft_kv_rebuild", drafter.rebuild_deferred_kv,
                                           on and drafter.capturable)
        self.cycle_by_k = {k: self._add("spec_cycle", k, top,
                                        functools.partial(self.cycle, k=k), on and fused)
                           for k in widest_first}
        self.fused = fused
        self._decode = self._fused_decode if fused else self._split_decode

    def _pad_mixed_draft(self, drafter: Drafter | None) -> bool:
        """With the padded target forward active and a `PadsMixedDraft` drafter whose hidden
        states have the target's dtype: the drafter serves the same buckets (`pad_mixed`) and
        the target writes its aux hidden states into the drafter's buffer. True then."""
        mt = self.mixed_target
        if not (mt.active and mt.rows and isinstance(drafter, PadsMixedDraft)):
            return False
        if drafter.hidden_buffer(0, 1).dtype != self.parts.target.embed_tokens.dtype:
            return False  # (the target's aux_out takes its own dtype only)
        mt.aux_out = drafter.pad_mixed(list(mt.rows), list(mt.tokens))
        return True

    def _add(self, family: str, k: int, top: int, fn, enabled: bool) -> CapturedForward:
        p = self.parts
        fwd = CapturedForward(family if k == top else f"{family}_k{k}", fn, p.schedule,
                              pool=p.graph_pool, enabled=enabled, on_oom=p.on_oom)
        return p.registry.add(family, k, fwd)

    # --- where the acceptance writes (the drafter's buffers: no staging copy) ------------
    def tokens(self, rows: int, n: int) -> torch.Tensor:
        return self.drafter.accepted_tokens(rows, n)

    def draft_accept(self, rows: int) -> torch.Tensor:
        return self.drafter.accept_lengths(rows)

    # --- the cycle's device functions (eager or captured; identical code) ---------------
    def verify(self, bs: int, n: int):
        """The target over `bs` prepared rows of n tokens (graph-capturable)."""
        return self.target_decode(bs, n, aux_out=self.drafter.hidden_buffer(bs, n),
                                  capture_aux=True)

    def _draft_only(self, bs: int, k: int) -> torch.Tensor:
        return self.drafter.draft(bs, k)

    def _drafts(self, bs: int, k: int, draft) -> torch.Tensor | None:
        nxt = draft(bs, k)
        if self.draft_hook is not None:
            self.draft_hook(bs, nxt)
        return nxt

    def cycle(self, bs: int, k: int) -> torch.Tensor:
        """One decode cycle of k drafts over `bs` staged rows (graph-capturable): verify width
        k + 1; returns pack[:bs] (`[bs, N + 3]` whatever k: token columns past k + 1 are 0)."""
        w = k + 1
        self.prepare(0, 0, bs, w)
        out = self.verify(bs, w)
        tokens = self.tokens(bs, w)
        self.accept(0, 0, bs, w, out.logits, self.parts.inputs.req_pool_indices[:bs], tokens,
                    self.draft_accept(bs))
        nxt = self._drafts(bs, k, self._draft_only)
        self.commit(0, bs, tokens, nxt, prefill=False)
        return self.parts.cycle.pack[:bs]

    def _split_decode(self, pbs: int, k: int) -> None:
        """The same cycle as verify graph, eager accept, draft graph (or eager draft), eager
        commit and pack."""
        w = k + 1
        self.prepare(0, 0, pbs, w)
        out = self.verify_by_k[k].run(pbs, padded_bs=pbs)
        tokens = self.tokens(pbs, w)
        self.accept(0, 0, pbs, w, out.logits, self.parts.inputs.req_pool_indices[:pbs], tokens,
                    self.draft_accept(pbs))
        nxt = self._drafts(pbs, k, lambda b, kk: self.draft_by_k[kk].run(b, padded_bs=b))
        self.commit(0, pbs, tokens, nxt, prefill=False)

    def _fused_decode(self, pbs: int, k: int) -> None:
        self.cycle_by_k[k].run(pbs, padded_bs=pbs)

    # --- the mode's interface ------------------------------------------------------------
    def run(self, bs: int, pbs: int, k: int, running: list[Request]) -> None:
        ring = self.deferred
        if ring is not None and (k > 0 or ring.full):
            self.rebuild_deferred_kv()  # (nothing when none is pending)
        self._decode(pbs, k)
        if ring is not None and k == 0:
            ring.stashed(pbs)

    def rebuild_deferred_kv(self) -> None:
        """Write the deferred draft KV (`EagleDrafter.rebuild_deferred_kv`, its graph at the
        widest padded bs stashed since the last rebuild); nothing when none is pending."""
        ring = self.deferred
        if ring is None or not ring.pending:
            return
        rows = ring.rows
        self.rebuild_kv.run(rows, padded_bs=rows)
        ring.rebuilt()

    def capture(self, progress: bool) -> None:
        """Deferred draft KV written first (capture warm-ups stash inert rows and clear the
        ring), then `DecodeMode.capture`; then, with `padded_draft`, the draft KV's dummy
        page zeroed."""
        self.rebuild_deferred_kv()
        super().capture(progress)
        if self.padded_draft:  # its captures read the target captures' undefined hidden states
            self.drafter.zero_dummy_kv()

    def state_tables(self) -> dict[str, torch.Tensor]:
        return {} if self.deferred is None else self.deferred.state_tables()

    def drafter_cycle(self, k: int) -> None:
        self.drafter.on_cycle(k)

    def drafts_made(self, k: int) -> int:
        return k if self.drafter.variable_draft_length else self.n_row - 1

    def reset_neutral(self) -> None:
        super().reset_neutral()
        self.drafter.reset_neutral()

    def decode_forwards(self) -> list[CapturedForward]:
        k = max(self.steps)
        if self.fused:
            return [self.cycle_by_k[k]]
        return [self.verify_by_k[k], *([self.draft_by_k[k]] if self.draft_by_k else [])]

    def cost_forwards(self) -> dict[int, CapturedForward]:
        return self.cycle_by_k if self.fused else self.verify_by_k

    def mixed(self, rows: list[BatchRow], preqs: list[Request], dreqs: list[Request],
              plan: StepPlan) -> None:
        """A prefill / mixed step, eager: prefill rows from the host, decode rows prepared on
        device from the same state as the cycle; the same accept, commit and pack (the target
        forward and, `padded_draft`, the draft's first step replayed per padded bucket). A rank of
        an agreed data-parallel mixed step without prefill rows runs its decode rows through
        the split cycle (at its own padded size)."""
        p = self.parts
        self.rebuild_deferred_kv()  # the step's first draft step reads the draft KV
        n, ne, nd = self.n_row, len(rows), len(dreqs)
        if ne == 0:
            pbs = self.padded(nd)
            p.stage_rows([r.slot for r in dreqs] + [0] * (pbs - nd))
            self._split_decode(pbs, max(self.steps))
            return
        bs = ne + nd
        ib, cb = p.inputs, p.cycle
        npt = write_batch(ib, p.pages, rows, staging=p.slots.staging,
                          kernels=p.cfg.kernels).input_num_tokens
        p.stage_rows([r.slot for r in preqs] + [r.slot for r in dreqs])
        if nd:
            self.prepare(ne, npt, nd, n)
        ctx = ForwardContext(bs=bs, num_extends=ne, input_num_tokens=npt + nd * n,
                             all_extends_mid_chunk=plan.all_mid_chunk)
        out = self.target_forward(ctx, rows, capture_aux=self.captures_aux, preqs=preqs,
                                  decode_rows=nd)
        # prefill rows: one token after a request's last chunk (slot 0 for the others)
        final = [r.slot if row.end == len(r.prompt) else 0
                 for row, r in zip(rows, preqs, strict=True)]
        cb.err[:ne] = 0
        p_tok = cb.tokens[:ne].view(ne, 1)
        self.accept(0, 0, ne, 1, out.logits[:ne], p.host_tensor(final), p_tok,
                    self.draft_accept(bs)[:ne])
        d_tok = cb.tokens[ne: ne + nd * n].view(nd, n)
        if nd:
            self.accept(ne, npt, nd, n, out.logits[ne:], ib.req_pool_indices[ne: ne + nd], d_tok,
                        self.draft_accept(bs)[ne:bs])
        nxt = self._draft_mixed(ctx, out.aux_hidden, cb.tokens[: ne + nd * n], bs, ne)
        self.commit(0, ne, p_tok, nxt[:ne] if nxt is not None else None, prefill=True)
        if nd:
            self.commit(ne, nd, d_tok, nxt[ne:bs] if nxt is not None else None, prefill=False)

    def _draft_mixed(self, ctx: ForwardContext, hidden: torch.Tensor | None,
                     tokens: torch.Tensor, bs: int, ne: int) -> torch.Tensor:
        accept = self.draft_accept(bs)  # the prefill rows' own: 1 (read by the draft only)
        accept[:ne].fill_(1)
        if self.padded_draft and self.mixed_bucket is not None:  # the target's bucket
            return self.drafter.draft_mixed_padded(ctx, tokens, accept, self.mixed_bucket)
        return self.drafter.draft_mixed(ctx, hidden, tokens, accept)


class TargetOnlyMode(ChainMode):
    """No drafter: one token a decode row (k = 0), the same cycle without the draft; the
    acceptance writes into `CycleBuffers.tokens` / `draft_accept`."""

    name = "none"
    captures_aux = False

    def __init__(self, parts: CycleParts, *, fused: bool, split_graphs: bool) -> None:
        super().__init__(parts, None, (0,), fused=fused, split_graphs=split_graphs)

    def tokens(self, rows: int, n: int) -> torch.Tensor:
        return self.parts.cycle.tokens[: rows * n].view(rows, n)

    def draft_accept(self, rows: int) -> torch.Tensor:
        return self.parts.cycle.draft_accept[:rows]

    def verify(self, bs: int, n: int):
        return self.target_decode(bs, n)

    def _drafts(self, bs: int, k: int, draft) -> None:
        return None

    def _draft_mixed(self, ctx, hidden, tokens, bs: int, ne: int) -> None:
        return None

    def drafter_cycle(self, k: int) -> None:
        """No drafter: nothing to count."""

    def drafts_made(self, k: int) -> int:
        return 0

    def reset_neutral(self) -> None:
        DecodeMode.reset_neutral(self)
