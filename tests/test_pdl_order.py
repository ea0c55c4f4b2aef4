"""The PDL early-load rule (`graphdraft.kernels.pdl`), checked on the real launch order.

A kernel that takes `EARLY` loads some of its inputs before waiting for the kernel launched
just before it, which may still be running; those inputs must not be written by that kernel.
Under Triton's interpreter every launch is traced: the tensors each launch changed (compared
byte for byte before and after it) and, for the early-loading kernels, the tensors they read
before the wait. The drafter (decode and mixed batches, 3 and 4 draft steps) and the engine
(target prefill, verify and draft) must never give an early-loading kernel an early input that
the launch before it wrote.
"""

from __future__ import annotations

import pytest
import torch
from triton.runtime import interpreter

from graphdraft.engine import Engine
from graphdraft.verify import SamplingParams
from tests.drafter_harness import FakeServingLoop, make_setup
from tests.engine_harness import make_models, runtime

EARLY_READS = {
    "_decode_split_kernel": ("req_ptr", "lens_ptr", "page_ptr", "q_index_ptr if Q_INDEX"),
    "_decode_combine_kernel": ("lens_ptr",),
    "_rope_store_kernel": ("pos_ptr", "loc_ptr", "cs_ptr"),
    "_uniform_kernel": ("req_pool_ptr", "start_ptr", "req_to_page_ptr"),
    "_advance_kernel": ("seq_lens_ptr", "positions_ptr"),
}
"""Kernel -> the pointer arguments it loads before its PDL wait when EARLY ("arg if FLAG": only
when the constexpr FLAG is set)."""


def _span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    lo = t.data_ptr() + sum(min(0, s) * (n - 1) for s, n in zip(t.stride(), t.shape, strict=True)) * t.element_size()
    hi = t.data_ptr() + (sum(max(0, s) * (n - 1) for s, n in zip(t.stride(), t.shape, strict=True)) + 1) * t.element_size()
    return lo, hi


@pytest.fixture
def launches(monkeypatch):
    """Every interpreted launch in order: (kernel name, {arg: tensor or constexpr}, spans it
    changed, EARLY)."""
    trace: list[tuple[str, dict, list, bool]] = []
    run = interpreter.InterpretedFunction.run

    def traced(self, *args, grid, warmup, **kwargs):
        named = dict(zip(self.arg_names, args, strict=False)) | kwargs
        tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
        before = {k: v.clone() for k, v in tensors.items()}
        out = run(self, *args, grid=grid, warmup=warmup, **kwargs)
        changed = [_span(v) for k, v in tensors.items()
                   if not torch.equal(before[k].nan_to_num(), v.nan_to_num())
                   or (before[k].isnan() != v.isnan()).any()]
        trace.append((self.__name__, tensors | {k: v for k, v in named.items() if k.isupper()},
                      changed, bool(named.get("EARLY", False))))
        return out

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", traced)
    return trace


def _violations(trace) -> list[str]:
    bad, early_seen = [], 0
    for i in range(1, len(trace)):
        name, tensors, _, early = trace[i]
        if not early or name not in EARLY_READS:
            continue
        early_seen += 1
        prev_name, _, prev_changed, _ = trace[i - 1]
        for item in EARLY_READS[name]:
            arg, _, flag = item.partition(" if ")
            t = tensors.get(arg)
            if not isinstance(t, torch.Tensor) or (flag and not tensors.get(flag)):
                continue
            lo, hi = _span(t)
            if any(lo < b and a < hi for a, b in prev_changed):
                bad.append(f"launch {i} {name}.{arg} written by launch {i - 1} {prev_name}")
    assert early_seen, "no early-loading launch traced"
    return bad


@pytest.mark.parametrize("steps", [3, 4])
def test_drafter_launch_order_keeps_the_early_load_rule(launches, steps):
    s = make_setup(steps=steps, seed=11, kernel_backend="triton")
    loop = FakeServingLoop(s, 4)
    for _ in range(3):
        loop.add(9, 5)  # chunked prefill: mixed batches, then decode batches
    for _ in range(4):
        loop.step()
    names = {name for name, *_ in launches}
    assert {"_uniform_kernel", "_decode_split_kernel", "_rope_store_kernel"} <= names
    assert "_advance_kernel" in names
    assert _violations(launches) == []


def test_engine_launch_order_keeps_the_early_load_rule(launches):
    target, head = make_models(5, dtype=torch.float32)
    eng = Engine(target, runtime(dtype="float32", kernel_backend="triton"), head)
    prompts = [[(7 * i + 3 * j) % 50 + 1 for j in range(5 + 3 * i)] for i in range(2)]
    eng.generate(prompts, SamplingParams(max_new_tokens=4))
    names = {name for name, *_ in launches}
    assert {"_uniform_kernel", "_decode_split_kernel", "_rope_store_kernel"} <= names
    assert _violations(launches) == []


def test_the_check_sees_a_violation(launches):
    """The same check flags RoPE reading positions the launch before it wrote."""
    from graphdraft.kernels.cache_loc import advance_positions_and_seq_lens
    from graphdraft.kernels.rope import rope_and_store_kv

    T, H, D = 2, 2, 8
    qkv = torch.randn(T, 3 * H, D)
    pos = torch.tensor([1, 2])
    seq = torch.tensor([2, 3], dtype=torch.int32)
    cs = torch.randn(16, D)
    cache = torch.zeros(8, H, D)
    advance_positions_and_seq_lens(seq, pos)  # writes pos
    rope_and_store_kv(qkv[:, :H], qkv[:, H:2 * H], qkv[:, 2 * H:], pos, cs, cache, cache.clone(),
                      torch.tensor([3, 4]))
    assert _violations(launches) == ["launch 1 _rope_store_kernel.pos_ptr written by launch 0 "
                                     "_advance_kernel"]
