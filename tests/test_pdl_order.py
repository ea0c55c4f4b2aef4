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

import numpy as np
import pytest
import torch
from triton.runtime import interpreter

from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.drafter_harness import FakeServingLoop, make_setup
from tests.engine_harness import make_models, runtime


def _span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    lo = t.data_ptr() + sum(min(0, s) * (n - 1) for s, n in zip(t.stride(), t.shape, strict=True)) * t.element_size()
    hi = t.data_ptr() + (sum(max(0, s) * (n - 1) for s, n in zip(t.stride(), t.shape, strict=True)) + 1) * t.element_size()
    return lo, hi


@pytest.fixture
def launches(monkeypatch):
    """Every interpreted launch in order: (kernel name, {arg: tensor or constexpr}, spans it
    changed, EARLY, the tensor arguments it loaded from before `pdl_enter`).

    The early reads are observed, not listed by hand: the loads of a program (the
    interpreter's `create_masked_load`, its masked-in addresses) before it calls `pdl_enter`
    (programs run one after another: `set_grid_idx` starts each; a kernel that never calls
    `pdl_enter` has no early reads) are mapped to the tensor arguments whose memory holds the
    address (CPU tensors: the interpreter loads from their own storage)."""
    trace: list[tuple[str, dict, list, bool, set]] = []
    run = interpreter.InterpretedFunction.run
    call = interpreter.InterpretedFunction.__call__
    builder = interpreter.interpreter_builder
    load, set_idx = builder.create_masked_load, builder.set_grid_idx
    state = {"entered": True, "pending": [], "addrs": []}

    def traced_load(ptrs, mask, *args, **kwargs):
        if not state["entered"]:
            m = np.broadcast_to(mask.data, ptrs.data.shape)
            state["pending"].append(np.asarray(ptrs.data)[m].astype(np.int64).ravel())
        return load(ptrs, mask, *args, **kwargs)

    def traced_set_idx(*idx):
        state["entered"], state["pending"] = False, []  # a new program
        return set_idx(*idx)

    def traced_call(self, *args, **kwargs):
        if self.__name__ == "pdl_enter" and not state["entered"]:
            state["addrs"] += state["pending"]  # what this program loaded before its wait
            state["entered"], state["pending"] = True, []
        return call(self, *args, **kwargs)

    def traced(self, *args, grid, warmup, **kwargs):
        named = dict(zip(self.arg_names, args, strict=False)) | kwargs
        tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
        before = {k: v.clone() for k, v in tensors.items()}
        state["addrs"], state["pending"] = [], []
        out = run(self, *args, grid=grid, warmup=warmup, **kwargs)
        state["entered"], state["pending"] = True, []
        changed = [_span(v) for k, v in tensors.items()
                   if not torch.equal(before[k].nan_to_num(), v.nan_to_num())
                   or (before[k].isnan() != v.isnan()).any()]
        addrs = np.concatenate(state["addrs"]) if state["addrs"] else np.zeros(0, np.int64)
        early_reads = {k for k, v in tensors.items()
                       if ((addrs >= _span(v)[0]) & (addrs < _span(v)[1])).any()}
        trace.append((self.__name__, tensors | {k: v for k, v in named.items() if k.isupper()},
                      changed, bool(named.get("EARLY", False)), early_reads))
        return out

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", traced)
    monkeypatch.setattr(interpreter.InterpretedFunction, "__call__", traced_call)
    monkeypatch.setattr(builder, "create_masked_load", traced_load)
    monkeypatch.setattr(builder, "set_grid_idx", traced_set_idx)
    return trace


def _violations(trace) -> list[str]:
    bad, early_seen = [], 0
    for i in range(1, len(trace)):
        name, tensors, _, early, early_reads = trace[i]
        if not early_reads:
            continue
        early_seen += early
        prev_name, _, prev_changed, _, _ = trace[i - 1]
        for arg in sorted(early_reads):
            lo, hi = _span(tensors[arg])
            if any(lo < b and a < hi for a, b in prev_changed):
                bad.append(f"launch {i} {name}.{arg} written by launch {i - 1} {prev_name}")
    assert early_seen, "no early-loading launch traced"
    return bad


DOCUMENTED_EARLY_READS = {
    "_decode_split_kernel": {"req_ptr", "lens_ptr", "page_ptr", "q_index_ptr"},
    "_combine_kernel": {"lens_ptr"},
    "_rope_store_kernel": {"pos_ptr", "loc_ptr", "cs_ptr"},
    "_uniform_kernel": {"req_pool_ptr", "start_ptr", "req_to_page_ptr"},
    "_advance_kernel": {"seq_lens_ptr", "positions_ptr"},
}
"""What `graphdraft.kernels.pdl`'s doc and the kernels' docstrings say each loads before its
wait (metadata only); the check itself uses the observed reads, this is compared to them."""


def _early_reads(trace) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, _, _, _, reads in trace:
        out.setdefault(name, set()).update(reads)
    return out


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
    early = {k: v for k, v in _early_reads(launches).items() if v}
    assert early == DOCUMENTED_EARLY_READS  # every early reader seen; none loads data early


def test_engine_launch_order_keeps_the_early_load_rule(launches):
    target, head = make_models(5, dtype=torch.float32, layers=2)
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

