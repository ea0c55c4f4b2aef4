"""The captured forwards of an engine, listed once, and the start-up's tasks over them.

`forwards(engine)` is the one list every start-up step reads (the precompile plan, the warm-up
sizes, the workers' builds per forward, the warm marker): the engine's graph registry
(`engine.graph_registry.items()`), `(key, CapturedForward)` pairs in capture order,
`key = (family, k)`.
A task is one forward at one batch size, `(family, k, bs)`, or `(PREFILL, None, tokens)`: one
eager prefill step of that many prompt tokens (`probes.probe_prefill`). A throw-away engine
built from the same shapes (`spec.build_engine`) lists the same keys, so a task names the same
forward in every process.
"""

from __future__ import annotations

from capture import CapturedForward, GraphRegistry
from graphdraft.kernels.buckets import representative_sizes
from graphdraft.startup.probes import prefill_probes

__all__ = ["ForwardKey", "PREFILL", "Task", "forward_of", "forwards", "owner_resets",
           "task_order", "tasks_of"]

ForwardKey = tuple[str, "int | None"]
"""(family, k): a captured forward's key in the engine's graph registry."""

Task = tuple[str, "int | None", int]
"""(family, k, batch size) of a captured forward, or (PREFILL, None, prompt tokens)."""

PREFILL = "prefill"
"""A task's family for an eager prefill step (no captured forward): `probes.prefill_probes`."""


def forwards(engine) -> list[tuple[ForwardKey, CapturedForward]]:
    """Every captured forward of `engine` (its drafter's included), in capture order: its
    graph registry's `(key, forward)` pairs (`engine.graph_registry`, a
    `capture.GraphRegistry`). ValueError when the engine has none."""
    registry = getattr(engine, "graph_registry", None)
    if not isinstance(registry, GraphRegistry):
        raise ValueError(f"engine: expected a graph_registry (capture.GraphRegistry), got "
                         f"{type(registry).__name__}")
    return registry.items()


def forward_of(engine, key: ForwardKey) -> CapturedForward:
    """The forward of `engine` under `key` (KeyError naming it when there is none)."""
    for k, f in forwards(engine):
        if k == key:
            return f
    raise KeyError(f"no captured forward {key!r} in this engine")


def owner_resets(engine, *, include_engine: bool = True) -> list:
    """The `_reset_neutral` methods of `engine` (unless `include_engine` is False) and of its
    drafter: every persistent buffer back to neutral rows, as before a capture."""
    owners = ([engine] if include_engine else []) + [getattr(engine, "drafter", None)]
    resets = [getattr(o, "_reset_neutral", None) for o in owners if o is not None]
    return [r for r in resets if r is not None]


def tasks_of(engine) -> list[Task]:
    """Every task the engine's precompile runs: each active captured forward (`forwards`) at
    its representative sizes (`buckets.representative_sizes` with rows per request 1 and
    `cfg.spec_num_tokens`; largest first), in capture order, then its prefill probes
    (`probes.prefill_probes`: what the first requests' eager prefill launches, compiled beside
    the capture instead of at the first request). Empty when nothing is captured."""
    n = int(getattr(engine.cfg, "spec_num_tokens", 1))
    kc = getattr(engine.cfg, "kernels", None)
    tasks: list[Task] = [(*key, bs) for key, f in forwards(engine) if getattr(f, "active", True)
                         for bs in representative_sizes(f.batch_sizes, (1, n), kernels=kc)]
    if not tasks or not callable(getattr(engine, "add_request", None)):  # not a serving engine
        return tasks
    return tasks + [(PREFILL, None, t) for t in prefill_probes(engine)]


def task_order(task: Task) -> tuple:
    """A sort key of tasks: by family, then k (None first), then the larger batch first."""
    family, k, bs = task
    return (family, -1 if k is None else k, -bs)
