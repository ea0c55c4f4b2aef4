"""Where a decode cycle's launches go, per phase: target only, chain and tree (issue #40).

`PYTHONPATH=$PWD python3 -m perf.studies.tree_launches --device cuda [--bs 1,8]
[--modes target,chain3,tree7,tree5] [--iters 50] [--json OUT.json]`
`TRITON_INTERPRET=1 python3 -m perf.studies.tree_launches --device cpu --tiny|--narrow` (counts)

A random pair at SmolLM2-135M's shape (`SMOLLM2`, `SMOLLM2_HEAD`: hidden 576, 9 q / 3 kv heads
of 64, 30 layers, ffn 1536, vocab 49152, tied embeddings; head: 1 layer, ffn 768, draft vocab
8192, aux layers 2, 15, 27; `--tiny`: a few-layer toy of the same structure), one `Engine`
per mode with `perf/real.py`'s `RuntimeConfig` (fixed policy; `kernel_backend` "auto": the
Triton kernels on CUDA; on the CPU "triton" under TRITON_INTERPRET=1, else "torch"). Each
engine serves `bs` requests (random prompts, `ignore_eos`) until every row decodes; its
per-slot state is then snapshotted, and every measured cycle starts from it
(`Engine.restore_state`), so each one is the same steady decode cycle.

Per mode and bs:
- counted launches by phase (any device): one eager cycle (`ChainMode.cycle` /
  `EngineTrees.run`, the functions the cycle graph captured) under `LaunchCounter`: every
  aten op that is not a view or an allocation (`torch.utils._python_dispatch.TorchDispatchMode`;
  on CUDA an aten op is about one kernel: a sort or topk may be several, a view none) plus
  every Triton launch (`JITFunction.run` / the interpreter's `run`), charged to the
  innermost phase the call stack is in (`phase_points`: method wrappers installed for the
  count only). `syncs`: ops that read a device value on the host (none may run in a graph).
- CUDA only: the same eager cycle under torch.profiler with a `record_function` per phase:
  host launch API calls per phase (`launched`: the kernels, copies and memsets a graph of
  this cycle holds) and their eager GPU time (`gpu_us`, each kernel's own duration: a
  graph replays the same kernels with less launch gap between them);
- CUDA only: the graph-replayed cycle's GPU time, CUDA events around `mode.run` (the graph
  replay the Engine does), median of `--iters` after `--warmup` (state restored before each).

Never CPU timing: on the CPU the study prints counts only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphdraft.config import ModelConfig

SMOLLM2 = ModelConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      intermediate_size=1536, num_hidden_layers=30, vocab_size=49152,
                      rope_theta=100000.0, max_position_embeddings=8192,
                      tie_word_embeddings=True, aux_hidden_state_layer_ids=(2, 15, 27))
SMOLLM2_HEAD = SMOLLM2.replace(num_hidden_layers=1, intermediate_size=768, draft_vocab_size=8192,
                               tie_word_embeddings=False, aux_hidden_state_layer_ids=None)
NARROW = SMOLLM2.replace(hidden_size=64, num_attention_heads=3, num_key_value_heads=1,
                         head_dim=16, intermediate_size=128, vocab_size=2048)
NARROW_HEAD = NARROW.replace(num_hidden_layers=1, intermediate_size=96, draft_vocab_size=512,
                             tie_word_embeddings=False, aux_hidden_state_layer_ids=None)
"""`--narrow`: SmolLM2's depth, heads ratio and modes at narrow widths (a CPU count of the
full model's launches per phase up to width-dependent split counts; the draft vocab stays
wider than `runtime.beams.SORT_MAX`, so the beams rank it as they rank 8192)."""
TINY = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   intermediate_size=64, num_hidden_layers=3, vocab_size=97,
                   max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
                   aux_hidden_state_layer_ids=(0, 1, 2))
TINY_HEAD = TINY.replace(num_hidden_layers=1, intermediate_size=48, draft_vocab_size=48,
                         tie_word_embeddings=False, aux_hidden_state_layer_ids=None)


@dataclass(frozen=True)
class Mode:
    """A decode mode of the study: `steps` 0 = target only; `topk` 1 = chain."""
    name: str
    steps: int
    topk: int
    num_draft_tokens: int


MODES = {"target": Mode("target-only", 0, 1, 1), "chain3": Mode("chain S=3", 3, 1, 4),
         "tree7": Mode("tree 7/2/8", 7, 2, 8), "tree5": Mode("tree 5/2/8", 5, 2, 8)}
TINY_MODES = {"target": Mode("target-only", 0, 1, 1), "chain3": Mode("chain S=3", 3, 1, 4),
              "tree4": Mode("tree 4/2/6", 4, 2, 6)}

PHASES = ("prepare/load", "verify setup", "target fwd", "controls", "accept", "stop cut",
          "logprobs", "compaction", "draft setup", "draft head", "beams", "tree build",
          "store", "commit", "other")
"""Columns of the table, in cycle order ("other": not inside any wrapped call)."""

_NO_KERNEL = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
    "detach", "alias", "set_", "resize_", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "is_same_size", "_local_scalar_dense", "record_stream"})
_SYNC = frozenset({"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"})


# --- counting ---------------------------------------------------------------------------

@dataclass
class Counts:
    """Per phase: `ops` (aten kernels + Triton launches), `triton` (of them), `syncs`, and
    `aten` (op name -> count, all phases)."""
    ops: Counter = field(default_factory=Counter)
    triton: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    aten: Counter = field(default_factory=Counter)
    by_phase_op: dict = field(default_factory=lambda: defaultdict(Counter))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


class _PhaseStack:
    def __init__(self) -> None:
        self.labels: list[str] = []
        self.profile = False
        self.in_triton = 0

    @property
    def current(self) -> str:
        return self.labels[-1] if self.labels else "other"

    @contextlib.contextmanager
    def enter(self, label: str) -> Iterator[None]:
        self.labels.append(label)
        try:
            if self.profile:
                with torch.profiler.record_function(f"tl:{label}"):
                    yield
            else:
                yield
        finally:
            self.labels.pop()


def _wrap(fn: Callable, label: str, stack: _PhaseStack) -> Callable:
    @functools.wraps(fn)
    def inner(*a, **kw):
        with stack.enter(label):
            return fn(*a, **kw)
    return inner


def phase_points() -> list[tuple[object, str, str]]:
    """(owner, attribute, phase) of every call the study labels: classes' methods and module
    functions looked up at call time (`ops.X`, names imported into a module's namespace)."""
    from graphdraft import ops
    from graphdraft.models.eagle3 import Eagle3DraftHead
    from graphdraft.models.llama import LlamaForCausalLM
    from graphdraft.runtime import tree_drafter
    from graphdraft.runtime.drafter import EagleDrafter
    from graphdraft.serving import tree_cycle
    from graphdraft.serving.cycles import chain
    from graphdraft.serving.cycles.base import DecodeMode
    return [
        # chain / target only
        (DecodeMode, "prepare", "prepare/load"), (chain.ChainMode, "verify", "verify setup"),
        (chain.TargetOnlyMode, "verify", "verify setup"), (DecodeMode, "accept", "accept"),
        (DecodeMode, "token_logprobs", "logprobs"), (DecodeMode, "commit", "commit"),
        (EagleDrafter, "draft", "draft setup"), (EagleDrafter, "_multi_step", "beams"),
        # tree
        (tree_cycle.EngineTrees, "run", "prepare/load"),
        (tree_cycle.SlotTrees, "load", "prepare/load"),
        (tree_cycle.TreeCycle, "verify", "verify setup"), (tree_cycle.TreeCycle, "accept", "accept"),
        (tree_cycle.EngineTrees, "stop_cut", "stop cut"),
        (tree_cycle.EngineTrees, "token_logprobs", "logprobs"),
        (tree_cycle.TreeCycle, "compact", "compaction"),
        (tree_cycle.TreeCycle, "draft_and_commit", "commit"),
        (tree_cycle.TreeCycle, "draft", "draft setup"),
        (tree_drafter.TreeDrafter, "first_step", "draft setup"),
        (tree_drafter.TreeDrafter, "expand", "draft setup"),
        (tree_drafter, "first_step", "beams"), (tree_drafter, "decode_step", "beams"),
        (tree_drafter.TreeDrafter, "_controlled", "controls"),
        (tree_cycle.SlotTrees, "store", "store"),
        # both
        (LlamaForCausalLM, "forward", "target fwd"), (Eagle3DraftHead, "forward", "draft head"),
        (ops, "apply_logit_controls", "controls"), (ops, "apply_draft_logit_controls", "controls"),
        (ops, "build_tree", "tree build"), (ops, "count_tokens", "commit"),
        (ops, "commit_pack", "commit"),
    ]


@contextlib.contextmanager
def labelled(stack: _PhaseStack, points: list[tuple[object, str, str]] | None = None
             ) -> Iterator[None]:
    """`points` ((owner, attribute, phase) as `phase_points` gives them; None: those) wrapped
    for the block, restored after it."""
    saved = []
    try:
        for owner, attr, label in phase_points() if points is None else points:
            orig = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            saved.append((owner, attr, orig))
            setattr(owner, attr, _wrap(getattr(owner, attr), label, stack))
        yield
    finally:
        for owner, attr, orig in reversed(saved):
            setattr(owner, attr, orig)


def _triton_run_classes() -> list[type]:
    out = []
    with contextlib.suppress(ImportError):
        from triton.runtime.jit import JITFunction
        out.append(JITFunction)
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction
        out.append(InterpretedFunction)
    return out


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: Counts, stack: _PhaseStack) -> None:
        super().__init__()
        self.counts, self.stack = counts, stack

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.stack.in_triton:  # the interpreter's own tensor traffic: not the cycle's
            return func(*args, **(kwargs or {}))
        if name in _SYNC:
            self.counts.syncs[self.stack.current] += 1
        if not (func.is_view or name in _NO_KERNEL):
            phase = self.stack.current
            self.counts.ops[phase] += 1
            self.counts.aten[name] += 1
            self.counts.by_phase_op[phase][name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def launch_counter(stack: _PhaseStack) -> Iterator[Counts]:
    """Counts the launches of the block by phase (module doc): aten ops through a dispatch
    mode, Triton launches through a wrapper of the JIT (or interpreter) `run`."""
    counts = Counts()
    patched = []

    def wrap_run(orig):
        @functools.wraps(orig)
        def run(self, *a, **kw):
            if not kw.get("warmup", False):
                phase = stack.current
                counts.ops[phase] += 1
                counts.triton[phase] += 1
                name = f"triton:{getattr(self, '__name__', '?')}"
                counts.aten[name] += 1
                counts.by_phase_op[phase][name] += 1
            stack.in_triton += 1
            try:
                return orig(self, *a, **kw)
            finally:
                stack.in_triton -= 1
        return run

    try:
        for cls in _triton_run_classes():
            orig = cls.__dict__["run"]
            patched.append((cls, orig))
            cls.run = wrap_run(orig)
        with _OpCounter(counts, stack):
            yield counts
    finally:
        for cls, orig in patched:
            cls.run = orig


# --- profiler attribution (CUDA) ----------------------------------------------------------

LAUNCH_APIS = ("cudaLaunch", "cuLaunch", "cudaMemcpy", "cuMemcpy", "cudaMemset", "cuMemset")
_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def attribute_trace(events: list[dict]) -> tuple[Counter, Counter]:
    """Chrome-trace `events` of one profiled cycle -> (host launch API calls per phase, GPU us
    per phase): each launch API call (`LAUNCH_APIS`, graph launches excluded) is charged to
    the innermost `tl:<phase>` span (`record_function`) on its thread that contains it
    ("other" when none), and the GPU work correlated with it to the same phase."""
    spans: dict = defaultdict(list)  # tid -> [(start, end, phase)]
    for e in events:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("tl:") and not str(
                e.get("cat", "")).lower().startswith("gpu"):
            t0 = float(e["ts"])
            spans[e.get("tid")].append((t0, t0 + float(e.get("dur", 0.0)), e["name"][3:]))
    launched, gpu_us = Counter(), Counter()
    phase_of_corr = {}
    for e in events:
        cat = str(e.get("cat", "")).lower()
        name = str(e.get("name", ""))
        if e.get("ph") != "X" or cat not in ("cuda_runtime", "cuda_driver"):
            continue
        if not name.startswith(LAUNCH_APIS):
            continue
        ts = float(e["ts"])
        inside = [s for s in spans.get(e.get("tid"), ()) if s[0] <= ts <= s[1]]
        phase = max(inside)[2] if inside else "other"  # the latest start: the innermost
        launched[phase] += 1
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            phase_of_corr[corr] = phase
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() in _GPU_CATS:
            phase = phase_of_corr.get((e.get("args") or {}).get("correlation"))
            if phase is not None:
                gpu_us[phase] += float(e.get("dur", 0.0))
    return launched, gpu_us


def profile_cycle(fn: Callable[[], object], stack: _PhaseStack) -> tuple[Counter, Counter]:
    """`attribute_trace` of one call of `fn` under torch.profiler (CUDA)."""
    from torch.profiler import ProfilerActivity, profile
    stack.profile = True
    try:
        with tempfile.TemporaryDirectory() as tmp, labelled(stack), torch.inference_mode():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text()).get("traceEvents", [])
    finally:
        stack.profile = False
    return attribute_trace(events)


# --- engines --------------------------------------------------------------------------------

SHAPES = {"smollm2": (SMOLLM2, SMOLLM2_HEAD), "narrow": (NARROW, NARROW_HEAD),
          "tiny": (TINY, TINY_HEAD)}


def build_pair(shape: str, device: str, dtype: torch.dtype, seed: int = 0):
    """The random (target, head) pair of `SHAPES[shape]`; hot ids: a fixed random subset of
    the vocab."""
    from graphdraft.models.random_models import random_model_pair
    tcfg, hcfg = SHAPES[shape]
    tiny = shape == "tiny"
    g = torch.Generator().manual_seed(seed)
    hot = torch.randperm(tcfg.vocab_size, generator=g)[: hcfg.draft_vocab_size].sort().values
    return random_model_pair(tcfg, hcfg, dtype, seed, std=0.5 if tiny else 0.05,
                             hot_token_ids=hot, device=device)


def runtime_config(mode: Mode, device: str, dtype: str, sizes: list[int], context: int,
                   backend: str, graphs: bool):
    """`perf/real.py`'s `runtime()` for `mode` (target only: its chain S=3 config, no head),
    graphs captured at the study's batch sizes only (each is its own padded size)."""
    from graphdraft.config import RuntimeConfig
    steps, max_bs = mode.steps or 3, max(sizes)
    return RuntimeConfig(
        speculative_num_steps=steps, speculative_eagle_topk=mode.topk,
        speculative_num_draft_tokens=mode.num_draft_tokens if mode.topk > 1 else None,
        speculative_policy="fixed", max_running_requests=max_bs, max_context_len=context,
        cuda_graph_max_bs=max_bs, cuda_graph_bs=tuple(sorted(set(sizes))),
        kv_cache_memory_gb=1.0 if device.startswith("cuda") else 0.05, dtype=dtype,
        device=device, kernel_backend=backend, enforce_eager=not graphs)


@dataclass
class Steady:
    """An engine with `bs` rows decoding: the cycle functions and the state to restore."""
    engine: object
    bs: int
    pbs: int
    k: int
    snap: dict

    def restore(self) -> None:
        self.engine.restore_state(self.snap)
        self.engine.mode.parts.stage_rows([r.slot for r in self.engine.running]
                                          + [0] * (self.pbs - self.bs))

    def eager(self) -> object:
        """One cycle through the captured function, eagerly."""
        from graphdraft.serving.tree_cycle import TreeMode
        m = self.engine.mode
        if isinstance(m, TreeMode):
            return m.trees.run(self.pbs, sampled=False)
        return m.cycle(self.pbs, self.k)

    def replay(self) -> None:
        """One cycle as the Engine runs it (a graph replay when captured)."""
        self.engine.mode.run(self.bs, self.pbs, self.k, self.engine.running)


def steady(engine, bs: int, prompt_len: int, vocab: int, seed: int = 0) -> Steady:
    """`bs` requests (random prompts, greedy, ignore_eos, room for many cycles) stepped until
    every one has run a decode cycle; the engine drained and its state snapshotted."""
    from graphdraft.serving.verify import SamplingParams
    g = torch.Generator().manual_seed(seed)
    room = engine.cfg.max_context_len - prompt_len - 2 * engine.mode.lookahead
    params = SamplingParams(max_new_tokens=room, ignore_eos=True)
    for _ in range(bs):
        engine.add_request(torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), params)
    with torch.inference_mode():
        for _ in range(64):  # the prefill, then a decode cycle (its step reads back the first tokens)
            engine.step()
            if not engine.waiting and all(r.output for r in engine.running):
                break
        engine.drain()
    if len(engine.running) != bs:
        raise RuntimeError(f"steady: expected {bs} running requests, got {len(engine.running)}")
    pbs = engine.mode.padded(bs)
    st = Steady(engine, bs, pbs, max(engine.steps), engine.state_snapshot())
    st.restore()
    return st


def count_cycle(st: Steady) -> Counts:
    """`LaunchCounter` counts of one eager steady cycle (state restored before and after)."""
    stack = _PhaseStack()
    st.restore()
    with torch.inference_mode(), labelled(stack), launch_counter(stack) as counts:
        st.eager()
    st.restore()
    return counts


def time_replays(st: Steady, warmup: int, iters: int) -> float:
    """Median GPU ms of one replayed cycle (CUDA events; state restored before each)."""
    times = []
    with torch.inference_mode():
        for i in range(warmup + iters):
            st.restore()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            st.replay()
            b.record()
            b.synchronize()
            if i >= warmup:
                times.append(a.elapsed_time(b))
        st.restore()
    return statistics.median(times)


# --- report --------------------------------------------------------------------------------

def _short(phase: str) -> str:
    return {"prepare/load": "load", "verify setup": "vset", "target fwd": "target",
            "controls": "ctrl", "accept": "acc", "stop cut": "stop", "logprobs": "lp",
            "compaction": "comp", "draft setup": "dset", "draft head": "head", "beams": "beams",
            "tree build": "build", "store": "store", "commit": "commit", "other": "other"}[phase]


def table(rows: list[dict], key: str) -> str:
    """One line per (mode, bs): `key` ("counted" / "launched") per phase, total, cycle ms."""
    cols = [p for p in PHASES if any(r[key].get(p) for r in rows if r.get(key))]
    head = f"{'mode':<13}{'bs':>3} " + "".join(f"{_short(p):>7}" for p in cols) + \
        f"{'total':>7}{'syncs':>6}{'cycle ms':>10}"
    lines = [head]
    for r in rows:
        if not r.get(key):
            continue
        ms = f"{r['cycle_ms']:10.3f}" if r.get("cycle_ms") is not None else f"{'-':>10}"
        lines.append(f"{r['mode']:<13}{r['bs']:>3} " + "".join(
            f"{r[key].get(p, 0):>7}" for p in cols) + f"{sum(r[key].values()):>7}"
            f"{sum(r['syncs'].values()):>6}" + ms)
    return "\n".join(lines)


def gpu_table(rows: list[dict]) -> str:
    cols = [p for p in PHASES if any(r.get("gpu_us", {}).get(p) for r in rows)]
    lines = [f"{'mode':<13}{'bs':>3} " + "".join(f"{_short(p):>7}" for p in cols)
             + f"{'sum us':>8}"]
    for r in rows:
        if r.get("gpu_us"):
            lines.append(f"{r['mode']:<13}{r['bs']:>3} " + "".join(
                f"{r['gpu_us'].get(p, 0):>7.0f}" for p in cols)
                + f"{sum(r['gpu_us'].values()):>8.0f}")
    return "\n".join(lines)


def study(modes: list[Mode], sizes: list[int], *, device: str, shape: str, iters: int,
          warmup: int, top: int = 0, prompt_len: int = 32,
          backend: str | None = None) -> list[dict]:
    """One row per (mode, bs): counted (and on CUDA launched, gpu_us, cycle_ms). `backend`
    None: "auto" on CUDA; on the CPU "triton" under TRITON_INTERPRET=1, else "torch"."""
    from graphdraft.serving.engine import Engine
    cuda = device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if backend is None:
        backend = "auto" if cuda else ("triton" if interp else "torch")
    tiny = shape == "tiny"
    target, head = build_pair(shape, device, getattr(torch, dtype))
    vocab = target.config.vocab_size
    rows = []
    for mode in modes:
        cfg = runtime_config(mode, device, dtype, sizes, 256 if tiny else 1024, backend,
                             graphs=cuda)
        eng = Engine(target, cfg, head if mode.steps else None, eos_token_id=0, seed=0)
        if cuda:
            eng.capture_graphs(progress=False)
        for bs in sizes:
            st = steady(eng, bs, prompt_len, vocab)
            counts = count_cycle(st)
            row = {"mode": mode.name, "bs": bs, "padded_bs": st.pbs, "backend": backend,
                   "counted": dict(counts.ops), "triton": dict(counts.triton),
                   "syncs": dict(counts.syncs), "ops": dict(counts.aten.most_common()),
                   "by_phase": {p: dict(c.most_common()) for p, c in counts.by_phase_op.items()}}
            if cuda:
                launched, gpu_us = profile_cycle(st.eager, _PhaseStack())
                st.restore()
                row["launched"], row["gpu_us"] = dict(launched), dict(gpu_us)
                row["cycle_ms"] = time_replays(st, warmup, iters)
            rows.append(row)
            print(f"[tree_launches] {mode.name} bs {bs}: {counts.total} counted launches"
                  + (f", {row['cycle_ms']:.3f} ms a replayed cycle" if cuda else ""), flush=True)
            if top:
                for p, c in counts.by_phase_op.items():
                    print(f"    {p}: " + ", ".join(f"{n} x{v}" for n, v in c.most_common(top)))
            with torch.inference_mode():
                for r in list(eng.running):
                    eng.abort(r)
                eng.drain()
        del eng
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m perf.studies.tree_launches", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="toy shapes (a CPU check of the study)")
    ap.add_argument("--narrow", action="store_true", help="SmolLM2's depth at narrow widths "
                    "(a CPU count of the full model's launches: NARROW)")
    ap.add_argument("--bs", default=None, help="batch sizes, comma-separated (default 1,8; "
                    "--tiny: 1,2)")
    ap.add_argument("--modes", default=None, help=f"of {sorted(MODES)} (--tiny: "
                    f"{sorted(TINY_MODES)}), comma-separated (default all)")
    ap.add_argument("--backend", choices=("auto", "triton", "torch"), default=None,
                    help="RuntimeConfig.kernel_backend (default: auto on CUDA; on the CPU "
                    "triton under TRITON_INTERPRET=1, else torch)")
    ap.add_argument("--iters", type=int, default=50, help="timed replays (CUDA)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--top", type=int, default=0, help="print each phase's N most counted ops")
    ap.add_argument("--json", default=None, help="write the rows here")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    known = TINY_MODES if a.tiny else MODES
    names = a.modes.split(",") if a.modes else list(known)
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"--modes: expected names from {sorted(known)}, got {bad}")
    try:
        sizes = [int(b) for b in (a.bs or ("1,2" if a.tiny else "1,8")).split(",")]
    except ValueError:
        raise SystemExit(f"--bs: expected comma-separated ints, got {a.bs!r}") from None
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--bs: expected batch sizes >= 1, got {a.bs!r}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    if a.tiny and a.narrow:
        raise SystemExit("--tiny, --narrow: expected one or neither")
    shape = "tiny" if a.tiny else ("narrow" if a.narrow else "smollm2")
    rows = study([known[n] for n in names], sizes, device=a.device, shape=shape,
                 iters=a.iters, warmup=a.warmup, top=a.top, backend=a.backend)
    print(f"\ncounted launches per cycle by phase (aten kernels + Triton launches; "
          f"backend {rows[0]['backend']}):")
    print(table(rows, "counted"))
    if a.device.startswith("cuda"):
        print("\nprofiled host launches per cycle by phase (eager cycle; = a graph's nodes):")
        print(table(rows, "launched"))
        print("\neager GPU kernel us per cycle by phase (kernel durations only):")
        print(gpu_table(rows))
    else:
        print("(CPU: counts only; no timing)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
