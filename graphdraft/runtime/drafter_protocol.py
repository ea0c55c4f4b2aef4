"""What the Engine needs from a drafter: the `Drafter` protocol and its cycle seam.

`Drafter` is every drafter: the Engine calls `run` after an eager target forward (prefill and
mixed steps, and decode steps of drafters that do not run inside the cycle), `capture_graphs`
from `Engine.capture_graphs`, and `decode_hidden_buffer(bs)` for the view `[bs * N, kH]` its
target's decode forward may write the aux hidden states into (None: the drafter has no such
buffer; `run` gets the target's own tensor).

`CycleDrafter` is a drafter whose decode draft runs *inside* the Engine's speculative cycle
(one CUDA graph: prepare, verify, accept, draft, commit), over persistent buffers the Engine
writes directly: `supports_cycle` is True, and the Engine
  - writes the accepted tokens `[rows, N]` into `cycle_tokens(rows)` (the draft's first-step
    ids) and each row's accept length into `cycle_accept_lengths()` `[max_bs]` int32,
  - calls `draft_staged(bs)` -> `next_tokens [bs, S + 1]` int32 (a view of the drafter's own
    buffer) inside the cycle, or replays `decode_graphs` in the split mode,
  - calls `reset_neutral()` around capture, reports `decode_graphs` / `multi_step_graphs` in
    its metrics, counts each cycle in `stats.calls` / `stats.decode_calls`, and passes
    `copy_output=False` to `run`.
`graphdraft.runtime.drafter.EagleDrafter` is the one cycle drafter; any other drafter is run eagerly.

Draft lengths below S (the Engine's speculation policy, `graphdraft.serving.policy`): a cycle
drafter that also has `use_draft_lengths(steps, capture_decode=...)` drafts any k of `steps`
inside the cycle: `draft_staged(bs, k)` (k = 0: the KV-only step, nothing drafted), `cycle_tokens(rows, k + 1)`,
`decode_hidden_buffer(bs, k + 1)`, `decode_graphs_for(k)` (split mode) and
`decode_forwards()` (metrics). Without it the Engine keeps k = S (the calls above, no k).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from graphdraft.runtime.batch import ForwardContext

DRAFTER_METHODS = ("run", "capture_graphs", "decode_hidden_buffer")
DRAFTER_ATTRIBUTES = ("stats", "supports_cycle")
CYCLE_METHODS = ("cycle_tokens", "cycle_accept_lengths", "draft_staged", "reset_neutral")
CYCLE_ATTRIBUTES = ("decode_graphs", "multi_step_graphs")


class Drafter(Protocol):
    """Any drafter the Engine can run (eagerly, after its target forward)."""

    supports_cycle: bool
    stats: Any

    def run(self, ctx: ForwardContext, hidden_states: torch.Tensor | None,
            output_tokens: torch.Tensor, accept_lengths: torch.Tensor) -> torch.Tensor:
        """-> next_tokens `[bs, S + 1]` int32 (column 0 the last verified token)."""
        ...

    def capture_graphs(self, progress: bool = True) -> None:
        """Capture the drafter's own graphs, if any (a drafter without graphs: nothing)."""
        ...

    def decode_hidden_buffer(self, bs: int) -> torch.Tensor | None:
        """The `[bs * N, kH]` view a decode `run` reads hidden states from, or None."""
        ...


class CycleDrafter(Drafter, Protocol):
    """A drafter whose decode draft runs inside the Engine's cycle graph (see the module)."""

    decode_graphs: Any
    multi_step_graphs: Any

    def run(self, ctx: ForwardContext, hidden_states: torch.Tensor | None,
            output_tokens: torch.Tensor, accept_lengths: torch.Tensor, *,
            copy_output: bool = True) -> torch.Tensor: ...

    def cycle_tokens(self, rows: int) -> torch.Tensor:
        """`[rows, N]` int64 view: where the cycle's accept writes the accepted tokens."""
        ...

    def cycle_accept_lengths(self) -> torch.Tensor:
        """`[max_bs]` int32: where the cycle's accept writes each row's accept length."""
        ...

    def draft_staged(self, bs: int) -> torch.Tensor:
        """The decode draft over `bs` staged rows (graph-capturable) -> `[bs, S + 1]` int32."""
        ...

    def reset_neutral(self) -> None:
        """Every buffer the cycle reads back to its neutral (padded-row) values."""
        ...


def check_drafter(drafter: object) -> Drafter:
    """Raise ValueError naming `drafter` and the missing members when `drafter` does not meet
    the `Drafter` protocol (or, with `supports_cycle` True, the `CycleDrafter` protocol);
    returns it unchanged."""
    missing = [m for m in DRAFTER_METHODS if not callable(getattr(drafter, m, None))]
    missing += [a for a in DRAFTER_ATTRIBUTES if not hasattr(drafter, a)]
    cycle = getattr(drafter, "supports_cycle", False)
    if not missing and not isinstance(cycle, bool):
        raise ValueError(f"drafter: expected supports_cycle to be a bool, got "
                         f"{type(cycle).__name__}")
    if not missing and cycle:
        missing += [m for m in CYCLE_METHODS if not callable(getattr(drafter, m, None))]
        missing += [a for a in CYCLE_ATTRIBUTES if not hasattr(drafter, a)]
    if missing:
        kind = "CycleDrafter" if cycle is True else "Drafter"
        raise ValueError(f"drafter: expected an object meeting the {kind} protocol "
                         f"(graphdraft.runtime.drafter_protocol), {type(drafter).__name__} lacks "
                         f"{', '.join(missing)}")
    return drafter  # type: ignore[return-value]
