"""Checkpoints: load and save Hugging Face Llama targets and EAGLE-3 heads (safetensors only).

Target directory (Hugging Face Llama layout):
  config.json                      LlamaConfig fields (transformers 4.x `rope_theta`/`rope_scaling`
                                   or 5.x `rope_parameters`; `torch_dtype` or `dtype`)
  model.safetensors                or shards `model-0000i-of-0000n.safetensors` plus
  model.safetensors.index.json     (its `weight_map`: tensor name -> shard file)
  names: model.embed_tokens.weight, model.layers.{i}.input_layernorm.weight,
         model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, model.layers.{i}.post_attention_layernorm.weight,
         model.layers.{i}.mlp.{gate,up,down}_proj.weight, model.norm.weight,
         lm_head.weight (absent when tie_word_embeddings)

EAGLE-3 head directory (the published EAGLE-3 layout, e.g. EAGLE3-LLaMA3.1-Instruct-8B):
  config.json   LlamaConfig-like, num_hidden_layers 1, vocab_size (the target's), draft_vocab_size,
                optional `eagle_config.eagle_aux_hidden_state_layer_ids` (or top level)
  names: midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
         midlayer.self_attn.{q,k,v}_proj.weight [*, 2H], midlayer.self_attn.o_proj.weight,
         midlayer.mlp.{gate,up,down}_proj.weight, fc.weight [H, k*H], norm.weight,
         lm_head.weight [draft_vocab, H], d2t int64 [draft_vocab] (offsets: target id =
         draft id + d2t[draft id]), t2d bool [vocab], optional embed_tokens.weight (without it
         the head shares the target's embedding).
  `graphdraft_lm_head` (graphdraft's config key, `LM_HEAD_KEY`): "own" (or absent) the head
         ships its lm_head.weight; "target": it ships none, and the loader gathers the target's
         lm_head rows at the draft vocabulary's target ids (d2t; none: Vd == V, every row) into
         the head's own [draft_vocab, H] parameter, in the head's dtype on its device (as
         EAGLE-1/-2 and Medusa reuse the target's frozen LM head; a tied target's rows are its
         embedding's). Such a head needs target=; a file holding lm_head.weight, a missing or
         out-of-range d2t, a target of another vocab or hidden size are errors naming them.

graphdraft fuses q/k/v into `qkv_proj` (rows [q; k; v]) and gate/up into `gate_up_proj`
(rows [gate; up]); loading concatenates, saving splits. One table (`_target_layout`,
`_head_layout`) drives both directions.

Policies
- Only safetensors is read, tensor by tensor through `safe_open` (never `torch.load`, never
  pickle). A directory with only `pytorch_model.bin` / `*.pt` raises ValueError saying so.
- Every tensor name, shape and dtype is checked against the model from the file headers
  before any data is read; all problems (missing, unexpected, wrong shape, wrong dtype) are
  reported together in one `CheckpointError` (a ValueError with `.problems`).
- dtype: float weights (F16, BF16, F32, F64) are cast to the requested dtype (default: the
  config's `torch_dtype`/`dtype`, else the stored dtype of the embedding). A non-float tensor
  where a float weight is expected (ints, bool, FP8 or other quantized formats) is an error.
  `d2t` must be an integer tensor, `t2d` bool (or integer 0/1).
- A truncated or corrupt file raises ValueError naming the file (safetensors validates the
  header against the file size, so nothing past the end is read). A shard listed in the index
  but missing on disk raises ValueError naming it.
- `open_model_pair` checks everything `load_model_pair` checks but reads no tensor data: the
  modules are built (weights uninitialised) and `PendingWeights.read()` fills them later, so
  engines can be built and their kernels compiled while a large checkpoint is read.
- `*.rotary_emb.inv_freq` tensors (some older exports) are ignored: RoPE comes from config.
  A tied target that also stores `lm_head.weight` is accepted only if it equals the embedding.

EAGLE-3 aux layer ids. graphdraft's `ModelConfig.aux_hidden_state_layer_ids` name the target
layers whose *input* residual stream is captured (default [2, L//2, L-3]). Configs in the wild
use two conventions for `eagle_aux_hidden_state_layer_ids`:
  "input"  id k = the stream entering layer k (HF `hidden_states[k]`; vLLM's reading)
  "output" id k = the output of layer k, i.e. graphdraft id k + 1 (SGLang's historic reading)
  "auto"   "output" when the first id is 1, else "input" (SGLang's current rule): both read
           the published [1, L//2-1, L-4] / [2, L//2, L-3] lists as the default layers.
The convention is taken from the argument, else from the config key
`graphdraft_aux_layer_ids_convention` (which graphdraft writes), else "auto".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphdraft.config import ModelConfig, resolve_dtype
from graphdraft.models.eagle3 import LM_HEAD_SOURCES, Eagle3DraftHead
from graphdraft.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONVENTION_KEY = "graphdraft_aux_layer_ids_convention"
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
LM_HEAD_KEY = "graphdraft_lm_head"
"""A head config's key: where its LM head comes from (`eagle3.LM_HEAD_SOURCES`; absent: "own")."""
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_FLOAT_CODES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                "F64": torch.float64}
_INT_CODES = ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64"}
_CONVENTIONS = ("auto", "input", "output")
_MAX_LISTED = 40


class CheckpointError(ValueError):
    """A checkpoint that does not match its model; `problems` lists every mismatch found."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path, self.problems = path, list(problems)
        shown = self.problems[:_MAX_LISTED]
        more = len(self.problems) - len(shown)
        lines = "".join(f"\n  - {p}" for p in shown) + (f"\n  ... and {more} more" if more else "")
        n = len(self.problems)
        super().__init__(f"{path}: checkpoint does not match the model "
                         f"({n} problem{'s' if n != 1 else ''}):{lines}")


# ---------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ConfigExtras:
    """What config.json says beyond the model shape."""

    path: Path
    raw: dict
    dtype: torch.dtype | None
    """`torch_dtype` / `dtype` of the config (None: absent or not a float dtype graphdraft runs)."""
    eos_token_ids: tuple[int, ...]
    """config.json's `eos_token_id` (int or list), then generation_config.json's, deduplicated."""
    bos_token_id: int | None
    aux_layer_ids_raw: tuple[int, ...] | None
    """`eagle_aux_hidden_state_layer_ids` as written (None: not named)."""
    aux_layer_ids_convention: str | None
    """How they were read: "input" or "output" (None: not named)."""
    architectures: tuple[str, ...]


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from e


def _checkpoint_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{p}: not a directory (expected a checkpoint directory with "
                         f"{CONFIG_NAME} and safetensors weights)")
    return p


def aux_layer_ids_from_config(ids: list[int] | tuple[int, ...], convention: str = "auto"
                              ) -> tuple[tuple[int, ...], str]:
    """`eagle_aux_hidden_state_layer_ids` as written -> (graphdraft ids, convention used).

    graphdraft ids name the target layers whose input residual stream is captured.
    """
    if convention not in _CONVENTIONS:
        raise ValueError(f"aux_ids_convention: expected one of {_CONVENTIONS}, got {convention!r}")
    if convention == "auto":
        convention = "output" if ids[0] == 1 else "input"
    shift = 1 if convention == "output" else 0
    return tuple(int(i) + shift for i in ids), convention


def _rope(raw: dict, where: str) -> tuple[float, dict | None]:
    params = raw.get("rope_parameters")
    theta, scaling = None, None
    if params is not None:  # transformers 5.x layout: {"rope_type", "rope_theta", ...}
        if not isinstance(params, dict):
            raise ValueError(f"{where}: rope_parameters: expected an object, got {params!r}")
        theta = params.get("rope_theta")
        if params.get("rope_type", params.get("type")) not in (None, "default"):
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if raw.get("rope_theta") is not None:
        theta = raw["rope_theta"]
    if raw.get("rope_scaling") is not None:
        scaling = raw["rope_scaling"]
    theta = 10000.0 if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ValueError(f"{where}: rope_theta: expected a number > 0, got {theta!r}")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ValueError(f"{where}: rope_scaling: expected an object or null, got {scaling!r}")
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            scaling = None
        elif kind != "llama3":
            raise ValueError(f"{where}: rope_scaling: unsupported rope_type {kind!r} "
                             f"(graphdraft supports 'default' and 'llama3')")
        elif not isinstance(scaling.get("factor"), (int, float)):
            raise ValueError(f"{where}: rope_scaling: llama3 needs a numeric 'factor', "
                             f"got {scaling.get('factor')!r}")
        else:
            scaling = dict(scaling)
    return float(theta), scaling


def _token_ids(value: Any, name: str, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items):
        raise ValueError(f"{where}: {name}: expected an int >= 0 or a list of them, got {value!r}")
    return tuple(items)


def _aux_layer_ids(raw: dict, where: str, convention_arg: str | None
                   ) -> tuple[list | None, tuple[int, ...] | None, str | None]:
    """`eagle_aux_hidden_state_layer_ids` (top level or under `eagle_config`) -> (as written,
    in graphdraft's convention, the convention it was read in); all None when absent."""
    eagle_cfg = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    ids_raw = raw.get(AUX_IDS_KEY)
    if ids_raw is None:
        ids_raw = eagle_cfg.get(AUX_IDS_KEY)
    if ids_raw is None:
        return None, None, None
    if (not isinstance(ids_raw, list) or not ids_raw
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids_raw)):
        raise ValueError(f"{where}: {AUX_IDS_KEY}: expected a non-empty list of ints, "
                         f"got {ids_raw!r}")
    convention = convention_arg or raw.get(CONVENTION_KEY) or eagle_cfg.get(
        CONVENTION_KEY) or "auto"
    aux_ids, convention = aux_layer_ids_from_config(ids_raw, convention)
    if min(aux_ids) < 0:
        raise ValueError(f"{where}: {AUX_IDS_KEY}: {ids_raw} read in the {convention!r} "
                         f"convention name target layers {list(aux_ids)}: expected ids >= 0")
    return ids_raw, aux_ids, convention


def _special_ids(raw: dict, d: Path, where: str) -> tuple[list[int], tuple[int, ...]]:
    """(EOS ids of config.json then generation_config.json, without repeats; BOS ids)."""
    eos = list(_token_ids(raw.get("eos_token_id"), "eos_token_id", where))
    gen_path = d / GENERATION_CONFIG_NAME
    if gen_path.is_file():
        gen = _read_json(gen_path)
        if isinstance(gen, dict):
            eos += [t for t in _token_ids(gen.get("eos_token_id"), "eos_token_id", str(gen_path))
                    if t not in eos]
    return eos, _token_ids(raw.get("bos_token_id"), "bos_token_id", where)


def read_config(path: str | os.PathLike, *, aux_ids_convention: str | None = None
                ) -> tuple[ModelConfig, ConfigExtras]:
    """Read `path/config.json` (a target's or an EAGLE-3 head's) -> (ModelConfig, extras).

    Missing optional fields take LlamaConfig's defaults: num_key_value_heads = heads,
    head_dim = hidden_size // heads, rms_norm_eps 1e-6, rope_theta 10000,
    max_position_embeddings 2048, tie_word_embeddings False. Named
    `eagle_aux_hidden_state_layer_ids` (top level or under `eagle_config`) become
    `aux_hidden_state_layer_ids` in graphdraft's convention (see the module docstring).
    """
    d = _checkpoint_dir(path)
    where = str(d / CONFIG_NAME)
    raw = _read_json(d / CONFIG_NAME)
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object")

    model_type = raw.get("model_type")
    if model_type not in (None, "llama"):
        raise ValueError(f"{where}: model_type: expected 'llama', got {model_type!r}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act: expected 'silu', got {raw['hidden_act']!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ValueError(f"{where}: {flag}: expected false (graphdraft has no biases), got true")

    def integer(name: str, default: Any = ...) -> Any:
        if name not in raw or raw[name] is None:
            if default is ...:
                raise ValueError(f"{where}: {name}: required, missing")
            return default
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: {name}: expected an int, got {value!r}")
        return value

    heads = integer("num_attention_heads")
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"{where}: rms_norm_eps: expected a number > 0, got {eps!r}")
    theta, scaling = _rope(raw, where)
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ValueError(f"{where}: tie_word_embeddings: expected true or false, got {tie!r}")

    ids_raw, aux_ids, convention = _aux_layer_ids(raw, where, aux_ids_convention)
    dtype_name = raw.get("torch_dtype", raw.get("dtype"))
    try:
        dtype = resolve_dtype(dtype_name) if isinstance(dtype_name, str) else None
    except ValueError:
        dtype = None
    eos, bos = _special_ids(raw, d, where)

    try:
        cfg = ModelConfig(
            hidden_size=integer("hidden_size"), num_attention_heads=heads,
            num_key_value_heads=integer("num_key_value_heads", heads),
            head_dim=integer("head_dim", None), intermediate_size=integer("intermediate_size"),
            num_hidden_layers=integer("num_hidden_layers"), vocab_size=integer("vocab_size"),
            draft_vocab_size=integer("draft_vocab_size", None), rms_norm_eps=float(eps),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=integer("max_position_embeddings", 2048),
            tie_word_embeddings=tie, aux_hidden_state_layer_ids=aux_ids)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    archs = raw.get("architectures") or ()
    extras = ConfigExtras(
        path=d, raw=raw, dtype=dtype, eos_token_ids=tuple(eos), bos_token_id=bos[0] if bos else None,
        aux_layer_ids_raw=tuple(ids_raw) if ids_raw is not None else None,
        aux_layer_ids_convention=convention,
        architectures=tuple(archs) if isinstance(archs, list) else ())
    return cfg, extras


# ---------------------------------------------------------------------------
# Name tables: checkpoint name -> (graphdraft parameter, first row, shape)
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    name: str          # checkpoint tensor name
    param: str         # graphdraft parameter name
    row: int           # first row of the parameter this tensor fills
    shape: tuple[int, ...]


def _layer_entries(src: str, dst: str, cfg: ModelConfig, in_size: int,
                   hidden_norm: bool = False) -> list[_Entry]:
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    norms = ["input_layernorm"] + (["hidden_norm"] if hidden_norm else []) + [
        "post_attention_layernorm"]
    out = [_Entry(f"{src}{n}.weight", f"{dst}{n}.weight", 0, (h,)) for n in norms]
    qkv = f"{dst}self_attn.qkv_proj"
    out += [_Entry(f"{src}self_attn.q_proj.weight", qkv, 0, (q, in_size)),
            _Entry(f"{src}self_attn.k_proj.weight", qkv, q, (kv, in_size)),
            _Entry(f"{src}self_attn.v_proj.weight", qkv, q + kv, (kv, in_size)),
            _Entry(f"{src}self_attn.o_proj.weight", f"{dst}self_attn.o_proj", 0, (h, q))]
    gu = f"{dst}mlp.gate_up_proj"
    out += [_Entry(f"{src}mlp.gate_proj.weight", gu, 0, (f, h)),
            _Entry(f"{src}mlp.up_proj.weight", gu, f, (f, h)),
            _Entry(f"{src}mlp.down_proj.weight", f"{dst}mlp.down_proj", 0, (h, f))]
    return out


def _target_layout(cfg: ModelConfig) -> list[_Entry]:
    h = cfg.hidden_size
    out = [_Entry("model.embed_tokens.weight", "embed_tokens", 0, (cfg.vocab_size, h))]
    for i in range(cfg.num_hidden_layers):
        out += _layer_entries(f"model.layers.{i}.", f"layers.{i}.", cfg, h)
    out.append(_Entry("model.norm.weight", "norm.weight", 0, (h,)))
    if not cfg.tie_word_embeddings:
        out.append(_Entry("lm_head.weight", "lm_head", 0, (cfg.vocab_size, h)))
    return out


def _head_layout(cfg: ModelConfig, include_embeddings: bool,
                 include_lm_head: bool = True) -> list[_Entry]:
    h = cfg.hidden_size
    out = [_Entry("embed_tokens.weight", "embed_tokens", 0, (cfg.vocab_size, h))] if (
        include_embeddings) else []
    out.append(_Entry("fc.weight", "fc", 0, (h, cfg.num_aux_hidden_states * h)))
    out += _layer_entries("midlayer.", "midlayer.", cfg, 2 * h, hidden_norm=True)
    out.append(_Entry("norm.weight", "norm.weight", 0, (h,)))
    if include_lm_head:
        out.append(_Entry("lm_head.weight", "lm_head", 0, (cfg.output_vocab_size, h)))
    return out


def _lm_head_source(extras: ConfigExtras) -> str:
    """config.json's `graphdraft_lm_head` ("own" when absent); ValueError naming the key."""
    value = extras.raw.get(LM_HEAD_KEY, "own")
    if value not in LM_HEAD_SOURCES:
        raise ValueError(f"{extras.path / CONFIG_NAME}: {LM_HEAD_KEY}: expected one of "
                         f"{', '.join(map(repr, LM_HEAD_SOURCES))}, got {value!r}")
    return value


# ---------------------------------------------------------------------------
# Reading safetensors
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Header:
    file: Path
    dtype: str                 # safetensors dtype code: "BF16", "F32", "I64", "BOOL", ...
    shape: tuple[int, ...]


def _inside(d: Path, name: str, where: Path) -> Path:
    if Path(name).name != name or name in ("", ".", ".."):
        raise ValueError(f"{where}: shard {name!r} is not a file name inside {d}")
    return d / name


def _weight_files(d: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of `d` and the index's weight map (None without an index)."""
    index_path = d / INDEX_NAME
    if index_path.is_file():
        index = _read_json(index_path)
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
            raise ValueError(f"{index_path}: expected a 'weight_map' object of name -> file")
        files = [_inside(d, n, index_path) for n in sorted(set(wmap.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index_path}: lists shard(s) missing on disk: {', '.join(missing)}")
        return files, wmap
    if (d / WEIGHTS_NAME).is_file():
        return [d / WEIGHTS_NAME], None
    found = sorted(p for p in d.glob("*.safetensors") if p.is_file())
    if found:
        return found, None
    pickles = sorted(p.name for p in d.iterdir() if p.name.endswith(_PICKLE_SUFFIXES))
    if pickles:
        raise ValueError(
            f"{d}: found {', '.join(pickles)} but no safetensors weights: graphdraft loads only "
            f"safetensors ({WEIGHTS_NAME} or shards with {INDEX_NAME}). A .bin/.pt file is a "
            f"Python pickle, which can run code when loaded, so it is not read. Convert it in a "
            f"trusted environment, e.g. safetensors.torch.save_file("
            f"torch.load(path, weights_only=True), '{WEIGHTS_NAME}').")
    raise ValueError(f"{d}: no weights found (expected {WEIGHTS_NAME}, or shards listed in "
                     f"{INDEX_NAME})")


class _Weights(contextlib.AbstractContextManager):
    """The safetensors files of one checkpoint directory: headers read at open, data on demand."""

    def __init__(self, d: Path) -> None:
        from safetensors import safe_open

        self.dir = d
        self.files, wmap = _weight_files(d)
        self.headers: dict[str, _Header] = {}
        self.problems: list[str] = []
        self._handles: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()
        try:
            for file in self.files:
                try:
                    handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
                    names = list(handle.keys())
                    slices = [handle.get_slice(n) for n in names]
                    info = [(sl.get_dtype(), tuple(sl.get_shape())) for sl in slices]
                except Exception as e:  # safetensors raises SafetensorError / OSError
                    raise ValueError(f"{file}: cannot read this safetensors file (truncated or "
                                     f"corrupt?): {e}") from e
                self._handles[file] = handle
                for name, (dtype, shape) in zip(names, info, strict=True):
                    if name in self.headers:
                        self.problems.append(f"tensor {name!r} stored twice: in "
                                             f"{self.headers[name].file.name} and {file.name}")
                    self.headers[name] = _Header(file, dtype, shape)
            for name, shard in (wmap or {}).items():
                if name not in self.headers or self.headers[name].file.name != Path(shard).name:
                    self.problems.append(f"{INDEX_NAME} lists {name!r} in {shard}, which does "
                                         f"not hold it")
        except BaseException:
            self._stack.close()
            raise

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def read(self, name: str) -> torch.Tensor:
        header = self.headers[name]
        try:
            return self._handles[header.file].get_tensor(name)
        except Exception as e:
            raise ValueError(f"{header.file}: cannot read tensor {name!r}: {e}") from e

    def float_dtype(self, name: str) -> torch.dtype | None:
        header = self.headers.get(name)
        return _FLOAT_CODES.get(header.dtype) if header is not None else None


def _describe(h: _Header) -> str:
    return f"shape {list(h.shape)}, {h.dtype}, in {h.file.name}"


def _check(w: _Weights, expected: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
    """Problems of `w` against `expected` (name -> (shape, "float" | "int" | "bool"))."""
    missing, wrong, extra = [], [], []
    for name, (shape, kind) in expected.items():
        h = w.headers.get(name)
        if h is None:
            missing.append(f"missing tensor {name!r} (expected shape {list(shape)})")
            continue
        if h.shape != tuple(shape):
            wrong.append(f"{name!r}: wrong shape: expected {list(shape)}, got {list(h.shape)} "
                         f"(in {h.file.name})")
        ok = {"float": h.dtype in _FLOAT_CODES, "int": h.dtype in _INT_CODES,
              "bool": h.dtype == "BOOL" or h.dtype in _INT_CODES}[kind]
        if not ok:
            want = {"float": f"a float dtype ({', '.join(_FLOAT_CODES)})",
                    "int": "an integer dtype (I64)", "bool": "BOOL"}[kind]
            wrong.append(f"{name!r}: wrong dtype: expected {want}, got {h.dtype} "
                         f"(in {h.file.name})")
    for name in sorted(set(w.headers) - set(expected)):
        if name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from config
        extra.append(f"unexpected tensor {name!r} ({_describe(w.headers[name])})")
    return w.problems + missing + wrong + extra


@torch.no_grad()
def _fill(module: torch.nn.Module, w: _Weights, entries: list[_Entry]) -> None:
    params = dict(module.named_parameters())
    for e in entries:
        dest = params[e.param].data
        dest[e.row: e.row + e.shape[0]].copy_(w.read(e.name).view(e.shape))


def _pick_dtype(dtype: str | torch.dtype | None, extras: ConfigExtras, w: _Weights,
                probe: str) -> torch.dtype:
    if dtype is not None:
        return resolve_dtype(dtype)
    if extras.dtype is not None:
        return extras.dtype
    return w.float_dtype(probe) or torch.float32


def _check_target_aux_ids(ids: tuple[int, ...], layers: int, source: str) -> None:
    if not all(0 <= i < layers for i in ids):
        raise ValueError(f"{source}: aux layer ids {list(ids)} (graphdraft convention: the input "
                         f"of each layer) are outside the target's layers [0, {layers})")


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointInfo:
    """What `load_target` read."""

    path: Path
    config: ModelConfig
    extras: ConfigExtras
    dtype: torch.dtype
    files: tuple[Path, ...]
    aux_layer_ids_source: str
    """Where the target's aux layer ids came from: "argument" (e.g. the head's config),
    "target config" or "default"."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.extras.eos_token_ids


def load_target(path: str | os.PathLike, dtype: str | torch.dtype | None = None,
                device: str | torch.device = "cpu", *,
                aux_layer_ids: tuple[int, ...] | None = None,
                aux_ids_convention: str | None = None) -> tuple[LlamaForCausalLM, CheckpointInfo]:
    """Load a Hugging Face Llama checkpoint directory -> (model, info).

    `dtype`: the parameters' dtype (default: the config's, else the stored one); float weights
    are cast to it. `aux_layer_ids`: target layers (graphdraft convention) to capture for
    EAGLE-3, overriding the config's `eagle_aux_hidden_state_layer_ids` and the default.
    """
    with contextlib.ExitStack() as stack:
        model, info, fill = _open_target(path, dtype, device, stack, aux_layer_ids=aux_layer_ids,
                                         aux_ids_convention=aux_ids_convention)
        fill()
    return model, info


def _open_target(path: str | os.PathLike, dtype: str | torch.dtype | None,
                 device: str | torch.device, stack: contextlib.ExitStack, *,
                 aux_layer_ids: tuple[int, ...] | None, aux_ids_convention: str | None
                 ) -> tuple[LlamaForCausalLM, CheckpointInfo, Callable[[], None]]:
    """`load_target` up to the data: the config and every header checked, the model built on
    `device` (weights uninitialised; the files stay open in `stack`) -> (model, info, fill),
    `fill()` reading the weights into it."""
    d = _checkpoint_dir(path)
    cfg, extras = read_config(d, aux_ids_convention=aux_ids_convention)
    source = "target config" if cfg.aux_hidden_state_layer_ids is not None else "default"
    if aux_layer_ids is not None:
        cfg = cfg.replace(aux_hidden_state_layer_ids=tuple(aux_layer_ids))
        source = "argument"
    if cfg.aux_hidden_state_layer_ids is not None:
        _check_target_aux_ids(cfg.aux_hidden_state_layer_ids, cfg.num_hidden_layers,
                              f"{d}: aux layer ids from the {source}")
    entries = _target_layout(cfg)
    w = stack.enter_context(_Weights(d))
    expected = {e.name: (e.shape, "float") for e in entries}
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in w.headers
    if tied_head:  # some tied exports store the head too: accepted if it is the embedding
        expected["lm_head.weight"] = ((cfg.vocab_size, cfg.hidden_size), "float")
    problems = _check(w, expected)
    if problems:
        raise CheckpointError(d, problems)
    dt = _pick_dtype(dtype, extras, w, "model.embed_tokens.weight")
    with torch.device(device):
        model = LlamaForCausalLM(cfg, dt)

    def fill() -> None:
        if tied_head and not torch.equal(w.read("lm_head.weight"),
                                         w.read("model.embed_tokens.weight")):
            raise CheckpointError(d, ["'lm_head.weight' differs from 'model.embed_tokens.weight' "
                                      "but tie_word_embeddings is true"])
        _fill(model, w, entries)

    return model, CheckpointInfo(d, cfg, extras, dt, tuple(w.files), source), fill


def _hot_token_ids(d: Path, w: _Weights, vocab: int, draft_vocab: int) -> torch.Tensor | None:
    if "d2t" not in w.headers:
        return None
    d2t = w.read("d2t").to(torch.int64).view(-1)
    hot = torch.arange(draft_vocab, dtype=torch.int64) + d2t
    problems = []
    bad = ((hot < 0) | (hot >= vocab)).nonzero().view(-1)
    if bad.numel():
        i = int(bad[0])
        problems.append(f"'d2t': {bad.numel()} draft id(s) map outside the target vocab [0, {vocab})"
                        f", e.g. draft id {i} + d2t {int(d2t[i])} = {int(hot[i])}")
    elif torch.unique(hot).numel() != draft_vocab:
        problems.append("'d2t': two draft ids map to the same target id")
    if not problems and "t2d" in w.headers:
        t2d = w.read("t2d").view(-1) != 0
        expect = torch.zeros(vocab, dtype=torch.bool)
        expect[hot] = True
        if not torch.equal(t2d, expect):
            n = int((t2d != expect).sum())
            problems.append(f"'t2d' disagrees with 'd2t' at {n} target id(s) (t2d must be true "
                            f"exactly at the target ids draft ids map to)")
    if problems:
        raise CheckpointError(d, problems)
    return hot


def load_eagle3_head(path: str | os.PathLike, target: LlamaForCausalLM | None = None,
                     dtype: str | torch.dtype | None = None,
                     device: str | torch.device | None = None, *,
                     aux_ids_convention: str | None = None) -> Eagle3DraftHead:
    """Load an EAGLE-3 head directory.

    Without `embed_tokens.weight` in the checkpoint the head shares `target.embed_tokens`
    (the same Parameter, not a copy); a shipped embedding equal to the target's is shared
    too. A config with `graphdraft_lm_head: "target"` takes its LM head from the target
    (module docstring; target= required). With a target: the dtype and device default to
    (and must equal) the target's, hidden and vocab sizes must match, and the head's RoPE
    table covers the target's max_position_embeddings. Without one: device defaults to "cpu".
    """
    with contextlib.ExitStack() as stack:
        head, fill, _ = _open_head(path, target, dtype, device, stack,
                                   aux_ids_convention=aux_ids_convention, target_read=True)
        fill()
    return head


def _served_with(cfg: ModelConfig, where: Path, target: LlamaForCausalLM | None,
                 dtype: str | torch.dtype | None, device: str | torch.device | None):
    """(cfg, dtype, device) of a head served with `target` (its hidden size and vocab must
    match; its dtype and device are the head's; the head's positions reach the target's), or
    of a head alone (device None: the CPU). ValueError naming what differs."""
    if target is None:
        return cfg, dtype, "cpu" if device is None else device
    tc = target.config
    for name in ("hidden_size", "vocab_size"):
        if getattr(cfg, name) != getattr(tc, name):
            raise ValueError(f"{where}: {name}: expected the target's "
                             f"({getattr(tc, name)}), got {getattr(cfg, name)}")
    if dtype is not None and resolve_dtype(dtype) != target.dtype:
        raise ValueError(f"dtype: expected the target's ({target.dtype}) for a head served "
                         f"with it, got {dtype}")
    here = target.embed_tokens.device
    if device is not None and torch.device(device) != here and not (
            torch.device(device).type == here.type and torch.device(device).index is None):
        raise ValueError(f"device: expected the target's ({here}) for a head served with it, "
                         f"got {device}")
    cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings,
                                                  tc.max_position_embeddings))
    return cfg, target.dtype, here


def _target_lm_head_problems(problems: list[str], w: _Weights, vd: int, v: int,
                             target: LlamaForCausalLM | None) -> list[str]:
    """`problems` of a head whose config takes its LM head from the target: a stored
    lm_head is one (not merely unexpected), a missing d2t is named with why it is needed
    (draft vocab `vd` < the target's `v`), and no target is one."""
    problems = [p for p in problems if not p.startswith("unexpected tensor 'lm_head.weight'")]
    taken = f"{LM_HEAD_KEY} is 'target' in {CONFIG_NAME}"
    if "lm_head.weight" in w.headers:
        problems.insert(0, f"'lm_head.weight' is stored but {taken}: the LM head is the "
                           f"target's rows, so the file must hold none (drop the tensor, "
                           f"or set {LM_HEAD_KEY} to 'own')")
    if "d2t" not in w.headers and vd != v:
        problems = [p for p in problems if not p.startswith("missing tensor 'd2t'")]
        problems.insert(0, f"missing tensor 'd2t' (expected shape [{vd}]): {taken}, and "
                           f"the target rows the {vd}-id draft LM head takes are the ones "
                           f"d2t maps the draft ids to")
    if target is None:
        problems.insert(0, f"{taken}: this head takes its LM head from the target, "
                           f"pass target=")
    return problems


def _open_head(path: str | os.PathLike, target: LlamaForCausalLM | None,
               dtype: str | torch.dtype | None, device: str | torch.device | None,
               stack: contextlib.ExitStack, *, aux_ids_convention: str | None, target_read: bool
               ) -> tuple[Eagle3DraftHead, Callable[[], None], list[Path]]:
    """`load_eagle3_head` up to the data -> (head, fill, its weight files) (as
    `_open_target`). A shipped embedding is compared with the target's at once when the
    target is read (`target_read`), else by `fill()` (the target's `fill()` first): the head
    holds its own until then."""
    if target is not None and getattr(target, "tp", None) is not None:
        raise ValueError("target: already sharded for tensor parallelism; load the head with the "
                         "full target, then shard both (graphdraft.parallel.shard_)")
    d = _checkpoint_dir(path)
    cfg, extras = read_config(d, aux_ids_convention=aux_ids_convention)
    where = d / CONFIG_NAME
    if cfg.num_hidden_layers != 1:
        raise ValueError(f"{where}: num_hidden_layers: expected 1 for an EAGLE-3 head, "
                         f"got {cfg.num_hidden_layers}")
    cfg, dtype, device = _served_with(cfg, where, target, dtype, device)
    lm_source = _lm_head_source(extras)
    from_target = lm_source == "target"
    w = stack.enter_context(_Weights(d))
    has_embed = "embed_tokens.weight" in w.headers
    entries = _head_layout(cfg, include_embeddings=has_embed, include_lm_head=not from_target)
    expected = {e.name: (e.shape, "float") for e in entries}
    vd, v = cfg.output_vocab_size, cfg.vocab_size
    if "d2t" in w.headers or vd != v:
        expected["d2t"] = ((vd,), "int")
    if "t2d" in w.headers:
        expected["t2d"] = ((v,), "bool")
    problems = _check(w, expected)
    if not has_embed and target is None:
        problems.insert(0, "missing tensor 'embed_tokens.weight': this head shares the "
                           "target's embedding, pass target=")
    if from_target:
        problems = _target_lm_head_problems(problems, w, vd, v, target)
    if problems:
        raise CheckpointError(d, problems)
    hot = _hot_token_ids(d, w, v, vd)
    dt = _pick_dtype(dtype, extras, w, "fc.weight")

    def same_embedding() -> bool:
        return torch.equal(w.read("embed_tokens.weight").to(target.embed_tokens.device,
                                                             target.dtype),
                           target.embed_tokens.data)

    # shared: no embedding of its own (none shipped, or one equal to the read target's)
    shared = target is not None and (not has_embed or (target_read and same_embedding()))
    lm = getattr(target, "lm_head", None)
    if from_target and (lm is None or tuple(lm.shape) != (v, cfg.hidden_size)):
        raise ValueError(f"target: its lm_head must be [{v}, {cfg.hidden_size}] (the head's "
                         f"vocab_size, hidden_size) for {LM_HEAD_KEY} 'target' in {where}, "
                         f"got {None if lm is None else tuple(lm.shape)}")
    with torch.device(device):
        head = Eagle3DraftHead(cfg, dt, embed_tokens=target.embed_tokens.data if shared else None,
                               hot_token_ids=hot.to(device) if hot is not None else None,
                               lm_head_source=lm_source)
    if shared:
        head.embed_tokens = target.embed_tokens
        entries = [e for e in entries if e.param != "embed_tokens"]
    decide = target is not None and has_embed and not target_read

    def fill() -> None:
        todo = entries
        if decide and same_embedding():
            head.embed_tokens = target.embed_tokens  # its own copy is dropped
            todo = [e for e in entries if e.param != "embed_tokens"]
        _fill(head, w, todo)
        if from_target:  # the target's rows (its own fill ran first in open_model_pair)
            head.tie_lm_head_(target.lm_head)

    return head.to(device), fill, w.files


def prefetch(files: Sequence[Path]) -> None:
    """Ask the kernel to read `files` into the page cache ahead of use
    (`posix_fadvise(WILLNEED)`; nothing where the platform lacks it). More reads in flight
    than one reader's page faults keep: a cold checkpoint is read closer to the disk's rate."""
    if not hasattr(os, "posix_fadvise"):
        return
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


class PendingWeights:
    """The weights `open_model_pair` has not read yet: the files stay open (every header was
    checked), and `read()` copies each tensor into the parameters the modules already hold,
    in place, so an engine built on them stays valid (its buffers, its KV pool, a compile
    phase started meanwhile: none reads a weight). `read()` runs once; `close()` (or a
    failed read) releases the files."""

    def __init__(self, stack: contextlib.ExitStack, fills: list[Callable[[], None]],
                 files: Sequence[Path] = ()) -> None:
        self._stack, self._fills, self._files = stack, fills, tuple(files)
        self.read_s: float | None = None
        """Seconds `read()` took (None before)."""

    def read(self) -> None:
        """Fill the modules' weights (tensor by tensor, in file order), the files' pages
        asked of the kernel ahead of the reads (`prefetch`)."""
        if self.read_s is not None:
            raise RuntimeError("PendingWeights.read: the weights were read already")
        if not self._fills:
            raise RuntimeError("PendingWeights.read: closed before the weights were read")
        t0 = time.perf_counter()
        threading.Thread(target=prefetch, args=(self._files,), name="graphdraft-prefetch",
                         daemon=True).start()
        try:
            for fill in self._fills:
                fill()
        finally:
            self.close()
        self.read_s = time.perf_counter() - t0

    def close(self) -> None:
        self._fills = []
        self._stack.close()

    def __enter__(self) -> PendingWeights:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load_model_pair(target_path: str | os.PathLike, draft_path: str | os.PathLike,
                    dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu", *,
                    aux_ids_convention: str | None = None
                    ) -> tuple[LlamaForCausalLM, Eagle3DraftHead, CheckpointInfo]:
    """Load a target and its EAGLE-3 head -> (target, head, target info).

    The target captures the layers the head's config names (`eagle_aux_hidden_state_layer_ids`);
    without them, the target config's ids, else the default [2, L//2, L-3].
    """
    target, head, info, weights = open_model_pair(target_path, draft_path, dtype, device,
                                                  aux_ids_convention=aux_ids_convention)
    weights.read()
    return target, head, info


def open_model_pair(target_path: str | os.PathLike, draft_path: str | os.PathLike,
                    dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu", *,
                    aux_ids_convention: str | None = None
                    ) -> tuple[LlamaForCausalLM, Eagle3DraftHead, CheckpointInfo, PendingWeights]:
    """`load_model_pair` without reading the weights -> (target, head, target info, weights):
    both configs and every tensor header checked (the same errors), the modules built on
    `device` with uninitialised weights; `weights.read()` fills them. Between the two, engines
    can be built on the modules and their kernels compiled (`Engine.start_precompile`): the
    serving CLI reads a checkpoint while the precompile workers compile.

    A head that ships an embedding holds its own until `read()` finds it equal to the
    target's (then it shares the target's and its own is freed)."""
    head_cfg, head_extras = read_config(draft_path, aux_ids_convention=aux_ids_convention)
    ids = head_cfg.aux_hidden_state_layer_ids
    if ids is not None:
        tcfg, _ = read_config(target_path, aux_ids_convention=aux_ids_convention)
        _check_target_aux_ids(ids, tcfg.num_hidden_layers,
                              f"{Path(draft_path) / CONFIG_NAME}: {AUX_IDS_KEY} "
                              f"{list(head_extras.aux_layer_ids_raw)} read in the "
                              f"{head_extras.aux_layer_ids_convention!r} convention")
        if tcfg.aux_hidden_state_layer_ids not in (None, ids):
            log.warning("aux layer ids: the head names %s, the target config %s; using the head's",
                        list(ids), list(tcfg.aux_hidden_state_layer_ids))
    stack = contextlib.ExitStack()
    try:
        target, info, fill_target = _open_target(target_path, dtype, device, stack,
                                                 aux_layer_ids=ids,
                                                 aux_ids_convention=aux_ids_convention)
        k = len(target.aux_layer_ids)
        if head_cfg.num_aux_hidden_states != k:
            raise ValueError(f"{Path(draft_path) / CONFIG_NAME}: the head's fc takes "
                             f"{head_cfg.num_aux_hidden_states} target hidden states, the target "
                             f"captures {k} ({info.aux_layer_ids_source}: "
                             f"{list(target.aux_layer_ids)}); name them with {AUX_IDS_KEY}")
        head, fill_head, head_files = _open_head(draft_path, target, None, None, stack,
                                                 aux_ids_convention=aux_ids_convention,
                                                 target_read=False)
    except BaseException:
        stack.close()
        raise
    files = [*info.files, *(f for f in head_files if f not in info.files)]
    return target, head, info, PendingWeights(stack, [fill_target, fill_head], files)


# ---------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------
def _config_common(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling is not None else None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _tensors(module: torch.nn.Module, entries: list[_Entry]) -> dict[str, torch.Tensor]:
    params = dict(module.named_parameters())
    out = {}
    for e in entries:
        p = params[e.param].detach()
        if e.row == 0 and tuple(p.shape) == e.shape:
            out[e.name] = p.to("cpu").contiguous()
        else:  # a slice of a fused parameter: its own storage (safetensors refuses shared ones)
            out[e.name] = p[e.row: e.row + e.shape[0]].to("cpu").clone()
    return out


def _write_weights(d: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    """model.safetensors, or shards of at most `max_shard_bytes` (a larger tensor alone) + index.

    Stale weight files of graphdraft's names (model.safetensors, its index, model-*-of-*)
    in `d` are removed first, so a directory never mixes two checkpoints.
    """
    from safetensors.torch import save_file

    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: expected None or an int >= 1, got {max_shard_bytes!r}")
    for p in d.iterdir():
        if p.name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.match(p.name):
            p.unlink()
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    total = sum(sizes.values())
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in tensors.items():
        if max_shard_bytes is not None and shards[-1] and used + sizes[name] > max_shard_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += sizes[name]

    def write(name: str, part: dict[str, torch.Tensor]) -> None:
        tmp = d / (name + ".tmp")
        save_file(part, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, d / name)

    if len(shards) == 1:
        write(WEIGHTS_NAME, shards[0])
        return
    wmap = {}
    for i, part in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write(name, part)
        wmap.update(dict.fromkeys(part, name))
    _write_json(d / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": wmap})


def _aux_ids_for_config(ids: tuple[int, ...]) -> dict[str, Any]:
    return {AUX_IDS_KEY: list(ids), CONVENTION_KEY: "input"}


def _refuse_sharded(name: str, model: torch.nn.Module) -> None:
    if any(getattr(m, "tp", None) is not None for m in model.modules()):
        raise ValueError(f"{name}: sharded for tensor parallelism; save the full (unsharded) model")


def save_target(model: LlamaForCausalLM, path: str | os.PathLike, *,
                max_shard_bytes: int | None = None,
                eos_token_id: int | list[int] | None = None,
                bos_token_id: int | None = None) -> Path:
    """Write `model` as a Hugging Face Llama checkpoint (config.json + safetensors) -> the dir.

    Explicit aux layer ids are written as `eagle_aux_hidden_state_layer_ids` in the "input"
    convention (with `graphdraft_aux_layer_ids_convention: "input"`).
    """
    _refuse_sharded("model", model)
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    config = {"architectures": ["LlamaForCausalLM"], **_config_common(cfg, model.dtype),
              "tie_word_embeddings": cfg.tie_word_embeddings,
              "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    if cfg.aux_hidden_state_layer_ids is not None:
        config.update(_aux_ids_for_config(cfg.aux_hidden_state_layer_ids))
    _write_weights(d, _tensors(model, _target_layout(cfg)), max_shard_bytes)
    _write_json(d / CONFIG_NAME, config)
    return d


def save_eagle3_head(head: Eagle3DraftHead, path: str | os.PathLike,
                     include_embeddings: bool = False, *,
                     max_shard_bytes: int | None = None) -> Path:
    """Write `head` in the published EAGLE-3 layout (config.json + safetensors) -> the dir.

    `d2t`/`t2d` are written from `hot_token_ids` (none when the head has no draft vocab);
    `embed_tokens.weight` only with `include_embeddings` (else the loader shares the target's).
    A head whose `lm_head_source` is "target" is written without `lm_head.weight` and with
    `graphdraft_lm_head: "target"` (the loader gathers the target's rows again); an "own"
    head's config has no such key.
    """
    _refuse_sharded("head", head)
    cfg = head.config
    ids = cfg.aux_hidden_state_layer_ids
    if ids is None and cfg.num_aux_hidden_states != 3:
        raise ValueError(f"head: fc takes {cfg.num_aux_hidden_states} target hidden states but "
                         "config.aux_hidden_state_layer_ids is None: name the layers so the "
                         "checkpoint says which ones (the default is 3 layers)")
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], **_config_common(cfg, head.dtype),
              "draft_vocab_size": cfg.output_vocab_size, "tie_word_embeddings": False}
    if ids is not None:
        config["eagle_config"] = _aux_ids_for_config(ids)
    from_target = head.lm_head_source == "target"
    if from_target:
        config[LM_HEAD_KEY] = "target"
    tensors = _tensors(head, _head_layout(cfg, include_embeddings, include_lm_head=not from_target))
    if head.hot_token_ids is not None:
        hot = head.hot_token_ids.detach().to("cpu", torch.int64)
        tensors["d2t"] = hot - torch.arange(hot.numel(), dtype=torch.int64)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[hot] = True
        tensors["t2d"] = t2d
    _write_weights(d, tensors, max_shard_bytes)
    _write_json(d / CONFIG_NAME, config)
    return d
