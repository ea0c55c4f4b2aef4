"""Training text as token streams: the documents of `graphdraft.io.corpus` (the Python standard
library's sources and help topics, every machine has them offline), each encoded as
`[BOS] + utf-8 bytes + [EOS]` and concatenated; held-out documents kept apart for evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphdraft.io.bytes_tokenizer import BOS_ID, EOS_ID
from graphdraft.io.corpus import documents, heldout_prompts, is_held_out  # noqa: F401 (re-exported)


@dataclass
class Corpus:
    train: torch.Tensor          # int64 [N] ids of the training documents, concatenated
    heldout: torch.Tensor        # int64 [M] ids of the held-out documents
    train_docs: int
    heldout_docs: int
    heldout_names: list[str]

    def describe(self) -> str:
        return (f"{self.train_docs} training documents ({self.train.numel():,} bytes), "
                f"{self.heldout_docs} held out ({self.heldout.numel():,} bytes)")


def _concat(docs: list[bytes]) -> torch.Tensor:
    buf = bytearray()
    marks = []
    for d in docs:
        marks.append((len(buf), len(buf) + len(d) + 1))  # where BOS and EOS go
        buf += b"\0" + d + b"\0"
    if not buf:
        return torch.empty(0, dtype=torch.long)
    ids = torch.frombuffer(buf, dtype=torch.uint8).long()
    for b, e in marks:
        ids[b], ids[e] = BOS_ID, EOS_ID
    return ids


def load_corpus() -> Corpus:
    docs = documents()
    train = [d for n, d in docs if not is_held_out(n)]
    held = [(n, d) for n, d in docs if is_held_out(n)]
    return Corpus(_concat(train), _concat([d for _, d in held]), len(train), len(held),
                  [n for n, _ in held])


def sample_windows(ids: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`[batch, length]` windows at uniform random offsets of `ids`."""
    starts = torch.randint(0, ids.numel() - length, (batch,), generator=gen)
    return torch.stack([ids[s: s + length] for s in starts.tolist()])


def eval_windows(ids: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """`[count, length]` evenly spaced windows of `ids` (deterministic)."""
    step = max(1, (ids.numel() - length) // count)
    return torch.stack([ids[i * step: i * step + length] for i in range(count)])
