"""Pure helpers of the perf suite: cases, drafter set-up, decode batches, timing, HBM floor.

Nothing here needs a GPU: on a CPU device the same code paths run (graphs are
off there and times come from the host clock), which `tests/test_perf_smoke.py`
uses to check the harness without one.

A *group* is one `(page_size, kv_len)` set-up: a drafter whose graphs are
captured once for every bs the group's cases need, its own shuffled page table,
KV pool (filled with random values) and input buffers, and, built on first use,
the torch.compile baseline drafter over the same buffers.

Order inside a group: every graph measurement first, then the compiled baseline.
Cudagraph trees (torch.compile's reduce-overhead mode) clear PyTorch's cached
cuBLAS workspaces before they warm up or record; the drafter's captured graphs
baked in the workspace cuBLAS held at capture, so replaying them after a
compiled run reads and writes freed memory (seen on an H200: an illegal memory
access on the next replay). `DraftGroup.graphs_stale` enforces the order.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
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
    graphs_stale: bool = False
    """Set once the baseline exists: the drafter's graphs must not replay again (module doc)."""
    reference: dict[int, torch.Tensor] = field(default_factory=dict)
    """Graph-replay `run` output per bs, to check the baseline's drafts against."""


def build_group(head: Eagle3DraftHead, page_size: int, kv_len: int, batch_sizes: Sequence[int], *,
                steps: int = STEPS, seed: int = 0, capture: bool = True) -> DraftGroup:
    """Drafter over a random-filled KV pool and shuffled pages; graphs captured for `batch_sizes`."""
    mc, device = head.config, next(head.parameters()).device
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    cfg = runtime_config(page_size, kv_len, batch_sizes, device=device, dtype=dtype[head.dtype],
                         steps=steps)
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

    `EagleDrafter.__init__` sets the head's backend flag, so a second drafter over
    the same head (the torch-path baseline) flips it for the first one's eager runs.
    """
    drafter.head.set_use_triton(drafter.cfg.use_triton)


# ---------------------------------------------------------------------------
# The torch.compile baseline
# ---------------------------------------------------------------------------
def reduce_overhead(fn: Forward, dynamic: bool | None = None) -> Forward:
    """`torch.compile(mode="reduce-overhead")`; each call starts a new cudagraph-trees step.

    `dynamic=None` (torch's default, automatic dynamic): the first bs compiles static,
    the second recompiles with a symbolic bs that every later bs reuses (cudagraph
    trees still record one graph per bs), so a group costs two compiles per forward.
    `dynamic=False`: one static compile per bs, the best case at several times the
    compile time.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=False, dynamic=dynamic)

    def step(bs: int) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(bs)

    return step


def compiler_from_env(env: dict[str, str] | None = None) -> tuple[Compiler | None, str]:
    """The baseline compiler and its label, from `GRAPHDRAFT_PERF_COMPILE`: "0" none,
    "dynamic" automatic dynamic (fewer compiles), anything else (default) static shapes."""
    mode = (os.environ if env is None else env).get("GRAPHDRAFT_PERF_COMPILE", "static").strip()
    if mode == "0":
        return None, "off"
    if mode == "dynamic":
        return reduce_overhead, "dynamic"
    return functools.partial(reduce_overhead, dynamic=False), "static"


def mark_static(drafter: EagleDrafter) -> None:
    """Mark every persistent tensor the drafter reads or writes as a static address, so
    cudagraph trees neither copy it in per replay nor skip graphs that mutate it."""
    tensors = [getattr(drafter.bufs, f.name) for f in fields(drafter.bufs)]
    tensors += [getattr(drafter.inputs, f.name) for f in fields(drafter.inputs)]
    tensors += [drafter.states.valid_cache_lengths, drafter.req_to_page,
                *drafter.kv_pool.k, *drafter.kv_pool.v]
    for t in tensors:
        torch._dynamo.mark_static_address(t)


def build_baseline(group: DraftGroup, compiler: Compiler) -> EagleDrafter:
    """A torch-path, eager-only drafter over the group's buffers whose two forwards are
    `compiler(...)` of its own `_first_step_decode` / `_multi_step`."""
    d = group.drafter
    cfg = group.cfg.replace(kernel_backend="torch", enforce_eager=True)
    base = EagleDrafter(d.head, cfg, req_to_page=group.pages.req_to_page, input_buffers=group.inputs,
                        runtime_states=group.states, kv_pool=group.kv_pool)
    activate(d)
    mark_static(base)
    base.first_step_graphs = CapturedForward("compiled_first_step", compiler(base._first_step_decode),
                                             base.schedule, enabled=False)
    base.multi_step_graphs = CapturedForward("compiled_multi_step", compiler(base._multi_step),
                                             base.schedule, enabled=False)
    return base


def _counter(group: str, key: str) -> int:
    from torch._dynamo.utils import counters
    return int(counters[group][key])


@torch.inference_mode()
def measure_compiled(group: DraftGroup, batch: DecodeBatch, compiler: Compiler, *,
                     warmup: int = 3, reps: int = 20) -> dict[str, Any]:
    """The baseline's `compile_{run,first,multi}_us` medians, `compile_s` (first three calls
    at this bs: compile, warm-up, record), cudagraph skips and agreement with the graph
    drafts; `{"compile_error": ...}` instead when building, compiling or running it raises.
    After this the group's graphs are stale (module docstring)."""
    dev = group.cfg.device
    try:
        if group.baseline is None:
            group.graphs_stale = True
            group.baseline = build_baseline(group, compiler)
        base = group.baseline
        activate(base)
        skips = _counter("inductor", "cudagraph_skips")
        t0 = time.perf_counter()
        for _ in range(3):  # compile at this bs, cudagraph-trees warm-up, record
            out = base.run(*batch.args)
        sync(dev)
        res: dict[str, Any] = {"compile_s": time.perf_counter() - t0}
        res.update(_time_forwards("compile", base, batch, warmup=warmup, reps=reps))
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
# One case
# ---------------------------------------------------------------------------
def _time_forwards(prefix: str, d: EagleDrafter, batch: DecodeBatch, **kw: Any) -> dict[str, float]:
    """Median us of `run` (whole draft call) and of each forward alone, `{prefix}_{name}_us`."""
    bs, args = batch.ctx.bs, batch.args
    fns = {"run": lambda: d.run(*args), "first": lambda: d.first_step_graphs.run(bs),
           "multi": lambda: d.multi_step_graphs.run(bs)}
    return {f"{prefix}_{k}_us": median_us(fn, device=d.cfg.device, **kw) for k, fn in fns.items()}


def capture_info(d: EagleDrafter, bs: int) -> dict[str, float]:
    """Capture seconds and pool bytes of both graphs at `bs`, and of the whole group."""
    fs, ms = d.first_step_graphs.stats, d.multi_step_graphs.stats
    return {"capture_s": fs.capture_seconds.get(bs, 0.0) + ms.capture_seconds.get(bs, 0.0),
            "pool_bytes": fs.pool_bytes.get(bs, 0) + ms.pool_bytes.get(bs, 0),
            "group_capture_s": fs.total_capture_seconds + ms.total_capture_seconds,
            "group_pool_bytes": fs.total_pool_bytes + ms.total_pool_bytes}


@torch.inference_mode()
def measure_case(group: DraftGroup, batch: DecodeBatch, *, warmup: int = 3, reps: int = 20,
                 eager_reps: int = 8) -> dict[str, Any]:
    """Eager and graph-replay times of one decode batch (before any `measure_compiled`).

    Keys: `{eager,graph}_{run,first,multi}_us` medians, `eager_equals_graph`
    (bit-identical `run` outputs), `graph_replayed`, capture stats. Keeps the graph
    output in `group.reference[bs]`.
    """
    d, bs = group.drafter, batch.ctx.bs
    if group.graphs_stale:
        raise RuntimeError("graph replay after the torch.compile baseline ran in this group: "
                           "cudagraph trees freed the cuBLAS workspace the graphs use")
    activate(d)
    d.validate(*batch.args)  # once: the timed calls skip it (validate_inputs=False)
    res: dict[str, Any] = {}
    with forced_eager():
        res.update(_time_forwards("eager", d, batch, warmup=1, reps=eager_reps))
        eager_out = d.run(*batch.args)
    replays = d.first_step_graphs.stats.total_replays + d.multi_step_graphs.stats.total_replays
    res.update(_time_forwards("graph", d, batch, warmup=warmup, reps=reps))
    graph_out = d.run(*batch.args)
    res["graph_replayed"] = (d.first_step_graphs.stats.total_replays
                             + d.multi_step_graphs.stats.total_replays) > replays
    res["eager_equals_graph"] = bool(torch.equal(eager_out, graph_out))
    res.update(capture_info(d, bs))
    group.reference[bs] = graph_out
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
