"""graphdraft.io.gguf_convert on a tiny Llama GGUF this test writes with `gguf.GGUFWriter`
(random weights, a small byte-level BPE vocabulary, Q4_1 / Q8_0 / F32 tensors in
llama.cpp's Q/K row order): logits equal transformers' own GGUF load in fp32, the tokenizer
equals transformers' GGUF tokenizer, the converted directory loads and serves, the cache is
reused, and every bad file is one error naming it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from graphdraft.io.checkpoint import load_target  # noqa: E402
from graphdraft.io.gguf_convert import (  # noqa: E402
    GGUFError,
    cached_conversion,
    convert_gguf,
    is_gguf_file,
    read_gguf,
)
from graphdraft.io.tokenizer import PretrainedTokenizer, load_tokenizer  # noqa: E402
from graphdraft.train.forward import target_forward  # noqa: E402

SHAPE = dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, context=256)
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
            "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEXT = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
        "for i in range(10):\n    print(i * 2)\n", "naïve café — 日本語 🙂", "x = 12345 + 678"]
Q = gguf.GGMLQuantizationType


def _bpe() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (ids 0..2 ChatML specials) and its merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=448, special_tokens=[
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXT * 30, trainer)
    spec = json.loads(tok.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return [t for t, _ in vocab], merges


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face q/k rows -> llama.cpp's (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_tiny_gguf(path: Path, *, arch: str = "llama", tied: bool = True, seed: int = 0,
                    drop: str | None = None, reshape: str | None = None,
                    int_tensor: str | None = None, tokenizer_model: str = "gpt2") -> Path:
    """A 2-layer Llama GGUF: token_embd Q8_0, matrices Q4_1, norms F32 (options break it)."""
    tokens, merges = _bpe()
    s, rng = SHAPE, np.random.default_rng(seed)
    h, d = s["hidden"], s["hidden"] // s["heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(s["layers"])
    w.add_context_length(s["context"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)

    def add(name: str, shape: tuple[int, ...], qtype, scale: float = 0.2) -> None:
        if name == drop:
            return
        if name == reshape:
            shape = (shape[0] + 32, *shape[1:])
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 1:
            x = 1.0 + 0.1 * x
        if ".attn_q." in name:
            x = _permute(x, s["heads"])
        elif ".attn_k." in name:
            x = _permute(x, s["kv_heads"])
        if name == int_tensor:
            w.add_tensor(name, (x * 100).astype(np.int32))
        elif qtype == Q.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    v, f, kv = len(tokens), s["ffn"], s["kv_heads"] * d
    add("token_embd.weight", (v, h), Q.Q8_0, 1.0)
    for i in range(s["layers"]):
        for name, shape in (("attn_norm", (h,)), ("attn_q", (h, h)), ("attn_k", (kv, h)),
                            ("attn_v", (kv, h)), ("attn_output", (h, h)), ("ffn_norm", (h,)),
                            ("ffn_gate", (f, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))):
            add(f"blk.{i}.{name}.weight", shape, Q.F32 if len(shape) == 1 else Q.Q4_1)
    add("output_norm.weight", (h,), Q.F32)
    if not tied:
        add("output.weight", (v, h), Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.parametrize("tied", [True, False])
def test_logits_equal_transformers_gguf_load(tmp_path, tied):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM
    src = write_tiny_gguf(tmp_path / "m.gguf", tied=tied, seed=int(tied))
    out = convert_gguf(src, tmp_path / "hf", "float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is tied and cfg["rope_theta"] == 100000.0
    ours, _ = load_target(out, torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                              dtype=torch.float32).eval()
    assert max_logit_diff(ours, hf, load_tokenizer(out), TEXT) < 1e-4


def max_logit_diff(ours, hf, tok, texts: list[str]) -> float:
    """max |logits| difference of our target and transformers' model over `texts` (printed)."""
    worst = 0.0
    for text in texts:
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            a, _ = target_forward(ours, ids, capture_aux=False)
            b = hf(ids).logits
        worst = max(worst, (a - b).abs().max().item())
    print(f"max |logit diff| vs transformers' GGUF load: {worst:.2e}")
    return worst


def test_tokenizer_equals_transformers_gguf_tokenizer(tiny, tmp_path):
    from transformers import AutoTokenizer
    out = convert_gguf(tiny, tmp_path / "hf")
    ours = load_tokenizer(out)
    theirs = AutoTokenizer.from_pretrained(str(tiny.parent), gguf_file=tiny.name)
    assert isinstance(ours, PretrainedTokenizer) and ours.eos_token_ids == [2]
    for text in TEXT + ["<|im_start|>user\nhi<|im_end|>", "  \n\n\t x  ", "a1b22c333"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == theirs.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def test_bfloat16_conversion_and_the_directory_serves(tiny, tmp_path):
    from graphdraft.config import RuntimeConfig
    from graphdraft.serving.engine import Engine
    from graphdraft.serving.verify import SamplingParams
    out = convert_gguf(tiny, tmp_path / "bf16", "bfloat16")
    model, _ = load_target(out, None, "cpu")
    assert model.dtype == torch.bfloat16
    cfg = RuntimeConfig(max_running_requests=2, max_context_len=64, cuda_graph_max_bs=2,
                        num_kv_pages=16, dtype="float32", device="cpu", kernel_backend="torch")
    target, _ = load_target(out, torch.float32, "cpu")
    tok = load_tokenizer(out)
    (o,) = Engine(target, cfg, eos_token_id=2).generate(
        [tok.encode("def add(a, b):")], SamplingParams(max_new_tokens=6))
    assert 0 < len(o) <= 6


def test_cache_converts_once(tiny, tmp_path, monkeypatch):
    import graphdraft.io.gguf_convert as gc
    d1 = cached_conversion(tiny, cache_dir=tmp_path / "cache")
    assert (d1 / "model.safetensors").is_file() and is_gguf_file(tiny) and not is_gguf_file(d1)
    src = json.loads((d1 / "gguf_source.json").read_text())
    assert src["file"] == "tiny.gguf" and len(src["sha256"]) == 64

    def boom(*a, **k):
        raise AssertionError("converted again")
    monkeypatch.setattr(gc, "convert_gguf", boom)
    assert cached_conversion(tiny, cache_dir=tmp_path / "cache") == d1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [d1.name]  # no temporary left


@pytest.mark.parametrize("kind, needle", [
    ("text", "not a GGUF file"),
    ("arch", "general.architecture is 'gpt2'"),
    ("missing", "missing tensor blk.1.ffn_up.weight (expected shape [128, 64])"),
    ("shape", "blk.0.attn_v.weight: shape [64, 64], expected [32, 64]"),
    ("quant", "blk.0.attn_norm.weight: tensor type I32 is not supported"),
    ("tokenizer", "tokenizer.ggml.model is 'llama'"),
    ("truncated", "not a readable GGUF file"),
])
def test_bad_files_are_one_named_error(tmp_path, kind, needle):
    p = tmp_path / "bad.gguf"
    if kind == "text":
        p.write_text("hello, not a model\n")
    elif kind == "truncated":
        data = write_tiny_gguf(tmp_path / "ok.gguf").read_bytes()
        p.write_bytes(data[:200])
    else:
        write_tiny_gguf(p, arch="gpt2" if kind == "arch" else "llama",
                        drop="blk.1.ffn_up.weight" if kind == "missing" else None,
                        reshape="blk.0.attn_v.weight" if kind == "shape" else None,
                        int_tensor="blk.0.attn_norm.weight" if kind == "quant" else None,
                        tokenizer_model="llama" if kind == "tokenizer" else "gpt2")
    out = tmp_path / "out"
    with pytest.raises(GGUFError) as e:
        convert_gguf(p, out)
    assert str(p) in str(e.value) and needle in str(e.value), str(e.value)
    assert not out.exists()  # nothing written


def test_read_gguf_lists_every_problem_at_once(tmp_path):
    p = write_tiny_gguf(tmp_path / "two.gguf", drop="blk.0.ffn_gate.weight",
                       reshape="blk.1.attn_q.weight")
    with pytest.raises(GGUFError, match=r"2 problems") as e:
        read_gguf(p)
    assert "blk.0.ffn_gate.weight" in str(e.value) and "blk.1.attn_q.weight" in str(e.value)
    with pytest.raises(ValueError, match="dtype: expected one of"):
        convert_gguf(p, tmp_path / "x", "int8")
