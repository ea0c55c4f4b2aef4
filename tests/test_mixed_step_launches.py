"""The mixed step's fused host-to-device set-up, end to end: an Engine on the Triton path
(`write_batch` through `ops.copy_segments`, the admission
through `ops.admit_slot_rows`, the draft's set-up through `ops.mixed_draft_inputs`) equals the same Engine with those ops on their
torch references, bit for bit on every state
tensor after every step (every other kernel the same on both: TRITON_INTERPRET=1 on the CPU),
through joins while others decode, the padded target forward and padded draft on, sampled
under penalties and logit_bias (the draft controls' accepted tokens)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import random

import pytest
import torch

from graphdraft import ops
from graphdraft.kernels import mixed_draft_inputs, segments, slot_admit
from graphdraft.serving.engine import Engine
from tests.engine_harness import make_models, runtime
from tests.test_mixed_draft_graphs import PARAMS, _lockstep, _padded

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu"  # the padded path forced on as tests/test_mixed_draft_graphs.py does on the CPU
# (on CUDA the GPU tests of test_mixed_graphs / test_mixed_draft_graphs run these kernels)
FUSED = ("copy_segments", "admit_slot_rows", "mixed_draft_inputs")


def _ref(fn):
    def call(*args, kernels=None, **kw):
        return fn(*args, **kw)
    return call


@contextlib.contextmanager
def _torch_references():
    """The fused ops on their torch paths for the block."""
    saved = {n: getattr(ops, n) for n in FUSED}
    ops.copy_segments = _ref(segments.copy_segments_ref)
    ops.admit_slot_rows = _ref(slot_admit.admit_rows_ref)
    ops.mixed_draft_inputs = _ref(mixed_draft_inputs.mixed_draft_inputs_ref)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(ops, n, f)


JOINS = {0: [0, 1], 1: [2], 3: [3, 4]}
"""Step -> the prompts that join then (mixed steps of prefill rows beside decode rows)."""


@pytest.mark.skipif(not INTERPRET, reason="a CPU test: Triton under TRITON_INTERPRET=1")
def test_fused_mixed_step_set_up_equals_the_torch_references(monkeypatch):
    target, head = make_models(3, dtype=torch.float32, device=DEV)
    rng = random.Random(4)
    ps = [[rng.randrange(61) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    params = dataclasses.replace(PARAMS["sampled"], max_new_tokens=4)
    cfg = runtime(dtype="float32", device=DEV, kernel_backend="triton", max_running_requests=4,
                  cuda_graph_max_bs=4, max_num_batched_tokens=40)
    engines = [Engine(target, cfg, head, seed=7) for _ in range(2)]
    seen = [_padded(e, draft=True) for e in engines]
    calls = collections.Counter()
    for name in FUSED:
        monkeypatch.setattr(ops, name, _counted(calls, name, getattr(ops, name)))
    outs = _lockstep(engines, ps, params, None, joins=JOINS, second=_torch_references)
    assert outs[0] == outs[1]
    assert all(len(o) == 4 for o in outs[0])
    assert seen[0] == seen[1] and any(r > bs for bs, _, _, r, _ in seen[0])
    assert any(tb > t for _, _, t, _, tb in seen[0]) and any(bs > ne for bs, ne, *_ in seen[0])
    assert calls["admit_slot_rows"] >= 2 and calls["mixed_draft_inputs"] == len(seen[0])
    assert calls["copy_segments"] >= len(seen[0])  # write_batch


def _counted(calls, name, fn):
    def call(*args, **kw):
        calls[name] += 1
        return fn(*args, **kw)
    return call
