"""Every ```python block of README.md runs as written (in order, one namespace, from the
repository root, with the shipped pair on this machine's default device): the examples
cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(),
                    flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


def test_readme_python_blocks_run(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(BLOCKS):
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"README python block {i} failed: {type(e).__name__}: {e}\n{block}")
    out = capsys.readouterr().out
    assert "'mean'" in out and "'histogram'" in out
    # the library example serves real text with the shipped pair
    assert len(namespace["outputs"]) == 2 and all(len(o) == 32 for o in namespace["outputs"])
