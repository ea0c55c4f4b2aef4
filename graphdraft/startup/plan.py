"""The precompile plan: one entry per distinct Triton specialization key a set of engines launches.

`plan_keys` dry-runs every task (`forwards.tasks_of`: each captured forward at one size per
bucket, then the prefill probes) on a throw-away engine of each spec (`spec.build_engine`)
under `KeyRecorder(launch=False)`: each launch's key is recorded, no kernel runs. Each distinct
key becomes one `entries.PlanEntry`: the kernel's name and its first launch's arguments as
data, from which a worker compiles the entry with `JITFunction.warmup` and no engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import torch

from graphdraft.kernels.keys import KeyRecorder, all_kernels
from graphdraft.startup.entries import PlanEntry, encode_arg
from graphdraft.startup.forwards import PREFILL, Task, forwards, owner_resets
from graphdraft.startup.probes import probe_prefill_dry
from graphdraft.startup.spec import WorkerSpec, build_engine

__all__ = ["heavy_rank", "plan_keys"]

_HEAVY_FIRST = ("extend_attention", "decode_attention", "gemv", "tree_", "rope", "norm")
"""Kernel modules in the order their keys go into the plan (the longest compiles first, so
the last compile to start is a short one); the other modules follow."""


def heavy_rank(kernel_name: str) -> int:
    mod = kernel_name.split(".", 1)[0]
    return next((i for i, p in enumerate(_HEAVY_FIRST) if mod.startswith(p)), len(_HEAVY_FIRST))


_PLAN_NOW = _HEAVY_FIRST.index("tree_")
"""A prefill probe's keys of the modules before this rank (attention, GEMV: the longest
compiles) go into the plan at once; its lighter keys wait for a capture that launches them."""

_Held = tuple[PlanEntry, tuple[str, tuple]]
"""A planned entry and its (kernel, key)."""


class _Planner:
    """`plan_keys`' state: the entries in plan order, the held probe keys, the first capture
    task of each key, the recorder over every kernel."""

    def __init__(self, emit, event) -> None:
        self.rec = KeyRecorder(all_kernels(), launch=False, keep=lambda j: True, zero_ints=True)
        self.entries: list[PlanEntry] = []
        self.keys: list[tuple[str, tuple]] = []
        self.held: list[_Held] = []
        self.first_capture: dict[tuple[str, tuple], tuple[int, Task]] = {}
        self.emit, self.event = emit, event

    def release(self, batch: list[_Held]) -> None:
        """Append `batch` to the plan (heavy kernels first, stable) and hand it out."""
        batch = sorted(batch, key=lambda x: heavy_rank(x[0].kernel))
        for entry, key in batch:
            self.entries.append(entry)
            self.keys.append(key)
        if self.emit is not None and batch:
            self.emit([entry for entry, _ in batch])

    def _kept(self) -> list[_Held]:
        """The recorder's new first launches as entries (its kept arguments then dropped: the
        activations are not kept alive)."""
        new = [(PlanEntry(name, [encode_arg(a) for a in args],
                          {k: encode_arg(v) for k, v in kwargs.items()}, i, t), (name, key))
               for name, key, args, kwargs, _grid, (i, t) in self.rec.kept]
        self.rec.kept.clear()
        return new

    def after_probe(self, new: list[_Held]) -> None:
        """A probe's attention / GEMV keys go out at once; its lighter keys wait for a capture
        that launches them."""
        self.held += [x for x in new if heavy_rank(x[0].kernel) >= _PLAN_NOW]
        self.release([x for x in new if heavy_rank(x[0].kernel) < _PLAN_NOW])

    def after_capture(self, index: int, task: Task, new: list[_Held]) -> None:
        """A capture task's new keys, and the held probe keys it launches, go out."""
        for _, key in new:
            self.first_capture.setdefault(key, (index, task))
        where = self.rec.where
        launched = [x for x in self.held if (index, task) in where[x[1][0]][x[1][1]]]
        self.held = [x for x in self.held if x not in launched]
        for _, key in launched:
            self.first_capture.setdefault(key, (index, task))
        self.release(new + launched)

    def run_engine(self, index: int, spec: WorkerSpec, tasks: Sequence[Task]) -> None:
        """Dry-run `tasks` (prefill probes first) on a throw-away engine of `spec`, freed after."""
        device = torch.device(spec.device)
        ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        order = [t for t in tasks if t[0] == PREFILL] + [t for t in tasks if t[0] != PREFILL]
        with ctx:
            engine = build_engine(spec)
            if self.event is not None:
                self.event("engine")
            with torch.inference_mode(), torch.no_grad(), self.rec:
                self._dry_run(index, engine, order)
            if device.type == "cuda":
                torch.cuda.synchronize()
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def _dry_run(self, index: int, engine, order: Sequence[Task]) -> None:
        fmap = dict(forwards(engine))
        resets = owner_resets(engine)
        probes_left = sum(t[0] == PREFILL for t in order)
        for task in order:
            family, k, bs = task
            for r in resets:
                r()
            self.rec.context = (index, task)
            if family == PREFILL:
                probe_prefill_dry(engine, bs, self.rec)
                self.after_probe(self._kept())
                probes_left -= 1
                if self.event is not None and not probes_left:
                    self.event("probes")
                continue
            fmap[(family, k)]._forward(bs)
            self.after_capture(index, task, self._kept())

    def finish(self, plans) -> tuple[list[PlanEntry], int, dict[tuple[int, Task], list[int]]]:
        """Release what is held, point each probe-first key at the capture that warms it up,
        and list per (engine index, task) the entries it launches."""
        self.release(self.held)
        self.held = []
        where = self.rec.where
        rank = {(i, t): r for r, (i, t) in enumerate(
            (i, t) for i, _, ts in plans for t in ts if t[0] != PREFILL)}
        for j, key in enumerate(self.keys):
            first = self.first_capture.get(key)
            if first is None:
                capture = [c for c in where[key[0]][key[1]] if c in rank]
                first = min(capture, key=rank.__getitem__) if capture else None
            entry = self.entries[j]
            if first is not None and (entry.engine, entry.task) != first:
                self.entries[j] = dataclasses.replace(entry, engine=first[0], task=first[1])
        needs: dict[tuple[int, Task], list[int]] = {}
        for pos, (name, key) in enumerate(self.keys):
            for c in where[name][key]:
                needs.setdefault(c, []).append(pos)
        return self.entries, self.rec.total(), needs


def plan_keys(plans: Sequence[tuple[int, WorkerSpec, Sequence[Task]]], emit=None, event=None
              ) -> tuple[list[PlanEntry], int, dict[tuple[int, Task], list[int]]]:
    """Dry-run each (engine index, spec, tasks) on a throw-away engine of the spec
    (`build_engine`, freed after) under one `KeyRecorder(launch=False, zero_ints=True)` of
    every kernel (`kernels.keys.all_kernels`), the engine's and drafter's buffers reset to
    neutral rows before each task; return one `PlanEntry` per distinct key over all of them
    (its first launch's arguments, `encode_arg`), the key count, and per (engine index, task)
    the positions of the entries it launches (what a capture of that task waits for when it
    overlaps the compiles).

    The order is fixed as the dry runs go, and `emit(batch)` (if given) gets each batch of
    entries at once, so workers compile while the rest is planned: an engine's prefill
    probes run first and their attention / GEMV keys (the longest compiles) lead; then each
    capture task in capture order adds the keys it launches that are not planned yet
    (heavy kernels first), the probes' lighter keys among them; the probes' keys no capture
    launches come last. Each entry's `task` is the first capture task that launches it (the
    one whose capture warms it up: `CompilePhase.first_tasks`), else its probe. `event(name)`
    (if given) marks the plan's steps: "engine" (a throw-away engine built), "probes" (its
    prefill probes dry-run)."""
    planner = _Planner(emit, event)
    for index, spec, tasks in plans:
        planner.run_engine(index, spec, tasks)
    return planner.finish(plans)
