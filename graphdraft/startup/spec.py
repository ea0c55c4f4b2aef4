"""What a worker needs to rebuild an engine: its shapes (`WorkerSpec`), the engine factory, and
the default worker count.

A Triton kernel is compiled per specialization key (constexprs, launch options, argument
dtypes, value / alignment specialization: `kernels.keys.specialization_key`), never per layer
or weight value. The precompile plan therefore runs a throw-away engine of the SAME shapes
(`WorkerSpec`: the target's and head's `ModelConfig`, dtype, `RuntimeConfig` with its
`KernelConfig` and the engine's KV page count, the draft vocab's size) with random weights and
only as many target layers as the code paths need (`reduced_target_config`: layer 0 runs
without a residual input, every later layer with one; 2 layers, the EAGLE-3 aux ids mapped
onto them). Start-up never imports the serving layer: the engine is built by a factory named
in the spec ("module:function", `factory(target, runtime, head)`; by default the engine's own
class, `engine_factory`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass

import torch

from capture import cache_dir
from graphdraft.config import (
    PRECOMPILE_WORKERS_CAP,
    PRECOMPILE_WORKERS_ENV,
    ModelConfig,
    RuntimeConfig,
    resolve_dtype,
)
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.layers import init_random_
from graphdraft.models.llama import LlamaForCausalLM
from graphdraft.models.random_models import random_model_pair
from graphdraft.runtime.drafter import EagleDrafter
from graphdraft.runtime.ngram_drafter import NgramDrafter

__all__ = ["PLAN_OVERHEAD_BYTES", "WORKER_CONTEXT_BYTES", "WorkerSpec", "build_engine",
           "default_workers", "engine_factory", "engine_spec", "memory_cap", "plan_bytes",
           "reduced_target_config", "resolve_factory"]


@dataclass(frozen=True)
class WorkerSpec:
    """What the plan's throw-away engine needs to launch the main engine's kernels."""

    target: ModelConfig
    """The target's shape with the fewest layers (`reduced_target_config`)."""
    head: ModelConfig | None
    hot_tokens: int | None
    """Length of the head's draft->target id map (`hot_token_ids`), None without one."""
    runtime: RuntimeConfig
    """The engine's config (its `num_kv_pages` fixed: the KV pool keeps the engine's shape)."""
    dtype: str
    device: str
    cache_dir: str
    factory: str
    """The engine factory, "module:function" (`resolve_factory`): called as
    `factory(target, runtime, head)` with the random-weight models (head None without a
    drafter), it returns the engine (`engine_spec`'s default: the engine's own class)."""


def default_workers(cfg: RuntimeConfig) -> int:
    """`cfg.precompile_workers`, or for None: `config.PRECOMPILE_WORKERS_DEFAULT` (the env
    var's int >= 0, anything else a ValueError naming it; else min(`PRECOMPILE_WORKERS_CAP`,
    CPU count) on CUDA: the main process only waits meanwhile; 0 on a CPU or under data
    parallelism)."""
    n = getattr(cfg, "precompile_workers", None)
    if n is not None:
        return n
    if not str(cfg.device).startswith("cuda") or cfg.dp_size > 1:
        return 0
    env = os.environ.get(PRECOMPILE_WORKERS_ENV, "").strip()
    if env:
        if not env.isdigit():
            raise ValueError(f"{PRECOMPILE_WORKERS_ENV}: expected an int >= 0, got {env!r}")
        return int(env)
    return min(PRECOMPILE_WORKERS_CAP, os.cpu_count() or 1)


def reduced_target_config(mc: ModelConfig) -> ModelConfig:
    """`mc` with 2 layers (or fewer if it has fewer): layer 0 (no residual input) and one later
    layer (with one) launch every kernel variant the full stack does. The EAGLE-3 aux ids map
    onto them (id 0 stays 0, every other id becomes 1), so the aux width `k * H` is unchanged."""
    n = min(mc.num_hidden_layers, 2)
    ids = tuple(min(i, n - 1) for i in mc.aux_layer_ids())
    return dataclasses.replace(mc, num_hidden_layers=n, aux_hidden_state_layer_ids=ids)


def engine_factory(engine) -> str:
    """The default engine factory of `engine`: its class as "module:QualName" (called as
    `cls(target, runtime, head)`)."""
    cls = type(engine)
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_factory(name: str):
    """The callable "module:function" names (a dotted qualified name after the colon);
    ValueError naming the factory when it is not of that form or not importable."""
    module, sep, qual = name.partition(":")
    if not sep or not module or not qual:
        raise ValueError(f"factory: expected 'module:function', got {name!r}")
    try:
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"factory: cannot import {name!r} ({type(e).__name__}: {e})") from e
    if not callable(obj):
        raise ValueError(f"factory: expected a callable at {name!r}, got {type(obj).__name__}")
    return obj


def engine_spec(engine, factory: str | None = None) -> tuple[WorkerSpec | None, str]:
    """The worker spec of `engine` (no tasks yet), or None and the reason when a worker cannot
    rebuild it: a caller's drafter (the n-gram drafter of `speculative_algorithm="ngram"` is
    rebuilt from the config), tensor or data parallelism, a model that is not the
    built-in Llama target / EAGLE-3 head. `factory`: the engine factory ("module:function";
    None: `engine_factory(engine)`)."""
    target = getattr(engine, "target", None)
    if type(target) is not LlamaForCausalLM or target.tp is not None or target.dp is not None:
        return None, "the target is not a plain LlamaForCausalLM (tensor / data parallel?)"
    if getattr(engine, "dp", None) is not None:
        return None, "data parallelism"
    drafter = getattr(engine, "drafter", None)
    head = None
    if type(drafter) is NgramDrafter and engine.cfg.speculative_algorithm == "ngram":
        drafter = None  # the factory's engine builds it from the runtime config
    if drafter is not None:
        if type(drafter) is not EagleDrafter:
            return None, f"a caller's drafter ({type(drafter).__name__})"
        head = drafter.head
        if type(head) is not Eagle3DraftHead or head.tp is not None or head.dp is not None:
            return None, "the draft head is not a plain Eagle3DraftHead"
    cfg = engine.cfg
    hot = getattr(head, "hot_token_ids", None) if head is not None else None
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    spec = WorkerSpec(target=reduced_target_config(target.config),
                      head=head.config if head is not None else None,
                      hot_tokens=int(hot.shape[0]) if hot is not None else None,
                      runtime=cfg, dtype=cfg.dtype, device=str(device),
                      cache_dir=str(cache_dir()),
                      factory=factory if factory is not None else engine_factory(engine))
    return spec, ""


def _param_bytes(module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def plan_bytes(engine, spec: WorkerSpec) -> int:
    """Device memory the plan's throw-away engine takes (`spec`'s reduced target: the full
    target's bytes less the dropped layers; the head without the shared embedding; the KV
    pools at the reduced layer count; `PLAN_OVERHEAD_BYTES`)."""
    target = engine.target
    layers = len(target.layers)
    per_layer = _param_bytes(target.layers[0]) if layers else 0
    total = _param_bytes(target) - (layers - spec.target.num_hidden_layers) * per_layer
    drafter = getattr(engine, "drafter", None)
    if type(drafter) is NgramDrafter:
        total += drafter.history.nbytes
    elif drafter is not None:
        shared = {target.embed_tokens.data_ptr()}
        total += sum(t.numel() * t.element_size() for t in drafter.head.parameters()
                     if t.data_ptr() not in shared)
        total += drafter.kv_pool.nbytes()
    total += engine.kv.nbytes() * spec.target.num_hidden_layers // max(layers, 1)
    return total + PLAN_OVERHEAD_BYTES


WORKER_CONTEXT_BYTES = 1 << 30
"""A worker's device memory: its CUDA context and the modules it loads (a generous bound)."""

PLAN_OVERHEAD_BYTES = 3 << 30
"""The plan's throw-away engine beyond its weights and KV pools: activations, the allocator's
slack, cuBLAS workspaces (a generous bound)."""


def memory_cap(engine, spec: WorkerSpec, workers: int) -> int:
    """`workers`, at most as many as the free device memory holds once the plan's
    throw-away engine (`plan_bytes`) and 4 GiB for this process's capture are set aside
    (`WORKER_CONTEXT_BYTES` each); 0 when the throw-away engine does not fit. Unchanged
    without CUDA."""
    if not torch.cuda.is_available() or not spec.device.startswith("cuda"):
        return workers
    free, _ = torch.cuda.mem_get_info(torch.device(spec.device))
    left = free - (4 << 30) - plan_bytes(engine, spec)
    return min(workers, max(0, int(left // WORKER_CONTEXT_BYTES)))


def build_engine(spec: WorkerSpec):
    """The plan's throw-away engine: random weights of the spec's shapes on its device (the
    caller picks the current device), handed to the spec's engine factory."""
    factory = resolve_factory(spec.factory)
    dtype = resolve_dtype(spec.dtype)
    device = torch.device(spec.device)
    if spec.head is None:
        with device:
            target = LlamaForCausalLM(spec.target, dtype)
            init_random_(target, 0, std=0.02)
        target.to(device)
        return factory(target, spec.runtime, None)
    hot = None
    if spec.hot_tokens is not None:
        hot = torch.randperm(spec.target.vocab_size,
                             generator=torch.Generator().manual_seed(0))[: spec.hot_tokens]
    target, head = random_model_pair(spec.target, spec.head, dtype, 0, std=0.02,
                                     hot_token_ids=hot, device=device)
    return factory(target, spec.runtime, head)
