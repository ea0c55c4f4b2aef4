"""Test set-up: Triton's interpreter on CPU, one torch thread in the processes tests start, and
the `gpu` marker.

TRITON_INTERPRET is read when ``@triton.jit`` decorates, so it is set here,
before any test module imports a kernel; under it, `tests/triton_interpreter.py` drops the
interpreter's re-patching at every nested helper call.

Without CUDA, every process a test starts (servers, engine processes, ranks, precompile
workers) runs one torch thread (OMP_NUM_THREADS=1, unless the environment names a count): on
a 2-core machine their threads otherwise contend with the test process's own two. The test
process keeps its threads (one thread for it too made a single-process fresh-clone `make test`
slower: 15.7 against ~14 minutes), except `make test`'s pytest-xdist workers, one per core,
which run one thread each.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # (torch read its thread count at import: this process keeps its own, unless it is one
    # of `make test`'s pytest-xdist workers, one per core)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
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
