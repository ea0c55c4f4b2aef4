"""The serving loop: requests in, tokens out, with EAGLE-3 speculative decoding.

Each `step()`:
  1. admit waiting requests while a request slot and their KV pages are free
     (pages for the whole request are reserved up front: a running request
     never runs out; new work queues instead),
  2. schedule prefill chunks (first) and decode rows (N tokens each),
  3. run the target (a replayed CUDA graph for pure decode batches),
  4. verify (greedy or rejection sampling) and run the drafter,
  5. commit accepted tokens, stop on EOS / max_new_tokens, free finished requests.

Without a draft head the same loop decodes one token per row (target-only).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from capture import CapturedForward, GraphPool, batch_size_schedule, eager_forced, padded_batch_size
from graphdraft.attention import PagedAttentionBackend
from graphdraft.batch import BatchRow, ForwardContext, ForwardMode, write_batch
from graphdraft.buffers import InputBuffers, RuntimeStates
from graphdraft.config import RuntimeConfig
from graphdraft.drafter import EagleDrafter
from graphdraft.eagle3 import Eagle3DraftHead
from graphdraft.kv_cache import KVPool, OutOfPagesError, PageTable
from graphdraft.llama import LlamaForCausalLM, TargetOutput
from graphdraft.metrics import ServingMetrics
from graphdraft.nvtx import nvtx_range
from graphdraft.verify import SamplingParams, sample_tokens, verify_greedy, verify_sampled

log = logging.getLogger(__name__)


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
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    committed: int = 0                   # KV positions committed
    last_verified: int | None = None
    drafts: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    generator: torch.Generator | None = None

    @property
    def prefilling(self) -> bool:
        return self.committed < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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


class Engine:
    def __init__(self, target: LlamaForCausalLM, cfg: RuntimeConfig,
                 head: Eagle3DraftHead | None = None, *, drafter=None,
                 eos_token_id: int | None = None, seed: int | None = None) -> None:
        """`head`: an EAGLE-3 head (an `EagleDrafter` is built for it); or `drafter`: any
        object with the drafter's `run(ctx, hidden, output_tokens, accept_lengths)`.
        `seed` seeds sampled requests that carry none (pass the same on every
        tensor-parallel rank so that ranks sample alike)."""
        self.target, self.cfg, self.eos_token_id = target, cfg, eos_token_id
        tc = target.config
        if tc.max_position_embeddings < cfg.max_context_len:
            raise ValueError(f"max_context_len: expected <= the target's max_position_embeddings "
                             f"({tc.max_position_embeddings}), got {cfg.max_context_len}")
        self.device = torch.device(cfg.device)
        _check_model("target", target, cfg, self.device)
        if head is not None:
            _check_model("head", head, cfg, self.device)
        if head is not None and drafter is not None:
            raise ValueError("drafter: expected either head or drafter, not both")
        self.n_row = cfg.spec_num_tokens if (head is not None or drafter is not None) else 1
        self.pages = PageTable(cfg.max_running_requests, cfg.max_pages_per_req, cfg.total_kv_pages,
                               cfg.page_size, self.device)
        self.kv = KVPool(tc.num_hidden_layers, cfg.total_kv_pages, cfg.page_size,
                         tc.num_key_value_heads, tc.head_dim, target.dtype, self.device)
        self.inputs, self.states = InputBuffers.allocate(cfg), RuntimeStates.allocate(cfg)
        self.backend = PagedAttentionBackend(self.pages.req_to_page, cfg.page_size,
                                             cfg.max_context_len, cfg.use_triton)
        target.set_use_triton(cfg.use_triton)
        t = cfg.max_num_tokens
        self._tok_req = torch.zeros(t, dtype=torch.int64, device=self.device)
        self._tok_kv = torch.ones(t, dtype=torch.int32, device=self.device)
        self._tok_row = torch.arange(t, device=self.device) // self.n_row
        self._tok_j = torch.arange(t, device=self.device) % self.n_row
        self.graph_pool = GraphPool()
        self.schedule = batch_size_schedule(cfg.cuda_graph_max_bs, cfg.cuda_graph_bs)
        enabled = not (cfg.enforce_eager or eager_forced()) and self.device.type == "cuda"
        # Under tensor parallelism a size dropped on one rank alone would desynchronise the
        # ranks' collectives: raise instead of dropping.
        on_oom = "raise" if getattr(target, "tp", None) is not None else "drop"
        self.verify_graphs = CapturedForward("target_verify", self._target_decode, self.schedule,
                                             pool=self.graph_pool, enabled=enabled, on_oom=on_oom)
        self.drafter = drafter
        if head is not None:
            if head.config.num_aux_hidden_states * head.config.hidden_size != target.aux_hidden_width:
                raise ValueError("head: its fc input width (k * H) does not match the target's "
                                 f"aux hidden width ({target.aux_hidden_width})")
            self.drafter = EagleDrafter(head, cfg, req_to_page=self.pages.req_to_page,
                                        input_buffers=self.inputs, runtime_states=self.states,
                                        graph_pool=self.graph_pool, on_oom=on_oom)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._rids = itertools.count()
        self._seeds = torch.Generator()
        if seed is not None:
            self._seeds.manual_seed(seed)
        else:
            self._seeds.seed()
        self.stats = EngineStats()
        self.metrics = ServingMetrics()

    # ------------------------------------------------------------------
    # Graphs
    # ------------------------------------------------------------------
    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture the target's verify forward and the drafter's forwards (largest bs first)."""
        self.inputs.pad_rows(0, self.cfg.max_bs)
        self.inputs.pad_tokens(0, self.cfg.max_bs * self.n_row)
        self.verify_graphs.capture()
        if isinstance(self.drafter, EagleDrafter):
            self.drafter.capture_graphs()

    def _captured_forwards(self) -> list[CapturedForward]:
        forwards = [self.verify_graphs]
        if isinstance(self.drafter, EagleDrafter):
            forwards += [self.drafter.decode_graphs, self.drafter.multi_step_graphs]
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

    def add_request(self, prompt: list[int], params: SamplingParams | None = None) -> Request:
        """Queue a request; raises ValueError (and queues nothing) when it can never be served."""
        params = self.check_request(prompt, params)
        req = Request(next(self._rids), list(prompt), params)
        if not params.greedy:
            seed = (params.seed if params.seed is not None
                    else int(torch.randint(2**62, (), generator=self._seeds)))
            req.generator = torch.Generator().manual_seed(seed)
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
            req.slot = slot
            self.waiting.popleft()
            self.running.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------
    # Target forwards
    # ------------------------------------------------------------------
    def _target_decode(self, bs: int) -> TargetOutput:
        """Target forward over a decode batch of `bs` rows x n_row tokens (graph-capturable)."""
        t, n, ib = bs * self.n_row, self.n_row, self.inputs
        meta = self.backend.uniform_row_metadata(ib.req_pool_indices[:bs], ib.seq_lens[:bs], n)
        # the aux hidden states go straight into the drafter's input buffer (no copy in its run)
        aux_out = None
        if (isinstance(self.drafter, EagleDrafter)
                and self.drafter.bufs.first_hidden.dtype == self.target.embed_tokens.dtype):
            aux_out = self.drafter.decode_hidden_buffer(bs)
        return self.target(ib.input_ids[:t], ib.positions[:t], ib.out_cache_loc[:t], self.kv,
                           self.backend, meta, None, capture_aux=self.drafter is not None,
                           aux_out=aux_out)

    def _target_forward(self, ctx: ForwardContext, rows: list[BatchRow]) -> TargetOutput:
        ib, bs = self.inputs, ctx.bs
        if ctx.forward_mode is ForwardMode.DECODE:
            pbs = padded_batch_size(self.schedule, bs) or bs
            ib.pad_rows(bs, pbs)
            ib.pad_tokens(bs * self.n_row, pbs * self.n_row)
            out = self.verify_graphs.run(pbs)
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
        idx = torch.tensor(logit_rows, dtype=torch.int64).to(self.device)
        return self.target(ib.input_ids[:t], ib.positions[:t], ib.out_cache_loc[:t], self.kv,
                           self.backend, meta, idx, capture_aux=self.drafter is not None)

    # ------------------------------------------------------------------
    # One step
    # ------------------------------------------------------------------
    def _schedule(self) -> tuple[list[BatchRow], list[Request]]:
        prefill = [r for r in self.running if r.prefilling]
        decode = [r for r in self.running if not r.prefilling]
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
        for r in decode:
            rows.append(BatchRow(r.slot, r.committed, [r.last_verified] + r.drafts, False))
            reqs.append(r)
        return rows, reqs

    @torch.inference_mode()
    @nvtx_range("engine_step")
    def step(self) -> list[Request]:
        """Run one forward of everything scheduled; returns the requests that finished."""
        self._admit()
        rows, reqs = self._schedule()
        if not rows:
            return []
        ctx = write_batch(self.inputs, self.pages, rows)
        out = self._target_forward(ctx, rows)
        output_tokens, accept = self._verify(ctx, rows, reqs, out.logits)
        next_tokens = None
        if self.drafter is not None:
            # _commit reads the drafts back before the next run: no copy of them needed
            no_copy = {"copy_output": False} if isinstance(self.drafter, EagleDrafter) else {}
            next_tokens = self.drafter.run(ctx, out.aux_hidden, output_tokens, accept, **no_copy)
        return self._commit(ctx, rows, reqs, output_tokens, accept, next_tokens)

    def _verify(self, ctx: ForwardContext, rows, reqs, logits: torch.Tensor):
        """-> output_tokens `[ne + nd * n]` int64, accept_lengths `[bs]` int32."""
        ne, n = ctx.num_extends, self.n_row
        outs = []
        for i in range(ne):  # a prefill row's first output token (mid-chunk: unused)
            r = reqs[i]
            outs.append(sample_tokens(logits[i: i + 1], r.params, r.generator))
        accept = torch.ones(ctx.bs, dtype=torch.int32, device=self.device)
        nd = ctx.bs - ne
        if nd:
            cand = torch.tensor([rows[i].input_ids for i in range(ne, ctx.bs)],
                                dtype=torch.int64).to(self.device)
            dec_logits = logits[ne: ne + nd * n]
            tokens, acc = verify_greedy(cand, dec_logits)
            for k in range(nd):
                r = reqs[ne + k]
                if not r.params.greedy:
                    t, a = verify_sampled(cand[k: k + 1], dec_logits[k * n:(k + 1) * n],
                                          r.params, r.generator)
                    tokens[k * n:(k + 1) * n] = t
                    acc[k] = a[0]
            outs.append(tokens)
            accept[ne:] = acc
        return torch.cat(outs).to(torch.int64), accept

    def _commit(self, ctx, rows, reqs, output_tokens, accept, next_tokens) -> list[Request]:
        ne, n = ctx.num_extends, self.n_row
        out_h = output_tokens.tolist()
        acc_h = accept.tolist()
        nxt_h = next_tokens.tolist() if next_tokens is not None else None
        finished, slots, lengths = [], [], []
        for i, (row, r) in enumerate(zip(rows, reqs, strict=True)):
            if row.is_prefill:
                r.committed = row.end
                self.stats.prefill_tokens += len(row.input_ids)
                new = [] if r.prefilling else [out_h[i]]
            else:
                a = acc_h[i]
                base = ne + (i - ne) * n
                new = out_h[base: base + a]
                r.committed = row.start + a
                self.stats.decode_rows += 1
                self.stats.accepted_tokens += a
                self.metrics.on_decode_accept(a)
            if new:
                r.last_verified = new[-1]
            r.drafts = nxt_h[i][1:] if nxt_h is not None else []
            slots.append(r.slot)
            lengths.append(r.committed)
            self._emit(r, new)
            if r.finished:
                finished.append(r)
        self.states.valid_cache_lengths[torch.tensor(slots, device=self.device)] = torch.tensor(
            lengths, dtype=torch.int32).to(self.device)
        for r in finished:
            self._release(r)
        self.stats.steps += 1
        return finished

    def _emit(self, r: Request, tokens: list[int]) -> None:
        before = len(r.output)
        self._append_until_stop(r, tokens)
        if len(r.output) > before:
            self.metrics.on_tokens(r.rid, len(r.output) - before, time.perf_counter())

    def _append_until_stop(self, r: Request, tokens: list[int]) -> None:
        for tok in tokens:
            r.output.append(tok)
            self.stats.emitted_tokens += 1
            stop = tok in r.params.stop_token_ids or (
                tok == self.eos_token_id and not r.params.ignore_eos)
            if stop:
                r.finish_reason = "stop"
                return
            if len(r.output) >= r.params.max_new_tokens:
                r.finish_reason = "length"
                return

    def _release(self, r: Request) -> None:
        self.metrics.on_request_finished(r.rid)
        self.running.remove(r)
        self.pages.free(r.slot)
        self.states.valid_cache_lengths[r.slot] = 0
        r.slot = None

    def abort(self, r: Request) -> None:
        """Drop a waiting or running request; its pages return to the pool."""
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
        while self.has_work:
            before = self.stats.emitted_tokens
            self.step()
            if bar is not None:
                bar.update(self.stats.emitted_tokens - before)
        if bar is not None:
            bar.close()
        return [r.output for r in reqs]
