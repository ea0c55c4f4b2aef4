"""Warm caches: the marker a complete precompile leaves in Triton's cache folder.

Once a precompile finished (with workers or without), a marker file
`graphdraft-precompiled-<fingerprint>.json` in the cache folder (the fingerprint covers the
spec with its kernel settings, the tasks, torch / triton versions, the GPU, the kernel
sources and the TRITON_* environment) makes later runs skip the workers and the in-process
precompile pass (`warmup.precompile_engine`): capture's warm-ups load each kernel from the
cache at its first launch. A stale marker only costs time: those warm-ups compile what is
missing. Without a marker the workers run and load what the cache has. The marker also lists
the tasks whose capture must warm up first (`warmup_tasks`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import triton

from graphdraft.kernels import keys
from graphdraft.startup.forwards import Task, task_order, tasks_of
from graphdraft.startup.spec import WorkerSpec, engine_spec

__all__ = ["cost_cache_path", "is_warm", "mark_warm", "marker_path", "warmup_tasks"]

logger = logging.getLogger(__name__)

_MARKER = "graphdraft-precompiled-{}.json"


def _fingerprint(spec: WorkerSpec, tasks: Sequence[Task]) -> str:
    """What decides which kernels a precompile of `spec` compiles (see the module docstring)."""
    kdir = Path(keys.__file__).resolve().parent  # graphdraft/kernels
    src = hashlib.sha256()
    for p in sorted(kdir.glob("*.py")):
        src.update(p.name.encode())
        src.update(p.read_bytes())
    dev = ""
    if torch.cuda.is_available() and spec.device.startswith("cuda"):
        d = torch.device(spec.device)
        dev = f"{torch.cuda.get_device_name(d)} {torch.cuda.get_device_capability(d)}"
    env = sorted((k, v) for k, v in os.environ.items()  # the GRAPHDRAFT_ kernel knobs are in
                 if k.startswith("TRITON_") and k != "TRITON_CACHE_DIR")  # the spec's config
    shape = dataclasses.replace(spec, cache_dir="", device="", factory="",
                                runtime=spec.runtime.replace(precompile_workers=None))
    parts = [repr(shape), repr(sorted(tasks, key=task_order)),
             torch.__version__, triton.__version__, dev, src.hexdigest(), repr(env)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def cost_cache_path(engine) -> Path | None:
    """Where `Engine.measure_costs(cache=True)` keeps the capture-time cycle costs of `engine`:
    `graphdraft-costs-<fingerprint>.json` beside the warm marker, the fingerprint the marker's
    (shapes, tasks, versions, GPU, environment) with every source of the package; None when
    no worker could rebuild the engine or nothing is captured."""
    found = _engine_marker(engine)
    if found is None:
        return None
    spec, tasks, _ = found
    src = hashlib.sha256(_fingerprint(spec, tasks).encode())
    root = Path(__file__).resolve().parents[1]  # graphdraft/
    for p in sorted(root.rglob("*.py")):
        src.update(str(p.relative_to(root)).encode())
        src.update(p.read_bytes())
    return Path(spec.cache_dir) / f"graphdraft-costs-{src.hexdigest()[:24]}.json"


def marker_path(spec: WorkerSpec, tasks: Sequence[Task]) -> Path:
    return Path(spec.cache_dir) / _MARKER.format(_fingerprint(spec, tasks))


def _engine_marker(engine) -> tuple[WorkerSpec, list[Task], Path] | None:
    """`engine`'s spec, tasks and warm-marker path; None when no worker could rebuild it or
    nothing is captured."""
    spec, _ = engine_spec(engine)
    tasks = tasks_of(engine)
    if spec is None or not tasks:
        return None
    return spec, tasks, marker_path(spec, tasks)


def is_warm(engine) -> bool:
    """The warm-cache marker of `engine` (`mark_warm`) is in Triton's cache folder: an earlier
    precompile of this engine shape finished there."""
    found = _engine_marker(engine)
    return found is not None and found[2].exists()


def warmup_tasks(engine) -> list[Task] | None:
    """The tasks whose capture must warm up first, from `engine`'s warm marker: those that
    first launch a kernel in capture order (`CompilePhase.first_tasks`; any other size only
    launches kernels an earlier warm-up loaded). None: no marker, or one without that list
    (every bucket warms up)."""
    found = _engine_marker(engine)
    if found is None:
        return None
    try:
        listed = json.loads(found[2].read_text()).get("warmup")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(listed, list):
        return None
    try:
        return [(str(f), None if k is None else int(k), int(bs)) for f, k, bs in listed]
    except (TypeError, ValueError):  # another layout (an older marker): every bucket warms up
        return None


def mark_warm(engine, warmup: Sequence[Task] | None = None) -> Path | None:
    """Write the warm-cache marker of `engine` (after its precompile finished), with the
    tasks that must warm up before their capture (`warmup_tasks`; None: not known, every
    bucket warms up); None when no worker could rebuild it, nothing is captured, or the cache
    folder is not writable."""
    found = _engine_marker(engine)
    if found is None:
        return None
    _, tasks, path = found
    data = {"tasks": len(tasks), "time": time.time()}
    if warmup is not None:
        data["warmup"] = [list(t) for t in warmup]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as e:
        logger.debug("precompile marker not written: %s", e)
        return None
    return path
