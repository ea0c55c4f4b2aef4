"""The offline text corpus: the Python standard library's own sources and help topics.

Documents: every `*.py` file under `sysconfig.get_paths()["stdlib"]` (minus site-packages,
the test suites and `__pycache__`), named by their path relative to the stdlib root, plus
every entry of `pydoc_data.topics.topics` (the language reference's help topics, English
prose), named `pydoc_data/topics/<key>`. A document is held out for evaluation when the
SHA-256 of its name is 0 mod 20 (about 5 %): deterministic, independent of the Python
version's file list, and the same rule on every machine. Each document is encoded as
`[BOS] + utf-8 bytes + [EOS]` and the documents are concatenated.

The runtime's demo draws its held-out prompts from here (`heldout_prompts`); training
(`graphdraft.train.data`) builds its token streams from the same documents.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Callable
from pathlib import Path

HOLDOUT_MOD = 20
_TOPICS_SOURCE = "pydoc_data/topics.py"  # its text is in the topic documents already
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % HOLDOUT_MOD == 0


def documents(select: Callable[[str], bool] | None = None) -> list[tuple[str, bytes]]:
    """(name, bytes) of every document whose name `select` accepts (all: None), sorted by name."""
    root = stdlib_root()
    docs = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        name = rel.as_posix()
        if (any(part in _SKIP_DIRS for part in rel.parts[:-1]) or name == _TOPICS_SOURCE
                or (select is not None and not select(name)) or not p.is_file()):
            continue
        docs.append((name, p.read_bytes()))
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a stripped interpreter: sources only
        topics = {}
    for k, v in topics.items():
        name = f"pydoc_data/topics/{k}"
        if select is None or select(name):
            docs.append((name, v.encode("utf-8")))
    return sorted(docs)


def heldout_prompts(count: int, length: int = 96, *, python_only: bool = True) -> list[bytes]:
    """`count` prompts of `length` bytes from held-out documents (deterministic).

    From each held-out document (in name order, Python sources first when `python_only`),
    the bytes starting at the first line start at or after a third of the document.
    """
    held = documents(is_held_out)
    if python_only:
        held = [x for x in held if x[0].endswith(".py")] or held
    out = []
    for _, d in held:
        start = d.find(b"\n", len(d) // 3) + 1
        chunk = d[start: start + length]
        if len(chunk) == length:
            out.append(chunk)
        if len(out) == count:
            break
    return out
