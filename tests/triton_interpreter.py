"""Triton's interpreter without its per-call re-patching of nested helpers (test set-up).

Under TRITON_INTERPRET=1 a kernel launch (`GridExecutor.__call__`) patches
`triton.language` for the interpreter once (`_patch_lang`, undone when the launch returns).
Triton 3.9 also runs `_patch_lang` at every call of a nested `@triton.jit` helper
(`InterpretedFunction.__call__`): it scans the modules' members again (`inspect.getmembers`)
and installs the same interpreter functions over them (never undone: the launch's own undo
restores the originals). Our kernels call helpers inside their loops, so this re-patching was
about 30% of the interpreted time of the CPU suite.

`install()` replaces that method with one that calls the helper directly when every
`triton.language` module the helper's globals name (`tl`, `tl.core`) is patched already (the
enclosing launch did it), and falls back to Triton's own method otherwise (a helper naming
`tl.core` under a kernel that names `tl` only; a call outside a launch). The interpreted
semantics are the same: the skipped patch would install functions that behave as the ones in
place. Only for the Triton versions listed in `CHECKED_VERSIONS` (their `__call__` is
`_patch_lang`, `rewrite`, call); another version keeps its own method.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["CHECKED_VERSIONS", "install", "installed"]

CHECKED_VERSIONS = ("3.9.",)
"""Triton versions whose `InterpretedFunction.__call__` this replaces (prefixes)."""

_LANGS: dict[object, tuple] = {}  # helper function -> the triton.language modules it names
_RANGE = tl.core.range  # what a launch's patch replaces (read outside a launch: at import)


def _langs_of(fn) -> tuple:
    langs = _LANGS.get(fn)
    if langs is None:
        langs = _LANGS[fn] = tuple(v for v in fn.__globals__.values() if v is tl or v is tl.core)
    return langs


def _is_patched(lang) -> bool:
    """Whether a launch's `_patch_lang` is in place on `lang` (its builtins and its `range`
    are the interpreter's)."""
    return lang.range is not _RANGE and not tl.core.is_builtin(lang.arange)


def _make_call(original):
    from triton.runtime.interpreter import InterpreterError

    def __call__(self, *args, **kwargs):
        langs = _langs_of(self.fn)
        if not langs or not all(_is_patched(lang) for lang in langs):
            return original(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise InterpreterError(repr(e)) from e

    __call__.original = original
    return __call__


def installed() -> bool:
    """Whether `install()` replaced the interpreter's nested-call method."""
    from triton.runtime.interpreter import InterpretedFunction

    return hasattr(InterpretedFunction.__call__, "original")


def install() -> bool:
    """Replace `InterpretedFunction.__call__` (once; a Triton version not in
    `CHECKED_VERSIONS` is left alone). Returns `installed()`."""
    from triton.runtime import interpreter

    if not triton.__version__.startswith(CHECKED_VERSIONS):
        return False
    if not installed() and hasattr(interpreter, "_patch_lang"):
        cls = interpreter.InterpretedFunction
        cls.__call__ = _make_call(cls.__call__)
    return installed()
