"""Host-side argument checks shared by the kernel wrappers: one wording for every rejection.

Each helper raises ValueError that names the argument, says what was expected and what it got,
e.g. ``x: expected a contiguous bfloat16 [4, 64] tensor on cuda:0, got float32 [4, 32] on cpu``,
and returns the value unchanged when it passes. They read only metadata (dim, shape, dtype,
device, strides) and python ints: never a tensor's values, so they add no device sync.

`expect_tensor`'s ``shape`` is a sequence with one entry per dimension: an int (that size
exactly), or None / a str (any size; a str is the size's name in the message, such as "split").
``device``: a device with an index (``cuda:0``, a tensor's ``.device``) must match exactly; one
without (``"cuda"``, ``"cpu"``) matches any device of that type.
``layout``:

- ``"contiguous"``: ``t.is_contiguous()`` (torch's rule: size-1 and empty dims are free).
- ``"rows"``: unit stride on the last dimension (``t.stride(-1) == 1``), any other strides, as
  for a row view of a persistent buffer. Wrappers whose kernel never reads that stride for an
  empty tensor or a single column pass ``layout=None`` in those cases themselves.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

LAYOUTS = ("contiguous", "rows")
INDEX_DTYPES = (torch.int32, torch.int64)  # row indices, slots, positions

_Dim = int | str | None


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def _dtypes(dtypes: torch.dtype | Collection[torch.dtype] | None) -> tuple[torch.dtype, ...] | None:
    if dtypes is None:
        return None
    return (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)


def _shape_text(shape: Sequence[_Dim]) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"


def describe(t: object) -> str:
    """What a value is, for the "got ..." half of a message: dtype, shape, device and strides of
    a tensor, else its type name."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return (f"{dtype_name(t.dtype)} {list(t.shape)} on {t.device} "
            f"with strides {tuple(t.stride())}")


def expectation(*, shape: Sequence[_Dim] | None = None,
                dtypes: torch.dtype | Collection[torch.dtype] | None = None,
                device: torch.device | str | None = None, layout: str | None = None) -> str:
    """The "expected ..." half of `expect_tensor`'s message, e.g.
    "a contiguous int32/int64 [4] tensor on cpu"."""
    words = []
    if layout == "contiguous":
        words.append("contiguous")
    dts = _dtypes(dtypes)
    if dts:
        words.append("/".join(dtype_name(d) for d in dts))
    if shape is not None:
        words.append(_shape_text(shape))
    words.append("tensor")
    if device is not None:
        words.append(f"on {device}")
    if layout == "rows":
        words.append("with unit column stride")
    return ("an " if words[0][0] in "aeio" else "a ") + " ".join(words)


_Tensor, _dtype, _device = torch.Tensor, torch.dtype, torch.device  # hot-path lookups


def _passes(t: object, shape, dtypes, device, layout) -> bool:
    """Whether `t` meets every given requirement (the hot path: plain comparisons only)."""
    if not isinstance(t, _Tensor):
        return False
    if shape is not None:
        ts = t.shape
        if ts != shape:  # equal when every size is given as an int and matches
            if len(ts) != len(shape):
                return False
            for want, got in zip(shape, ts, strict=True):
                if type(want) is int and want != got:  # None / a name: any size
                    return False
    if dtypes is not None:
        if dtypes.__class__ is _dtype:
            if t.dtype != dtypes:
                return False
        elif t.dtype not in dtypes:
            return False
    if device is not None:
        if device.__class__ is not _device:
            device = _device(device)
        td = t.device
        if td != device and (device.index is not None or td.type != device.type):
            return False  # an index must match; a device without one matches its type
    if layout is None:
        return True
    if layout == "rows":
        return t.dim() >= 1 and t.stride(-1) == 1
    return t.is_contiguous()


def expect_tensor(name: str, t: object, *, shape: Sequence[_Dim] | None = None,
                  dtypes: torch.dtype | Collection[torch.dtype] | None = None,
                  device: torch.device | str | None = None,
                  layout: str | None = None) -> torch.Tensor:
    """`t` if it is a tensor with `shape`, a dtype in `dtypes`, on `device` and in `layout`
    (each None: not checked); else ValueError naming `name`."""
    if layout is not None and layout != "rows" and layout != "contiguous":
        raise ValueError(f"layout: expected one of {LAYOUTS} or None, got {layout!r}")
    if not _passes(t, shape, dtypes, device, layout):
        want = expectation(shape=shape, dtypes=dtypes, device=device, layout=layout)
        raise ValueError(f"{name}: expected {want}, got {describe(t)}")
    return t


def expect_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """`value` if it is a python int (not a bool) in `[lo, hi]` (either bound None: open);
    else ValueError naming `name`."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and ((lo is not None and value < lo) or (hi is not None and value > hi)):
        ok = False
    if not ok:
        if lo is not None and hi is not None:
            want = f"an int in [{lo}, {hi}]"
        elif lo is not None:
            want = f"an int >= {lo}"
        elif hi is not None:
            want = f"an int <= {hi}"
        else:
            want = "an int"
        raise ValueError(f"{name}: expected {want}, got {value!r}")
    return value


def expect_one_of(name: str, value: object, choices: Collection[object]) -> object:
    """`value` if it is one of `choices`; else ValueError naming `name`."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")
    return value
