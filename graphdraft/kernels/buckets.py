"""Size buckets: which row counts share one compiled variant of the Triton kernels.

Triton compiles a kernel once per *specialization key*: its constexprs, launch options, and,
for every int argument it may specialize, whether the value is 1 or divisible by 16 (and
16-byte alignment of pointers). A row count passed plainly would therefore compile a new
variant for 1, for multiples of 16 and for the rest, times every per-size constexpr. The
kernels here pass batch / row / token counts (and strides that scale with them) as
`do_not_specialize` arguments and pick their tiles per bucket of rows, so a batch-size
schedule compiles a handful of variants per kernel, not one per size:

* `rows_block(rows)`: the lanes of the per-row metadata kernels: 64 for every row count
  (`cdiv(rows, 64)` programs; one compiled variant where 16 / 64 by row count compiled two);
* `gemv.m_bucket(m)`: the GEMV row tile (1 | 16 | 32 | 64) and, for M <=
  `KernelConfig.finish_norm_max_m` (1), the fused-norm finisher;
* `gemm_m_bucket(m)`: above the GEMV's rows and up to `KernelConfig.gemm_max_m`, the row
  bucket (64 | 128 | 256 | 512 | 1024) whose measured route `gemm_config` gives for a card
  and projection shape in `KernelConfig.gemm_routes` (a `kernels.gemm` tile or cuBLASLt; the
  rest: cuBLAS; only tile routes compile anything);
* (not buckets: PDL is one variant at every row count, `KernelConfig.pdl_max_rows` a
  runtime argument of it, `kernels.pdl`; the split argmax's second stage loops over its
  splits with fixed lanes, `argmax.argmax_stage2`).

The thresholds come from a `KernelConfig` (`kernels=`; None: the default config): the one the
launches run under. `row_bucket(rows)` names the combination; `representative_sizes` picks one batch size of a
schedule per distinct combination (the sizes a warm-up must run to compile what every size
of the schedule needs: `graphdraft.startup.warmup`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from graphdraft.kernels import gemv
from graphdraft.kernels.config import GEMV_MAX_M, KernelConfig
from graphdraft.kernels.config import default as default_config
from graphdraft.kernels.gemm import GemmConfig

__all__ = ["GEMM_M_BUCKETS", "gemm_config", "gemm_m_bucket",
           "representative_sizes", "row_bucket", "rows_block"]

_ROWS_BLOCK = 64


def rows_block(rows: int) -> int:
    """Lanes per program of a kernel over `rows` per-row values: 64 at every row count (the
    grid takes `cdiv(rows, 64)` programs). These kernels are elementwise over rows (a few
    loads and stores per row, one warp): masked lanes at fewer rows cost nothing measurable,
    and one tile means one compiled variant per kernel for the whole schedule."""
    if rows < 0:
        raise ValueError(f"rows: expected >= 0, got {rows}")
    return _ROWS_BLOCK


GEMM_M_BUCKETS = (64, 128, 256, 512, 1024)
"""Row buckets of `kernels.gemm` (each M of a bucket runs its bucket's tile; M is a runtime
argument of the kernel, so a bucket compiles one variant per tile)."""

@functools.lru_cache(maxsize=16)
def _routes(gemm_routes: tuple) -> dict[tuple[str, int, int, int], GemmConfig | str]:
    """`KernelConfig.gemm_routes` as a dict, tile tuples as `GemmConfig`s."""
    return {key: route if isinstance(route, str) else GemmConfig(*route)
            for key, route in gemm_routes}


def gemm_m_bucket(m: int) -> int:
    """The smallest of `GEMM_M_BUCKETS` holding m rows (ValueError above the largest)."""
    for b in GEMM_M_BUCKETS:
        if 1 <= m <= b:
            return b
    raise ValueError(f"m: expected 1..{GEMM_M_BUCKETS[-1]} rows, got {m}")


def _gemm_rows(rows: int, kc: KernelConfig) -> bool:
    """Whether `rows` rows may run `kernels.gemm` under `kc` (the Triton path, above the
    GEMV's rows, at most `gemm_max_m` and the largest bucket)."""
    return (kc.use_triton and kc.small_m_max < rows <= min(kc.gemm_max_m, GEMM_M_BUCKETS[-1]))


def gemm_config(m: int, n: int, k: int, card: str, *, kernels: KernelConfig | None = None
                ) -> GemmConfig | str | None:
    """The route of an `[m, k] x [n, k]^T` product on `card` (`gemm.card_name`) under
    `kernels` (None: the default config): a `kernels.gemm` tile or `gemm.CUBLASLT` from
    `kernels.gemm_routes`, or None where plain cuBLAS runs it (no entry for the card and
    shape at m's bucket, or m outside `_gemm_rows`)."""
    kc = kernels if kernels is not None else default_config()
    if not _gemm_rows(m, kc):
        return None
    return _routes(kc.gemm_routes).get((card, gemm_m_bucket(m), n, k))


def row_bucket(rows: int, *, kernels: KernelConfig | None = None) -> tuple:
    """The compile-relevant choices of a launch over `rows` rows under `kernels` (equal tuples:
    the same compiled variants): the GEMV tile and finisher, above `kernels.small_m_max` the
    `kernels.gemm` row bucket where `kernels.gemm_routes` has tiles for it (else cuBLAS), and
    `rows_block`."""
    kc = kernels if kernels is not None else default_config()
    if rows < 1:
        raise ValueError(f"rows: expected >= 1, got {rows}")
    if rows <= min(kc.small_m_max, GEMV_MAX_M):
        gemv_key = (gemv.m_bucket(rows), rows <= kc.finish_norm_max_m)
    elif _gemm_rows(rows, kc) and any(b == gemm_m_bucket(rows) and not isinstance(t, str)
                                      for (_, b, _, _), t in kc.gemm_routes):
        gemv_key = ("gemm", gemm_m_bucket(rows))
    else:
        gemv_key = ("cublas",)
    return (gemv_key, rows_block(rows))


def representative_sizes(schedule: Sequence[int], row_multipliers: Sequence[int] = (1,), *,
                         kernels: KernelConfig | None = None) -> list[int]:
    """One batch size per bucket of `schedule` (the largest of each), descending.

    A forward at batch size bs launches kernels over `bs * r` rows for each r of
    `row_multipliers` (e.g. 1 for per-request kernels and N for the N tokens a request
    carries into a decode step); two sizes share a bucket when every such row count does
    (`row_bucket` under `kernels`). Warming up these sizes compiles every variant the schedule
    needs.
    """
    sizes = sorted(set(schedule))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"schedule: expected batch sizes >= 1, got {list(schedule)!r}")
    mults = sorted(set(row_multipliers))
    if not mults or mults[0] < 1:
        raise ValueError(f"row_multipliers: expected ints >= 1, got {list(row_multipliers)!r}")
    best: dict[tuple, int] = {}
    for bs in sizes:
        best[tuple(row_bucket(bs * r, kernels=kernels) for r in mults)] = bs
    return sorted(best.values(), reverse=True)
