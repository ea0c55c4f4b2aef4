"""The 8B target's projections at M = 128..1024 rows (large-batch decode, verify): cuBLAS
against `graphdraft.kernels.gemm` (swap-AB tiles, a K split summed by each tile's last
program, pointer or TMA loads) over a few tiles and splits (GPU only; issue #42 items 2 and 3).

`python3 -m perf.studies.mid_m_gemm --out DIR [--max-seconds 120] [--ms 256,128,64,512,1024]
[--shapes qkv,o,gate_up,down,lm_head] [--cublas-only]`

For each projection and M, each candidate is timed as a CUDA graph of back-to-back calls over
rotating weight copies larger than L2 (`perf.timing.graph_time_us`, the method of
`perf.verify`'s `matmuls`: no launch cost, no L2 hits), checked against `F.linear` first
(relative error of the fp32 difference over the fp32 product; a candidate over 1e-2 is
recorded, not ranked). Candidates:

- `cublas`: `F.linear(x, w)` (what `ops.linear` runs above the GEMV's rows today);
- `cublas_lt`: the same under `torch.backends.cuda.preferred_blas_library("cublaslt")`;
- `cublas_lt_bias`: `F.linear(x, w, zeros)` (torch runs a 1-D bias through cuBLASLt's bias
  epilogue: another heuristic's tiles, the same values);
- `cublas_no_rpr`: the same with `allow_bf16_reduced_precision_reduction` off (cuBLAS then
  may not split K with a bf16 reduction);
- `gemm[...]`: `kernels.gemm.gemm` per `candidates(m, n, k)`.

Each is printed as its time, `bw` (the weight bytes over the time, as a fraction of the copy
bandwidth measured in this run) and `rate` (the FLOPs over the time, as a fraction of an
8192^3 cuBLAS GEMM's rate measured in this run), against the floor max(FLOPs / rate,
weight bytes / bandwidth). Writes `mid_m_gemm.json` (every record) and ends with a table of
the best `gemm` config per (projection, M) and its time over cuBLAS's, and the routes
(`winners`: a tile or cuBLASLt under 0.97x plain cuBLAS) in `KernelConfig.gemm_routes`'
form; `perf.verify --gemm-routes` runs the forward with them.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from graphdraft.kernels.gemm import GemmConfig, gemm

MS = (256, 128, 64, 512, 1024)
"""Rows timed (the bs 64 verify / bs 256 decode row count first: a truncated run has it)."""
SMS = 132  # an H100 / H200's multiprocessors: the split targets


def _tiles(m: int) -> list[GemmConfig]:
    """The tiles tried at `m` rows (split 1): swap-AB with every row of a bucket in one
    program (128 or 256 rows) and plain 128-row tiles, through pointer loads and (more of
    them) through tensor descriptors (TMA); each pipeline within 200 KiB of shared memory."""
    swap = [(128, 64, 128, 4, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 4),
            (256, 64, 64, 8, 3), (256, 128, 64, 8, 3), (256, 64, 128, 8, 2)]
    plain = [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)]
    swap_tma = swap + [(128, 64, 128, 4, 4), (128, 128, 128, 8, 3), (128, 64, 64, 4, 6),
                       (256, 64, 64, 8, 4), (256, 128, 64, 8, 4)]
    plain_tma = plain + [(128, 128, 64, 4, 4), (128, 128, 128, 8, 3), (128, 64, 64, 4, 5)]
    out = []
    for tiles, swap_ab, tma in ((swap, True, False), (plain, False, False),
                                (swap_tma, True, True), (plain_tma, False, True)):
        for bm, bn, bk, w, st in tiles:
            if swap_ab and (bm > max(128, m) or (m > 128 and bm < 256 and m <= 256 and bn < 128)):
                continue  # every row in one program where the rows fit one
            if st * (bm + bn) * bk * 2 > 200 << 10:
                continue
            out.append(GemmConfig(bm, bn, bk, 1, swap_ab, w, st, tma))
    return out


def candidates(m: int, n: int, k: int) -> list[GemmConfig]:
    """Every tile of `_tiles(m)` at split 1 and at the splits 2, 3, 4, 6, 8 that keep at most
    2.5 programs per SM and slices of at least 4 BLOCK_K steps."""
    out = []
    for t in _tiles(m):
        tiles = -(-m // t.block_m) * -(-n // t.block_n)
        for split in (1, 2, 3, 4, 6, 8):
            if split > 1 and (tiles * split > 2.5 * SMS or k // split < 4 * t.block_k):
                continue
            out.append(GemmConfig(t.block_m, t.block_n, t.block_k, split, t.swap_ab,
                                  t.num_warps, t.num_stages, t.tma))
    return out


def label(c: GemmConfig) -> str:
    return (f"gemm[{'tma ' if c.tma else ''}{'swap ' if c.swap_ab else ''}{c.block_m}x{c.block_n}x{c.block_k} "
            f"s{c.split} w{c.num_warps} st{c.num_stages}]")


def shapes_8b() -> dict[str, tuple[int, int]]:
    """Projection name -> (N, K) of the Llama-3.1-8B shape."""
    from perf.models_8b import LLAMA31_8B as mc

    h, d = mc.hidden_size, mc.head_dim
    return {"qkv": ((mc.num_attention_heads + 2 * mc.num_key_value_heads) * d, h),
            "o": (h, mc.num_attention_heads * d), "gate_up": (2 * mc.intermediate_size, h),
            "down": (h, mc.intermediate_size), "lm_head": (mc.vocab_size, h)}


def _time(fn, copies: int, ref: torch.Tensor) -> dict:
    """fn(i) (call i of the graph) checked against `ref`, then timed."""
    from perf.timing import graph_time_us

    try:
        got = fn(0).float()
        err = float((got - ref).norm() / ref.norm())
        return {"us": graph_time_us(fn, 2 * copies), "rel_err": err}
    except Exception as e:  # noqa: BLE001 - a candidate that fails is a result
        return {"error": str(e).splitlines()[0][:200] if str(e) else type(e).__name__}


def _cublas_variants(x, ws, ref) -> dict:
    copies = len(ws)
    lin = lambda i: F.linear(x, ws[i % copies])  # noqa: E731
    rec = {"cublas": _time(lin, copies, ref)}
    zero = torch.zeros(ws[0].shape[0], device=x.device, dtype=x.dtype)
    rec["cublas_lt_bias"] = _time(lambda i: F.linear(x, ws[i % copies], zero), copies, ref)
    prev = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        rec["cublas_lt"] = _time(lin, copies, ref)
    except Exception as e:  # noqa: BLE001 - not every build has it: a result
        rec["cublas_lt"] = {"error": str(e)[:200]}
    finally:
        torch.backends.cuda.preferred_blas_library(prev)
    rpr = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not rpr
        rec["cublas_rpr" if not rpr else "cublas_no_rpr"] = _time(lin, copies, ref)
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = rpr
    return rec


def shape_row(name: str, n: int, k: int, m: int, ws: list[torch.Tensor], bw: float, rate: float,
              deadline: float) -> dict:
    """Every candidate at one (projection, M): `{"floor_us", "variants": {label: record}}`,
    each record with `us`, `bw`, `rate`, `rel_err` (or `error`)."""
    copies = len(ws)
    x = torch.randn(m, k, device=ws[0].device, dtype=ws[0].dtype)
    ref = F.linear(x, ws[0]).float()
    flops, wbytes = 2 * m * n * k, n * k * ws[0].element_size()
    row = {"name": name, "m": m, "n": n, "k": k,
           "floor_us": max(flops / rate, wbytes / bw) * 1e6, "truncated": False}
    recs = _cublas_variants(x, ws, ref)
    for c in candidates(m, n, k):
        if time.perf_counter() > deadline:
            row["truncated"] = True
            break
        recs[label(c)] = dict(_time(lambda i, c=c: gemm(x, ws[i % copies], c), copies, ref),
                              config=c.__dict__)
    for r in recs.values():
        if "us" in r:
            r["bw"] = wbytes / (r["us"] * 1e-6) / bw
            r["rate"] = flops / (r["us"] * 1e-6) / rate
    row["variants"] = recs
    return row


def best_gemm(row: dict) -> tuple[str, dict] | None:
    ok = {k: v for k, v in row["variants"].items()
          if k.startswith("gemm[") and "us" in v and v["rel_err"] < 1e-2}
    if not ok:
        return None
    key = min(ok, key=lambda kk: ok[kk]["us"])
    return key, ok[key]


WIN_MARGIN = 0.97
"""A route replaces plain cuBLAS at a (bucket, N, K) only below this fraction of its time."""


def winners(rows: list[dict], card: str, margin: float = WIN_MARGIN) -> tuple:
    """`KernelConfig.gemm_routes` from a sweep's rows on `card` (the json's "gpu"): per
    (card, row bucket of M, N, K) the fastest
    correct `gemm` tile (its fields as a tuple) or `cublas_lt_bias` ("cublaslt"), where it took
    under `margin` x plain cuBLAS's time; sorted by key."""
    import dataclasses

    from graphdraft.kernels.buckets import GEMM_M_BUCKETS, gemm_m_bucket
    from graphdraft.kernels.gemm import CUBLASLT

    out: dict = {}
    for row in rows:
        v = row["variants"]
        if "us" not in v.get("cublas", {}) or row["m"] > GEMM_M_BUCKETS[-1]:
            continue
        ok = {k: r for k, r in v.items() if "us" in r and r.get("rel_err", 1) < 1e-2
              and (k.startswith("gemm[") or k == "cublas_lt_bias")}
        if not ok:
            continue
        key = min(ok, key=lambda kk: ok[kk]["us"])
        if ok[key]["us"] < margin * v["cublas"]["us"]:
            route = (CUBLASLT if key == "cublas_lt_bias"
                     else dataclasses.astuple(GemmConfig(**ok[key]["config"])))
            out[(card, gemm_m_bucket(row["m"]), row["n"], row["k"])] = route
    return tuple(sorted(out.items()))


def print_row(row: dict) -> None:
    v = row["variants"]
    cb = v["cublas"]
    head = (f"[mid-m] {row['name']:8s} M={row['m']:5d} floor {row['floor_us']:7.1f} us | "
            f"cuBLAS {cb.get('us', float('nan')):7.1f} (bw {cb.get('bw', 0):.2f}, rate "
            f"{cb.get('rate', 0):.2f})")
    for key in ("cublas_lt", "cublas_lt_bias", "cublas_no_rpr", "cublas_rpr"):
        if key in v and "us" in v[key]:
            head += f" | {key} {v[key]['us']:.1f}"
    b = best_gemm(row)
    if b:
        head += (f" | best {b[0]} {b[1]['us']:7.1f} (bw {b[1]['bw']:.2f}, rate "
                 f"{b[1]['rate']:.2f}, {b[1]['us'] / cb['us']:.2f}x cuBLAS)")
    print(head, flush=True)
    for k, r in v.items():
        if "error" in r:
            print(f"[mid-m]   {k}: {r['error']}", flush=True)
        elif k.startswith("gemm["):
            print(f"[mid-m]   {k:40s} {r['us']:8.1f} us  bw {r['bw']:.2f}  rate {r['rate']:.2f}"
                  f"  err {r['rel_err']:.1e}", flush=True)


def main(argv: list[str] | None = None) -> int:
    from perf.cases import int_list
    from perf.timing import copy_bandwidth, write_json
    from perf.verify import gemm_rate

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="perf/out")
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument("--ms", type=int_list, default=MS, help="row counts (comma-separated)")
    p.add_argument("--cublas-only", action="store_true",
                   help="only the cuBLAS variants (e.g. under other CUBLASLT_WORKSPACE_SIZE)")
    p.add_argument("--shapes", default="o,down,qkv,gate_up,lm_head",
                   help="projections (comma-separated; of " + ",".join(shapes_8b()) + ")")
    a = p.parse_args(argv)
    shapes = shapes_8b()
    names = [s for s in a.shapes.split(",") if s]
    bad = [s for s in names if s not in shapes]
    if bad:
        p.error(f"--shapes: unknown {bad}; expected names of {list(shapes)}")
    if not torch.cuda.is_available():
        raise SystemExit("perf.studies.mid_m_gemm: needs a CUDA GPU")
    t0 = time.perf_counter()
    deadline = t0 + a.max_seconds
    bw, rate = copy_bandwidth("cuda"), gemm_rate("cuda")
    print(f"[mid-m] {torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, GEMM "
          f"{rate / 1e12:.0f} TFLOP/s", flush=True)
    res = {"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "gemm_flops_s": rate, "rows": []}
    weights = {name: [torch.randn(*shapes[name], device="cuda", dtype=torch.bfloat16) * 0.02
                      for _ in range(max(2, -(-(256 << 20) // (shapes[name][0] * shapes[name][1]
                                                                * 2))))]
               for name in names}
    for m in a.ms:  # every projection at the first M before the next M (a cut run keeps them)
        for name in names:
            row = shape_row(name, *shapes[name], m, weights[name], bw, rate,
                            t0 if a.cublas_only else deadline)
            res["rows"].append(row)
            print_row(row)
    res["seconds"] = time.perf_counter() - t0
    path = write_json(a.out, "mid_m_gemm.json", res)
    print("\n| projection | M | floor us | cuBLAS us | cuBLAS bw / rate | best gemm | its us | "
          "bw / rate | / cuBLAS |\n|---|---|---|---|---|---|---|---|---|")
    for row in res["rows"]:
        cb, b = row["variants"]["cublas"], best_gemm(row)
        if "us" not in cb or b is None:
            continue
        print(f"| {row['name']} | {row['m']} | {row['floor_us']:.1f} | {cb['us']:.1f} | "
              f"{cb['bw']:.2f} / {cb['rate']:.2f} | {b[0]} | {b[1]['us']:.1f} | "
              f"{b[1]['bw']:.2f} / {b[1]['rate']:.2f} | {b[1]['us'] / cb['us']:.2f} |")
    routes = winners(res["rows"], res["gpu"])
    print("[mid-m] routes under 0.97x plain cuBLAS (KernelConfig.gemm_routes form):")
    for entry in routes:
        print(f"    {entry!r},")
    print(f"[mid-m] wrote {path} ({res['seconds']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
