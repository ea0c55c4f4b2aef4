"""What the Engine needs from a drafter: the `Drafter` protocol, every member of which it uses.

Shapes: `bs` rows (a padded batch size inside the cycle), `N = S + 1` tokens a decode row
verifies at the full draft length `S = speculative_num_steps`, `n = k + 1` at draft length
`k`, `kH` the target's aux hidden width.

The Engine binds a drafter once (`bind(DraftBinding)`: its shared buffers and settings), then
per decode cycle of draft length k, inside one CUDA graph when `capturable`:
  verify   the target writes its aux hidden states into `hidden_buffer(bs, n)` (or, None,
           keeps them: a drafter that reads no hidden state),
  accept   writes the accepted tokens into `accepted_tokens(bs, n)` and each row's accept
           length into `accept_lengths(bs)`,
  draft    `draft(bs, k)` -> the next drafts `[bs, S + 1]` int32 (column 0 the last accepted
           token; columns k + 1.. repeat column k; k = 0: nothing drafted), read from those
           buffers, `DraftBinding.inputs` (the rows' slots `req_pool_indices`, `seq_lens`)
           and `DraftBinding.states.valid_cache_lengths` (before this cycle's commit),
  commit   the Engine stores the drafts in the slot state for the next cycle's verify.
Prefill and mixed steps run eagerly: `draft_mixed(ctx, hidden, output_tokens, accept)` (a
`PadsMixedDraft` drafter: padded to the target's bucket, `draft_mixed_padded`, replayed).
The drafter's own captured forwards (if any) are in `graphs()`; the Engine captures them with
its own. Nothing else of a drafter is read or written from outside.

`TokenDrafter` is a base for drafters that read no hidden state (the n-gram drafter, one
written outside the package): the buffers the acceptance writes and the protocol's trivial
members; a subclass adds `draft` and `draft_mixed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from capture import GraphPool, GraphRegistry
from graphdraft.config import RuntimeConfig
from graphdraft.runtime.batch import ForwardContext
from graphdraft.runtime.buffers import InputBuffers, RuntimeStates
from graphdraft.runtime.slot_state import SlotState


@dataclass(frozen=True)
class DraftBinding:
    """The Engine's state a drafter may read (never write, except where a member's docstring
    says), handed to `Drafter.bind` once, before anything else.

    cfg             the runtime configuration (max_bs, S, page size, kernels, device, dtype)
    inputs          the target's `InputBuffers` of the step (ids `[T]`, positions, KV slots,
                    `req_pool_indices [bs]`, `seq_lens [bs]`, `extend_lens`, shifted prefill
                    ids), written by the Engine before the verify; the drafter may reuse them
                    after the verify (the `EagleDrafter` stages its own first step there)
    states          `RuntimeStates` (`valid_cache_lengths [R]`: committed tokens per slot)
    req_to_page     `[R, max_pages]` int32: the page table every KV pool of the Engine shares
    graph_pool      the memory pool the Engine's graphs are captured into
    graphs_enabled  whether CUDA graphs are captured at all (off: every forward runs eagerly)
    on_oom          "drop" or "raise": what a capture that runs out of memory does
    slots           the Engine's `SlotState` (None: not given): a drafter may read the rows'
                    logit controls there (penalties, counts, logit_bias; counted through the
                    last commit when `draft` runs: this cycle's accepted tokens, in
                    `accepted_tokens` within `accept_lengths`, are counted in the commit
                    after it) to propose what the verify, which applies them, accepts
                    (`ops.apply_draft_logit_controls`, its `accepted` window)
    """

    cfg: RuntimeConfig
    inputs: InputBuffers
    states: RuntimeStates
    req_to_page: torch.Tensor
    graph_pool: GraphPool
    graphs_enabled: bool
    on_oom: str
    slots: SlotState | None = None


@runtime_checkable
class Drafter(Protocol):
    """A drafter the Engine runs (see the module docstring for the order of the calls)."""

    capturable: bool
    """`draft` may run inside a CUDA graph (no host sync, fixed buffer addresses). False: the
    Engine runs it eagerly between its verify graph and its eager commit."""

    variable_draft_length: bool
    """`draft(bs, k)` drafts any k in 0..S (the speculation policy may pick k per cycle);
    False: the Engine always calls it with k = S."""

    def bind(self, binding: DraftBinding) -> None:
        """Called once by the Engine before any other member: allocate buffers for
        `binding.cfg.max_bs` rows, keep what it needs; ValueError naming `drafter` when the
        drafter cannot serve this configuration."""
        ...

    def graphs(self) -> GraphRegistry:
        """The drafter's own captured forwards (`(family, k)` keys; empty if none), in the
        order they should be captured; the Engine captures them with its own."""
        ...

    def reset_neutral(self) -> None:
        """Every buffer the cycle reads back to its neutral (padded-row) values; called around
        capture (graphs are recorded over inert rows)."""
        ...

    def hidden_buffer(self, bs: int, n: int) -> torch.Tensor | None:
        """`[bs * n, kH]` where the target's decode verify writes its aux hidden states (the
        drafter reads them in `draft`), or None: the drafter reads no hidden state."""
        ...

    def accepted_tokens(self, rows: int, n: int) -> torch.Tensor:
        """`[rows, n]` int64 view, unit column stride: where the acceptance writes each decode
        row's tokens (row j's first `accept_lengths[j]` are accepted, the last of them the new
        last verified token)."""
        ...

    def accept_lengths(self, rows: int) -> torch.Tensor:
        """`[rows]` int32 view: where the acceptance writes each row's accept length (0: an
        inert row, padded or done; its drafts are discarded)."""
        ...

    def draft(self, bs: int, k: int) -> torch.Tensor:
        """The decode draft of k tokens over `bs` rows (after the acceptance wrote them) ->
        `[bs, S + 1]` int32 (column 0 the last accepted token, columns 1..k the drafts,
        columns k + 1..S repeating column k; k = 0: all column 0). Capturable when
        `capturable`; valid until the next call."""
        ...

    def draft_mixed(self, ctx: ForwardContext, hidden_states: torch.Tensor | None,
                    output_tokens: torch.Tensor, accept_lengths: torch.Tensor) -> torch.Tensor:
        """A prefill / mixed step's draft (eager): `ctx` the target batch (prefill rows first),
        `hidden_states [ctx.input_num_tokens, kH]` (or None), `output_tokens
        [num_extends + num_decodes * N]` (the target's token after each sampled position),
        `accept_lengths [bs]` (prefill rows 1) -> `[bs, S + 1]` int32 as `draft`."""
        ...

    def on_cycle(self, k: int) -> None:
        """Host bookkeeping after each decode cycle was launched (e.g. counting); no device
        work (the cycle ran `draft` inside its graph)."""
        ...


@runtime_checkable
class DefersDraftKV(Protocol):
    """A drafter that can skip its KV-only draft step at k = 0 and write that KV later (an
    optional capability beside `Drafter`: `EagleDrafter` has it; the chain cycle uses it when
    `cfg.deferred_draft_kv` > 0)."""

    def defer_kv(self, columns: int) -> object:
        """From now on `draft(bs, 0)` stashes its inputs in a ring of `columns` cycles
        (allocated once, before capture) instead of writing the draft KV; returns the ring
        (`runtime.deferred_kv.DeferredDraftKV`: its host counters say when it must be
        rebuilt)."""
        ...

    def rebuild_deferred_kv(self, bs: int) -> None:
        """Write the stashed draft KV of rows [0, bs) and clear them (graph-capturable)."""
        ...


@runtime_checkable
class PadsMixedDraft(Protocol):
    """A drafter whose prefill / mixed step's draft runs padded to the target's padded
    forward's (R, Tb) bucket, so that it replays a graph (an optional capability beside
    `Drafter`: `EagleDrafter` has it; the chain's mixed step uses it for the steps its
    target forward ran padded)."""

    def pad_mixed(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """Once, before capture: serve the buckets `rows` x `tokens`; returns the
        `[max(tokens), kH]` buffer the padded target forward writes its aux hidden states
        into (its graphs, if any, are in `graphs()` from now on)."""
        ...

    def draft_mixed_padded(self, ctx: ForwardContext, output_tokens: torch.Tensor,
                           accept_lengths: torch.Tensor, bucket: tuple[int, int]) -> torch.Tensor:
        """`draft_mixed` of a step whose target forward ran padded to `bucket` (R, Tb), its
        aux hidden states in that buffer -> `[bs, S + 1]`."""
        ...

    def zero_dummy_kv(self) -> None:
        """After capture: the drafter's dummy KV page zeroed."""
        ...


DRAFTER_MEMBERS = ("capturable", "variable_draft_length", "bind", "graphs", "reset_neutral",
                   "hidden_buffer", "accepted_tokens", "accept_lengths", "draft", "draft_mixed",
                   "on_cycle")


def check_drafter(drafter: object) -> Drafter:
    """Raise ValueError naming `drafter` and the missing members when `drafter` does not meet
    the `Drafter` protocol; returns it unchanged."""
    missing = [m for m in DRAFTER_MEMBERS if not hasattr(drafter, m)]
    missing += [m for m in DRAFTER_MEMBERS[2:] if hasattr(drafter, m)
                and not callable(getattr(drafter, m))]
    if missing:
        raise ValueError(f"drafter: expected an object meeting the Drafter protocol "
                         f"(graphdraft.runtime.drafter_protocol), {type(drafter).__name__} lacks "
                         f"{', '.join(dict.fromkeys(missing))}")
    for flag in DRAFTER_MEMBERS[:2]:
        value = getattr(drafter, flag)
        if not isinstance(value, bool):
            raise ValueError(f"drafter: expected {flag} to be a bool, got {type(value).__name__}")
    return drafter  # type: ignore[return-value]


class TokenDrafter:
    """The members of `Drafter` that a drafter reading no hidden state shares. `bind` keeps
    `binding`, `cfg` and `S` and allocates, for `cfg.max_bs` rows:
      tokens  [max_bs * N] int64     `accepted_tokens` (the acceptance writes them)
      accept  [max_bs] int32         `accept_lengths`
      next    [max_bs, S + 1] int32  where a subclass writes the drafts it returns
    No graphs of its own (`draft` runs inside the Engine's cycle graph: keep it capturable or
    set `capturable = False`); `cycles` counts `on_cycle` calls. A subclass adds `draft` and
    `draft_mixed` and extends `bind` / `reset_neutral` for buffers of its own."""

    capturable = True
    variable_draft_length = True

    def __init__(self) -> None:
        self.cycles = 0

    def bind(self, binding: DraftBinding) -> None:
        cfg = binding.cfg
        self.binding, self.cfg, self.S = binding, cfg, cfg.speculative_num_steps
        mb, n, dev = cfg.max_bs, cfg.spec_num_tokens, cfg.device
        self.tokens = torch.zeros(mb * n, dtype=torch.int64, device=dev)
        self.accept = torch.zeros(mb, dtype=torch.int32, device=dev)
        self.next = torch.zeros(mb, self.S + 1, dtype=torch.int32, device=dev)

    def graphs(self) -> GraphRegistry:
        return GraphRegistry()

    def reset_neutral(self) -> None:
        self.tokens.zero_()
        self.accept.zero_()
        self.next.zero_()

    def hidden_buffer(self, bs: int, n: int) -> None:
        return None  # reads no hidden state

    def accepted_tokens(self, rows: int, n: int) -> torch.Tensor:
        return self.tokens[: rows * n].view(rows, n)

    def accept_lengths(self, rows: int) -> torch.Tensor:
        return self.accept[:rows]

    def on_cycle(self, k: int) -> None:
        self.cycles += 1
