"""The verify forward's matmuls at M = 64..1024 rows: cuBLAS's choices against candidates
(GPU only; issue #23's "matmuls at M = 256..1024 reach the GEMM rate, fix what does not").

`python3 -m perf.studies.verify_gemm --out DIR [--max-seconds 180]`

In 2026-12-04d (`make perf-verify`) the 8B target's projections at M = 256 (bs 64 x 4 verify
tokens) ran at 0.60 (o_proj) to 0.81 (gate_up) of a large GEMM's bf16 rate, 1.23-1.67x their
floor; at M >= 512 at 0.88-1.0. For each projection (qkv, o, gate_up, down, lm_head) and M in
`MS` this times, each as a CUDA graph of back-to-back calls over weight copies larger than L2
(`perf.timing.graph_time_us`: no launch cost, no L2 hits):

- `cublas`: `F.linear(x, w)` (what `ops.linear` runs above the GEMV's rows);
- `cublas_t`: the transposed problem, `(w @ x.T).T` made contiguous (cuBLAS picks other
  tiles for N x M than for M x N);
- `cublaslt`: `F.linear` under `torch.backends.cuda.preferred_blas_library("cublaslt")`;
- `triton`: `gemm` below (tiles per config, grouped program order, M a runtime argument)
  over `configs(m)`;
- for gate_up also the MLP's activation: cuBLAS then `gemv.silu_mul` (what runs today above
  32 rows: the `[M, 2I]` product written and read back) against `gemm_swiglu`, the
  activation as the GEMM's epilogue, over `configs(m, swiglu=True)`.

Writes `verify_gemm.json` (every timing, each config's relative error against cuBLAS) and
prints per shape the floor (max(FLOPs / GEMM rate, weight bytes / copy bandwidth)), each
variant's time and the best Triton config. A Triton config that beats cuBLAS at a row bucket
by more than the noise moves into `graphdraft/kernels` (`ops.linear` choosing it per M
bucket: one compiled variant per bucket, issue #19's count) in a later change.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from graphdraft.kernels.pdl import interpreting

MS = (256, 128, 64, 512, 1024)
"""Rows timed, the widest gap (2026-12-04d) first: a truncated run has it."""


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile: its rows and columns, and the same clamped into the
    matrix (int64, for in-bounds reads). Programs run GROUP_M row tiles per column tile
    (a weight tile is read by neighbouring programs while in L2)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, tl.minimum(rm, M - 1).to(tl.int64), tl.minimum(rn, N - 1).to(tl.int64)


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """out `[M, N]` = x `[M, K]` @ w `[N, K]`^T, fp32 accumulation, one tile a program
    (`_tile`). Rows / columns past M / N are read clamped (in bounds) and not stored."""
    rm, rn, rm_in, rn_in = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm_in[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn_in[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=rk[None, :] < left, other=0.0)
            b = tl.load(w_ptrs, mask=rk[:, None] < left, other=0.0)
        if IEEE:  # fp32 inputs, or the interpreter (whose bf16 dot is wrong)
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _gemm_splitk_kernel(x_ptr, w_ptr, out_ptr, M, N, K_SPLIT, stride_xm, stride_wn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, IEEE: tl.constexpr):
    """Split s (`program_id(1)`) of out `[split, M, N]` fp32 = x `[M, K]`[:, s * K_SPLIT:]
    @ w `[N, K]`[:, s * K_SPLIT:]^T over K_SPLIT columns (a multiple of BLOCK_K)."""
    rm, rn, rm_in, rn_in = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    s = tl.program_id(1)
    rk = tl.arange(0, BLOCK_K)
    k0 = s.to(tl.int64) * K_SPLIT
    x_ptrs = x_ptr + rm_in[:, None] * stride_xm + k0 + rk[None, :]
    w_ptrs = w_ptr + rn_in[None, :] * stride_wn + k0 + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K_SPLIT // BLOCK_K):
        a = tl.load(x_ptrs)
        b = tl.load(w_ptrs)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + (s.to(tl.int64) * M + rm[:, None].to(tl.int64)) * N + rn[None, :]
    tl.store(out_ptrs, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm_splitk(x: torch.Tensor, w: torch.Tensor, split: int,
                config: GemmConfig = GemmConfig()) -> torch.Tensor:
    """fp32 partials `[split, M, N]` of x `[M, K]` @ w `[N, K]`^T, K cut in `split` equal
    parts (each a multiple of the tile's BLOCK_K)."""
    m, k = x.shape
    n = w.shape[0]
    c = config
    if k % (split * c.block_k):
        raise ValueError(f"split: K {k} is not a multiple of split {split} x {c.block_k}")
    out = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n), split)
    _gemm_splitk_kernel[grid](x, w, out, m, n, k // split, x.stride(0), w.stride(0),
                              BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                              GROUP_M=c.group_m, IEEE=x.dtype == torch.float32 or interpreting(),
                              num_warps=c.num_warps, num_stages=c.num_stages)
    return out


def bmm_splitk(x: torch.Tensor, w: torch.Tensor, split: int) -> torch.Tensor:
    """fp32 partials `[split, M, N]` of x `[M, K]` @ w `[N, K]`^T by one strided-batched
    cuBLAS call (`torch.bmm(..., out_dtype=torch.float32)`): batch s is the K columns
    `[s * K / split, (s + 1) * K / split)` of both, as views (no copy)."""
    m, k = x.shape
    n = w.shape[0]
    ks = k // split
    xs = x.view(m, split, ks).transpose(0, 1)  # [split, M, ks], row stride K
    ws = w.view(n, split, ks).permute(1, 2, 0)  # [split, ks, N], column-major
    return torch.bmm(xs, ws, out_dtype=torch.float32)


SPLITK_TILES = (GemmConfig(64, 128, 64, 8, 4, 4), GemmConfig(128, 128, 64, 8, 8, 3),
                GemmConfig(64, 64, 64, 8, 4, 4), GemmConfig(128, 128, 64, 8, 8, 4),
                GemmConfig(128, 64, 64, 8, 4, 4))


def splitk_study(m: int, name: str, x: torch.Tensor, ws: list[torch.Tensor], floor: float,
                 deadline: float) -> dict:
    """Split-K candidates for one projection at `m` rows: cuBLAS's strided-batched GEMM
    into fp32 partials (`bmm_splitk`) and the Triton split-K tile (`gemm_splitk`), each
    alone (the consumer sums the partials: `ops.SplitK`) and with a torch sum + cast after."""
    from perf.timing import graph_time_us

    copies = len(ws)
    k = x.shape[1]
    ref = F.linear(x, ws[0]).float()
    rec: dict = {}
    for split in (2, 3, 4, 7, 8):
        if k % (split * 64) or time.perf_counter() > deadline:
            continue
        for kind, fn in (("bmm", lambda i, s=split: bmm_splitk(x, ws[i % copies], s)),
                         ) + tuple(
                (f"triton{j}", lambda i, s=split, c=c: gemm_splitk(x, ws[i % copies], s, c))
                for j, c in enumerate(SPLITK_TILES)):
            key = f"{kind}_s{split}"
            try:
                got = fn(0).sum(0)
                err = float((got - ref).norm() / ref.norm())
                us = graph_time_us(fn, copies)
                us_sum = graph_time_us(lambda i, fn=fn: fn(i).sum(0).to(x.dtype), copies)
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                rec[key] = {"error": str(e).splitlines()[0][:200]}
                continue
            rec[key] = {"us": us, "us_with_sum": us_sum, "rel_err": err}
    timed = {kk: v for kk, v in rec.items() if "us" in v and v["rel_err"] < 1e-2}
    if timed:
        best = min(timed, key=lambda kk: timed[kk]["us"])
        print(f"[splitk] {name:8s} m={m:4d} floor {floor:7.1f} us | best partials {best} "
              f"{timed[best]['us']:7.1f} us (+sum {timed[best]['us_with_sum']:7.1f}) | "
              + " ".join(f"{kk} {v['us']:.1f}" for kk, v in timed.items() if kk.startswith("bmm")),
              flush=True)
    for kk, v in rec.items():
        if "error" in v:
            print(f"[splitk] {name} m={m} {kk}: {v['error']}", flush=True)
    return rec


def gemm(x: torch.Tensor, w: torch.Tensor, config: GemmConfig = GemmConfig(),
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x `[M, K]` @ w `[N, K]`^T -> `[M, N]` (x's dtype; fp32 in IEEE precision)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x, w: expected [M, K] and [N, K], got {list(x.shape)} and "
                         f"{list(w.shape)}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x, w: expected the last dimension contiguous")
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    c = config
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _gemm_kernel[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                       BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                       GROUP_M=c.group_m, EVEN_K=k % c.block_k == 0,
                       IEEE=x.dtype == torch.float32 or interpreting(), num_warps=c.num_warps,
                       num_stages=c.num_stages)
    return out


@triton.jit(do_not_specialize=["M"])
def _gemm_swiglu_kernel(x_ptr, w_ptr, out_ptr, M, N_HALF, K, stride_xm, stride_wn, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """out `[M, N_HALF]` = silu(x @ gate^T) * (x @ up^T), w `[2 * N_HALF, K]` = [gate; up]:
    the MLP's gate_up projection with its activation as the epilogue (no round trip of the
    `[M, 2 * N_HALF]` product through memory)."""
    rm, rn, rm_in, rn_in = _tile(M, N_HALF, BLOCK_M, BLOCK_N, GROUP_M)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm_in[:, None] * stride_xm + rk[None, :]
    g_ptrs = w_ptr + rn_in[None, :] * stride_wn + rk[:, None]
    u_ptrs = g_ptrs + N_HALF * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=rk[None, :] < left, other=0.0)
            g = tl.load(g_ptrs, mask=rk[:, None] < left, other=0.0)
            u = tl.load(u_ptrs, mask=rk[:, None] < left, other=0.0)
        if IEEE:
            a32 = a.to(tl.float32)
            acc_g = tl.dot(a32, g.to(tl.float32), acc_g, input_precision="ieee")
            acc_u = tl.dot(a32, u.to(tl.float32), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N_HALF))


def gemm_swiglu(x: torch.Tensor, w: torch.Tensor, config: GemmConfig = GemmConfig()
                ) -> torch.Tensor:
    """silu(x @ w[:I]^T) * (x @ w[I:]^T) -> `[M, I]` for x `[M, K]`, w `[2I, K]`."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or w.shape[0] % 2:
        raise ValueError(f"x, w: expected [M, K] and [2I, K], got {list(x.shape)} and "
                         f"{list(w.shape)}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x, w: expected the last dimension contiguous")
    m, k = x.shape
    i = w.shape[0] // 2
    out = torch.empty(m, i, device=x.device, dtype=x.dtype)
    c = config
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(i, c.block_n),)
    _gemm_swiglu_kernel[grid](x, w, out, m, i, k, x.stride(0), w.stride(0), out.stride(0),
                              BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                              GROUP_M=c.group_m, EVEN_K=k % c.block_k == 0,
                              IEEE=x.dtype == torch.float32 or interpreting(),
                              num_warps=c.num_warps, num_stages=c.num_stages)
    return out


def configs(m: int, swiglu: bool = False) -> list[GemmConfig]:
    """The tiles tried at `m` rows (row tiles no taller than needed; `swiglu`: two weight
    tiles a step, `gemm_swiglu`)."""
    out = []
    for bm, bn, bk, warps, stages, group in itertools.product(
            (64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4), (1, 8)):
        if bm > max(64, m) or bn * bk > 128 * 128 or (bm == 128 and bn == 256):
            continue
        if stages * (bm + bn) * bk * 2 > 220 << 10:  # the pipeline's buffers, in bf16
            continue
        if swiglu and (stages * (bm + 2 * bn) * bk * 2 > 220 << 10 or bn > 128):
            continue  # two weight tiles a step
        if warps == 8 and bm * bn < 128 * 128:
            continue
        out.append(GemmConfig(bm, bn, bk, group, warps, stages))
    return out


def sweep(run, ref: torch.Tensor, cfgs: list[GemmConfig], copies: int, deadline: float
          ) -> tuple[list[dict], dict | None, bool]:
    """Time `run(i, cfg)` (call i of a graph of `copies`) per config, each checked against
    `ref` first -> (every config's record, the fastest within 1e-2 relative error, whether
    the deadline cut the list)."""
    from perf.timing import graph_time_us

    out = []
    for cfg in cfgs:
        if time.perf_counter() > deadline:
            return out, _fastest(out), True
        try:
            got = run(0, cfg).float()
            err = float((got - ref).norm() / ref.norm())
            us = graph_time_us(lambda i, cfg=cfg: run(i, cfg), copies)
        except Exception as e:  # noqa: BLE001 - a config that fails is a result
            out.append({"config": dataclasses.asdict(cfg), "error": str(e)[:200]})
            continue
        out.append({"config": dataclasses.asdict(cfg), "us": us, "rel_err": err})
    return out, _fastest(out), False


def _fastest(records: list[dict]) -> dict | None:
    timed = [c for c in records if "us" in c and c["rel_err"] < 1e-2]
    return min(timed, key=lambda c: c["us"]) if timed else None


def main(argv: list[str] | None = None) -> int:
    from perf.models_8b import LLAMA31_8B
    from perf.timing import copy_bandwidth, graph_time_us, write_json
    from perf.verify import gemm_rate

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="perf/out")
    p.add_argument("--max-seconds", type=float, default=180.0)
    p.add_argument("--splitk-only", action="store_true",
                   help="only cuBLAS and the split-K candidates (qkv, o, gate_up, down at M "
                        "64..512), not the whole-tile sweep (measured in 2026-12-05 run N)")
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + a.max_seconds
    bw, rate = copy_bandwidth("cuda"), gemm_rate("cuda")
    print(f"[gemm] {torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, GEMM "
          f"{rate / 1e12:.0f} TFLOP/s", flush=True)
    mc = LLAMA31_8B
    h, d = mc.hidden_size, mc.head_dim
    shapes = {"qkv": ((mc.num_attention_heads + 2 * mc.num_key_value_heads) * d, h),
              "o": (h, mc.num_attention_heads * d), "gate_up": (2 * mc.intermediate_size, h),
              "down": (h, mc.intermediate_size), "lm_head": (mc.vocab_size, h)}
    res: dict = {"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "gemm_flops_s": rate,
                 "shapes": {}}
    dt = torch.bfloat16
    weights = {name: [torch.randn(n, k, device="cuda", dtype=dt) * 0.02
                      for _ in range(max(2, -(-(256 << 20) // (n * k * 2))))]
               for name, (n, k) in shapes.items()}
    if a.splitk_only:
        return _splitk_main(a, shapes, rate, bw, res, t_start, deadline)
    for m in MS:
        for name, (n, k) in shapes.items():
            ws = weights[name]
            copies = len(ws)
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ref = F.linear(x, ws[0]).float()
            flops = 2 * m * n * k
            floor = max(flops / rate, n * k * 2 / bw) * 1e6
            rec = {"n": n, "k": k, "m": m, "floor_us": floor}

            def lt(i, x=x, ws=ws, copies=copies):
                return F.linear(x, ws[i % copies])

            rec["cublas_us"] = graph_time_us(lt, copies)
            rec["cublas_t_us"] = graph_time_us(
                lambda i, x=x, ws=ws, copies=copies: (ws[i % copies] @ x.T).T.contiguous(),
                copies)
            prev = torch.backends.cuda.preferred_blas_library()
            try:
                torch.backends.cuda.preferred_blas_library("cublaslt")
                rec["cublaslt_us"] = graph_time_us(lt, copies)
            except Exception as e:  # noqa: BLE001 - not every build has it: a result
                rec["cublaslt_error"] = str(e)[:200]
            finally:
                torch.backends.cuda.preferred_blas_library(prev)
            rec["triton"], rec["best"], cut = sweep(
                lambda i, cfg, x=x, ws=ws, copies=copies: gemm(x, ws[i % copies], cfg),
                ref, configs(m), copies, deadline)
            rec["truncated"] = cut
            if name == "gate_up":  # the activation fused as the epilogue, against 2 launches
                from graphdraft.kernels.gemv import silu_mul

                ref_act = silu_mul(F.linear(x, ws[0])).float()
                rec["cublas_silu_mul_us"] = graph_time_us(
                    lambda i, x=x, ws=ws, copies=copies: silu_mul(F.linear(x, ws[i % copies])),
                    copies)
                rec["swiglu"], rec["best_swiglu"], cut = sweep(
                    lambda i, cfg, x=x, ws=ws, copies=copies: gemm_swiglu(x, ws[i % copies], cfg),
                    ref_act, configs(m, swiglu=True), copies, deadline)
                rec["truncated"] |= cut
            res["shapes"][f"{name}-m{m}"] = rec
            best = rec["best"]
            print(f"[gemm] {name:8s} m={m:4d} floor {floor:7.1f} us | cuBLAS "
                  f"{rec['cublas_us']:7.1f} ({floor / rec['cublas_us']:4.0%}) | transposed "
                  f"{rec['cublas_t_us']:7.1f} | cublasLt {rec.get('cublaslt_us', float('nan')):7.1f}"
                  f" | triton best {best['us'] if best else float('nan'):7.1f} "
                  f"({floor / best['us'] if best else 0:4.0%}) "
                  f"{best['config'] if best else ''}", flush=True)
            if rec.get("best_swiglu"):
                print(f"[gemm] gate_up+silu_mul m={m:4d}: cuBLAS + silu_mul "
                      f"{rec['cublas_silu_mul_us']:7.1f} us | fused best "
                      f"{rec['best_swiglu']['us']:7.1f} {rec['best_swiglu']['config']}", flush=True)
    write_json(a.out, "verify_gemm.json", res)
    print(f"[gemm] done in {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


def _splitk_main(a, shapes: dict, rate: float, bw: float, res: dict, t_start: float,
                 deadline: float) -> int:
    from perf.timing import graph_time_us, write_json

    dt = torch.bfloat16
    for name in ("o", "down", "qkv", "gate_up"):
        n, k = shapes[name]
        ws = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02
              for _ in range(max(2, -(-(256 << 20) // (n * k * 2))))]
        for m in (256, 128, 64, 384, 512):
            if time.perf_counter() > deadline:
                break
            x = torch.randn(m, k, device="cuda", dtype=dt)
            floor = max(2 * m * n * k / rate, n * k * 2 / bw) * 1e6
            rec = {"n": n, "k": k, "m": m, "floor_us": floor,
                   "cublas_us": graph_time_us(lambda i, x=x, ws=ws: F.linear(x, ws[i % len(ws)]),
                                              len(ws))}
            print(f"[splitk] {name:8s} m={m:4d} floor {floor:7.1f} us | cuBLAS "
                  f"{rec['cublas_us']:7.1f} us", flush=True)
            rec["splitk"] = splitk_study(m, name, x, ws, floor, deadline)
            res["shapes"][f"{name}-m{m}"] = rec
        del ws
        torch.cuda.empty_cache()
    write_json(a.out, "verify_gemm_splitk.json", res)
    print(f"[splitk] done in {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
