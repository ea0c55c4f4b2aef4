"""A precompile plan's entry: one specialization key as data a worker compiles from.

`PlanEntry` holds the kernel's name and its first launch's arguments as JSON data
(`encode_arg`: a tensor as its dtype and 16-byte alignment, scalars as they are);
`decode_arg` turns them back into what Triton's key reads (`MockTensor`-like pointers), so a
worker compiles the entry with `JITFunction.warmup` and no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphdraft.startup.forwards import Task

__all__ = ["PlanEntry", "decode_arg", "encode_arg"]


@dataclass(frozen=True)
class PlanEntry:
    """One distinct specialization key of the plan: `kernel` (`kernels.keys.all_kernels()` name),
    its first launch's arguments as JSON data (`encode_arg`), and the first capture task that
    launches it (engine index among the planned engines, then the `Task`; a prefill probe's
    where no capture does)."""

    kernel: str
    args: list
    kwargs: dict
    engine: int
    task: Task

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "args": self.args, "kwargs": self.kwargs,
                "engine": self.engine, "task": list(self.task)}

    @classmethod
    def from_json(cls, d: dict) -> PlanEntry:
        family, k, bs = d["task"]
        return cls(d["kernel"], d["args"], d["kwargs"], int(d["engine"]),
                   (str(family), None if k is None else int(k), int(bs)))


def encode_arg(v):
    """A launch argument as JSON data: a tensor as {"tensor": dtype name, "aligned": its
    pointer % 16 == 0} (all Triton's key reads of it), None / bool / int / float / str as
    they are. TypeError for anything else (the key could not be rebuilt from it)."""
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype).removeprefix("torch."), "aligned": v.data_ptr() % 16 == 0}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"precompile plan: cannot encode a launch argument of type "
                    f"{type(v).__name__} ({v!r})")


def decode_arg(v):
    """`encode_arg`'s inverse for Triton's key: a tensor becomes a `MockTensor` of its dtype
    whose `data_ptr()` has its alignment (0 or 8); scalars stay."""
    if isinstance(v, dict):
        return _MockPointer(getattr(torch, v["tensor"]), bool(v["aligned"]))
    return v


class _MockPointer:
    """Stands for a tensor in `JITFunction.warmup` (Triton's `MockTensor` with a chosen
    alignment): Triton reads a pointer argument's dtype and `data_ptr() % 16` for its key."""

    def __init__(self, dtype: torch.dtype, aligned: bool) -> None:
        self.dtype = dtype
        self.shape = [1]
        self._ptr = 0 if aligned else 8

    def data_ptr(self) -> int:
        return self._ptr

    @staticmethod
    def ptr_range() -> int:
        return 0

    @staticmethod
    def stride() -> tuple[int, ...]:
        return (1,)
