"""The serving loop: requests in, tokens out, with EAGLE-3 speculative decoding.

Every token decision lives on the device; the host plans and reads results one step late.
Per-slot state (`graphdraft.runtime.slot_state.SlotState` + `RuntimeStates.valid_cache_lengths`)
holds each request's last verified token, drafts, committed length, sampling parameters,
stop table, emitted count and done flag; the host writes a slot's row only at admission.

A pure decode step is one **cycle** per padded batch size B (`cycle_graphs`, one CUDA graph
replay; the same functions run eagerly under `enforce_eager` / GRAPHDRAFT_EAGER=1):
  prepare   rows' slots (`CycleBuffers.slot_rows`) -> input ids from last_token / drafts,
            positions, KV slots and seq lens from valid_cache_lengths and the page table;
            padded and done rows inert (the dummy slot 0)
  verify    `_target_decode(B)` (its aux hidden states land in the drafter's buffer)
  accept    `graphdraft.kernels.accept` (greedy and sampled rows, stop tokens, max_new)
  draft     the drafter's decode body (first step + multi-step) over the accepted rows
  commit    valid_cache_lengths += accept, last_token, drafts, emitted, done
  pack      tokens, accept, finish, error bits -> `CycleBuffers.pack [max_bs, N + 3]` int32
`cycle_graph=False` runs the same functions as verify graph + eager accept + draft graph +
eager commit (bit-identical). Prefill / mixed steps run eagerly over the same state (prefill
rows written by the host, decode rows prepared on device), so no step needs a sync.

`step()` keeps one step in flight: it plans (retire nothing yet; drop finished rows, admit,
schedule prefill chunks), launches step k, enqueues one non-blocking copy of the pack buffer
into a pinned slot (two slots, each with its own event), then retires step k-1: appends its
tokens, decodes its error bits, finishes requests. `generate()` drains the last step.
Without a draft head the same loop decodes one token per row (target-only).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from capture import CapturedForward, GraphPool, batch_size_schedule, eager_forced, padded_batch_size
from graphdraft.config import RuntimeConfig
from graphdraft.kernels.accept import FINISH_LENGTH, FINISH_STOP, accept_tokens
from graphdraft.kernels.cycle_kernels import (
    ERR_CACHE_LEN,
    ERR_DRAFTS,
    commit_pack,
    neutral_slot0,
    prepare_rows,
)
from graphdraft.kernels.warmup import precompile_engine
from graphdraft.models.attention import PagedAttentionBackend
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.llama import LlamaForCausalLM, TargetOutput
from graphdraft.nvtx import nvtx_range
from graphdraft.runtime.batch import BatchRow, ForwardContext, ForwardMode, write_batch
from graphdraft.runtime.buffers import CycleBuffers, InputBuffers, RuntimeStates
from graphdraft.runtime.drafter import EagleDrafter
from graphdraft.runtime.drafter_protocol import CycleDrafter, Drafter, check_drafter
from graphdraft.runtime.kv_cache import KVPool, OutOfPagesError, PageTable
from graphdraft.runtime.slot_state import SlotState, StopTableFullError
from graphdraft.serving import data_parallel
from graphdraft.serving.metrics import ServingMetrics
from graphdraft.serving.request import Request
from graphdraft.serving.verify import SamplingParams, request_seed

log = logging.getLogger(__name__)

# Error bits of the cycle's prepare: ERR_DRAFTS (1) a candidate token (last verified token or
# draft) outside [0, vocab); ERR_CACHE_LEN (2) a committed length whose next N positions pass
# max_context_len. Bit 1 of the accept kernel (a draft outside [0, vocab)) is the same fault.
_ERR_NAMES = {ERR_DRAFTS: ("drafts", "token ids in [0, vocab_size)"),
              ERR_CACHE_LEN: ("valid_cache_lengths", "committed length + N <= max_context_len")}


def _check_model(name: str, model: torch.nn.Module, cfg: RuntimeConfig,
                 device: torch.device) -> None:
    """The model's dtype and device must be the runtime's (KV pools and buffers follow them)."""
    param = next(model.parameters())
    if param.dtype != cfg.torch_dtype or model.dtype != cfg.torch_dtype:
        raise ValueError(f"{name}: expected dtype {cfg.torch_dtype} (RuntimeConfig.dtype), "
                         f"got {param.dtype}")
    param_device = param.device
    if param_device.type != device.type:
        raise ValueError(f"{name}: expected parameters on {device} (RuntimeConfig.device), "
                         f"got {param_device}")


@dataclass
class EngineStats:
    steps: int = 0
    decode_rows: int = 0
    accepted_tokens: int = 0             # tokens committed by decode rows (accept lengths summed)
    emitted_tokens: int = 0
    prefill_tokens: int = 0

    @property
    def mean_accept_length(self) -> float:
        return self.accepted_tokens / self.decode_rows if self.decode_rows else 0.0


@dataclass
class _Launched:
    """A launched step, retired one step later: its rows' requests and their kind."""

    reqs: list[Request]
    decode: list[bool]                   # False: a prefill row (one token column, or none)
    emits: list[bool]                    # the row counts in its request's `in_flight`
    ring: int                            # pinned slot holding its pack
    event: object | None


class Engine:
    def __init__(self, target: LlamaForCausalLM, cfg: RuntimeConfig,
                 head: Eagle3DraftHead | None = None, *, drafter=None,
                 eos_token_id: int | None = None, seed: int | None = None) -> None:
        """`head`: an EAGLE-3 head (an `EagleDrafter` is built for it); or `drafter`: any
        object meeting `graphdraft.runtime.drafter_protocol.Drafter` (its `run(ctx, hidden,
        output_tokens, accept_lengths)` runs eagerly inside every step, no cycle graph, unless
        it is a `CycleDrafter`; anything else: ValueError naming `drafter`). `seed` seeds
        sampled requests that carry none (pass the same on every tensor-parallel rank so that
        ranks sample alike)."""
        tc = target.config
        # The pool's size is fixed here, once: `num_kv_pages` or what `kv_cache_memory_gb` pays for.
        cfg = cfg.replace(num_kv_pages=cfg.kv_pages(tc.kv_bytes_per_token(target.dtype)) - 1)
        self.target, self.cfg, self.eos_token_id = target, cfg, eos_token_id
        if tc.max_position_embeddings < cfg.max_context_len:
            raise ValueError(f"max_context_len: expected <= the target's max_position_embeddings "
                             f"({tc.max_position_embeddings}), got {cfg.max_context_len}")
        self.device = torch.device(cfg.device)
        _check_model("target", target, cfg, self.device)
        if head is not None:
            _check_model("head", head, cfg, self.device)
        if head is not None and drafter is not None:
            raise ValueError("drafter: expected either head or drafter, not both")
        if drafter is not None:
            check_drafter(drafter)  # before anything (the target's kernel path) is changed
        self.n_row = cfg.spec_num_tokens if (head is not None or drafter is not None) else 1
        self.pages = PageTable(cfg.max_running_requests, cfg.max_pages_per_req, cfg.total_kv_pages,
                               cfg.page_size, self.device)
        self.kv = KVPool(tc.num_hidden_layers, cfg.total_kv_pages, cfg.page_size,
                         tc.num_key_value_heads, tc.head_dim, target.dtype, self.device)
        self.inputs, self.states = InputBuffers.allocate(cfg), RuntimeStates.allocate(cfg)
        self.slots = SlotState.allocate(cfg.max_running_requests + 1, cfg.speculative_num_steps,
                                        cfg.stop_table_width, self.device)
        self.cycle = CycleBuffers.allocate(cfg, self.n_row)
        self.backend = PagedAttentionBackend(self.pages.req_to_page, cfg.page_size,
                                             cfg.max_context_len, cfg.use_triton)
        target.set_use_triton(cfg.use_triton)
        self.graph_pool = GraphPool()
        self.schedule = batch_size_schedule(cfg.cuda_graph_max_bs, cfg.cuda_graph_bs)
        enabled = not (cfg.enforce_eager or eager_forced()) and self.device.type == "cuda"
        # Under tensor parallelism a size dropped on one rank alone would desynchronise the
        # ranks' collectives: raise instead of dropping.
        on_oom = "raise" if getattr(target, "tp", None) is not None else "drop"
        self.verify_graphs = CapturedForward("target_verify", self._target_decode, self.schedule,
                                             pool=self.graph_pool, enabled=enabled, on_oom=on_oom)
        self.drafter: Drafter | None = drafter
        if head is not None:
            if head.config.num_aux_hidden_states * head.config.hidden_size != target.aux_hidden_width:
                raise ValueError("head: its fc input width (k * H) does not match the target's "
                                 f"aux hidden width ({target.aux_hidden_width})")
            self.drafter = EagleDrafter(head, cfg, req_to_page=self.pages.req_to_page,
                                        input_buffers=self.inputs, runtime_states=self.states,
                                        graph_pool=self.graph_pool, on_oom=on_oom)
        # the drafter whose decode draft runs inside the cycle graph (None: `run` eagerly)
        self._cycle_drafter: CycleDrafter | None = (
            self.drafter if self.drafter is not None and self.drafter.supports_cycle else None)
        self._own_drafter = self.drafter is None or self._cycle_drafter is not None
        # Data-parallel attention (graphdraft.serving.data_parallel): None unless a model's dense
        # layers were split with shard_dense_ (dp_size > 1); then `step` runs in lock-step.
        self.dp = self._data_parallel(target, head, cfg)
        self._lockstep = None      # this step's data_parallel.StepPlan (inside `_launch`)
        self._lockstep_work = True  # some rank had work at the last step's agreement
        self.cycle_graphs = CapturedForward("spec_cycle", self._spec_cycle, self.schedule,
                                            pool=self.graph_pool, on_oom=on_oom,
                                            enabled=enabled and self._own_drafter and cfg.cycle_graph)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._rids = itertools.count()
        self._seeds = torch.Generator()
        if seed is not None:
            self._seeds.manual_seed(seed)
        else:
            self._seeds.seed()
        self._seed_uses: dict[int, int] = {}
        self._staged_rows: list[int] | None = None
        self._in_flight: deque[_Launched] = deque()
        self._ring = 0
        pin = self.device.type == "cuda"
        shape = self.cycle.pack.shape
        self._pinned = [torch.zeros(shape, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._events = [torch.cuda.Event(blocking=True) if pin else None for _ in range(2)]
        self.stats = EngineStats()
        self.metrics = ServingMetrics()

    def _data_parallel(self, target, head, cfg: RuntimeConfig):
        """The models' `DataParallel` (None: dp_size 1, today's code path); ValueError when
        it disagrees with `cfg.dp_size`, between the models, or with a caller's drafter."""
        dps = {id(d): d for d in (getattr(target, "dp", None), getattr(head, "dp", None))
               if d is not None}
        if len(dps) > 1:
            raise ValueError("head: expected the target's DataParallel group (or none)")
        dp = next(iter(dps.values()), None)
        size = 1 if dp is None else dp.world_size
        if cfg.dp_size != size:
            raise ValueError(f"dp_size: expected the models' data-parallel size ({size}: "
                             f"data_parallel.shard_dense_), got {cfg.dp_size}")
        if dp is not None and not self._own_drafter:
            raise ValueError("drafter: data parallelism needs the built-in EAGLE drafter (head)")
        return dp

    def state_snapshot(self) -> dict[str, torch.Tensor]:
        """Clones of the per-slot device state a cycle commits (valid_cache_lengths and the
        `SlotState` tables). A benchmark that replays `cycle_graphs` alone advances the
        requests at every replay (commit); `restore_state` puts them back between replays."""
        snap = {f"slots.{k}": v.clone() for k, v in vars(self.slots).items()}
        snap["valid_cache_lengths"] = self.states.valid_cache_lengths.clone()
        return snap

    def restore_state(self, snap: dict[str, torch.Tensor]) -> None:
        """Copy a `state_snapshot` back in place (stream-ordered; no sync)."""
        for k, v in vars(self.slots).items():
            v.copy_(snap[f"slots.{k}"])
        self.states.valid_cache_lengths.copy_(snap["valid_cache_lengths"])

    @property
    def pinned_packs(self) -> list[torch.Tensor]:
        """The two pinned host copies `[max_bs, N + 3]` int32 of `cycle.pack` (one per step
        parity; a step's rows are valid once its event completed: `drain()` waits)."""
        return self._pinned

    # ------------------------------------------------------------------
    # Graphs
    # ------------------------------------------------------------------
    @torch.inference_mode()
    def capture_graphs(self, progress: bool = True, parallel_precompile: bool = False) -> None:
        """Compile the Triton kernels each size bucket needs (`precompile_engine`), then capture
        the target's verify forward, the drafter's forwards and the cycle (largest
        bs first). Warm-up and capture run inert rows only (slot 0); every table is neutral after."""
        if self.dp is not None and parallel_precompile:
            raise ValueError("parallel_precompile: expected False under data parallelism (two "
                             "threads would interleave the ranks' collectives)")
        self.drain()
        self._reset_neutral()
        # Every Triton variant, once per size bucket (`parallel_precompile`: two threads).
        precompile_engine(self, progress=progress, parallel=parallel_precompile)
        self._reset_neutral()
        self.verify_graphs.capture(progress=progress)
        if self.drafter is not None:
            self.drafter.capture_graphs(progress=progress)
        self._reset_neutral()
        self.cycle_graphs.capture(progress=progress)
        self._reset_neutral()
        if self.dp is not None:  # every rank keeps the sizes every rank captured
            data_parallel.agree_captured(self)

    def _reset_neutral(self) -> None:
        self.inputs.pad_rows(0, self.cfg.max_bs)
        self.inputs.pad_tokens(0, self.cfg.max_bs * self.n_row)
        self.cycle.reset()
        self._staged_rows = None
        if self._cycle_drafter is not None:
            self._cycle_drafter.reset_neutral()
        self._neutral_slot0()

    def _captured_forwards(self) -> list[CapturedForward]:
        forwards = [self.cycle_graphs, self.verify_graphs]
        if self._cycle_drafter is not None:
            forwards += [self._cycle_drafter.decode_graphs, self._cycle_drafter.multi_step_graphs]
        return forwards

    def graph_summary(self) -> dict[str, tuple[int, int]]:
        """Per captured forward: (graph replays, eager runs)."""
        return {f.name: (f.stats.total_replays, f.stats.total_eager)
                for f in self._captured_forwards()}

    def metrics_snapshot(self) -> dict:
        """`ServingMetrics.snapshot()` with every captured forward's graph statistics."""
        return self.metrics.snapshot([f.stats for f in self._captured_forwards()])

    # ------------------------------------------------------------------
    # Requests
    # ------------------------------------------------------------------
    def _lookahead(self) -> int:
        return self.n_row + self.cfg.speculative_num_steps

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        stops = list(dict.fromkeys(params.stop_token_ids))
        if self.eos_token_id is not None and not params.ignore_eos and self.eos_token_id not in stops:
            stops.insert(0, self.eos_token_id)
        return stops

    def add_request(self, prompt: list[int], params: SamplingParams | None = None) -> Request:
        """Queue a request; raises ValueError (and queues nothing) when it can never be served.

        Seeds of sampled requests (`verify.request_seed`): without `params.seed` one drawn
        from the Engine's `seed`; with it, derived from (seed, how many earlier requests of
        this Engine carried the same seed), so requests sharing one SamplingParams get
        distinct streams and the same sequence of requests reproduces the same tokens."""
        params = self.check_request(prompt, params)
        req = Request(next(self._rids), list(prompt), params)
        if not params.greedy:
            if params.seed is None:
                req.seed = int(torch.randint(2**62, (), generator=self._seeds))
            else:
                k = self._seed_uses.get(params.seed, 0)
                self._seed_uses[params.seed] = k + 1
                req.seed = request_seed(params.seed, k)
        self.waiting.append(req)
        self.metrics.on_request_added(req.rid, time.perf_counter())
        return req

    def check_request(self, prompt: list[int], params: SamplingParams | None = None
                      ) -> SamplingParams:
        """Raise ValueError naming the argument when `prompt` / `params` can never be served;
        returns the params to use (defaults for None). Changes nothing."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        vocab = self.target.config.vocab_size
        if not prompt or not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt: expected a non-empty list of token ids in [0, {vocab})")
        stops = self._stop_ids(params)
        if len(stops) > self.cfg.stop_table_width:
            raise StopTableFullError(
                f"params.stop_token_ids: expected at most {self.cfg.stop_table_width} stop ids "
                f"with EOS (RuntimeConfig.stop_table_width), got {len(stops)}")
        need = len(prompt) + params.max_new_tokens + self._lookahead()
        if need > self.cfg.max_context_len:
            raise ValueError(f"prompt: {len(prompt)} tokens + max_new_tokens "
                             f"{params.max_new_tokens} + look-ahead {self._lookahead()} exceed "
                             f"max_context_len ({self.cfg.max_context_len})")
        if self.pages.pages_needed(None, need) > self.pages.num_pages - 1:
            raise ValueError(f"prompt: needs {self.pages.pages_needed(None, need)} KV pages, the "
                             f"pool has {self.pages.num_pages - 1}")
        return params

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            need = len(req.prompt) + req.params.max_new_tokens + self._lookahead()
            if self.pages.pages_needed(None, need) > self.pages.num_free_pages:
                break  # back-pressure: wait for running requests to finish
            slot = self.pages.alloc_slot()
            try:
                self.pages.reserve(slot, need)
            except OutOfPagesError:
                self.pages.free(slot)
                break
            p = req.params
            self.slots.admit(slot, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                             seed=req.seed, stop_ids=self._stop_ids(p), max_new=p.max_new_tokens)
            req.slot = slot
            self.waiting.popleft()
            self.running.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight)

    @property
    def keep_stepping(self) -> bool:
        """Whether a serving loop should call `step()` again: `has_work`; data-parallel, whether
        any rank had work at the last step's agreement (ranks stop together; True before the
        first step, so a rank without requests joins its peers' steps)."""
        return self.has_work if self.dp is None else self._lockstep_work

    # ------------------------------------------------------------------
    # Target forwards
    # ------------------------------------------------------------------
    def _target_decode(self, bs: int) -> TargetOutput:
        """Target forward over a decode batch of `bs` rows x n_row tokens (graph-capturable)."""
        t, n, ib = bs * self.n_row, self.n_row, self.inputs
        meta = self.backend.uniform_row_metadata(ib.req_pool_indices[:bs], ib.seq_lens[:bs], n)
        # the aux hidden states go straight into the drafter's input buffer (no copy in its run)
        aux_out = self.drafter.decode_hidden_buffer(bs) if self.drafter is not None else None
        if aux_out is not None and aux_out.dtype != self.target.embed_tokens.dtype:
            aux_out = None
        return self.target(ib.input_ids[:t], ib.positions[:t], ib.out_cache_loc[:t], self.kv,
                           self.backend, meta, None, capture_aux=self.drafter is not None,
                           aux_out=aux_out)

    def _target_forward(self, ctx: ForwardContext, rows: list[BatchRow]) -> TargetOutput:
        ib, bs = self.inputs, ctx.bs
        if ctx.forward_mode is ForwardMode.DECODE:
            pbs = padded_batch_size(self.schedule, bs) or bs
            ib.pad_rows(bs, pbs)
            ib.pad_tokens(bs * self.n_row, pbs * self.n_row)
            out = self.verify_graphs.run(pbs, padded_bs=pbs)
            t = bs * self.n_row
            aux = out.aux_hidden[:t] if out.aux_hidden is not None else None
            return TargetOutput(out.logits[:t], aux)
        t = ctx.input_num_tokens
        meta = self.backend.row_metadata(ib.req_pool_indices[:bs], ib.seq_lens[:bs],
                                         ib.extend_lens[:bs], max(len(r.input_ids) for r in rows))
        logit_rows, tok = [], 0
        for r in rows:
            if r.is_prefill:
                logit_rows.append(tok + len(r.input_ids) - 1)
            else:
                logit_rows.extend(range(tok, tok + self.n_row))
            tok += len(r.input_ids)
        idx = torch.tensor(logit_rows, dtype=torch.int64)
        idx = (idx.pin_memory() if self.device.type == "cuda" else idx).to(self.device,
                                                                           non_blocking=True)
        return self.target(ib.input_ids[:t], ib.positions[:t], ib.out_cache_loc[:t], self.kv,
                           self.backend, meta, idx, capture_aux=self.drafter is not None)

    # ------------------------------------------------------------------
    # The cycle's device functions (run eagerly or captured; identical code)
    # ------------------------------------------------------------------
    def _prepare(self, row0: int, tok0: int, rows: int) -> None:
        """Decode rows [row0, row0 + rows) from `slot_rows` into `InputBuffers` (N tokens each
        from token tok0): ids from last_token / drafts, positions and KV slots from
        valid_cache_lengths and the page table. Padded (slot 0), done and bad rows are inert:
        the dummy slot 0 at positions 0..N-1. Sets `err` of these rows (fresh each step).
        (`graphdraft.kernels.cycle_kernels.prepare_rows`: one launch on the Triton path.)"""
        n, ib, st, cb = self.n_row, self.inputs, self.slots, self.cycle
        t = rows * n
        prepare_rows(cb.slot_rows[row0: row0 + rows], n, done=st.done,
                     vcl=self.states.valid_cache_lengths, last_token=st.last_token,
                     drafts=st.drafts, req_to_page=self.pages.req_to_page,
                     page_size=self.cfg.page_size, max_context_len=self.cfg.max_context_len,
                     vocab=self.target.config.vocab_size, input_ids=ib.input_ids[tok0: tok0 + t],
                     positions=ib.positions[tok0: tok0 + t],
                     out_cache_loc=ib.out_cache_loc[tok0: tok0 + t],
                     req=ib.req_pool_indices[row0: row0 + rows],
                     seq_lens=ib.seq_lens[row0: row0 + rows],
                     extend_lens=ib.extend_lens[row0: row0 + rows], err=cb.err[row0: row0 + rows],
                     use_triton=self.cfg.use_triton)

    def _tokens_buffer(self, rows: int) -> torch.Tensor:
        """Where a decode cycle's accepted tokens go `[rows, N]`: the drafter's first-step ids
        (no staging copy) or the engine's own buffer."""
        if self._cycle_drafter is not None:
            return self._cycle_drafter.cycle_tokens(rows)
        return self.cycle.tokens[: rows * self.n_row].view(rows, self.n_row)

    def _draft_accept_buffer(self) -> torch.Tensor:
        if self._cycle_drafter is not None:
            return self._cycle_drafter.cycle_accept_lengths()
        return self.cycle.draft_accept

    def _accept(self, row0: int, tok0: int, rows: int, n: int, logits: torch.Tensor,
                slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """The accept kernel over rows [row0, row0 + rows) whose logits are `logits [rows * n, V]`;
        `slots`: the rows' slots as prepared (0 for padded, done and flagged rows: inert)."""
        cb = self.cycle
        cand = self.inputs.input_ids[tok0: tok0 + rows * n].view(rows, n)
        accept_tokens(logits, cand, slots, self.inputs.seq_lens[row0: row0 + rows], self.slots,
                      tokens=tokens, accept=cb.accept[row0: row0 + rows],
                      draft_accept=self._draft_accept_buffer()[row0: row0 + rows],
                      finish=cb.finish[row0: row0 + rows], err=cb.err[row0: row0 + rows],
                      use_triton=self.cfg.use_triton)

    def _commit(self, row0: int, rows: int, tokens: torch.Tensor, next_tokens: torch.Tensor | None,
                prefill: bool) -> None:
        """State after the step for rows [row0, row0 + rows): valid_cache_lengths (decode:
        += accept; prefill rows: their seq len), last_token, drafts, emitted, done; then the
        rows' pack (tokens, accept, finish, error bits). Rows that accepted nothing (inert,
        mid-chunk) change no slot's tokens (`cycle_kernels.commit_pack`, one launch)."""
        cb, st, ib = self.cycle, self.slots, self.inputs
        sl = slice(row0, row0 + rows)
        commit_pack(tokens, next_tokens[:rows] if next_tokens is not None else None,
                    accept=cb.accept[sl], finish=cb.finish[sl], err=cb.err[sl],
                    req=ib.req_pool_indices[sl], seq_lens=ib.seq_lens[sl],
                    vcl=self.states.valid_cache_lengths, last_token=st.last_token,
                    drafts=st.drafts, emitted=st.emitted, done=st.done, pack=cb.pack[sl],
                    prefill=prefill, use_triton=self.cfg.use_triton)

    def _neutral_slot0(self) -> None:
        st = self.slots
        neutral_slot0(self.states.valid_cache_lengths, st.last_token, st.drafts, st.emitted,
                      st.done)

    def _spec_cycle(self, bs: int) -> torch.Tensor:
        """One decode cycle over `bs` staged rows (graph-capturable); returns pack[:bs]."""
        self._prepare(0, 0, bs)
        out = self._target_decode(bs)
        tokens = self._tokens_buffer(bs)
        self._accept(0, 0, bs, self.n_row, out.logits, self.inputs.req_pool_indices[:bs], tokens)
        nxt = None
        if self._cycle_drafter is not None:
            nxt = self._cycle_drafter.draft_staged(bs)
        self._commit(0, bs, tokens, nxt, prefill=False)
        return self.cycle.pack[:bs]

    def _split_cycle(self, bs: int, pbs: int) -> None:
        """The same cycle as verify graph, eager accept, draft graph (or any drafter's run),
        eager commit and pack."""
        self._prepare(0, 0, pbs)
        out = self.verify_graphs.run(pbs, padded_bs=pbs)
        tokens = self._tokens_buffer(pbs)
        self._accept(0, 0, pbs, self.n_row, out.logits, self.inputs.req_pool_indices[:pbs],
                     tokens)
        nxt = None
        if self._cycle_drafter is not None:
            nxt = self._cycle_drafter.decode_graphs.run(pbs, padded_bs=pbs)
        elif self.drafter is not None:
            ctx = ForwardContext(bs=bs, num_extends=0, input_num_tokens=bs * self.n_row)
            aux = out.aux_hidden[: bs * self.n_row] if out.aux_hidden is not None else None
            nxt = self.drafter.run(ctx, aux, tokens[:bs].reshape(-1), self.cycle.draft_accept[:bs])
            nxt = torch.cat([nxt, torch.zeros(pbs - bs, nxt.shape[1], dtype=nxt.dtype,
                                              device=nxt.device)]) if pbs > bs else nxt
        self._commit(0, pbs, tokens, nxt, prefill=False)

    # ------------------------------------------------------------------
    # One step
    # ------------------------------------------------------------------
    def _schedule(self) -> tuple[list[BatchRow], list[Request], list[Request]]:
        """-> prefill rows (host-written), their requests, decode requests (device-prepared)."""
        prefill = [r for r in self.running if r.prefilling]
        # every launched live row emits >= 1 token: a request whose in-flight steps reach
        # max_new_tokens is certainly done on device; it is not scheduled again (no inert row)
        decode = [r for r in self.running if not r.prefilling
                  and len(r.output) + r.in_flight < r.params.max_new_tokens]
        budget = self.cfg.max_num_batched_tokens - len(decode) * self.n_row
        rows, reqs = [], []
        for r in prefill:
            if budget <= 0:
                break
            end = min(len(r.prompt), r.committed + budget)
            ids = r.prompt[r.committed:end]
            nxt = r.prompt[r.committed + 1: end + 1]
            nxt += [-1] * (len(ids) - len(nxt))
            rows.append(BatchRow(r.slot, r.committed, ids, True, nxt))
            reqs.append(r)
            budget -= len(ids)
        return rows, reqs, decode

    def _stage_rows(self, slots: list[int]) -> None:
        """Write `slot_rows[:len(slots)]` (one H2D copy) when the rows changed."""
        if slots == self._staged_rows:
            return
        src = torch.tensor(slots, dtype=torch.int64)
        if self.device.type == "cuda":
            src = src.pin_memory()
        self.cycle.slot_rows[: len(slots)].copy_(src.to(self.device, non_blocking=True))
        self._staged_rows = list(slots)

    def _host_tensor(self, values: list[int]) -> torch.Tensor:
        src = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            src = src.pin_memory()
        return src.to(self.device, non_blocking=True)

    @torch.inference_mode()
    @nvtx_range("engine_step")
    def step(self) -> list[Request]:
        """Plan and launch one step, then retire the previous one; returns the requests that
        finished (as read back: one step late). With `validation="sync"` the launched step is
        retired at once (a sync per step; immediate errors)."""
        if self.dp is not None:  # data-parallel: the ranks agree on the step first
            return data_parallel.lockstep_step(self)
        self._admit()
        rows, preqs, dreqs = self._schedule()
        launched = False
        if rows or dreqs:
            with nvtx_range("launch"):
                self._launch(rows, preqs, dreqs)
            launched = True
        finished: list[Request] = []
        keep = 1 if launched and self.cfg.validation_mode != "sync" else 0
        while len(self._in_flight) > keep:
            finished += self._retire(self._in_flight.popleft())
        return finished

    def drain(self) -> list[Request]:
        """Retire every launched step (waits for the device)."""
        finished: list[Request] = []
        while self._in_flight:
            finished += self._retire(self._in_flight.popleft())
        return finished

    def _launch(self, rows: list[BatchRow], preqs: list[Request], dreqs: list[Request]) -> None:
        ne, nd = len(rows), len(dreqs)
        bs = ne + nd
        plan = self._lockstep  # data-parallel: the step all ranks agreed on (else None)
        if ne == 0 and (plan is None or not plan.mixed):
            pbs = (padded_batch_size(self.schedule, bs) or bs) if plan is None else plan.padded_bs
            self._stage_rows([r.slot for r in dreqs] + [0] * (pbs - bs))
            if self._own_drafter and self.cfg.cycle_graph:
                self.cycle_graphs.run(pbs, padded_bs=pbs)
            else:
                self._split_cycle(bs, pbs)
            if self._cycle_drafter is not None:  # it drafted once, inside the cycle
                self._cycle_drafter.stats.calls += 1
                self._cycle_drafter.stats.decode_calls += 1
        else:
            self._mixed_step(rows, preqs, dreqs)
        ring = self._ring
        self._ring ^= 1
        pinned = self._pinned[ring]
        pinned[:bs].copy_(self.cycle.pack[:bs], non_blocking=True)
        event = self._events[ring]
        if event is not None:
            event.record()
        for row, r in zip(rows, preqs, strict=True):
            r.committed = row.end
            r.in_flight += row.end == len(r.prompt)  # its first token
            self.stats.prefill_tokens += len(row.input_ids)
        for r in dreqs:
            r.in_flight += 1
        self.stats.steps += 1
        emits = [row.end == len(r.prompt) for row, r in zip(rows, preqs, strict=True)] + [True] * nd
        self._in_flight.append(_Launched(preqs + dreqs, [False] * ne + [True] * nd, emits, ring,
                                         event))

    def _mixed_step(self, rows: list[BatchRow], preqs: list[Request], dreqs: list[Request]) -> None:
        """A prefill / mixed step, eager: prefill rows from the host, decode rows prepared on
        device from the same state as the cycle; the same accept, commit and pack."""
        n, ne, nd = self.n_row, len(rows), len(dreqs)
        bs = ne + nd
        ib, cb = self.inputs, self.cycle
        pctx = write_batch(ib, self.pages, rows)
        npt = pctx.input_num_tokens
        self._stage_rows([r.slot for r in preqs] + [r.slot for r in dreqs])
        if nd:
            self._prepare(ne, npt, nd)
        ctx = ForwardContext(bs=bs, num_extends=ne, input_num_tokens=npt + nd * n,
                             all_extends_mid_chunk=pctx.all_extends_mid_chunk and nd == 0)
        if self._lockstep is not None:  # data-parallel: the multi-step skip is decided globally
            ctx.all_extends_mid_chunk = self._lockstep.all_mid_chunk
        all_rows = rows + [BatchRow(r.slot, 0, [0] * n, False) for r in dreqs]
        out = self._target_forward(ctx, all_rows)
        # prefill rows: one token after a request's last chunk (slot 0 for the others)
        final = [r.slot if row.end == len(r.prompt) else 0 for row, r in zip(rows, preqs, strict=True)]
        tokens = cb.tokens
        cb.err[:ne] = 0
        p_tok = tokens[:ne].view(ne, 1)
        self._accept(0, 0, ne, 1, out.logits[:ne], self._host_tensor(final), p_tok)
        d_tok = tokens[ne: ne + nd * n].view(nd, n)
        if nd:
            self._accept(ne, npt, nd, n, out.logits[ne:], ib.req_pool_indices[ne: ne + nd], d_tok)
        nxt = None
        if self.drafter is not None:
            accept = self._draft_accept_buffer()[:bs].clone()
            accept[:ne] = 1
            kw = {"copy_output": False} if self._cycle_drafter is not None else {}
            nxt = self.drafter.run(ctx, out.aux_hidden, tokens[: ne + nd * n], accept, **kw)
        self._commit(0, ne, p_tok, nxt[:ne] if nxt is not None else None, prefill=True)
        if nd:
            self._commit(ne, nd, d_tok, nxt[ne:bs] if nxt is not None else None, prefill=False)

    # ------------------------------------------------------------------
    # Retirement (host, one step late)
    # ------------------------------------------------------------------
    def _retire(self, step: _Launched) -> list[Request]:
        if step.event is not None:
            step.event.synchronize()
        data = self._pinned[step.ring][: len(step.reqs)].tolist()
        n = self.n_row
        finished, errors = [], []
        for r, decode, emits, row in zip(step.reqs, step.decode, step.emits, data, strict=True):
            r.in_flight -= emits
            if r.finished:
                continue  # aborted (or failed) after this step was launched
            a, fin, err = row[n], row[n + 1], row[n + 2]
            if err and self.cfg.validation_mode != "off":
                errors.append((r, err))
                continue
            new = row[:a]
            if decode:
                self.stats.decode_rows += 1
                self.stats.accepted_tokens += a
                self.metrics.on_decode_accept(a)
            if new:
                r.output.extend(new)
                r.last_verified = new[-1]
                self.stats.emitted_tokens += len(new)
                self.metrics.on_tokens(r.rid, len(new), time.perf_counter())
            if fin:
                r.finish_reason = "stop" if fin == FINISH_STOP else "length"
                assert fin in (FINISH_STOP, FINISH_LENGTH)
                finished.append(r)
        for r in finished:
            self._release(r)
        if errors:
            for r, _ in errors:
                r.finish_reason = "error"
                self._release(r)
            r, err = errors[0]
            bit = err & -err
            name, expected = _ERR_NAMES.get(bit, ("error bits", "0"))
            raise ValueError(f"{name}: expected {expected} for request {r.rid} (slot {r.slot}); "
                             f"the request was aborted (error bits {err:#x}, "
                             f"{len(errors)} request(s) flagged)")
        return finished

    def _release(self, r: Request) -> None:
        self.metrics.on_request_finished(r.rid)
        self.running.remove(r)
        self.pages.free(r.slot)
        self.states.valid_cache_lengths[r.slot] = 0
        self.slots.release(r.slot)
        r.slot = None

    def abort(self, r: Request) -> None:
        """Drop a waiting or running request; its pages return to the pool (a step already in
        flight treats its row as inert or writes only within the request's reservation)."""
        if r in self.waiting:
            self.waiting.remove(r)
        elif r in self.running:
            self._release(r)
        r.finish_reason = r.finish_reason or "abort"

    # ------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[list[int]]:
        """Serve every prompt to completion; returns each request's output tokens.

        Every prompt is checked before any is queued: a bad one raises ValueError (naming
        its index) and leaves the engine's queue as it was."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: expected one SamplingParams per prompt ({len(prompts)}), "
                             f"got {len(plist)}")
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
            try:
                self.check_request(p, sp)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=sum(r.params.max_new_tokens for r in reqs), desc="tokens", unit="tok")
        self._lockstep_work = True
        while self.keep_stepping:
            before = self.stats.emitted_tokens
            self.step()
            if bar is not None:
                bar.update(self.stats.emitted_tokens - before)
        self.drain()
        if bar is not None:
            bar.close()
        return [r.output for r in reqs]
