"""Kernel settings: one frozen `KernelConfig`, built once, passed down.

`RuntimeConfig.kernels` holds the one a runtime uses (its `backend` follows
`RuntimeConfig.kernel_backend`); the models hold the config they were built with
(`set_kernels`), `graphdraft.ops` takes it (`kernels=`) and hands it to the kernel wrappers
(`kernels/gemv.py`, `kernels/pdl.launch_options`, ...). A wrapper or op called without one uses
`default()`: a config built once, on first use, from the environment (backend "torch", as the
ops' default path). Nothing here is read again after construction: changing an environment
variable later changes no config already built (tests: `tests/test_kernel_config.py`).

Settings, their environment variables (read by `KernelConfig.from_env()`; unset or empty: the
default) and defaults. A value that does not parse raises ValueError naming the variable.

| field | env var | values | default | what it does |
|---|---|---|---|---|
| `backend` | (`RuntimeConfig.kernel_backend`) | "triton", "torch" | "torch" | Triton kernels or the plain torch path (each op's torch reference) |
| `gemv_tiles` | `GRAPHDRAFT_GEMV_TILES` | "wide", "uniform" | "wide" | "uniform": single-row GEMVs take the multi-row tiles (`gemv.gemv_config`; a tuning aid) |
| `gemv_split` | `GRAPHDRAFT_GEMV_SPLIT` | int >= 1, or unset | unset (None) | force the K split of every GEMV that may split (not the LM head's argmax one); None: the tile heuristic. Tuning and tests |
| `gemv_block_k` | `GRAPHDRAFT_GEMV_BLOCK_K` | power of two in [16, 1024], or unset | unset (None) | force BLOCK_K of the same GEMVs; None: the tile heuristic |
| `gemv_num_stages` | `GRAPHDRAFT_GEMV_NUM_STAGES` | int in [1, 8], or unset | unset (None) | force the software-pipeline stages of every GEMV launch the tile heuristic sizes; None: the heuristic (a tuning aid) |
| `gemv_swap_ab` | `GRAPHDRAFT_GEMV_SWAP_AB` | bool | on | M > 1 GEMVs compute `w @ x^T` (the weights as the MMA's M side: Hopper's wgmma) instead of `x @ w^T` |
| `small_m_max` | `GRAPHDRAFT_SMALL_M_MAX` | 0..64 | 32 | rows at or below which the Triton path runs the GEMV instead of cuBLAS (0: never) |
| `gemm_max_m` | `GRAPHDRAFT_GEMM_MAX_M` | 0..4096 | 1024 | rows up to which (above `small_m_max`) the Triton path takes the `gemm_routes` route of a listed shape (else cuBLAS; 0: never) |
| `gemm_routes` | (none: `perf.verify --gemm-routes` replaces it) | ((card, row bucket, N, K), route) pairs | `GEMM_ROUTES` | per card (`torch.cuda.get_device_name`), projection shape and row bucket (`buckets.gemm_m_bucket`) the route measured faster than plain cuBLAS on that card: "cublaslt" (`gemm.linear_lt`) or a `gemm.GemmConfig` as a tuple |
| `gemv_pdl` | `GRAPHDRAFT_GEMV_PDL` | bool | on | launch the GEMV with programmatic dependent launch |
| `stream_evict_first` | `GRAPHDRAFT_STREAM_EVICT_FIRST` | bool | on | load GEMV weights `evict_first` (read once per step) |
| `finish_maxnreg` | `GRAPHDRAFT_FINISH_MAXNREG` | int >= 1, or 0 / "none" | 128 | register cap of M == 1 GEMV launches that carry a finisher (None: the compiler's choice) |
| `finish_norm_max_m` | `GRAPHDRAFT_FINISH_NORM_MAX_M` | 0..64 | 1 | rows up to which the residual + RMSNorm runs in the GEMV's last program (more: its own launch) |
| `pdl` | `GRAPHDRAFT_PDL` | bool | on | small chain kernels launch with PDL (`kernels/pdl.py`) |
| `pdl_max_rows` | `GRAPHDRAFT_PDL_MAX_ROWS` | int >= 0 | 4 | small kernels over more rows let the next kernel launch only when they end (a runtime argument) |
| `pdl_early_loads` | `GRAPHDRAFT_PDL_EARLY_LOADS` | bool | on | kernels taking `EARLY` load their metadata before the PDL wait |
| `decode_block_n` | `GRAPHDRAFT_DECODE_BLOCK_N` | power of two in [16, 256] | 64 | KV positions per loop step of the decode attention (`kernels/decode_attention.py`; also the split granule) |
| `decode_fused_combine` | `GRAPHDRAFT_DECODE_FUSED_COMBINE` (`perf.long --fused-combine`) | bool | off | decode attention over several splits combines them in its own last program per (row, kv head) (a split counter), no second launch (`kernels/decode_attention.py`, "Fused combine") |
| `extend_tiles` | `GRAPHDRAFT_EXTEND_TILES` | four `BMxBNxW` (BLOCK_M, BLOCK_N, num_warps), comma-separated | `16x64x4,32x64x4,64x64x4,128x64x4` | the extend attention's tile for the 16-, 32-, 64- and 128-row cases of `extend_attention.tile_config` (a tuning aid: perf/verify.py sweeps it) |
| `extend_num_stages` | `GRAPHDRAFT_EXTEND_NUM_STAGES` | int >= 1 | 2 | software-pipeline stages of the extend attention's split kernel, tile cases of 16-64 rows (verify, draft first step) |
| `extend_prefill_stages` | `GRAPHDRAFT_EXTEND_PREFILL_STAGES` | int >= 1 | 3 | the same for the 128-row case (prefill chunks) |

Bools: "1", "true", "yes", "on" / "0", "false", "no", "off" (any case). The measurements behind
the defaults are in the docstrings of `gemv.py` / `pdl.py` and in perf/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ENV_VARS", "KernelConfig", "TORCH", "TRITON", "default", "resolve"]

GEMV_MAX_M = 64
"""Most rows one GEMV launch takes (`gemv.MAX_M`): the bound of the row thresholds."""
GEMM_MAX_M = 4096
"""The bound of `KernelConfig.gemm_max_m`."""
GEMM_ROUTES: tuple = (
    (("NVIDIA H100 80GB HBM3", 64, 4096, 14336), "cublaslt"),
    (("NVIDIA H100 80GB HBM3", 128, 4096, 14336), "cublaslt"),
)
"""`KernelConfig.gemm_routes`' default: ((card, row bucket, N, K), route) where a route beat
plain cuBLAS by more than 3 % on that card in `perf/studies/mid_m_gemm.py` (perf/RESULTS.md
2026-12-06g): on an H100 SXM, the 8B down_proj (N 4096, K 14336) at up to 128 rows through
cuBLASLt. A route is "cublaslt" or `gemm.GemmConfig`'s fields as a tuple (block_m, block_n,
block_k, split, swap_ab, num_warps, num_stages, tma). Other cards, shapes and buckets: plain
cuBLAS."""
BACKENDS = ("triton", "torch")
GEMV_TILES = ("wide", "uniform")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


EXTEND_TILES = ((16, 64, 4), (32, 64, 4), (64, 64, 4), (128, 64, 4))
"""The extend attention's default tiles, (BLOCK_M, BLOCK_N, num_warps) for its 16-, 32-, 64-
and 128-row cases."""
_EXTEND_TILES_EXPECTED = ("4 tiles (BLOCK_M, BLOCK_N, num_warps): BLOCK_M a power of two in "
                          "[16, 128], BLOCK_N in [16, 256], num_warps in [1, 16]")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _route_ok(entry: object) -> bool:
    """One `gemm_routes` pair: ((card name, bucket, N, K: positive ints), "cublaslt" or a tile
    tuple)."""
    if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], tuple)
            and len(entry[0]) == 4 and isinstance(entry[0][0], str)
            and all(_is_int(v) and v > 0 for v in entry[0][1:])):
        return False
    route = entry[1]
    if route == "cublaslt":
        return True
    return (isinstance(route, tuple) and len(route) == 8
            and all(_is_int(v) and v > 0 for v in route[:4] + route[5:7])
            and isinstance(route[4], bool) and isinstance(route[7], bool))


def _pow2(v: object, lo: int, hi: int) -> bool:
    return _is_int(v) and lo <= v <= hi and v & (v - 1) == 0


@dataclass(frozen=True)
class KernelConfig:
    """Every kernel setting (the module docstring's table); frozen and hashable. Bad values
    raise ValueError naming the field."""

    backend: str = "torch"
    gemv_tiles: str = "wide"
    gemv_split: int | None = None
    gemv_block_k: int | None = None
    gemv_num_stages: int | None = None
    gemv_swap_ab: bool = True
    """On: the 8B target's verify forward faster at bs 1-8 and equal at 16, the cycle faster at
    bs 8 and equal at 16 and 64 (H100, A/B in one run: perf/RESULTS.md 2026-12-05j)."""
    small_m_max: int = 32
    """32: faster drafts at bs 32 than 16; 64 was slower from bs 8 up (H200: perf/RESULTS.md,
    fourth session)."""
    gemm_max_m: int = 1024
    gemm_routes: tuple = GEMM_ROUTES
    gemv_pdl: bool = True
    """On: faster at bs 1, neutral at bs 8 (perf/RESULTS.md, third session, and "Figures moved out of the code")."""
    stream_evict_first: bool = True
    """On: faster at bs 1, neutral at bs 8 (perf/RESULTS.md, "Figures moved out of the code")."""
    finish_maxnreg: int | None = 128
    finish_norm_max_m: int = 1
    pdl: bool = True
    pdl_max_rows: int = 4
    """4: PDL on every small kernel sped a draft call up at bs 1 but slowed it at bs 8
    (perf/RESULTS.md, third session run 8)."""
    pdl_early_loads: bool = True
    decode_block_n: int = 64
    decode_fused_combine: bool = False
    """Off until a GPU run shows the one-launch form faster (issue #42: the bs-1 decode
    attention at long contexts is latency bound; `perf.long --attention-only --fused-combine
    both` measures both forms). Not measured on a GPU yet; both forms give the same output
    (tests/test_decode_attention_fused.py)."""
    extend_tiles: tuple[tuple[int, int, int], ...] = EXTEND_TILES
    """(BLOCK_M, BLOCK_N, num_warps) for the tile cases BLOCK_M 16, 32, 64, 128, in that order
    (`extend_attention.tile_config`). The 128-row case (prefill chunks) at 4 warps: a faster 8k
    prefill than at 8 (H200, perf/RESULTS.md 2026-12-04c)."""
    extend_num_stages: int = 2
    """2 stages: one layer's N = 4 verify attention at kv 4096 faster than with 3 at bs 8, 64
    and 256 (H200, perf/RESULTS.md 2026-12-04c)."""
    extend_prefill_stages: int = 3
    """Stages of the 128-row case: 3 gave a faster 8k prefill at (128, 64, 4) than 2 (H200,
    perf/RESULTS.md 2026-12-04d)."""

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise ValueError(f"{name}: expected {expected}, got {getattr(self, name)!r}")

        need(self.backend in BACKENDS, "backend", "'triton' or 'torch'")
        need(self.gemv_tiles in GEMV_TILES, "gemv_tiles", "'wide' or 'uniform'")
        need(self.gemv_split is None or (_is_int(self.gemv_split) and self.gemv_split >= 1),
             "gemv_split", "None or an int >= 1")
        need(self.gemv_block_k is None or (_is_int(self.gemv_block_k) and 16 <= self.gemv_block_k
                                           <= 1024 and self.gemv_block_k & (self.gemv_block_k - 1) == 0),
             "gemv_block_k", "None or a power of two in [16, 1024]")
        need(self.gemv_num_stages is None or (_is_int(self.gemv_num_stages)
                                              and 1 <= self.gemv_num_stages <= 8),
             "gemv_num_stages", "None or an int in [1, 8]")
        need(_is_int(self.small_m_max) and 0 <= self.small_m_max <= GEMV_MAX_M, "small_m_max",
             f"an int in [0, {GEMV_MAX_M}]")
        need(_is_int(self.gemm_max_m) and 0 <= self.gemm_max_m <= GEMM_MAX_M, "gemm_max_m",
             f"an int in [0, {GEMM_MAX_M}]")
        need(isinstance(self.gemm_routes, tuple) and all(_route_ok(r) for r in self.gemm_routes),
             "gemm_routes", "a tuple of ((card, row bucket, N, K), route) pairs, route 'cublaslt' or "
             "(block_m, block_n, block_k, split, swap_ab, num_warps, num_stages, tma)")
        for name in ("gemv_pdl", "stream_evict_first", "pdl", "pdl_early_loads", "gemv_swap_ab",
                     "decode_fused_combine"):
            need(isinstance(getattr(self, name), bool), name, "a bool")
        need(self.finish_maxnreg is None or (_is_int(self.finish_maxnreg) and self.finish_maxnreg >= 1),
             "finish_maxnreg", "None or an int >= 1")
        need(_is_int(self.finish_norm_max_m) and 0 <= self.finish_norm_max_m <= GEMV_MAX_M,
             "finish_norm_max_m", f"an int in [0, {GEMV_MAX_M}]")
        need(_is_int(self.pdl_max_rows) and self.pdl_max_rows >= 0, "pdl_max_rows", "an int >= 0")
        need(_pow2(self.decode_block_n, 16, 256), "decode_block_n", "a power of two in [16, 256]")
        need(isinstance(self.extend_tiles, tuple) and len(self.extend_tiles) == len(EXTEND_TILES)
             and all(isinstance(t, tuple) and len(t) == 3 and _pow2(t[0], 16, 128)
                     and _pow2(t[1], 16, 256) and _pow2(t[2], 1, 16) for t in self.extend_tiles),
             "extend_tiles", _EXTEND_TILES_EXPECTED)
        need(_is_int(self.extend_prefill_stages) and self.extend_prefill_stages >= 1,
             "extend_prefill_stages", "an int >= 1")
        need(_is_int(self.extend_num_stages) and self.extend_num_stages >= 1, "extend_num_stages",
             "an int >= 1")

    @property
    def use_triton(self) -> bool:
        """The Triton path (`backend == "triton"`)."""
        return self.backend == "triton"

    def replace(self, **changes: Any) -> KernelConfig:
        """A copy with `changes` (validated)."""
        return _replace(self, tuple(sorted(changes.items())))

    def with_backend(self, backend: str) -> KernelConfig:
        """This config with `backend` (the same object when it already has it)."""
        return self if backend == self.backend else self.replace(backend=backend)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> KernelConfig:
        """The config named by the environment variables of the module table (`environ`:
        default `os.environ`), read once here; `overrides` (field=value) win over them.
        ValueError naming the variable for a value that does not parse or is out of range."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, (var, parse) in ENV_VARS.items():
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                values[name] = parse(raw)
                cls(**{name: values[name]})  # range checks, reported under the variable's name
            except ValueError as e:
                raise ValueError(f"{var}: expected {_EXPECTED[name]}, got {raw!r} ({e})") from None
        values.update(overrides)
        return cls(**values)


@functools.lru_cache(maxsize=64)
def _replace(cfg: KernelConfig, changes: tuple) -> KernelConfig:
    return dataclasses.replace(cfg, **dict(changes))


def _bool(raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("not a bool")


def _int(raw: str) -> int:
    return int(raw, 10)


def _maxnreg(raw: str) -> int | None:
    if raw.lower() == "none":
        return None
    v = _int(raw)
    return None if v == 0 else v


def _tiles(raw: str) -> tuple[tuple[int, int, int], ...]:
    tiles = []
    for part in raw.split(","):
        fields = part.strip().lower().split("x")
        if len(fields) != 3:
            raise ValueError(f"{part.strip()!r} is not BMxBNxW")
        tiles.append(tuple(_int(f) for f in fields))
    return tuple(tiles)


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw.lower() not in options:
            raise ValueError(f"not one of {options}")
        return raw.lower()
    return parse


ENV_VARS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "gemv_tiles": ("GRAPHDRAFT_GEMV_TILES", _choice(*GEMV_TILES)),
    "gemv_split": ("GRAPHDRAFT_GEMV_SPLIT", _int),
    "gemv_block_k": ("GRAPHDRAFT_GEMV_BLOCK_K", _int),
    "gemv_num_stages": ("GRAPHDRAFT_GEMV_NUM_STAGES", _int),
    "gemv_swap_ab": ("GRAPHDRAFT_GEMV_SWAP_AB", _bool),
    "small_m_max": ("GRAPHDRAFT_SMALL_M_MAX", _int),
    "gemm_max_m": ("GRAPHDRAFT_GEMM_MAX_M", _int),
    "gemv_pdl": ("GRAPHDRAFT_GEMV_PDL", _bool),
    "stream_evict_first": ("GRAPHDRAFT_STREAM_EVICT_FIRST", _bool),
    "finish_maxnreg": ("GRAPHDRAFT_FINISH_MAXNREG", _maxnreg),
    "finish_norm_max_m": ("GRAPHDRAFT_FINISH_NORM_MAX_M", _int),
    "pdl": ("GRAPHDRAFT_PDL", _bool),
    "pdl_max_rows": ("GRAPHDRAFT_PDL_MAX_ROWS", _int),
    "pdl_early_loads": ("GRAPHDRAFT_PDL_EARLY_LOADS", _bool),
    "decode_block_n": ("GRAPHDRAFT_DECODE_BLOCK_N", _int),
    "decode_fused_combine": ("GRAPHDRAFT_DECODE_FUSED_COMBINE", _bool),
    "extend_tiles": ("GRAPHDRAFT_EXTEND_TILES", _tiles),
    "extend_num_stages": ("GRAPHDRAFT_EXTEND_NUM_STAGES", _int),
    "extend_prefill_stages": ("GRAPHDRAFT_EXTEND_PREFILL_STAGES", _int),
}
"""field -> (environment variable, parser): the module table."""

_BOOL = "1/true/yes/on or 0/false/no/off"
_EXPECTED = {
    "gemv_tiles": "'wide' or 'uniform'",
    "gemv_split": "an int >= 1",
    "gemv_block_k": "a power of two in [16, 1024]",
    "gemv_num_stages": "an int in [1, 8]",
    "gemv_swap_ab": _BOOL,
    "small_m_max": f"an int in [0, {GEMV_MAX_M}]",
    "gemm_max_m": f"an int in [0, {GEMM_MAX_M}]",
    "gemv_pdl": _BOOL,
    "stream_evict_first": _BOOL,
    "finish_maxnreg": "an int >= 1, or 0 / 'none'",
    "finish_norm_max_m": f"an int in [0, {GEMV_MAX_M}]",
    "pdl": _BOOL,
    "pdl_max_rows": "an int >= 0",
    "pdl_early_loads": _BOOL,
    "decode_block_n": "a power of two in [16, 256]",
    "decode_fused_combine": _BOOL,
    "extend_tiles": _EXTEND_TILES_EXPECTED + ", as BMxBNxW,BMxBNxW,...",
    "extend_num_stages": "an int >= 1",
    "extend_prefill_stages": "an int >= 1",
}

TRITON = KernelConfig(backend="triton")
"""The defaults on the Triton path (tests and benchmarks: no environment read)."""
TORCH = KernelConfig()
"""The defaults on the torch path (no environment read)."""


@functools.cache
def default() -> KernelConfig:
    """The config of a wrapper or op called without one: `KernelConfig.from_env()`, built once
    (the first call) and kept for the process."""
    return KernelConfig.from_env()


def resolve(kernels: KernelConfig | None = None) -> KernelConfig:
    """`kernels`, or `default()` when None."""
    return kernels if kernels is not None else default()
