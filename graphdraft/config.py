"""Configuration: one runtime dataclass and the model-shape dataclass.

`RuntimeConfig` holds every knob of the drafting runtime with defaults that
work; its field names follow the serving ecosystem's CLI flags
(`--speculative-num-steps`, `--cuda-graph-max-bs`, `--enforce-eager`, ...).
`ModelConfig` is the shape of a Llama-family model (a target or an EAGLE-3
draft head), named like Hugging Face's `LlamaConfig`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from graphdraft.kernels.config import KernelConfig
from graphdraft.runtime.tree import TreeSpec

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}  # float64: exactness tests on the torch path


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"` / `torch.bfloat16` -> `torch.bfloat16`; anything else raises."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


PRECOMPILE_WORKERS_CAP = 16
"""The most precompile worker processes `RuntimeConfig.precompile_workers=None` starts."""
PRECOMPILE_WORKERS_ENV = "GRAPHDRAFT_PRECOMPILE_WORKERS"
"""The environment variable that sets that default (an int >= 0)."""
PRECOMPILE_WORKERS_DEFAULT = (f"env {PRECOMPILE_WORKERS_ENV} if set, else "
                              f"min({PRECOMPILE_WORKERS_CAP}, CPU count) on CUDA without data "
                              "parallelism, else 0")
"""What `RuntimeConfig.precompile_workers=None` means, in words: stated once here, read by
`graphdraft.startup.spec.default_workers` (the value) and `--precompile-workers`' help."""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class RuntimeConfig:
    """Every knob of the drafting runtime.

    Chain drafting: `spec_num_tokens = speculative_num_steps + 1` tokens per
    decode row go into verify (the last verified token and the drafts).
    """

    speculative_num_steps: int = 3
    page_size: int = 16
    max_running_requests: int = 64
    """Request-pool slots available to live requests (slot 0 is reserved extra)."""
    max_context_len: int = 4096
    """Longest sequence (prompt + output + draft look-ahead) a request may reach."""
    max_num_batched_tokens: int = 4096
    """Token budget of one forward (chunked-prefill size); persistent token buffers use it."""
    num_kv_pages: int | None = None
    """KV pages in the pool (page 0 is the reserved dummy). None: sized by `kv_cache_memory_gb`
    (see `kv_pages`)."""
    kv_cache_memory_gb: float = 4.0
    """Budget of the target's KV pool in GB (1e9 bytes) when `num_kv_pages` is None: the pool
    holds `min(every slot at max context, what the budget pays for)` pages, and requests wait
    for pages (back-pressure) beyond it. 4 GB: about 30,000 tokens of a Llama-3.1-8B target
    in bf16 (128 KiB a token), instead of 64 slots x 4096 tokens = 34 GB."""
    cuda_graph_max_bs: int = 64
    cuda_graph_bs: tuple[int, ...] | None = None
    """Explicit padded batch-size schedule; None: 1, 2, 4, 8, 16, 24, ... up to cuda_graph_max_bs."""
    enforce_eager: bool = False
    """Turn every CUDA graph off (also: env GRAPHDRAFT_EAGER=1)."""
    dtype: str = "bfloat16"
    device: str = field(default_factory=default_device)
    validate_inputs: bool = True
    """Check every call's shapes, dtypes and value ranges (a host sync); off on a tuned hot path."""
    kernel_backend: str = "auto"
    """"triton" (Triton kernels), "torch" (plain torch path), or "auto" (triton on CUDA)."""
    kernels: KernelConfig | None = None
    """The kernel settings (`graphdraft/kernels/config.py`: GEMV tiles, PDL, thresholds; frozen).
    None: `KernelConfig.from_env()`, read once here at construction. Its `backend` always
    follows `kernel_backend` (resolved: "auto" is "triton" on CUDA); `replace()` keeps the
    rest. The models, the attention backend and the ops run under it."""
    validation: str = "deferred"
    """Value checks of the hot path: "deferred" (device error word, raised one step later as
    the named ValueError; no sync), "sync" (immediate errors, syncs), "off". `validate_inputs=False`
    also turns them off (kept as an alias). (Named `validation`: `validate()` is the method.)"""
    cycle_graph: bool = True
    """Pure decode steps replay one graph per cycle (verify + accept + draft + commit); False:
    the split mode (verify graph, eager accept, draft graph), bit-identical."""
    stop_table_width: int = 4
    """Stop token ids per request held on the device (EOS included); more are rejected."""
    max_logprobs: int = 20
    """The widest `logprobs` / `prompt_logprobs` a request may ask (0..20; more: rejected at
    admission). Each pack row carries N * (1 + 2 * max_logprobs) int32 words of
    log-probabilities (`graphdraft.kernels.logprobs`); only rows that ask compute them."""
    dp_size: int = 1
    """Data-parallel attention ranks (`graphdraft.serving.data_parallel`): each rank serves its own
    requests, the MLPs are split over the ranks. 1: no data parallelism (today's code path);
    > 1: the models' dense layers must be split with `data_parallel.shard_dense_` over a
    group of this size (the Engine checks)."""
    precompile_workers: int | None = None
    """Worker processes that compile the schedule's Triton kernels into Triton's on-disk cache
    before `capture_graphs` (`graphdraft.startup`); 0: compile in this process only; None:
    `PRECOMPILE_WORKERS_DEFAULT` (`RuntimeConfig.precompile_workers_default`)."""
    precompile_workers_default: ClassVar[str] = PRECOMPILE_WORKERS_DEFAULT
    """`precompile_workers=None` in words (a class constant, not a field: --help prints it)."""
    # --- speculation policy (graphdraft.serving.policy; README "Speculation policy") ---------
    speculative_policy: str = "adaptive"
    """Draft steps per cycle (`--speculative-policy`): "adaptive" picks k in
    `speculative_policy_steps` per padded batch size from the measured cycle costs and the
    running accept rate (0 = target-only decode); "fixed" always drafts
    `speculative_num_steps` (only that cycle graph is captured)."""
    speculative_policy_steps: tuple[int, ...] | None = None
    """Draft lengths the adaptive policy may pick (one cycle graph per padded bs each):
    distinct ints in 0..speculative_num_steps including 0; None: (0, 1, speculative_num_steps)."""
    deferred_draft_kv: int = 8
    """k = 0 cycles whose draft KV the chain drafter defers (`runtime/deferred_kv.py`: their
    inputs kept per batch row, written in one batch before drafting resumes or when this
    many are kept); 0: the KV-only draft step in every k = 0 cycle. At most 64."""
    # --- tree drafting (graphdraft.runtime.tree; README "Tree drafting") -----------------------
    speculative_eagle_topk: int = 1
    """Beams per draft step (`--speculative-eagle-topk`): 1 drafts a chain (today's cycle, bit
    for bit); k > 1 drafts a tree of `speculative_num_draft_tokens` nodes verified at once
    (the fixed policy: adaptive falls back to fixed with a log line)."""
    speculative_num_draft_tokens: int | None = None
    """Tree nodes verified per request, root included (`--speculative-num-draft-tokens`):
    2 <= n <= 1 + k + (steps-1)*k^2 and n <= 64; with topk 1 it must be steps + 1. None:
    steps + 1 (`tree_spec.n`; kept None so that `replace(speculative_num_steps=...)` follows)."""

    # --- drafting without a head (graphdraft.runtime.ngram_drafter; README "N-gram drafting") --
    speculative_algorithm: str = "eagle3"
    """What drafts (`--speculative-algorithm`): "eagle3" the EAGLE-3 head (none loaded:
    target-only); "ngram" prompt lookup (`NgramDrafter`: the tokens that followed the last
    earlier occurrence of the request's last n tokens; no head)."""
    ngram_min: int = 1
    """Shortest suffix the n-gram drafter matches (`--ngram-min`), >= 1."""
    ngram_max: int = 4
    """Longest suffix it tries first (`--ngram-max`), ngram_min..64."""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------
    @property
    def spec_num_tokens(self) -> int:
        return self.speculative_num_steps + 1

    @property
    def max_bs(self) -> int:
        """Largest batch the persistent buffers hold."""
        return self.max_running_requests

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def use_triton(self) -> bool:
        """The Triton path (`kernels.use_triton`)."""
        return self.kernels.use_triton

    @property
    def max_pages_per_req(self) -> int:
        return -(-self.max_context_len // self.page_size)

    @property
    def total_kv_pages(self) -> int:
        """Pages in the pool including the reserved dummy page 0."""
        if self.num_kv_pages is not None:
            return self.num_kv_pages + 1
        return self.max_running_requests * self.max_pages_per_req + 1

    def kv_pages(self, bytes_per_token: int) -> int:
        """Pages of the KV pool including the reserved dummy page 0, for a model whose KV cache
        takes `bytes_per_token` bytes a token (`ModelConfig.kv_bytes_per_token`).

        `num_kv_pages + 1` when it is set; else every slot at max context
        (`total_kv_pages`), capped at what `kv_cache_memory_gb` pays for. Raises ValueError
        when the budget cannot hold one request of `max_context_len` tokens."""
        if not isinstance(bytes_per_token, int) or isinstance(bytes_per_token, bool) \
                or bytes_per_token < 1:
            raise ValueError(f"bytes_per_token: expected an int >= 1, got {bytes_per_token!r}")
        if self.num_kv_pages is not None:
            return self.num_kv_pages + 1
        full = self.max_running_requests * self.max_pages_per_req
        budget = int(self.kv_cache_memory_gb * 1e9) // (bytes_per_token * self.page_size)
        if budget < self.max_pages_per_req:
            need = self.max_pages_per_req * self.page_size * bytes_per_token / 1e9
            raise ValueError(f"kv_cache_memory_gb: expected >= {need:.3g} (one request of "
                             f"max_context_len {self.max_context_len} tokens at "
                             f"{bytes_per_token} bytes a token), got {self.kv_cache_memory_gb!r}")
        return min(full, budget) + 1

    @property
    def max_num_tokens(self) -> int:
        """Rows of the persistent token buffers: the chunk budget or a full decode batch."""
        return max(self.max_num_batched_tokens, self.max_bs * self.spec_num_tokens)

    def replace(self, **changes: Any) -> RuntimeConfig:
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        def need(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise ValueError(f"{name}: expected {expected}, got {getattr(self, name)!r}")

        need(isinstance(self.speculative_num_steps, int) and self.speculative_num_steps >= 1,
             "speculative_num_steps", "an int >= 1")
        need(isinstance(self.page_size, int) and self.page_size >= 1, "page_size", "an int >= 1")
        need(isinstance(self.max_running_requests, int) and self.max_running_requests >= 1,
             "max_running_requests", "an int >= 1")
        need(isinstance(self.max_context_len, int) and self.max_context_len >= 2,
             "max_context_len", "an int >= 2")
        need(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
             "max_num_batched_tokens", "an int >= 1")
        need(self.num_kv_pages is None or (isinstance(self.num_kv_pages, int) and self.num_kv_pages >= 1),
             "num_kv_pages", "None or an int >= 1")
        need(isinstance(self.kv_cache_memory_gb, (int, float))
             and not isinstance(self.kv_cache_memory_gb, bool) and self.kv_cache_memory_gb > 0,
             "kv_cache_memory_gb", "a number > 0")
        need(isinstance(self.cuda_graph_max_bs, int) and 1 <= self.cuda_graph_max_bs,
             "cuda_graph_max_bs", "an int >= 1")
        need(self.cuda_graph_max_bs <= self.max_running_requests, "cuda_graph_max_bs",
             f"<= max_running_requests ({self.max_running_requests})")
        if self.cuda_graph_bs is not None:
            sizes = tuple(self.cuda_graph_bs)
            need(all(isinstance(s, int) and s >= 1 for s in sizes) and len(sizes) > 0
                 and list(sizes) == sorted(set(sizes)) and sizes[-1] <= self.cuda_graph_max_bs,
                 "cuda_graph_bs",
                 f"ints >= 1, strictly ascending, each <= cuda_graph_max_bs ({self.cuda_graph_max_bs})")
            self.cuda_graph_bs = sizes
        resolve_dtype(self.dtype)
        need(self.kernel_backend in ("auto", "triton", "torch"), "kernel_backend",
             "'auto', 'triton' or 'torch'")
        interpreting = os.environ.get("TRITON_INTERPRET") == "1"
        need(self.kernel_backend != "triton" or str(self.device).startswith("cuda") or interpreting,
             "kernel_backend", "'torch' or 'auto' on a CPU device (unless TRITON_INTERPRET=1)")
        need(str(self.device).split(":")[0] in ("cpu", "cuda"), "device", "'cpu' or 'cuda[:N]'")
        need(self.kernels is None or isinstance(self.kernels, KernelConfig), "kernels",
             "None or a KernelConfig")
        triton_path = self.kernel_backend == "triton" or (
            self.kernel_backend == "auto" and str(self.device).startswith("cuda"))
        kernels = self.kernels if self.kernels is not None else KernelConfig.from_env()
        self.kernels = kernels.with_backend("triton" if triton_path else "torch")
        need(self.validation in ("deferred", "sync", "off"), "validation", "'deferred', 'sync' or 'off'")
        need(isinstance(self.cycle_graph, bool), "cycle_graph", "a bool")
        need(isinstance(self.stop_table_width, int) and self.stop_table_width >= 1,
             "stop_table_width", "an int >= 1")
        need(isinstance(self.max_logprobs, int) and not isinstance(self.max_logprobs, bool)
             and 0 <= self.max_logprobs <= 20, "max_logprobs", "an int in [0, 20]")
        need(isinstance(self.dp_size, int) and not isinstance(self.dp_size, bool)
             and self.dp_size >= 1, "dp_size", "an int >= 1")
        need(self.precompile_workers is None or (
            isinstance(self.precompile_workers, int) and not isinstance(self.precompile_workers, bool)
            and self.precompile_workers >= 0), "precompile_workers", "None or an int >= 0")
        need(not (self.dp_size > 1 and self.precompile_workers), "precompile_workers",
             "0 or None under data parallelism (dp_size > 1)")
        # speculation policy
        need(self.speculative_policy in ("adaptive", "fixed"), "speculative_policy",
             "'adaptive' or 'fixed'")
        if self.speculative_policy_steps is not None:
            ks = self.speculative_policy_steps
            ok = isinstance(ks, (tuple, list)) and all(
                isinstance(k, int) and not isinstance(k, bool) for k in ks)
            need(ok and 0 in ks and len(set(ks)) == len(ks)
                 and all(0 <= k <= self.speculative_num_steps for k in ks),
                 "speculative_policy_steps", f"None or distinct ints in "
                 f"0..speculative_num_steps ({self.speculative_num_steps}) including 0")
            self.speculative_policy_steps = tuple(sorted(ks))
        need(isinstance(self.deferred_draft_kv, int) and not isinstance(self.deferred_draft_kv, bool)
             and 0 <= self.deferred_draft_kv <= 64, "deferred_draft_kv", "an int in [0, 64]")
        # tree drafting: the shape checks of runtime.tree.TreeSpec (ValueErrors naming the flag)
        for name in ("speculative_eagle_topk", "speculative_num_draft_tokens"):
            v = getattr(self, name)
            need(v is None and name == "speculative_num_draft_tokens"
                 or isinstance(v, int) and not isinstance(v, bool), name,
                 "an int" + (" or None" if name == "speculative_num_draft_tokens" else ""))
        self.tree_spec  # noqa: B018 - TreeSpec raises on a combination that cannot be drafted
        self._validate_ngram(need)

    def _validate_ngram(self, need) -> None:
        """The n-gram drafter's fields (`need(ok, field, expected)` raises naming the field)."""
        need(self.speculative_algorithm in ("eagle3", "ngram"), "speculative_algorithm",
             "'eagle3' or 'ngram'")
        for name, hi in (("ngram_min", 64), ("ngram_max", 64)):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= hi, name,
                 f"an int in 1..{hi}")
        need(self.ngram_max >= self.ngram_min, "ngram_max",
             f"an int >= ngram_min ({self.ngram_min})")
        need(self.speculative_algorithm == "eagle3" or self.speculative_eagle_topk == 1,
             "speculative_eagle_topk", "1 with speculative_algorithm 'ngram' (tree drafting "
             "needs the EAGLE-3 head)")

    @property
    def policy_steps(self) -> tuple[int, ...]:
        """The draft lengths whose cycle graphs are captured: fixed (S,); adaptive
        `speculative_policy_steps` or (0, 1, S)."""
        s = self.speculative_num_steps
        if self.speculative_policy == "fixed":
            return (s,)
        return self.speculative_policy_steps or tuple(sorted({0, 1, s}))

    @property
    def tree_spec(self) -> TreeSpec:
        """The validated draft shape (`runtime.tree.TreeSpec`: steps, topk, n; chain when topk 1)."""
        return TreeSpec(self.speculative_num_steps, self.speculative_eagle_topk,
                        self.speculative_num_draft_tokens)

    @property
    def validation_mode(self) -> str:
        """The effective `validation` mode ("off" when `validate_inputs` is False)."""
        return self.validation if self.validate_inputs else "off"


_WARNED_AUX_LAYERS: set[int] = set()


@dataclass
class ModelConfig:
    """Shape of a Llama-family model: a target (many layers) or an EAGLE-3 head (one layer).

    For an EAGLE-3 head `draft_vocab_size` may be smaller than `vocab_size`
    (its LM head predicts draft ids, mapped to target ids by `hot_token_ids`),
    and `num_aux_hidden_states` (k) target layers are concatenated into its
    `fc` input of width `k * hidden_size`.
    """

    hidden_size: int = 4096
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    intermediate_size: int = 14336
    num_hidden_layers: int = 1
    vocab_size: int = 128256
    draft_vocab_size: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    num_aux_hidden_states: int = 3
    aux_hidden_state_layer_ids: tuple[int, ...] | None = None
    """Target layers whose input residual stream is captured for EAGLE-3; None: [2, L//2, L-3]."""

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "num_hidden_layers", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: expected a divisor of num_attention_heads "
                f"({self.num_attention_heads}), got {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even int, got {self.head_dim}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size: expected 1..vocab_size ({self.vocab_size}), "
                             f"got {self.draft_vocab_size}")
        if self.aux_hidden_state_layer_ids is not None:
            self.aux_hidden_state_layer_ids = tuple(int(i) for i in self.aux_hidden_state_layer_ids)
            self.num_aux_hidden_states = len(self.aux_hidden_state_layer_ids)

    @property
    def output_vocab_size(self) -> int:
        """Rows of the LM head: the draft vocab for a head that has one, else the vocab."""
        return self.draft_vocab_size or self.vocab_size

    def kv_bytes_per_token(self, dtype: str | torch.dtype) -> int:
        """Bytes of K and V a token takes over all layers in `dtype` (`RuntimeConfig.kv_pages`)."""
        itemsize = torch.empty((), dtype=resolve_dtype(dtype)).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize

    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose *input* residual stream is captured for EAGLE-3.

        None configured: EAGLE-3's default [2, L//2, L-3] (clamped to the layers there are).
        For L < 7 those ids repeat or descend (L = 4: (2, 2, 1)); that is logged as a warning
        once per L: the head then sees the same stream twice, or in an order a head trained
        on ascending ids does not expect. Name the ids (`aux_hidden_state_layer_ids`) for
        small targets."""
        if self.aux_hidden_state_layer_ids is not None:
            return self.aux_hidden_state_layer_ids
        n = self.num_hidden_layers
        ids = (min(2, n - 1), n // 2, max(n - 3, 0))
        if list(ids) != sorted(set(ids)) and n not in _WARNED_AUX_LAYERS:
            _WARNED_AUX_LAYERS.add(n)
            log.warning("aux layer ids: the default [2, L//2, L-3] for a %d-layer target is %s "
                        "(repeated or descending); set aux_hidden_state_layer_ids to name "
                        "distinct ascending layers", n, list(ids))
        return ids

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)
