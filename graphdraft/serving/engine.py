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

Speculation policy (`graphdraft.serving.policy`, `RuntimeConfig.speculative_policy`): a decode
cycle drafts k tokens for k in the captured set `steps` (adaptive, the default: 0, 1 and S;
fixed: S alone), one cycle graph per (padded bs, k) (`spec_cycle` for k = S,
`spec_cycle_k{k}` for the others). `_launch` asks `policy.decide(padded bs)` for k (host
arithmetic: no sync, no re-capture); `_retire` feeds `policy.observe(accept lengths, k)` from
the pack it reads one step later anyway. A cycle of k drafts verifies k + 1 tokens a row
(last_token and drafts[:k]) and drafts k tokens; the drafts table's columns past k repeat the
last one (filler; k = 0: last_token). A row whose stored drafts are fewer than this cycle's k
verifies filler: the verify compares against the target, so it stays exact, and the policy
counts only the drafts really drafted for the row (`Request.drafts_ready`; after a k = 0 cycle
none, so the first k > 0 cycle after a stretch of k = 0 is no observation). k = 0 is
target-only decode plus the drafter's KV-only first step over the one accepted token
(`Eagle3DraftHead.store_kv`: embedding, fc, norms, qkv, RoPE and the KV write of the
committed position; skipping the drafter would leave holes in the draft KV cache at every
position accepted meanwhile, and later drafts would attend over them); no attention, MLP or
LM head, nothing drafted. Its extra cost over a target-only step is what perf/policy.py's
`k0_tps` measures. Without a drafter k is 0 and nothing is
drafted. Drafters that cannot vary k (any non-`EagleDrafter`) and data-parallel engines keep S.
`capture_graphs` times every captured (padded bs, k) cycle with CUDA events for the adaptive
policy's `CostTable` (`measure_costs`); on a CPU or with graphs off it keeps the analytic cost
(`policy.analytic_cost_table`). On CUDA every launched decode cycle is timed too (`cycle_timer`,
a pair of timing events per pinned ring slot, read when the cycle is retired: no sync) and fed
to `policy.observe_cost`, whose online median replaces the capture-time figure. The split-mode
`target_verify` / `draft_decode` graphs (per k) are captured only with `cycle_graph=False` (the
cycle graph never replays them).

`step()` keeps one step in flight: it plans (retire nothing yet; drop finished rows, admit,
schedule prefill chunks), launches step k, enqueues one non-blocking copy of the pack buffer
into a pinned slot (two slots, each with its own event), then retires step k-1: appends its
tokens, decodes its error bits, finishes requests. `generate()` drains the last step.
Without a draft head the same loop decodes one token per row (target-only).

Importing this module on a CUDA machine starts Triton's compiler key in a thread
(`kernels.compiler_key.prefetch`: 0.37 s of hashing, beside the caller's weight loading);
`capture_graphs` waits for it before its first launch.
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from capture import (
    CapturedForward,
    GraphPool,
    GraphStats,
    batch_size_schedule,
    eager_forced,
    padded_batch_size,
)
from graphdraft.config import RuntimeConfig
from graphdraft.kernels import compiler_key
from graphdraft.kernels.accept import FINISH_LENGTH, FINISH_STOP, accept_tokens
from graphdraft.kernels.cycle_kernels import (
    ERR_CACHE_LEN,
    ERR_DRAFTS,
    commit_pack,
    neutral_slot0,
    prepare_rows,
)
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
from graphdraft.runtime.tree import TreeSpec
from graphdraft.sampling import device_row
from graphdraft.serving import data_parallel
from graphdraft.serving.metrics import ServingMetrics
from graphdraft.serving.policy import (
    ANALYTIC_BANDWIDTH,
    CostTable,
    CycleTimer,
    SpeculationPolicy,
    analytic_cost_table,
    load_costs,
    measure_replay_ms,
    save_costs,
)
from graphdraft.serving.request import Request
from graphdraft.serving.tree_cycle import EngineTrees
from graphdraft.serving.verify import SamplingParams, request_seed
from graphdraft.startup.marker import cost_cache_path
from graphdraft.startup.spec import default_workers
from graphdraft.startup.warmup import finish_precompile, precompile_engine, start_precompile

log = logging.getLogger(__name__)

if torch.cuda.is_available():
    compiler_key.prefetch()

CAPTURE_COST_REPLAYS = 1
"""Timed replays per (bs, k) cell of the cost table `capture_graphs` measures (after the
capture's own first replay of each graph): graph replays vary by about 1 %, the inert rows
they run already price a real cycle a few % off, and the online medians of the first real
cycles correct the table; three replays cost 0.6 s of a cold start at the 8B shape (33 cells,
H200, perf/RESULTS.md 2026-12-05c)."""

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
    k: int | None = None                 # a decode cycle's draft length (None: a mixed step)
    real_drafts: list[int] | None = None  # per row: drafts it verified that were drafted for it
    cost: tuple[int, int, float] | None = None  # a timed cycle: (padded bs, k, its extra_ms)


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
        self.tree_spec = self._check_tree(cfg, head, drafter)  # None: chain drafting
        if self.tree_spec is not None:  # decode rows verify the n tree nodes
            self.n_row = self.tree_spec.n
        self.pages = PageTable(cfg.max_running_requests, cfg.max_pages_per_req, cfg.total_kv_pages,
                               cfg.page_size, self.device)
        self.kv = KVPool(tc.num_hidden_layers, cfg.total_kv_pages, cfg.page_size,
                         tc.num_key_value_heads, tc.head_dim, target.dtype, self.device)
        self.inputs, self.states = InputBuffers.allocate(cfg), RuntimeStates.allocate(cfg)
        self.slots = SlotState.allocate(cfg.max_running_requests + 1, cfg.speculative_num_steps,
                                        cfg.stop_table_width, self.device)
        self.cycle = CycleBuffers.allocate(cfg, self.n_row)
        self.backend = PagedAttentionBackend(self.pages.req_to_page, cfg.page_size,
                                             cfg.max_context_len, kernels=cfg.kernels)
        target.set_kernels(cfg.kernels)
        self.graph_pool = GraphPool()
        self.schedule = batch_size_schedule(cfg.cuda_graph_max_bs, cfg.cuda_graph_bs)
        enabled = not (cfg.enforce_eager or eager_forced()) and self.device.type == "cuda"
        # Under tensor parallelism a size dropped on one rank alone would desynchronise the
        # ranks' collectives: raise instead of dropping.
        on_oom = "raise" if getattr(target, "tp", None) is not None else "drop"
        self.drafter: Drafter | None = drafter
        self._tree = self._build_tree(head, cfg, enabled, on_oom)  # None: chain drafting
        if head is not None:
            if head.config.num_aux_hidden_states * head.config.hidden_size != target.aux_hidden_width:
                raise ValueError("head: its fc input width (k * H) does not match the target's "
                                 f"aux hidden width ({target.aux_hidden_width})")
            self.drafter = EagleDrafter(head, cfg, req_to_page=self.pages.req_to_page,
                                        input_buffers=self.inputs, runtime_states=self.states,
                                        graph_pool=self.graph_pool, on_oom=on_oom,
                                        kv_pool=self._tree.chain_kv if self._tree else None)
        # the drafter whose decode draft runs inside the cycle graph (None: `run` eagerly)
        self._cycle_drafter: CycleDrafter | None = (
            self.drafter if self.drafter is not None and self.drafter.supports_cycle else None)
        self._own_drafter = self.drafter is None or self._cycle_drafter is not None
        # Data-parallel attention (graphdraft.serving.data_parallel): None unless a model's dense
        # layers were split with shard_dense_ (dp_size > 1); then `step` runs in lock-step.
        self.dp = self._data_parallel(target, head, cfg)
        self._lockstep = None      # this step's data_parallel.StepPlan (inside `_launch`)
        self._lockstep_work = True  # some rank had work at the last step's agreement
        # Draft lengths: one cycle per (padded bs, k) for k in `self.steps`, the policy picks k
        # per decode cycle (class docstring, "Speculation policy").
        self._cycle_mode = self._own_drafter and cfg.cycle_graph
        self.steps = self._draft_lengths(cfg)
        k_top = self.n_row - 1
        if self._variable_k:
            self.drafter.use_draft_lengths(self.steps,
                                           capture_decode=not self._cycle_mode or self.dp is not None)
        # the split mode's verify forwards (k + 1 tokens a row), captured only without the cycle
        # graph (and under data parallelism, whose agreed mixed steps may replay them)
        verify_on = enabled and (not self._cycle_mode or self.dp is not None)
        self._verify_by_k = {k: CapturedForward(
            "target_verify" if k == k_top else f"target_verify_k{k}",
            functools.partial(self._target_decode, n=k + 1), self.schedule, pool=self.graph_pool,
            enabled=verify_on, on_oom=on_oom) for k in sorted(set(self.steps) | {k_top})}
        self.verify_graphs = self._verify_by_k[k_top]
        cycle_on = enabled and self._cycle_mode
        self._cycle_by_k = {k: CapturedForward(
            "spec_cycle" if k == k_top else f"spec_cycle_k{k}",
            functools.partial(self._spec_cycle, k=k), self.schedule, pool=self.graph_pool,
            on_oom=on_oom, enabled=cycle_on) for k in self.steps}
        self.cycle_graphs = self._cycle_by_k[max(self.steps)]
        for k, f in self._cycle_by_k.items():  # attributes: `precompile_engine` finds them
            if f is not self.cycle_graphs:
                setattr(self, f"cycle_graphs_k{k}", f)
        self.policy = self._build_policy(cfg)
        # ms of reading one context token's target KV (the policy's extra_ms, see `_decide`)
        self._kv_ms_per_token = tc.kv_bytes_per_token(target.dtype) / ANALYTIC_BANDWIDTH * 1e3
        self.cost_source = "analytic"
        self.policy_history: deque[tuple[int, int]] = deque(maxlen=1024)  # (padded bs, k)
        self.draft_hook = None  # benchmark only (see `_spec_cycle`); None: off
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
        # timing events around each decode cycle, one per ring slot, read at its retirement
        # (the policy's online costs: `policy.CycleTimer`, `SpeculationPolicy.observe_cost`)
        self.cycle_timer: CycleTimer | None = CycleTimer(2) if pin else None
        self._decided_extra_ms = 0.0
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

    # ------------------------------------------------------------------
    # Speculation policy
    # ------------------------------------------------------------------
    @property
    def _variable_k(self) -> bool:
        """The drafter drafts any k in 0..S inside the cycle (`EagleDrafter`)."""
        d = self._cycle_drafter
        return d is not None and callable(getattr(d, "use_draft_lengths", None))

    def _draft_lengths(self, cfg: RuntimeConfig) -> tuple[int, ...]:
        """The captured draft lengths: (0,) without a drafter (n_row 1); (S,) for a drafter
        that runs outside the cycle or cannot vary k, and under data parallelism (the ranks
        would need to agree on k: not done); else `cfg.policy_steps`."""
        if self.drafter is None:
            return (0,)
        s = cfg.speculative_num_steps
        if not self._variable_k or self.dp is not None or self.tree_spec is not None:
            if cfg.speculative_policy == "adaptive":
                log.info("speculative_policy: fixed (%d steps): the drafter cannot vary its "
                         "draft length in the cycle, data parallelism is on, or tree drafting "
                         "(speculative_eagle_topk > 1) is on", s)
            return (s,)
        return cfg.policy_steps

    def _build_policy(self, cfg: RuntimeConfig) -> SpeculationPolicy:
        """Fixed when one draft length is captured; adaptive over `self.steps` with the
        analytic cost table until `capture_graphs` measures the cycles."""
        if len(self.steps) == 1:
            return SpeculationPolicy("fixed", self.steps[0], steps=self.steps)
        return SpeculationPolicy("adaptive", cfg.speculative_num_steps, self._analytic_costs(),
                                 steps=self.steps)

    def _analytic_costs(self) -> dict[tuple[int, int], float]:
        """`policy.analytic_cost_table` for this engine's models over its schedule."""
        head = getattr(self.drafter, "head", None)
        return analytic_cost_table(self.target, head, self.schedule, self.steps)

    def set_policy(self, policy) -> None:
        """Replace the speculation policy: any object with `decide(padded_bs) -> k` (k in
        `self.steps`), `observe(accept_lengths, k)` and `stats() -> dict` (tests force k
        sequences this way), and optionally `observe_cost(padded_bs, k, ms, extra_ms)` (each
        retired decode cycle's device time, when `cycle_timer` is set). ValueError naming
        `policy` otherwise."""
        missing = [m for m in ("decide", "observe", "stats") if not callable(getattr(policy, m, None))]
        if missing:
            raise ValueError(f"policy: expected an object with decide, observe and stats, "
                             f"{type(policy).__name__} lacks {', '.join(missing)}")
        self.policy = policy

    def _decide(self, pbs: int, reqs: list[Request]) -> int:
        """The draft length of the next decode cycle at padded bs `pbs` over `reqs` (host
        only). The adaptive policy's costs leave out the KV reads of the rows' contexts (timed
        on length-N rows; the same for every k): they are added as
        `extra_ms` = context tokens x the target's KV bytes a token / ANALYTIC_BANDWIDTH."""
        self._decided_extra_ms = 0.0
        if isinstance(self.policy, SpeculationPolicy) and self.policy.mode == "adaptive":
            ctx = sum(len(r.prompt) + len(r.output) for r in reqs)
            self._decided_extra_ms = ctx * self._kv_ms_per_token
            k = self.policy.decide(pbs, extra_ms=self._decided_extra_ms)
        else:
            k = self.policy.decide(pbs)
        if k not in self._cycle_by_k:
            raise ValueError(f"policy: decide({pbs}) returned {k!r}, expected one of the "
                             f"captured draft lengths {list(self.steps)}")
        self.policy_history.append((pbs, k))
        return k

    def _run_cycle(self, bs: int, pbs: int, k: int) -> None:
        """One decode cycle of k drafts over the staged rows: the cycle graph (or its eager
        run), else the split mode."""
        if self._tree is not None:  # tree drafting: the tree cycle (`_tree_cycle`)
            self._tree_cycle(bs, pbs)
        elif self._cycle_mode:
            self._cycle_by_k[k].run(pbs, padded_bs=pbs)
        else:
            self._split_cycle(bs, pbs, k)

    @torch.inference_mode()
    def measure_costs(self, warmup: int = 1, iters: int = 3, cache: bool = False
                      ) -> dict[tuple[int, int], float]:
        """Time each captured (padded bs, k) cycle with CUDA events (`policy.measure_replay_ms`,
        inert rows: every row the dummy slot, so nothing is committed) and give the adaptive
        policy this cost table; the state is snapshotted and restored around it. Returns the
        table ({} and the analytic costs kept: no CUDA, graphs off, or a fixed policy).
        `cache`: take the table an earlier run of this engine shape on this GPU measured
        (`precompile_workers.cost_cache_path`, in Triton's cache folder; `cost_source`
        "cached": the online medians correct it from the first real cycles on) when it has
        every cell, else measure and write it there. Called by `capture_graphs`; call it from
        a drained engine."""
        if not isinstance(self.policy, SpeculationPolicy) or self.policy.mode != "adaptive":
            return {}
        fwd = self._cycle_by_k if self._cycle_mode else self._verify_by_k
        sizes = sorted(set.intersection(*(set(fwd[k].captured_sizes) for k in self.steps)))
        if self.device.type != "cuda" or not sizes:
            return {}
        path = cost_cache_path(self) if cache else None
        cached = load_costs(path, [(pbs, k) for pbs in sizes for k in self.steps])
        if cached is not None:
            self.policy.costs = CostTable(cached)
            self.cost_source = "cached"
            return cached
        self.drain()
        snap = self.state_snapshot()
        self._reset_neutral()
        table = {}
        for pbs in sizes:
            self._stage_rows([0] * pbs)
            for k in self.steps:
                table[(pbs, k)] = measure_replay_ms(
                    functools.partial(self._run_cycle, pbs, pbs, k), warmup=warmup, iters=iters)
        self.restore_state(snap)
        self._reset_neutral()
        self.policy.costs = CostTable(table)
        self.cost_source = "measured"
        if path is not None:
            save_costs(path, table)
        return table

    def state_snapshot(self) -> dict[str, torch.Tensor]:
        """Clones of the per-slot device state a cycle commits (valid_cache_lengths and the
        `SlotState` tables). A benchmark that replays `cycle_graphs` alone advances the
        requests at every replay (commit); `restore_state` puts them back between replays."""
        snap = {f"slots.{k}": v.clone() for k, v in vars(self.slots).items()}
        snap["valid_cache_lengths"] = self.states.valid_cache_lengths.clone()
        if self._tree is not None:  # the slots' trees
            snap.update({f"trees.{f}": getattr(self._tree.trees, f).clone()
                         for f in self._tree.trees.TREE_FIELDS})
        return snap

    def restore_state(self, snap: dict[str, torch.Tensor]) -> None:
        """Copy a `state_snapshot` back in place (stream-ordered; no sync)."""
        for k, v in vars(self.slots).items():
            v.copy_(snap[f"slots.{k}"])
        self.states.valid_cache_lengths.copy_(snap["valid_cache_lengths"])
        if self._tree is not None:
            for f in self._tree.trees.TREE_FIELDS:
                getattr(self._tree.trees, f).copy_(snap[f"trees.{f}"])

    @property
    def pinned_packs(self) -> list[torch.Tensor]:
        """The two pinned host copies `[max_bs, N + 3]` int32 of `cycle.pack` (one per step
        parity; a step's rows are valid once its event completed: `drain()` waits)."""
        return self._pinned

    # ------------------------------------------------------------------
    # Graphs
    # ------------------------------------------------------------------
    def start_precompile(self, progress: bool = True, precompile_workers: int | None = None,
                         meanwhile: Callable[[], object] | None = None) -> bool:
        """Start compiling the Triton kernels `capture_graphs` needs in `precompile_workers`
        processes (None: `cfg.precompile_workers`); `capture_graphs` then adopts the phase.
        Nothing in it reads this engine's weights: `meanwhile` (e.g. `PendingWeights.read`
        of `checkpoint.open_model_pair`) runs beside it from the start, and this returns
        once both run (`warmup.start_precompile`). False when no phase starts (no workers,
        no graphs, a warm cache, tree drafting or data parallelism: the capture compiles
        as it would have; `meanwhile` still runs)."""
        workers = (default_workers(self.cfg) if precompile_workers is None else precompile_workers)
        if self._tree is not None or self.dp is not None:
            workers = 0
        return start_precompile([self], workers=workers, progress=progress, meanwhile=meanwhile)

    @torch.inference_mode()
    def capture_graphs(self, progress: bool = True, parallel_precompile: bool = False,
                       precompile_workers: int | None = None) -> None:
        """Compile the Triton kernels each size bucket needs (`precompile_engine`; in
        `precompile_workers` processes, None: `cfg.precompile_workers`, see
        `graphdraft.kernels.precompile_workers.default_workers`, while the captures run:
        each bucket's first capture waits for its own kernels; a phase `start_precompile`
        started is adopted), then capture
        the cycle per captured draft length k (`self.steps`), or in the split mode
        (`cycle_graph=False`) the target's verify forward and the drafter's decode draft per
        k; the drafter's multi-step graphs always (largest bs first). Then the adaptive
        policy's costs: `measure_costs` (no warm-up replays: capture replayed each graph
        once already; `CAPTURE_COST_REPLAYS` timed replays a cell), timed before the worker
        phase ends (its last kernels, the prefill's, compile meanwhile). Warm-up and capture
        run inert rows only (slot 0); every table is neutral after. `capture_phases`: wall seconds of the precompile (its start), the
        captures, the cost timing and the wait for the phase's end (`compile_tail_s`)."""
        if self.dp is not None and parallel_precompile:
            raise ValueError("parallel_precompile: expected False under data parallelism (two "
                             "threads would interleave the ranks' collectives)")
        self.drain()
        self._reset_neutral()
        if self.device.type == "cuda":
            compiler_key.wait()  # computed once, before the first compile or cache load
        if self._tree is not None:  # tree drafting: its cycle graphs only
            finish_precompile(self)  # a phase `start_precompile` began over several engines
            self._capture_tree_graphs(progress)
            return
        # Every Triton variant, once per size bucket (`parallel_precompile`: two threads).
        workers = (default_workers(self.cfg) if precompile_workers is None else precompile_workers)
        t0 = time.perf_counter()
        precompile_engine(self, progress=progress, parallel=parallel_precompile,
                          workers=0 if self.dp is not None else workers, overlap=True)
        t1 = time.perf_counter()
        try:  # a worker phase may still run: each bucket's first capture waits for its kernels
            self._reset_neutral()
            for f in self._verify_sequence():
                f.capture(progress=progress)
            if self.drafter is not None:
                self.drafter.capture_graphs(progress=progress)
            self._reset_neutral()
            for f in self._cycle_sequence():
                f.capture(progress=progress)
            self._reset_neutral()
            if self.dp is not None:  # every rank keeps the sizes every rank captured
                data_parallel.agree_captured(self)
            t2 = time.perf_counter()
            # timed while the phase's last kernels compile: the prefill's (no graph launches
            # them; the workers use no GPU)
            self.measure_costs(warmup=0, iters=CAPTURE_COST_REPLAYS, cache=True)
            t3 = time.perf_counter()
        except BaseException:
            finish_precompile(self, abort=True)
            raise
        finish_precompile(self)
        self.capture_phases = {"precompile_s": t1 - t0, "capture_s": t2 - t1, "costs_s": t3 - t2,
                               "compile_tail_s": time.perf_counter() - t3}

    def _verify_sequence(self) -> list[CapturedForward]:
        return [self._verify_by_k[k] for k in sorted(self._verify_by_k, reverse=True)]

    def _cycle_sequence(self) -> list[CapturedForward]:  # the widest first (pool reuse)
        return [self._cycle_by_k[k] for k in sorted(self._cycle_by_k, reverse=True)]

    def capture_sequence(self) -> list[CapturedForward]:
        """The forwards `capture_graphs` captures, in that order (split-mode verify per k, the
        drafter's, the cycle per k; each largest size first): the precompile plan compiles
        their kernels in this order, so a capture overlapping it finds them in time."""
        drafter = getattr(self.drafter, "capture_sequence", None) if self.drafter else None
        return [*self._verify_sequence(), *(drafter() if drafter else []),
                *self._cycle_sequence()]

    def _reset_neutral(self) -> None:
        self.inputs.pad_rows(0, self.cfg.max_bs)
        self.inputs.pad_tokens(0, self.cfg.max_bs * self.n_row)
        self.cycle.reset()
        self._staged_rows = None
        if self._cycle_drafter is not None:
            self._cycle_drafter.reset_neutral()
        if self._tree is not None:
            self._tree.reset_neutral()
        self._neutral_slot0()

    def _captured_forwards(self) -> list[CapturedForward]:
        forwards = list(self._cycle_by_k.values()) + list(self._verify_by_k.values())
        if self._cycle_drafter is not None:
            d = self._cycle_drafter
            dec = d.decode_forwards() if callable(getattr(d, "decode_forwards", None)) \
                else [d.decode_graphs]
            forwards += dec + [d.multi_step_graphs]
        if self._tree is not None:
            forwards += self._tree.forwards()
        return forwards

    def _forward_groups(self) -> dict[str, dict[int | None, CapturedForward]]:
        """Captured forwards by family (`spec_cycle`, `target_verify`, `draft_decode`, ...),
        each by draft length k (None: a forward with no k, the multi-step)."""
        groups: dict[str, dict[int | None, CapturedForward]] = {}
        for f in self._captured_forwards():
            m = re.fullmatch(r"(.*)_k(\d+)", f.name)
            base, k = (m.group(1), int(m.group(2))) if m else (f.name, None)
            if k is None and base in ("spec_cycle", "target_verify", "draft_decode"):
                k = self.n_row - 1
            groups.setdefault(base, {})[k] = f
        return groups

    def _merged_stats(self) -> list[GraphStats]:
        """One `GraphStats` per family: the per-k forwards' statistics summed."""
        out = []
        for base, by_k in self._forward_groups().items():
            if len(by_k) == 1:
                out.append(next(iter(by_k.values())).stats)
                continue
            m = GraphStats(base)
            for f in by_k.values():
                st = f.stats
                m.replays.update(st.replays)
                m.compiles.update(st.compiles)
                m.built.update(st.built)
                m.worker_built.update(st.worker_built)
                for key, v in st.eager.items():
                    m.eager[key] = m.eager.get(key, 0) + v
                for name in ("capture_seconds", "pool_bytes", "eager_seconds",
                             "precompile_seconds"):
                    mine = getattr(m, name)
                    for bs, v in getattr(st, name).items():
                        mine[bs] = mine.get(bs, 0) + v
                m.dropped = sorted(set(m.dropped) | set(st.dropped))
            out.append(m)
        return out

    def graph_summary(self) -> dict[str, tuple[int, int]]:
        """Per captured forward family (the per-k forwards of `spec_cycle`, `target_verify`,
        `draft_decode` summed): (graph replays, eager runs)."""
        return {st.name: (st.total_replays, st.total_eager) for st in self._merged_stats()}

    def metrics_snapshot(self) -> dict:
        """`ServingMetrics.snapshot()` with every captured forward family's graph statistics
        (per draft length under `graphs[family]["by_k"]`) and the policy's decisions under
        `speculation`: mode, captured steps, steps chosen per padded bs, switches, probes,
        the accept-rate estimate, the cost table (ms by k, then padded bs; `cost_source`
        "measured" or "analytic") and the last decisions (padded bs, k) in launch order."""
        snap = self.metrics.snapshot(self._merged_stats())
        for base, by_k in self._forward_groups().items():
            if len(by_k) > 1:
                snap["graphs"][base]["by_k"] = {
                    k: {"replays": f.stats.total_replays, "eager": f.stats.total_eager,
                        "capture_s": round(f.stats.total_capture_seconds, 4)}
                    for k, f in sorted(by_k.items())}
        spec = dict(self.policy.stats())
        spec["steps_captured"] = list(self.steps)
        costs = getattr(self.policy, "costs", None)
        if isinstance(costs, CostTable):
            table: dict[int, dict[int, float]] = {}
            for (bs, k), ms in sorted(costs.measured().items()):
                table.setdefault(k, {})[bs] = round(ms, 5)
            spec["cost_ms"] = dict(sorted(table.items()))
            spec["cost_source"] = self.cost_source
        spec["decisions"] = [list(d) for d in self.policy_history]
        snap["speculation"] = spec
        ts = self.cfg.tree_spec
        mode = "tree" if self.tree_spec is not None else "chain" if self.drafter else "none"
        snap["accept_length"]["drafting"] = {"mode": mode, "steps": ts.steps,
            "topk": ts.topk, "num_draft_tokens": ts.n}
        return snap

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
            self.slots.admit(slot, stop_ids=self._stop_ids(req.params),
                             **device_row(req.params, req.seed))
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
    def _target_decode(self, bs: int, n: int | None = None) -> TargetOutput:
        """Target forward over a decode batch of `bs` rows x n tokens (default n_row; a cycle
        of k drafts: k + 1) (graph-capturable)."""
        n = self.n_row if n is None else n
        t, ib = bs * n, self.inputs
        meta = self.backend.uniform_row_metadata(ib.req_pool_indices[:bs], ib.seq_lens[:bs], n)
        # the aux hidden states go straight into the drafter's input buffer (no copy in its run)
        if self.drafter is None:
            aux_out = None
        elif n == self.n_row:
            aux_out = self.drafter.decode_hidden_buffer(bs)
        else:
            aux_out = self._cycle_drafter.decode_hidden_buffer(bs, n)
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
    def _prepare(self, row0: int, tok0: int, rows: int, n: int | None = None) -> None:
        """Decode rows [row0, row0 + rows) from `slot_rows` into `InputBuffers` (n tokens each,
        default N, from token tok0): ids from last_token / drafts[:n - 1], positions and KV
        slots from valid_cache_lengths and the page table. Padded (slot 0), done and bad rows
        are inert: the dummy slot 0 at positions 0..n-1. Sets `err` of these rows (fresh each
        step). (`graphdraft.kernels.cycle_kernels.prepare_rows`: one launch on the Triton path.)"""
        ib, st, cb = self.inputs, self.slots, self.cycle
        n = self.n_row if n is None else n
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

    def _tokens_buffer(self, rows: int, n: int | None = None) -> torch.Tensor:
        """Where a decode cycle's accepted tokens go `[rows, n]` (default N): the drafter's
        first-step ids (no staging copy) or the engine's own buffer."""
        n = self.n_row if n is None else n
        if self._cycle_drafter is not None:
            d = self._cycle_drafter
            return d.cycle_tokens(rows) if n == self.n_row else d.cycle_tokens(rows, n)
        return self.cycle.tokens[: rows * n].view(rows, n)

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

    def _draft(self, bs: int, k: int) -> torch.Tensor:
        d = self._cycle_drafter
        return d.draft_staged(bs) if k == self.n_row - 1 else d.draft_staged(bs, k)

    def _spec_cycle(self, bs: int, k: int | None = None) -> torch.Tensor:
        """One decode cycle of k drafts (default: the largest captured) over `bs` staged rows
        (graph-capturable): verify width k + 1; returns pack[:bs] (`[bs, N + 3]` whatever k:
        token columns past k + 1 are 0).

        `draft_hook` (benchmark only, e.g. `perf/policy.py`'s accept-rate control): when set
        (before `capture_graphs`: a captured graph holds what was set then), called as
        `draft_hook(bs, next_tokens [bs, S + 1])` after drafting and before the commit; it may
        overwrite the drafts in place and must be capturable."""
        k = max(self.steps) if k is None else k
        w = k + 1
        self._prepare(0, 0, bs, w)
        out = self._target_decode(bs, w)
        tokens = self._tokens_buffer(bs, w)
        self._accept(0, 0, bs, w, out.logits, self.inputs.req_pool_indices[:bs], tokens)
        nxt = None
        if self._cycle_drafter is not None:
            nxt = self._draft(bs, k)
            if self.draft_hook is not None:
                self.draft_hook(bs, nxt)
        self._commit(0, bs, tokens, nxt, prefill=False)
        return self.cycle.pack[:bs]

    def _split_cycle(self, bs: int, pbs: int, k: int | None = None) -> None:
        """The same cycle as verify graph, eager accept, draft graph (or any drafter's run),
        eager commit and pack."""
        k = max(self.steps) if k is None else k
        w = k + 1
        self._prepare(0, 0, pbs, w)
        out = self._verify_by_k[k].run(pbs, padded_bs=pbs)
        tokens = self._tokens_buffer(pbs, w)
        self._accept(0, 0, pbs, w, out.logits, self.inputs.req_pool_indices[:pbs], tokens)
        nxt = None
        if self._cycle_drafter is not None:
            d = self._cycle_drafter
            fwd = d.decode_graphs_for(k) if self._variable_k else d.decode_graphs
            nxt = fwd.run(pbs, padded_bs=pbs)
            if self.draft_hook is not None:
                self.draft_hook(pbs, nxt)
        elif self.drafter is not None:
            ctx = ForwardContext(bs=bs, num_extends=0, input_num_tokens=bs * self.n_row)
            aux = out.aux_hidden[: bs * self.n_row] if out.aux_hidden is not None else None
            nxt = self.drafter.run(ctx, aux, tokens[:bs].reshape(-1), self.cycle.draft_accept[:bs])
            nxt = torch.cat([nxt, torch.zeros(pbs - bs, nxt.shape[1], dtype=nxt.dtype,
                                              device=nxt.device)]) if pbs > bs else nxt
        self._commit(0, pbs, tokens, nxt, prefill=False)

    # ------------------------------------------------------------------
    # Tree drafting (speculative_eagle_topk > 1; `graphdraft.serving.tree_cycle.EngineTrees`)
    # ------------------------------------------------------------------
    @staticmethod
    def _check_tree(cfg: RuntimeConfig, head, drafter) -> TreeSpec | None:
        """The tree shape when `speculative_eagle_topk > 1` (None: chain, or target-only: no
        head and no drafter, the tree fields unused); ValueError naming the field when trees
        cannot be served: they need the built-in EAGLE-3 drafter (`head`, not `drafter`), no
        data parallelism."""
        if cfg.speculative_eagle_topk == 1 or (head is None and drafter is None):
            return None
        if head is None:
            raise ValueError("speculative_eagle_topk: expected 1 with a caller's drafter (tree "
                             f"drafting needs the EAGLE-3 `head`), got {cfg.speculative_eagle_topk}")
        if cfg.dp_size != 1:
            raise ValueError(f"speculative_eagle_topk: expected 1 with dp_size > 1 (trees are "
                             f"not served data-parallel), got {cfg.speculative_eagle_topk}")
        return cfg.tree_spec

    def _build_tree(self, head, cfg: RuntimeConfig, enabled: bool, on_oom: str):
        """`EngineTrees` for a tree spec (None for chain drafting)."""
        if self.tree_spec is None:
            return None
        return EngineTrees(self.target, head, self.tree_spec, cfg, req_to_page=self.pages.req_to_page,
                           kv=self.kv, backend=self.backend, slots=self.slots,
                           valid_cache_lengths=self.states.valid_cache_lengths,
                           cycle_buffers=self.cycle, schedule=self.schedule,
                           graph_pool=self.graph_pool, enabled=enabled, on_oom=on_oom)

    def _tree_sampled(self) -> bool:
        """Whether the sampled tree cycle runs (any running request samples; greedy rows are
        one-hot rows there, so exact either way)."""
        return any(not r.params.greedy for r in self.running)

    def _tree_cycle(self, bs: int, pbs: int) -> None:
        """One tree decode cycle over the staged rows: the graph at padded bs `pbs` (or the
        same function eagerly)."""
        self._tree.graphs[self._tree_sampled()].run(pbs, padded_bs=pbs)

    def _capture_tree_graphs(self, progress: bool) -> None:
        """Capture the greedy and the sampled tree cycle per padded bs (largest first; inert
        rows only); every table neutral after."""
        for sampled in (False, True):
            self._tree.graphs[sampled].capture(progress=progress)
            self._reset_neutral()

    def _tree_mixed_step(self, rows: list[BatchRow], preqs: list[Request],
                         dreqs: list[Request]) -> None:
        """A prefill / mixed step under tree drafting (eager): the decode rows run the tree
        cycle (its graph at their padded size), then the prefill rows the chain's prefill
        (target over the chunks, first-token accept, the chain drafter's first step writing
        the draft KV; its multi-step skipped: chain drafts are not verified here) and
        `EngineTrees.expand_prefilled` for prompts whose last chunk ran. Pack rows: prefill
        rows first, then decode rows (the order `_launch` records)."""
        ne, nd = len(rows), len(dreqs)
        cb = self.cycle
        dec_pack = None
        if nd:
            pnd = padded_batch_size(self.schedule, nd) or nd
            self._stage_rows([r.slot for r in dreqs] + [0] * (pnd - nd))
            self._tree_cycle(nd, pnd)
            dec_pack = cb.pack[:nd].clone()
        if ne:
            ib = self.inputs
            pctx = write_batch(ib, self.pages, rows)
            ctx = ForwardContext(bs=ne, num_extends=ne, input_num_tokens=pctx.input_num_tokens,
                                 all_extends_mid_chunk=pctx.all_extends_mid_chunk)
            out = self._target_forward(ctx, rows)
            final = [r.slot if row.end == len(r.prompt) else 0
                     for row, r in zip(rows, preqs, strict=True)]
            p_tok = cb.tokens[:ne].view(ne, 1)
            cb.err[:ne] = 0
            self._accept(0, 0, ne, 1, out.logits[:ne], self._host_tensor(final), p_tok)
            accept = self._draft_accept_buffer()[:ne].clone()
            accept[:] = 1
            dctx = ForwardContext(bs=ne, num_extends=ne, input_num_tokens=ctx.input_num_tokens,
                                  all_extends_mid_chunk=True)  # first step only (draft KV)
            nxt = self.drafter.run(dctx, out.aux_hidden, cb.tokens[:ne], accept, copy_output=False)
            self._commit(0, ne, p_tok, nxt[:ne], prefill=True)
            last = [i for i, s in enumerate(final) if s]
            if last:
                idx = self._host_tensor(last)
                self._tree.expand_prefilled(
                    self._host_tensor([final[i] for i in last]),
                    self._host_tensor([len(preqs[i].prompt) for i in last]),
                    p_tok[:, 0].index_select(0, idx),
                    self.drafter.bufs.hidden.index_select(0, idx))
        if nd:
            cb.pack[ne: ne + nd].copy_(dec_pack)

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
            k = self._decide(pbs, dreqs)
            self._stage_rows([r.slot for r in dreqs] + [0] * (pbs - bs))
            cost = (pbs, k, self._decided_extra_ms) if self.cycle_timer is not None else None
            if cost is not None:  # read at its retirement (`_retire`), never waited for
                self.cycle_timer.begin(self._ring)
            self._run_cycle(bs, pbs, k)
            if self._cycle_drafter is not None:  # it drafted once, inside the cycle
                self._cycle_drafter.stats.calls += 1
                self._cycle_drafter.stats.decode_calls += 1
            real = [min(k, r.drafts_ready) for r in dreqs]
            made = k if self._variable_k else self.n_row - 1  # k = 0 drafts nothing
            for r in dreqs:
                r.drafts_ready = made
        else:
            k, real, cost = None, None, None
            self._mixed_step(rows, preqs, dreqs)
            for r in dreqs:
                r.drafts_ready = self.n_row - 1
            for row, r in zip(rows, preqs, strict=True):
                if row.end == len(r.prompt):
                    r.drafts_ready = self.n_row - 1
        ring = self._ring
        self._ring ^= 1
        pinned = self._pinned[ring]
        pinned[:bs].copy_(self.cycle.pack[:bs], non_blocking=True)
        if cost is not None:
            self.cycle_timer.end(ring)
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
                                         event, k, real, cost))

    def _mixed_step(self, rows: list[BatchRow], preqs: list[Request], dreqs: list[Request]) -> None:
        """A prefill / mixed step, eager: prefill rows from the host, decode rows prepared on
        device from the same state as the cycle; the same accept, commit and pack."""
        if self._tree is not None:  # tree drafting: `_tree_mixed_step`
            self._tree_mixed_step(rows, preqs, dreqs)
            return
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
        observed: dict[int, list[int]] = {}  # real drafts verified -> accept lengths
        real = step.real_drafts
        for i, (r, decode, emits, row) in enumerate(zip(step.reqs, step.decode, step.emits, data,
                                                        strict=True)):
            r.in_flight -= emits
            if r.finished:
                continue  # aborted (or failed) after this step was launched
            a, fin, err = row[n], row[n + 1], row[n + 2]
            if err and self.cfg.validation_mode != "off":
                errors.append((r, err))
                continue
            if real is not None and a > 0 and not fin:  # a stop cut says nothing of the drafts
                # filler drafts (past the drafts made for this row) do not count
                observed.setdefault(real[i], []).append(min(a, real[i] + 1))
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
        for kr, accepts in observed.items():
            self.policy.observe(accepts, kr)
        if step.cost is not None and self.cycle_timer is not None:  # the cycle's device time
            ms = self.cycle_timer.elapsed_ms(step.ring)  # (completed: its pack was read)
            observe_cost = getattr(self.policy, "observe_cost", None)
            if ms is not None and callable(observe_cost):
                observe_cost(step.cost[0], step.cost[1], ms, step.cost[2])
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
            # a rate measured off a GPU is no performance figure: counts only there
            fmt = None if self.device.type == "cuda" else "{desc}: {n_fmt}/{total_fmt} |{bar}|"
            bar = tqdm(total=sum(r.params.max_new_tokens for r in reqs), desc="tokens", unit="tok",
                       bar_format=fmt)
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
