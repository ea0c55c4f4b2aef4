"""What every decode mode shares: the Engine's state it runs over and the cycle's device steps.

`CycleParts` is the Engine's state a mode runs over (buffers, pools, page table, the slot
state, the graph registry). `DecodeMode` holds it and the device functions of a decode cycle
(each run eagerly or inside a captured graph; identical code):
  prepare  rows' slots (`CycleBuffers.slot_rows`) -> `InputBuffers` (ids from last_token /
           drafts, positions, KV slots, seq lens); padded and done rows inert (slot 0)
  verify   the target over the prepared rows (`target_decode`)
  accept   the logit controls in place on the verify logits (`ops.apply_logit_controls`:
           logit_bias, penalties), then the acceptance kernel (greedy and sampled rows, stop
           ids, max_new; reads the sampling columns of `SlotState`)
  logprobs rows that asked (`SlotState.logprobs` >= 0): the emitted tokens' log-probabilities
           and top alternatives from the same logits (`ops.token_logprobs`) into
           `CycleBuffers.logprobs`, read back with the pack (one copy: `CycleBuffers.wire`)
  draft    (a drafter's mode) proposals under the same controls, this cycle's accepted
           tokens counted as emitted beside the counts (`ops.apply_draft_logit_controls`)
  commit   the accepted tokens' counts (`ops.count_tokens`: the penalties' output counts,
           updated only here, so a cycle that fails before its commit changes no count);
           valid_cache_lengths, last_token, drafts, emitted, done; the pack row `[N + 3]`
           (tokens, accept, finish, error bits) the host reads one step late
A mode (`TargetOnlyMode`, `ChainMode`, `SplitChainMode` in `cycles.chain`; `TreeMode` in
`graphdraft.serving.tree_cycle`) is chosen once, when the Engine is built; the Engine's step
calls the same members whatever the mode (`DecodeMode`'s interface below).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from capture import CapturedForward, GraphPool, GraphRegistry, padded_batch_size
from graphdraft import ops
from graphdraft.config import RuntimeConfig
from graphdraft.kernels.cycle_kernels import neutral_slot0
from graphdraft.models.attention import PagedAttentionBackend
from graphdraft.models.llama import LlamaForCausalLM, TargetOutput
from graphdraft.runtime.batch import BatchRow, ForwardContext
from graphdraft.runtime.buffers import CycleBuffers, InputBuffers, RuntimeStates
from graphdraft.runtime.kv_cache import KVPool, PageTable
from graphdraft.runtime.slot_state import SlotState
from graphdraft.serving.cycles.mixed_graphs import MixedTargetGraphs
from graphdraft.serving.data_parallel import StepPlan
from graphdraft.serving.prompt_logprobs import PromptLogprobs
from graphdraft.serving.request import Request


@dataclass
class CycleParts:
    """The Engine's state a decode mode runs over (owned by the Engine, shared by reference)."""

    cfg: RuntimeConfig
    target: LlamaForCausalLM
    kv: KVPool                      # the target's KV pool
    backend: PagedAttentionBackend  # the target's attention backend
    pages: PageTable
    inputs: InputBuffers
    states: RuntimeStates           # valid_cache_lengths
    slots: SlotState
    cycle: CycleBuffers             # slot_rows in; tokens, accept, finish, err, pack out
    schedule: list[int]             # captured batch sizes
    graph_pool: GraphPool
    registry: GraphRegistry         # every captured forward, in capture order
    graphs_enabled: bool
    on_oom: str
    stage_rows: Callable[[list[int]], None]             # slot_rows[:len] <- slots (H2D)
    host_tensor: Callable[[list[int]], torch.Tensor]    # an int64 device tensor of values
    running: Callable[[], list[Request]]                # the Engine's running requests


class DecodeMode:
    """Base of the decode modes: the cycle's device steps over `CycleParts`.

    Interface the Engine calls (each mode implements or inherits it):
      n_row                  tokens a decode row verifies (N; 1 target-only)
      steps                  the draft lengths k it has a cycle for (the policy picks one)
      name                   "none", "chain" or "tree" (metrics)
      run(bs, pbs, k, reqs)  one decode cycle over the staged rows `slot_rows[:pbs]` (bs real)
      mixed(rows, preqs, dreqs, plan)  a prefill / mixed step (eager), pack rows prefill first
      drafts_made(k)         drafts each decode row holds after a cycle of k
      reset_neutral()        every buffer the cycle reads back to its neutral values
      capture(progress)      capture this mode's forwards (registry order; inert rows only)
      decode_forwards()      the forwards a decode cycle replays (data-parallel replay mask)
      cost_forwards()        per k, the forward whose captured sizes a cost table can time
      state_tables()         extra per-slot tables a state snapshot includes
      lookahead              KV positions reserved past prompt + max_new
      precompiles            whether start-up may precompile its kernels in workers
      drafter_cycle(k)       host bookkeeping after a decode cycle was launched
    """

    name = "none"
    precompiles = True
    draft_hook = None  # benchmark only: `ChainMode.draft_hook`
    mixed_target: MixedTargetGraphs | None = None  # the mixed step's captured target forward
    mixed_bucket: tuple[int, int] | None = None
    """The (R, Tb) bucket the last `target_forward` ran padded to (None: unpadded), which the
    step's draft follows."""

    def __init__(self, parts: CycleParts, n_row: int, steps: tuple[int, ...]) -> None:
        self.parts, self.n_row, self.steps = parts, n_row, steps
        self.prompt_scores = PromptLogprobs(parts.cfg, parts.host_tensor)

    # --- interface defaults ------------------------------------------------------------
    @property
    def lookahead(self) -> int:
        return self.n_row + self.parts.cfg.speculative_num_steps

    def drafts_made(self, k: int) -> int:
        return k

    def drafter_cycle(self, k: int) -> None:
        """No drafter: nothing to count."""

    def state_tables(self) -> dict[str, torch.Tensor]:
        return {}

    def reset_neutral(self) -> None:
        p = self.parts
        p.inputs.pad_rows(0, p.cfg.max_bs)
        p.inputs.pad_tokens(0, p.cfg.max_bs * self.n_row)
        p.cycle.reset()
        st = p.slots
        neutral_slot0(p.states.valid_cache_lengths, st.last_token, st.drafts, st.emitted,
                          st.done)
        if self.mixed_target is not None:
            self.mixed_target.reset_neutral()
            if self.mixed_target.by_tokens:
                p.inputs.pad_tokens(0, p.inputs.max_tokens)  # what its captures read

    def capture(self, progress: bool) -> None:
        """Capture every registered forward (registry order), neutral before and after."""
        self.reset_neutral()
        for fwd in self.parts.registry.forwards():
            fwd.capture(progress=progress)
            if self.mixed_target is not None:
                self.mixed_target.captured(fwd)
        self.reset_neutral()

    def forward(self, family: str, fn, enabled: bool, k: int | None = None) -> CapturedForward:
        """A `CapturedForward` of `fn(bs)` over the schedule, registered as (family, k)."""
        p = self.parts
        name = family if k is None else f"{family}_k{k}"
        fwd = CapturedForward(name, fn, p.schedule, pool=p.graph_pool, enabled=enabled,
                              on_oom=p.on_oom)
        return p.registry.add(family, k, fwd)

    # --- the cycle's device steps -------------------------------------------------------
    def prepare(self, row0: int, tok0: int, rows: int, n: int) -> None:
        """Decode rows [row0, row0 + rows) from `slot_rows` into `InputBuffers` (n tokens each,
        from token tok0): ids from last_token / drafts[:n - 1], positions and KV slots from
        valid_cache_lengths and the page table. Padded (slot 0), done and bad rows are inert:
        the dummy slot 0 at positions 0..n-1. Sets `err` of these rows (fresh each step)."""
        p = self.parts
        ib, st, cb, cfg = p.inputs, p.slots, p.cycle, p.cfg
        t = rows * n
        ops.prepare_rows(cb.slot_rows[row0: row0 + rows], n, done=st.done,
                         vcl=p.states.valid_cache_lengths, last_token=st.last_token,
                         drafts=st.drafts, req_to_page=p.pages.req_to_page,
                         page_size=cfg.page_size, max_context_len=cfg.max_context_len,
                         vocab=p.target.config.vocab_size,
                         input_ids=ib.input_ids[tok0: tok0 + t],
                         positions=ib.positions[tok0: tok0 + t],
                         out_cache_loc=ib.out_cache_loc[tok0: tok0 + t],
                         req=ib.req_pool_indices[row0: row0 + rows],
                         seq_lens=ib.seq_lens[row0: row0 + rows],
                         extend_lens=ib.extend_lens[row0: row0 + rows],
                         err=cb.err[row0: row0 + rows], kernels=cfg.kernels)

    def target_decode(self, bs: int, n: int, aux_out: torch.Tensor | None = None,
                      capture_aux: bool = False) -> TargetOutput:
        """Target forward over `bs` prepared rows x n tokens (graph-capturable); its aux hidden
        states go into `aux_out` `[bs * n, kH]` when given (the drafter's buffer: no copy)."""
        p = self.parts
        t, ib = bs * n, p.inputs
        meta = p.backend.uniform_row_metadata(ib.req_pool_indices[:bs], ib.seq_lens[:bs], n)
        if aux_out is not None and aux_out.dtype != p.target.embed_tokens.dtype:
            aux_out = None
        return p.target(ib.input_ids[:t], ib.positions[:t], ib.out_cache_loc[:t], p.kv,
                        p.backend, meta, None, capture_aux=capture_aux, aux_out=aux_out)

    def target_forward(self, ctx: ForwardContext, rows: list[BatchRow], capture_aux: bool,
                       preqs: list[Request] = (), decode_rows: int = 0) -> TargetOutput:
        """Eager target forward over a prefill / mixed batch written into `InputBuffers`:
        `rows` its prefill rows, then `decode_rows` decode rows of `n_row` tokens (prefill
        rows' last position and decode rows' N positions get logits, in row order; then, for
        the prefill rows of `preqs` that asked `prompt_logprobs`, every chunk position whose
        next prompt token is known: `PromptLogprobs.score` reads those). With the mode's
        `mixed_target` active, a step within its buckets runs the padded captured forward
        (`cycles.mixed_graphs`; not when prompt log-probabilities are scored), and
        `mixed_bucket` says which."""
        p = self.parts
        ib, bs = p.inputs, ctx.bs
        t = ctx.input_num_tokens
        lens = np.fromiter((len(r.input_ids) for r in rows), np.int64, len(rows))
        npt = int(lens.sum())
        logit_rows = np.concatenate([np.cumsum(lens) - 1,  # each prefill row's last token
                                     np.arange(npt, npt + decode_rows * self.n_row)])
        scored = self.prompt_scores.plan(rows, preqs, len(logit_rows))
        graphs = self.mixed_target
        self.mixed_bucket = None
        if graphs is not None and graphs.active and not scored.token_rows:
            bucket = graphs.bucket(bs, t)
            if bucket is not None:  # the padded forward: a graph replay (`mixed_graphs`)
                self.mixed_bucket = bucket
                return graphs.run(bs, t, logit_rows, bucket)
        if scored.token_rows:
            logit_rows = np.concatenate([logit_rows, scored.token_rows])
        longest = max(int(lens.max()) if len(rows) else 1, self.n_row if decode_rows else 1)
        meta = p.backend.row_metadata(ib.req_pool_indices[:bs], ib.seq_lens[:bs],
                                      ib.extend_lens[:bs], longest)
        idx = p.host_tensor(logit_rows)
        out = p.target(ib.input_ids[:t], ib.positions[:t], ib.out_cache_loc[:t], p.kv,
                       p.backend, meta, idx, capture_aux=capture_aux)
        self.prompt_scores.score(scored, out.logits)
        return out

    def accept(self, row0: int, tok0: int, rows: int, n: int, logits: torch.Tensor,
               slots: torch.Tensor, tokens: torch.Tensor, draft_accept: torch.Tensor) -> None:
        """The acceptance over rows [row0, row0 + rows) whose logits are `logits [rows * n, V]`;
        `slots`: the rows' slots as prepared (0 for padded, done and flagged rows: inert);
        writes `tokens [rows, n]` and `draft_accept [rows]` (the drafter's accept lengths).
        First the rows' logit controls (`ops.apply_logit_controls`: logit_bias, penalties) in
        place on `logits`: every later reader (the acceptance, log-probabilities) sees them.
        Writes no per-slot state: the accepted tokens are counted in `commit` (after the
        draft, whose proposals count them as emitted from `tokens` and the accept lengths)."""
        p = self.parts
        cb = p.cycle
        cand = p.inputs.input_ids[tok0: tok0 + rows * n].view(rows, n)
        ops.apply_logit_controls(logits, cand, slots, p.slots, kernels=p.cfg.kernels)
        ops.accept_tokens(logits, cand, slots, p.inputs.seq_lens[row0: row0 + rows], p.slots,
                          tokens=tokens, accept=cb.accept[row0: row0 + rows],
                          draft_accept=draft_accept, finish=cb.finish[row0: row0 + rows],
                          err=cb.err[row0: row0 + rows], kernels=p.cfg.kernels)
        self.token_logprobs(row0, logits, slots, tokens)

    def token_logprobs(self, row0: int, logits: torch.Tensor, slots: torch.Tensor,
                       tokens: torch.Tensor, logit_rows: torch.Tensor | None = None) -> None:
        """Log-probabilities of the emitted `tokens [rows, n]` (and the top alternatives) of
        rows [row0, row0 + rows) that asked (`SlotState.logprobs` >= 0) into their
        `CycleBuffers.logprobs` rows, from `logits` (the verify logits after the request's
        logit controls; `logit_rows [rows, n]`: which logits row scored each token, None:
        `r * n + j`). Inert rows (slot 0, done) and positions past a row's accept length
        (`CycleBuffers.accept`, never read back) write nothing."""
        p = self.parts
        rows = tokens.shape[0]
        ops.token_logprobs(logits, tokens, slots, p.slots.logprobs,
                           out=p.cycle.logprobs[row0: row0 + rows], k=p.cfg.max_logprobs,
                           logit_rows=logit_rows, done=p.slots.done,
                           accept=p.cycle.accept[row0: row0 + rows], kernels=p.cfg.kernels)

    def commit(self, row0: int, rows: int, tokens: torch.Tensor,
               next_tokens: torch.Tensor | None, prefill: bool) -> None:
        """State after the step for rows [row0, row0 + rows): the accepted `tokens [rows, n]`
        counted (`ops.count_tokens` into `SlotState.token_counts`, at the rows' prepared
        slots), valid_cache_lengths (decode: += accept; prefill rows: their seq len),
        last_token, drafts `next_tokens [rows, S + 1]` (None: no drafter), emitted, done; then
        the rows' pack. Rows that accepted nothing (inert, mid-chunk) change no slot's
        tokens or counts."""
        p = self.parts
        cb, st, ib = p.cycle, p.slots, p.inputs
        sl = slice(row0, row0 + rows)
        ops.count_tokens(tokens, cb.accept[sl], ib.req_pool_indices[sl], st.token_counts,
                         kernels=p.cfg.kernels)
        ops.commit_pack(tokens, next_tokens[:rows] if next_tokens is not None else None,
                        accept=cb.accept[sl], finish=cb.finish[sl], err=cb.err[sl],
                        req=ib.req_pool_indices[sl], seq_lens=ib.seq_lens[sl],
                        vcl=p.states.valid_cache_lengths, last_token=st.last_token,
                        drafts=st.drafts, emitted=st.emitted, done=st.done, pack=cb.pack[sl],
                        prefill=prefill, kernels=p.cfg.kernels)

    def padded(self, bs: int) -> int:
        return padded_batch_size(self.parts.schedule, bs) or bs

    # --- interface the modes implement --------------------------------------------------
    def run(self, bs: int, pbs: int, k: int, reqs: list[Request]) -> None:
        raise NotImplementedError

    def mixed(self, rows: list[BatchRow], preqs: list[Request], dreqs: list[Request],
              plan: StepPlan) -> None:
        raise NotImplementedError

    def decode_forwards(self) -> list[CapturedForward]:
        raise NotImplementedError

    def cost_forwards(self) -> dict[int, CapturedForward]:
        raise NotImplementedError
