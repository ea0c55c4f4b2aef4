"""The byte-level tokenizer of graphdraft's shipped model pair (`graphdraft/assets/`).

Ids 0..255 are the bytes of the UTF-8 text, 256 is BOS (start of a document), 257 is EOS
(end of a document); ids 258..263 exist only to pad the vocabulary to 264 rows (a multiple
of 8, which bf16 GEMMs on a GPU like) and never occur in training data.
"""

from __future__ import annotations

BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 264
"""Rows of the embedding and LM head: 256 bytes + BOS + EOS, padded to a multiple of 8."""
CONFIG_KEY = "graphdraft_tokenizer"
"""A target's config.json names this tokenizer with `"graphdraft_tokenizer": "bytes"`."""


class ByteTokenizer:
    """UTF-8 bytes <-> ids; `decode` drops the special ids and replaces invalid UTF-8."""

    bos_id, eos_id, vocab_size = BOS_ID, EOS_ID, VOCAB_SIZE

    def encode(self, text: str | bytes, *, bos: bool = False, eos: bool = False) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return ([BOS_ID] if bos else []) + list(data) + ([EOS_ID] if eos else [])

    def decode(self, ids: list[int], errors: str = "replace") -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors=errors)
