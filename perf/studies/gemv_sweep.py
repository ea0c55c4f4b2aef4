"""Tile sweep of the small-M GEMV kernels at the 8B head's draft-step shapes (GPU only).

`python3 -m perf.studies.gemv_sweep --out DIR [--max-seconds 150] [--shapes target] [--ms 16,32]`

For each matmul of a draft step (qkv, o, gate_up, down with the silu_mul input,
lm_head with the argmax epilogue, fc; `--shapes target`: one layer of the 8B target,
`TARGET_LAYER_MATMULS`) and M in {1, 4, 16} (`--ms`): the time of cuBLAS
(`F.linear`, plus the separate silu*mul / argmax ops where the fused kernel saves
them) and of the Triton kernels for every tile config, each timed as a CUDA graph
of `copies` back-to-back calls whose weights rotate among copies larger than L2
(so every call reads its weights from HBM and host launch time is out of the
picture). Writes `gemv_sweep.json` (every config) and prints the best per shape
next to the default config (`gemv_config`) and the copy-bandwidth floor.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F

from graphdraft.kernels.argmax import argmax_with_map
from graphdraft.kernels.gemv import (
    MAX_M,
    GemvConfig,
    gemv_config,
    linear_small_m,
    linear_small_m_argmax,
    linear_small_m_ref,
)
from perf.cases import int_list
from perf.models_8b import DRAFT_STEP_MATMULS, TARGET_LAYER_MATMULS
from perf.timing import copy_bandwidth, graph_time_us, write_json

SHAPES = {"draft": DRAFT_STEP_MATMULS, "target": TARGET_LAYER_MATMULS}
MS = (1, 4, 16)


def configs(m: int, n: int, k: int, epilogue: str | None) -> list[GemvConfig]:
    out = []
    for (bn, bk), warps, stages, progs in itertools.product(
            ((32, 256), (64, 128), (64, 256), (128, 128), (128, 64)), (4, 8), (2, 3, 4),
            (132, 264, 528)):
        max_split = 1 if epilogue == "argmax" else 16
        c = gemv_config(m, n, k, block_n=bn, block_k=bk, target_programs=progs,
                        max_split=max_split, num_warps=warps, num_stages=stages)
        if c not in out:
            out.append(c)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="perf/out")
    p.add_argument("--max-seconds", type=float, default=150.0)
    p.add_argument("--shapes", choices=sorted(SHAPES), default="draft",
                   help="the draft head's step matmuls or one layer of the target's")
    p.add_argument("--ms", type=lambda raw: int_list(raw, MAX_M), default=MS,
                   help=f"rows per product, comma-separated (1..{MAX_M})")
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    bw = copy_bandwidth("cuda")
    print(f"[sweep] {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results: dict = {"copy_bw": bw, "gpu": torch.cuda.get_device_name(), "shape_set": a.shapes,
                     "shapes": {}}
    dt = torch.bfloat16
    for name, (n, k, act, epi) in SHAPES[a.shapes].items():
        copies = max(2, -(-(256 << 20) // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(copies)]
        floor = n * k * 2 / bw * 1e6
        for m in a.ms:
            kx = 2 * k if act else k
            x = torch.randn(m, kx, device="cuda", dtype=dt)
            ref = linear_small_m_ref(x, ws[0], act=act)
            if act == "silu_mul":
                def cublas(i, x=x, k=k, ws=ws, copies=copies):
                    return F.linear(F.silu(x[:, :k]) * x[:, k:], ws[i % copies])
            elif epi == "argmax":
                def cublas(i, x=x, ws=ws, copies=copies):
                    return argmax_with_map(F.linear(x, ws[i % copies]))
            else:
                def cublas(i, x=x, ws=ws, copies=copies):
                    return F.linear(x, ws[i % copies])
            rec = {"n": n, "k": k, "m": m, "act": act, "epilogue": epi, "floor_us": floor,
                   "cublas_us": graph_time_us(cublas, copies), "configs": []}
            default = gemv_config(m, n, k, max_split=1 if epi == "argmax" else 16)
            for cfg in [default] + configs(m, n, k, epi):
                if time.perf_counter() - t_start > a.max_seconds:
                    rec["truncated"] = True
                    break
                if epi == "argmax":
                    def ours(i, x=x, cfg=cfg, ws=ws, copies=copies):
                        return linear_small_m_argmax(x, ws[i % copies], config=cfg)
                    got = ours(0)[0]
                else:
                    def ours(i, x=x, cfg=cfg, ws=ws, copies=copies, act=act):
                        return linear_small_m(x, ws[i % copies], act=act, config=cfg)
                    got = ours(0)
                err = float((got.float() - ref.float()).norm() / ref.float().norm())
                try:
                    us = graph_time_us(ours, copies)
                except Exception as e:  # noqa: BLE001 - a config that fails is a result
                    rec["configs"].append({"config": cfg.__dict__, "error": str(e)[:200]})
                    continue
                rec["configs"].append({"config": cfg.__dict__, "us": us, "rel_err": err,
                                       "default": cfg == default})
            timed = [c for c in rec["configs"] if "us" in c]
            best = min(timed, key=lambda c: c["us"]) if timed else None
            dflt = next((c for c in timed if c.get("default")), None)
            rec["best"], rec["default"] = best, dflt
            results["shapes"][f"{name}-m{m}"] = rec
            print(f"[sweep] {name:8s} m={m:2d} floor {floor:6.1f} us | cuBLAS {rec['cublas_us']:6.1f} "
                  f"({floor / rec['cublas_us']:4.0%}) | default "
                  f"{dflt['us'] if dflt else float('nan'):6.1f} | best "
                  f"{best['us'] if best else float('nan'):6.1f} "
                  f"({floor / best['us'] if best else 0:4.0%}) {best['config'] if best else ''}",
                  flush=True)
        ws = []
        torch.cuda.empty_cache()
    write_json(a.out, "gemv_sweep.json", results)
    print(f"[sweep] done in {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
