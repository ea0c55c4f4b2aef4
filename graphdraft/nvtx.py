"""NVTX ranges around hot regions (no-ops without CUDA). Usable as decorator or `with` block."""

from __future__ import annotations

import contextlib

import torch

_ENABLED = torch.cuda.is_available()


class nvtx_range(contextlib.ContextDecorator):  # noqa: N801 - reads like a function
    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> nvtx_range:
        if _ENABLED:
            torch.cuda.nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc) -> bool:
        if _ENABLED:
            torch.cuda.nvtx.range_pop()
        return False
