"""Data-parallel attention: ranks with different batches draft and verify in lock-step.

A `DataParallel` group of `world_size` ranks (one process each) splits the *requests*:
every rank admits, schedules and serves its own requests, with its own page table and KV
pools holding every KV head (attention, embeddings, norms and LM heads are replicated,
full weights on every rank). The MLPs (the dense layers) are tensor-parallel over the same
group (`shard_dense_`: gate_up column slices, down row slices, F / world each). Before an
MLP the tokens of all ranks are gathered, after it the partial sums are reduce-scattered
back to their ranks:

  x [n, H] (this rank's rows) -> zero-padded to [rows, H] -> all-gather [world * rows, H]
  -> local gate_up / silu-mul / down -> reduce-scatter [rows, H] -> rows [:n]

`rows` is the same on every rank (the maximum over ranks of what any forward of the step
needs), so every rank issues collectives of identical sizes; padded rows are zeros
(silu(0) * 0 = 0: no NaN) and are cut off. An EAGLE-3 head sharded with `shard_dense_`
does the same in its MLP (its LM head stays replicated); a head left whole needs no
communication at all.

Lock-step, once per engine step (`LockstepPlanner`, the `Engine.planner` of an engine whose
models carry a `DataParallel`; it drives the Engine's public planning interface
`plan_step` / `launch` / `retire_launched`): every rank plans its step, then ONE all-gather of
`PLAN_FIELDS` (a few ints per rank) gives every rank the same table, and `lockstep_plan`
(a pure function of that table) decides for all of them:

  mixed        any rank has a prefill row -> every rank runs the engine's eager mixed step
               (a decode-only rank runs its rows through the split cycle: verify, then
               draft, at its own padded size), else every rank runs the decode cycle
  padded_bs    decode cycle: the graph schedule's size for the largest rank batch (every
               rank stages that many rows; its own first, then inert slot-0 rows)
  rows         mixed step: the largest token / row count any rank's forward needs (the
               gather size of every MLP of the step); decode cycle: None (all ranks run
               the same padded shapes, so their local counts are equal)
  eager        graph-or-eager: each rank sends a bit mask of the schedule's sizes its decode
               forwards would replay now (`replay_mask`); the cycle replays only when every
               rank's mask holds padded_bs, else every rank runs eagerly (a graph missing on
               one rank, GRAPHDRAFT_EAGER set on one rank only, padded_bs above the
               schedule, and every mixed step): `CapturedForward.forced_eager`
  all_mid_chunk  the drafter's multi-step skip: only when every rank has rows and all of
               them are mid-chunk prefill rows (an idle rank's dummy row is a decode row:
               it drafts every step, so the others must too)
  any_work     some rank still has requests or steps in flight: `Engine.generate` keeps
               stepping until no rank has (ranks stop together)

An idle rank (no row this step) runs one inert decode row of the reserved slot 0
(`_idle_request`: a Request already finished, so it never emits) through the same forwards:
the prepare marks it inert (dummy page, accept 0), so it writes no request's KV and commits
nothing. After `Engine.capture_graphs` every
rank keeps only the sizes every rank captured (`agree_captured`: an all-gather of the
captured sizes, then `CapturedForward.restrict_to` the intersection), so a size dropped to
out-of-memory on one rank falls back on all.

`dp_size = 1` (the default) never builds a `DataParallel`: no model carries one, the
Engine's `dp` is None and its planner the `planning.LocalPlanner`. Data parallelism with tensor
parallelism of attention inside each rank (tp_size > 1 and dp_size > 1 together) is not
supported: `shard_dense_` refuses a tensor-parallel model.

Collectives are plain `torch.distributed` calls on the current stream (gloo on CPU,
NCCL on GPU; capturable with NCCL once the communicator exists: `warmup`). An exception
on one rank only (a deferred validation error raised by its `step`, an out-of-memory in a
warm-up forward before capture) leaves the others waiting in their next collective until
the process group's timeout: data-parallel ranks fail together, not alone. `log`, when a
list, records every collective `(name, shape)` this rank issues (tests compare ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from capture import padded_batch_size
from graphdraft.parallel import check_rank
from graphdraft.sampling import SamplingParams
from graphdraft.serving.request import Request

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)

# One row of the per-step plan table, in this order (ints).
PLAN_FIELDS = ("has_rows", "mixed", "bs", "rows", "mid_chunk", "has_work")
# ... then `replay_mask` in words of 63 bits (int64 without the sign bit), low sizes first.
_WORD = 63


@dataclass
class DataParallel:
    """This process's place in a data-parallel group (group None: the default group).

    `rows`: the gather size of the current step's MLPs (None: each call's own row count;
    set by `lockstep_step` for a mixed step). `cpu_group`: a gloo group over the same ranks
    for the host-side agreements (the plan table, captured sizes, outputs) when `group` is
    NCCL (None: `group` itself, gloo on CPU): no device sync for the plan. `log`: None, or
    a list that records every collective as `(name, shape)`. `decisions`: None, or a list
    that records every step's `StepPlan`."""

    rank: int
    world_size: int
    group: Any = None
    rows: int | None = None
    cpu_group: Any = None
    log: list | None = field(default=None, repr=False)
    decisions: list | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_rank(self.rank, self.world_size)

    @classmethod
    def from_group(cls, group: Any = None) -> DataParallel:
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def host_group(self) -> Any:
        """The group of host-side (CPU tensor) agreements."""
        return self.group if self.cpu_group is None else self.cpu_group

    def _record(self, name: str, t: torch.Tensor) -> None:
        if self.log is not None:
            self.log.append((name, tuple(t.shape)))

    # ------------------------------------------------------------------
    # Collectives
    # ------------------------------------------------------------------
    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's `values` (same length on every rank) -> `[world][len]` (host ints)."""
        local = torch.tensor(list(values), dtype=torch.int64)
        out = torch.empty(self.world_size * local.numel(), dtype=torch.int64)
        self._record("all_gather_ints", out)
        _all_gather_single(out, local, group=self.host_group)
        return out.view(self.world_size, -1).tolist()

    def dense(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`fn` (a row-wise dense layer whose output is this rank's partial sum) over the rows
        of every rank: x `[n, H_in]` -> `[n, H_out]` (this rank's rows, summed over ranks).

        Pads to `rows` (`self.rows`, at least n) zero rows, all-gathers `[world * rows, H_in]`,
        applies `fn`, reduce-scatters `[world * rows, H_out]` -> `[rows, H_out]`, keeps `[:n]`."""
        n = x.shape[0]
        rows = n if self.rows is None else self.rows
        if rows < n:
            raise ValueError(f"rows: expected >= this rank's {n} rows (the step's agreed "
                             f"gather size), got {rows}")
        if rows > n:
            x = torch.cat([x, x.new_zeros((rows - n, *x.shape[1:]))])
        full = x.new_empty((self.world_size * rows, *x.shape[1:]))
        self._record("all_gather", full)
        _all_gather_single(full, x.contiguous(), group=self.group)
        part = fn(full)
        out = part.new_empty((rows, *part.shape[1:]))
        self._record("reduce_scatter", part)
        _reduce_scatter_single(out, part.contiguous(), group=self.group)
        return out if rows == n else out[:n]

    def warmup(self, device: str | torch.device = "cpu") -> None:
        """One small collective: creates the communicator before any graph capture."""
        if self.world_size > 1:
            dist.all_reduce(torch.zeros(1, device=device), group=self.group)


def init_data_parallel(dp_size: int, backend: str | None = None, device: str | None = None,
                       timeout_s: float | None = None) -> tuple[DataParallel | None, str]:
    """Join the default process group that `torchrun` set up (env RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT) as a data-parallel group of `dp_size` ranks ->
    (dp, this rank's device). `dp_size` 1: (None, device), no process group. ValueError
    when WORLD_SIZE is not `dp_size`. Backend: gloo on CPU, NCCL on CUDA (default)."""
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size: expected an int >= 1, got {dp_size!r}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda") and ":" not in device:
        device = f"cuda:{local_rank}"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if dp_size == 1:
        return None, device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != dp_size:
        raise ValueError(f"dp_size: expected the launcher's WORLD_SIZE ({world}; start "
                         f"with torchrun --nproc-per-node {dp_size}), got {dp_size}")
    if not dist.is_initialized():
        kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        dist.init_process_group(backend or ("nccl" if device.startswith("cuda") else "gloo"),
                                **kw)
    dp = DataParallel.from_group()
    if dist.get_backend() != "gloo":  # host-side agreements on CPU tensors: a gloo group
        dp.cpu_group = dist.new_group(backend="gloo")
    dp.warmup(device)
    return dp, device


# ---------------------------------------------------------------------------
# Sharding the dense layers
# ---------------------------------------------------------------------------
def shard_dense_(model: nn.Module, dp: DataParallel | None) -> nn.Module:
    """Keep this rank's slices of every MLP of `model` (a `LlamaForCausalLM` or an
    `Eagle3DraftHead`, full HF-layout weights) and route them through `dp.dense`; returns
    `model`. `dp` None or world_size 1: nothing changes. ValueError (nothing changed) when
    the intermediate size does not divide, the model is tensor-parallel or already sharded."""
    from graphdraft.models.layers import MLP
    from graphdraft.parallel import TensorParallel, shard_mlp_

    if dp is None or dp.world_size == 1:
        return model
    if not hasattr(model, "shard_"):
        raise ValueError(f"model: expected a LlamaForCausalLM or Eagle3DraftHead, got "
                         f"{type(model).__name__}")
    if getattr(model, "tp", None) is not None:
        raise ValueError("model: tensor-parallel; data parallelism shards only unsharded models")
    if getattr(model, "dp", None) is not None:
        raise ValueError("model: already sharded")
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    for m in mlps:
        if m.intermediate_size % dp.world_size:
            raise ValueError(f"intermediate_size: expected a multiple of dp_size "
                             f"({dp.world_size}), got {m.intermediate_size}")
    view = TensorParallel(dp.rank, dp.world_size, dp.group)
    with torch.no_grad():
        for m in mlps:
            shard_mlp_(m, view)
            m.tp, m.dp = None, dp
    model.dp = dp
    return model


# ---------------------------------------------------------------------------
# The per-step agreement
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StepPlan:
    """What every rank does this step (identical on every rank; see the module docstring)."""

    any_rows: bool
    mixed: bool
    padded_bs: int
    rows: int | None
    all_mid_chunk: bool
    eager: bool
    any_work: bool
    table: tuple = ()  # every rank's `local_plan` row (PLAN_FIELDS), rank order


def _pad(schedule: Sequence[int], bs: int) -> int:
    return padded_batch_size(schedule, bs) or bs


def local_plan(schedule: Sequence[int], n_row: int, *, prefill_lens: Sequence[int],
               num_decodes: int, mid_chunk: bool, replay: int, has_work: bool) -> list[int]:
    """This rank's row of the plan table (`PLAN_FIELDS`).

    prefill_lens: tokens of each prefill row; num_decodes: decode rows (an idle rank: 0,
    it will run the one-row dummy); mid_chunk: every row is a mid-chunk prefill row;
    replay: `replay_mask` of this rank's decode forwards."""
    ne = len(prefill_lens)
    bs = ne + num_decodes
    if ne:  # mixed path: target over every token; drafter rows up to its padded bs
        need = max(sum(prefill_lens) + num_decodes * n_row, _pad(schedule, bs))
    else:   # decode-only rank inside a mixed step: verify at its padded bs (the dummy: 1 row)
        need = _pad(schedule, max(bs, 1)) * n_row
    words = [(replay >> (_WORD * w)) & ((1 << _WORD) - 1)
             for w in range(max(1, -(-len(schedule) // _WORD)))]
    return [int(bs > 0), int(ne > 0), bs, need, int(bs > 0 and mid_chunk), int(has_work)] + words


def lockstep_plan(table: Sequence[Sequence[int]], schedule: Sequence[int]) -> StepPlan:
    """The step's plan from every rank's `local_plan` row (a pure function: every rank
    computes the same plan from the same gathered table)."""
    width = len(PLAN_FIELDS) + max(1, -(-len(schedule) // _WORD))
    if not table or any(len(r) != width for r in table):
        raise ValueError(f"table: expected one row of {width} ints ({PLAN_FIELDS} + replay "
                         f"mask words) per rank, got {table!r}")
    col = {f: [r[i] for r in table] for i, f in enumerate(PLAN_FIELDS)}
    col["replay_mask"] = [sum(w << (_WORD * k) for k, w in enumerate(r[len(PLAN_FIELDS):]))
                          for r in table]
    any_rows = any(col["has_rows"])
    mixed = any(col["mixed"])
    padded = _pad(schedule, max(max(col["bs"]), 1))
    bit = list(schedule).index(padded) if padded in schedule else None
    replay = bit is not None and all(m >> bit & 1 for m in col["replay_mask"])
    return StepPlan(any_rows=any_rows, mixed=mixed, padded_bs=padded,
                    rows=max(col["rows"]) if mixed else None,
                    all_mid_chunk=all(col["mid_chunk"]),
                    eager=mixed or not replay, any_work=any(col["has_work"]),
                    table=tuple(tuple(r) for r in table))


def replay_mask(forwards: Sequence, schedule: Sequence[int]) -> int:
    """Bit i set when every one of `forwards` (`CapturedForward`s) would replay a graph of
    exactly `schedule[i]` now (captured, enabled, no GRAPHDRAFT_EAGER)."""
    mask = 0
    for i, bs in enumerate(schedule):
        if all(f._decide(bs) == bs for f in forwards):
            mask |= 1 << i
    return mask


def agree_sizes(dp: DataParallel, sizes: Sequence[int], max_size: int) -> list[int]:
    """The sizes every rank holds (an all-gather of a 0/1 mask over 1..max_size)."""
    mask = [0] * max_size
    for s in sizes:
        mask[s - 1] = 1
    table = dp.all_gather_ints(mask)
    return [i + 1 for i in range(max_size) if all(r[i] for r in table)]


def agree_captured(dp: DataParallel, forwards: Sequence, max_size: int) -> None:
    """After capture: every captured forward keeps the sizes every rank captured
    (`CapturedForward.restrict_to` the intersection; the same forwards on every rank)."""
    for f in forwards:
        f.restrict_to(agree_sizes(dp, f.captured_sizes, max_size))


# ---------------------------------------------------------------------------
# The engine's lock-step planner
# ---------------------------------------------------------------------------
def _idle_request() -> Request:
    """The inert decode row an idle rank runs: slot 0, already finished (never emits)."""
    return Request(rid=-1, prompt=[0], params=SamplingParams(max_new_tokens=1), slot=0,
                   finish_reason="idle")


class LockstepPlanner:
    """The planner of a data-parallel Engine (`Engine.planner`): every step, the ranks agree
    on one plan (one all-gather of a few ints: `local_plan` rows -> `lockstep_plan`) and
    launch it together (a dummy row when idle), through the Engine's public planning
    interface (`plan_step`, `launch`, `retire_launched`, `decode_forwards`,
    `graph_registry`)."""

    def __init__(self, dp: DataParallel) -> None:
        self.dp = dp
        self.any_work = True  # some rank had work at the last agreement (True: before any)

    def agree(self, engine, work) -> tuple[StepPlan, object]:
        """The agreed plan for this rank's `work` (a `planning.StepWork`), and the work to
        launch (the idle dummy row when this rank has none but others do)."""
        rows, dreqs = work.rows, work.dreqs
        mine = local_plan(engine.schedule, engine.n_row,
                          prefill_lens=[len(r.input_ids) for r in rows], num_decodes=len(dreqs),
                          mid_chunk=work.all_mid_chunk,
                          replay=replay_mask(engine.decode_forwards(), engine.schedule),
                          has_work=engine.has_work)
        plan = lockstep_plan(self.dp.all_gather_ints(mine), engine.schedule)
        self.any_work = plan.any_work
        if self.dp.decisions is not None:
            self.dp.decisions.append(plan)
        if plan.any_rows and not rows and not dreqs:
            work = dataclasses.replace(work, dreqs=[_idle_request()])
        return plan, work

    @contextlib.contextmanager
    def launching(self, engine, plan: StepPlan):
        """Around the launch: the agreed token rows (`DataParallel.rows`), every forward eager
        when the plan says so."""
        with contextlib.ExitStack() as stack:
            if plan.eager:
                for f in engine.graph_registry.forwards():
                    stack.enter_context(f.forced_eager())
            self.dp.rows = plan.rows
            try:
                yield
            finally:
                self.dp.rows = None

    def keep_stepping(self, engine) -> bool:
        return self.any_work

    def expect_work(self) -> None:
        """A serving loop starts: step until the ranks agree there is no work left."""
        self.any_work = True


# ---------------------------------------------------------------------------
# Requests over ranks, outputs back to rank 0
# ---------------------------------------------------------------------------
def spread(items: Sequence, dp: DataParallel | None) -> list[int]:
    """Indices of `items` this rank serves: round-robin (item i on rank i % world)."""
    if dp is None:
        return list(range(len(items)))
    return list(range(dp.rank, len(items), dp.world_size))


def gather_outputs(outputs: list, indices: list[int], total: int, dp: DataParallel | None
                   ) -> list | None:
    """Every rank's `outputs` (of its `indices`) -> the full list of `total` on rank 0
    (None on the other ranks)."""
    if dp is None:
        return list(outputs)
    got = [None] * dp.world_size if dp.rank == 0 else None
    dist.gather_object((indices, outputs), got, dst=0, group=dp.host_group)
    if dp.rank != 0:
        return None
    full = [None] * total
    for idx, outs in got:
        for i, o in zip(idx, outs, strict=True):
            full[i] = o
    return full
