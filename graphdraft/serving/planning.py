"""What one Engine step launches: the scheduled work, and the planner that fixes its plan.

`Engine.step` = `plan_step()` (admit, schedule: a `StepWork`) -> `planner.agree(engine,
work)` (a `data_parallel.StepPlan`: padded bs, mixed or decode, the multi-step skip, eager)
-> `launch(work, plan)` inside `planner.launching(engine, plan)` -> `retire_launched(keep)`.
`LocalPlanner` plans an engine serving alone; `data_parallel.LockstepPlanner` makes the
data-parallel ranks agree on one plan. Both drive only the Engine's public interface.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from capture import padded_batch_size
from graphdraft.runtime.batch import BatchRow
from graphdraft.serving.data_parallel import StepPlan
from graphdraft.serving.request import Request


@dataclass
class StepWork:
    """One step's rows as `Engine.plan_step` scheduled them."""

    rows: list[BatchRow]                 # prefill rows (host-written), prompt chunks
    preqs: list[Request]                 # their requests
    dreqs: list[Request]                 # decode requests (rows prepared on the device)

    @property
    def all_mid_chunk(self) -> bool:
        """Every row is a prefill chunk that is not its prompt's last (no draft from it can be
        verified: the drafter's multi-step is skipped)."""
        return bool(self.rows) and not self.dreqs and all(
            r.next_ids is not None and r.next_ids[-1] >= 0 for r in self.rows)


class LocalPlanner:
    """The planner of an Engine serving alone: the step as scheduled, padded to its own
    schedule, never forced eager."""

    def agree(self, engine, work: StepWork) -> tuple[StepPlan, StepWork]:
        bs = len(work.rows) + len(work.dreqs)
        plan = StepPlan(any_rows=bs > 0, mixed=bool(work.rows),
                        padded_bs=padded_batch_size(engine.schedule, max(bs, 1)) or bs,
                        rows=None, all_mid_chunk=work.all_mid_chunk, eager=False,
                        any_work=engine.has_work)
        return plan, work

    def launching(self, engine, plan: StepPlan):
        return contextlib.nullcontext()

    def keep_stepping(self, engine) -> bool:
        return engine.has_work

    def expect_work(self) -> None:
        """Nothing to reset."""
