"""Verify forward vs decode step vs their floors at the 8B shape, and an 8k-token prefill (issue #23).

    python3 -m perf.verify --out DIR [--no-old] [--rows-only] [--bs 1,8] [--kv 512]
                           [--no-matmuls] [--kernels-from-env]
        (one H200; about 1-4 minutes; writes DIR/verify.json; an 80 GB card skips what
        does not fit its memory: `kv_budget_bytes`)
    python3 -m perf.verify --bounds perf/runs/<date>-h200-verify.json
        (no GPU: that run's rows against issue #23's goal and the sequential floor,
        `goal_bounds`; a measuring run prints the same table at its end)

The Llama-3.1-8B-shaped target (random bf16 weights, `perf.models_8b.build_target`) is built
once. For bs in 1, 8, 64, 128, 256 and kv in 512, 4096 (cases whose KV does not fit next to
the weights are skipped with a printed reason) it captures, as `Engine._target_decode` runs
them, the target forward over bs rows of N = 4 tokens (verify: `uniform_row_metadata`, the
extend kernel; aux hidden states captured as for EAGLE-3; logits of every token) and of
N = 1 (decode step: the decode kernel), and times their replays (CUDA events, median after
warm-up). `verify_old_ms`: the same verify forward with the per-token metadata the engine
used before (one decode-kernel row per token), for comparison.

Floors: `hbm_floor_ms` = (weight bytes but the embedding table, which is only gathered, +
every row's KV read once) / the copy bandwidth
measured in this run; `compute_floor_ms` = the forward's FLOPs (2 x matmul parameters x
tokens + attention 4 x Hq x D x sum of positions seen, every layer) / the bf16 rate of an
8192^3 cuBLAS GEMM timed in this run. `matmuls`: the verify forward's projections at
M = 128 (the bs 128 decode step), 256, 512, 1024 (`ops.linear`, as the model calls them) as a fraction of that rate, GPU time
per call from a CUDA graph of back-to-back calls over rotating weight copies (an event pair
around one call measures the host's launch cost at these sizes: the 2026-12-04c figures of
0.30-0.38 at M = 256 were that). Per row, `matmul_ms` / `attention_ms` / `other_ms`: the
verify forward's kernel time by category (torch profiler, one eager call), against
`matmul_floor_ms` (max(matmul FLOPs / GEMM rate, weight bytes / bandwidth)) and
`attention_floor_ms` (KV read once); `sum_floor_ms` is their sum (the kernels of one layer
run one after another: the attention cannot hide under the matmuls). `replay_kernels` /
`replay_kernel_ms` / `replay_span_ms`: one replay of the captured verify under the profiler,
its kernels' summed time against first start to last end (the rest: gaps between kernels).

The decode step (N = 1) gets the same accounting (`decode_row`): `decode_hbm_floor_ms`
(weights + every row's KV of kv + 1 positions), `decode_compute_floor_ms` (its FLOPs: a
quarter of the verify's matmul FLOPs), `decode_over_floor` (decode_ms over the larger: issue
#42 item 2 asks <= 1.25 at bs 128 and 256, kv 512), and `decode_matmul_ms` /
`decode_attention_ms` / `decode_other_ms` against `decode_matmul_floor_ms` /
`decode_attention_floor_ms` (`decode_sum_floor_ms`). The bounds tables (`--bounds`, and the
end of a measuring run) print both goals: the verify's against issue #23's 1.3 x max(floors)
and issue #42's 1.3 x sum of floors, the decode step's against issue #42's 1.25 x max(floors).

Prefill: the extend kernel alone (`kernels.extend_attention.paged_extend_attention`) over one
8192-token prompt in a paged cache (page 16, shuffled pages), one layer's attention (32 q
heads, 8 kv heads, D 128, causal), against `scaled_dot_product_attention` with the flash
backend on the same shapes with contiguous K/V (GQA through `enable_gqa`, or K/V expanded to
32 heads where that backend refuses it: `sdpa_form` says which), and the per-token decode
kernel on the same paged cache (`old_prefill_ms`, today's path). `prefill_tiles`: the same
prefill under a few other 128-row tile configs; `attention_alone`: one layer's verify attention
(N = 4) at kv 4096 through the extend kernel (a few tile configs), the per-token decode kernel
it replaces, and the decode kernel at N = 1, against that layer's KV read once.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import time
from pathlib import Path

import torch

from graphdraft import ops
from graphdraft.kernels import extend_attention
from graphdraft.kernels.config import TRITON, KernelConfig
from graphdraft.kernels.config import default as default_config
from graphdraft.kernels.decode_attention import paged_decode_attention
from graphdraft.kernels.extend_attention import paged_extend_attention
from graphdraft.models.attention import PagedAttentionBackend
from graphdraft.runtime.kv_cache import KVPool, kv_slot
from perf.cases import int_list
from perf.models_8b import LLAMA31_8B, build_target, kv_bytes_per_token, weight_bytes
from perf.timing import copy_bandwidth, graph_time_us, median_us, write_json

BATCH_SIZES = (1, 8, 64, 128, 256)
KV_LENS = (512, 4096)
N_VERIFY = 4
PAGE_SIZE = 16
NOT_KV_BYTES = 35 << 30  # the 16 GB of weights, activations and the allocator's slack
PREFILL_TOKENS = 8192


def gemm_routes_of(path: str) -> tuple:
    """The `KernelConfig.gemm_routes` a `mid_m_gemm.json` measured
    (`perf.studies.mid_m_gemm.winners`); printed."""
    from perf.studies.mid_m_gemm import winners

    data = json.loads(Path(path).read_text())
    routes = winners(data["rows"], data["gpu"])
    print(f"gemm routes from {path}: " + (", ".join(f"{k}: {v!r}" for k, v in routes) or "none"))
    return routes


def kv_budget_bytes(device: str) -> int:
    """Bytes of KV pages the benchmark may allocate: the card's memory less `NOT_KV_BYTES`
    (104 GiB on an H200, 43 GiB on an 80 GB H100; rows that do not fit are skipped)."""
    return torch.cuda.get_device_properties(device).total_memory - NOT_KV_BYTES


def gemm_rate(device: str) -> float:
    """bf16 FLOP/s of a large cuBLAS GEMM (8192^3)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = median_us(lambda: a @ b, warmup=5, reps=20, device=device)
    return 2 * 8192 ** 3 / (t * 1e-6)


def matmul_params(mc) -> int:
    """Parameters the forward multiplies per token (projections and LM head)."""
    h, d = mc.hidden_size, mc.head_dim
    qkv = (mc.num_attention_heads + 2 * mc.num_key_value_heads) * d * h
    o = h * mc.num_attention_heads * d
    mlp = 3 * h * mc.intermediate_size
    return mc.num_hidden_layers * (qkv + o + mlp) + mc.vocab_size * h


def forward_flops(mc, bs: int, kv: int, n: int) -> float:
    seen = bs * sum(kv + j + 1 for j in range(n))  # positions each token attends to
    attn = 4 * mc.num_attention_heads * mc.head_dim * seen * mc.num_hidden_layers
    return 2 * matmul_params(mc) * bs * n + attn


class Batch:
    """bs requests (slots 1..bs) of kv committed positions plus n new tokens, shuffled pages."""

    def __init__(self, pool: KVPool, bs: int, kv: int, n: int, device: str, seed: int = 0):
        ps = PAGE_SIZE
        self.bs, self.kv, self.n = bs, kv, n
        per_req = math.ceil((kv + n) / ps)
        if bs * per_req + 1 > pool.num_pages:
            raise ValueError("pool too small")
        g = torch.Generator().manual_seed(seed)
        ids = torch.randperm(bs * per_req, generator=g) + 1
        table = torch.zeros(bs + 1, per_req, dtype=torch.int32)
        table[1:] = ids.view(bs, per_req).to(torch.int32)
        self.req_to_page = table.to(device)
        t = bs * n
        pos = (kv + torch.arange(n)).repeat(bs)
        slot = torch.arange(1, bs + 1).repeat_interleave(n)
        loc = kv_slot(table, slot, pos, ps)
        self.input_ids = torch.randint(0, LLAMA31_8B.vocab_size, (t,), generator=g).to(device)
        self.positions = pos.to(device)
        self.out_cache_loc = loc.to(device)
        self.req = torch.arange(1, bs + 1, device=device)
        self.seq_lens = torch.full((bs,), kv + n, dtype=torch.int32, device=device)
        # the per-token metadata the engine built before (today's verify path)
        j = torch.arange(t, device=device) % n
        self.tok_req = self.req.repeat_interleave(n)
        self.tok_kv = (self.seq_lens.repeat_interleave(n) - n + j + 1).to(torch.int32)
        self.max_ctx = kv + 64


def target_forward(target, pool: KVPool, batch: Batch, n: int, form: str):
    """The target forward over `batch` as `Engine._target_decode` runs it; form "rows" (the
    engine's metadata now) or "tokens" (per-token metadata, the decode kernel for every token)."""
    backend = PagedAttentionBackend(batch.req_to_page, PAGE_SIZE, batch.max_ctx,
                                     kernels=target.kernels)

    def fwd():
        if form == "rows":
            meta = backend.uniform_row_metadata(batch.req, batch.seq_lens, n)
        else:
            meta = backend.bind_metadata(batch.tok_req, batch.tok_kv)
        return target(batch.input_ids, batch.positions, batch.out_cache_loc, pool, backend, meta,
                      None, capture_aux=True)
    return fwd


def capture_graph(fwd) -> torch.cuda.CUDAGraph:
    """`fwd` run twice on a side stream (compiles, allocations), then captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fwd()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fwd()
    return graph


def capture_and_time(target, pool: KVPool, batch: Batch, n: int, form: str, device: str,
                     gaps: dict | None = None) -> float:
    """Median replay time (ms) of the captured `target_forward`; with `gaps` (a dict) also
    `replay_gaps` of one replay written into it."""
    graph = capture_graph(target_forward(target, pool, batch, n, form))
    ms = median_us(graph.replay, warmup=3, reps=15, device=device) / 1e3
    if gaps is not None:
        gaps.update(replay_gaps(graph.replay))
    del graph
    return ms


def profile_replay(replay) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the kernels of one `replay()` under the torch profiler (after
    one unprofiled call), in start order; memcpy / memset records left out."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    ks = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
          if e.device_type == torch.autograd.DeviceType.CUDA
          and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    return sorted(ks, key=lambda k: k[1])


def replay_gaps(replay) -> dict:
    """One replay under the torch profiler: `replay_kernels` (kernel records seen),
    `replay_kernel_ms` (their summed GPU time) and `replay_span_ms` (first start to last
    end); span - sum is the GPU time between the graph's kernels (launch gaps; negative where
    kernels overlap, PDL's early launches waiting). Empty when the profiler records no kernel
    inside the graph."""
    spans = [(a, b) for _, a, b in profile_replay(replay)]
    if not spans:
        return {}
    return {"replay_kernels": len(spans),
            "replay_kernel_ms": sum(b - a for a, b in spans) / 1e3,
            "replay_span_ms": (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3}


MATMUL_MS = (128, 256, 512, 1024)
"""Rows of the `matmuls` timings: the bs 128 decode step, the verify at bs 64, 128, 256."""


def time_matmuls(target, rate: float, bw: float, device: str) -> list[dict]:
    """The forward's projections at `MATMUL_MS` rows (`ops.linear`, as the model
    calls them): GPU time per call from a CUDA graph of back-to-back calls over rotating weight
    copies (more bytes than L2 holds), so neither launch overhead nor L2 hits count."""
    layer = target.layers[0]
    shapes = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
              "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj,
              "lm_head": target.lm_head}
    rows = []
    for name, w in shapes.items():
        copies = [w] + [w.clone() for _ in range(max(0, math.ceil(256e6 / w.nbytes) - 1))]
        for m in MATMUL_MS:
            x = torch.randn(m, w.shape[1], device=device, dtype=w.dtype)
            us = graph_time_us(lambda i, x=x, c=copies: ops.linear(x, c[i % len(c)],
                                                                   kernels=target.kernels),
                               calls=2 * len(copies))
            flops = 2 * m * w.shape[0] * w.shape[1]
            rows.append({"m": m, "name": name, "n": w.shape[0], "k": w.shape[1], "us": us,
                         "tflops": flops / us / 1e6, "of_gemm_rate": flops / (us * 1e-6) / rate,
                         "floor_us": max(flops / rate, w.nbytes / bw) * 1e6})
        del copies
    return rows


MATMUL_KERNELS = ("nvjet", "gemm", "gemv", "cutlass", "splitkreduce", "sm90_xmma", "_linear")
ATTENTION_KERNELS = ("attention", "_extend_", "_decode_split", "_combine")


def kernel_breakdown(fwd) -> dict[str, float]:
    """GPU ms per category (matmul / attention / other) of one call of `fwd`, from the torch
    profiler's kernel records (an eager call: the same kernels the graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    fwd()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd()
        torch.cuda.synchronize()
    out = {"matmul_ms": 0.0, "attention_ms": 0.0, "other_ms": 0.0}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        us = getattr(e, "device_time_total", None)
        us = e.cuda_time_total if us is None else us
        cat = ("matmul" if any(k in name for k in MATMUL_KERNELS) else
               "attention" if any(k in name for k in ATTENTION_KERNELS) else "other")
        out[f"{cat}_ms"] += us / 1e3
    return out


def prefill(device: str) -> dict:
    """One 8192-token prompt through one layer's attention: the extend kernel (paged, page
    16), the per-token decode kernel (today), SDPA flash (contiguous)."""
    mc, L = LLAMA31_8B, PREFILL_TOKENS
    hq, hkv, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    per = L // PAGE_SIZE
    pages = torch.randperm(per, device=device) + 1
    r2p = torch.zeros(2, per, dtype=torch.int32, device=device)
    r2p[1] = pages.to(torch.int32)
    q = torch.randn(L, hq, d, device=device, dtype=torch.bfloat16, generator=g)
    k = torch.randn(L, hkv, d, device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(L, hkv, d, device=device, dtype=torch.bfloat16, generator=g)
    kc = torch.zeros((per + 1) * PAGE_SIZE, hkv, d, device=device, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    pos = torch.arange(L, device=device)
    slots = r2p[1, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE
    kc[slots], vc[slots] = k, v
    scale = d ** -0.5
    req = torch.ones(1, dtype=torch.int64, device=device)
    seq = torch.full((1,), L, dtype=torch.int32, device=device)
    ext = seq.clone()
    qs = torch.zeros(1, dtype=torch.int64, device=device)
    out = torch.empty_like(q)
    ours = lambda: paged_extend_attention(q, kc, vc, req, seq, ext, qs, r2p, PAGE_SIZE, scale,
                                          max_kv_len=L, max_extend=L, out=out)
    prefill_ms = median_us(ours, warmup=3, reps=10, device=device) / 1e3
    tok_req = req.repeat(L)
    tok_kv = (pos + 1).to(torch.int32)
    old = lambda: paged_decode_attention(q, kc, vc, tok_req, tok_kv, r2p, PAGE_SIZE, scale,
                                         max_kv_len=L, out=out)
    old_ms = median_us(old, warmup=2, reps=5, device=device) / 1e3
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))  # [1, H, L, D]
    form = "enable_gqa"
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            sdpa = lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                          enable_gqa=True)
            sdpa()
        except (RuntimeError, TypeError):
            form = "expanded_kv"
            ke, ve = (x.repeat_interleave(hq // hkv, dim=1) for x in (kh, vh))
            sdpa = lambda: F.scaled_dot_product_attention(qh, ke, ve, is_causal=True, scale=scale)
        sdpa_ms = median_us(sdpa, warmup=3, reps=10, device=device) / 1e3
        ref = sdpa()
    torch.cuda.synchronize()
    ours()
    err = (out.float() - ref[0].transpose(0, 1).float()).abs().max().item()
    flops = 4 * hq * d * L * (L + 1) / 2
    return {"prefill_tokens": L, "prefill_ms": prefill_ms, "sdpa_prefill_ms": sdpa_ms,
            "old_prefill_ms": old_ms, "sdpa_form": form,
            "prefill_tflops": flops / prefill_ms / 1e9, "sdpa_tflops": flops / sdpa_ms / 1e9,
            "max_abs_diff_vs_sdpa": err, "measured": "kernel alone, one layer"}


PREFILL_TILES = ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 4, 2),
                 (64, 64, 4, 3), (128, 32, 4, 4))
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) tried for the 8k prefill (`prefill_tiles`)."""
VERIFY_TILES = ((64, 4, 3), (32, 4, 3), (128, 4, 3), (64, 4, 2), (32, 4, 2), (128, 4, 2),
                (64, 8, 4))
"""(BLOCK_N, num_warps, num_stages) tried for the N = 4 verify tile (`attention_alone`)."""
VERIFY_SPLITS = (1, 2, 4, 8, 16, 32, 64)
"""KV splits tried for the N = 4 verify attention at the default tile (`attention_alone`;
the default is `extend_attention.extend_num_splits`'s choice, in `extend_splits_default`)."""


def _tiled(case: int, tile: tuple[int, int, int], stages: int) -> KernelConfig:
    """The default config (environment read once) with the extend attention's BLOCK_M `case`
    tile replaced by `tile` and `stages` pipeline stages."""
    kc = default_config()
    tiles = list(kc.extend_tiles)
    tiles[extend_attention.TILE_CASES.index(case)] = tile
    field = "extend_prefill_stages" if case == 128 else "extend_num_stages"
    return kc.replace(extend_tiles=tuple(tiles), **{field: stages})


def prefill_tiles(device: str) -> list[dict]:
    """The 8k prefill (kernel alone, as `prefill`) under other 128-row tile configs."""
    mc, L = LLAMA31_8B, PREFILL_TOKENS
    hq, hkv, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    per = L // PAGE_SIZE
    r2p = torch.zeros(2, per, dtype=torch.int32, device=device)
    r2p[1] = (torch.randperm(per, device=device) + 1).to(torch.int32)
    q = torch.randn(L, hq, d, device=device, dtype=torch.bfloat16)
    kc = torch.randn((per + 1) * PAGE_SIZE, hkv, d, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    req = torch.ones(1, dtype=torch.int64, device=device)
    seq = torch.full((1,), L, dtype=torch.int32, device=device)
    qs = torch.zeros(1, dtype=torch.int64, device=device)
    out = torch.empty_like(q)
    rows = []
    for bm, bn, w, st in PREFILL_TILES:
        try:
            call = functools.partial(paged_extend_attention, q, kc, vc, req, seq, seq, qs, r2p,
                                     PAGE_SIZE, d ** -0.5, max_kv_len=L, max_extend=L, out=out,
                                     kernels=_tiled(128, (bm, bn, w), st))
            ms = median_us(call, warmup=2, reps=5, device=device) / 1e3
        except Exception as e:  # a config the compiler refuses (shared memory): say so
            rows.append({"tile": [bm, bn, w, st], "error": str(e).splitlines()[0][:200]})
            continue
        rows.append({"tile": [bm, bn, w, st], "ms": ms})
    return rows


def attention_alone(bw: float, device: str) -> list[dict]:
    """One layer's verify attention (N = 4, extend kernel; the per-token decode kernel it
    replaces) and decode attention (N = 1) at kv 512 and 4096, against one layer's KV read
    once. GPU time per call: a CUDA graph of back-to-back calls over rotating copies of the
    KV (page tables onto distinct pages, more bytes than L2 holds)."""
    rows = []
    for kv in (512, 4096):
        for bs in (1, 8, 64, 256):
            rows.append(_attention_alone_row(bs, kv, bw, device))
            torch.cuda.empty_cache()
    return rows


def _attention_alone_row(bs: int, kv: int, bw: float, device: str) -> dict:
    mc, n = LLAMA31_8B, N_VERIFY
    hq, hkv, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    per = math.ceil((kv + n) / PAGE_SIZE)
    kv_bytes = bs * (kv + n) * hkv * d * 2 * 2
    copies = max(2, min(16, math.ceil(256e6 / kv_bytes)))
    pages = torch.randperm(copies * bs * per, device=device) + 1
    r2p = []
    for c in range(copies):
        t = torch.zeros(bs + 1, per, dtype=torch.int32, device=device)
        t[1:] = pages[c * bs * per:(c + 1) * bs * per].view(bs, per).to(torch.int32)
        r2p.append(t)
    kc = torch.randn((copies * bs * per + 1) * PAGE_SIZE, hkv, d, device=device,
                     dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(bs * n, hq, d, device=device, dtype=torch.bfloat16)
    req = torch.arange(1, bs + 1, device=device)
    seq = torch.full((bs,), kv + n, dtype=torch.int32, device=device)
    tok_req = req.repeat_interleave(n)
    tok_kv = (seq.repeat_interleave(n) - n + torch.arange(bs * n, device=device) % n + 1
              ).to(torch.int32)
    scale, ctx = d ** -0.5, kv + 64
    ext = lambda tiled, i, splits=None: paged_extend_attention(
        q, kc, vc, req, seq, None, None, r2p[i % copies], PAGE_SIZE, scale, max_kv_len=ctx,
        uniform_n=n, kernels=tiled, num_splits=splits)
    old = lambda i: paged_decode_attention(q, kc, vc, tok_req, tok_kv, r2p[i % copies],
                                           PAGE_SIZE, scale, max_kv_len=ctx)
    dec = lambda i: paged_decode_attention(q[:bs], kc, vc, req, seq, r2p[i % copies], PAGE_SIZE,
                                           scale, max_kv_len=ctx)
    calls = 2 * copies
    row = {"bs": bs, "kv": kv, "kv_floor_us": kv_bytes / bw * 1e6,
           "decode_kernel_n1_us": graph_time_us(dec, calls),
           "old_per_token_n4_us": graph_time_us(old, calls),
           "extend_n4_us[default]": graph_time_us(functools.partial(ext, default_config()), calls)}
    bn = default_config().extend_tiles[0][1]
    row["extend_splits_default"] = extend_attention.extend_num_splits(
        bs * hkv, ctx, bn, torch.device(device))
    for splits in VERIFY_SPLITS:
        if splits <= math.ceil(ctx / bn):
            row[f"extend_n4_us[splits{splits}]"] = graph_time_us(
                functools.partial(ext, default_config(), splits=splits), calls)
    for bn, w, st in VERIFY_TILES:
        try:
            row[f"extend_n4_us[bn{bn},w{w},s{st}]"] = graph_time_us(
                functools.partial(ext, _tiled(16, (16, bn, w), st)), calls)
        except Exception as e:  # a config the compiler refuses: say so, go on
            row[f"extend_n4_us[bn{bn},w{w},s{st}]"] = str(e).splitlines()[0][:200]
    return row


GOAL = 1.3
"""Issue #23's goal: verify_ms <= GOAL x max(hbm_floor_ms, compute_floor_ms) in every row."""
SUM_GOAL = 1.3
"""Issue #42 item 3: verify_ms <= SUM_GOAL x sum_floor_ms in every row."""
DECODE_GOAL = 1.25
"""Issue #42 item 2: decode_ms <= DECODE_GOAL x max(decode_hbm_floor_ms,
decode_compute_floor_ms) at `DECODE_GOAL_ROWS`."""
DECODE_GOAL_ROWS = ((128, 512), (256, 512))
"""(bs, kv) rows the decode goal names."""


def decode_row(target, pool: KVPool, batch: Batch, decode_ms: float, wbytes: int, bw: float,
               rate: float) -> dict:
    """The decode step's (N = 1) floors and kernel categories, as the verify row has them:
    `decode_hbm_floor_ms` (weights + every row's KV of kv + 1 positions, read once),
    `decode_compute_floor_ms` (`forward_flops` at N = 1 over the GEMM rate),
    `decode_over_floor` (`decode_ms`, the captured step's replay time, over the larger),
    `decode_matmul_ms` / `decode_attention_ms` / `decode_other_ms` (`kernel_breakdown` of one
    eager call) against `decode_matmul_floor_ms` / `decode_attention_floor_ms`, their sum
    `decode_sum_floor_ms`."""
    mc = LLAMA31_8B
    bs, kv = batch.bs, batch.kv
    kv_read = bs * (kv + 1) * kv_bytes_per_token(mc)
    parts = kernel_breakdown(target_forward(target, pool, batch, 1, "rows"))
    mm_floor = max(2 * matmul_params(mc) * bs / rate, wbytes / bw) * 1e3
    attn_floor = kv_read / bw * 1e3
    hbm = (wbytes + kv_read) / bw * 1e3
    compute = forward_flops(mc, bs, kv, 1) / rate * 1e3
    return {"decode_hbm_floor_ms": hbm, "decode_compute_floor_ms": compute,
            "decode_over_floor": decode_ms / max(hbm, compute),
            **{f"decode_{k}": v for k, v in parts.items()},
            "decode_matmul_floor_ms": mm_floor, "decode_attention_floor_ms": attn_floor,
            "decode_sum_floor_ms": mm_floor + attn_floor}


def decode_bounds(rows: list[dict]) -> list[dict]:
    """Per row with the decode keys (`decode_row`): `decode_floor_ms` (max of its two
    floors), `decode_over_floor`, each category over its own floor, `goal_row` (a row issue
    #42 item 2 names) and `met` (decode_ms <= DECODE_GOAL x decode_floor_ms)."""
    out = []
    for r in rows:
        if "decode_hbm_floor_ms" not in r:
            continue
        floor = max(r["decode_hbm_floor_ms"], r["decode_compute_floor_ms"])
        out.append({"bs": r["bs"], "kv": r["kv"], "decode_ms": r["decode_ms"],
                    "decode_floor_ms": floor, "decode_over_floor": r["decode_ms"] / floor,
                    "matmul_over_floor": r["decode_matmul_ms"] / r["decode_matmul_floor_ms"],
                    "attention_over_floor": r["decode_attention_ms"]
                    / r["decode_attention_floor_ms"],
                    "other_ms": r["decode_other_ms"],
                    "goal_row": (r["bs"], r["kv"]) in DECODE_GOAL_ROWS,
                    "met": r["decode_ms"] <= DECODE_GOAL * floor})
    return out


def decode_bounds_lines(rows: list[dict]) -> list[str]:
    """`decode_bounds` as a markdown table (empty when no row has the decode keys)."""
    bounds = decode_bounds(rows)
    if not bounds:
        return []
    lines = ["| bs | kv | decode ms | max(floors) ms | decode / floor | matmul / its floor "
             f"| attention / its floor | other ms | <= {DECODE_GOAL} x floor (#42 item 2) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b in bounds:
        met = ("yes" if b["met"] else "no") + ("" if b["goal_row"] else " (not a goal row)")
        lines.append(f"| {b['bs']} | {b['kv']} | {b['decode_ms']:.2f} | "
                     f"{b['decode_floor_ms']:.2f} | {b['decode_over_floor']:.3f} | "
                     f"{b['matmul_over_floor']:.2f} | {b['attention_over_floor']:.2f} | "
                     f"{b['other_ms']:.2f} | {met} |")
    return lines


def goal_bounds(rows: list[dict]) -> list[dict]:
    """Per verify row of a `verify.json` (rows with `bs`): `goal_ms` (GOAL x max(floors)), the
    sequential floor `sum_floor_ms` (matmul floor + attention floor: a layer's attention sits
    between its projections, so within one batch neither hides under the other),
    `goal_over_sum` (the share over that floor the goal leaves every kernel, norms and RoPE
    included: below 1, no schedule running a layer's kernels in sequence reaches it),
    `verify_over_sum` (measured),
    `matmul_over_floor` / `attention_over_floor` (each category's kernel time over its own
    floor), `sum_met` (issue #42 item 3: verify_ms <= SUM_GOAL x sum_floor_ms),
    `met` (verify_ms <= goal_ms)."""
    out = []
    for r in rows:
        if "bs" not in r:
            continue
        goal = GOAL * max(r["hbm_floor_ms"], r["compute_floor_ms"])
        total = r["sum_floor_ms"]
        out.append({"bs": r["bs"], "kv": r["kv"], "verify_ms": r["verify_ms"], "goal_ms": goal,
                    "sum_floor_ms": total, "goal_over_sum": goal / total,
                    "verify_over_sum": r["verify_over_sum_floor"],
                    "matmul_over_floor": r["matmul_ms"] / r["matmul_floor_ms"],
                    "attention_over_floor": r["attention_ms"] / r["attention_floor_ms"],
                    "sum_met": r["verify_ms"] <= SUM_GOAL * total,
                    "met": r["verify_ms"] <= goal})
    return out


def bounds_lines(rows: list[dict]) -> list[str]:
    """`goal_bounds` as a markdown table."""
    lines = ["| bs | kv | verify ms | goal ms | sum of floors ms | goal / sum | verify / sum "
             f"| matmul / its floor | attention / its floor | <= {SUM_GOAL} x sum (#42) | met |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in goal_bounds(rows):
        lines.append(f"| {b['bs']} | {b['kv']} | {b['verify_ms']:.2f} | {b['goal_ms']:.2f} | "
                     f"{b['sum_floor_ms']:.2f} | {b['goal_over_sum']:.2f} | "
                     f"{b['verify_over_sum']:.2f} | {b['matmul_over_floor']:.2f} | "
                     f"{b['attention_over_floor']:.2f} | {'yes' if b['sum_met'] else 'no'} | "
                     f"{'yes' if b['met'] else 'no'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for verify.json (required unless --bounds)")
    ap.add_argument("--bounds", metavar="VERIFY_JSON",
                    help="print the goal against the sequential floor (`goal_bounds`) for the "
                         "rows of an existing verify.json and exit (no GPU needed)")
    ap.add_argument("--no-old", action="store_true", help="skip the per-token verify baseline")
    ap.add_argument("--kernels-from-env", action="store_true",
                    help="the Triton path with the GRAPHDRAFT_* kernel settings of the environment "
                         "(KernelConfig.from_env; default: the shipped defaults, TRITON), for an "
                         "A/B of a setting run by run")
    ap.add_argument("--rows-only", action="store_true",
                    help="only the verify / decode rows and the matmuls (no prefill, prefill "
                         "tiles or attention-alone studies)")
    ap.add_argument("--bs", type=int_list, default=BATCH_SIZES,
                    help="batch sizes of the verify / decode rows (comma-separated; default "
                         + ",".join(map(str, BATCH_SIZES)) + ")")
    ap.add_argument("--kv", type=int_list, default=KV_LENS,
                    help="committed KV lengths of those rows (default "
                         + ",".join(map(str, KV_LENS)) + ")")
    ap.add_argument("--no-matmuls", action="store_true",
                    help="skip the per-projection matmul timings")
    ap.add_argument("--gemm-routes", metavar="MID_M_GEMM_JSON",
                    help="run the projections above the GEMV's rows with the routes of a "
                         "`perf.studies.mid_m_gemm` run (`winners`: Triton tiles or cuBLASLt "
                         "where they beat plain cuBLAS) as KernelConfig.gemm_routes instead of "
                         "the shipped ones, for an A/B of a sweep's winners")
    args = ap.parse_args(argv)
    if args.bounds:
        rows = json.loads(Path(args.bounds).read_text())["rows"]
        print("\n".join(bounds_lines(rows) + decode_bounds_lines(rows)))
        return 0
    if not args.out:
        ap.error("--out: expected a folder for verify.json (or --bounds FILE)")
    routes = gemm_routes_of(args.gemm_routes) if args.gemm_routes else None
    device = "cuda"
    t0 = time.time()
    torch.manual_seed(0)
    bw = copy_bandwidth(device)
    rate = gemm_rate(device)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 GEMM {rate / 1e12:.0f} TFLOP/s")
    pre, tiles, alone = {}, [], []
    if not args.rows_only:
        pre = prefill(device)
        print(f"prefill {PREFILL_TOKENS}: ours {pre['prefill_ms']:.3f} ms, sdpa flash "
              f"{pre['sdpa_prefill_ms']:.3f} ms ({pre['sdpa_form']}), per-token decode kernel "
              f"{pre['old_prefill_ms']:.3f} ms; max |diff| {pre['max_abs_diff_vs_sdpa']:.3g}")
        tiles = prefill_tiles(device)
        print("prefill tiles (BLOCK_M, BLOCK_N, warps, stages): " + ", ".join(
            f"{r['tile']} {r['ms']:.3f} ms" if "ms" in r else f"{r['tile']} failed"
            for r in tiles))
        alone = attention_alone(bw, device)
        for r in alone:
            print("attention alone:", {k: round(v, 1) if isinstance(v, float) else v
                                       for k, v in r.items()})
    gc.collect()
    torch.cuda.empty_cache()

    mc = LLAMA31_8B
    target = build_target(device)
    kernels = KernelConfig.from_env(backend="triton") if args.kernels_from_env else TRITON
    if routes is not None:
        kernels = kernels.replace(gemm_routes=routes)
    target.set_kernels(kernels)
    print(f"kernels: {kernels}")
    wbytes = weight_bytes(target)
    if target.lm_head is not target.embed_tokens:  # the embedding is gathered, not read whole
        wbytes -= target.embed_tokens.numel() * target.embed_tokens.element_size()
    matmuls = []
    if not args.no_matmuls:
        with torch.inference_mode():
            matmuls = time_matmuls(target, rate, bw, device)
    per_tok = kv_bytes_per_token(mc)
    cases = [(bs, kv) for kv in args.kv for bs in args.bs]
    budget = kv_budget_bytes(device)
    fit = [(bs, kv) for bs, kv in cases
           if bs * (kv + N_VERIFY + PAGE_SIZE) * per_tok <= budget]
    for bs, kv in cases:
        if (bs, kv) not in fit:
            print(f"skip bs {bs} kv {kv}: its KV needs "
                  f"{bs * (kv + N_VERIFY) * per_tok / 2**30:.0f} GiB, over the "
                  f"{budget / 2**30:.0f} GiB budget next to the weights")
    if not fit:
        raise SystemExit("perf.verify: no verify row fits this card's KV budget")
    max_pages = max(bs * math.ceil((kv + N_VERIFY) / PAGE_SIZE) for bs, kv in fit) + 1
    pool = KVPool(mc.num_hidden_layers, max_pages, PAGE_SIZE, mc.num_key_value_heads,
                  mc.head_dim, torch.bfloat16, device)
    for t in pool.k + pool.v:
        t.normal_()
    rows = []
    with torch.inference_mode():
        for bs, kv in fit:
            row = {"bs": bs, "kv": kv}
            vb = Batch(pool, bs, kv, N_VERIFY, device)
            gaps: dict = {}
            row["verify_ms"] = capture_and_time(target, pool, vb, N_VERIFY, "rows", device, gaps)
            if not args.no_old:
                row["verify_old_ms"] = capture_and_time(target, pool, vb, N_VERIFY, "tokens",
                                                        device)
            db = Batch(pool, bs, kv, 1, device)
            row["decode_ms"] = capture_and_time(target, pool, db, 1, "rows", device)
            kv_read = bs * (kv + N_VERIFY) * per_tok
            row["hbm_floor_ms"] = (wbytes + kv_read) / bw * 1e3
            row["compute_floor_ms"] = forward_flops(mc, bs, kv, N_VERIFY) / rate * 1e3
            row["verify_over_floor"] = row["verify_ms"] / max(row["hbm_floor_ms"],
                                                              row["compute_floor_ms"])
            # where the time goes: kernel categories against their own floors (matmuls:
            # max(FLOPs / GEMM rate, weight bytes / bandwidth); attention: KV read once)
            parts = kernel_breakdown(target_forward(target, pool, vb, N_VERIFY, "rows"))
            mm_floor = max(2 * matmul_params(mc) * bs * N_VERIFY / rate, wbytes / bw) * 1e3
            attn_floor = kv_read / bw * 1e3
            row.update(parts, matmul_floor_ms=mm_floor, attention_floor_ms=attn_floor,
                       sum_floor_ms=mm_floor + attn_floor,
                       verify_over_sum_floor=row["verify_ms"] / (mm_floor + attn_floor),
                       **gaps)
            row.update(decode_row(target, pool, db, row["decode_ms"], wbytes, bw, rate))
            rows.append(row)
            print(row, flush=True)
            del vb, db
            gc.collect()
            torch.cuda.empty_cache()
    if pre:
        rows.append({k: pre[k] for k in ("prefill_tokens", "prefill_ms", "sdpa_prefill_ms")})
    data = {"rows": rows, "prefill": pre, "prefill_tiles": tiles, "attention_alone": alone,
            "matmuls": matmuls, "copy_bandwidth_bytes_s": bw,
            "gemm_flops_s": rate, "n_verify": N_VERIFY, "page_size": PAGE_SIZE,
            "weight_bytes": wbytes, "seconds": time.time() - t0,
            "gemm_routes": [[list(k), v] for k, v in kernels.gemm_routes],
            "gemm_routes_from": args.gemm_routes or "KernelConfig.gemm_routes"}
    path = write_json(args.out, "verify.json", data)

    print(f"\n{'bs':>4} {'kv':>5} {'verify':>8} {'old':>8} {'decode':>8} {'hbm':>7} {'flops':>7} "
          f"{'v/floor':>7} {'matmul':>7} {'mm flr':>7} {'attn':>6} {'at flr':>6} {'other':>6} "
          f"{'v/sum':>6}")
    for r in rows:
        if "bs" in r:
            print(f"{r['bs']:>4} {r['kv']:>5} {r['verify_ms']:>8.2f} {r.get('verify_old_ms', 0):>8.2f} "
                  f"{r['decode_ms']:>8.2f} {r['hbm_floor_ms']:>7.2f} {r['compute_floor_ms']:>7.2f} "
                  f"{r['verify_over_floor']:>7.2f} {r['matmul_ms']:>7.2f} {r['matmul_floor_ms']:>7.2f} "
                  f"{r['attention_ms']:>6.2f} {r['attention_floor_ms']:>6.2f} {r['other_ms']:>6.2f} "
                  f"{r['verify_over_sum_floor']:>6.2f}")
    if pre:
        print(f"prefill {pre['prefill_tokens']}: {pre['prefill_ms']:.3f} ms vs sdpa flash "
              f"{pre['sdpa_prefill_ms']:.3f} ms ({pre['prefill_ms'] / pre['sdpa_prefill_ms']:.2f}x)")
    for r in rows:
        if "replay_span_ms" in r:
            print(f"bs {r['bs']} kv {r['kv']}: one verify replay's {r['replay_kernels']} kernels "
                  f"{r['replay_kernel_ms']:.2f} ms of its {r['replay_span_ms']:.2f} ms span "
                  f"(between kernels {r['replay_span_ms'] - r['replay_kernel_ms']:.2f} ms)")
    worst = sorted(matmuls, key=lambda r: r["of_gemm_rate"])[:5]
    if worst:
        print("slowest matmuls (of the GEMM rate): " + ", ".join(
            f"{r['name']} M={r['m']} {r['of_gemm_rate']:.2f}" for r in worst))
    print("\n".join(bounds_lines(rows)))
    print("\n".join(decode_bounds_lines(rows)))
    print(f"wrote {path} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
