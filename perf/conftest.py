"""perf/ fixtures: the 8B-shaped head, the copy bandwidth and the group cache, once per session.

Without CUDA every test under perf/ is skipped (collection still imports the
modules, which need no GPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from perf.cases import cases_from_env
from perf.draft_group import GroupCache
from perf.models_8b import LLAMA31_8B_HEAD, build_head
from perf.timing import copy_bandwidth

HAS_CUDA = torch.cuda.is_available()
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="perf suite needs a CUDA GPU")
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device_info() -> dict[str, Any]:
    """GPU name, library versions and the measured copy bandwidth (bytes/s, read + written)."""
    import triton

    bw = copy_bandwidth("cuda")
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "copy_bw": bw}
    print(f"\n[perf] {info['gpu']}: copy bandwidth {bw / 1e12:.2f} TB/s")
    return info


@pytest.fixture(scope="session")
def head() -> torch.nn.Module:
    """The EAGLE-3 head shaped for Llama-3.1-8B, random bf16 weights, built once."""
    return build_head(LLAMA31_8B_HEAD, "cuda")


@pytest.fixture(scope="session")
def groups(head: torch.nn.Module) -> Iterator[GroupCache]:
    cache = GroupCache(head, cases_from_env())
    yield cache
    cache.close()
