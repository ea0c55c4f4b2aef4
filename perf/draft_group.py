"""A draft benchmark group: one drafter per (page size, KV length) over shuffled pages and a
random-filled KV pool, its graphs captured for the group's batch sizes, and decode batches
written into its buffers."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphdraft.config import RuntimeConfig
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.runtime.batch import BatchRow, ForwardContext, write_batch
from graphdraft.runtime.buffers import InputBuffers, RuntimeStates
from graphdraft.runtime.drafter import EagleDrafter
from graphdraft.runtime.kv_cache import KVPool
from perf.cases import STEPS, Case, group_batch_sizes


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
    head.set_kernels(cfg.kernels)  # the settings (backend, tiles, PDL) this group runs under
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
    """Point the (shared) head's layers at this drafter's kernel settings (`cfg.kernels`).

    `EagleDrafter.run` switches the backend itself; the harness also calls the drafters'
    forwards directly (`decode_graphs.run`, the compiled baseline's warm-up), which do not.
    """
    drafter.head.set_kernels(drafter.cfg.kernels)



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
