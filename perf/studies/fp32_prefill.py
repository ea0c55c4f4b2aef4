"""Does the fp32 prefill keep its speed on the 16-row FMA tile? (GPU only, a study.)

`python3 -m perf.studies.fp32_prefill --out DIR`

fp32 models (the shipped demo pair) run the extend attention's dots on the FMA units, and
since session 16 every fp32 launch takes the 16-row tile (`extend_attention.FMA_TILE_CASES`:
the 128-row tile spilled 3.4 KB a thread at D = 32, 110 KB at D = 128). This study times one
prefill chunk of `--tokens` prompt tokens (one row, paged cache, page 16, causal) through
`paged_extend_attention` in fp32 with the tile the code picks, against the 128-row tile the
prefill took before (`tile_config` patched for that call only), at the shipped pair's shape
(8 q heads, 4 kv heads, D 32) and, for the 16-row tile only, at the 8B head shape (32 / 8 / 128:
its 128-row fp32 tile takes minutes to compile). CUDA events, median of `--reps` after
warm-up; the first call's seconds (its compile on a cold cache) are kept too.
Writes `DIR/fp32_prefill.json`.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from graphdraft.kernels import extend_attention
from perf.timing import median_us, write_json

SHAPES = {"shipped_pair": (8, 4, 32), "llama_8b": (32, 8, 128)}


def _inputs(tokens: int, hq: int, hkv: int, d: int, seed: int = 0):
    page = 16
    pages = math.ceil(tokens / page)
    g = torch.Generator().manual_seed(seed)
    table = (torch.randperm(pages, generator=g) + 1).view(1, pages).to(torch.int32)
    kc = torch.randn((pages + 1) * page, hkv, d, generator=g)
    vc = torch.randn((pages + 1) * page, hkv, d, generator=g)
    q = torch.randn(tokens, hq, d, generator=g)
    e = torch.tensor([tokens], dtype=torch.int32)
    args = (q, kc, vc, torch.zeros(1, dtype=torch.int64), e.clone(), e,
            torch.zeros(1, dtype=torch.int64), table)
    return [x.cuda() for x in args], page


def time_prefill(tokens: int, shape: tuple[int, int, int], tile: tuple[int, int, int] | None,
                 reps: int) -> dict:
    """One row of `tokens` new tokens over no prefix; `tile` forces (BLOCK_M, BLOCK_N, warps)."""
    args, page = _inputs(tokens, *shape)

    def call():
        return extend_attention.paged_extend_attention(*args, page, 0.088, max_kv_len=tokens,
                                                       max_extend=tokens)

    original = extend_attention.tile_config
    if tile is not None:
        extend_attention.tile_config = lambda *a, **k: tile
    try:
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        us = median_us(call, warmup=3, reps=reps)
    finally:
        extend_attention.tile_config = original
    return {"tile": list(tile) if tile else "chosen", "first_call_s": round(first_s, 3),
            "median_us": round(us, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.reps < 1:
        ap.error(f"--tokens / --reps: expected ints >= 1, got {a.tokens} / {a.reps}")
    if not torch.cuda.is_available():
        print("no CUDA device: this study times GPU kernels (nothing written)")
        return 0
    rows = []
    for name, shape in SHAPES.items():
        tiles = [None] + ([(128, 64, 4)] if name == "shipped_pair" else [])
        for tile in tiles:
            r = {"shape": name, "hq_hkv_d": list(shape), "tokens": a.tokens,
                 **time_prefill(a.tokens, shape, tile, a.reps)}
            rows.append(r)
            print(f"{name:<13} tile {str(r['tile']):<14} {r['median_us']:>9.1f} us "
                  f"(first call {r['first_call_s']:.2f} s)")
    if a.out:
        write_json(a.out, "fp32_prefill.json", {"gpu": torch.cuda.get_device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
