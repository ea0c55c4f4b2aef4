"""`graphdraft.kernels.compiler_key`: Triton's compiler key computed once, in a thread."""

from __future__ import annotations

import threading

import pytest

from graphdraft.kernels import compiler_key


@pytest.fixture
def fresh(monkeypatch):
    """No key thread started yet in this process (as at import), Triton not interpreting."""
    monkeypatch.setattr(compiler_key, "_thread", None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return monkeypatch


def test_prefetch_starts_one_thread_and_wait_leaves_the_key_cached(fresh):
    calls = []
    done = threading.Event()

    def fake_key() -> str:
        calls.append(threading.current_thread().name)
        done.wait(5)
        return "key"

    fresh.setattr(compiler_key, "_triton_key", lambda: fake_key)
    first = compiler_key.prefetch()
    assert first is not None and first.daemon and first.name == "graphdraft-triton-key"
    assert compiler_key.prefetch() is first  # once per process
    done.set()
    compiler_key.wait()
    assert not first.is_alive()
    assert calls == ["graphdraft-triton-key"]  # computed once, in the thread
    compiler_key.wait()  # again: nothing new
    assert calls == ["graphdraft-triton-key"]


def test_wait_alone_computes_the_real_key_once(fresh):
    """Triton's own `triton_key` (lru-cached): after `wait` the cache holds it."""
    key = compiler_key._triton_key()
    if key is None:
        pytest.skip("this Triton has no triton_key")
    key.cache_clear()
    compiler_key.wait()
    info = key.cache_info()
    assert info.currsize == 1 and info.misses == 1
    assert isinstance(key(), str) and key.cache_info().hits == 1


def test_noop_when_interpreting_or_without_triton_key(fresh):
    fresh.setenv("TRITON_INTERPRET", "1")
    assert compiler_key.prefetch() is None
    compiler_key.wait()  # no thread, no error
    fresh.delenv("TRITON_INTERPRET")
    fresh.setattr(compiler_key, "_triton_key", lambda: None)
    assert compiler_key.prefetch() is None
    compiler_key.wait()
