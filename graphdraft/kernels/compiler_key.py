"""Triton's compiler key, computed ahead in a thread.

Before a process compiles a kernel or loads one from the on-disk cache, Triton computes once
its compiler key (`triton_key()`: a sha256 of its own sources and of its libtriton shared
library, about 500 MB): a visible share of a warm `capture_graphs` of the 8B pair
(perf/RESULTS.md 2026-12-05h, run Z), paid at the first launch, and again in each precompile
worker. The hashing releases the GIL, so it can run beside other work: `prefetch()` starts it
in a daemon thread, once per process (importing `graphdraft.serving.engine` does so on a CUDA
machine, so it runs while the caller loads or builds its weights); `wait()` joins that thread
before the first launch, so the key is computed once and is ready (what is left of it is
waited for, never computed twice). The precompile workers' parent computes it beside its
imports and before it forks them, and every worker inherits it. A Triton without
`triton_key`, or its interpreter (`TRITON_INTERPRET=1`: nothing is compiled), makes both
no-ops.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable

from graphdraft.kernels.pdl import interpreting

__all__ = ["prefetch", "wait"]

_lock = threading.Lock()
_thread: threading.Thread | None = None


def _triton_key() -> Callable[[], str] | None:
    """`triton_key` of the installed Triton (3.x: `triton.runtime.cache`; older:
    `triton.compiler.compiler`), None where neither has it."""
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):
        try:
            fn = getattr(importlib.import_module(module), "triton_key", None)
        except ImportError:
            continue
        if callable(fn):
            return fn
    return None


def prefetch() -> threading.Thread | None:
    """Start computing Triton's compiler key in a daemon thread (once per process; later calls
    return the same thread). None where this Triton has no `triton_key` or interprets."""
    global _thread
    if interpreting():
        return None
    with _lock:
        if _thread is None:
            fn = _triton_key()
            if fn is None:
                return None
            _thread = threading.Thread(target=fn, name="graphdraft-triton-key", daemon=True)
            _thread.start()
        return _thread


def wait() -> None:
    """Join the key's thread (`prefetch`, started here if it was not): after this, Triton's
    first compile or cache load finds the key computed."""
    thread = prefetch()
    if thread is not None:
        thread.join()
