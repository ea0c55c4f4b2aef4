"""Batch-size schedules for CUDA graphs: which sizes to capture, and padding to them.

A CUDA graph replays fixed shapes, so one graph is captured per batch size of a
*schedule* and a batch of ``bs`` rows runs on the graph of the smallest scheduled
size ``>= bs`` (its padded size); the extra rows are padding.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import pairwise

__all__ = ["batch_size_schedule", "padded_batch_size"]

_POW2_HEAD = (1, 2, 4, 8)
_STEP = 8


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def batch_size_schedule(max_bs: int, sizes: Sequence[int] | None = None) -> list[int]:
    """The batch sizes to capture, ascending.

    Default (``sizes`` is None): ``1, 2, 4, 8``, then every multiple of 8
    (``16, 24, 32, ...``), all ``<= max_bs``, and always ``max_bs`` itself as the
    last size (``max_bs=100`` ends ``..., 88, 96, 100``).

    Explicit ``sizes`` (the ``cuda_graph_bs`` setting) are validated and returned
    as a new list: non-empty, ints ``>= 1``, strictly ascending, all ``<= max_bs``
    (``max_bs`` need not be among them). Any violation raises ``ValueError``.
    """
    if not _is_int(max_bs) or max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs (max_bs) must be an int >= 1, got {max_bs!r}")
    if sizes is None:
        out = [s for s in _POW2_HEAD if s <= max_bs]
        out += range(2 * _STEP, max_bs + 1, _STEP)
        if out[-1] != max_bs:
            out.append(max_bs)
        return out

    out = list(sizes)
    where = f"cuda_graph_bs (sizes)={out!r}"
    if not out:
        raise ValueError(f"{where}: expected at least one batch size")
    bad = [s for s in out if not _is_int(s) or s < 1]
    if bad:
        raise ValueError(f"{where}: expected ints >= 1, got {bad!r}")
    if any(a >= b for a, b in pairwise(out)):
        raise ValueError(f"{where}: expected strictly ascending sizes (sorted, no duplicates)")
    if out[-1] > max_bs:
        raise ValueError(f"{where}: expected every size <= cuda_graph_max_bs={max_bs}")
    return out


def padded_batch_size(schedule: Sequence[int], bs: int) -> int | None:
    """The smallest size of the ascending ``schedule`` that is ``>= bs``.

    ``None`` when ``bs`` is above the largest size (or the schedule is empty);
    ``ValueError`` when ``bs < 1``.
    """
    if bs < 1:
        raise ValueError(f"batch size must be >= 1, got {bs!r}")
    i = bisect.bisect_left(schedule, bs)
    return schedule[i] if i < len(schedule) else None
