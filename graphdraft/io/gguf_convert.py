"""GGUF -> a Hugging Face Llama directory the checkpoint loader reads (`graphdraft.io.checkpoint`).

A llama.cpp GGUF file (`general.architecture` "llama") holds the model's hyper-parameters,
its tensors (quantized or float) and its tokenizer (vocabulary, merges, pre-tokenizer type,
special token ids, chat template) as metadata. `convert_gguf(path, out_dir, dtype)` writes
  config.json             LlamaConfig fields (`tie_word_embeddings` when the file has no
                          `output.weight`), BOS / EOS ids
  generation_config.json  BOS / EOS ids
  model.safetensors       every tensor dequantized (`gguf.quants.dequantize`) to `dtype`, under
                          Hugging Face names; q_proj / k_proj rows un-permuted (llama.cpp's
                          converter interleaves each head's rotary halves; Hugging Face Llama
                          rotates the two halves of a head: the inverse permutation of
                          llama.cpp's `LlamaModel.permute`)
  tokenizer.json          a byte-level BPE built with the `tokenizers` library from the
                          vocabulary and merges, the pre-tokenizer of `tokenizer.ggml.pre`
                          (e.g. "smollm": single digits, then GPT-2's byte-level split) and the
                          control tokens as special tokens
  tokenizer_config.json   the chat template, special tokens, `add_bos_token`
  gguf_source.json        the source file's name, size and sha256 (the cache key)
`cached_conversion(path)` converts once into a cache directory (`GRAPHDRAFT_CACHE`, else
`~/.cache/graphdraft`, then `gguf/<name>-<sha256[:16]>-<dtype>`) and reuses it; a conversion
is written to a temporary directory and renamed into place, so a crash leaves no half cache.

A bad file is one `GGUFError` (a ValueError) naming it: not a GGUF file, another architecture,
a missing or mis-shaped tensor (all such problems listed together), an unsupported tensor
type, an unsupported tokenizer. Nothing is written then.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

GGUF_MAGIC = b"GGUF"
SOURCE_NAME = "gguf_source.json"
CACHE_ENV = "GRAPHDRAFT_CACHE"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER_TENSORS = {  # GGUF name in block i -> Hugging Face name in layer i
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj"}
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {  # tokenizer.ggml.pre -> (split digits one by one first, split regex)
    "default": (False, _GPT2_SPLIT), "gpt2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT), "starcoder": (True, _GPT2_SPLIT),
    "refact": (True, _GPT2_SPLIT), "codeshell": (True, _GPT2_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT), "llama3": (False, _LLAMA3_SPLIT),
    "llama-v3": (False, _LLAMA3_SPLIT)}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class GGUFError(ValueError):
    """A GGUF file that cannot be converted; the message names the file and the problem."""


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file says, read once: its metadata, tensors and the HF config it implies."""

    path: Path
    reader: Any  # gguf.GGUFReader
    config: dict
    """config.json of the converted directory."""
    tensors: dict[str, Any]
    """GGUF tensor name -> `gguf.ReaderTensor`."""


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise GGUFError("reading a GGUF file needs the `gguf` package (pip install gguf)") from e
    return gguf


def _field(reader: Any, key: str, default: Any = ...) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise GGUFError(f"{reader.path}: metadata key {key!r} is missing")
        return default
    return f.contents()


def _dequantizable(gguf: Any) -> set:
    """The tensor types `gguf.quants.dequantize` implements (probed once on one zero block)."""
    if not hasattr(_dequantizable, "types"):
        ok = set()
        for qt in gguf.GGMLQuantizationType:
            block, size = gguf.GGML_QUANT_SIZES[qt]
            arr = (np.zeros((1, block), np.float32 if qt.name == "F32" else np.float16)
                   if qt.name in ("F32", "F16") else np.zeros((1, size), np.uint8))
            try:
                gguf.quants.dequantize(arr, qt)
                ok.add(qt)
            except Exception:  # noqa: BLE001 -- NotImplementedError, QuantError, ...
                pass
        _dequantizable.types = ok
    return _dequantizable.types


def read_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open and check a Llama GGUF (header, architecture, tensor names, shapes and types);
    GGUFError naming the file and every problem found. No tensor data is read."""
    p = Path(path)
    if not p.is_file():
        raise GGUFError(f"{p}: not a file (expected a .gguf model file)")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{p}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # noqa: BLE001 -- the reader raises ValueError / struct errors
        raise GGUFError(f"{p}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"{p}: general.architecture is {arch!r}; graphdraft converts Llama "
                        "models only ('llama')")
    config = _config(reader, p)
    tensors = {t.name: t for t in reader.tensors}
    _check_tensors(p, tensors, config, _dequantizable(gguf))
    return GGUFModel(p, reader, config, tensors)


def _config(reader: Any, p: Path) -> dict:
    def num(key: str, default: Any = ...) -> Any:
        return _field(reader, f"llama.{key}", default)

    heads = int(num("attention.head_count"))
    hidden = int(num("embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(num("vocab_size", len(tokens.data) if tokens is not None else 0))
    if "rope.scaling.type" in {k.removeprefix("llama.") for k in reader.fields} and \
            _field(reader, "llama.rope.scaling.type") not in ("none", None):
        raise GGUFError(f"{p}: llama.rope.scaling.type "
                        f"{_field(reader, 'llama.rope.scaling.type')!r} is not supported")
    bos = _field(reader, "tokenizer.ggml.bos_token_id", None)
    eos = _field(reader, "tokenizer.ggml.eos_token_id", None)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": int(num("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(num("attention.head_count_kv", heads)),
        "head_dim": int(num("rope.dimension_count", hidden // heads)),
        "num_hidden_layers": int(num("block_count")), "vocab_size": vocab,
        "rms_norm_eps": float(num("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(num("rope.freq_base", 10000.0)), "rope_scaling": None,
        "max_position_embeddings": int(num("context_length")),
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in {t.name for t in reader.tensors},
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
    }


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> the Hugging Face shape `[out, in]` it must dequantize to."""
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["output.weight"] = (v, h)
    per_layer = {"attn_norm": (h,), "ffn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h),
                 "attn_v": (kv, h), "attn_output": (h, q), "ffn_gate": (f, h), "ffn_up": (f, h),
                 "ffn_down": (h, f)}
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"blk.{i}.{k}.weight": s for k, s in per_layer.items()}
    return shapes


def _hf_shape(t: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape as Hugging Face writes it (GGUF lists ne0 = the inner dim first)."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def _check_tensors(p: Path, tensors: dict, config: dict, supported: set) -> None:
    from graphdraft.io.checkpoint import CheckpointError
    problems = []
    shapes = expected_shapes(config)
    for name, shape in shapes.items():
        t = tensors.get(name)
        if t is None:
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
        elif _hf_shape(t) != shape:
            problems.append(f"{name}: shape {list(_hf_shape(t))}, expected {list(shape)}")
        elif t.tensor_type not in supported:
            problems.append(f"{name}: tensor type {t.tensor_type.name} is not supported (gguf "
                            f"dequantizes {', '.join(sorted(s.name for s in supported))})")
    ignored = ("rope_freqs.weight",)
    extra = sorted(set(tensors) - set(shapes) - set(ignored))
    problems += [f"unexpected tensor {n}" for n in extra[:10]]
    if "rope_freqs.weight" in tensors:
        problems.append("rope_freqs.weight: RoPE frequency factors (Llama-3.1 scaling) are "
                        "not supported by the converter")
    if problems:
        raise GGUFError(str(CheckpointError(p, problems)))


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order -> Hugging Face's: w `[heads * D, in]`.

    llama.cpp stores each head's rows as interleaved pairs (r0, r_{D/2}, r1, r_{D/2+1}, ...);
    Hugging Face keeps the two rotary halves apart. The inverse of llama.cpp's
    `w.reshape(heads, 2, D // 2, in).swapaxes(1, 2)`.
    """
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized(model: GGUFModel, name: str) -> np.ndarray:
    """One tensor as float32 in Hugging Face row order `[out, in]`."""
    gguf = _gguf()
    t = model.tensors[name]
    try:
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    except Exception as e:  # noqa: BLE001 -- a corrupt block
        raise GGUFError(f"{model.path}: {name}: cannot dequantize {t.tensor_type.name} "
                        f"({type(e).__name__}: {e})") from e
    w = w.reshape(_hf_shape(t))
    if name.endswith("attn_q.weight"):
        w = unpermute_rotary(w, model.config["num_attention_heads"])
    elif name.endswith("attn_k.weight"):
        w = unpermute_rotary(w, model.config["num_key_value_heads"])
    return w


def hf_name(gguf_name: str) -> str:
    fixed = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    _, i, kind, _ = gguf_name.split(".")
    return f"model.layers.{i}.{_LAYER_TENSORS[kind]}.weight"


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------
def build_tokenizer(model: GGUFModel) -> Any:
    """The file's byte-level BPE as a `tokenizers.Tokenizer` (GGUFError for other kinds)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    r, p = model.reader, model.path
    kind = _field(r, "tokenizer.ggml.model", None)
    if kind != "gpt2":
        raise GGUFError(f"{p}: tokenizer.ggml.model is {kind!r}; the converter builds "
                        "byte-level BPE tokenizers ('gpt2') only")
    pre = _field(r, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{p}: tokenizer.ggml.pre {pre!r} is not supported (supported: "
                        f"{', '.join(sorted(PRE_TOKENIZERS))})")
    tokens = [str(t) for t in _field(r, "tokenizer.ggml.tokens")]
    merges = [tuple(str(m).split(" ", 1)) for m in _field(r, "tokenizer.ggml.merges")]
    types = list(_field(r, "tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{p}: tokenizer.ggml.tokens repeats a token")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    digits, split = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    return tok


def tokenizer_config(model: GGUFModel) -> dict:
    """tokenizer_config.json: chat template, special tokens, add_bos / add_eos, end of turn."""
    r = model.reader
    tokens = _field(r, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        i = _field(r, f"tokenizer.ggml.{key}", None)
        return str(tokens[int(i)]) if i is not None and 0 <= int(i) < len(tokens) else None

    cfg = {"tokenizer_class": "PreTrainedTokenizerFast",
           "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
           "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
           "add_bos_token": bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
           "add_eos_token": bool(_field(r, "tokenizer.ggml.add_eos_token", False)),
           "model_max_length": model.config["max_position_embeddings"]}
    eot = token("eot_token_id")
    if eot is not None:
        cfg["graphdraft_end_of_turn_token"] = eot
    template = _field(r, "tokenizer.chat_template", None)
    if template is not None:
        cfg["chat_template"] = str(template)
    return {k: v for k, v in cfg.items() if v is not None}


def _bos_post_processor(tok: Any, cfg: dict) -> None:
    """`add_special_tokens=True` adds BOS (and EOS) when the file says llama.cpp adds them."""
    from tokenizers import processors
    bos, eos = cfg.get("bos_token"), cfg.get("eos_token")
    pre = [bos] if cfg.get("add_bos_token") and bos else []
    post = [eos] if cfg.get("add_eos_token") and eos else []
    if pre or post:
        single = " ".join([*pre, "$A", *post])
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} $B", special_tokens=[
                (t, tok.token_to_id(t)) for t in dict.fromkeys(pre + post)])


# ---------------------------------------------------------------------------
# Writing, caching
# ---------------------------------------------------------------------------
def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike,
                 dtype: str = "float32", sha256: str | None = None) -> Path:
    """Write the Hugging Face directory of a Llama GGUF (module docstring) -> `out_dir`.

    `dtype`: "float32", "bfloat16" or "float16" (the dequantized weights' dtype). Every check
    runs before anything is written."""
    from safetensors.torch import save_file
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    model = read_gguf(path)
    tok = build_tokenizer(model)
    tok_cfg = tokenizer_config(model)
    _bos_post_processor(tok, tok_cfg)
    tensors = {hf_name(n): torch.from_numpy(dequantized(model, n)).to(DTYPES[dtype]).contiguous()
               for n in expected_shapes(model.config)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = dict(model.config, torch_dtype=dtype)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tok_cfg)
    p = model.path
    _write_json(out / SOURCE_NAME, {"file": p.name, "bytes": p.stat().st_size,
                                    "sha256": sha256 or file_sha256(p), "dtype": dtype})
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "graphdraft"


def cached_conversion(path: str | os.PathLike, dtype: str = "float32",
                      cache_dir: str | os.PathLike | None = None) -> Path:
    """The converted directory of `path` in the cache, converting it on first use (keyed by
    the file's sha256 and `dtype`; a directory whose gguf_source.json matches is reused)."""
    p = Path(path)
    if not p.is_file():
        raise GGUFError(f"{p}: not a file (expected a .gguf model file)")
    sha = file_sha256(p)
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "gguf"
    d = root / f"{p.stem}-{sha[:16]}-{dtype}"
    src = d / SOURCE_NAME
    if src.is_file():
        try:
            if json.loads(src.read_text(encoding="utf-8")).get("sha256") == sha:
                return d
        except (OSError, json.JSONDecodeError):
            pass
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}-", dir=root))
    try:
        convert_gguf(p, tmp, dtype, sha256=sha)
        if d.exists():
            shutil.rmtree(d)
        os.replace(tmp, d)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return d


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True for a file that starts with the GGUF magic (a directory or other file: False)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def main(argv: list[str] | None = None) -> int:
    """`python -m graphdraft.io.gguf_convert FILE.gguf [--out DIR] [--dtype D]`: convert
    (into the cache without --out) and print the directory."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m graphdraft.io.gguf_convert",
                                 description="Convert a Llama GGUF into a Hugging Face directory")
    ap.add_argument("gguf", help="the .gguf file")
    ap.add_argument("--out", default=None, help="output directory (default: the cache)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    a = ap.parse_args(argv)
    try:
        d = convert_gguf(a.gguf, a.out, a.dtype) if a.out else cached_conversion(a.gguf, a.dtype)
    except ValueError as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    print(d)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
