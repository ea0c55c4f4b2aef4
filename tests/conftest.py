"""Test set-up: Triton's interpreter on CPU, one torch thread on CPU, and the `gpu` marker.

TRITON_INTERPRET is read when ``@triton.jit`` decorates, so it is set here,
before any test module imports a kernel; under it, `tests/triton_interpreter.py` drops the
interpreter's re-patching at every nested helper call.

Without CUDA, torch runs one intra-op thread in the test process and, through
OMP_NUM_THREADS, in every process a test starts (servers, engine processes, ranks, precompile
workers), unless the environment names a count: the suite's tensors are tiny, and on a
2-core machine a second thread mostly busy-waits against the other processes (the
interpreter, a test's server or ranks).
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)

import pytest  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import triton_interpreter  # noqa: E402

    triton_interpreter.install()  # nested helper calls skip Triton's re-patching


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
