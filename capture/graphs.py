"""CUDA graphs of one forward function over a padded batch-size schedule.

Mechanism only: a :class:`CapturedForward` wraps any ``forward(bs)`` that reads
the first ``bs`` rows of caller-owned static input buffers and returns tensors
(or a pytree of tensors). It captures one graph per scheduled batch size into a
shared :class:`GraphPool` and, at :meth:`CapturedForward.run`, replays the graph
of the padded size or falls back to calling ``forward(bs)`` eagerly.

Decision rule of ``run(bs, padded_bs=None)``, first match wins (see ``_decide``):

1. ``disabled``     -- built with ``enabled=False``, or CUDA unavailable: eager.
2. ``env``          -- the env var (default ``GRAPHDRAFT_EAGER``) was truthy at
   construction, or is truthy now (re-read on every call): eager.
3. replay           -- ``padded_bs`` given: the graph of exactly ``padded_bs`` if
   one was captured; otherwise the graph of the smallest captured size ``>= bs``.
4. ``above_max``    -- ``bs`` above the largest *scheduled* size: eager, WARNING once.
5. ``not_captured`` -- anything else (``capture()`` not called, skipped, or the
   size was dropped on out-of-memory): eager.

Inside ``with forced_eager():`` an enabled forward runs eagerly before rule 2 (reason
``lockstep``, counted in ``stats.eager`` from its first use): ranks that agreed to run a
step eagerly (data-parallel lock-step) all do so, whatever their own graphs are.

Multi-rank safety: the decision depends only on ``(bs, padded_bs, enabled, env
var, captured sizes)``, so ranks with equal inputs decide identically. Captured
sizes can differ between ranks only if an out-of-memory drop hit one rank and
not another; ranks whose graphs contain collectives should agree on a common set
after ``capture()`` (e.g. all-gather ``captured_sizes``) and call
:meth:`CapturedForward.restrict_to` with the intersection.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import torch
from torch.utils._pytree import tree_leaves

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - a declared dependency; fall back to log lines
    tqdm = None

from .compiles import thread_builds, thread_compiles
from .schedule import padded_batch_size

__all__ = [
    "EAGER_ENV",
    "EAGER_REASONS",
    "CapturedForward",
    "GraphPool",
    "GraphStats",
    "eager_forced",
    "graphs_available",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
OnOOM = Literal["drop", "raise"]

EAGER_ENV = "GRAPHDRAFT_EAGER"
EAGER_REASONS = ("disabled", "env", "above_max", "not_captured")
_TRUTHY = frozenset({"1", "true", "yes"})
_MiB = float(1 << 20)


@functools.cache
def graphs_available() -> bool:
    """Whether CUDA graphs can be used: ``torch.cuda.is_available()``, decided once."""
    return torch.cuda.is_available()


def eager_forced(flag: bool = False, env_var: str = EAGER_ENV) -> bool:
    """True if ``flag`` is set or ``env_var`` is "1"/"true"/"yes" (any case, read now)."""
    return bool(flag) or os.environ.get(env_var, "").strip().lower() in _TRUTHY


def _env_reader(var: str) -> Callable[[], str]:
    """A cheap ``os.environ.get(var, "")`` for run()'s hot path.

    A missing key costs ``os.environ.get`` two exceptions. CPython's
    ``os.environ`` keeps its entries, encoded, in the dict ``_data`` (which
    ``os.environ[...] = ...`` and ``del`` update); read it directly (a dict
    lookup) when it is there, else fall back to the public call.
    """
    env = os.environ
    data, enc, dec = (getattr(env, a, None) for a in ("_data", "encodekey", "decodevalue"))
    if not (isinstance(data, dict) and callable(enc) and callable(dec)):
        return lambda: env.get(var, "")
    key = enc(var)

    def read() -> str:
        v = data.get(key)
        return "" if v is None else dec(v)

    return read


class GraphPool:
    """One CUDA-graph memory pool, and the side stream captures into it use.

    Graph sets share one by passing it as ``pool=``; a :class:`CapturedForward`
    given none makes its own. Graphs of one pool reuse each other's freed intermediates, so they must
    never replay concurrently (replay them on one stream). Handle and stream are
    created lazily on first use, on the then-current device.
    """

    def __init__(self) -> None:
        self._handle: Any = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def handle(self) -> Any:
        """The ``torch.cuda.graph_pool_handle()`` token."""
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    @property
    def stream(self) -> torch.cuda.Stream:
        """The side stream for warm-up and capture (same stream for every capture)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream


@dataclass(repr=False)
class GraphStats:
    """Capture and run statistics of one :class:`CapturedForward` (live object).

    Per captured size: ``capture_seconds`` (wall time of warm-up + capture +
    the first replay), ``pool_bytes`` (growth of ``torch.cuda.memory_reserved()``
    across the capture itself, the allocator's free cache emptied just before:
    new device memory the pool took for this graph; captured largest first, the
    smaller graphs mostly reuse it and add ~0), ``eager_seconds`` (one
    synchronized warm-up forward; none for a size outside ``warmup_sizes``) and
    ``replay_seconds`` (the first replay, synchronized: it also uploads the graph).
    ``dropped``: scheduled sizes left uncaptured by out-of-memory.
    ``compiles``: JIT compilations (the forward's compile counter, by default Triton's:
    ``capture.compiles``) while precompiling, warming up and capturing that size; a size of
    an already compiled bucket adds 0. ``built``: of those, the ones Triton's compiler built
    here (misses of its on-disk cache; the rest were loaded from it: ``capture.compiles.
    thread_builds``). ``worker_built``: kernels that precompile worker processes built for this
    forward at that size (``graphdraft.startup``), before this process loaded
    them. ``precompile_seconds``: wall time of :meth:`CapturedForward.precompile` per size it ran.
    """

    name: str
    capture_seconds: dict[int, float] = field(default_factory=dict)
    pool_bytes: dict[int, int] = field(default_factory=dict)
    eager_seconds: dict[int, float] = field(default_factory=dict)
    replay_seconds: dict[int, float] = field(default_factory=dict)
    dropped: list[int] = field(default_factory=list)
    compiles: Counter[int] = field(default_factory=Counter)
    precompile_seconds: dict[int, float] = field(default_factory=dict)
    built: Counter[int] = field(default_factory=Counter)
    worker_built: Counter[int] = field(default_factory=Counter)
    replays: Counter[int] = field(default_factory=Counter)
    eager: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EAGER_REASONS, 0))

    @property
    def total_capture_seconds(self) -> float:
        return sum(self.capture_seconds.values())

    @property
    def total_compiles(self) -> int:
        return sum(self.compiles.values())

    @property
    def total_built(self) -> int:
        return sum(self.built.values())

    @property
    def total_worker_built(self) -> int:
        return sum(self.worker_built.values())

    @property
    def total_precompile_seconds(self) -> float:
        return sum(self.precompile_seconds.values())

    @property
    def total_pool_bytes(self) -> int:
        return sum(self.pool_bytes.values())

    @property
    def total_replays(self) -> int:
        return sum(self.replays.values())

    @property
    def total_eager(self) -> int:
        return sum(self.eager.values())

    @property
    def speedup(self) -> float | None:
        """Eager / replay time at the largest size where both were measured."""
        both = [bs for bs in self.replay_seconds if bs in self.eager_seconds]
        if not both:
            return None
        bs = max(both)
        return self.eager_seconds[bs] / max(self.replay_seconds[bs], 1e-9)

    def summary(self) -> str:
        """One line, e.g. ``draft: 5 graphs [1..16] 0.41s pool 12.0MiB compiles 7 ~3.2x | replays 9
        eager 2 (above_max=2)`` (with a precompile: ``0.41s (+0.30s precompile)``)."""
        sizes = sorted(self.capture_seconds)
        span = f"[{sizes[0]}..{sizes[-1]}]" if sizes else "[]"
        speed = f" ~{self.speedup:.1f}x" if self.speedup is not None else ""
        why = ", ".join(f"{k}={v}" for k, v in self.eager.items() if v)
        drop = f" dropped {self.dropped}" if self.dropped else ""
        pre = (f" (+{self.total_precompile_seconds:.2f}s precompile)" if self.precompile_seconds
               else "")
        built = (f" (built {self.total_built}, {self.total_worker_built} in workers)"
                 if self.worker_built else "")
        return (
            f"{self.name}: {len(sizes)} graphs {span} {self.total_capture_seconds:.2f}s{pre} "
            f"pool {self.total_pool_bytes / _MiB:.1f}MiB compiles {self.total_compiles}{built}"
            f"{speed}{drop} | "
            f"replays {self.total_replays} eager {self.total_eager}" + (f" ({why})" if why else "")
        )

    __repr__ = summary


@dataclass(slots=True)
class _Graph:
    """A captured graph and the static outputs its kernels write (kept alive with it)."""

    graph: Any
    outputs: Any


def _check_outputs(name: str, bs: int, out: object) -> None:
    """Host-side guard: every output tensor has a first dimension >= bs."""
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and (leaf.dim() == 0 or leaf.shape[0] < bs):
            raise RuntimeError(
                f"CUDA graph {name!r}: forward({bs}) returned a tensor of shape "
                f"{tuple(leaf.shape)}; every output tensor needs a first dimension >= bs={bs}"
            )


def _is_oom(exc: BaseException | None) -> bool:
    """OutOfMemoryError (or a CUDA 'out of memory' error) anywhere in the exception chain."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class CapturedForward(Generic[T]):
    """CUDA graphs of one ``forward(bs)`` over a padded batch-size schedule.

    ``forward(bs)`` must read only caller-owned static buffers (first ``bs`` rows)
    and be graph-safe (no host syncs, no new inputs per call). Whatever it
    returns at capture is kept, for the graph's lifetime, as that graph's static
    outputs. The module docstring gives the exact ``run()`` decision rule.

    Args:
        name: label for logs and stats.
        forward: the function to capture, called as ``forward(bs)``.
        batch_sizes: sizes to capture (any order; e.g. ``batch_size_schedule(...)``).
        pool: memory pool shared with other graph sets (None: a pool of its own).
        enabled: False never captures and always runs eagerly (reason ``disabled``).
        warmup_iters: eager calls of ``forward(bs)`` on the side stream before capturing bs.
        on_oom: ``"drop"``: an out-of-memory while warming up or capturing a size
            drops that size and capture goes on with the smaller ones (batches
            then pad to the next larger captured size, or run eagerly);
            ``"raise"``: propagate it.
        env_var: the eager-forcing environment variable (see :func:`eager_forced`).
        compile_counter: a ``() -> int`` count of JIT compilations so far (only grows);
            None: Triton's, in the calling thread (:func:`capture.compiles.thread_compiles`).
    """

    def __init__(
        self,
        name: str,
        forward: Callable[[int], T],
        batch_sizes: Sequence[int],
        *,
        pool: GraphPool | None = None,
        enabled: bool = True,
        warmup_iters: int = 2,
        on_oom: OnOOM = "drop",
        env_var: str = EAGER_ENV,
        compile_counter: Callable[[], int] | None = None,
    ) -> None:
        sizes = list(batch_sizes)
        if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise ValueError(f"{name}: batch_sizes must be non-empty ints >= 1, got {sizes!r}")
        if warmup_iters < 0:
            raise ValueError(f"{name}: warmup_iters must be >= 0, got {warmup_iters}")
        if on_oom not in ("drop", "raise"):
            raise ValueError(f"{name}: on_oom must be 'drop' or 'raise', got {on_oom!r}")
        self.name = name
        self.warmup_iters = warmup_iters
        self.warmup_sizes: set[int] | None = None
        """None: every size warms up before its capture; else only these (the caller knows
        which sizes launch what a larger warmed-up one already loaded: its JIT buckets)."""
        self.before_capture: Callable[[int], None] | None = None
        """Called with each size before its warm-up and capture (e.g. to wait until the
        kernels it launches are compiled elsewhere); None: nothing."""
        self._forward = forward
        self._sizes = sorted(set(sizes))
        self._max_bs = self._sizes[-1]
        self._pool = pool
        self._enabled = bool(enabled) and graphs_available()
        self._env_var = env_var
        self._env_read = _env_reader(env_var)
        self._env_at_init = eager_forced(env_var=env_var)
        self._on_oom = on_oom
        if compile_counter is not None and not callable(compile_counter):
            raise ValueError(f"{name}: compile_counter must be a callable () -> int or None, "
                             f"got {compile_counter!r}")
        self._compiles = compile_counter if compile_counter is not None else thread_compiles
        self._compiles()  # install Triton's hook now: compiles from here on are counted
        self._graphs: dict[int, _Graph] = {}
        self._lookup: list[int] = [0]  # _lookup[bs]: captured size a bs replays on
        self._stats = GraphStats(name)
        self._logged: set[str] = set()
        self._forced = False  # `forced_eager()`: every run is eager ("lockstep")

    # ----------------------------------------------------------------- properties
    @property
    def pool(self) -> GraphPool:
        """The memory pool graphs are captured into."""
        if self._pool is None:
            self._pool = GraphPool()
        return self._pool

    @property
    def active(self) -> bool:
        """Whether :meth:`capture` / :meth:`precompile` would run (enabled, CUDA available,
        eager not forced by the env var now or at construction)."""
        return self._enabled and not self._env_at_init and not eager_forced(env_var=self._env_var)

    @property
    def batch_sizes(self) -> list[int]:
        """The scheduled sizes, ascending."""
        return list(self._sizes)

    @property
    def captured_sizes(self) -> list[int]:
        """The sizes with a live graph, ascending."""
        return sorted(self._graphs)

    @property
    def stats(self) -> GraphStats:
        """Live statistics (not a copy)."""
        return self._stats

    def __repr__(self) -> str:
        return f"CapturedForward({self._stats.summary()})"

    # -------------------------------------------------------------------- capture
    def capture(self, stream: torch.cuda.Stream | None = None, progress: bool = True) -> list[int]:
        """Capture a graph for every scheduled size not yet captured; return the captured sizes.

        Per size, largest first (the smaller graphs then fit in the pool memory
        the larger ones left free, instead of fragmenting it): ``warmup_iters``
        eager calls on the side stream (``stream``, default ``pool.stream``) and
        a synchronize, then the capture into the shared pool on that stream, all
        under ``torch.no_grad()``. A
        no-op (logged at DEBUG) when disabled, CUDA is unavailable, or eager is
        forced by the env var (now or at construction). Out-of-memory: see
        ``on_oom``; calling ``capture()`` again retries the dropped sizes.
        ``progress``: a tqdm bar (an INFO line per size if tqdm is missing).
        Raises RuntimeError when an output tensor's first dimension is < bs.
        """
        if not self._enabled or self._env_at_init or eager_forced(env_var=self._env_var):
            logger.debug("%s: CUDA graphs disabled or eager forced; capture skipped", self.name)
            return []
        todo = [bs for bs in reversed(self._sizes) if bs not in self._graphs]
        oom: list[int] = []
        st = self._stats
        bar = progress and tqdm is not None
        level = logging.INFO if progress and not bar else logging.DEBUG  # no tqdm: a line per size
        sizes = tqdm(todo, desc=f"CUDA graphs {self.name}", unit="graph") if bar else todo
        with torch.no_grad(), contextlib.closing(sizes) if bar else contextlib.nullcontext():
            for bs in sizes:
                if self.before_capture is not None:
                    self.before_capture(bs)
                t0 = time.perf_counter()
                c0, b0 = self._compiles(), thread_builds()
                try:
                    eager_s = self._warmup(bs, stream)
                    graph, out, pool_bytes, replay_s = self._record(bs, stream)
                except Exception as e:
                    st.compiles[bs] += self._compiles() - c0
                    st.built[bs] += thread_builds() - b0
                    if self._on_oom == "raise" or not _is_oom(e):
                        raise
                    logger.debug("%s: out of memory at bs=%d: %s", self.name, bs, e)
                    oom.append(bs)
                    continue
                _check_outputs(self.name, bs, out)
                self._graphs[bs] = _Graph(graph, out)
                st.capture_seconds[bs] = time.perf_counter() - t0
                st.compiles[bs] += self._compiles() - c0
                st.built[bs] += thread_builds() - b0
                st.pool_bytes[bs] = pool_bytes
                st.replay_seconds[bs] = replay_s
                if eager_s is not None:
                    st.eager_seconds[bs] = eager_s
                logger.log(level, "%s: captured bs=%d in %.3fs, pool +%d B", self.name, bs,
                           st.capture_seconds[bs], pool_bytes)
        self._reindex()
        st.dropped = [bs for bs in self._sizes if bs not in self._graphs]
        if oom:
            logger.warning(
                "%s: out of GPU memory capturing CUDA graphs for batch sizes %s: dropped them; %s",
                self.name, sorted(oom),
                f"captured {self.captured_sizes}, batches pad to the next larger captured size "
                "or run eagerly" if self._graphs else "nothing captured, every batch runs eagerly",
            )
        logger.info("%s", st.summary())
        return self.captured_sizes

    def precompile(self, sizes: Iterable[int], stream: torch.cuda.Stream | None = None,
                   progress: bool = True) -> int:
        """Run ``forward(bs)`` once for each of ``sizes`` (scheduled sizes not yet captured,
        largest first) on the side stream, under ``torch.no_grad()``, so the JIT compiles
        what their buckets need before :meth:`capture`; return the compiles it counted.

        The caller picks one size per bucket of compiled variants (it knows which sizes
        share them); capture then finds every kernel compiled. Same no-op rule as
        :meth:`capture`; ``ValueError`` for a size that is not scheduled. Per size:
        ``stats.precompile_seconds`` and ``stats.compiles``. ``progress``: a tqdm bar (an
        INFO line per size if tqdm is missing).
        """
        sizes = sorted(set(sizes), reverse=True)
        bad = [bs for bs in sizes if bs not in self._sizes]
        if bad:
            raise ValueError(f"{self.name}: precompile sizes must be scheduled sizes "
                             f"{self._sizes}, got {bad}")
        if not self._enabled or self._env_at_init or eager_forced(env_var=self._env_var):
            return 0
        todo = [bs for bs in sizes if bs not in self._graphs]
        st = self._stats
        bar = progress and tqdm is not None and bool(todo)
        level = logging.INFO if progress and not bar else logging.DEBUG
        it = tqdm(todo, desc=f"JIT warm-up {self.name}", unit="size") if bar else todo
        total = 0
        with torch.no_grad(), contextlib.closing(it) if bar else contextlib.nullcontext():
            for bs in it:
                t0 = time.perf_counter()
                c0, b0 = self._compiles(), thread_builds()
                self._run_side(bs, stream)
                n = self._compiles() - c0
                st.compiles[bs] += n
                st.built[bs] += thread_builds() - b0
                st.precompile_seconds[bs] = time.perf_counter() - t0
                total += n
                logger.log(level, "%s: precompiled bs=%d in %.3fs, %d compiles", self.name, bs,
                           st.precompile_seconds[bs], n)
        return total

    def _run_side(self, bs: int, stream: torch.cuda.Stream | None) -> None:
        """One eager ``forward(bs)`` on the side stream, synchronized."""
        side = stream if stream is not None else self.pool.stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _check_outputs(self.name, bs, self._forward(bs))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def _warmup(self, bs: int, stream: torch.cuda.Stream | None) -> float | None:
        """``warmup_iters`` eager forwards on the side stream (none for a size outside
        ``warmup_sizes``); seconds of the last (synchronized) one."""
        if self.warmup_iters == 0 or (self.warmup_sizes is not None
                                      and bs not in self.warmup_sizes):
            return None
        side = stream if stream is not None else self.pool.stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_iters - 1):
                _check_outputs(self.name, bs, self._forward(bs))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _check_outputs(self.name, bs, self._forward(bs))
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        torch.cuda.current_stream().wait_stream(side)
        return seconds

    def _record(self, bs: int, stream: torch.cuda.Stream | None) -> tuple[Any, Any, int, float]:
        """Capture ``forward(bs)``; return (graph, static outputs, pool bytes, replay seconds)."""
        side = stream if stream is not None else self.pool.stream
        torch.cuda.synchronize()
        # A graph must not point at cuBLAS's cached workspace: torch.compile(mode=
        # "reduce-overhead") frees that cache before it records its own graphs, and a
        # graph captured over it would then replay into freed memory. Clearing it
        # here makes cuBLAS allocate a workspace inside this graph's pool.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()  # torch.cuda.graph does it too; done here so `before` is exact
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        prev = torch.cuda.current_stream()
        # No cyclic garbage collection while capturing: a dead object cycle holding an older
        # CUDA graph (a dropped drafter: its CapturedForward holds a bound method of it) would
        # be destroyed mid-capture, and freeing its pool's memory invalidates the capture
        # (torch.cuda.graph no longer collects before capturing). It is collected afterwards.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool.handle, stream=side):
                out = self._forward(bs)
        except BaseException:
            torch.cuda.set_stream(prev)  # a failed capture_end skips torch's own stream restore
            raise
        finally:
            if gc_was_enabled:
                gc.enable()
        torch.cuda.synchronize()
        pool_bytes = torch.cuda.memory_reserved() - before
        t0 = time.perf_counter()
        graph.replay()  # the first replay also uploads the graph (not left to the first run)
        torch.cuda.synchronize()
        return graph, out, pool_bytes, time.perf_counter() - t0

    def _reindex(self) -> None:
        """Rebuild the bs -> padded captured size table (O(1) lookups in run())."""
        sizes = self.captured_sizes
        top = sizes[-1] if sizes else 0
        self._lookup = [0] + [padded_batch_size(sizes, b) or 0 for b in range(1, top + 1)]

    def restrict_to(self, sizes: Iterable[int]) -> list[int]:
        """Keep only the graphs (and scheduled sizes) in ``sizes``; release the others.

        The multi-rank hook: pass the intersection of every rank's
        ``captured_sizes`` so all ranks replay the same graphs. The released
        graphs' memory returns to the pool, not to the device. The above-max
        threshold stays the original largest scheduled size.
        """
        keep = set(sizes)
        for bs in [b for b in self._graphs if b not in keep]:
            del self._graphs[bs]
            for d in (self._stats.capture_seconds, self._stats.pool_bytes,
                      self._stats.eager_seconds, self._stats.replay_seconds):
                d.pop(bs, None)
        self._sizes = [s for s in self._sizes if s in keep]
        self._stats.dropped = [s for s in self._stats.dropped if s in keep]
        self._reindex()
        return self.captured_sizes

    @contextlib.contextmanager
    def forced_eager(self):
        """Every ``run`` inside the block is eager (reason ``lockstep``); nests."""
        before, self._forced = self._forced, True
        try:
            yield self
        finally:
            self._forced = before

    # ------------------------------------------------------------------------ run
    def _decide(self, bs: int, padded_bs: int | None = None) -> int | str:
        """The captured size to replay, or the reason to run eagerly (module docstring)."""
        if bs < 1:
            raise ValueError(f"{self.name}: batch size must be >= 1, got {bs}")
        if not self._enabled:
            return "disabled"
        if self._forced:
            return "lockstep"
        if self._env_at_init or ((v := self._env_read()) and v.strip().lower() in _TRUTHY):
            return "env"
        if padded_bs is not None:
            if padded_bs < bs:
                raise ValueError(f"{self.name}: padded_bs={padded_bs} < bs={bs}")
            if padded_bs in self._graphs:
                return padded_bs
        elif bs < len(self._lookup):
            return self._lookup[bs]
        return "above_max" if bs > self._max_bs else "not_captured"

    def run(self, bs: int, padded_bs: int | None = None) -> T:
        """Replay the graph for ``bs`` (see the module docstring's rule) or call ``forward(bs)``.

        Replay returns the graph's static outputs: views into static buffers
        that the next replay of that graph overwrites, with the padded size's
        rows. Copy out what you keep. Eager returns ``forward(bs)``'s result.
        """
        d = self._decide(bs, padded_bs)
        if isinstance(d, int):
            g = self._graphs[d]
            g.graph.replay()
            self._stats.replays[d] += 1
            return g.outputs
        self._stats.eager[d] = self._stats.eager.get(d, 0) + 1
        if d not in self._logged:
            self._logged.add(d)
            if d == "above_max":
                x = self._stats.speedup
                logger.warning(
                    "%s: batch size %d is above the largest CUDA graph (%d): running eagerly, "
                    "%s; raise cuda_graph_max_bs", self.name, bs, self._max_bs,
                    f"about {x:.1f}x slower" if x else "slower than graph replay",
                )
            else:
                logger.debug("%s: running eagerly (%s) from bs=%d on; counted, not logged again",
                             self.name, d, bs)
        return self._forward(bs)
