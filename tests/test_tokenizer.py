"""graphdraft.io.tokenizer on the shipped byte pair and on a small `tokenizers` BPE: the one
loader, encode / decode, EOS and end-of-turn ids, chat templates, streaming decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphdraft.io.bytes_tokenizer import BOS_ID, EOS_ID
from graphdraft.io.chat import ChatTemplate, ChatTemplateError, validate_messages
from graphdraft.io.tokenizer import (
    ByteLevelTokenizer,
    IncrementalDecoder,
    PretrainedTokenizer,
    load_tokenizer,
)

SHIPPED = Path(__file__).resolve().parents[1] / "graphdraft" / "assets" / "target"
SAMPLES = ["plain ascii", "héllo wörld ☃ 日本語 🙂", "  leading and   runs\n\n\ttabs ",
           "def f(x):\n    return x ** 2\n", "\u00e9\u0301 combining", ""]
IM_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
               "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_shipped_pair_is_byte_level_with_a_chat_template():
    tok = load_tokenizer(SHIPPED)
    assert isinstance(tok, ByteLevelTokenizer)
    assert tok.eos_token_ids == [EOS_ID] and tok.bos_token_id == BOS_ID
    assert tok.encode("ab") == [97, 98] and tok.encode("ab", add_special_tokens=True) == [
        BOS_ID, 97, 98]
    assert tok.has_chat_template
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "hi"}])
    assert text == "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"
    assert not tok.apply_chat_template([{"role": "user", "content": "x"}],
                                       add_generation_prompt=False).endswith("<|assistant|>\n")


@pytest.mark.parametrize("s", SAMPLES)
def test_byte_round_trip(s):
    tok = load_tokenizer(SHIPPED)
    assert tok.decode(tok.encode(s)) == s


@pytest.mark.parametrize("bad, field", [
    ("hello", "messages"), ([], "messages"), ([42], "messages[0]"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": 3}], "messages[1].content"),
    ([{"role": "user"}], "messages[0].content")])
def test_bad_messages_name_the_field(bad, field):
    tok = load_tokenizer(SHIPPED)
    with pytest.raises(ValueError, match=rf"^{field.replace('[', '.').replace(']', '.')}"):
        tok.apply_chat_template(bad)


def test_template_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for x in %}")
    t = ChatTemplate("{{ raise_exception('only user roles') }}")
    with pytest.raises(ChatTemplateError, match="only user roles"):
        t.render([{"role": "user", "content": "x"}])
    assert validate_messages(({"role": "user", "content": "x", "name": "n"},))[0]["name"] == "n"


def _bpe_dir(tmp_path: Path, template: str | None) -> Path:
    """A small byte-level BPE tokenizer.json trained here, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SAMPLES * 20 + ["the quick brown fox jumps over the lazy dog"] * 50,
                            trainer)
    d = tmp_path / "bpe"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 0, "bos_token_id": 1}))
    cfg = {"eos_token": "<|endoftext|>", "bos_token": "<|im_start|>"}
    if template is not None:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_pretrained_tokenizer_stops_on_eos_and_end_of_turn(tmp_path):
    tok = load_tokenizer(_bpe_dir(tmp_path, IM_TEMPLATE))
    assert isinstance(tok, PretrainedTokenizer)
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == [0, im_end]
    text = tok.apply_chat_template([{"role": "user", "content": "the fox"}])
    assert text == "<|im_start|>user\nthe fox<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == tok.token_to_id("<|im_start|>") and im_end in ids  # specials stay whole
    assert tok.decode(ids) == "user\nthe fox\nassistant\n"  # special tokens skipped
    assert tok.decode(ids, skip_special_tokens=False) == text
    for s in SAMPLES:
        assert tok.decode(tok.encode(s)) == s


def test_no_template_is_a_clear_error(tmp_path):
    tok = load_tokenizer(_bpe_dir(tmp_path, None))
    assert not tok.has_chat_template and tok.eos_token_ids == [0]
    with pytest.raises(ValueError, match="chat template: this model's tokenizer has none"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_tokenizer_and_broken_files(tmp_path):
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="tokenizer_config.json: expected a JSON object"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_incremental_decoder_never_splits_a_character(tmp_path, which):
    tok = load_tokenizer(SHIPPED if which == "bytes" else _bpe_dir(tmp_path, IM_TEMPLATE))
    text = "naïve café ☃ 日本語 🙂 the quick brown fox\n  done"
    ids = tok.encode(text)
    dec, pieces = IncrementalDecoder(tok), []
    for i in range(0, len(ids), 2):
        piece = dec.push(ids[i:i + 2])
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    assert sum(1 for p in pieces if p) > 5  # it streamed, not one piece at the end


def test_incremental_decoder_flushes_incomplete_bytes():
    tok = load_tokenizer(SHIPPED)
    dec = IncrementalDecoder(tok)
    assert dec.push(list("a☃".encode())[:-1]) == "a"
    assert dec.flush() == "\ufffd"
