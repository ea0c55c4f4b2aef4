"""Tokenizers: the one loader for a checkpoint directory's tokenizer, text <-> ids, streaming.

`load_tokenizer(model_dir)` returns
- `ByteLevelTokenizer` when the target's config.json says `"graphdraft_tokenizer": "bytes"`
  (the shipped toy pair, `graphdraft/io/bytes_tokenizer.py`);
- `PretrainedTokenizer` when the directory has a `tokenizer.json` (read with the `tokenizers`
  library; a GGUF converted by `graphdraft.io.gguf` writes one);
- None otherwise.
Either way `tokenizer_config.json` beside it (or `chat_template.jinja`) may carry a chat
template (`graphdraft/io/chat.py`), the special tokens it reads and `add_bos_token`.

`Tokenizer.eos_token_ids` are every id that ends a request: config.json's and
generation_config.json's `eos_token_id`, tokenizer_config.json's `eos_token`, and the chat
template's end-of-turn token (tokenizer_config.json's `graphdraft_end_of_turn_token`, else
the first of the usual end-of-turn tokens the template writes and the vocabulary holds).

`IncrementalDecoder` turns a request's ids, as they are accepted, into text that never ends
in half a character: a trailing replacement character is held back until the ids that
complete it arrive (or `flush()`).
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphdraft.io.bytes_tokenizer import BOS_ID, CONFIG_KEY, EOS_ID, VOCAB_SIZE, ByteTokenizer
from graphdraft.io.chat import ChatTemplate

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
END_OF_TURN_KEY = "graphdraft_end_of_turn_token"
"""tokenizer_config.json key naming the chat template's end-of-turn token (a stop token)."""
END_OF_TURN_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>",
                          "<|endoftext|>")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
REPLACEMENT = "\ufffd"


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: "<s>" or {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    items = value if isinstance(value, list) else [value]
    return [v for v in items if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


class Tokenizer(ABC):
    """Text <-> token ids of one checkpoint, its stop ids and its chat template."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    """Ids that end a request: EOS and the chat template's end-of-turn token."""
    chat_template: ChatTemplate | None

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`text` -> ids; `add_special_tokens` adds what the checkpoint adds (e.g. BOS)."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """ids -> text; bytes that are not valid UTF-8 (yet) become U+FFFD."""

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True
                            ) -> str:
        """The prompt text of `messages` (`[{"role", "content"}, ...]`) under the chat
        template; ValueError naming `messages` on a bad list, or saying the model has none."""
        if self.chat_template is None:
            raise ValueError("chat template: this model's tokenizer has none (no chat_template "
                             f"in {TOKENIZER_CONFIG_FILE} or {CHAT_TEMPLATE_FILE}); send plain "
                             "text prompts instead")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)


class ByteLevelTokenizer(Tokenizer):
    """The shipped toy pair's UTF-8 byte tokenizer (ids 0..255 bytes, BOS 256, EOS 257)."""

    def __init__(self, chat_template: ChatTemplate | None = None,
                 eos_token_ids: Sequence[int] = (EOS_ID,)) -> None:
        self._tok = ByteTokenizer()
        self.vocab_size, self.bos_token_id = VOCAB_SIZE, BOS_ID
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids)) or [EOS_ID]
        self.chat_template = chat_template

    def encode(self, text: str | bytes, add_special_tokens: bool = False) -> list[int]:
        """Also takes bytes (their own ids: held-out byte windows need not be valid UTF-8)."""
        if not isinstance(text, (str, bytes)):
            raise ValueError(f"text: expected a str, got {type(text).__name__}")
        return self._tok.encode(text, bos=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), errors="replace")


class PretrainedTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (a checkpoint's tokenizer.json) with its special tokens."""

    def __init__(self, backend: Any, eos_token_ids: Sequence[int], bos_token_id: int | None,
                 chat_template: ChatTemplate | None = None) -> None:
        self._tok = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template

    @property
    def backend(self) -> Any:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text: expected a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _chat_template(d: Path, tok_config: dict, specials: dict[str, str]) -> ChatTemplate | None:
    file = d / CHAT_TEMPLATE_FILE
    if file.is_file():
        return ChatTemplate(file.read_text(encoding="utf-8"), specials, str(file))
    source = tok_config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    return ChatTemplate(source, specials, f"{d / TOKENIZER_CONFIG_FILE}: chat_template")


def _end_of_turn(tok_config: dict, template: ChatTemplate | None, to_id) -> int | None:
    named = _token_text(tok_config.get(END_OF_TURN_KEY))
    if named is not None:
        return to_id(named)
    if template is None:
        return None
    for token in END_OF_TURN_CANDIDATES:
        if token in template.source and to_id(token) is not None:
            return to_id(token)
    return None


def _config_eos(d: Path, config: dict) -> list[int]:
    ids = _ids(config.get("eos_token_id"))
    gen = d / "generation_config.json"
    if gen.is_file():
        ids += _ids(_read_json(gen).get("eos_token_id"))
    return ids


def load_tokenizer(model_dir: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer of a target checkpoint directory (see the module docstring), or None
    when it has none. ValueError naming the file when one is there but unreadable."""
    d = Path(model_dir)
    config = _read_json(d / "config.json") if (d / "config.json").is_file() else {}
    tok_config_path = d / TOKENIZER_CONFIG_FILE
    tok_config = _read_json(tok_config_path) if tok_config_path.is_file() else {}
    specials = {name: t for name in SPECIAL_TOKEN_NAMES
                if (t := _token_text(tok_config.get(name))) is not None}
    template = _chat_template(d, tok_config, specials)
    eos = _config_eos(d, config)
    if config.get(CONFIG_KEY) == "bytes":
        return ByteLevelTokenizer(template, eos or [EOS_ID])
    file = d / TOKENIZER_FILE
    if not file.is_file():
        return None
    try:
        from tokenizers import Tokenizer as Backend
    except ImportError as e:
        raise ValueError(f"{file}: reading it needs the `tokenizers` package "
                         "(pip install tokenizers)") from e
    try:
        backend = Backend.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{file}: not a readable tokenizers file ({e})") from e
    to_id = backend.token_to_id
    if "eos_token" in specials and to_id(specials["eos_token"]) is not None:
        eos.append(to_id(specials["eos_token"]))
    eot = _end_of_turn(tok_config, template, to_id)
    if eot is not None:
        eos.append(eot)
    bos = _ids(config.get("bos_token_id"))
    if not bos and "bos_token" in specials and to_id(specials["bos_token"]) is not None:
        bos = [to_id(specials["bos_token"])]
    return PretrainedTokenizer(backend, eos, bos[0] if bos else None, template)


class IncrementalDecoder:
    """A request's ids -> its text, piece by piece, never splitting a multi-byte character.

    `push(ids)` returns the text the new ids complete; a trailing U+FFFD (bytes of a
    character whose rest has not come) waits for the next push; `flush()` returns what is
    left (with U+FFFD for bytes that never completed). The concatenation of every piece is
    `tokenizer.decode(all ids)` for tokenizers whose decoding is a concatenation of tokens
    (byte-level BPE, the byte tokenizer); only a small window of ids is decoded per push.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # the decode window is ids[_prefix:] (one push of context, then new)
        self._read = 0  # where the window starts once every id so far decoded cleanly
        self._sent = 0  # characters of decode(ids[_prefix:]) already returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self._decode(self.ids[self._prefix:])
        complete = text.rstrip(REPLACEMENT)
        piece = complete[self._sent:]
        self._sent = max(self._sent, len(complete))
        if complete == text:  # nothing pending: slide the window past the returned ids
            self._prefix, self._read = self._read, len(self.ids)
            self._sent = len(self._decode(self.ids[self._prefix:]))
        return piece

    def flush(self) -> str:
        text = self._decode(self.ids[self._prefix:])
        piece = text[self._sent:]
        self._prefix = self._read = len(self.ids)
        self._sent = 0
        return piece
