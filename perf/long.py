"""Long contexts at the Llama-3.1-8B shape (issue #42 item 1): decode, the speculative cycle and
attention at 4k-128k tokens of KV against their HBM floors.

    python3 -m perf.long --out DIR [--tag 2026-12-06] [--deadline-s 270] [--no-useless]
                         [--useless-deadline-s 180] [--kv 4096,8192,32768] [--bs 1,8,32,64]
        (one H200: the long-context rows within --deadline-s, then perf.useless_draft's rows
        within --useless-deadline-s; writes DIR/<tag>-<card>-long.json)
    python3 -m perf.long --tiny --out DIR [--no-useless]
        (CPU: a tiny pair through the same code, end to end; its timings mean nothing)
    python3 -m perf.long --attention-only --out DIR [--kv ...] [--bs ...] [--no-long-row]
                         [--fused-combine off|on|both]
        (the attention columns alone, on synthetic pools: DIR/<tag>-<card>-long-attention.json)

`--fused-combine` (`KernelConfig.decode_fused_combine`, the decode attention's one-launch
split combine): off / on set it for every measurement (the engines' kernels too); unset: the
config's own (the environment's). `both` (with `--attention-only`): the columns above with it
off (two launches), and on the Triton path each row also gets the decode attention with it on:
`attention_fused_ms`, `attention_fused_over_floor`, `attention_fused_speedup` (two-launch ms /
fused ms) and the split sweep's `attention_fused_ms[splitsN]`, timed in the same run; the
goal misses of the fused column under `goal_misses_fused`.

One target (random bf16 weights, `perf.models_8b.build_target`) with Llama-3.1's rope scaling
(`rope_type: "llama3"`, factor 8 over 8192 positions) and a RoPE table as long as the context,
and its EAGLE-3 head. Two Engines over it, one after the other (their KV pools do not fit side
by side), each built once with `max_context_len` = the longest row's prompt + new tokens +
look-ahead and its graphs captured once for the measured batch sizes: the attention kernels'
split count follows each row's length on the device (`kernels.decode_attention.row_chunk`), so
every row below replays the same graphs (no capture per length).

Per context length kv (4096, 8192, 32768; and 131072 at bs 1) the largest batch that fits is
admitted with prompts of kv random tokens and prefilled in chunks of `--chunk` tokens (the
prefill's seconds and its peak memory above the engine's own allocations are recorded: chunked
prefill of 32k / 128k prompts stays bounded); then each batch size is timed in steady decode,
largest first, aborting requests down to the next (the KV stays at about kv). A batch whose KV
does not fit the card (pages for prompt + new tokens, target and draft, next to the weights) is
listed under `skipped` with its size. Per row:

  target_only_step_ms  wall ms per `Engine.step()` of the target-only engine (median of blocks)
  decode_floor_ms      its floor: target weights (the embedding table gathered, not read) +
                       every row's KV once, over the copy bandwidth measured in this run
  cycle_ms             wall ms per `Engine.step()` of the speculative engine (fixed S = 3)
  cycle_floor_ms       `floors.cycle_floor_bytes` over the bandwidth
  attention_ms         one decode step's attention over every layer (the decode kernel over the
                       engine's own pool, page table and bound, 32 calls in one CUDA graph)
  attention_floor_ms   that KV read once over the bandwidth
  verify_attention_ms  the same for the verify's N = 4 rows (the extend kernel)
  speedup_at_3.0       3.0 x target_only_step_ms / cycle_ms (tokens/s over target-only at a mean
                       accept length of 3; the random head's drafts are rejected, the cost is
                       the same)
  kv_mean              the mean KV length of the rows while timed (kv plus the decoded tokens)

Then (unless --no-useless) `perf.useless_draft.run_rows` (rows with `regime: "useless"`),
imported when it runs. Rows that do not fit the deadline are left out and named under
`skipped`. CUDA-event / synchronized wall medians after warm-up; a CPU run says its timings mean
nothing.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import triton

from graphdraft import ops
from graphdraft.config import ModelConfig, RuntimeConfig
from graphdraft.kernels import decode_attention, extend_attention
from graphdraft.kernels.config import KernelConfig
from graphdraft.serving.engine import Engine
from graphdraft.serving.request import Request
from graphdraft.serving.verify import SamplingParams
from perf.cases import int_list
from perf.floors import (
    attention_floor_bytes,
    cycle_floor_bytes,
    decode_floor_bytes,
    kv_bytes_per_token,
)
from perf.models_8b import (
    LLAMA31_8B,
    LLAMA31_8B_HEAD,
    LLAMA31_ROPE_SCALING,
    build_head,
    build_target,
)
from perf.real import card_name
from perf.timing import copy_bandwidth, graph_time_us, sync, write_json

KV_LENS = (4096, 8192, 32768)
BATCH_SIZES = (1, 8, 32, 64)
LONG_KV = 131072
"""The longest row, at bs 1."""
STEPS = 3
ACCEPT = 3.0
NEW_TOKENS = 512
"""max_new_tokens of every request: the decode steps while later prompts prefill (mixed steps)
and every timed block of the group's batch sizes fit in it."""
NOT_KV_BYTES = 30 << 30
"""Device memory kept off the KV pools: the 16 GB of target weights, the head, an 8k-token
chunk's activations, the graphs' pools, the allocator's slack."""
USELESS_BS = (1, 8, 64, 128, 256)
GOALS = {"step_over_floor": 1.15, "cycle_over_floor": 1.20, "attention_over_floor": 1.10}
"""Issue #42's bounds on each long row (attention: at kv >= ATTENTION_GOAL_KV only)."""
ATTENTION_GOAL_KV = 8192


@dataclass(frozen=True)
class Setup:
    """What one run measures and on what."""

    kv_lens: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    long_kv: int | None
    device: str
    dtype: torch.dtype = torch.bfloat16
    page_size: int = 16
    chunk: int = 8192
    new_tokens: int = NEW_TOKENS
    warmup: int = 4
    blocks: int = 5
    block: int = 6
    target_cfg: ModelConfig = field(default_factory=lambda: LLAMA31_8B)
    head_cfg: ModelConfig = field(default_factory=lambda: LLAMA31_8B_HEAD)
    fused_combine: bool | None = None
    """`KernelConfig.decode_fused_combine` of every measurement (None: the config's own)."""

    @property
    def lookahead(self) -> int:
        """KV positions the chain modes reserve past prompt + max_new (N + S)."""
        return 2 * STEPS + 1

    @property
    def context_len(self) -> int:
        longest = max((*self.kv_lens, self.long_kv or 0))
        return longest + self.new_tokens + self.lookahead

    def pages(self, bs: int, kv: int) -> int:
        """KV pages bs requests of kv prompt tokens reserve."""
        return bs * -(-(kv + self.new_tokens + self.lookahead) // self.page_size)


TINY = dict(kv_lens=(32, 64, 128), batch_sizes=(1, 2, 4), long_kv=256, device="cpu",
            dtype=torch.float32, chunk=64, new_tokens=48, warmup=1, blocks=2, block=2,
            target_cfg=ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, intermediate_size=128, num_hidden_layers=4,
                                   vocab_size=97, rope_theta=500000.0,
                                   aux_hidden_state_layer_ids=(0, 1, 3)),
            head_cfg=ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, intermediate_size=96, num_hidden_layers=1,
                                 vocab_size=97, draft_vocab_size=48, rope_theta=500000.0))
"""`--tiny`: the same code on a CPU-sized pair (rope scaling over 64 positions)."""


@dataclass
class Group:
    """Rows that share one prefill: the batch sizes of one context length, largest first."""

    kv: int
    batch_sizes: list[int]

    @property
    def tokens(self) -> int:
        return self.batch_sizes[0] * self.kv


@dataclass
class Clock:
    """The run's deadline; `rate` the prefill tokens/s seen so far (for estimates)."""

    deadline_s: float
    start: float = field(default_factory=time.perf_counter)
    rate: float = 20000.0
    per_row_s: float = 4.0

    def left(self) -> float:
        return self.deadline_s - (time.perf_counter() - self.start)

    def estimate(self, group: Group) -> float:
        """Seconds a group may take: its prefill at `rate`, its attention's quadratic share
        growing with the prompt (x3 at 128k), and each row's timing."""
        prefill = group.tokens / self.rate * (1 + group.kv / 65536)
        return prefill + self.per_row_s * len(group.batch_sizes)


def plan_groups(setup: Setup, kv_budget: float) -> tuple[list[Group], list[dict]]:
    """The groups whose pages (target and draft KV) fit `kv_budget` bytes, and the rows that
    do not (`skipped` entries naming the bytes they need)."""
    tok = kv_bytes_per_token(setup.target_cfg, setup.dtype.itemsize) + kv_bytes_per_token(
        setup.head_cfg, setup.dtype.itemsize)
    cases = [(kv, sorted(setup.batch_sizes, reverse=True)) for kv in setup.kv_lens]
    if setup.long_kv:
        cases.append((setup.long_kv, [1]))
    groups, skipped = [], []
    for kv, sizes in cases:
        fit = []
        for bs in sizes:
            need = setup.pages(bs, kv) * setup.page_size * tok
            if need <= kv_budget:
                fit.append(bs)
            else:
                skipped.append({"bs": bs, "kv": kv, "reason": f"KV needs {need / 2**30:.1f} GiB, "
                                f"over the {kv_budget / 2**30:.1f} GiB budget next to the weights"})
        if fit:
            groups.append(Group(kv, fit))
    return groups, skipped


def build_models(setup: Setup, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The target and its head with Llama-3.1's rope scaling and RoPE tables of the context
    length; the head shares the target's embedding."""
    ctx = setup.context_len
    scaling = dict(LLAMA31_ROPE_SCALING)
    if setup.device == "cpu":  # the tiny pair: scaled past 64 positions
        scaling["original_max_position_embeddings"] = 64
    tc = replace(setup.target_cfg, max_position_embeddings=ctx, rope_scaling=scaling)
    hc = replace(setup.head_cfg, max_position_embeddings=ctx, rope_scaling=scaling)
    if setup.device == "cpu":
        torch.manual_seed(seed)
    target = build_target(setup.device, tc, dtype=setup.dtype, seed=seed)
    head = build_head(hc, setup.device, dtype=setup.dtype, seed=seed + 1)
    head.embed_tokens = target.embed_tokens
    return target, head


def engine_config(setup: Setup, groups: list[Group]) -> RuntimeConfig:
    """One config for every group: slots and graphs up to the largest batch, pages for the
    largest group, the context of the longest row, fixed S = 3."""
    sizes = tuple(sorted({bs for g in groups for bs in g.batch_sizes}))
    pages = max(setup.pages(g.batch_sizes[0], g.kv) for g in groups)
    kernels = (None if setup.fused_combine is None else
               KernelConfig.from_env(decode_fused_combine=setup.fused_combine))
    return RuntimeConfig(
        kernels=kernels,
        speculative_num_steps=STEPS, page_size=setup.page_size, max_running_requests=sizes[-1],
        max_context_len=setup.context_len, max_num_batched_tokens=setup.chunk,
        cuda_graph_max_bs=sizes[-1], cuda_graph_bs=sizes, num_kv_pages=pages,
        dtype=str(setup.dtype).removeprefix("torch."), device=setup.device,
        speculative_policy="fixed")


def fill(engine: Engine, bs: int, kv: int, setup: Setup, rng: random.Random
         ) -> tuple[list[Request], dict[str, Any]]:
    """Admit bs requests of kv random prompt tokens and step until all decode (chunked
    prefill, then mixed steps); returns them and the prefill's seconds and peak memory above
    what was allocated before (CUDA)."""
    vocab = engine.target.config.vocab_size
    params = SamplingParams(max_new_tokens=setup.new_tokens, ignore_eos=True)
    cuda = setup.device.startswith("cuda")
    sync(setup.device)
    if cuda:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    prompts = [[rng.randrange(vocab) for _ in range(kv)] for _ in range(bs)]
    t0 = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in prompts]
    steps = 0
    while not all(r.slot is not None and not r.prefilling for r in reqs):
        engine.step()
        steps += 1
    engine.drain()
    seconds = time.perf_counter() - t0
    info = {"bs": bs, "kv": kv, "tokens": bs * kv, "steps": steps, "seconds": seconds}
    if cuda:
        info["peak_above_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
    return reqs, info


def _kv_now(reqs: list[Request]) -> float:
    return statistics.mean(len(r.prompt) + len(r.output) + r.in_flight for r in reqs)


def timed_steps(engine: Engine, reqs: list[Request], setup: Setup) -> tuple[float, float]:
    """Median wall ms per `step()` over blocks after warm-up, and the mean KV length while
    timed. Every request must be decoding."""
    for _ in range(setup.warmup):
        engine.step()
    kv0, times = _kv_now(reqs), []
    for _ in range(setup.blocks):
        sync(setup.device)
        t0 = time.perf_counter()
        for _ in range(setup.block):
            engine.step()
        sync(setup.device)
        times.append((time.perf_counter() - t0) * 1e3 / setup.block)
    engine.drain()
    return statistics.median(times), (kv0 + _kv_now(reqs)) / 2


@dataclass(frozen=True)
class AttentionSite:
    """Where one step's attention reads: a layer's (K, V) caches by index, the page table and
    bound of the engine (or of a synthetic pool), its kernel config."""

    kv_layer: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    layers: int
    req_to_page: torch.Tensor
    page_size: int
    bound: int
    kernels: Any


def site_attention_ms(site: AttentionSite, slots: torch.Tensor, committed: torch.Tensor, n: int,
                      mc: ModelConfig, dtype: torch.dtype, device: str,
                      num_splits: int | None = None) -> float:
    """One step's attention over every layer for rows `slots` `[bs]` of `committed` `[bs]` KV
    positions: the decode kernel (n = 1) or the verify's extend kernel (uniform rows of n),
    each row seeing committed + n positions (`num_splits`: the Triton kernels on that split
    count, not the rule's); on CUDA the median of a graph of the layers' calls, elsewhere one
    eager pass (meaningless)."""
    seq = (committed + n).to(torch.int32)
    q = torch.randn(slots.shape[0] * n, mc.num_attention_heads, mc.head_dim, dtype=dtype,
                    device=device)
    scale = mc.head_dim ** -0.5
    common = (site.req_to_page, site.page_size, scale)

    def call(i: int) -> None:
        k, v = site.kv_layer(i % site.layers)
        if num_splits is not None and n == 1:
            decode_attention.paged_decode_attention(q, k, v, slots, seq, *common,
                                                    max_kv_len=site.bound, num_splits=num_splits,
                                                    kernels=site.kernels)
        elif num_splits is not None:
            extend_attention.paged_extend_attention(q, k, v, slots, seq, None, None, *common,
                                                    max_kv_len=site.bound, uniform_n=n,
                                                    num_splits=num_splits, kernels=site.kernels)
        elif n == 1:
            ops.paged_attention(q, k, v, slots, seq, *common, site.bound, kernels=site.kernels)
        else:
            ops.paged_extend_attention(q, k, v, slots, seq, None, None, *common, site.bound,
                                       uniform_n=n, kernels=site.kernels)

    with torch.inference_mode():
        if device.startswith("cuda"):
            return graph_time_us(call, site.layers) * site.layers / 1e3
        t0 = time.perf_counter()
        for i in range(site.layers):
            call(i)
        return (time.perf_counter() - t0) * 1e3


def attention_ms(engine: Engine, reqs: list[Request], n: int, device: str) -> float:
    """`site_attention_ms` for these requests over the engine's pool, page table and bound."""
    backend, mc = engine.backend, engine.target.config
    site = AttentionSite(engine.kv.layer, mc.num_hidden_layers, backend.req_to_page,
                         backend.page_size, backend.max_context_len, backend.kernels)
    slots = torch.tensor([r.slot for r in reqs], dtype=torch.int64, device=device)
    return site_attention_ms(site, slots, engine.states.valid_cache_lengths[slots], n, mc,
                             engine.target.dtype, device)


def synthetic_site(setup: Setup, bs: int, kv: int, kernels: Any) -> AttentionSite:
    """A paged pool of the target's layers holding bs rows of kv + the look-ahead random
    positions (shuffled pages, page 0 unused) under the engine's bound (`Setup.context_len`)."""
    mc, ps = setup.target_cfg, setup.page_size
    per = -(-(kv + setup.lookahead) // ps)
    gen = torch.Generator(device=setup.device).manual_seed(bs * 131 + kv)
    cols = -(-setup.context_len // ps)
    r2p = torch.zeros(bs, cols, dtype=torch.int32, device=setup.device)
    r2p[:, :per] = (torch.randperm(bs * per, generator=gen, device=setup.device) + 1).view(
        bs, per).to(torch.int32)
    shape = ((bs * per + 1) * ps, mc.num_key_value_heads, mc.head_dim)
    pool = [torch.empty(shape, dtype=setup.dtype, device=setup.device).normal_(generator=gen)
            for _ in range(2 * mc.num_hidden_layers)]
    return AttentionSite(lambda i: (pool[2 * i], pool[2 * i + 1]), mc.num_hidden_layers, r2p, ps,
                         setup.context_len, kernels)


SPLIT_SWEEP = (1, 2, 4, 8)
"""`--attention-only` also times each row's attention at the rule's split count divided by
these (the grid sized for the engine's bound; each row's chunk still follows its length)."""


def rule_splits(site: AttentionSite, bs: int, n: int, mc: ModelConfig, device: str) -> int:
    """The split count the kernels' rule picks for bs rows of n tokens (one query block each)
    under the site's bound (decode: `default_num_splits`; verify: `extend_num_splits` over
    its tile's BLOCK_N), fitted (`fit_splits`)."""
    hkv, dev = mc.num_key_value_heads, torch.device(device)
    if n == 1:
        want = decode_attention.default_num_splits(bs, hkv, site.bound, dev, kernels=site.kernels)
        return decode_attention.fit_splits(want, site.bound, site.kernels.decode_block_n)[0]
    g_pad = triton.next_power_of_2(mc.num_attention_heads // hkv)
    block_n = extend_attention.tile_config(n, g_pad, kernels=site.kernels)[1]
    want = extend_attention.extend_num_splits(bs * hkv, site.bound, block_n, dev)
    return decode_attention.fit_splits(want, site.bound, block_n)[0]


def fused_columns(row: dict, site: AttentionSite, slots: torch.Tensor, committed: torch.Tensor,
                  mc: ModelConfig, setup: Setup) -> None:
    """`--fused-combine both`: the decode attention of this row with the fused combine on
    (`site`'s kernels with `decode_fused_combine`), at the rule's split count and the sweep's,
    added to `row` beside the two-launch columns it already holds."""
    site = replace(site, kernels=site.kernels.replace(decode_fused_combine=True))
    ms = site_attention_ms(site, slots, committed, 1, mc, setup.dtype, setup.device)
    row["attention_fused_ms"] = ms
    row["attention_fused_over_floor"] = ms / row["attention_floor_ms"]
    row["attention_fused_speedup"] = row["attention_ms"] / ms
    default = row["attention_splits_default"]
    for cut in SPLIT_SWEEP:
        if default // cut >= 1 and (cut == 1 or default // cut < default):
            row[f"attention_fused_ms[splits{default // cut}]"] = site_attention_ms(
                site, slots, committed, 1, mc, setup.dtype, setup.device,
                num_splits=default // cut)


def attention_rows(setup: Setup, groups: list[Group], bw: float, kernels: Any,
                   compare_fused: bool = False) -> list[dict]:
    """The attention columns of every (bs, kv) row on synthetic pools (`synthetic_site`, one
    per group, its largest batch): no model, no engine. `compare_fused` (on the Triton path):
    also the fused-combine decode columns (`fused_columns`; `kernels` should have it off)."""
    rows, mc = [], setup.target_cfg
    ms = lambda nbytes: nbytes / bw * 1e3
    for group in groups:
        site = synthetic_site(setup, group.batch_sizes[0], group.kv, kernels)
        for bs in group.batch_sizes:
            slots = torch.arange(bs, dtype=torch.int64, device=setup.device)
            committed = torch.full((bs,), group.kv, dtype=torch.int64, device=setup.device)
            row = {"bs": bs, "kv": group.kv, "mode": "attention_only"}
            for key, n in (("attention", 1), ("verify_attention", STEPS + 1)):
                row[f"{key}_ms"] = site_attention_ms(site, slots, committed, n, mc, setup.dtype,
                                                     setup.device)
                row[f"{key}_floor_ms"] = ms(attention_floor_bytes(mc, bs, group.kv + n,
                                                                  setup.dtype.itemsize))
                row[f"{key}_over_floor"] = row[f"{key}_ms"] / row[f"{key}_floor_ms"]
                if kernels.use_triton:  # the split counts below the rule's (SPLIT_SWEEP)
                    default = rule_splits(site, bs, n, mc, setup.device)
                    row[f"{key}_splits_default"] = default
                    for cut in SPLIT_SWEEP:
                        if default // cut >= 1 and (cut == 1 or default // cut < default):
                            row[f"{key}_ms[splits{default // cut}]"] = site_attention_ms(
                                site, slots, committed, n, mc, setup.dtype, setup.device,
                                num_splits=default // cut)
            if compare_fused and kernels.use_triton:
                fused_columns(row, site, slots, committed, mc, setup)
            rows.append(row)
            print(f"[long] attention only: {row}", flush=True)
        del site
        gc.collect()
        if setup.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


@dataclass
class Phase:
    """One engine kind's measurements: per (bs, kv) a dict of figures; the groups' prefills."""

    kind: str
    rows: dict[tuple[int, int], dict[str, float]] = field(default_factory=dict)
    prefills: list[dict] = field(default_factory=list)
    capture_s: float = 0.0
    left_out: list[tuple[int, int]] = field(default_factory=list)


def run_phase(kind: str, target, head, setup: Setup, groups: list[Group], cfg: RuntimeConfig,
              clock: Clock, until_s: float) -> Phase:
    """Build the `kind` engine ("target_only" or "spec"), capture its graphs, then per group
    (while the clock allows it before `until_s` seconds are left) fill, time each batch size
    (largest first, aborting down), measure attention (target-only), and release the group."""
    phase = Phase(kind)
    t0 = time.perf_counter()
    engine = Engine(target, cfg, head if kind == "spec" else None)
    engine.capture_graphs()
    phase.capture_s = time.perf_counter() - t0
    rng = random.Random(len(kind))
    for group in groups:
        if clock.left() - until_s < clock.estimate(group):
            phase.left_out += [(bs, group.kv) for bs in group.batch_sizes]
            print(f"[long] {kind}: kv {group.kv} left out ({clock.left():.0f} s left)", flush=True)
            continue
        reqs, info = fill(engine, group.batch_sizes[0], group.kv, setup, rng)
        info["kind"] = kind
        phase.prefills.append(info)
        clock.rate = max(1.0, info["tokens"] * (1 + group.kv / 65536) / max(info["seconds"], 1e-6))
        print(f"[long] {kind}: prefill {info}", flush=True)
        for bs in group.batch_sizes:
            for r in reqs[bs:]:
                engine.abort(r)
            reqs = reqs[:bs]
            ms, kv_mean = timed_steps(engine, reqs, setup)
            row = {"step_ms": ms, "kv_mean": kv_mean}
            if any(r.finish_reason is not None for r in reqs):  # fewer rows than bs decoded
                row["warning"] = "a request finished while timed (raise NEW_TOKENS)"
            if kind == "target_only":
                row["attention_ms"] = attention_ms(engine, reqs, 1, setup.device)
                row["verify_attention_ms"] = attention_ms(engine, reqs, STEPS + 1, setup.device)
            phase.rows[(bs, group.kv)] = row
            print(f"[long] {kind}: bs {bs} kv {group.kv}: {row}", flush=True)
        for r in reqs:
            engine.abort(r)
        engine.drain()
    del engine
    gc.collect()
    if setup.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return phase


def build_rows(base: Phase, spec: Phase, target, head_cfg: ModelConfig, bw: float
               ) -> list[dict[str, Any]]:
    """The issue's rows: target-only figures, cycle figures where the spec phase measured the
    same (bs, kv), floors at each phase's own mean KV length."""
    rows = []
    ms = lambda nbytes: nbytes / bw * 1e3
    for (bs, kv), b in sorted(base.rows.items(), key=lambda x: (x[0][1], x[0][0])):
        s = spec.rows.get((bs, kv))
        mc = target.config
        row = {"bs": bs, "kv": kv, "target_only_step_ms": b["step_ms"],
               "decode_floor_ms": ms(decode_floor_bytes(target, bs, b["kv_mean"])),
               "cycle_ms": s["step_ms"] if s else None,
               "cycle_floor_ms": (ms(cycle_floor_bytes(target, head_cfg, bs, s["kv_mean"], STEPS,
                                                       target.dtype.itemsize)) if s else None),
               "attention_ms": b["attention_ms"],
               "attention_floor_ms": ms(attention_floor_bytes(mc, bs, b["kv_mean"] + 1,
                                                              target.dtype.itemsize)),
               "verify_attention_ms": b["verify_attention_ms"],
               "verify_attention_floor_ms": ms(attention_floor_bytes(
                   mc, bs, b["kv_mean"] + STEPS + 1, target.dtype.itemsize)),
               f"speedup_at_{ACCEPT}": ACCEPT * b["step_ms"] / s["step_ms"] if s else None,
               "kv_mean": b["kv_mean"], "cycle_kv_mean": s["kv_mean"] if s else None}
        row["step_over_floor"] = row["target_only_step_ms"] / row["decode_floor_ms"]
        row["cycle_over_floor"] = row["cycle_ms"] / row["cycle_floor_ms"] if s else None
        row["attention_over_floor"] = row["attention_ms"] / row["attention_floor_ms"]
        rows.append(row)
    return rows


def goal_misses(rows: list[dict]) -> list[str]:
    """The long rows' misses of `GOALS` (a row the spec phase left out: its cycle unmeasured)."""
    out = []
    for r in rows:
        for key, bound in GOALS.items():
            value = r.get(key)
            if key == "attention_over_floor" and r["kv"] < ATTENTION_GOAL_KV:
                continue
            if value is None:
                out.append(f"bs {r['bs']} kv {r['kv']}: {key} not measured")
            elif value > bound:
                out.append(f"bs {r['bs']} kv {r['kv']}: {key} {value:.2f} > {bound}")
    return out


def useless_rows(deadline_s: float, info: dict | None = None) -> tuple[list[dict], str | None]:
    """`perf.useless_draft.run_rows` (another benchmark's rows: bs, regime "useless",
    adaptive_tps, target_only_tps; its skipped sizes, capture time and cost table into
    `info`), imported here; ([], why) when it is not there."""
    try:  # through sys.modules (a `from perf import` would find the package's attribute)
        useless_draft = importlib.import_module("perf.useless_draft")
    except ImportError as e:
        return [], f"perf.useless_draft not importable ({e}): no useless-draft rows"
    rows = useless_draft.run_rows(bs_list=USELESS_BS, deadline_s=deadline_s, info=info)
    return list(rows), None


def _bandwidth_and_budget(setup: Setup, kv_budget: float | None) -> tuple[float, float]:
    """The copy bandwidth measured now and the KV budget (None: the card's memory less
    `NOT_KV_BYTES`; 8 GiB on a CPU)."""
    cuda = setup.device.startswith("cuda")
    bw = copy_bandwidth(setup.device, nbytes=(2 << 30) if cuda else (1 << 20))
    if kv_budget is None:
        kv_budget = (torch.cuda.get_device_properties(setup.device).total_memory - NOT_KV_BYTES
                     if cuda else float(8 << 30))
    return bw, kv_budget


def _attention_misses(rows: list[dict], key: str) -> list[str]:
    """The rows at kv >= ATTENTION_GOAL_KV whose `key` (an over-floor ratio) misses its goal."""
    return [f"bs {r['bs']} kv {r['kv']}: {key} {r[key]:.2f}" for r in rows
            if r["kv"] >= ATTENTION_GOAL_KV and key in r
            and r[key] > GOALS["attention_over_floor"]]


def measure_attention(setup: Setup, kv_budget: float | None = None,
                      compare_fused: bool = False) -> dict[str, Any]:
    """`--attention-only`: the attention columns of the rows a full run would measure (the
    same groups, bound and kernel config), on synthetic pools: seconds, not minutes.
    `compare_fused` (`--fused-combine both`): the main columns with the fused combine off, the
    fused ones beside them (`fused_columns`)."""
    t0 = time.perf_counter()
    bw, kv_budget = _bandwidth_and_budget(setup, kv_budget)
    groups, skipped = plan_groups(setup, kv_budget)
    if compare_fused:
        setup = replace(setup, fused_combine=False)
    kernels = engine_config(setup, groups).kernels
    rows = attention_rows(setup, groups, bw, kernels, compare_fused=compare_fused)
    out = {"copy_bw": bw, "context_len": setup.context_len, "page_size": setup.page_size,
           "kv_budget_gib": kv_budget / 2**30, "skipped": skipped, "goals": GOALS,
           "decode_fused_combine": "both" if compare_fused else kernels.decode_fused_combine,
           "goal_misses": _attention_misses(rows, "attention_over_floor"), "rows": rows}
    if compare_fused:
        out["goal_misses_fused"] = _attention_misses(rows, "attention_fused_over_floor")
    return {**out, "seconds": time.perf_counter() - t0}


def measure(setup: Setup, deadline_s: float, kv_budget: float | None = None) -> dict[str, Any]:
    """Both phases within `deadline_s` (the target-only phase stops planning groups at half
    of it, the spec phase measures the groups the first one did), the floors, the rows."""
    clock = Clock(deadline_s)
    bw, kv_budget = _bandwidth_and_budget(setup, kv_budget)
    groups, skipped = plan_groups(setup, kv_budget)
    if not groups:
        raise SystemExit("perf.long: no row fits this card's KV budget")
    target, head = build_models(setup)
    cfg = engine_config(setup, groups)
    base = run_phase("target_only", target, None, setup, groups, cfg, clock, deadline_s / 2)
    done = [g for g in groups if any(kv == g.kv for _, kv in base.rows)]
    spec = (run_phase("spec", target, head, setup, done, cfg, clock, 0.0) if done
            else Phase("spec"))
    skipped += [{"bs": bs, "kv": kv, "reason": f"{p.kind}: past the deadline"}
                for p in (base, spec) for bs, kv in p.left_out]
    rows = build_rows(base, spec, target, head.config, bw)
    return {"copy_bw": bw, "context_len": setup.context_len, "page_size": setup.page_size,
            "chunk_tokens": setup.chunk, "new_tokens": setup.new_tokens, "steps": STEPS,
            "rope_scaling": target.config.rope_scaling, "kv_budget_gib": kv_budget / 2**30,
            "decode_fused_combine": cfg.kernels.decode_fused_combine,
            "capture_s": {"target_only": base.capture_s, "spec": spec.capture_s},
            "prefills": base.prefills + spec.prefills, "skipped": skipped,
            "goals": GOALS, "goal_misses": goal_misses(rows), "rows": rows,
            "seconds": time.perf_counter() - clock.start}


def table(rows: list[dict]) -> str:
    """The long rows as a markdown table (ratios to the floors)."""
    out = ["| bs | kv | step ms | step/floor | cycle ms | cycle/floor | attn ms | attn/floor "
           "| x@3.0 |", "|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, spec="{:.2f}": "-" if v is None else spec.format(v)
    for r in rows:
        if "kv" not in r:
            continue
        cyc = r["cycle_ms"]
        out.append(f"| {r['bs']} | {r['kv']} | {f(r['target_only_step_ms'])} | "
                   f"{f(r['target_only_step_ms'] / r['decode_floor_ms'])}x | {f(cyc)} | "
                   f"{f(cyc / r['cycle_floor_ms'] if cyc else None)}x | {f(r['attention_ms'])} | "
                   f"{f(r['attention_ms'] / r['attention_floor_ms'])}x | "
                   f"{f(r[f'speedup_at_{ACCEPT}'])}x |")
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="perf/out", help="folder for <tag>-<card>-long.json")
    ap.add_argument("--tag", default=None, help="file name prefix (default: today, UTC)")
    ap.add_argument("--deadline-s", type=float, default=270.0,
                    help="seconds for the long-context rows (rows that do not fit are left out "
                         "and listed under 'skipped'; default 270)")
    ap.add_argument("--useless-deadline-s", type=float, default=180.0,
                    help="seconds handed to perf.useless_draft.run_rows (a batch size started "
                         "before it runs to its end; default 180)")
    ap.add_argument("--no-useless", action="store_true", help="skip the useless-draft rows")
    ap.add_argument("--kv", type=int_list, default=KV_LENS,
                    help="context lengths of the rows (default 4096,8192,32768)")
    ap.add_argument("--bs", type=int_list, default=BATCH_SIZES,
                    help="batch sizes of the rows (default 1,8,32,64; those that fit)")
    ap.add_argument("--no-long-row", action="store_true", help="skip the 131072-token row")
    ap.add_argument("--attention-only", action="store_true",
                    help="only the attention columns of the rows, on synthetic KV pools of the "
                         "same bound (no model, no engine; writes <tag>-<card>-long-attention.json)")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny pair on the CPU through the same code (timings meaningless)")
    ap.add_argument("--fused-combine", choices=("off", "on", "both"), default=None,
                    help="KernelConfig.decode_fused_combine for every measurement (default: the "
                         "config's own); 'both' (with --attention-only): the decode attention "
                         "with it off and on, in one run")
    a = ap.parse_args(argv)
    if a.deadline_s <= 0 or a.useless_deadline_s <= 0:
        ap.error("--deadline-s / --useless-deadline-s: expected seconds > 0")
    if a.fused_combine == "both" and not a.attention_only:
        ap.error("--fused-combine both: only with --attention-only (the engines take one form)")
    return a


def attention_main(setup: Setup, a: argparse.Namespace, card: str, tag: str) -> int:
    """`--attention-only`: `measure_attention`, written to <tag>-<card>-long-attention.json."""
    data = measure_attention(setup, compare_fused=a.fused_combine == "both")
    doc = {"device": torch.cuda.get_device_name() if card != "cpu" else "cpu (timings meaningless)",
           "card": card, "torch": torch.__version__, "tiny": a.tiny, **data}
    path = write_json(Path(a.out), f"{tag}-{card}-long-attention.json", doc)
    print("| bs | kv | attn ms | attn/floor | verify attn ms | verify attn/floor |")
    print("|---|---|---|---|---|---|")
    for r in doc["rows"]:
        print(f"| {r['bs']} | {r['kv']} | {r['attention_ms']:.3f} | {r['attention_over_floor']:.2f}x "
              f"| {r['verify_attention_ms']:.3f} | {r['verify_attention_over_floor']:.2f}x |")
    print("goal misses: " + ("; ".join(doc["goal_misses"]) or "none"))
    if "goal_misses_fused" in doc:
        print("\n| bs | kv | attn ms (two launches) | attn ms (fused) | fused/floor | speedup |")
        print("|---|---|---|---|---|---|")
        for r in doc["rows"]:
            if "attention_fused_ms" in r:
                print(f"| {r['bs']} | {r['kv']} | {r['attention_ms']:.3f} | "
                      f"{r['attention_fused_ms']:.3f} | {r['attention_fused_over_floor']:.2f}x | "
                      f"{r['attention_fused_speedup']:.2f}x |")
        print("goal misses (fused): " + ("; ".join(doc["goal_misses_fused"]) or "none"))
    print(f"wrote {path} ({doc['seconds']:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    fused = {"off": False, "on": True}.get(a.fused_combine)  # both / unset: None here
    if a.tiny:
        setup = Setup(**{**TINY, "long_kv": None if a.no_long_row else TINY["long_kv"],
                         "fused_combine": fused})
    else:
        if not torch.cuda.is_available():
            print("perf.long needs a CUDA GPU (or --tiny on the CPU)")
            return 2
        setup = Setup(kv_lens=tuple(a.kv), batch_sizes=tuple(a.bs),
                      long_kv=None if a.no_long_row else LONG_KV, device="cuda",
                      fused_combine=fused)
    card = card_name(setup.device)
    tag = a.tag or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    if a.attention_only:
        return attention_main(setup, a, card, tag)
    data = measure(setup, a.deadline_s)
    doc = {"device": torch.cuda.get_device_name() if card != "cpu" else "cpu (timings meaningless)",
           "card": card, "torch": torch.__version__, "tiny": a.tiny, "useless_note": None, **data}
    path = write_json(Path(a.out), f"{tag}-{card}-long.json", doc)  # the long rows kept first
    if a.no_useless:
        doc["useless_note"] = "--no-useless"
    elif a.tiny:
        doc["useless_note"] = ("--tiny: the useless-draft rows need the 8B pair "
                               "(python -m perf.useless_draft --tiny)")
    else:
        del setup  # the long phase's pair: the useless rows build their own
        gc.collect()
        torch.cuda.empty_cache()
        doc["useless_info"] = {}
        try:
            extra, doc["useless_note"] = useless_rows(a.useless_deadline_s, doc["useless_info"])
        except torch.OutOfMemoryError as e:  # e.g. an 80 GB card: the long rows stay written
            extra, doc["useless_note"] = [], f"useless-draft rows: out of GPU memory ({e})"[:300]
        doc["rows"] += extra
        path = write_json(Path(a.out), f"{tag}-{card}-long.json", doc)
    note = doc["useless_note"]
    print(table(doc["rows"]))
    print("goal misses: " + ("; ".join(doc["goal_misses"]) or "none"))
    if note:
        print(f"useless-draft rows: {note}")
    print(f"wrote {path} ({doc['seconds']:.0f} s for the long rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
