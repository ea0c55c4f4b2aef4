"""Registers and spills of every compiled kernel a capture needs, from a CPU (no GPU).

    python -m perf.kernel_resources [--max-bs 64] [--arch 90] [--out DIR]

The capture's specialization keys (the compile census's dry run of the cycle graphs, the
multi-step and the prefill probes, `perf.compile_census.plan_census`, under the launch options
an H200 gets) are compiled by Triton for `sm_<arch>` on this machine (Triton's compiler and its
bundled ptxas need no GPU: the driver is answered with the target), and `ptxas -v` reads each
kernel's registers per thread, spill bytes and shared memory. A CPU-side check for a change
that turns a constexpr into a runtime flag (fewer keys): the flag's code is compiled into the
kernel, which must not raise the hot variants' registers past their occupancy or spill.
It is not a timing: speed is measured on the GPU (`make perf`).

Writes `DIR/kernel_resources.json`: per key the kernel, its constexprs and launch options,
registers, spill stores / loads (bytes), shared memory (bytes) and where it is launched.

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
from pathlib import Path

__all__ = ["ptxas_usage", "main"]

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


def _record(top: int) -> list[dict]:
    """Phase 1 (under TRITON_INTERPRET=1): the census's entries with their encoded arguments."""
    from graphdraft.kernels.precompile_workers import encode_arg
    from perf.compile_census import plan_census

    rec, _engine = plan_census(top, keep=True)
    out = []
    for name, key, args, kwargs, _grid, _context in rec.kept:  # one per key
        out.append({"kernel": name, "args": [encode_arg(a) for a in args],
                    "kwargs": {k: encode_arg(v) for k, v in kwargs.items()},
                    "where": sorted({f"{c[0]}@{c[1]}" for c in rec.where[name][key]})})
    return out


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


def _compile(entries: list[dict], arch: int) -> list[dict]:
    """Phase 2 (compiler, no interpreter): each entry compiled for sm_<arch>, ptxas's usage."""
    from triton.runtime import driver

    from graphdraft.kernels.precompile_workers import decode_arg
    from graphdraft.kernels.warmup import all_kernels

    driver.set_active(_TargetOnlyDriver(arch))
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path  # the ptxas Triton itself runs for this arch
    kernels = all_kernels()
    out = []
    for e in entries:
        k = kernels[e["kernel"]]
        compiled = k.warmup(*[decode_arg(a) for a in e["args"]], grid=(1,),
                            **{n: decode_arg(v) for n, v in e["kwargs"].items()})
        usage = ptxas_usage(compiled.asm["ptx"], arch, ptxas)
        consts = {n: v for n, v in e["kwargs"].items() if not isinstance(v, dict)}
        out.append({"kernel": e["kernel"], "kwargs": consts, "where": e["where"], **usage})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-bs", type=int, default=64)
    ap.add_argument("--arch", type=int, default=90, help="compute capability (90: H100/H200)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--phase", choices=("record", "compile"),
                    help="run one phase only (record: under TRITON_INTERPRET=1), on --file")
    ap.add_argument("--file", type=Path, help="the phases' JSON file")
    args = ap.parse_args(argv)
    if args.phase == "record":
        args.file.write_text(json.dumps(_record(args.max_bs)))
        return 0
    if args.phase == "compile":
        entries = json.loads(args.file.read_text())
        args.file.write_text(json.dumps(_compile(entries, args.arch)))
        return 0
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "entries.json"
        me = [sys.executable, "-m", "perf.kernel_resources", "--max-bs", str(args.max_bs),
              "--arch", str(args.arch), "--file", str(f)]
        env = dict(os.environ, TRITON_INTERPRET="1")
        subprocess.run(me + ["--phase", "record"], env=env, check=True)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(Path(d) / "triton")
        subprocess.run(me + ["--phase", "compile"], env=env, check=True)
        rows = json.loads(f.read_text())
    print(f"{len(rows)} keys, sm_{args.arch}")
    print(f"  {'kernel':<44} {'regs':>4} {'spill st/ld':>12} {'smem':>6}  constexprs / options")
    for r in sorted(rows, key=lambda r: r["kernel"]):
        short = {k: v for k, v in r["kwargs"].items() if k.isupper() or k.startswith("num_")
                 or k in ("maxnreg",)}
        print(f"  {r['kernel']:<44} {r['registers']:>4} {r['spill_stores']:>5}/{r['spill_loads']:<6} "
              f"{r['smem']:>6}  {short}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernel_resources.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
