"""Tensor parallelism: one process per device, weights sliced at load, collectives in the forward.

A `TensorParallel` names one tensor-parallel group: this process's `rank`, the group's
`world_size` and its `torch.distributed` process group. `None` (or `world_size == 1`)
means no communication: `shard_` leaves the model alone, every layer keeps `tp = None`
and the forward is exactly the single-device code path (no collective call, no extra
tensor; the only cost is one `is None` test per layer).

What is split (Megatron-style; checkpoints stay in HF layout, `shard_` slices full weights):

  qkv_proj      column-parallel, per head group: rows [q heads of this rank; its k heads;
                its v heads] (Hq/tp query heads, Hkv/tp KV heads: GQA groups stay whole)
  o_proj        row-parallel: columns of this rank's query heads, then all-reduce
  gate_up_proj  column-parallel: rows [gate slice; up slice] (F/tp each)
  down_proj     row-parallel: columns F/tp, then all-reduce
  embed_tokens  vocab-parallel: rows [r*Vp, (r+1)*Vp), Vp = ceil(V/tp), zero rows pad the
                last shard; lookup = masked local lookup + all-reduce
  lm_head       vocab-parallel (same rows; tied embeddings stay tied); logits shards are
                all-gathered and the padding cut off, so every rank holds the full
                `[B, V]` logits (argmax / sampling over the gathered logits: simple)
  RMSNorm, fc, RoPE table, hot_token_ids: replicated

After `shard_`, `model.config` is the rank-local shape (num_attention_heads,
num_key_value_heads and intermediate_size divided by tp; hidden_size and vocab_size stay
global, since the model's inputs and outputs are over the full vocab and hidden size), so
everything that sizes per-rank state from the config (the engine's and the drafter's
`KVPool(..., config.num_key_value_heads, ...)`) gets the local head count without knowing
about tensor parallelism. `model.global_config` is the checkpoint's config; `model.tp`
the group.

Every activation between layers is replicated: the residual stream after each
row-parallel all-reduce, hence the EAGLE-3 aux hidden states, the logits after the
all-gather, and the tokens chosen from them are identical on every rank (an all-reduce
hands every rank the same bits). Everything the engine and the drafter decide (graph or
eager, padded batch size, multi-step skip) depends only on the batch and the config, so
ranks fed the same requests stay in lock-step and issue the same collectives in the same
order. Sampled (non-greedy) requests need the same seed on every rank (an explicit
`SamplingParams.seed`, or the same global `torch.manual_seed`), else ranks sample
different tokens and their batches diverge.

Collectives are plain `torch.distributed` calls issued on the current stream
(`dist.all_reduce`, `dist.all_gather_single`, `async_op=False`): with NCCL these can
be captured into a CUDA graph (the communicator must exist before capture: run one
collective first, `TensorParallel.warmup`), with gloo they run eagerly on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_rank(rank: object, world_size: object) -> None:
    """ValueError naming `world_size` / `rank` unless 0 <= rank < world_size (ints)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group.

    group: the process group (None: the default group, or no communication when
    world_size == 1).
    """

    rank: int
    world_size: int
    group: Any = None

    def __post_init__(self) -> None:
        check_rank(self.rank, self.world_size)

    @classmethod
    def from_group(cls, group: Any = None) -> TensorParallel:
        """The group `group` (default: the default process group) as seen by this process."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    # ------------------------------------------------------------------
    # Split sizes
    # ------------------------------------------------------------------
    def split(self, total: int, name: str) -> int:
        """`total / world_size`; ValueError naming `name` when it does not divide."""
        if total % self.world_size:
            raise ValueError(f"{name}: expected a multiple of the tensor-parallel size "
                             f"(tp.world_size = {self.world_size}), got {total}")
        return total // self.world_size

    def vocab_shard(self, vocab: int) -> tuple[int, int, int]:
        """(start, stop, rows) of this rank's vocab range: rows = ceil(vocab / tp) per rank;
        ids [start, stop) are real, the remaining `rows - (stop - start)` rows are padding."""
        rows = -(-vocab // self.world_size)
        start = min(self.rank * rows, vocab)
        return start, min(start + rows, vocab), rows

    # ------------------------------------------------------------------
    # Collectives (only ever called with world_size > 1)
    # ------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns `x` (row-parallel outputs).

        `dist.all_reduce` on the current stream, synchronous from the stream's point of
        view: capturable into a CUDA graph with NCCL.
        """
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """Vocab-parallel logits `[B, Vp]` (this rank's rows of the LM head) -> `[B, vocab]`
        on every rank (all-gather, then the padding columns are dropped)."""
        b, vp = local.shape
        out = torch.empty((self.world_size * b, vp), dtype=local.dtype, device=local.device)
        _all_gather_single(out, local.contiguous(), group=self.group)  # rank-major rows
        full = out.view(self.world_size, b, vp).permute(1, 0, 2).reshape(b, self.world_size * vp)
        return full if full.shape[1] == vocab else full[:, :vocab].contiguous()

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding lookup: ids `[T]` (global), weight this rank's `[Vp, H]`
        rows -> `[T, H]` on every rank. Ids outside this rank's range contribute zeros;
        the all-reduce adds the one rank that holds each id (exact: x + 0 == x)."""
        rows = weight.shape[0]
        local = ids - self.rank * rows
        inside = (local >= 0) & (local < rows)
        out = weight[local.clamp(0, rows - 1)]
        out.masked_fill_(~inside.unsqueeze(-1), 0)
        return self.all_reduce(out)

    def warmup(self, device: str | torch.device = "cpu") -> None:
        """One small all-reduce: creates the communicator (NCCL does it lazily at the first
        collective, which must not happen inside a CUDA-graph capture)."""
        if self.is_parallel:
            self.all_reduce(torch.zeros(1, device=device))


def active(tp: TensorParallel | None) -> TensorParallel | None:
    """`tp` when it communicates (world_size > 1), else None."""
    return tp if tp is not None and tp.is_parallel else None


def init_tensor_parallel(backend: str | None = None, device: str | None = None,
                         timeout_s: float | None = None) -> tuple[TensorParallel, str]:
    """Join the default process group set up by `torchrun` (env RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT) -> (tp over the whole world, this rank's device).

    device: "cuda" (default when CUDA is available: `cuda:LOCAL_RANK`, made current) or
    "cpu"; backend: "nccl" on CUDA, "gloo" on CPU (default). Without torchrun's
    environment (a plain `python` run) returns a single-rank `TensorParallel`.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda") and ":" not in device:
        device = f"cuda:{local_rank}"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if "WORLD_SIZE" not in os.environ:
        return TensorParallel(0, 1), device
    if not dist.is_initialized():
        kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        if backend is None:
            backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, **kw)
    tp = TensorParallel.from_group()
    tp.warmup(device)
    return tp, device


# ---------------------------------------------------------------------------
# Sharding: full HF-layout weights -> this rank's slices
# ---------------------------------------------------------------------------
def _new(t: torch.Tensor) -> nn.Parameter:
    """A parameter owning a copy of `t` (a slice must not keep the full tensor alive)."""
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)


def shard_rows(w: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Rows `[start, stop)` of each range, concatenated in order."""
    return torch.cat([w[a:b] for a, b in ranges], dim=0)


def vocab_rows(w: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's vocab rows of a `[V, H]` table, zero-padded to ceil(V / tp) rows."""
    start, stop, rows = tp.vocab_shard(w.shape[0])
    out = torch.zeros((rows, *w.shape[1:]), dtype=w.dtype, device=w.device)
    out[: stop - start] = w[start:stop]
    return out


def shared_shard(memo: dict, full: nn.Parameter, make) -> nn.Parameter:
    """`make(full)` as a new parameter, once per full parameter: modules that shared `full`
    (tied embeddings, a head using the target's embedding) share the shard."""
    key = id(full)
    if key not in memo:
        memo[key] = (full, _new(make(full.data)))  # `full` stays referenced: ids stay unique
    return memo[key][1]


def shard_(model: nn.Module, tp: TensorParallel | None, *, memo: dict | None = None) -> nn.Module:
    """Replace `model`'s parameters by this rank's slices, in place; returns `model`.

    `model`: a `LlamaForCausalLM` or an `Eagle3DraftHead` holding full (HF-layout) weights.
    With `tp` None or world_size 1 nothing changes (not even `model.tp`). Raises ValueError
    naming the config field (num_attention_heads, num_key_value_heads, intermediate_size)
    that tp does not divide, before anything is changed. Pass the same `memo` dict when
    sharding modules that share a parameter (an EAGLE-3 head sharded too, sharing the
    target's embedding) so they keep sharing one slice; drop it afterwards (it holds the
    full tensors). Load full weights on the CPU, shard, then move to the device: only the
    shard ever reaches the GPU.
    """
    tp = active(tp)
    if tp is None:
        return model
    if getattr(model, "tp", None) is not None:
        raise ValueError("model: already sharded")
    if getattr(model, "dp", None) is not None:
        raise ValueError("model: data-parallel (shard_dense_); tp and dp together are not supported")
    shard = getattr(model, "shard_", None)
    if shard is None:
        raise ValueError(f"model: expected a LlamaForCausalLM or Eagle3DraftHead, got "
                         f"{type(model).__name__}")
    shard(tp, {} if memo is None else memo)
    return model


def local_config(cfg, tp: TensorParallel):
    """The rank-local shape of `cfg` (ValueError naming the field tp does not divide)."""
    hq = tp.split(cfg.num_attention_heads, "num_attention_heads")
    hkv = tp.split(cfg.num_key_value_heads, "num_key_value_heads")
    f = tp.split(cfg.intermediate_size, "intermediate_size")
    return cfg.replace(num_attention_heads=hq, num_key_value_heads=hkv, intermediate_size=f,
                       head_dim=cfg.head_dim)


def shard_attention_(attn: nn.Module, tp: TensorParallel) -> None:
    """Column-parallel qkv (per head group), row-parallel o_proj."""
    d, r = attn.head_dim, tp.rank
    hq, hkv = attn.num_heads // tp.world_size, attn.num_kv_heads // tp.world_size
    q_size, kv_size = attn.num_heads * d, attn.num_kv_heads * d
    qkv = attn.qkv_proj.data
    ranges = [(r * hq * d, (r + 1) * hq * d),
              (q_size + r * hkv * d, q_size + (r + 1) * hkv * d),
              (q_size + kv_size + r * hkv * d, q_size + kv_size + (r + 1) * hkv * d)]
    attn.qkv_proj = _new(shard_rows(qkv, ranges))
    attn.o_proj = _new(attn.o_proj.data[:, r * hq * d:(r + 1) * hq * d])
    attn.num_heads, attn.num_kv_heads = hq, hkv
    attn.q_size, attn.kv_size = hq * d, hkv * d
    attn.tp = tp


def shard_mlp_(mlp: nn.Module, tp: TensorParallel) -> None:
    """Column-parallel gate_up ([gate slice; up slice]), row-parallel down."""
    f_full, r = mlp.intermediate_size, tp.rank
    f = f_full // tp.world_size
    gu = mlp.gate_up_proj.data
    mlp.gate_up_proj = _new(shard_rows(gu, [(r * f, (r + 1) * f),
                                            (f_full + r * f, f_full + (r + 1) * f)]))
    mlp.down_proj = _new(mlp.down_proj.data[:, r * f:(r + 1) * f])
    mlp.intermediate_size = f
    mlp.tp = tp
