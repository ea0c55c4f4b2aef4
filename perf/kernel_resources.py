"""Registers and spills of every compiled kernel a capture needs, from a CPU (no GPU).

    python -m perf.kernel_resources [--max-bs 64 | --demo] [--arch 90] [--by-compile] [--out DIR]

The capture's specialization keys (the compile census's dry run of the cycle graphs, the
multi-step and the prefill probes, `perf.compile_census.plan_census`, under the launch options
an H200 gets) are compiled by Triton for `sm_<arch>` on this machine (Triton's compiler and its
bundled ptxas need no GPU: the driver is answered with the target), and `ptxas -v` reads each
kernel's registers per thread, spill bytes and shared memory. A CPU-side check for a change
that turns a constexpr into a runtime flag (fewer keys): the flag's code is compiled into the
kernel, which must not raise the hot variants' registers past their occupancy or spill.
It is not a timing of the kernels: speed is measured on the GPU (`make perf`). It does time
the compiles (a cold start is bounded by its longest ones, issue 19): per key the seconds of
Triton's compile, one key at a time into an empty cache, and of each stage (frontend: the
AST to IR and cache I/O, then ttir, ttgir, llir, ptx, cubin = ptxas), this host's seconds:
relative only (the device's host and Triton version differ).

Writes `DIR/kernel_resources.json`: per key the kernel, its constexprs and launch options,
registers, spill stores / loads (bytes), shared memory (bytes), compile seconds and their
stages, and where it is launched.

The two phases run apart too, e.g. to compile with the GPU's Triton version from a side venv:
`--phase record --file F` (under TRITON_INTERPRET=1: the keys' launch arguments as JSON), then
`<other python> -m perf.kernel_resources --phase compile --file F` (F rewritten with the rows).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["compile_entries", "encode_entry", "ptxas_usage", "main"]

_USAGE = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")


def ptxas_usage(ptx: str, arch: int, ptxas: str) -> dict:
    """{'registers', 'spill_stores', 'spill_loads', 'smem'} of the one kernel in `ptx`
    (`ptxas -v` for sm_<arch>; 'a' suffix for arch >= 90 as Triton uses)."""
    sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([ptxas, "-v", f"--gpu-name={sm}", str(src), "-o", str(Path(d) / "k.o")],
                           capture_output=True, text=True)
    text = r.stdout + r.stderr
    if r.returncode:
        raise RuntimeError(f"ptxas failed: {text[-2000:]}")
    regs = _USAGE.search(text)
    spill = _SPILL.search(text)
    smem = _SMEM.search(text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spill.group(1)) if spill else 0,
            "spill_loads": int(spill.group(2)) if spill else 0,
            "smem": int(smem.group(1)) if smem else 0}


def _record(top: int, demo: bool = False) -> list[dict]:
    """Phase 1 (under TRITON_INTERPRET=1): the census's entries with their encoded arguments
    (`demo`: `graphdraft demo`'s engines, `compile_census.demo_census`)."""
    from perf.compile_census import demo_census, plan_census

    rec, _engine = demo_census(keep=True) if demo else plan_census(top, keep=True)
    return [encode_entry(name, args, kwargs, sorted({f"{c[0]}@{c[1]}" for c in rec.where[name][key]}))
            for name, key, args, kwargs, _grid, _context in rec.kept]  # one per key


def encode_entry(kernel: str, args, kwargs: dict, where: list[str]) -> dict:
    """One recorded launch (`kernels.keys.KeyRecorder.kept`) as an entry of the compile phase: the
    kernel's name, its arguments as JSON (`startup.entries.encode_arg`), where it runs."""
    from graphdraft.startup.entries import encode_arg

    return {"kernel": kernel, "args": [encode_arg(a) for a in args],
            "kwargs": {k: encode_arg(v) for k, v in kwargs.items()}, "where": list(where)}


def compile_entries(entries: list[dict], workdir: Path, *, arch: int = 90,
                    triton_path: Path | None = None) -> list[dict]:
    """The compile phase in a subprocess without the interpreter (an empty Triton cache under
    `workdir`; `triton_path` first on its path): one row per entry (`_compile`)."""
    f = Path(workdir) / "entries.json"
    f.write_text(json.dumps(entries))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(Path(workdir) / "triton")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(([str(triton_path)] if triton_path else []) + [root]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    subprocess.run([sys.executable, "-m", "perf.kernel_resources", "--phase", "compile",
                    "--arch", str(arch), "--file", str(f)], env=env, check=True, timeout=1800)
    return json.loads(f.read_text())


class _TargetOnlyDriver:
    """Answers what `JITFunction.warmup` asks Triton's driver with a fixed target (no GPU)."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self._target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self._target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, *_):
        return 0

    def is_active(self) -> bool:
        return True


def _time_stages(times: list) -> None:
    """Time each stage of Triton's CUDA pipeline (`CUDABackend.add_stages` wrapped): every
    compile appends (stage, seconds) to `times`."""
    from triton.backends.nvidia.compiler import CUDABackend

    original = CUDABackend.add_stages

    def add_stages(self, stages, options, *rest):
        original(self, stages, options, *rest)
        for name, fn in list(stages.items()):
            def timed(src, metadata, _fn=fn, _name=name):
                t0 = time.perf_counter()
                try:
                    return _fn(src, metadata)
                finally:
                    times.append((_name, time.perf_counter() - t0))
            stages[name] = timed

    CUDABackend.add_stages = add_stages


def _compile(entries: list[dict], arch: int) -> list[dict]:
    """Phase 2 (compiler, no interpreter): each entry compiled for sm_<arch>, one at a time
    (its seconds and stages' seconds), ptxas's usage."""
    import triton
    import triton.language as tl
    from triton.runtime import driver

    from graphdraft.kernels.keys import all_kernels
    from graphdraft.startup.entries import decode_arg

    driver.set_active(_TargetOnlyDriver(arch))
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path  # the ptxas Triton itself runs for this arch
    kernels = all_kernels()
    stages: list = []
    _time_stages(stages)

    @triton.jit
    def _one(x_ptr):  # Triton's one-off set-up is not charged to the first key
        tl.store(x_ptr, 1)

    _one.warmup(decode_arg({"tensor": "int32", "aligned": True}), grid=(1,))
    out = []
    for e in entries:
        k = kernels[e["kernel"]]
        stages.clear()
        t0 = time.perf_counter()
        compiled = k.warmup(*[decode_arg(a) for a in e["args"]], grid=(1,),
                            **{n: decode_arg(v) for n, v in e["kwargs"].items()})
        seconds = time.perf_counter() - t0
        st = {"frontend": round(seconds - sum(s for _, s in stages), 3)}
        st |= {n: round(s, 3) for n, s in stages}
        usage = ptxas_usage(compiled.asm["ptx"], arch, ptxas)
        consts = {n: v for n, v in e["kwargs"].items() if not isinstance(v, dict)}
        out.append({"kernel": e["kernel"], "kwargs": consts, "where": e["where"], **usage,
                    "compile_s": round(seconds, 3), "stages_s": st,
                    "ptx_bytes": len(compiled.asm["ptx"])})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-bs", type=int, default=64)
    ap.add_argument("--arch", type=int, default=90, help="compute capability (90: H100/H200)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--phase", choices=("record", "compile"),
                    help="run one phase only (record: under TRITON_INTERPRET=1), on --file")
    ap.add_argument("--file", type=Path, help="the phases' JSON file")
    ap.add_argument("--demo", action="store_true",
                    help="the keys of `graphdraft demo` (shipped pair, fp32) instead of the 8B pair")
    ap.add_argument("--by-compile", action="store_true",
                    help="list the longest compiles first (default: by kernel name)")
    ap.add_argument("--triton-path", type=Path,
                    help="a folder first on the compile phase's path (another Triton, e.g. "
                         "`pip install --no-deps --target DIR triton==3.6.0`)")
    args = ap.parse_args(argv)
    if args.phase == "record":
        args.file.write_text(json.dumps(_record(args.max_bs, args.demo)))
        return 0
    if args.phase == "compile":
        entries = json.loads(args.file.read_text())
        args.file.write_text(json.dumps(_compile(entries, args.arch)))
        return 0
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "entries.json"
        subprocess.run([sys.executable, "-m", "perf.kernel_resources", "--max-bs", str(args.max_bs),
                        "--file", str(f), "--phase", "record"] + (["--demo"] if args.demo else []),
                       env=dict(os.environ, TRITON_INTERPRET="1"), check=True)
        rows = compile_entries(json.loads(f.read_text()), Path(d), arch=args.arch,
                               triton_path=args.triton_path)
    print(f"{len(rows)} keys, sm_{args.arch}; compile seconds: this host's, one key at a time "
          "(relative only)")
    stage_names = list(dict.fromkeys(n for r in rows for n in r["stages_s"]))
    print(f"  {'kernel':<44} {'regs':>4} {'spill st/ld':>12} {'smem':>6} {'compile':>7} "
          + " ".join(f"{n[:6]:>6}" for n in stage_names) + "  constexprs / options")
    key = (lambda r: -r["compile_s"]) if args.by_compile else (lambda r: r["kernel"])
    for r in sorted(rows, key=key):
        short = {k: v for k, v in r["kwargs"].items() if k.isupper() or k.startswith("num_")
                 or k in ("maxnreg",)}
        print(f"  {r['kernel']:<44} {r['registers']:>4} {r['spill_stores']:>5}/{r['spill_loads']:<6} "
              f"{r['smem']:>6} {r['compile_s']:>7.2f} "
              + " ".join(f"{r['stages_s'].get(n, 0):>6.2f}" for n in stage_names) + f"  {short}")
    print(f"  compile seconds in all: {sum(r['compile_s'] for r in rows):.1f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernel_resources.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
