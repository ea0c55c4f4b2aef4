"""The interpreter's nested-helper fast path (`tests/triton_interpreter.py`, installed by
`conftest.py` under TRITON_INTERPRET=1): a helper called inside a launch runs without Triton's
re-patching and computes what Triton's own path computes; a call the launch did not patch
for goes through Triton's method; the launch's undo still restores `triton.language`."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from tests import triton_interpreter

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the interpreter's method (TRITON_INTERPRET=1)")


@triton.jit
def _scaled_row_sum(x_ptr, row, scale, N: tl.constexpr):
    offs = tl.arange(0, N)
    return tl.sum(tl.load(x_ptr + row * N + offs), axis=0) * scale


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, scale, N: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    acc = 0.0
    for r in range(ROWS):  # the helper in a loop, as the GEMV and attention kernels call theirs
        acc += _scaled_row_sum(x_ptr, pid * ROWS + r, scale, N)
    tl.store(out_ptr + pid, acc)


def _run(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(4, dtype=torch.float32)
    _row_sums_kernel[(4,)](x, out, 0.5, N=8, ROWS=3)
    return out


def test_the_fast_path_is_installed_for_this_triton():
    if not triton.__version__.startswith(triton_interpreter.CHECKED_VERSIONS):
        pytest.skip(f"Triton {triton.__version__} keeps its own method")
    assert triton_interpreter.installed() and triton_interpreter.install()


def test_a_nested_helper_skips_the_repatch_and_computes_the_same(monkeypatch):
    from triton.runtime import interpreter

    if not triton_interpreter.installed():
        pytest.skip("fast path not installed")
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
    want = x.sum(dim=1).view(4, 3).sum(dim=1) * 0.5
    fast = _run(x)
    calls = []
    original = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: calls.append(fn) or original(fn))
    assert torch.allclose(_run(x), fast) and torch.allclose(fast, want, atol=1e-5)
    # the launch patched once; its 12 helper calls (and tl.sum's, once tl.core is patched) not
    assert [f.__name__ for f in calls] == ["_row_sums_kernel"]
    # the launch's undo (of `tl`; Triton's own nested patch of `tl.core` is never undone)
    assert tl.core.is_builtin(tl.arange) and tl.range is triton_interpreter._RANGE
    # Triton's own method (every call re-patches) gives the same values
    monkeypatch.setattr(interpreter.InterpretedFunction, "__call__",
                        interpreter.InterpretedFunction.__call__.original)
    assert torch.equal(_run(x), fast)
    assert len(calls) > 12


def test_a_call_outside_a_patched_launch_takes_tritons_method(monkeypatch):
    """A helper whose `triton.language` modules no launch has patched (here: called from
    host code) goes to Triton's own method, which patches before it runs."""
    from triton.runtime import interpreter

    if not triton_interpreter.installed():
        pytest.skip("fast path not installed")
    seen = []
    original = interpreter.InterpretedFunction.__call__.original
    monkeypatch.setattr(interpreter.InterpretedFunction.__call__, "original", original)

    def spy(self, *args, **kwargs):
        seen.append(self.fn.__name__)
        raise RuntimeError("Triton's method")

    fast_call = triton_interpreter._make_call(spy)
    monkeypatch.setattr(interpreter.InterpretedFunction, "__call__", fast_call)
    with pytest.raises(RuntimeError, match="Triton's method"):
        _scaled_row_sum(torch.zeros(8), 0, 1.0, 8)
    assert seen == ["_scaled_row_sum"]
