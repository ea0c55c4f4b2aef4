"""The serving loop: requests in, tokens out, with speculative decoding.

The Engine is the host loop: requests (`add_request`, `abort`), admission (a request's slot
row written once: `SlotState.admit`), the schedule (prefill chunks, decode rows), the
launch / retire ring and metrics. Every token decision lives on the device; the host plans
and reads results one step late.

What a decode step runs is its **decode mode**, chosen once at construction
(`graphdraft.serving.cycles`): `TargetOnlyMode` (no drafter), `ChainMode` (a drafter meeting
`graphdraft.runtime.drafter_protocol.Drafter`: the built-in `EagleDrafter` for a `head`, or
a caller's `drafter`), `TreeMode` (`speculative_eagle_topk > 1`,
`graphdraft.serving.tree_cycle`). A pure decode step is one cycle per padded batch size
(prepare, verify, accept, draft, commit + pack; one CUDA graph replay, or the same functions
eagerly); a step with prefill rows is the mode's eager mixed step over the same state.

`step()` keeps one step in flight: it plans (`plan_step`: admit, schedule), agrees the step
with its planner (`LocalPlanner`; data parallelism: `data_parallel.LockstepPlanner`, the
ranks agree on one plan), launches it (`launch`: one non-blocking copy of the pack into a
pinned slot, two slots each with its own event), then retires the step before it
(`retire_launched`: tokens appended, error bits decoded, requests finished). `generate()`
drains the last step.

Speculation policy (`graphdraft.serving.policy`, `RuntimeConfig.speculative_policy`): a
decode cycle drafts k tokens for k in the mode's `steps` (adaptive: `cfg.policy_steps`;
fixed: S alone; a drafter that cannot vary k, tree drafting and data parallelism keep S).
`launch` asks `policy.decide(padded bs)` for k (host arithmetic); `retire_launched` feeds
`policy.observe(accept lengths, k)` from the pack it reads one step later anyway, and on
CUDA each cycle's device time (`policy.CycleTimer`, a pair of events per ring slot) to
`policy.observe_cost`. `capture_graphs` times every captured (padded bs, k) cycle for the
adaptive policy's `CostTable` (`measure_costs`).

Every captured forward is in `graph_registry` (`capture.GraphRegistry`, `(family, k)` keys in
capture order): capture, statistics, cost timing, warm-up and precompile read it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from capture import CapturedForward, GraphPool, GraphRegistry, batch_size_schedule, eager_forced
from graphdraft.config import RuntimeConfig
from graphdraft.kernels import compiler_key
from graphdraft.kernels.accept import FINISH_LENGTH, FINISH_STOP
from graphdraft.kernels.cycle_kernels import ERR_CACHE_LEN, ERR_DRAFTS
from graphdraft.kernels.logprobs import unpack_row
from graphdraft.models.attention import PagedAttentionBackend
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.llama import LlamaForCausalLM
from graphdraft.nvtx import nvtx_range
from graphdraft.runtime.batch import BatchRow
from graphdraft.runtime.buffers import CycleBuffers, InputBuffers, RuntimeStates
from graphdraft.runtime.drafter import EagleDrafter
from graphdraft.runtime.drafter_protocol import DraftBinding, Drafter, check_drafter
from graphdraft.runtime.kv_cache import KVPool, OutOfPagesError, PageTable
from graphdraft.runtime.ngram_drafter import configured_drafter
from graphdraft.runtime.slot_state import SlotState
from graphdraft.runtime.tree import TreeSpec
from graphdraft.sampling import device_row
from graphdraft.serving import data_parallel
from graphdraft.serving.cycles.base import CycleParts, DecodeMode
from graphdraft.serving.cycles.chain import ChainMode, TargetOnlyMode
from graphdraft.serving.data_parallel import StepPlan
from graphdraft.serving.limits import EngineLimits
from graphdraft.serving.metrics import ServingMetrics
from graphdraft.serving.planning import LocalPlanner, StepWork
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
from graphdraft.serving.prompt_logprobs import ScoredStep
from graphdraft.serving.request import Request
from graphdraft.serving.tree_cycle import EngineTrees, TreeMode
from graphdraft.serving.verify import SamplingParams, request_seed
from graphdraft.startup.marker import cost_cache_path
from graphdraft.startup.spec import default_workers
from graphdraft.startup.warmup import finish_precompile, precompile_engine, start_precompile

log = logging.getLogger(__name__)

if torch.cuda.is_available():
    compiler_key.prefetch()  # Triton's compiler key, hashed beside the caller's weight loading

CAPTURE_COST_REPLAYS = 1
"""Timed replays per (bs, k) cell of the cost table `capture_graphs` measures (after the
capture's own first replay of each graph): the online medians of the first real cycles
correct the table."""

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
    if param.device.type != device.type:
        raise ValueError(f"{name}: expected parameters on {device} (RuntimeConfig.device), "
                         f"got {param.device}")


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
    prompt_scores: ScoredStep | None = None  # prompt_logprobs its prefill chunks scored


class Engine:
    def __init__(self, target: LlamaForCausalLM, cfg: RuntimeConfig,
                 head: Eagle3DraftHead | None = None, *, drafter: Drafter | None = None,
                 eos_token_id: int | None = None, seed: int | None = None) -> None:
        """`head`: an EAGLE-3 head (an `EagleDrafter` is built for it); or `drafter`: any
        object meeting `graphdraft.runtime.drafter_protocol.Drafter` (bound to this Engine's
        buffers here; anything else: ValueError naming `drafter`); neither: target-only, or the
        n-gram drafter when `cfg.speculative_algorithm == "ngram"` (`runtime.ngram_drafter`).
        `seed` seeds sampled requests that carry none (pass the same on every
        tensor-parallel rank so that ranks sample alike)."""
        tc = target.config
        # The pool's size is fixed here, once: `num_kv_pages` or what `kv_cache_memory_gb` pays for.
        cfg = cfg.replace(num_kv_pages=cfg.kv_pages(tc.kv_bytes_per_token(target.dtype)) - 1)
        self.target, self.cfg, self.eos_token_id = target, cfg, eos_token_id
        self.device = torch.device(cfg.device)
        drafter = configured_drafter(cfg, head, drafter)  # speculative_algorithm "ngram"
        self._check_inputs(target, cfg, head, drafter)
        self.tree_spec = self._check_tree(cfg, head, drafter)  # None: chain drafting
        self.pages = PageTable(cfg.max_running_requests, cfg.max_pages_per_req, cfg.total_kv_pages,
                               cfg.page_size, self.device)
        self.kv = KVPool(tc.num_hidden_layers, cfg.total_kv_pages, cfg.page_size,
                         tc.num_key_value_heads, tc.head_dim, target.dtype, self.device)
        self.inputs, self.states = InputBuffers.allocate(cfg), RuntimeStates.allocate(cfg)
        self.slots = SlotState.allocate(cfg.max_running_requests + 1, cfg.speculative_num_steps,
                                        cfg.stop_table_width, self.device, vocab=tc.vocab_size,
                                        kernels=cfg.kernels)
        n_row = 1 if head is None and drafter is None else (
            self.tree_spec.n if self.tree_spec is not None else cfg.spec_num_tokens)
        self.cycle = CycleBuffers.allocate(cfg, n_row)
        self.backend = PagedAttentionBackend(self.pages.req_to_page, cfg.page_size,
                                             cfg.max_context_len, kernels=cfg.kernels)
        target.set_kernels(cfg.kernels)
        self.graph_pool = GraphPool()
        self.graph_registry = GraphRegistry()
        """Every captured forward of this engine (its drafter's included), `(family, k)` in
        capture order: what `capture_graphs`, the statistics and start-up read."""
        self.schedule = batch_size_schedule(cfg.cuda_graph_max_bs, cfg.cuda_graph_bs)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.mode = self._build_mode(head, drafter)
        self.n_row, self.steps = self.mode.n_row, self.mode.steps
        self.drafter = self.mode.drafter
        self.limits = EngineLimits.of(self)  # what a request must fit (constant from here)
        self._init_policy(cfg, head)
        self._init_host_state(seed)

    def _check_inputs(self, target, cfg: RuntimeConfig, head, drafter) -> None:
        """ValueErrors naming the argument, before anything (the target's kernel path) changes."""
        tc = target.config
        if tc.max_position_embeddings < cfg.max_context_len:
            raise ValueError(f"max_context_len: expected <= the target's max_position_embeddings "
                             f"({tc.max_position_embeddings}), got {cfg.max_context_len}")
        _check_model("target", target, cfg, self.device)
        if head is not None:
            _check_model("head", head, cfg, self.device)
            if head.config.num_aux_hidden_states * head.config.hidden_size != target.aux_hidden_width:
                raise ValueError("head: its fc input width (k * H) does not match the target's "
                                 f"aux hidden width ({target.aux_hidden_width})")
        if head is not None and drafter is not None:
            raise ValueError("drafter: expected either head or drafter, not both")
        if drafter is not None:
            check_drafter(drafter)

    def _parts(self, graphs_enabled: bool, on_oom: str) -> CycleParts:
        return CycleParts(cfg=self.cfg, target=self.target, kv=self.kv, backend=self.backend,
                          pages=self.pages, inputs=self.inputs, states=self.states,
                          slots=self.slots, cycle=self.cycle, schedule=self.schedule,
                          graph_pool=self.graph_pool, registry=self.graph_registry,
                          graphs_enabled=graphs_enabled, on_oom=on_oom,
                          stage_rows=self._stage_rows, host_tensor=self._host_tensor,
                          running=lambda: self.running)

    def _build_mode(self, head, drafter) -> DecodeMode:
        """The decode mode, once: target-only, chain (fused cycle graph or split) or tree;
        the data-parallel planner. The drafter is bound to this engine's buffers first."""
        cfg, target = self.cfg, self.target
        enabled = not (cfg.enforce_eager or eager_forced()) and self.device.type == "cuda"
        # Under tensor parallelism a size dropped on one rank alone would desynchronise the
        # ranks' collectives: raise instead of dropping.
        on_oom = "raise" if getattr(target, "tp", None) is not None else "drop"
        parts = self._parts(enabled, on_oom)
        trees = None if self.tree_spec is None else EngineTrees(
            target, head, self.tree_spec, cfg, req_to_page=self.pages.req_to_page, kv=self.kv,
            backend=self.backend, slots=self.slots,
            valid_cache_lengths=self.states.valid_cache_lengths, cycle_buffers=self.cycle,
            schedule=self.schedule, graph_pool=self.graph_pool, enabled=enabled, on_oom=on_oom)
        if head is not None:
            drafter = EagleDrafter(head, cfg, req_to_page=self.pages.req_to_page,
                                   input_buffers=self.inputs, runtime_states=self.states,
                                   graph_pool=self.graph_pool, on_oom=on_oom,
                                   kv_pool=trees.chain_kv if trees else None)
        if drafter is not None:
            drafter.bind(DraftBinding(cfg, self.inputs, self.states, self.pages.req_to_page,
                                      self.graph_pool, enabled, on_oom, self.slots))
        # Data-parallel attention (graphdraft.serving.data_parallel): the models' dense layers
        # split with shard_dense_ (dp_size > 1); then the ranks agree on every step.
        self.dp = self._data_parallel(target, head, cfg, drafter)
        self.planner = LocalPlanner() if self.dp is None else data_parallel.LockstepPlanner(self.dp)
        if trees is not None:  # the chain drafter's prefill skips its multi-step: no graphs
            return TreeMode(parts, trees, drafter)
        fused = cfg.cycle_graph and (drafter is None or drafter.capturable)
        split_graphs = not fused or self.dp is not None
        if drafter is None:
            return TargetOnlyMode(parts, fused=fused, split_graphs=split_graphs)
        steps = self._draft_lengths(cfg, drafter)
        return ChainMode(parts, drafter, steps, fused=fused, split_graphs=split_graphs)

    def _init_policy(self, cfg: RuntimeConfig, head: Eagle3DraftHead | None) -> None:
        self.policy = self._build_policy(cfg, head)
        self._observe_cost = self.policy.observe_cost
        # ms of reading one context token's target KV (the policy's extra_ms, see `_decide`)
        self._kv_ms_per_token = (self.target.config.kv_bytes_per_token(self.target.dtype)
                                 / ANALYTIC_BANDWIDTH * 1e3)
        self.cost_source = "analytic"
        self.policy_history: deque[tuple[int, int]] = deque(maxlen=1024)  # (padded bs, k)
        self._decided_extra_ms = 0.0

    def _init_host_state(self, seed: int | None) -> None:
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
        shape = self.cycle.wire.shape  # pack, then the rows' log-probabilities
        self._pinned = [torch.zeros(shape, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._events = [torch.cuda.Event(blocking=True) if pin else None for _ in range(2)]
        # timing events around each decode cycle, one per ring slot, read at its retirement
        # (the policy's online costs: `policy.CycleTimer`, `SpeculationPolicy.observe_cost`)
        self.cycle_timer: CycleTimer | None = CycleTimer(2) if pin else None
        self.stats = EngineStats()
        self.metrics = ServingMetrics()

    def _data_parallel(self, target, head, cfg: RuntimeConfig, drafter: Drafter | None):
        """The models' `DataParallel` (None: dp_size 1); ValueError when it disagrees with
        `cfg.dp_size`, between the models, or with a drafter that cannot run in a graph."""
        dps = {id(d): d for d in (getattr(target, "dp", None), getattr(head, "dp", None))
               if d is not None}
        if len(dps) > 1:
            raise ValueError("head: expected the target's DataParallel group (or none)")
        dp = next(iter(dps.values()), None)
        size = 1 if dp is None else dp.world_size
        if cfg.dp_size != size:
            raise ValueError(f"dp_size: expected the models' data-parallel size ({size}: "
                             f"data_parallel.shard_dense_), got {cfg.dp_size}")
        if dp is not None and drafter is not None and not drafter.capturable:
            raise ValueError("drafter: data parallelism needs a capturable drafter (the EAGLE "
                             "drafter of a head)")
        return dp

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

    # ------------------------------------------------------------------
    # Speculation policy
    # ------------------------------------------------------------------
    def _draft_lengths(self, cfg: RuntimeConfig, drafter: Drafter) -> tuple[int, ...]:
        """The captured draft lengths: (S,) for a drafter that cannot vary k and under data
        parallelism (the ranks would need to agree on k: not done); else `cfg.policy_steps`."""
        s = cfg.speculative_num_steps
        if not drafter.variable_draft_length or self.dp is not None:
            if cfg.speculative_policy == "adaptive":
                log.info("speculative_policy: fixed (%d steps): the drafter cannot vary its "
                         "draft length or data parallelism is on", s)
            return (s,)
        return cfg.policy_steps

    def _build_policy(self, cfg: RuntimeConfig, head: Eagle3DraftHead | None) -> SpeculationPolicy:
        """Fixed when one draft length is captured; adaptive over `self.steps` with the
        analytic cost table (of `head`, None: the target alone) until `capture_graphs`
        measures the cycles."""
        if len(self.steps) == 1:
            if self.mode.name == "tree" and cfg.speculative_policy == "adaptive":
                log.info("speculative_policy: fixed (%d steps) under tree drafting", self.steps[0])
            return SpeculationPolicy("fixed", self.steps[0], steps=self.steps)
        costs = analytic_cost_table(self.target, head, self.schedule, self.steps)
        return SpeculationPolicy("adaptive", cfg.speculative_num_steps, costs, steps=self.steps)

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
        observe_cost = getattr(policy, "observe_cost", None)
        self._observe_cost = observe_cost if callable(observe_cost) else (lambda *a: None)

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
        if k not in self.steps:
            raise ValueError(f"policy: decide({pbs}) returned {k!r}, expected one of the "
                             f"captured draft lengths {list(self.steps)}")
        self.policy_history.append((pbs, k))
        return k

    @torch.inference_mode()
    def measure_costs(self, warmup: int = 1, iters: int = 3, cache: bool = False
                      ) -> dict[tuple[int, int], float]:
        """Time each captured (padded bs, k) cycle with CUDA events (`policy.measure_replay_ms`,
        inert rows: every row the dummy slot, so nothing is committed) and give the adaptive
        policy this cost table; the state is snapshotted and restored around it. Returns the
        table ({} and the analytic costs kept: no CUDA, graphs off, or a fixed policy).
        `cache`: take the table an earlier run of this engine shape on this GPU measured
        (`startup.marker.cost_cache_path`; `cost_source` "cached": the online medians
        correct it from the first real cycles on) when it has every cell, else measure and
        write it there. Called by `capture_graphs`; call it from a drained engine."""
        if not isinstance(self.policy, SpeculationPolicy) or self.policy.mode != "adaptive":
            return {}
        fwd = self.mode.cost_forwards()
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
                    functools.partial(self.mode.run, pbs, pbs, k, []), warmup=warmup, iters=iters)
        self.restore_state(snap)
        self._reset_neutral()
        self.policy.costs = CostTable(table)
        self.cost_source = "measured"
        if path is not None:
            save_costs(path, table)
        return table

    def state_snapshot(self) -> dict[str, torch.Tensor]:
        """Clones of the per-slot device state a cycle commits (valid_cache_lengths, the
        `SlotState` tables and the mode's own, e.g. the slots' trees). A benchmark that
        replays `cycle_graphs` alone advances the requests at every replay (commit);
        `restore_state` puts them back between replays."""
        snap = {f"slots.{k}": v.clone() for k, v in self.slots.tables().items()}
        snap["valid_cache_lengths"] = self.states.valid_cache_lengths.clone()
        snap.update({k: v.clone() for k, v in self.mode.state_tables().items()})
        return snap

    def restore_state(self, snap: dict[str, torch.Tensor]) -> None:
        """Copy a `state_snapshot` back in place (stream-ordered; no sync)."""
        for k, v in self.slots.tables().items():
            v.copy_(snap[f"slots.{k}"])
        self.states.valid_cache_lengths.copy_(snap["valid_cache_lengths"])
        for k, v in self.mode.state_tables().items():
            v.copy_(snap[k])

    @property
    def pinned_packs(self) -> list[torch.Tensor]:
        """The two pinned host copies `[max_bs, N + 3 + N * (1 + 2K)]` int32 of `cycle.wire`
        (the pack, then the log-probabilities; one per step parity; a step's rows are valid
        once its event completed: `drain()` waits)."""
        return self._pinned

    # ------------------------------------------------------------------
    # Graphs
    # ------------------------------------------------------------------
    @property
    def cycle_graphs(self) -> CapturedForward | None:
        """The decode cycle's graphs at the full draft length (`spec_cycle`; None: a mode
        without one, tree drafting)."""
        return self.graph_registry.get("spec_cycle", max(self.steps))

    @property
    def verify_graphs(self) -> CapturedForward | None:
        """The split cycle's verify graphs at the full draft length (`target_verify`)."""
        return self.graph_registry.get("target_verify", max(self.steps))

    @property
    def draft_hook(self):
        """Benchmark only (`ChainMode.draft_hook`): called as `draft_hook(bs, next_tokens)`
        inside the cycle after drafting; set it before `capture_graphs`."""
        return self.mode.draft_hook

    @draft_hook.setter
    def draft_hook(self, hook) -> None:
        if not isinstance(self.mode, ChainMode) or self.mode.drafter is None:
            raise ValueError("draft_hook: expected a chain-drafting engine")
        self.mode.draft_hook = hook

    def decode_forwards(self) -> list[CapturedForward]:
        """The captured forwards a decode cycle replays (the cycle, or verify + draft)."""
        return self.mode.decode_forwards()

    def capture_sequence(self) -> list[CapturedForward]:
        """The forwards `capture_graphs` captures, in that order (`graph_registry`)."""
        return self.graph_registry.forwards()

    def start_precompile(self, progress: bool = True, precompile_workers: int | None = None,
                         meanwhile: Callable[[], object] | None = None) -> bool:
        """Start compiling the Triton kernels `capture_graphs` needs in `precompile_workers`
        processes (None: `cfg.precompile_workers`); `capture_graphs` then adopts the phase.
        Nothing in it reads this engine's weights: `meanwhile` (e.g. `PendingWeights.read`
        of `checkpoint.open_model_pair`) runs beside it from the start, and this returns
        once both run. False when no phase starts (no workers, no graphs, a warm cache, tree
        drafting or data parallelism: the capture compiles as it would have; `meanwhile`
        still runs)."""
        workers = (default_workers(self.cfg) if precompile_workers is None else precompile_workers)
        if not self.mode.precompiles or self.dp is not None:
            workers = 0
        return start_precompile([self], workers=workers, progress=progress, meanwhile=meanwhile)

    @torch.inference_mode()
    def capture_graphs(self, progress: bool = True, parallel_precompile: bool = False,
                       precompile_workers: int | None = None) -> None:
        """Compile the Triton kernels each size bucket needs (`precompile_engine`; in
        `precompile_workers` processes, None: `cfg.precompile_workers`, while the captures
        run: each bucket's first capture waits for its own kernels; a phase
        `start_precompile` started is adopted), then capture every forward of
        `graph_registry` in its order (largest bs first; inert rows only, every table neutral
        after). Then the adaptive policy's costs: `measure_costs` (`CAPTURE_COST_REPLAYS`
        timed replays a cell), timed before the worker phase ends. `capture_phases`: wall
        seconds of the precompile (its start), the captures, the cost timing and the wait
        for the phase's end (`compile_tail_s`)."""
        if self.dp is not None and parallel_precompile:
            raise ValueError("parallel_precompile: expected False under data parallelism (two "
                             "threads would interleave the ranks' collectives)")
        self.drain()
        self._reset_neutral()
        if self.device.type == "cuda":
            compiler_key.wait()  # computed once, before the first compile or cache load
        workers = (default_workers(self.cfg) if precompile_workers is None else precompile_workers)
        if not self.mode.precompiles or self.dp is not None:
            workers = 0
        t0 = time.perf_counter()
        if self.mode.precompiles:
            precompile_engine(self, progress=progress, parallel=parallel_precompile,
                              workers=workers, overlap=True)
        t1 = time.perf_counter()
        try:  # a worker phase may still run: each bucket's first capture waits for its kernels
            self.mode.capture(progress)
            if self.dp is not None:  # every rank keeps the sizes every rank captured
                data_parallel.agree_captured(self.dp, self.graph_registry.forwards(),
                                             self.cfg.max_bs)
            t2 = time.perf_counter()
            # timed while the phase's last kernels compile (the prefill's; no graph launches
            # them; the workers use no GPU)
            self.measure_costs(warmup=0, iters=CAPTURE_COST_REPLAYS, cache=True)
            t3 = time.perf_counter()
        except BaseException:
            finish_precompile(self, abort=True)
            raise
        finish_precompile(self)
        self.capture_phases = {"precompile_s": t1 - t0, "capture_s": t2 - t1, "costs_s": t3 - t2,
                               "compile_tail_s": time.perf_counter() - t3}

    def _reset_neutral(self) -> None:
        self._staged_rows = None
        self.mode.reset_neutral()

    def graph_summary(self) -> dict[str, tuple[int, int]]:
        """Per captured forward family (`graph_registry`; the per-k forwards of a family
        summed): (graph replays, eager runs)."""
        return self.graph_registry.summary()

    def metrics_snapshot(self) -> dict:
        """`ServingMetrics.snapshot()` with every captured forward family's graph statistics
        (per draft length under `graphs[family]["by_k"]`) and the policy's decisions under
        `speculation`: mode, captured steps, steps chosen per padded bs, switches, probes,
        the accept-rate estimate, the cost table (ms by k, then padded bs; `cost_source`
        "measured", "cached" or "analytic") and the last decisions (padded bs, k) in launch
        order."""
        reg = self.graph_registry
        snap = self.metrics.snapshot(reg.merged_stats())
        for family in reg.families():
            by_k = reg.family(family)
            if len(by_k) > 1:
                snap["graphs"][family]["by_k"] = {
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
        snap["accept_length"]["drafting"] = {"mode": self.mode.name, "steps": ts.steps,
                                             "topk": ts.topk, "num_draft_tokens": ts.n}
        return snap

    # ------------------------------------------------------------------
    # Requests
    # ------------------------------------------------------------------
    @property
    def lookahead(self) -> int:
        """KV positions reserved per request past its prompt and max_new_tokens."""
        return self.mode.lookahead

    def add_request(self, prompt: list[int], params: SamplingParams | None = None, *,
                    seed_stream: int | None = None) -> Request:
        """Queue a request; raises ValueError (and queues nothing) when it can never be served.

        Seeds of sampled requests (`verify.request_seed`): without `params.seed` one drawn
        from the Engine's `seed`; with it and `seed_stream` None, derived from (seed, how many
        earlier requests of this Engine carried the same seed), so requests sharing one
        SamplingParams get distinct streams and the same sequence of requests reproduces the
        same tokens; with `seed_stream` (an int >= 0, needs `params.seed`), exactly
        `request_seed(params.seed, seed_stream)` whatever came before (a server gives choice i
        of a request stream i, so the same request reproduces its samples)."""
        params = self.check_request(prompt, params)
        if seed_stream is not None and (
                isinstance(seed_stream, bool) or not isinstance(seed_stream, int)
                or seed_stream < 0 or params.seed is None):
            raise ValueError(f"seed_stream: expected None, or an int >= 0 with params.seed set, "
                             f"got {seed_stream!r} (params.seed {params.seed!r})")
        req = Request(next(self._rids), list(prompt), params)  # its logprob lists as asked
        if not params.greedy:
            if params.seed is None:
                req.seed = int(torch.randint(2**62, (), generator=self._seeds))
            elif seed_stream is not None:
                req.seed = request_seed(params.seed, seed_stream)
            else:
                k = self._seed_uses.get(params.seed, 0)
                self._seed_uses[params.seed] = k + 1
                req.seed = request_seed(params.seed, k)
        self.waiting.append(req)
        self.metrics.on_request_added(req.rid, time.perf_counter())
        return req

    def check_request(self, prompt: list[int], params: SamplingParams | None = None
                      ) -> SamplingParams:
        """Raise ValueError naming the argument when `prompt` / `params` can never be served
        (`EngineLimits.check`); returns the params to use (defaults for None). Changes nothing."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        self.limits.check(prompt, params)
        return params

    def _admit(self) -> None:
        with self.slots.admitting(), self.pages.batched():  # rows written together, no sync
            while self.waiting and len(self.running) < self.cfg.max_running_requests:
                req = self.waiting[0]
                need = len(req.prompt) + req.params.max_new_tokens + self.mode.lookahead
                if self.pages.pages_needed(None, need) > self.pages.num_free_pages:
                    break  # back-pressure: wait for running requests to finish
                slot = self.pages.alloc_slot()
                try:
                    self.pages.reserve(slot, need)
                except OutOfPagesError:
                    self.pages.free(slot)
                    break
                self.slots.admit(slot, stop_ids=self.limits.stop_ids(req.params),
                                 prompt=req.prompt, logit_bias=req.params.logit_bias,
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
        return self.planner.keep_stepping(self)

    # ------------------------------------------------------------------
    # One step: plan, agree, launch, retire (the planning interface is public: a planner,
    # e.g. `data_parallel.LockstepPlanner`, drives the same calls)
    # ------------------------------------------------------------------
    def _schedule(self) -> StepWork:
        """Prefill rows (host-written) within the token budget, and decode requests."""
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
        return StepWork(rows, reqs, decode)

    def _stage_rows(self, slots: list[int]) -> None:
        """Write `slot_rows[:len(slots)]` (one H2D copy) when the rows changed."""
        if slots == self._staged_rows:
            return
        self.slots.staging.copy_into(self.cycle.slot_rows, slots)
        self._staged_rows = list(slots)

    def _host_tensor(self, values: list[int]) -> torch.Tensor:
        return self.slots.staging.tensor(values)  # pinned staging: no sync, no pin_memory

    def plan_step(self) -> StepWork:
        """Admit waiting requests while slots and pages last, then schedule this step's rows
        (host only)."""
        self._admit()
        return self._schedule()

    def retire_launched(self, keep: int = 0) -> list[Request]:
        """Retire launched steps, oldest first, until `keep` remain in flight (0 waits for the
        device); returns the requests that finished."""
        finished: list[Request] = []
        while len(self._in_flight) > keep:
            finished += self._retire(self._in_flight.popleft())
        return finished

    @torch.inference_mode()
    @nvtx_range("engine_step")
    def step(self) -> list[Request]:
        """Plan and launch one step, then retire the previous one; returns the requests that
        finished (as read back: one step late). With `validation="sync"` the launched step is
        retired at once (a sync per step; immediate errors)."""
        plan, work = self.planner.agree(self, self.plan_step())
        launched = plan.any_rows
        if launched:
            with nvtx_range("launch"), self.planner.launching(self, plan):
                self.launch(work, plan)
        return self.retire_launched(1 if launched and self.cfg.validation_mode != "sync" else 0)

    def drain(self) -> list[Request]:
        """Retire every launched step (waits for the device)."""
        return self.retire_launched(0)

    def launch(self, work: StepWork, plan: StepPlan) -> None:
        """Launch `work` as `plan` says (a decode cycle at `plan.padded_bs`, or the mode's
        mixed step) and record it for `retire_launched`."""
        rows, preqs, dreqs = work.rows, work.preqs, work.dreqs
        ne, nd = len(rows), len(dreqs)
        bs = ne + nd
        if not plan.mixed:
            k, real, cost = self._launch_cycle(bs, plan.padded_bs, dreqs)
        else:
            k, real, cost = None, None, None
            self.mode.mixed(rows, preqs, dreqs, plan)
            for r in dreqs:
                r.drafts_ready = self.n_row - 1
            for row, r in zip(rows, preqs, strict=True):
                if row.end == len(r.prompt):
                    r.drafts_ready = self.n_row - 1
        ring = self._ring
        self._ring ^= 1
        self._pinned[ring][:bs].copy_(self.cycle.wire[:bs], non_blocking=True)
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
                                         event, k, real, cost, self.mode.prompt_scores.take()))

    def _launch_cycle(self, bs: int, pbs: int, dreqs: list[Request]):
        """One decode cycle over `dreqs` at padded bs `pbs` -> (k, real drafts per row, the
        cost cell to time or None)."""
        k = self._decide(pbs, dreqs)
        self._stage_rows([r.slot for r in dreqs] + [0] * (pbs - bs))
        cost = (pbs, k, self._decided_extra_ms) if self.cycle_timer is not None else None
        if cost is not None:  # read at its retirement (`_retire`), never waited for
            self.cycle_timer.begin(self._ring)
        self.mode.run(bs, pbs, k, self.running)
        self.mode.drafter_cycle(k)
        real = [min(k, r.drafts_ready) for r in dreqs]
        made = self.mode.drafts_made(k)
        for r in dreqs:
            r.drafts_ready = made
        return k, real, cost

    # ------------------------------------------------------------------
    # Retirement (host, one step late)
    # ------------------------------------------------------------------
    def _retire(self, step: _Launched) -> list[Request]:
        """Read a launched step's pack (waits for its event) into its requests; the policy's
        accept and cost observations; ValueError for error bits (the flagged requests are
        aborted first)."""
        if step.event is not None:
            step.event.synchronize()
        n = self.n_row
        wire = self._pinned[step.ring][: len(step.reqs)]
        data = wire[:, : n + 3].tolist()
        if step.prompt_scores is not None:
            step.prompt_scores.apply()
        finished, errors, now = [], [], time.perf_counter()  # every row's tokens known now
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
            if new and r.logprobs is not None:  # the row's logprobs region: kernels.logprobs
                lps, tops = unpack_row(wire[i, n + 3:], n, self.cfg.max_logprobs, len(new),
                                       r.params.logprobs)
                r.logprobs += lps
                r.top_logprobs += tops
            if new:
                r.output.extend(new)
                r.last_verified = new[-1]
                self.stats.emitted_tokens += len(new)
                self.metrics.on_tokens(r.rid, len(new), now)
            if fin:
                r.finish_reason = "stop" if fin == FINISH_STOP else "length"
                assert fin in (FINISH_STOP, FINISH_LENGTH)
                finished.append(r)
        for kr, accepts in observed.items():
            self.policy.observe(accepts, kr)
        if step.cost is not None:  # the cycle's device time (completed: its pack was read)
            ms = self.cycle_timer.elapsed_ms(step.ring)
            if ms is not None:
                self._observe_cost(step.cost[0], step.cost[1], ms, step.cost[2])
        with self.slots.releasing():  # the finished rows neutral together
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
        self.states.valid_cache_lengths[r.slot].zero_()  # a fill: `[slot] = 0` would sync
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
        """Serve every prompt to completion; returns each request's output tokens
        (`generate_requests`: the finished `Request`s, with log-probabilities when asked).

        Every prompt is checked before any is queued: a bad one raises ValueError (naming
        its index) and leaves the engine's queue as it was."""
        return [r.output for r in self.generate_requests(prompts, params, progress)]

    def generate_requests(self, prompts: list[list[int]],
                          params: SamplingParams | list[SamplingParams] | None = None,
                          progress: bool = False) -> list[Request]:
        """`generate`, returning each prompt's finished `Request` (output, finish_reason,
        logprobs / top_logprobs / prompt_logprobs when its params asked)."""
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
        self.planner.expect_work()
        while self.keep_stepping:
            before = self.stats.emitted_tokens
            self.step()
            if bar is not None:
                bar.update(self.stats.emitted_tokens - before)
        self.drain()
        if bar is not None:
            bar.close()
        return reqs
