"""The EAGLE / EAGLE-3 drafter: first draft step + multi-step chain, eager or graph-replayed.

After each target forward the serving loop calls `run(ctx, hidden_states,
output_tokens, accept_lengths)` and gets `next_tokens [bs, S + 1]` int32:
column 0 the last verified token of each request, columns 1..S the drafts.

Inputs (rows: `num_extends` prefill rows first, then decode rows of N tokens):
  output_tokens    [num_extends + num_decodes * N]  the target's token after each sampled
                   position: a prefill row's last position, each of a decode row's N positions
  hidden_states    [input_num_tokens, k*H]          target hidden states of every input token
  accept_lengths   [bs]                             tokens committed this step (decode rows 0..N;
                                                    prefill rows: ignored)
and the engine's `InputBuffers` (positions, out_cache_loc, seq_lens, req_pool_indices,
extend_lens, shifted_prefill_ids) plus `RuntimeStates.valid_cache_lengths` (before this step).

The two forwards:
  first step  over the target's token layout; KV of every token is written, and the
              gathered row of each request (decode: `row*N - 1 + clamp(accept, 1, N)`;
              prefill: its last token) attends over the accepted prefix only.
  multi-step  S - 1 pure decode steps, one token per request, writing from
              `valid_cache_lengths[req] + accept` (decode rows) or `seq_lens` (prefill rows).
              One kernel writes every step's KV slots up front; the seq-len alias is
              advanced in place before each step.

Both forwards read and write only `DraftBuffers` / `InputBuffers`; `capture.CapturedForward`
decides whether a call replays a CUDA graph or runs the same functions eagerly. Two graph
sets per batch size: `decode_graphs` (a decode batch's whole draft: first step, then
multi-step, one replay) and `multi_step_graphs` (multi-step alone, after the first step of a
prefill/mixed batch). A prefill/mixed batch's first step computes its rows' indices on the
device from each row's kind (`DraftBuffers.row_kind`), so it depends on (rows, tokens) only:
unpadded it runs eagerly at (bs, t); served padded to the target's (R, Tb) bucket
(`pad_mixed`, `draft_mixed_padded`: rows of no token, padded tokens on the dummy KV slot)
it replays `mixed_graphs[Tb]` at R. Around a decode replay the host issues two launches: staging
the caller's inputs (`stage_decode_inputs`) and copying next_tokens out. Decode batches are
always padded to the graph schedule (also when graphs are off), so `enforce_eager`
reproduces graph numerics exactly.

Inside the `Engine` the drafter meets `graphdraft.runtime.drafter_protocol.Drafter`: the
Engine's decode cycle writes the accepted tokens and accept lengths straight into its
buffers and runs `draft(bs, k)` (the decode body of any k in 0..S) inside its own cycle
graph; `decode_graphs` are then not captured (`bind`), `multi_step_graphs` are (`graphs`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from capture import (
    CapturedForward,
    GraphPool,
    GraphRegistry,
    batch_size_schedule,
    eager_forced,
    padded_batch_size,
)
from graphdraft import ops
from graphdraft.checks import INDEX_DTYPES, expect_tensor
from graphdraft.config import RuntimeConfig
from graphdraft.models.attention import PagedAttentionBackend
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.nvtx import nvtx_range
from graphdraft.runtime.batch import ForwardContext, ForwardMode
from graphdraft.runtime.buffers import (
    NEUTRAL_DRAFT_TOKEN,
    ROW_DECODE,
    ROW_PAD,
    ROW_PREFILL,
    DraftBuffers,
    InputBuffers,
    RuntimeStates,
)
from graphdraft.runtime.deferred_kv import DeferredDraftKV
from graphdraft.runtime.draft_controls import DraftControls
from graphdraft.runtime.drafter_protocol import DraftBinding
from graphdraft.runtime.kv_cache import KVPool

log = logging.getLogger(__name__)


@dataclass
class DrafterStats:
    calls: int = 0
    decode_calls: int = 0
    mixed_calls: int = 0
    skipped_multi_step: int = 0


class EagleDrafter:
    """Runs an `Eagle3DraftHead` over the shared page table with its own KV pool."""

    def __init__(self, head: Eagle3DraftHead, cfg: RuntimeConfig, *, req_to_page: torch.Tensor,
                 input_buffers: InputBuffers, runtime_states: RuntimeStates,
                 kv_pool: KVPool | None = None, graph_pool: GraphPool | None = None,
                 on_oom: str = "drop") -> None:
        """`on_oom`: a batch size whose capture runs out of memory is dropped ("drop": it pads
        to a larger graph or runs eagerly) or the error propagates ("raise"; use it when
        ranks must capture identical sets)."""
        self.head, self.cfg = head, cfg
        self.N, self.S = cfg.spec_num_tokens, cfg.speculative_num_steps
        self.device = torch.device(cfg.device)
        mc = head.config
        if mc.max_position_embeddings < cfg.max_context_len:
            raise ValueError(f"max_context_len: expected <= the head's max_position_embeddings "
                             f"({mc.max_position_embeddings}), got {cfg.max_context_len}")
        if input_buffers.max_bs < cfg.max_bs or input_buffers.max_tokens < cfg.max_num_tokens:
            raise ValueError("input_buffers: expected buffers allocated for this RuntimeConfig")
        self.req_to_page = req_to_page
        self.inputs, self.states = input_buffers, runtime_states
        self.kv_pool = kv_pool or KVPool(1, cfg.total_kv_pages, cfg.page_size, mc.num_key_value_heads,
                                         mc.head_dim, head.dtype, self.device)
        self.backend = PagedAttentionBackend(req_to_page, cfg.page_size, cfg.max_context_len,
                                             kernels=cfg.kernels)
        self._use_head_kernels()
        self.bufs = DraftBuffers.allocate(cfg, mc.hidden_size, head.target_hidden_width, head.dtype)
        self.schedule = batch_size_schedule(cfg.cuda_graph_max_bs, cfg.cuda_graph_bs)
        enabled = not (cfg.enforce_eager or eager_forced()) and self.device.type == "cuda"
        self._graphs_on, self._on_oom = enabled, on_oom
        self.graph_pool = graph_pool or GraphPool()
        self.decode_graphs = CapturedForward(
            "draft_decode", self._decode, self.schedule, pool=self.graph_pool,
            enabled=enabled, on_oom=on_oom)
        self.multi_step_graphs = CapturedForward(
            "draft_multi_step", self._multi_step, self.schedule, pool=self.graph_pool,
            enabled=enabled and self.S > 1, on_oom=on_oom)
        self.stats = DrafterStats()
        self.controls: DraftControls | None = None
        """The Engine's logit controls (`bind`): drafts proposed under the rows' penalties
        and logit_bias (None: a standalone drafter, the head's own greedy pick)."""
        self.mixed_accepted = torch.full((cfg.max_bs, self.N), -1, dtype=torch.int64,
                                         device=self.device)
        """`[max_bs, N]`: a prefill / mixed step's accepted tokens per row (a prefill row's
        first token in column 0), staged by `run` for the draft controls (`_accepted`)."""
        self.deferred: DeferredDraftKV | None = None
        """The k = 0 cycles' deferred draft KV (`defer_kv`; None: `draft(bs, 0)` runs the
        KV-only step in every k = 0 cycle)."""
        self.mixed_hidden: torch.Tensor | None = None
        """`[Tb_max, kH]` (`pad_mixed`, allocated once): the target's aux hidden states of a
        prefill / mixed step run padded to a (rows, tokens) bucket (the target's padded
        forward writes them here: `aux_out`), the padded first step's input."""
        self.mixed_graphs: dict[int, CapturedForward] = {}
        """`pad_mixed`'s padded first steps by token bucket (captured with graphs on only)."""

    def _use_head_kernels(self) -> None:
        """Point the head's layers at this drafter's kernel path (a head shared by two drafters
        with different `kernel_backend` is switched back before each eager forward)."""
        if self.head.kernels != self.cfg.kernels:
            self.head.set_kernels(self.cfg.kernels)

    # ------------------------------------------------------------------
    # Graphs
    # ------------------------------------------------------------------
    @torch.inference_mode()
    def capture_graphs(self, progress: bool = True) -> None:
        """Capture the decode draft and the multi-step chain for every size of the schedule
        (largest first).

        Buffers are reset to neutral values first, so warm-up runs see length-1
        sequences of the dummy request.
        """
        self._use_head_kernels()
        self._reset_neutral()
        for f in self.capture_sequence():
            f.capture(progress=progress)
        self._reset_neutral()

    def capture_sequence(self) -> list[CapturedForward]:
        """The forwards `capture_graphs` captures, in that order."""
        return [self.decode_graphs, self.multi_step_graphs]

    def _reset_neutral(self) -> None:
        mb = self.cfg.max_bs
        self.inputs.pad_rows(0, mb)
        self.inputs.pad_tokens(0, mb * self.N)
        self._pad_draft_rows(0, mb)
        self.bufs.next_tokens.zero_()  # warm-up and capture drafted for inert rows
        self.bufs.row_kind.fill_(ROW_PAD)
        if self.mixed_hidden is not None:  # the padded first steps read up to max(tokens)
            self.bufs.first_input_ids.fill_(NEUTRAL_DRAFT_TOKEN["first_input_ids"])

    def _pad_draft_rows(self, start: int, stop: int) -> None:
        self.bufs.pad_rows(start, stop, self.N)

    # ------------------------------------------------------------------
    # The two forwards (run eagerly or captured; identical code)
    # ------------------------------------------------------------------
    def _first_step(self, bs: int, num_tokens: int, hidden: torch.Tensor, n: int | None = None,
                    *, kv_only: bool = False):
        """One draft forward over a decode batch's `num_tokens` = bs * n tokens (rows of `n`
        tokens each, default N; `hidden` `[num_tokens, kH]`); writes ids/hidden/write_start/
        next_tokens[:, :2]. `kv_only`: the head's `store_kv` instead (the same indices and the
        same KV written, nothing drafted: writes write_start/seq_lens/gather_ids and
        next_tokens[:, 0] only)."""
        b, ib = self.bufs, self.inputs
        n = self.N if n is None else n
        ids = b.first_input_ids[:num_tokens]
        # next_tokens[:, 0]: the last verified token, ids[gather]
        ops.decode_draft_indices(b.accept_lengths[:bs], ib.seq_lens[:bs],
                                 ib.req_pool_indices[:bs], self.states.valid_cache_lengths, n, 0,
                                 b.gather_ids[:bs], b.seq_lens[:bs], b.write_start[:bs], ids,
                                 b.next_tokens[:bs, 0], kernels=self.cfg.kernels)
        if kv_only:
            self.head.store_kv(ids, ib.positions[:num_tokens], hidden,
                               ib.out_cache_loc[:num_tokens], self.kv_pool.layer(0))
            return b.next_tokens[:bs]
        return self._head_first(bs, num_tokens, hidden, self._accepted(bs, n))

    def _head_first(self, rows: int, tokens: int, hidden: torch.Tensor,
                    accepted: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The head over the first step's `tokens` tokens (ids `first_input_ids`, positions
        and KV slots from `InputBuffers`, `hidden [tokens, kH]`; every token's KV written),
        LM head at `gather_ids[:rows]`, attending over `seq_lens[:rows]`; the pick under the
        controls (`accepted`: `_accepted`) -> ids/hidden/next_tokens[:rows, 1]. Returns
        next_tokens[:rows] `[rows, S + 1]`. Graph-capturable."""
        b, ib = self.bufs, self.inputs
        req = ib.req_pool_indices[:rows]
        metadata = self.backend.bind_metadata(req, b.seq_lens[:rows])
        out = self.head(b.first_input_ids[:tokens], ib.positions[:tokens], hidden,
                        ib.out_cache_loc[:tokens], self.kv_pool.layer(0), self.backend, metadata,
                        b.gather_ids[:rows], ids_out=b.ids[:rows],
                        tokens_out=b.next_tokens[:rows, 1], hidden_out=b.hidden[:rows])
        self._controlled_pick(out, req, None, b.next_tokens[:rows, 1], accepted)
        return b.next_tokens[:rows]

    # ------------------------------------------------------------------
    # The first step of a prefill / mixed batch. Its rows' kinds (`DraftBuffers.row_kind`:
    # prefill, decode, padded) are staged on the host; every per-row index is computed on the
    # device for all rows at once, so the step depends on (rows, tokens) only: run unpadded
    # (rows = bs, tokens = t) or padded to a bucket (R, Tb) whose graph replays it.
    # ------------------------------------------------------------------
    def _mixed_first(self, ctx: ForwardContext, hidden: torch.Tensor,
                     bucket: tuple[int, int] | None) -> None:
        """Run the first step of a prefill / mixed batch (`bs` rows, `t` tokens, `hidden
        [t, kH]`; its rows' kinds and ids staged by `_prepare_mixed_ids`). `bucket` None:
        `_mixed_first_step(bs, t, hidden)`. `bucket` (R, Tb) (`draft_mixed_padded`): tokens
        [t, Tb) id 0 (staged; their positions and KV slots are `InputBuffers`' neutral
        tokens, as the target's padded forward left them: the dummy slot), rows [bs, R)
        neutral `InputBuffers` rows of kind `ROW_PAD` (the kind staged), the hidden states
        `mixed_hidden[:Tb]`; `mixed_graphs[Tb]` replayed at R, or (graphs off, none
        captured) the same `_mixed_first_step(R, Tb)` eagerly."""
        bs, t = ctx.bs, ctx.input_num_tokens
        if bucket is None:
            self._mixed_first_step(bs, t, hidden)
            return
        rows, tokens = bucket
        if rows > bs:
            self.inputs.pad_rows(bs, rows)
        fwd = self.mixed_graphs.get(tokens)
        if fwd is not None:
            fwd.run(rows, padded_bs=rows)
        else:
            self._mixed_first_step(rows, tokens)

    def _mixed_first_step(self, rows: int, tokens: int, hidden: torch.Tensor | None = None):
        """The first draft step over `tokens` tokens of `rows` rows of kinds `row_kind[:rows]`
        (prefill rows' chunks, then decode rows of N tokens, then padded rows of none; tokens
        past the rows' own are padded ones) and `hidden [tokens, kH]` (None:
        `mixed_hidden[:tokens]`): the rows' indices (`_mixed_indices`), next_tokens[:, 0] =
        the gathered ids, then the head (`_head_first`). Returns next_tokens[:rows]
        `[rows, S + 1]`. Depends only on (rows, tokens): graph-capturable."""
        b = self.bufs
        hidden = self.mixed_hidden[:tokens] if hidden is None else hidden
        self._mixed_indices(rows)
        b.next_tokens[:rows, 0].copy_(b.first_input_ids.index_select(0, b.gather_ids[:rows]))
        return self._head_first(rows, tokens, hidden, self._accepted(rows, None))

    def _mixed_indices(self, rows: int) -> None:
        """`gather_ids`, `seq_lens`, `write_start` `[rows]` of a prefill / mixed batch's rows
        by kind (`row_kind`), no host value: a decode row's from `decode_draft_indices` (its
        accepted prefix) shifted to its tokens' start; a prefill row gathers its last token
        and attends over / writes from its seq len; a padded row (no token) gathers the token
        before it (>= 0) with its neutral seq len (1). Tokens of a row: the cumsum of
        `extend_lens` (0 for padded rows). Graph-capturable."""
        b, ib, n = self.bufs, self.inputs, self.N
        kind = b.row_kind[:rows]
        seq = ib.seq_lens[:rows]
        gather, seq_out, start = b.gather_ids[:rows], b.seq_lens[:rows], b.write_start[:rows]
        # every row as a decode row whose N tokens start at token r * N (its last token too:
        # the decode batches' kernel variant; `_mixed_first_step` gathers it again below)
        ops.decode_draft_indices(b.accept_lengths[:rows], seq, ib.req_pool_indices[:rows],
                                 self.states.valid_cache_lengths, n, 0, gather, seq_out, start,
                                 b.first_input_ids, b.next_tokens[:rows, 0],
                                 kernels=self.cfg.kernels)
        ext = torch.where(kind == ROW_PAD, 0, ib.extend_lens[:rows])
        end = torch.cumsum(ext, 0, dtype=torch.int64)  # each row's tokens end here
        decode = kind == ROW_DECODE
        shift = end - ext - torch.arange(0, rows * n, n, device=end.device)
        torch.where(decode, gather + shift, (end - 1).clamp_(min=0), out=gather)
        torch.where(decode, seq_out, seq, out=seq_out)
        torch.where(decode, start, seq, out=start)

    def _accepted(self, bs: int, n: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's accepted tokens and their lengths `accept_lengths[:bs]`, which the
        draft controls count as emitted (the Engine's commit counts them after the draft): a
        decode batch's are its first-step ids viewed `[bs, n]` (n tokens a row); a prefill /
        mixed step's (n None) are `mixed_accepted[:bs]` (`run` stages them)."""
        b = self.bufs
        if n is None:
            return self.mixed_accepted[:bs], b.accept_lengths[:bs]
        return b.first_input_ids[: bs * n].view(bs, n), b.accept_lengths[:bs]

    def _controlled_pick(self, out, req: torch.Tensor, window: torch.Tensor | None,
                         tokens_out: torch.Tensor,
                         accepted: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Under the rows' logit controls (`controls`): the draft step's logits `out.logits
        [B, Vd]` transformed in place (the rows' committed tokens, this step's `accepted`
        tokens (`[B, n]`, lengths `[B]`: `_accepted`) and `window [B, W]`, the drafts since,
        counted as emitted) and the pick redone into `out.ids` and `tokens_out` (rows
        without controls pick what the head picked: their logits are unchanged).
        Graph-capturable; nothing without controls."""
        c = self.controls
        if c is None:
            return
        kc = self.cfg.kernels
        win = window if window is not None else c.no_window[: req.shape[0]]
        ops.apply_draft_logit_controls(out.logits, win, req, c.slots, accepted=accepted[0],
                                       accepted_len=accepted[1], col_ids=c.col_ids,
                                       col_of=c.col_of, kernels=kc)
        ops.argmax_with_map(out.logits, self.head.hot_token_ids, out=out.ids,
                            tokens_out=tokens_out, kernels=kc)

    def _decode(self, bs: int, k: int | None = None):
        """A decode batch's whole draft over `bs` staged rows of k + 1 tokens (the verify of
        k drafts; default k = S); writes next_tokens[:bs] `[bs, S + 1]`.

        k drafts: the first step over the rows' k + 1 tokens, then k - 1 multi-steps; the k
        drafts fill columns 1..k, columns k + 1..S repeat column k (filler: a later cycle with
        more drafts verifies them against the target, which keeps it exact). k = 0 runs the
        KV-only first step (`Eagle3DraftHead.store_kv` over the one accepted token a row: the
        draft KV of that position, so the draft cache has no hole; no attention, MLP or LM
        head) and drafts nothing: columns 1..S repeat column 0 (all filler). With a deferred
        ring (`defer_kv`) a k = 0 draft only stashes that step's inputs
        (`DeferredDraftKV.stash`) and writes the filler; `rebuild_deferred_kv` writes their
        KV later."""
        k = self.S if k is None else k
        if not 0 <= k <= self.S:
            raise ValueError(f"k: expected draft steps in 0..{self.S}, got {k}")
        if k == 0 and self.deferred is not None:
            return self._defer_kv_step(bs)
        w = k + 1
        hidden = self.bufs.first_hidden[: bs * w]
        if k == self.S:
            self._first_step(bs, bs * w, hidden)
        else:
            self._first_step(bs, bs * w, hidden, n=w, kv_only=k == 0)
        if k > 1:
            self._multi_step(bs, k, accepted_width=w)
        if k < self.S:
            nt = self.bufs.next_tokens[:bs]
            nt[:, k + 1:].copy_(nt[:, k: k + 1].expand(bs, self.S - k))
        return self.bufs.next_tokens[:bs]

    def _defer_kv_step(self, bs: int) -> torch.Tensor:
        """A k = 0 draft with the ring: the KV-only step's inputs of the one token a row (the
        accepted id, its position and KV slot from `InputBuffers`, the verify's aux hidden
        state) stashed, and next_tokens[:bs] = that token in every column (column 0: the
        last verified token, as `decode_draft_indices` gathers it for one token a row)."""
        b, ib = self.bufs, self.inputs
        ids = b.first_input_ids[:bs]
        self.deferred.stash(bs, ids, ib.positions[:bs], ib.out_cache_loc[:bs],
                            b.first_hidden[:bs])
        nt = b.next_tokens[:bs]
        nt.copy_(ids.unsqueeze(1).expand(bs, self.S + 1))
        return nt

    def defer_kv(self, columns: int) -> DeferredDraftKV:
        """Give this drafter a deferred draft-KV ring of `columns` cycles (`DeferredDraftKV`,
        allocated once, before capture): from now on `draft(bs, 0)` stashes instead of
        running the KV-only step, and the caller runs `rebuild_deferred_kv` before the draft
        KV is read again. Returns the ring (its host counters say when)."""
        if self.deferred is not None:
            raise ValueError("deferred: this drafter already has a deferred draft-KV ring")
        self.deferred = DeferredDraftKV(self.cfg.max_bs, columns, self.head.target_hidden_width,
                                        self.head.dtype, self.device)
        return self.deferred

    def rebuild_deferred_kv(self, bs: int) -> None:
        """Write the draft KV of every entry the ring holds in rows [0, bs) (`store_kv` over
        `bs * P` tokens; inert entries write the dummy slot 0), then clear those rows
        (graph-capturable: the same code eager or replayed)."""
        ring = self.deferred
        if ring is None:
            raise ValueError("deferred: this drafter has no deferred draft-KV ring (defer_kv)")
        ids, positions, locs, hidden = ring.inputs(bs)
        self.head.store_kv(ids, positions, hidden, locs, self.kv_pool.layer(0))
        ring.clear(bs)

    def _multi_step(self, bs: int, k: int | None = None, accepted_width: int | None = None):
        """Draft steps 2..k (default S) for `bs` rows; writes next_tokens[:bs, 2:k + 1].
        `accepted_width`: a decode batch's tokens a row (its accepted tokens are the
        first-step ids, `_accepted`); None: a prefill / mixed step's (staged by `run`)."""
        b, steps = self.bufs, (self.S if k is None else k)
        accepted = self._accepted(bs, accepted_width)
        req = self.inputs.req_pool_indices[:bs]
        write_start = b.write_start[:bs]
        locs = b.out_cache_loc[: (steps - 1) * bs]
        seq_lens, positions = b.seq_lens[:bs], b.positions[:bs]
        ops.out_cache_loc_uniform(locs, req, write_start, self.req_to_page, self.cfg.page_size,
                                  steps - 1, positions_out=positions, seq_lens_out=seq_lens,
                                  kernels=self.cfg.kernels)
        locs = locs.view(steps - 1, bs)
        metadata = self.backend.bind_metadata(req, seq_lens)
        ids, hidden = b.ids[:bs], b.hidden[:bs]
        for i in range(1, steps):
            out = self.head(ids, positions, hidden, locs[i - 1], self.kv_pool.layer(0),
                            self.backend, metadata, tokens_out=b.next_tokens[:bs, i + 1])
            self._controlled_pick(out, req, b.next_tokens[:bs, 1: i + 1],
                                  b.next_tokens[:bs, i + 1], accepted)
            ids, hidden = out.ids, out.hidden
            if i + 1 < steps:
                ops.advance_positions_and_seq_lens(seq_lens, positions,
                                                   kernels=self.cfg.kernels)
        return b.next_tokens[:bs]

    def decode_hidden_buffer(self, bs: int, n: int | None = None) -> torch.Tensor:
        """The view `[bs * n, kH]` (n tokens per row, default N) that a decode `run` at `bs`
        (or the cycle's draft of n - 1 steps) reads the target's hidden states from. A target
        that writes its captured hidden states here (and passes this view as
        `hidden_states`) saves `run` their copy; valid until the next `run`."""
        if not 0 <= bs <= self.cfg.max_bs:
            raise ValueError(f"bs: expected 0..{self.cfg.max_bs}, got {bs}")
        n = self.N if n is None else n
        if not 1 <= n <= self.N:
            raise ValueError(f"n: expected tokens per row in 1..{self.N}, got {n}")
        return self.bufs.first_hidden[: bs * n]

    # ------------------------------------------------------------------
    # The Engine's drafter protocol (`graphdraft.runtime.drafter_protocol.Drafter`): the cycle
    # graph writes the accepted tokens and accept lengths straight into this drafter's
    # buffers and runs its decode body in the same graph.
    # ------------------------------------------------------------------
    capturable = True
    variable_draft_length = True

    def bind(self, binding: DraftBinding) -> None:
        """The Engine that built this drafter binds it (its own buffers: nothing to allocate);
        ValueError naming `drafter` for another Engine's buffers. The standalone
        `decode_graphs` (`run` of decode batches) are not captured then: the Engine's cycle
        runs `draft`."""
        if binding.inputs is not self.inputs or binding.states is not self.states:
            raise ValueError("drafter: expected the EagleDrafter built over this Engine's "
                             "buffers (input_buffers, runtime_states)")
        self.decode_graphs = CapturedForward("draft_decode", self._decode, self.schedule,
                                             pool=self.graph_pool, enabled=False)
        if binding.slots is not None and binding.slots.vocab:
            self.controls = DraftControls.build(binding.slots, self.head.hot_token_ids,
                                                self.cfg.max_bs, self.device)

    def graphs(self) -> GraphRegistry:
        """The multi-step chain (`draft_multi_step`) of prefill / mixed steps, then the
        padded first steps (`pad_mixed`: ("draft_mixed", Tb), widest first)."""
        reg = GraphRegistry()
        reg.add("draft_multi_step", None, self.multi_step_graphs)
        for tb, fwd in self.mixed_graphs.items():
            reg.add("draft_mixed", tb, fwd)
        return reg

    def hidden_buffer(self, bs: int, n: int) -> torch.Tensor:
        """`decode_hidden_buffer(bs, n)`."""
        return self.decode_hidden_buffer(bs, n)

    def accepted_tokens(self, rows: int, n: int) -> torch.Tensor:
        """`[rows, n]` view of `DraftBuffers.first_input_ids`: the first step's ids."""
        return self.bufs.first_input_ids[: rows * n].view(rows, n)

    def accept_lengths(self, rows: int) -> torch.Tensor:
        """`DraftBuffers.accept_lengths[:rows]` int32."""
        return self.bufs.accept_lengths[:rows]

    def draft(self, bs: int, k: int) -> torch.Tensor:
        """`_decode(bs, k)`: the decode draft of k steps over the staged buffers ->
        next_tokens[:bs] `[bs, S + 1]`."""
        return self._decode(bs, k)

    def draft_mixed(self, ctx: ForwardContext, hidden_states: torch.Tensor | None,
                    output_tokens: torch.Tensor, accept_lengths: torch.Tensor) -> torch.Tensor:
        """The Engine's prefill / mixed step: `run(..., copy_output=False)` without the
        deferred mode's device value checks (`_device_checks`, an error word the Engine never
        reads): as in `draft`, which checks none, every value is the Engine's own (prompts
        and slots validated on the host when added and admitted, tokens and accept lengths
        from its acceptance kernel, rows its prepare kernel flagged made inert). The host
        shape checks, and `validation="sync"`'s value checks, still run."""
        return self._run(ctx, hidden_states, output_tokens, accept_lengths, False,
                         device_checks=False)

    def pad_mixed(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """Serve prefill / mixed steps whose target forward runs padded to a (R, Tb) bucket of
        `rows` x `tokens` (`draft_mixed_padded`): allocates `mixed_hidden` `[max(tokens), kH]`
        once and, with graphs on, one `CapturedForward` of the padded first step per token
        bucket Tb over the row buckets R <= Tb (`draft_mixed_t{Tb}`; in `graphs()` as
        ("draft_mixed", Tb), widest first). Returns `mixed_hidden`: the padded target forward
        writes its aux hidden states there (its `aux_out`). Once, before capture."""
        if self.mixed_hidden is not None:
            raise ValueError("pad_mixed: this drafter already serves padded mixed steps")
        for name, sizes, top in (("rows", rows, self.cfg.max_bs),
                                 ("tokens", tokens, self.cfg.max_num_tokens)):
            if not sizes or any(not isinstance(x, int) or not 1 <= x <= top for x in sizes):
                raise ValueError(f"{name}: expected bucket sizes in 1..{top}, got {sizes!r}")
        self.mixed_hidden = torch.zeros(max(tokens), self.head.target_hidden_width,
                                        dtype=self.head.dtype, device=self.device)
        if not self._graphs_on:
            return self.mixed_hidden  # the same padded step, eagerly
        for tb in sorted(set(tokens), reverse=True):
            sizes = sorted({r for r in rows if r <= tb})
            if sizes:
                self.mixed_graphs[tb] = CapturedForward(
                    f"draft_mixed_t{tb}", functools.partial(self._mixed_first_step, tokens=tb),
                    sizes, pool=self.graph_pool, on_oom=self._on_oom)
        return self.mixed_hidden

    def draft_mixed_padded(self, ctx: ForwardContext, output_tokens: torch.Tensor,
                           accept_lengths: torch.Tensor, bucket: tuple[int, int]) -> torch.Tensor:
        """`draft_mixed` of a step whose target forward ran padded to `bucket` (R, Tb) and
        wrote its aux hidden states `[Tb, kH]` into `mixed_hidden` (`pad_mixed`), its padded
        tokens [t, Tb) the dummy KV slot: the first step runs padded to the same bucket (a
        graph replay), the multi-step as in `draft_mixed`. Returns next_tokens[:bs]
        `[bs, S + 1]` (a view)."""
        top = 0 if self.mixed_hidden is None else self.mixed_hidden.shape[0]
        rows, tokens = bucket
        if not (ctx.bs <= rows <= self.cfg.max_bs and ctx.input_num_tokens <= tokens <= top):
            raise ValueError(f"bucket: expected (R, Tb) with bs={ctx.bs} <= R <= "
                             f"{self.cfg.max_bs} and t={ctx.input_num_tokens} <= Tb <= {top} "
                             f"(pad_mixed), got {bucket}")
        return self._run(ctx, self.mixed_hidden[: ctx.input_num_tokens], output_tokens,
                         accept_lengths, False, device_checks=False, bucket=(rows, tokens))

    def zero_dummy_kv(self) -> None:
        """The draft KV's dummy page zeroed (after captures over rows of no token, whose
        hidden states are undefined: what they wrote there must not reach the inert rows that
        read it)."""
        self.kv_pool.zero_dummy_page()

    def on_cycle(self, k: int) -> None:
        """Count a decode cycle (it drafted once, inside the Engine's cycle)."""
        self.stats.calls += 1
        self.stats.decode_calls += 1

    def reset_neutral(self) -> None:
        """The head's kernel path, and the input, draft and next_tokens buffers back to
        neutral values."""
        self._use_head_kernels()
        self._reset_neutral()

    def first_step_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        """`[m, H]`: the first draft step's (pre-norm) hidden state of the given batch rows
        `rows [m]` of the last `run` (a prefill row: at its last token)."""
        return self.bufs.hidden.index_select(0, rows)

    # ------------------------------------------------------------------
    # Public entry point
    # ------------------------------------------------------------------
    def run(self, ctx: ForwardContext, hidden_states: torch.Tensor, output_tokens: torch.Tensor,
            accept_lengths: torch.Tensor, *, copy_output: bool = True) -> torch.Tensor:
        """Draft for the target batch described by `ctx`; returns `[bs, S + 1]` int32: a new
        tensor, or with `copy_output=False` a view of the persistent `next_tokens` buffer (no
        copy launch), valid until the next `run`.

        Accept length 0 on a decode row: the row committed nothing; its output is not drafts
        for the committed text (column 0 is the row's first output token), discard it.
        A batch of mid-chunk prefill rows only (`ctx.all_extends_mid_chunk`) skips the
        multi-step forward: column 0 is each row's next prompt token, column 1 the first
        step's draft, columns 2.. copies of column 0 (README, "Using the drafter")."""
        if not isinstance(copy_output, bool):
            raise ValueError(f"copy_output: expected a bool, got {type(copy_output).__name__}")
        return self._run(ctx, hidden_states, output_tokens, accept_lengths, copy_output,
                         device_checks=True)

    @torch.inference_mode()
    @nvtx_range("drafter")
    def _run(self, ctx: ForwardContext, hidden_states: torch.Tensor,
             output_tokens: torch.Tensor, accept_lengths: torch.Tensor, copy_output: bool, *,
             device_checks: bool, bucket: tuple[int, int] | None = None) -> torch.Tensor:
        """`run`; `device_checks`: the deferred mode's device value checks too; `bucket`: a
        prefill / mixed batch's first step padded to it (`draft_mixed_padded`)."""
        mode = self.cfg.validation_mode
        if mode == "sync":
            self.validate(ctx, hidden_states, output_tokens, accept_lengths)
        elif mode == "deferred":
            self.check_shapes(ctx, hidden_states, output_tokens, accept_lengths)
        bs, n = ctx.bs, self.N
        self.stats.calls += 1
        if bs == 0:
            return self._output(0, copy_output)
        b, ib = self.bufs, self.inputs
        self._use_head_kernels()
        decode = ctx.forward_mode is ForwardMode.DECODE
        pbs = padded_batch_size(self.schedule, bs) or bs  # eager pads too: same numerics

        with nvtx_range("draft_prepare"):
            if decode:  # one launch on the Triton path (the first step writes the rest up to pbs)
                ops.stage_decode_inputs(
                    bs, pbs, n, accept_lengths, output_tokens, hidden_states,
                    accept=b.accept_lengths, first_ids=b.first_input_ids, first_hidden=b.first_hidden,
                    seq_lens=ib.seq_lens, req=ib.req_pool_indices, extend_lens=ib.extend_lens,
                    input_ids=ib.input_ids, positions=ib.positions, out_cache_loc=ib.out_cache_loc,
                    kernels=self.cfg.kernels)
            else:
                self._prepare_mixed_ids(ctx, output_tokens, accept_lengths, bucket)
            if mode == "deferred" and device_checks:
                self._device_checks(ctx)

        if decode:
            self.stats.decode_calls += 1
            with nvtx_range("draft_decode"):
                self.decode_graphs.run(pbs, padded_bs=pbs)
            return self._output(bs, copy_output)

        self.stats.mixed_calls += 1
        with nvtx_range("draft_first_step"):
            self._mixed_first(ctx, hidden_states, bucket)
        if self.S > 1 and not ctx.all_extends_mid_chunk:
            with nvtx_range("draft_multi_step"):
                ib.pad_rows(bs, pbs)  # the first step ran at bs: neutral rows up to pbs
                self._pad_draft_rows(bs, pbs)
                self.multi_step_graphs.run(pbs, padded_bs=pbs)
        elif self.S > 1:
            self.stats.skipped_multi_step += 1
            b.next_tokens[:bs, 2:] = b.next_tokens[:bs, :1]
        return self._output(bs, copy_output)

    def _output(self, bs: int, copy: bool) -> torch.Tensor:
        """`next_tokens[:bs]` `[bs, S + 1]`: cloned, or the persistent view itself."""
        out = self.bufs.next_tokens[:bs]
        return out.clone() if copy else out

    def _prepare_mixed_ids(self, ctx: ForwardContext, output_tokens: torch.Tensor,
                           accept_lengths: torch.Tensor, bucket: tuple[int, int] | None) -> None:
        """A prefill / mixed batch's first-step inputs (`ops.mixed_draft_inputs`, one launch on
        the Triton path): `first_input_ids` (shifted prompt ids, a final chunk's last one its
        output token, then the decode rows' outputs; tokens up to the `bucket`'s Tb id 0),
        `accept_lengths[:bs]`, `row_kind` (prefill, decode, then `ROW_PAD` up to the bucket's
        R) and, with draft controls, `mixed_accepted` (a prefill row's first token into
        column 0, a decode row's N tokens), read with `accept_lengths` by `_accepted`."""
        ne, nd, n, b = ctx.num_extends, ctx.num_decodes, self.N, self.bufs
        t = ctx.input_num_tokens
        rows, tokens = bucket if bucket is not None else (ctx.bs, t)
        ops.mixed_draft_inputs(
            ne, nd, n, t - nd * n, rows, tokens, self.inputs.shifted_prefill_ids,
            self.inputs.extend_lens, output_tokens.contiguous(), accept_lengths.contiguous(),
            ids=b.first_input_ids, accept_out=b.accept_lengths, row_kind=b.row_kind,
            accepted=self.mixed_accepted if self.controls is not None else None,
            kinds=(ROW_PREFILL, ROW_DECODE, ROW_PAD),
            pad_id=NEUTRAL_DRAFT_TOKEN["first_input_ids"], kernels=self.cfg.kernels)

    # ------------------------------------------------------------------
    # Validation. RuntimeConfig.validation: "sync" runs `validate` (host syncs, immediate
    # errors); "deferred" checks shapes on the host and values on the device into the error
    # word `DraftBuffers.err` (no sync; bad values are clamped to safe ones first: token 0,
    # accept in [0, N], the dummy slot 0, seq len >= 1), read by `check_errors()`; "off" none.
    # ------------------------------------------------------------------
    ERR_BITS = {1: ("output_tokens", "token ids in [0, vocab_size)"),
                2: ("accept_lengths", "decode rows in [0, N]"),
                4: ("input_buffers.req_pool_indices", "slots in [0, max_running_requests]"),
                8: ("input_buffers.seq_lens", ">= 1 for every row")}

    def _device_checks(self, ctx: ForwardContext) -> None:
        """Deferred value checks on the staged inputs: OR bits into `err`, sanitize in place."""
        b, ib, bs, ne = self.bufs, self.inputs, ctx.bs, ctx.num_extends
        ids = b.first_input_ids[: ctx.input_num_tokens]
        vocab = self.head.config.vocab_size
        bad_ids = ((ids < 0) | (ids >= vocab)).any()
        acc = b.accept_lengths[ne:bs]
        bad_acc = ((acc < 0) | (acc > self.N)).any()
        req = ib.req_pool_indices[:bs]
        bad_req = ((req < 0) | (req >= self.req_to_page.shape[0])).any()
        bad_seq = (ib.seq_lens[:bs] < 1).any()
        word = bad_ids.int() | (bad_acc.int() << 1) | (bad_req.int() << 2) | (bad_seq.int() << 3)
        b.err |= word
        ids.clamp_(0, vocab - 1)
        acc.clamp_(0, self.N)
        req.copy_(torch.where((req < 0) | (req >= self.req_to_page.shape[0]), 0, req))
        ib.seq_lens[:bs].clamp_(min=1)

    def check_errors(self) -> None:
        """Read the deferred error word (one sync) and raise the ValueError naming the first
        bad argument of any `run` since the last check; resets the word."""
        word = int(self.bufs.err.item())
        if word:
            self.bufs.err.zero_()
            bit = word & -word
            name, expected = self.ERR_BITS[bit]
            raise ValueError(f"{name}: expected {expected} (deferred check of an earlier run; "
                             f"error bits {word:#x})")

    def check_shapes(self, ctx: ForwardContext, hidden_states: torch.Tensor,
                     output_tokens: torch.Tensor, accept_lengths: torch.Tensor) -> None:
        """The host half of `validate`: sizes, shapes, dtypes, devices; reads no device value."""
        self.validate(ctx, hidden_states, output_tokens, accept_lengths, values=False)

    def validate(self, ctx: ForwardContext, hidden_states: torch.Tensor,
                 output_tokens: torch.Tensor, accept_lengths: torch.Tensor,
                 values: bool = True) -> None:
        """Raise ValueError naming the first bad argument; writes nothing. `values=False`:
        the host checks only (no sync)."""
        cfg, n = self.cfg, self.N
        bs, ne, nd = ctx.bs, ctx.num_extends, ctx.num_decodes
        if bs > cfg.max_bs:
            raise ValueError(f"ctx.bs: expected <= max_running_requests ({cfg.max_bs}), got {bs}")
        if ctx.input_num_tokens > cfg.max_num_tokens:
            raise ValueError(f"ctx.input_num_tokens: expected <= {cfg.max_num_tokens}, "
                             f"got {ctx.input_num_tokens}")
        if ctx.input_num_tokens < ne + nd * n:
            raise ValueError(f"ctx.input_num_tokens: expected >= num_extends + num_decodes * "
                             f"{n} = {ne + nd * n}, got {ctx.input_num_tokens}")
        if nd and ne == 0 and ctx.input_num_tokens != bs * n:
            raise ValueError(f"ctx.input_num_tokens: expected bs * {n} = {bs * n} for a decode "
                             f"batch, got {ctx.input_num_tokens}")

        dev = torch.device(self.device.type)  # any device of the runtime's type
        expect_tensor("output_tokens", output_tokens, shape=(ne + nd * n,), dtypes=INDEX_DTYPES,
                      device=dev)
        expect_tensor("accept_lengths", accept_lengths, shape=(bs,), dtypes=INDEX_DTYPES, device=dev)
        expect_tensor("hidden_states", hidden_states,
                      shape=(ctx.input_num_tokens, self.head.target_hidden_width),
                      dtypes=self.head.dtype, device=dev)
        if not values:
            return
        if output_tokens.numel():
            lo, hi = int(output_tokens.min()), int(output_tokens.max())
            if lo < 0 or hi >= self.head.config.vocab_size:
                raise ValueError(f"output_tokens: expected ids in [0, {self.head.config.vocab_size}), "
                                 f"got values in [{lo}, {hi}]")
        if nd:
            acc = accept_lengths[ne:]
            lo, hi = int(acc.min()), int(acc.max())
            if lo < 0 or hi > n:
                raise ValueError(f"accept_lengths: expected decode rows in [0, {n}], "
                                 f"got values in [{lo}, {hi}]")
        ib = self.inputs
        req = ib.req_pool_indices[:bs]
        if bs and (int(req.min()) < 0 or int(req.max()) >= self.req_to_page.shape[0]):
            raise ValueError(f"input_buffers.req_pool_indices: expected slots in "
                             f"[0, {self.req_to_page.shape[0]}) (0: a padded or inert row), "
                             f"got {req.tolist()}")
        if bs and int(ib.seq_lens[:bs].min()) < 1:
            raise ValueError("input_buffers.seq_lens: expected >= 1 for every row")
        if ne:
            npt = ctx.input_num_tokens - nd * n
            lens = ib.extend_lens[:ne]
            if int(lens.min()) < 1 or int(lens.sum()) != npt:
                raise ValueError(f"input_buffers.extend_lens: expected prefill rows >= 1 summing to "
                                 f"{npt}, got {lens.tolist()}")
            shifted = ib.shifted_prefill_ids[:npt]
            if int(shifted.min()) < -1 or int(shifted.max()) >= self.head.config.vocab_size:
                raise ValueError("input_buffers.shifted_prefill_ids: expected ids in "
                                 f"[-1, {self.head.config.vocab_size})")
