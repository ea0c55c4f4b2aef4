"""capture: a generic CUDA-graph manager (mechanism only, no domain knowledge).

Schedules of batch sizes, a shared graph memory pool, and :class:`CapturedForward`,
which captures one forward function per padded batch size and replays it, or
falls back to running it eagerly.
"""

from .compiles import (
    cache_dir,
    cache_entries,
    thread_builds,
    thread_compiles,
    triton_builds,
    triton_compiles,
)
from .graphs import (
    EAGER_ENV,
    EAGER_REASONS,
    CapturedForward,
    GraphPool,
    GraphStats,
    eager_forced,
    graphs_available,
)
from .registry import GraphKey, GraphRegistry, merge_stats
from .schedule import batch_size_schedule, padded_batch_size

__all__ = [
    "EAGER_ENV",
    "EAGER_REASONS",
    "CapturedForward",
    "GraphKey",
    "GraphPool",
    "GraphRegistry",
    "GraphStats",
    "batch_size_schedule",
    "cache_dir",
    "cache_entries",
    "eager_forced",
    "graphs_available",
    "merge_stats",
    "padded_batch_size",
    "thread_builds",
    "thread_compiles",
    "triton_builds",
    "triton_compiles",
]
