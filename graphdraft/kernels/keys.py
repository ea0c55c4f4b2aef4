"""Triton specialization keys: the key of a launch, and a recorder of the keys launched.

`specialization_key(kernel, *args, **kwargs)` is the key Triton's JIT caches a compiled
kernel under for a launch with these arguments (its constexprs and launch options, and for
every other argument its type with Triton's value specialization: 1, divisible by 16,
16-byte aligned), computed on the host the way Triton's launcher does; `KeyRecorder` records
it for every launch of the given kernels (`all_kernels()`: every `_..._kernel` of this
package). They run under the interpreter too, so the CPU tests can check that the sizes of
one bucket launch under one key, and the start-up's precompile plan (`graphdraft.startup`)
is built from them.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import pkgutil
from collections import defaultdict

import torch

__all__ = ["KeyRecorder", "all_kernels", "kernels", "specialization_key", "storages"]

_KERNEL_MODULES = ("argmax", "cache_loc", "draft_indices", "gemv", "norm", "rope", "stage_inputs")


def _module_kernels(mod_names) -> dict[str, object]:
    out = {}
    for mod_name in mod_names:
        mod = importlib.import_module(f"graphdraft.kernels.{mod_name}")
        for name, obj in vars(mod).items():
            if name.startswith("_") and "_kernel" in name and hasattr(obj, "run") and hasattr(obj, "fn"):
                out[f"{mod_name}.{name}"] = obj
    return out


def kernels() -> dict[str, object]:
    """The launched `@triton.jit` kernels of the draft chain's kernel modules (not attention),
    by `module.name`: `KeyRecorder`'s default."""
    return _module_kernels(_KERNEL_MODULES)


def all_kernels() -> dict[str, object]:
    """The launched `@triton.jit` kernels (`_..._kernel`) of every module of
    `graphdraft.kernels`, attention's included, by `module.name`."""
    here = os.path.dirname(os.path.abspath(__file__))
    return _module_kernels(sorted(m.name for m in pkgutil.iter_modules([here])))


def _params(kernel) -> list:
    """Triton's per-parameter metadata (KernelParam), also for the interpreter's functions."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return params
    from triton.runtime.jit import KernelParam  # interpreter: rebuild from the jit arguments

    kw = getattr(kernel, "kwargs", {}) or {}
    dns = set(kw.get("do_not_specialize") or ())
    dns_oa = set(kw.get("do_not_specialize_on_alignment") or ())
    return [KernelParam(i, p, i in dns or p.name in dns, i in dns_oa or p.name in dns_oa)
            for i, p in enumerate(inspect.signature(kernel.fn).parameters.values())]


def _specialize(v, is_const: bool, specialize: bool, align: bool) -> tuple:
    """Triton's (type, specialization) of one argument: its own native function where the
    installed triton has it, else the same rules in Python (ints: 1 -> constexpr, a multiple
    of 16 -> "D"; pointers: 16-byte aligned -> "D"; none of it under do_not_specialize)."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        native_specialize_impl = None
    if native_specialize_impl is not None:
        try:
            return tuple(native_specialize_impl(BaseBackend, v, is_const, specialize, align))
        except TypeError:  # another signature in this triton: the same rules in Python
            pass
    if v is None:
        return ("constexpr", None)
    if isinstance(v, bool):
        return ("u1", None)
    if isinstance(v, int):
        ty = "i32" if -2**31 <= v < 2**31 else ("u64" if v >= 2**63 else "i64")
        if not specialize:
            return (ty, None)
        return ("constexpr", 1) if v == 1 else (ty, "D" if v % 16 == 0 else "")
    if isinstance(v, float):
        return ("fp32", None)
    if hasattr(v, "data_ptr"):
        ty = f"*{'k' if is_const else ''}{v.dtype}"
        return (ty, ("D" if v.data_ptr() % 16 == 0 else "") if specialize and align else None)
    return (type(v).__name__, repr(v))


def specialization_key(kernel, *args, **kwargs) -> tuple:
    """The JIT cache key of launching `kernel` with these arguments: a tuple of
    `(name, ("constexpr", value) | (type, specialization))` per parameter, then the sorted
    launch options (num_warps, launch_pdl, ...). Two launches with equal keys run one
    compiled kernel."""
    params = _params(kernel)
    names = {p.name for p in params}
    sig = inspect.signature(kernel.fn)
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    spec = []
    for p in params:
        v = bound.arguments[p.name]
        if p.is_constexpr:
            spec.append((p.name, ("constexpr", v)))
        else:
            spec.append((p.name, _specialize(v, p.is_const, not p.do_not_specialize,
                                             not p.do_not_specialize_on_alignment)))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    return tuple(spec) + options


def _zero_int_tensors(args, kwargs, spare: frozenset = frozenset()) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.numel() and not (a.is_floating_point()
                                                             or a.is_complex()):
            if a.untyped_storage().data_ptr() not in spare:
                a.zero_()


class KeyRecorder(contextlib.AbstractContextManager):
    """Record `specialization_key` of every launch of `kernels` (default: `kernels()`) while
    active: `keys[name]` is the set of distinct keys, `launches[name]` the launch count,
    `where[name][key]` the contexts (`context`, set by the caller, e.g. (forward, bs)) that
    launched it. A diagnostic (it costs host time per launch), not for serving.

    `launch=False` (a dry run): record the key and skip the launch itself (outputs keep
    whatever the buffers held). For a census of the keys a forward launches at shapes too
    large for the interpreter, and for the precompile workers' plan; valid for forwards whose
    host code reads no device values (captured forwards: no host syncs), which is what
    `tests/test_compile_census.py` checks against real launches.

    `zero_ints` (with `launch=False`, on a throw-away engine): every integer tensor argument
    of a skipped launch is zeroed instead, so what the kernel would have written (token ids,
    indices, lengths) is 0 rather than stale memory when later torch ops index with it (a
    device-side bounds assert would end the process); the keys do not depend on values.
    `spare` (storage pointers, `storages(...)`): tensors never zeroed, the host-written inputs
    later host-side torch ops index with (an eager prefill's extend lengths).

    `order` lists the distinct `(name, key)` in the order first launched; `keep(index)`
    (index in `order`) True keeps that first launch's arguments in `kept` as
    `(name, key, args, kwargs, grid, context)`: `kernel.warmup(*args, grid=grid, **kwargs)`
    (Triton's compile without a launch) then compiles exactly that key
    (`graphdraft.startup.plan.plan_keys`)."""

    def __init__(self, kernels_by_name: dict[str, object] | None = None, *,
                 launch: bool = True, keep=None, zero_ints: bool = False) -> None:
        self.kernels = dict(kernels_by_name) if kernels_by_name is not None else kernels()
        self.keys: dict[str, set] = defaultdict(set)
        self.launches: dict[str, int] = defaultdict(int)
        self.where: dict[str, dict] = defaultdict(lambda: defaultdict(set))
        self.order: list[tuple[str, tuple]] = []
        self.kept: list[tuple] = []
        self.launch = launch
        self.keep = keep
        self.zero_ints = zero_ints
        self.spare: frozenset = frozenset()
        self.context: object = None
        self._saved: list[tuple[object, object]] = []

    def __enter__(self) -> KeyRecorder:
        for name, k in self.kernels.items():
            run = k.run  # the bound method (or an outer recorder's wrapper)

            def wrapped(*args, _run=run, _k=k, _name=name, grid, warmup, **kwargs):
                key = specialization_key(_k, *args, **kwargs)
                if key not in self.keys[_name]:
                    if self.keep is not None and self.keep(len(self.order)):
                        self.kept.append((_name, key, args, kwargs, grid, self.context))
                    self.order.append((_name, key))
                self.keys[_name].add(key)
                self.launches[_name] += 1
                if self.context is not None:
                    self.where[_name][key].add(self.context)
                if not self.launch and not warmup:
                    if self.zero_ints:
                        _zero_int_tensors(args, kwargs, self.spare)
                    return None
                return _run(*args, grid=grid, warmup=warmup, **kwargs)

            self._saved.append((k, k.__dict__.get("run")))
            k.run = wrapped
        return self

    def __exit__(self, *exc) -> None:
        for k, prev in reversed(self._saved):
            if prev is None:
                del k.run
            else:
                k.run = prev
        self._saved.clear()

    def total(self) -> int:
        """Distinct keys over all kernels: the compiles these launches need on a GPU."""
        return sum(len(v) for v in self.keys.values())


def storages(*tensors: torch.Tensor) -> frozenset:
    """The storage pointers of `tensors` (`KeyRecorder.spare`)."""
    return frozenset(t.untyped_storage().data_ptr() for t in tensors)
