"""Compile census: the distinct Triton specialization keys a capture of the schedule needs.

    TRITON_INTERPRET=1 python -m perf.compile_census [--max-bs 64,160] [--out DIR]   # on a CPU
    python3 -m perf.compile_census --device cuda [--max-bs 64,160] [--out DIR]        # on a GPU

A kernel is compiled once per specialization key (`kernels.keys.specialization_key`: constexprs,
launch options, argument dtypes, the value specialization of ints (== 1, % 16) and the 16-byte
alignment of pointers). The census runs every forward a CUDA capture would capture (the cycle
graph per draft length and the draft multi-step; the split-mode verify / draft-decode forwards
when `cycle_graph=False`) at EVERY size of the schedule under a dry-run `KeyRecorder` (the key
of each launch is recorded, the launch skipped: the host code of a captured forward reads no
device values, `tests/test_compile_census.py` checks the dry keys against real launches), and
lists per kernel its distinct keys and which argument tells them apart:

* `int ==1 / %16` (Triton's value specialization of an int argument: a row / batch count
  that should be `do_not_specialize`),
* `align` (a pointer's 16-byte alignment: an offset view whose offset scales with a size),
* `constexpr` (a per-size compile-time constant: a tile or a flag),
* `option` (a launch option such as num_warps / num_stages).

The engine is the Llama-3.1-8B-shaped target and its EAGLE-3 head (`perf.models_8b`) with
2 target layers (`startup.spec.reduced_target_config`: `tests/test_precompile_workers.py`
pins that a 2-layer engine launches exactly the full engine's keys) and the full vocabularies
(no shrinking), weights left uninitialised (a dry run reads none through a Triton kernel).
The keys do not depend on the device beyond the SM count (132 on a CPU: an H200's).

The total over the schedule to 64 is the compile count of a cold capture (every key is
compiled once, by one process or another); `perf/capture.py` reports it beside the measured
builds. Writes `DIR/compile_census.json` (per top: total, per kernel keys and reasons).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

__all__ = ["census", "census_total", "explain", "gpu_dry_keys", "gpu_forwards", "build_engine_8b",
           "plan_census", "main"]


def gpu_forwards(engine) -> dict[tuple, object]:
    """The captured forwards `Engine.capture_graphs` captures on a GPU, by their key
    (`graphdraft.startup.forwards.forwards`): in the cycle mode the cycle graph per draft
    length, else the split-mode verify and draft decode forwards; the drafter's multi-step
    when it drafts more than one step; the deferred draft KV's rebuild where k = 0 is captured. (On a CPU every forward is disabled, so `active`
    cannot tell.)"""
    from graphdraft.startup.forwards import forwards

    out = {}
    cycle_mode = getattr(engine.mode, "fused", True)  # the fused cycle graph, else split
    drafter = engine.drafter
    for key, f in forwards(engine):
        if f.name == "draft_multi_step":
            take = drafter is not None and drafter.S > 1
        elif f.name == "draft_kv_rebuild":  # the deferred draft KV of k = 0 cycles
            take = True
        elif f.name.startswith("draft_decode"):
            take = not cycle_mode
        else:
            take = f.name.startswith("spec_cycle") == cycle_mode
        if take:
            out[key] = f
    return out


@contextlib.contextmanager
def gpu_launch_options():
    """While active, the launch wrappers choose what they choose on a CUDA device outside the
    interpreter (PDL on with `launch_pdl` at every row count, `EARLY` with PDL only,
    bf16 dots, the GEMV's register cap): the keys of an H200's launches, recorded on a CPU.
    Only for dry runs (the interpreter cannot run those variants)."""
    from graphdraft.kernels import decode_attention, extend_attention, gemv, pdl

    patches = [(pdl, "supported", lambda device: True), (pdl, "interpreting", lambda: False),
               (gemv, "pdl_supported", lambda device: True)]
    patches += [(m, "interpreting", lambda: False)
                for m in (decode_attention, extend_attention, gemv)]
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    try:
        for m, n, f in patches:
            setattr(m, n, f)
        yield
    finally:
        for m, n, f in reversed(saved):
            setattr(m, n, f)


def gpu_dry_keys(run):
    """The keys an H200 would compile for `run()`: every kernel's launches recorded and skipped
    (`KeyRecorder(launch=False)` of `kernels.keys.all_kernels()`) under the GPU's launch options
    (`gpu_launch_options`), in inference mode. Returns the recorder."""
    import torch

    from graphdraft.kernels.keys import KeyRecorder, all_kernels

    rec = KeyRecorder(all_kernels(), launch=False)
    with torch.inference_mode(), rec, gpu_launch_options():
        run()
    return rec


def census(engine, sizes=None, *, launch: bool = False, kernels=None, gpu_like: bool | None = None,
           prefill: bool = False, keep: bool = False, rec=None):
    """Run every forward of `gpu_forwards(engine)` at each of `sizes` (default: each forward's
    whole schedule) under a `KeyRecorder` of `kernels` (default: `kernels.keys.all_kernels()`),
    the engine's (and drafter's) buffers reset to neutral rows before each run and after;
    with `prefill`, also the plan's prefill probes (`startup.probes.prefill_probes`, their
    context `("prefill", tokens)`: what the first requests launch); `keep`: the recorder keeps
    each new key's launch arguments (`KeyRecorder.kept`);
    `launch=False`: a dry run (keys only; the integer tensors the skipped launches would have
    read or written are zeroed, `KeyRecorder(zero_ints=True)`: a throw-away engine, or one
    whose state is reset after). `gpu_like` (default: a dry run on a CPU): the
    launch options a CUDA device gets (`gpu_launch_options`). `rec`: an earlier census's
    recorder to add to (several engines' keys, each once; `launch` and `keep` are then its
    own). Return the recorder: `keys[kernel]`, and `where[kernel][key]` = {(forward name, bs)}."""
    import torch

    from graphdraft.kernels.keys import KeyRecorder, all_kernels
    from graphdraft.startup.forwards import owner_resets
    from graphdraft.startup.probes import prefill_probes, probe_prefill_dry

    forwards = gpu_forwards(engine)
    resets = owner_resets(engine)

    if rec is None:
        rec = KeyRecorder(kernels if kernels is not None else all_kernels(), launch=launch,
                          zero_ints=not launch, keep=(lambda j: True) if keep else None)
    launch = rec.launch
    if gpu_like is None:
        gpu_like = not launch and torch.device(engine.cfg.device).type != "cuda"
    if gpu_like and launch:
        raise ValueError("gpu_like: expected False with launch=True (the interpreter cannot "
                         "run the GPU's launch variants)")
    opts = gpu_launch_options() if gpu_like else contextlib.nullcontext()
    with torch.inference_mode(), rec, opts:
        for f in forwards.values():
            for bs in (f.batch_sizes if sizes is None else sizes):
                for r in resets:
                    r()
                rec.context = (f.name, bs)
                f._forward(bs)
        for tokens in (prefill_probes(engine) if prefill else ()):
            for r in resets:
                r()
            rec.context = ("prefill", tokens)
            probe_prefill_dry(engine, tokens, rec)
        rec.context = None
    for r in resets:
        r()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return rec


def census_total(rec) -> int:
    return rec.total()


def _kind(a, b) -> str:
    """What tells two specializations of one parameter apart."""
    (ta, sa), (tb, sb) = a, b
    if ta == "constexpr" and tb == "constexpr":
        return "constexpr"
    if ("constexpr", 1) in (a, b) or (ta == tb and {sa, sb} <= {"D", ""}):
        return "align" if ta.startswith("*") else "int ==1 / %16"
    return "dtype"


def _split(key) -> tuple[list, dict]:
    """A key's per-parameter specializations and its launch options (by name)."""
    params = [x for x in key if isinstance(x[1], tuple)]
    options = {x[0]: x[1] for x in key if not isinstance(x[1], tuple)}
    return params, options


def explain(keys) -> list[str]:
    """Per parameter (or launch option) that differs between `keys` (of one kernel): a line
    `name: kind values` (module docstring). [] for one key."""
    keys = sorted(keys, key=repr)
    if len(keys) < 2:
        return []
    split = [_split(k) for k in keys]
    out = []
    for i, (name, _) in enumerate(split[0][0]):
        specs = [p[i][1] for p, _ in split]
        if len({repr(s) for s in specs}) < 2:
            continue
        kinds = {_kind(specs[0], s) for s in specs[1:] if s != specs[0]}
        shown = sorted({repr(s[1]) if s[0] == "constexpr" else f"{s[0]}:{s[1] or '-'}"
                        for s in specs})
        out.append(f"{name}: {'/'.join(sorted(kinds))} {shown}")
    names = sorted({n for _, o in split for n in o})
    for n in names:
        vals = {repr(o.get(n)) for _, o in split}
        if len(vals) > 1:
            out.append(f"{n}: option {sorted(vals)}")
    return out


def report(rec) -> dict:
    """{"total": n, "kernels": {name: {"keys": n, "why": [...], "by_key": [[(forward, bs)...]]}}}"""
    kernels = {}
    for name in sorted(rec.keys):
        keys = rec.keys[name]
        kernels[name] = {
            "keys": len(keys),
            "launches": rec.launches[name],
            "why": explain(keys),
            "by_key": [sorted(rec.where[name].get(k, ())) for k in sorted(keys, key=repr)],
        }
    return {"total": rec.total(), "kernels": kernels}


def build_engine_8b(max_bs: int, device: str = "cpu"):
    """The 8B-shaped pair (2 target layers, full vocabularies, weights uninitialised) and its
    `Engine` (`cuda_graph_max_bs` = `max_running_requests` = `max_bs`, `max_context_len`
    1024), as `perf/capture.py` builds it (default config otherwise)."""
    import torch

    from graphdraft.config import RuntimeConfig
    from graphdraft.models.eagle3 import Eagle3DraftHead
    from graphdraft.models.llama import LlamaForCausalLM
    from graphdraft.serving.engine import Engine
    from graphdraft.startup.spec import reduced_target_config
    from perf.models_8b import LLAMA31_8B, LLAMA31_8B_HEAD

    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    hot = torch.randperm(LLAMA31_8B_HEAD.vocab_size,
                         generator=gen)[: LLAMA31_8B_HEAD.output_vocab_size]
    with torch.device(device):
        target = LlamaForCausalLM(reduced_target_config(LLAMA31_8B), dtype)
        head = Eagle3DraftHead(LLAMA31_8B_HEAD, dtype, hot_token_ids=hot.to(device))
        with torch.no_grad():  # finite values where a torch op (cuBLAS path) reads them
            for p in list(target.parameters()) + list(head.parameters()):
                if p.is_floating_point():
                    p.zero_()
    head.embed_tokens = target.embed_tokens
    backend = "triton" if device == "cpu" else "auto"
    cfg = RuntimeConfig(cuda_graph_max_bs=max_bs, max_running_requests=max_bs,
                        max_context_len=1024, device=device, kernel_backend=backend,
                        precompile_workers=0)
    return Engine(target, cfg, head)


def plan_census(max_bs: int, device: str = "cpu", *, keep: bool = False):
    """`census` of the 8B-shaped engine (`build_engine_8b(max_bs, device)`) over its whole
    schedule and its prefill probes: the keys a cold start compiles (the precompile plan's
    count). Returns (recorder, engine)."""
    engine = build_engine_8b(max_bs, device)
    return census(engine, prefill=True, keep=keep), engine


def demo_engines(device: str = "cpu") -> tuple:
    """The two engines `graphdraft demo` serves with by default (target-only, speculative: the
    shipped pair in float32, graphs to its 8 prompts), built as the demo builds them, with the
    Triton kernels on (on a CPU: for a dry run)."""
    import graphdraft.serving.cli.models as models
    from graphdraft.serving.cli import build_parser
    from graphdraft.serving.engine import Engine

    if not models.shipped_pair_available():
        raise FileNotFoundError(f"demo_engines: no shipped pair in {models.ASSETS}")
    a = build_parser().parse_args(["demo", "--device", device, "--kernel-backend", "triton"])
    a.cuda_graph_max_bs = min(a.num_prompts, a.max_running_requests)  # as `demo` sets it
    m = models.load(a)
    return (Engine(m.target, m.cfg, eos_token_id=m.eos),
            Engine(m.target, m.cfg, m.head, eos_token_id=m.eos))


def demo_census(device: str = "cpu", *, keep: bool = False):
    """`census` of both `demo_engines` and their prefill probes into one recorder: the keys a
    cold `graphdraft demo` compiles. Returns (recorder, (target-only, speculative))."""
    engines = demo_engines(device)
    rec = None
    for e in reversed(engines):  # the speculative engine first, as the demo's plan
        rec = census(e, prefill=True, keep=keep, rec=rec)
    return rec, engines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-bs", default="64,160", help="schedule tops, comma-separated")
    ap.add_argument("--device", default="cpu", help="cpu (under TRITON_INTERPRET=1) or cuda")
    ap.add_argument("--out", type=Path, help="folder for compile_census.json")
    ap.add_argument("--demo", action="store_true",
                    help="the keys of `graphdraft demo` (shipped pair) instead of the 8B pair")
    args = ap.parse_args(argv)
    tops = [int(x) for x in args.max_bs.split(",") if x.strip()]
    if not tops or min(tops) < 1:
        ap.error(f"--max-bs: expected positive ints, got {args.max_bs!r}")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu: run under TRITON_INTERPRET=1")
    out = {}
    runs = [("demo", None)] if args.demo else [(str(top), top) for top in tops]
    for label, top in runs:
        t0 = time.perf_counter()
        if top is None:
            rec, engines = demo_census(args.device)
            sizes = dict(zip(("target-only", "speculative"),
                             (getattr(e, "schedule", None) for e in engines), strict=True))
            what = "graphdraft demo's two engines and their prefill probes"
        else:
            rec, engine = plan_census(top, args.device)
            engines = (engine,)
            sizes = engine.schedule if hasattr(engine, "schedule") else None
            what = f"schedule to {top} and the prefill probes"
            del engine
        del engines  # freed before the next top's engine is built (the 8B vocabularies)
        rep = report(rec)
        rep["seconds"] = round(time.perf_counter() - t0, 1)
        rep["sizes"] = sizes
        out[label] = rep
        print(f"\n{what}: {rep['total']} distinct keys ({rep['seconds']} s)")
        print(f"  {'kernel':<46} {'keys':>4}  why more than one")
        for name, k in rep["kernels"].items():
            why = "; ".join(k["why"]) if k["why"] else ""
            print(f"  {name:<46} {k['keys']:>4}  {why}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compile_census.json").write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
