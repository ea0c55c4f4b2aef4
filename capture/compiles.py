"""Counting JIT compilations (Triton's), for the capture statistics.

A compile counter is any ``Callable[[], int]`` returning a count that only grows;
:class:`~capture.CapturedForward` reads it before and after each size's warm-up and
capture and stores the difference in ``GraphStats.compiles``. The default,
:func:`triton_compiles`, counts the kernels Triton's JIT compiled in this process (a new
specialization of a ``@triton.jit`` function: ``triton.knobs.runtime.jit_post_compile_hook``,
which triton 3.4+ calls once per new specialization whether its binary came from the
on-disk cache or from the compiler; :func:`thread_compiles` counts the calling thread's). :func:`cache_entries` counts the entries of Triton's
on-disk cache (compiles that reached the compiler, in a process that started with an empty
cache). :func:`triton_builds` / :func:`thread_builds` count only the specializations Triton's
compiler really built in this process (a miss of the on-disk cache: Triton's compilation
listener, ``triton.knobs.compilation.listener``, with ``cache_hit=False``); a load from the
cache is not one. Mechanism only: nothing here knows what the kernels do.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["builds_counted", "cache_dir", "cache_entries", "install_triton_counter",
           "thread_builds", "thread_compiles", "triton_builds", "triton_compiles"]

_lock = threading.Lock()
_count = 0
_local = threading.local()  # per thread: Triton compiles in the thread whose launch needs them
_installed: bool | None = None  # None: not tried; False: no hook in this triton
_builds = 0  # cache misses: kernels Triton's compiler built in this process
_listening = False  # the compilation listener is installed (builds are counted)


def _on_compile(*args, **kwargs):
    """The hook: count, then chain to the hook that was installed before ours."""
    global _count
    with _lock:
        _count += 1
    _local.count = getattr(_local, "count", 0) + 1
    prev = _on_compile.previous
    return prev(*args, **kwargs) if prev is not None else None


_on_compile.previous = None


def _on_build(*args, **kwargs):
    """Triton's compilation listener: count a build (``cache_hit`` False), then chain."""
    global _builds
    if not kwargs.get("cache_hit", False):
        with _lock:
            _builds += 1
        _local.builds = getattr(_local, "builds", 0) + 1
    prev = _on_build.previous
    return prev(*args, **kwargs) if prev is not None else None


_on_build.previous = None


def _install_listener() -> None:
    global _listening
    try:
        import triton
        comp = getattr(getattr(triton, "knobs", None), "compilation", None)
        if comp is not None and hasattr(comp, "listener"):
            _on_build.previous = comp.listener
            comp.listener = _on_build
            _listening = True
    except ImportError:
        pass


def install_triton_counter() -> bool:
    """Install the counting hook once (idempotent); False when triton or its hook is missing."""
    global _installed
    if _installed is not None:
        return _installed
    _install_listener()
    try:
        import triton
        knobs = getattr(triton, "knobs", None)
        runtime = getattr(knobs, "runtime", None)
        if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
            _on_compile.previous = runtime.jit_post_compile_hook
            runtime.jit_post_compile_hook = _on_compile
            _installed = True
        else:  # triton < 3.4: a class attribute of JITFunction
            from triton.runtime.jit import JITFunction
            if not hasattr(JITFunction, "compiled_hook"):
                raise AttributeError("no compile hook")
            _on_compile.previous = JITFunction.compiled_hook
            JITFunction.compiled_hook = staticmethod(_on_compile)
            _installed = True
    except (ImportError, AttributeError):
        _installed = False
    return _installed


def triton_compiles() -> int:
    """Triton kernel specializations compiled (or loaded from disk) by this process since
    the counter was installed (the first call installs it); 0 without triton."""
    install_triton_counter()
    return _count


def thread_compiles() -> int:
    """:func:`triton_compiles` of the calling thread only (the default counter of
    :class:`~capture.CapturedForward`: forwards warmed up in parallel threads each count
    their own compiles)."""
    install_triton_counter()
    return getattr(_local, "count", 0)


def builds_counted() -> bool:
    """Whether this triton tells builds from cache loads (its compilation listener exists)."""
    install_triton_counter()
    return _listening


def triton_builds() -> int:
    """Kernels Triton's compiler built in this process (on-disk cache misses) since the
    counter was installed; 0 without triton or its listener (`builds_counted`)."""
    install_triton_counter()
    return _builds


def thread_builds() -> int:
    """:func:`triton_builds` of the calling thread only."""
    install_triton_counter()
    return getattr(_local, "builds", 0)


def cache_dir() -> Path:
    """Triton's on-disk cache: ``TRITON_CACHE_DIR`` if set, else Triton's own default
    (``$TRITON_HOME/.triton/cache``, ``~/.triton/cache`` without TRITON_HOME)."""
    env = os.environ.get("TRITON_CACHE_DIR", "").strip()
    if env:
        return Path(env)
    try:
        import triton
        d = triton.knobs.cache.dir
        if d:
            return Path(d)
    except (ImportError, AttributeError):
        pass
    home = os.environ.get("TRITON_HOME", "").strip() or str(Path.home())
    return Path(home) / ".triton" / "cache"


def cache_entries(directory: str | os.PathLike | None = None) -> int:
    """Entries (one directory per compiled kernel) in the Triton cache (default `cache_dir()`);
    0 when it does not exist."""
    d = Path(directory) if directory is not None else cache_dir()
    if not d.is_dir():
        return 0
    return sum(1 for e in d.iterdir() if e.is_dir())
