"""GraphRegistry: the captured forwards of one runtime, keyed by (family, k).

A family is one forward function specialized by an optional integer `k` (for a drafting
runtime: the draft length; None for a forward with no such parameter). The registry is the
one list every consumer reads: capture order (insertion order), statistics per family,
warm-up and precompile plans. Nothing finds a forward by scanning attributes or parsing
names.
"""

from __future__ import annotations

from collections.abc import Iterator

from .graphs import CapturedForward, GraphStats

GraphKey = tuple[str, "int | None"]
"""(family, k): e.g. ("spec_cycle", 3), ("draft_multi_step", None)."""

_SUMMED = ("capture_seconds", "pool_bytes", "eager_seconds", "precompile_seconds")


def merge_stats(name: str, stats: list[GraphStats]) -> GraphStats:
    """One `GraphStats` named `name` whose counters are the sums of `stats`' (per size)."""
    if len(stats) == 1 and stats[0].name == name:
        return stats[0]
    m = GraphStats(name)
    for st in stats:
        m.replays.update(st.replays)
        m.compiles.update(st.compiles)
        m.built.update(st.built)
        m.worker_built.update(st.worker_built)
        for key, v in st.eager.items():
            m.eager[key] = m.eager.get(key, 0) + v
        for attr in _SUMMED:
            mine = getattr(m, attr)
            for bs, v in getattr(st, attr).items():
                mine[bs] = mine.get(bs, 0) + v
        m.replay_seconds.update(st.replay_seconds)
        m.dropped = sorted(set(m.dropped) | set(st.dropped))
    return m


class GraphRegistry:
    """`{(family, k): CapturedForward}` in capture order (the order of `add`).

    Register the widest forward of a family first when its graphs should be captured first
    (later, smaller graphs then reuse the shared pool's memory).
    """

    def __init__(self) -> None:
        self._by_key: dict[GraphKey, CapturedForward] = {}

    def add(self, family: str, k: int | None, forward: CapturedForward) -> CapturedForward:
        """Register `forward` under (family, k); ValueError if the key is taken or the
        arguments are of the wrong kind. Returns `forward`."""
        if not isinstance(family, str) or not family:
            raise ValueError(f"GraphRegistry.add: family must be a non-empty str, got {family!r}")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise ValueError(f"GraphRegistry.add: k must be None or an int >= 0, got {k!r}")
        if not isinstance(forward, CapturedForward):
            raise ValueError(f"GraphRegistry.add: forward must be a CapturedForward, "
                             f"got {type(forward).__name__}")
        if (family, k) in self._by_key:
            raise ValueError(f"GraphRegistry.add: ({family!r}, {k!r}) is already registered")
        self._by_key[(family, k)] = forward
        return forward

    def extend(self, other: GraphRegistry) -> None:
        """Register every entry of `other` (in its order) here."""
        for (family, k), fwd in other.items():
            self.add(family, k, fwd)

    def get(self, family: str, k: int | None = None) -> CapturedForward | None:
        return self._by_key.get((family, k))

    def __getitem__(self, key: GraphKey) -> CapturedForward:
        return self._by_key[key]

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[GraphKey]:
        return iter(self._by_key)

    def items(self) -> list[tuple[GraphKey, CapturedForward]]:
        """(key, forward) pairs in capture order."""
        return list(self._by_key.items())

    def forwards(self) -> list[CapturedForward]:
        """Every registered forward, in capture order."""
        return list(self._by_key.values())

    def families(self) -> list[str]:
        """Family names in order of first registration."""
        return list(dict.fromkeys(f for f, _ in self._by_key))

    def family(self, family: str) -> dict[int | None, CapturedForward]:
        """The forwards of one family by k (empty if none)."""
        return {k: fwd for (f, k), fwd in self._by_key.items() if f == family}

    def merged_stats(self) -> list[GraphStats]:
        """One `GraphStats` per family (its per-k forwards' statistics summed)."""
        return [merge_stats(f, [fwd.stats for fwd in self.family(f).values()])
                for f in self.families()]

    def summary(self) -> dict[str, tuple[int, int]]:
        """Per family: (graph replays, eager runs)."""
        return {st.name: (st.total_replays, st.total_eager) for st in self.merged_stats()}
