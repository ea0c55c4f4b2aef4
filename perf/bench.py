"""Pure helpers of the perf suite: cases, drafter set-up, decode batches, timing, HBM floor.

Nothing here needs a GPU: on a CPU device the same code paths run (graphs are
off there and times come from the host clock), which `tests/test_perf_smoke.py`
uses to check the harness without one.

A *group* is one `(page_size, kv_len)` set-up: a drafter whose graphs are
captured once for every bs the group's cases need, its own shuffled page table,
KV pool (filled with random values) and input buffers, and, built on first use,
the torch.compile baseline drafter over the same buffers.

The baseline (`Baseline`, chosen by `GRAPHDRAFT_PERF_COMPILE`) is a torch-path
drafter (`kernel_backend="torch"`) whose two forwards are compiled:

- "compile+graph" (default): `torch.compile(fn, dynamic=False, fullgraph=False)`
  (inductor, default mode, no cudagraphs), the compiled forwards captured in
  graphdraft's own CUDA graphs (`CapturedForward`, its own pool; the compile runs
  on each bs's first warm-up call), as SGLang runs torch.compile inside its own
  graph runner;
- "reduce-overhead": `torch.compile(mode="reduce-overhead", dynamic=False)`,
  torch's cudagraph trees (which skip graphs that mutate inputs: the multi-step's
  in-place buffer writes); "reduce-overhead-dynamic" the same with automatic
  dynamic shapes.

Order inside a group: every graph measurement first, then the compiled baseline.
For reduce-overhead this order is required: cudagraph trees clear PyTorch's
cached cuBLAS workspaces before they warm up or record; graphs that baked in the
workspace cuBLAS held at capture then replay into freed memory (seen on an
H200: an illegal memory access on the next replay), so `DraftGroup.graphs_stale`
is set once a reduce-overhead baseline exists. With compile+graph every graph is
captured by `CapturedForward`, which gives each capture a workspace of its own
pool, and nothing frees it: the drafter's graphs stay valid.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from capture import EAGER_ENV, CapturedForward
from graphdraft.batch import BatchRow, ForwardContext, write_batch
from graphdraft.buffers import InputBuffers, RuntimeStates
from graphdraft.config import ModelConfig, RuntimeConfig
from graphdraft.drafter import EagleDrafter
from graphdraft.eagle3 import Eagle3DraftHead
from graphdraft.kv_cache import KVPool
from graphdraft.layers import init_random_

LLAMA31_8B_HEAD = ModelConfig(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=14336, vocab_size=128256, draft_vocab_size=32000,
    max_position_embeddings=8192, rope_theta=500000.0)
"""EAGLE-3 head shaped for Llama-3.1-8B (weights read per draft step: 748.7 MB in bf16)."""

STEPS = 3
BATCH_SIZES = (1, 8, 32, 64, 128)
KV_LENS = (512, 4096)
PAGE1_BS = 64
"""The single page-size-1 case runs at this bs (kv 4096)."""

Forward = Callable[[int], Any]
Compiler = Callable[[Forward], Forward]


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One benchmark point; cases sharing `group` share one drafter (captured once)."""

    page_size: int
    kv_len: int
    bs: int

    @property
    def group(self) -> tuple[int, int]:
        return self.page_size, self.kv_len

    def __str__(self) -> str:
        return f"page{self.page_size}-kv{self.kv_len}-bs{self.bs}"


def default_cases(batch_sizes: Sequence[int] = BATCH_SIZES) -> list[Case]:
    """Page 16 at every kv length and bs, then one page-size-1 case (kv 4096)."""
    cases = [Case(16, kv, bs) for kv in KV_LENS for bs in batch_sizes]
    cases.append(Case(1, max(KV_LENS), PAGE1_BS if PAGE1_BS in batch_sizes else max(batch_sizes)))
    return cases


def cases_from_env(env: dict[str, str] | None = None) -> list[Case]:
    """`default_cases`, restricted by `GRAPHDRAFT_PERF_BS="1,64"` when set."""
    raw = (os.environ if env is None else env).get("GRAPHDRAFT_PERF_BS", "").strip()
    return default_cases(tuple(int(b) for b in raw.split(",")) if raw else BATCH_SIZES)


def ordered_params(cases: Sequence[Case], compile: bool) -> list[tuple[Case, str]]:
    """`(case, variant)` in run order: per group, every "graph" variant (eager + graph
    replay) before any "compile" variant (the graphs go stale once the baseline runs)."""
    out: list[tuple[Case, str]] = []
    for group in dict.fromkeys(c.group for c in cases):
        mine = [c for c in cases if c.group == group]
        out += [(c, "graph") for c in mine]
        out += [(c, "compile") for c in mine] if compile else []
    return out


def group_batch_sizes(cases: Sequence[Case], group: tuple[int, int]) -> tuple[int, ...]:
    """The sizes a group must capture: every bs of its cases, ascending."""
    return tuple(sorted({c.bs for c in cases if c.group == group}))


# ---------------------------------------------------------------------------
# HBM floor
# ---------------------------------------------------------------------------
def weight_bytes_per_step(mc: ModelConfig, dtype_bytes: int = 2) -> int:
    """Weights every draft step reads: qkv, o, gate_up, down, lm_head (norms/embedding rows ~0)."""
    h, d, hq, hkv = mc.hidden_size, mc.head_dim, mc.num_attention_heads, mc.num_key_value_heads
    qkv = (hq + 2 * hkv) * d * 2 * h  # input is [embeds ; hidden], 2H wide
    o = h * hq * d
    gate_up = 2 * mc.intermediate_size * h
    down = h * mc.intermediate_size
    lm_head = mc.output_vocab_size * h
    return (qkv + o + gate_up + down + lm_head) * dtype_bytes


@dataclass(frozen=True)
class FloorBytes:
    """The fewest HBM bytes one draft call (first step + `steps - 1` multi-steps) must read."""

    weights_per_step: int
    fc: int
    """First step only: the `[H, k*H]` projection of the target hidden states."""
    kv_per_step: int
    """`bs * kv_len * 2 (K, V) * Hkv * D * dtype_bytes`."""
    hidden_in: int
    """First step only: the target hidden states, `bs * N * k*H * dtype_bytes`."""
    steps: int

    @property
    def first_step(self) -> int:
        return self.weights_per_step + self.fc + self.kv_per_step + self.hidden_in

    @property
    def multi_step(self) -> int:
        return (self.steps - 1) * (self.weights_per_step + self.kv_per_step)

    @property
    def total(self) -> int:
        return self.first_step + self.multi_step

    @property
    def weights_only(self) -> int:
        """DESIGN.md's anchor floor: `steps` x the per-step weights (no fc, KV or hidden)."""
        return self.steps * self.weights_per_step


def floor_bytes(mc: ModelConfig, bs: int, kv_len: int, steps: int = STEPS,
                dtype_bytes: int = 2) -> FloorBytes:
    h = mc.hidden_size
    return FloorBytes(
        weights_per_step=weight_bytes_per_step(mc, dtype_bytes),
        fc=h * mc.num_aux_hidden_states * h * dtype_bytes,
        kv_per_step=bs * kv_len * 2 * mc.num_key_value_heads * mc.head_dim * dtype_bytes,
        hidden_in=bs * (steps + 1) * mc.num_aux_hidden_states * h * dtype_bytes,
        steps=steps)


def floor_info(mc: ModelConfig, bs: int, kv_len: int, bandwidth: float,
               steps: int = STEPS) -> dict[str, float]:
    """The floor's bytes and times (us) at `bandwidth` bytes/s, as benchmark extra_info."""
    fb = floor_bytes(mc, bs, kv_len, steps)
    us = 1e6 / bandwidth
    return {"floor_bytes": fb.total, "floor_us": fb.total * us,
            "floor_first_us": fb.first_step * us, "floor_multi_us": fb.multi_step * us,
            "weights_floor_us": fb.weights_only * us}


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------
def time_us(fn: Callable[[], Any], *, warmup: int = 3, reps: int = 20,
            device: str | torch.device = "cuda") -> list[float]:
    """Per-call times (us) of `reps` calls after `warmup` calls.

    CUDA: an event pair around each call, calls issued back to back (as a serving
    loop issues them), so a call's time is its GPU span, or its host time where
    the host is the bottleneck. CPU: the host clock around each call.
    """
    for _ in range(warmup):
        fn()
    if torch.device(device).type != "cuda":
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in events]


def write_json(out_dir: str | Path, name: str, data: Any) -> Path:
    """Write `data` as indented JSON to `out_dir/name` (the folder made if missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(data, indent=1))
    return path


def median_us(fn: Callable[[], Any], **kw: Any) -> float:
    return statistics.median(time_us(fn, **kw))


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str | torch.device = "cuda", nbytes: int = 2 << 30,
                   reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s: (read + written) / median copy time."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t = median_us(lambda: dst.copy_(src), warmup=3, reps=reps, device=device)
    return 2 * nbytes / (t * 1e-6)


@contextlib.contextmanager
def forced_eager(on: bool = True) -> Iterator[None]:
    """Set `GRAPHDRAFT_EAGER=1` (read on every `CapturedForward.run`) inside the block."""
    old = os.environ.get(EAGER_ENV)
    if on:
        os.environ[EAGER_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(EAGER_ENV, None)
        else:
            os.environ[EAGER_ENV] = old


# ---------------------------------------------------------------------------
# Set-up
# ---------------------------------------------------------------------------
def build_head(mc: ModelConfig, device: str | torch.device, *, dtype: torch.dtype = torch.bfloat16,
               seed: int = 0, std: float = 0.02) -> Eagle3DraftHead:
    """A head with random weights and, for a draft vocab, a random hot-token map.

    CPU: `init_random_`. CUDA: the same distribution drawn on the device (N(0, std),
    norm weights 1 + N(0, 0.1)): `init_random_` draws on the host, about 20 s for the
    8B-shaped head's 0.9 G values, which the perf budget cannot spare.
    """
    gen = torch.Generator().manual_seed(seed)
    hot = (torch.randperm(mc.vocab_size, generator=gen)[: mc.output_vocab_size]
           if mc.output_vocab_size < mc.vocab_size else None)
    head = Eagle3DraftHead(mc, dtype, hot_token_ids=hot)
    if torch.device(device).type == "cpu":
        init_random_(head, seed, std=std)
        return head
    head.to(device)
    dgen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(head.named_parameters()):
            is_norm = "norm" in name
            p.normal_(1.0 if is_norm else 0.0, 0.1 if is_norm else std, generator=dgen)
    return head


class StaticPages:
    """Request slots 1..max_reqs, each holding `pages_per_req` pages of a shuffled pool.

    Duck-types `PageTable` for `write_batch` (`page_size`, `pages_of`, `req_to_page`).
    Shuffled pages make attention gather scattered pages, as a long-running
    server's fragmented pool does; slot 0 and page 0 stay the reserved dummies.
    """

    def __init__(self, max_reqs: int, pages_per_req: int, page_size: int,
                 device: str | torch.device, *, seed: int = 0, shuffle: bool = True) -> None:
        total = max_reqs * pages_per_req
        gen = torch.Generator().manual_seed(seed)
        ids = (torch.randperm(total, generator=gen) if shuffle else torch.arange(total)) + 1
        table = torch.zeros((max_reqs + 1, pages_per_req), dtype=torch.int32)
        table[1:] = ids.view(max_reqs, pages_per_req).to(torch.int32)
        self.page_size, self.num_pages = page_size, total
        self._host = table
        self.req_to_page = table.to(device)

    def pages_of(self, slot: int) -> list[int]:
        return self._host[slot].tolist()


def context_positions(kv_len: int, steps: int = STEPS) -> int:
    """Positions a decode row touches: the KV, N verify tokens, and S - 1 draft look-ahead."""
    return kv_len + (steps + 1) + steps - 1


def runtime_config(page_size: int, kv_len: int, batch_sizes: Sequence[int], *,
                   device: str | torch.device, dtype: str = "bfloat16",
                   steps: int = STEPS) -> RuntimeConfig:
    """Tight sizes: context and KV pages just cover `kv_len`; graphs only for `batch_sizes`."""
    max_bs = max(batch_sizes)
    ctx = -(-context_positions(kv_len, steps) // page_size) * page_size
    return RuntimeConfig(
        speculative_num_steps=steps, page_size=page_size, max_running_requests=max_bs,
        max_context_len=ctx, max_num_batched_tokens=max_bs * (steps + 1),
        num_kv_pages=max_bs * ctx // page_size, cuda_graph_max_bs=max_bs,
        cuda_graph_bs=tuple(sorted(batch_sizes)), dtype=dtype, device=str(device),
        validate_inputs=False)


@dataclass
class DraftGroup:
    """The set-up shared by every bs of one `(page_size, kv_len)` group."""

    cfg: RuntimeConfig
    kv_len: int
    drafter: EagleDrafter
    pages: StaticPages
    inputs: InputBuffers
    states: RuntimeStates
    kv_pool: KVPool
    baseline: EagleDrafter | None = None
    """The torch.compile baseline (built by `measure_compiled` on first use)."""
    baseline_info: dict[str, Any] = field(default_factory=dict)
    """Building the baseline: `compile_group_s` (build, compile and capture of every bs),
    `compile_fx_graphs` / `compile_graph_breaks` (dynamo counters across it)."""
    baseline_error: str | None = None
    """Why building the baseline failed (every later case of the group reports it as is)."""
    graphs_stale: bool = False
    """Set once a reduce-overhead baseline exists: the drafter's graphs must not replay
    again (module doc). Never set by the compile+graph baseline."""
    reference: dict[int, torch.Tensor] = field(default_factory=dict)
    """Graph-replay `run` output per bs, to check the baseline's drafts against."""


def build_group(head: Eagle3DraftHead, page_size: int, kv_len: int, batch_sizes: Sequence[int], *,
                steps: int = STEPS, seed: int = 0, capture: bool = True,
                **config_changes: Any) -> DraftGroup:
    """Drafter over a random-filled KV pool and shuffled pages; graphs captured for `batch_sizes`
    (`config_changes`: RuntimeConfig fields to override)."""
    mc, device = head.config, next(head.parameters()).device
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    cfg = runtime_config(page_size, kv_len, batch_sizes, device=device, dtype=dtype[head.dtype],
                         steps=steps).replace(**config_changes)
    pages = StaticPages(cfg.max_running_requests, cfg.max_pages_per_req, page_size, device,
                        seed=seed)
    inputs, states = InputBuffers.allocate(cfg), RuntimeStates.allocate(cfg)
    kv = KVPool(1, cfg.total_kv_pages, page_size, mc.num_key_value_heads, mc.head_dim, head.dtype,
                device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for t in kv.k + kv.v:  # never time on zeros
        t.normal_(generator=gen)
    drafter = EagleDrafter(head, cfg, req_to_page=pages.req_to_page, input_buffers=inputs,
                           runtime_states=states, kv_pool=kv)
    if capture:
        drafter.capture_graphs()
    return DraftGroup(cfg, kv_len, drafter, pages, inputs, states, kv)


@dataclass
class DecodeBatch:
    """A decode batch written into the group's `InputBuffers`; `args` is what `run` takes."""

    ctx: ForwardContext
    hidden: torch.Tensor
    out_tokens: torch.Tensor
    accept: torch.Tensor

    @property
    def args(self) -> tuple[ForwardContext, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.ctx, self.hidden, self.out_tokens, self.accept


def fill_decode_batch(group: DraftGroup, bs: int, *, seed: int = 0) -> DecodeBatch:
    """`bs` decode rows (slots 1..bs) at KV length `kv_len`, N random tokens each, random
    target hidden states and accept lengths in 1..N."""
    cfg, mc = group.cfg, group.drafter.head.config
    n, dev = cfg.spec_num_tokens, cfg.device
    gen = torch.Generator().manual_seed(seed * 1000 + bs)
    rows = [BatchRow(slot, group.kv_len, torch.randint(mc.vocab_size, (n,), generator=gen).tolist(),
                     is_prefill=False) for slot in range(1, bs + 1)]
    ctx = write_batch(group.inputs, group.pages, rows)
    group.states.valid_cache_lengths[1: bs + 1] = group.kv_len
    out_tokens = torch.randint(mc.vocab_size, (bs * n,), generator=gen)
    hidden = torch.randn(bs * n, group.drafter.head.target_hidden_width, generator=gen)
    accept = torch.randint(1, n + 1, (bs,), generator=gen, dtype=torch.int32)
    return DecodeBatch(ctx, hidden.to(group.drafter.head.dtype).to(dev), out_tokens.to(dev),
                       accept.to(dev))


def activate(drafter: EagleDrafter) -> None:
    """Point the (shared) head's layers at this drafter's kernel backend.

    `EagleDrafter.run` does this itself; the harness also calls the drafters' forwards
    directly (`decode_graphs.run`, the compiled baseline's warm-up), which do not.
    """
    drafter.head.set_use_triton(drafter.cfg.use_triton)


# ---------------------------------------------------------------------------
# The torch.compile baseline
# ---------------------------------------------------------------------------
COMPILE_GRAPH = "compile+graph"
REDUCE_OVERHEAD = "reduce-overhead"
REDUCE_OVERHEAD_DYNAMIC = "reduce-overhead-dynamic"
COMPILE_ENV = "GRAPHDRAFT_PERF_COMPILE"


@dataclass(frozen=True)
class Baseline:
    """How the torch.compile baseline drafter is built (module docstring)."""

    mode: str
    """The label in the records and the report's column headers."""
    compiler: Compiler
    """Wraps each of the two forwards, `forward(bs) -> compiled forward(bs)`."""
    own_graphs: bool
    """True: capture the compiled forwards in `CapturedForward` graphs (compile+graph).
    False: call them through disabled `CapturedForward`s (reduce-overhead's cudagraph
    trees do the graphing)."""

    @property
    def stales_graphs(self) -> bool:
        """Whether building it invalidates the drafter's captured graphs (reduce-overhead)."""
        return not self.own_graphs


def _raise_recompile_limit(limit: int = 64) -> None:
    """Static shapes compile once per bs (and per graph-break resume function)."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), limit))


def inductor(fn: Forward) -> Forward:
    """`torch.compile(fn, dynamic=False, fullgraph=False)`: inductor kernels, default mode
    (no cudagraphs); `bs` is specialized, so each bs compiles on its first call."""
    _raise_recompile_limit()
    return torch.compile(fn, dynamic=False, fullgraph=False)


def reduce_overhead(fn: Forward, dynamic: bool | None = None) -> Forward:
    """`torch.compile(mode="reduce-overhead")`; each call starts a new cudagraph-trees step.

    `dynamic=None` (torch's default, automatic dynamic): the first bs compiles static,
    the second recompiles with a symbolic bs that every later bs reuses (cudagraph
    trees still record one graph per bs), so a group costs two compiles per forward.
    `dynamic=False`: one static compile per bs, the best case at several times the
    compile time.
    """
    _raise_recompile_limit()
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=False, dynamic=dynamic)

    def step(bs: int) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(bs)

    return step


BASELINES: dict[str, Baseline] = {
    COMPILE_GRAPH: Baseline(COMPILE_GRAPH, inductor, own_graphs=True),
    REDUCE_OVERHEAD: Baseline(REDUCE_OVERHEAD, functools.partial(reduce_overhead, dynamic=False),
                              own_graphs=False),
    REDUCE_OVERHEAD_DYNAMIC: Baseline(REDUCE_OVERHEAD_DYNAMIC, reduce_overhead, own_graphs=False),
}
_BASELINE_ALIASES = {"": COMPILE_GRAPH, "1": COMPILE_GRAPH, "graph": COMPILE_GRAPH,
                     "static": REDUCE_OVERHEAD, "dynamic": REDUCE_OVERHEAD_DYNAMIC}


def baseline_from_env(env: dict[str, str] | None = None) -> Baseline | None:
    """The baseline `GRAPHDRAFT_PERF_COMPILE` names: unset/"compile+graph" (default),
    "reduce-overhead", "reduce-overhead-dynamic", or "0" for none. ("static" and
    "dynamic", the reduce-overhead variants' old names, still work.) Anything else
    raises ValueError: a typo must not silently measure another baseline."""
    raw = (os.environ if env is None else env).get(COMPILE_ENV, "").strip().lower()
    if raw in ("0", "off", "none", "false", "no"):
        return None
    mode = _BASELINE_ALIASES.get(raw, raw)
    if mode not in BASELINES:
        raise ValueError(f"{COMPILE_ENV}={raw!r}: expected one of {sorted(BASELINES)} or '0'")
    return BASELINES[mode]


def mark_static(drafter: EagleDrafter) -> None:
    """Mark every persistent tensor the drafter reads or writes as a static address, so
    cudagraph trees neither copy it in per replay nor skip graphs that mutate it."""
    tensors = [getattr(drafter.bufs, f.name) for f in fields(drafter.bufs)]
    tensors += [getattr(drafter.inputs, f.name) for f in fields(drafter.inputs)]
    tensors += [drafter.states.valid_cache_lengths, drafter.req_to_page,
                *drafter.kv_pool.k, *drafter.kv_pool.v]
    for t in tensors:
        torch._dynamo.mark_static_address(t)


@contextlib.contextmanager
def preserved_inputs(inputs: InputBuffers) -> Iterator[None]:
    """Restore every `InputBuffers` tensor on exit (a capture resets them to neutral rows,
    and the group's buffers hold the batch being measured)."""
    saved = {f.name: getattr(inputs, f.name).clone() for f in fields(inputs)}
    try:
        yield
    finally:
        for name, t in saved.items():
            getattr(inputs, name).copy_(t)


def _dynamo_counts() -> tuple[int, int]:
    """(FX graphs compiled, graph breaks) so far, from dynamo's counters."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def build_baseline(group: DraftGroup, baseline: Baseline) -> EagleDrafter:
    """A torch-path drafter over the group's buffers whose two forwards are
    `baseline.compiler(...)` of its own `_decode` / `_multi_step`.

    compile+graph: both wrapped in enabled `CapturedForward`s over the drafter's schedule
    and a graph pool of its own, and captured here for every bs of the group (three
    warm-up calls per bs first: the compile, then steady calls), the group's input
    buffers restored afterwards. reduce-overhead: wrapped in disabled ones, every
    persistent buffer marked static. Fills `group.baseline_info`. Leaves the shared head
    on the group drafter's kernel backend.
    """
    d = group.drafter
    t0, (graphs0, breaks0) = time.perf_counter(), _dynamo_counts()
    cfg = group.cfg.replace(kernel_backend="torch", enforce_eager=not baseline.own_graphs)
    base = EagleDrafter(d.head, cfg, req_to_page=group.pages.req_to_page, input_buffers=group.inputs,
                        runtime_states=group.states, kv_pool=group.kv_pool)
    try:
        activate(base)  # compile (and capture) the torch path, not the group drafter's
        if not baseline.own_graphs:
            mark_static(base)
        forwards = {"decode_graphs": ("compiled_decode", base._decode, True),
                    "multi_step_graphs": ("compiled_multi_step", base._multi_step, base.S > 1)}
        for attr, (name, fn, enabled) in forwards.items():
            setattr(base, attr, CapturedForward(
                name, baseline.compiler(fn), base.schedule, pool=base.graph_pool,
                enabled=baseline.own_graphs and enabled, warmup_iters=3))
        if baseline.own_graphs:
            with preserved_inputs(group.inputs):
                base.capture_graphs()  # resets the inputs to neutral rows, warms up, captures
            sync(cfg.device)
    finally:
        activate(d)
    graphs1, breaks1 = _dynamo_counts()
    group.baseline_info = {"compile_group_s": time.perf_counter() - t0,
                           "compile_fx_graphs": graphs1 - graphs0,
                           "compile_graph_breaks": breaks1 - breaks0}
    return base


def _counter(group: str, key: str) -> int:
    from torch._dynamo.utils import counters
    return int(counters[group][key])


def _forward_counts(d: EagleDrafter) -> tuple[int, int]:
    """(graph replays, eager calls) of both forwards so far."""
    fs, ms = d.decode_graphs.stats, d.multi_step_graphs.stats
    return fs.total_replays + ms.total_replays, fs.total_eager + ms.total_eager


@torch.inference_mode()
def measure_compiled(group: DraftGroup, batch: DecodeBatch, baseline: Baseline, *,
                     warmup: int = 3, reps: int = 20) -> dict[str, Any]:
    """The baseline's times and set-up cost at this bs; `{"compile_error": ...}` instead when
    building, compiling, capturing or running it raises (a failed build is kept in
    `group.baseline_error` and returned for every later case of the group).

    Keys: `compile_{run,decode,multi,first}_us` medians; `compile_s`, the seconds to make this
    bs ready (compile+graph: this bs's warm-up calls, where it compiles, and capture of
    both forwards; reduce-overhead, or a bs left uncaptured: the first three `run`
    calls: compile, cudagraph-trees warm-up, record); `compile_case_fx_graphs`, FX
    graphs dynamo compiled during this case's calls; `compile_agreement`, the share of
    drafts equal to the graph drafter's. compile+graph also: `compile_graph_replayed`
    (every forward call of this case replayed a graph, per the `CapturedForward`
    stats), `compile_replays`, `compile_eager_forwards`, `compile_pool_bytes`,
    `compile_dropped` (sizes whose capture ran out of memory) and `group.baseline_info`.
    reduce-overhead also: `compile_cudagraph_skips`; it leaves the group's graphs stale
    (module docstring).
    """
    dev = group.cfg.device
    if group.baseline_error is not None:
        return {"compile_error": group.baseline_error}
    try:
        if group.baseline is None:
            group.graphs_stale = group.graphs_stale or baseline.stales_graphs
            try:
                group.baseline = build_baseline(group, baseline)
            except Exception as e:
                group.baseline_error = f"{type(e).__name__}: {e}"[:500]
                raise
        base = group.baseline
        activate(base)
        skips = _counter("inductor", "cudagraph_skips")
        counts, fx_graphs = _forward_counts(base), _dynamo_counts()[0]
        t0 = time.perf_counter()
        for _ in range(3):  # reduce-overhead: compile at this bs, cudagraph-trees warm-up, record
            out = base.run(*batch.args)
        sync(dev)
        first_calls_s = time.perf_counter() - t0
        res: dict[str, Any] = {"compile_s": first_calls_s}
        res.update(time_forwards("compile", base, batch, warmup=warmup, reps=reps))
        res["compile_case_fx_graphs"] = _dynamo_counts()[0] - fx_graphs
        if baseline.own_graphs:
            bs = batch.ctx.bs
            fs, ms = base.decode_graphs.stats, base.multi_step_graphs.stats
            replays, eager = (b - a for a, b in zip(counts, _forward_counts(base), strict=True))
            if bs in fs.capture_seconds:
                res["compile_s"] = fs.capture_seconds[bs] + ms.capture_seconds.get(bs, 0.0)
            res.update(compile_graph_replayed=eager == 0 and replays > 0,
                       compile_replays=replays, compile_eager_forwards=eager,
                       compile_pool_bytes=fs.total_pool_bytes + ms.total_pool_bytes,
                       compile_dropped=sorted(set(fs.dropped) | set(ms.dropped)),
                       **group.baseline_info)
        else:
            res["compile_cudagraph_skips"] = _counter("inductor", "cudagraph_skips") - skips
        reference = group.reference.get(batch.ctx.bs)
        if reference is not None:
            res["compile_agreement"] = float((out[:, 1:] == reference[:, 1:]).float().mean())
        return res
    except Exception as e:  # noqa: BLE001 - a failed baseline is a result, not a crash
        return {"compile_error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        activate(group.drafter)


# ---------------------------------------------------------------------------
# Work outside the graph replays (torch.profiler)
# ---------------------------------------------------------------------------
LAUNCHES_ENV = "GRAPHDRAFT_PERF_LAUNCHES"
CALL_MARK = "graphdraft_perf_call"
"""The `record_function` name around each profiled call."""
LAUNCH_APIS = ("cudaLaunch", "cuLaunch", "cudaMemcpy", "cuMemcpy", "cudaMemset", "cuMemset")
"""Host API calls that put one kernel, copy or memset on a stream (runtime and driver API:
Triton launches through `cuLaunchKernel[Ex]`)."""
GRAPH_LAUNCH_APIS = ("cudaGraphLaunch", "cuGraphLaunch")
GRAPH_LAUNCH_HOST = "graph launch (host)"
"""The timeline's name for a host graph-launch API call."""
_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def _api_event(e: dict[str, Any]) -> bool:
    cat = str(e.get("cat", "")).lower()
    return e.get("ph") == "X" and cat in ("cuda_runtime", "cuda_driver")


def count_launches(events: Sequence[dict[str, Any]], mark: str = CALL_MARK) -> list[dict[str, Any]]:
    """Per `record_function(mark)` span of a chrome trace (`traceEvents`), in time order, the
    CUDA work the host issued inside it:

    `launches`: host API calls in `LAUNCH_APIS` (kernel launches, memcpys, memsets) made
    outside graph launches; `graph_launches`: `cudaGraphLaunch` calls; `gpu_outside` /
    `gpu_inside`: GPU kernels, copies and memsets correlated with a non-graph / a graph
    launch (the profiler may miss GPU records, never host API records, so `launches` is
    the count to trust); `ops`: name -> count of the `gpu_outside` work;
    `refresh_gpu_us`: the call's GPU span minus its graph work's span; `timeline`:
    `[name, start, end]` us from the call's first GPU op, of the outside work, of the
    graph work (`"graph: <its first op>"`) and of the host's graph-launch API calls
    (`GRAPH_LAUNCH_HOST`, negative when the host ran ahead of the GPU).
    Raises ValueError when the trace has no span named `mark`.
    """
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                   if e.get("ph") == "X" and e.get("name") == mark
                   and not str(e.get("cat", "")).lower().startswith("gpu"))
    if not spans:
        raise ValueError(f"no {mark!r} spans in the profiler trace")
    calls: list[dict[str, Any]] = [{"launches": 0, "graph_launches": 0, "gpu_outside": 0,
                                    "gpu_inside": 0, "ops": Counter()} for _ in spans]
    bounds: list[dict[bool, list[float]]] = [{} for _ in spans]  # is graph -> [first start, last end]
    outside: list[list[list]] = [[] for _ in spans]
    graph_api: list[list[list]] = [[] for _ in spans]  # host graph-launch calls
    first_graph_op: list[tuple[float, str]] = [(float("inf"), "?") for _ in spans]

    def span_of(ts: float) -> int | None:
        for i, (lo, hi) in enumerate(spans):
            if lo <= ts <= hi:
                return i
        return None

    by_corr: dict[Any, tuple[int, bool]] = {}  # correlation id -> (span, is a graph launch)
    for e in events:
        if not _api_event(e):
            continue
        i = span_of(float(e.get("ts", -1.0)))
        name = str(e.get("name", ""))
        if i is None:
            continue
        graph = name.startswith(GRAPH_LAUNCH_APIS)
        if graph:
            calls[i]["graph_launches"] += 1
            t0 = float(e["ts"])
            graph_api[i].append([GRAPH_LAUNCH_HOST, t0, t0 + float(e.get("dur", 0.0))])
        elif name.startswith(LAUNCH_APIS):
            calls[i]["launches"] += 1
        else:
            continue
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            by_corr[corr] = (i, graph)
    for e in events:
        if e.get("ph") != "X" or str(e.get("cat", "")).lower() not in _GPU_CATS:
            continue
        hit = by_corr.get((e.get("args") or {}).get("correlation"))
        if hit is None:
            continue
        i, graph = hit
        t0 = float(e["ts"])
        t1 = t0 + float(e.get("dur", 0.0))
        b = bounds[i].setdefault(graph, [t0, t1])
        b[0], b[1] = min(b[0], t0), max(b[1], t1)
        if not graph:
            outside[i].append([str(e.get("name", "?"))[:60], t0, t1])
        if graph:
            calls[i]["gpu_inside"] += 1
            if t0 < first_graph_op[i][0]:
                first_graph_op[i] = (t0, str(e.get("name", "?"))[:40])
        else:
            calls[i]["gpu_outside"] += 1
            calls[i]["ops"][str(e.get("name", "?"))[:100]] += 1
    for c, b, out, api, first in zip(calls, bounds, outside, graph_api, first_graph_op,
                                     strict=True):
        c["ops"] = dict(sorted(c["ops"].items()))
        c["refresh_gpu_us"], c["timeline"] = None, []
        if b:
            lo = min(v[0] for v in b.values())
            ops = out + api + ([[f"graph: {first[1]}", *b[True]]] if True in b else [])
            c["timeline"] = [[n, round(t0 - lo, 2), round(t1 - lo, 2)] for n, t0, t1 in sorted(
                ops, key=lambda o: o[1])]
        if len(b) == 2:
            lo, hi = min(b[True][0], b[False][0]), max(b[True][1], b[False][1])
            c["refresh_gpu_us"] = (hi - lo) - (b[True][1] - b[True][0])
    return calls


def launches_enabled(env: dict[str, str] | None = None) -> bool:
    """`GRAPHDRAFT_PERF_LAUNCHES=0` skips the profiler pass of every case."""
    return (os.environ if env is None else env).get(LAUNCHES_ENV, "1").strip() != "0"


def trace_calls(fn: Callable[[], Any], *, calls: int = 5, device: str | torch.device = "cuda",
                host_ahead_cycles: int = 0) -> list[dict[str, Any]]:
    """Run `fn` once, then `calls` times under torch.profiler, each inside a
    `record_function(CALL_MARK)` span; returns `count_launches` of the trace (one dict per
    call). `host_ahead_cycles` > 0 (CUDA) first queues a sleep kernel of that many cycles, so
    that the host issues every call before the GPU runs them."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()
    sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=activities) as prof:
            if cuda and host_ahead_cycles:
                torch.cuda._sleep(host_ahead_cycles)
            for _ in range(calls):
                with record_function(CALL_MARK):
                    fn()
            sync(device)
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return count_launches(events)


def profile_launches(fn: Callable[[], Any], *, calls: int = 5,
                     device: str | torch.device = "cuda") -> dict[str, Any]:
    """Run `fn` (one draft call) `calls` times under torch.profiler and count the work it
    issues outside graph launches (`trace_calls`); report the last call's counts.

    Keys: `refresh_launches`, `graph_launches`, `refresh_gpu_ops`, `graph_gpu_ops`,
    `refresh_ops` (name -> count), `launch_counts_stable` (every profiled call issued the
    same host launches), `refresh_gpu_us` (median over the calls; None without GPU
    records), `refresh_timeline` (the last call's `timeline`). On a CPU device only host ops are traced and the counts are 0.
    """
    per_call = trace_calls(fn, calls=calls, device=device)
    last = per_call[-1]
    gaps = [c["refresh_gpu_us"] for c in per_call if c["refresh_gpu_us"] is not None]
    return {"refresh_launches": last["launches"], "graph_launches": last["graph_launches"],
            "refresh_gpu_ops": last["gpu_outside"], "graph_gpu_ops": last["gpu_inside"],
            "refresh_ops": last["ops"],
            "refresh_gpu_us": statistics.median(gaps) if gaps else None,
            "refresh_timeline": last["timeline"],
            "launch_counts_stable": len({(c["launches"], c["graph_launches"]) for c in per_call})
            == 1}


# ---------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------
def time_forwards(prefix: str, d: EagleDrafter, batch: DecodeBatch, **kw: Any) -> dict[str, float]:
    """Median us of `run` (whole draft call), of the decode forward (first step + multi-step,
    one replay) and of the multi-step forward alone, `{prefix}_{run,decode,multi}_us`, and
    `{prefix}_first_us` = decode - multi."""
    bs, args = batch.ctx.bs, batch.args
    fns = {"run": lambda: d.run(*args), "decode": lambda: d.decode_graphs.run(bs),
           "multi": lambda: d.multi_step_graphs.run(bs)}
    res = {f"{prefix}_{k}_us": median_us(fn, device=d.cfg.device, **kw) for k, fn in fns.items()}
    res[f"{prefix}_first_us"] = res[f"{prefix}_decode_us"] - res[f"{prefix}_multi_us"]
    return res


def time_refresh_us(d: EagleDrafter, args: tuple[Any, ...], *, warmup: int = 3,
                    reps: int = 20, **run_kw: Any) -> list[float]:
    """Per `d.run(*args, **run_kw)` call (decode batch, `reps` calls back to back after
    `warmup`): the call's GPU span minus the span of its decode forward, both from CUDA events
    recorded in the same call (around the call, and just before and after
    `decode_graphs.run`). What is left is the work between replays: the staging launch, the
    output copy and any gap the host leaves the GPU. CPU: the same with the host clock."""
    cuda = torch.device(d.cfg.device).type == "cuda"

    def mark() -> Any:
        if not cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def span_us(a: Any, b: Any) -> float:
        return a.elapsed_time(b) * 1e3 if cuda else (b - a) * 1e6

    inner: list[tuple[Any, Any]] = []
    forward = d.decode_graphs.run

    def timed_forward(bs: int, *a: Any, **k: Any) -> Any:
        start = mark()
        out = forward(bs, *a, **k)
        inner.append((start, mark()))
        return out

    d.decode_graphs.run = timed_forward  # an instance attribute: shadows the method
    try:
        for _ in range(warmup):
            d.run(*args, **run_kw)
        sync(d.cfg.device)
        inner.clear()
        outer = []
        for _ in range(reps):
            start = mark()
            d.run(*args, **run_kw)
            outer.append((start, mark()))
        sync(d.cfg.device)
    finally:
        del d.decode_graphs.run
    if len(inner) != reps:
        raise RuntimeError(f"expected one decode forward per draft call, got {len(inner)} in {reps}")
    return [span_us(*o) - span_us(*i) for o, i in zip(outer, inner, strict=True)]


def refresh_info(d: EagleDrafter, batch: DecodeBatch, *, warmup: int = 3, reps: int = 20,
                 profile: bool = True) -> dict[str, Any]:
    """The time the work outside the decode replay adds to a `d.run` call, two ways: as the
    API's default (`batch.args`: hidden states copied in, drafts copied out) and in place
    (`in_place_args` and `copy_output=False`: the target's hidden states already in the
    drafter's buffer, the drafts returned as its view, as the bundled Engine runs it).
    Keys: `refresh_events{,_in_place}_us` (`time_refresh_us` medians); on CUDA with
    `profile`, `profile_launches`'s keys for the default path and `refresh_gpu_in_place_us`,
    `refresh_launches_in_place`, `refresh_in_place_timeline` (measured after the event
    timings; `launches_error` when the profiler fails)."""
    in_place, no_copy = in_place_args(d, batch), {"copy_output": False}
    res: dict[str, Any] = {
        "refresh_events_us": statistics.median(time_refresh_us(d, batch.args, warmup=warmup,
                                                               reps=reps)),
        "refresh_events_in_place_us": statistics.median(time_refresh_us(
            d, in_place, warmup=warmup, reps=reps, **no_copy))}
    if profile and torch.device(d.cfg.device).type == "cuda":
        try:
            res.update(profile_launches(lambda: d.run(*batch.args), device=d.cfg.device))
            place = profile_launches(lambda: d.run(*in_place, **no_copy), device=d.cfg.device)
            res["refresh_gpu_in_place_us"] = place["refresh_gpu_us"]
            res["refresh_launches_in_place"] = place["refresh_launches"]
            res["refresh_in_place_timeline"] = place["refresh_timeline"]
        except Exception as e:  # noqa: BLE001 - a failed count is a result, not a crash
            res["launches_error"] = f"{type(e).__name__}: {e}"[:300]
    return res


def in_place_args(d: EagleDrafter, batch: DecodeBatch) -> tuple[Any, ...]:
    """`batch.args` with the hidden states written into `d.decode_hidden_buffer(bs)` and
    that view passed (a target writing there saves `run` the hidden copy)."""
    ctx, hidden, tokens, accept = batch.args
    view = d.decode_hidden_buffer(ctx.bs)
    view.copy_(hidden)
    return ctx, view, tokens, accept


def capture_info(d: EagleDrafter, bs: int) -> dict[str, float]:
    """Capture seconds and pool bytes of both graphs at `bs`, and of the whole group."""
    fs, ms = d.decode_graphs.stats, d.multi_step_graphs.stats
    return {"capture_s": fs.capture_seconds.get(bs, 0.0) + ms.capture_seconds.get(bs, 0.0),
            "pool_bytes": fs.pool_bytes.get(bs, 0) + ms.pool_bytes.get(bs, 0),
            "group_capture_s": fs.total_capture_seconds + ms.total_capture_seconds,
            "group_pool_bytes": fs.total_pool_bytes + ms.total_pool_bytes}


@torch.inference_mode()
def measure_case(group: DraftGroup, batch: DecodeBatch, *, warmup: int = 3, reps: int = 20,
                 eager_reps: int = 8, profile: bool = True) -> dict[str, Any]:
    """Eager and graph-replay times of one decode batch (before any reduce-overhead
    `measure_compiled`).

    Keys: `{eager,graph}_{run,decode,multi,first}_us` (`time_forwards`), `eager_equals_graph`
    (bit-identical `run` outputs), `graph_replayed`, capture stats, `in_place_equals_copy`
    (the same drafts with the hidden states already in the drafter's buffer,
    `in_place_args`, and the drafts returned as its view); the time the work outside the decode replay adds to a call, three
    ways: `refresh_diff_us` = `graph_run_us - graph_decode_us` (medians timed apart) and
    `refresh_info`'s CUDA events inside each call (host gaps and the two extra event
    records included) and, on CUDA with `profile`, GPU timeline of profiled calls with
    `profile_launches`'s counts of the work one `run` issues outside its graph launch
    (measured last, after every timing). Keeps the graph output in `group.reference[bs]`.
    """
    d, bs = group.drafter, batch.ctx.bs
    if group.graphs_stale:
        raise RuntimeError("graph replay after the torch.compile baseline ran in this group: "
                           "cudagraph trees freed the cuBLAS workspace the graphs use")
    activate(d)
    d.validate(*batch.args)  # once: the timed calls skip it (validate_inputs=False)
    res: dict[str, Any] = {}
    with forced_eager():
        res.update(time_forwards("eager", d, batch, warmup=1, reps=eager_reps))
        eager_out = d.run(*batch.args)
    replays = d.decode_graphs.stats.total_replays
    res.update(time_forwards("graph", d, batch, warmup=warmup, reps=reps))
    graph_out = d.run(*batch.args)
    res["graph_replayed"] = d.decode_graphs.stats.total_replays > replays
    res["eager_equals_graph"] = bool(torch.equal(eager_out, graph_out))
    res["in_place_equals_copy"] = bool(torch.equal(
        d.run(*in_place_args(d, batch), copy_output=False), graph_out))
    res["refresh_diff_us"] = res["graph_run_us"] - res["graph_decode_us"]
    res.update(capture_info(d, bs))
    group.reference[bs] = graph_out
    res.update(refresh_info(d, batch, warmup=warmup, reps=reps, profile=profile))
    return res


class GroupCache:
    """Keeps one `DraftGroup` alive; asking for another frees the current one first."""

    def __init__(self, head: Eagle3DraftHead, cases: Sequence[Case], *, capture: bool = True) -> None:
        self.head, self.cases, self.capture = head, list(cases), capture
        self.key: tuple[int, int] | None = None
        self.group: DraftGroup | None = None
        self.build_seconds: dict[tuple[int, int], float] = {}

    def get(self, page_size: int, kv_len: int) -> DraftGroup:
        key = (page_size, kv_len)
        if self.key != key:
            self.close()
            t0 = time.perf_counter()
            sizes = group_batch_sizes(self.cases, key)
            self.group = build_group(self.head, page_size, kv_len, sizes, capture=self.capture)
            self.build_seconds[key] = time.perf_counter() - t0
            self.key = key
        assert self.group is not None
        return self.group

    def close(self) -> None:
        """Drop the live group (drafters, graphs, compiled baseline) and return its memory."""
        if self.group is None:
            return
        device = self.group.cfg.device
        self.group, self.key = None, None
        torch._dynamo.reset()  # compiled baseline code and its cudagraph trees
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
