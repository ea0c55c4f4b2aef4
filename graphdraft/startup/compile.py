"""Compiling one plan entry without a launch, claiming entries between processes, and the
Triton hooks that make a worker cheap.

An entry is compiled with Triton's `JITFunction.warmup` (compile, no launch: the same key) and
its host launcher (`build_launcher`). Processes share the plan's entries by claims: entry j is
taken by creating `claims/<j>` exclusively (none compiled twice, none idle while work is
left) and marked `done/<j>` once compiled (what the main process's capture gates wait for).
A worker never opens a CUDA context: Triton's compile target, device and stream come with
the plan (`use_target`), and a kernel's launcher is built without loading its module.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from capture.compiles import triton_builds
from graphdraft.startup.entries import PlanEntry, decode_arg

__all__ = ["LAUNCHER_CFLAGS", "build_launcher", "claim", "compile_entry", "current_target",
           "mark_done", "quick_launcher_builds", "take_and_compile", "use_target"]

logger = logging.getLogger(__name__)


def compile_entry(kernels: dict, entry: PlanEntry, load: bool = True) -> tuple[int, float]:
    """Compile one plan entry (`JITFunction.warmup` with its decoded arguments: Triton's
    compile, no launch) and build its host launcher (`build_launcher(load=...)`); return the
    kernels Triton's compiler built (0: loaded from the cache) and the launcher's seconds."""
    b0 = triton_builds()
    kernel = kernels[entry.kernel]
    compiled = kernel.warmup(*[decode_arg(a) for a in entry.args], grid=(1,),
                             **{k: decode_arg(v) for k, v in entry.kwargs.items()})
    t0 = time.perf_counter()
    build_launcher(compiled, load=load)
    return triton_builds() - b0, time.perf_counter() - t0


def claim(workdir: Path, j: int) -> bool:
    """Take entry j: create `claims/<j>` exclusively (False: another process has it)."""
    try:
        os.close(os.open(workdir / "claims" / str(j), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def mark_done(workdir: Path, j: int) -> None:
    """Entry j is compiled (`done/<j>`; what a gate of the main process waits for)."""
    with contextlib.suppress(OSError):
        (workdir / "done").mkdir(exist_ok=True)
        (workdir / "done" / str(j)).touch()


def take_and_compile(workdir: Path, kernels: dict, entries: Sequence[PlanEntry],
                      built: dict, seconds: list, *, among: Sequence[int] | None = None,
                      on_done=None, stop_after: int | None = None, load: bool = True) -> int:
    """Claim and compile entries (`among`, default all, in plan order) until none is left
    (or `stop_after` compiled): each is marked done (`mark_done`), its builds added to
    `built[j]`, `[kernel, seconds, start, launcher seconds]` to `seconds`, then `on_done(j)`.
    Returns how many this process compiled."""
    done = 0
    for j in range(len(entries)) if among is None else among:
        if stop_after is not None and done >= stop_after:
            break
        if not claim(workdir, j):
            continue
        entry = entries[j]
        t0, wall = time.perf_counter(), time.time()
        n, launcher_s = compile_entry(kernels, entry, load=load)
        seconds.append([entry.kernel, round(time.perf_counter() - t0, 3), round(wall, 4),
                        round(launcher_s, 3)])
        built[j] = built.get(j, 0) + n
        mark_done(workdir, j)
        done += 1
        if on_done is not None:
            on_done(j)
    return done


def build_launcher(compiled, load: bool = True) -> bool:
    """Build (and leave in Triton's on-disk cache) the host launcher of a kernel `warmup` just
    compiled. Triton 3.6 generates a C launcher per argument signature and builds it with the
    system compiler at a kernel's first launch (`CudaLauncher`: `compile_module_from_src`,
    cached by its source), not at `warmup`: an H200 run spent most of the main process's
    capture warm-ups on those builds after the workers had compiled every kernel
    (perf/RESULTS.md 2026-12-04f). `load`: `CompiledKernel._init_handles()` (builds the
    launcher and loads the module into this process's CUDA context); else only the launcher
    (`driver.active.launcher_cls`: no CUDA context needed, what a worker does). Returns whether
    it ran (False: no such hook, e.g. the interpreter, or it failed: the first launch then
    builds it, as before)."""
    try:
        if load:
            init = getattr(compiled, "_init_handles", None)
            if not callable(init):
                return False
            init()
        else:
            from triton.runtime import driver

            src, metadata = getattr(compiled, "src", None), getattr(compiled, "metadata", None)
            if src is None or metadata is None:
                return False
            driver.active.launcher_cls(src, metadata)
    except Exception as exc:  # a private Triton hook: never fail the worker over it
        logger.debug("launcher build skipped: %s", exc)
        return False
    return True


LAUNCHER_CFLAGS = ("-O1",)
"""Appended to the C compiler's flags of Triton's builds in a worker (each kernel's host
launcher; the last -O wins over Triton's -O3). The launchers' C builds are a large share of a
cold start's compile work; at -O1 they build faster and a launch's host cost in the
launcher's C code is unchanged (-O0 builds faster still but costs more per launch):
perf/RESULTS.md 2026-12-05f."""


def quick_launcher_builds(flags: Sequence[str] = LAUNCHER_CFLAGS) -> bool:
    """In this process, Triton's C builds (`triton.runtime.build._build`, a private function:
    its `ccflags`) get `flags` appended; for the worker processes only (every C module they
    build is a launcher of a kernel they compiled). False (nothing changed) where Triton has
    no such function or argument; a build impl the user set (`knobs.build.impl`) is Triton's
    to call and gets no flags. Called again, it wraps Triton's function anew with `flags`."""
    try:
        from triton.runtime import build
    except ImportError:
        return False
    original = getattr(build, "_build", None)
    if original is None:
        return False
    original = getattr(original, "_graphdraft_original", original)  # called before: re-wrap
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return False
    if "ccflags" not in params:
        return False
    at = params.index("ccflags")

    @functools.wraps(original)
    def _build(*args, **kwargs):
        if "ccflags" in kwargs:
            kwargs["ccflags"] = [*(kwargs["ccflags"] or []), *flags]
        elif len(args) > at:
            args = (*args[:at], [*(args[at] or []), *flags], *args[at + 1:])
        else:
            kwargs["ccflags"] = list(flags)
        return original(*args, **kwargs)

    _build._graphdraft_original = original
    build._build = _build
    return True


def current_target() -> list | None:
    """Triton's compile target of this process's current device as JSON data
    ([backend, arch, warp_size]); None without a GPU driver (the interpreter)."""
    try:
        from triton.runtime import driver

        t = driver.active.get_current_target()
        return [t.backend, t.arch, t.warp_size]
    except Exception:  # no GPU driver: the workers then initialise CUDA themselves
        return None


def use_target(target: list | None, device: str) -> bool:
    """Point Triton's driver at `target` and `device` without a CUDA context: the compile
    target, the current device and stream it asks for are answered from the plan, so a worker
    never initialises CUDA (16 workers initialising CUDA side by side took seconds each on the
    H200: perf/RESULTS.md "Figures moved out of the code"). False (nothing changed) without a
    target or where the driver differs."""
    if target is None or not device.startswith("cuda"):
        return False
    try:
        from triton.backends.compiler import GPUTarget
        from triton.runtime import driver

        active = driver.active
        if not all(hasattr(active, a) for a in ("get_current_target", "get_current_device",
                                                  "get_current_stream", "launcher_cls")):
            return False
        index = torch.device(device).index or 0
        tgt = GPUTarget(target[0], target[1], target[2])
        active.get_current_target = lambda: tgt
        active.get_current_device = lambda: index
        active.get_current_stream = lambda *_: 0
    except Exception as exc:
        logger.debug("compile target not set from the plan: %s", exc)
        return False
    return True
