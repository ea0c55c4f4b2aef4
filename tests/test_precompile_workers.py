"""Precompile worker processes (`graphdraft.startup`): the premise (the plan's
reduced-layer engine launches exactly the Triton specialization keys of the full engine), the
plan (one entry per distinct key, whose decoded arguments give that key back, for one engine
or several), the worker processes (claims: every entry compiled once), failures, the
warm-cache marker, and the config.

The keys are computed on the host as Triton's launcher does (`keys.specialization_key`), so
the premise is checked under the interpreter, for every kernel of `graphdraft.kernels`
(attention's included: `keys.all_kernels`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from graphdraft.config import (
    PRECOMPILE_WORKERS_CAP,
    PRECOMPILE_WORKERS_ENV,
    ModelConfig,
    RuntimeConfig,
)
from graphdraft.kernels import keys
from graphdraft.kernels.buckets import representative_sizes
from graphdraft.startup import compile as compile_
from graphdraft.startup import entries as sentries
from graphdraft.startup import forwards as sf
from graphdraft.startup import marker, probes, warmup, workers
from graphdraft.startup import phase as sphase
from graphdraft.startup import plan as splan
from graphdraft.startup import spec as wspec

TARGET = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     intermediate_size=64, num_hidden_layers=6, vocab_size=61,
                     max_position_embeddings=512, rope_theta=10000.0,
                     aux_hidden_state_layer_ids=(1, 3, 4))
SHALLOW = TARGET.replace(num_hidden_layers=3, aux_hidden_state_layer_ids=(1, 1, 1))
"""TARGET at 3 layers, for the checks that launch the full engine for real under the
interpreter: every kind of layer TARGET has (layer 0, which has no residual input; a later
layer that captures the aux stream; a later layer that does not, the last), reduced as TARGET
is (2 layers, aux ids (1, 1, 1)), in half the interpreted time of 6."""
HEAD = TARGET.replace(num_hidden_layers=1, intermediate_size=48,
                      aux_hidden_state_layer_ids=None, num_aux_hidden_states=3,
                      draft_vocab_size=40)


def _runtime(**kw) -> RuntimeConfig:
    base = dict(speculative_num_steps=3, page_size=4, max_running_requests=4, max_context_len=64,
                max_num_batched_tokens=32, cuda_graph_max_bs=4, dtype="bfloat16", device="cpu",
                kernel_backend="triton", precompile_workers=0)
    base.update(kw)
    return RuntimeConfig(**base)


def _full_engine(target_cfg: ModelConfig = TARGET, **kw):
    """The tiny pair's engine (schedule 1, 2, 4 by default; `max_running_requests` and
    `cuda_graph_max_bs` in `kw` for a longer one)."""
    from graphdraft.models.random_models import random_model_pair
    from graphdraft.serving.engine import Engine

    hot = torch.randperm(target_cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    target, head = random_model_pair(target_cfg, HEAD, torch.bfloat16, 3, std=0.5,
                                     hot_token_ids=hot)
    return Engine(target, _runtime(**kw), head)


def _keys(engine, sizes, only=None):
    """{(forward key, bs): {(kernel, key)}} over every forward a GPU captures of the engine
    and its drafter (`perf.compile_census.gpu_forwards`; those of `only` keys: run eagerly,
    the code their graphs capture)."""
    from perf.compile_census import gpu_forwards

    out = {}
    for attr, f in gpu_forwards(engine).items():
        if only is not None and attr not in only:
            continue
        for bs in sizes:
            engine._reset_neutral()
            engine.drafter._reset_neutral()
            with torch.inference_mode(), keys.KeyRecorder(keys.all_kernels()) as rec:
                f._forward(bs)
            out[(attr, bs)] = {(n, k) for n, ks in rec.keys.items() for k in ks}
    return out


# ------------------------------------------------------------------ the premise
def test_reduced_config_keeps_shapes_and_maps_aux_ids():
    r = wspec.reduced_target_config(TARGET)
    assert r.num_hidden_layers == 2 and r.aux_layer_ids() == (1, 1, 1)
    assert (r.hidden_size, r.intermediate_size, r.vocab_size, r.head_dim) == (32, 64, 61, 8)
    assert len(r.aux_layer_ids()) == len(TARGET.aux_layer_ids())  # fc width k * H unchanged
    r0 = wspec.reduced_target_config(TARGET.replace(aux_hidden_state_layer_ids=(0, 2, 5)))
    assert r0.aux_layer_ids() == (0, 1, 1)
    one = wspec.reduced_target_config(TARGET.replace(num_hidden_layers=1,
                                                  aux_hidden_state_layer_ids=(0, 0, 0)))
    assert one.num_hidden_layers == 1 and one.aux_layer_ids() == (0, 0, 0)
    # the default ids of a deep target: [2, L//2, L-3] -> every one a later layer
    deep = wspec.reduced_target_config(TARGET.replace(num_hidden_layers=32,
                                                   aux_hidden_state_layer_ids=None))
    assert deep.aux_layer_ids() == (1, 1, 1)


_MADE: list = []


def _recording_factory(target, runtime, head):
    """An engine factory ("tests.test_precompile_workers:_recording_factory") that records
    what it was given."""
    from graphdraft.serving.engine import Engine

    _MADE.append((target, runtime, head))
    return Engine(target, runtime, head)


def test_the_workers_engine_comes_from_the_specs_factory():
    """`engine_spec` names the engine's class as its factory (start-up imports no serving
    module); `build_engine` calls the factory the spec names with the random-weight models;
    a bad factory is a ValueError naming it."""
    full = _full_engine()
    spec, _ = wspec.engine_spec(full)
    assert spec.factory == "graphdraft.serving.engine:Engine"
    assert wspec.engine_spec(full, factory="x.y:z")[0].factory == "x.y:z"
    _MADE.clear()
    name = "tests.test_precompile_workers:_recording_factory"
    made = wspec.build_engine(dataclasses.replace(spec, factory=name))
    (target, runtime, head), = _MADE
    assert made.target is target and runtime is spec.runtime and head is not None
    assert len(target.layers) == 2 and head.config == spec.head
    for bad, match in (("no_colon", "expected 'module:function'"),
                       ("graphdraft.no_such_module:f", "cannot import"),
                       ("graphdraft.config:NO_SUCH", "cannot import"),
                       ("graphdraft.config:PRECOMPILE_WORKERS_CAP", "expected a callable")):
        with pytest.raises(ValueError, match=f"^factory: {match}"):
            wspec.resolve_factory(bad)


def test_reduced_engine_launches_the_full_engines_keys():
    """A worker's engine (`build_engine(engine_spec(full))`: 2 target layers, random weights)
    launches, for every forward a GPU captures (the cycle graph per draft length, which runs
    the split cycle's verify and draft code, and the multi-step) at two sizes of two buckets,
    exactly the kernel keys of the full 3-layer engine (`SHALLOW`: every kind of layer;
    every kernel module, attention included), and at least one kernel of the layer stack (so
    the check can fail)."""
    full = _full_engine(SHALLOW)
    spec, why = wspec.engine_spec(full)
    assert spec is not None, why
    assert spec.target.num_hidden_layers == 2 and spec.runtime.num_kv_pages == full.cfg.num_kv_pages
    reduced = wspec.build_engine(spec)
    assert len(reduced.target.layers) == 2 and reduced.kv.num_pages == full.kv.num_pages
    sizes = (1, 3)
    assert len(representative_sizes(sizes, (1, 4))) == 2
    a, b = _keys(full, sizes), _keys(reduced, sizes)
    assert a.keys() == b.keys() and len(a) >= 4
    for task in a:
        assert a[task] == b[task], (task, sorted({n for n, _ in a[task] ^ b[task]}))
    names = {n for ks in a.values() for n, _ in ks}
    assert any(n.startswith("decode_attention.") for n in names), names
    assert any(n.startswith("rope.") for n in names), names


def test_the_key_check_sees_a_shape_change():
    """The check above can fail: an FFN width that is not a multiple of 16 (72 against 64)
    launches other keys (value specialization), with the layer count unchanged."""
    verify = {("spec_cycle", 0)}  # the cycle that only verifies: the target's layers
    a = _keys(_full_engine(), (1,), only=verify)
    b = _keys(_full_engine(TARGET.replace(intermediate_size=72)), (1,), only=verify)
    assert a.keys() == b.keys() == {(("spec_cycle", 0), 1)}
    assert any(a[t] != b[t] for t in a)


# ------------------------------------------------------------------ the plan
def _gpu_tasks(monkeypatch, engine):
    """`tasks_of(engine)` as on a GPU: the forwards a CUDA capture captures (the cycle graphs
    and the multi-step) count as active."""
    from capture import CapturedForward
    from perf.compile_census import gpu_forwards

    on = {id(f) for f in gpu_forwards(engine).values()}
    monkeypatch.setattr(CapturedForward, "active", property(lambda self: id(self) in on))
    return sf.tasks_of(engine)


@functools.cache
def engine_to_8_and_its_census():
    """The tiny pair's engine (`SHALLOW`: 3 target layers) with the schedule to 8 (two GEMV
    row tiles at 4 tokens a row) and its real census (`perf.compile_census.census(launch=True)`: every forward a GPU
    captures, launched at every size, the buffers neutral after), built once per test process:
    the plan's check here and the dry run's check of `tests/test_compile_census.py` read it
    (neither changes either)."""
    from perf.compile_census import census

    e = _full_engine(SHALLOW, max_running_requests=8, cuda_graph_max_bs=8)
    return e, census(e, launch=True)


def _recorded_keys(real):
    """Every distinct (kernel, key) of a real census `real`, and per (forward name, bs) the
    ones that run launched."""
    by_run: dict[tuple, set] = {}
    for n, where in real.where.items():
        for k, runs in where.items():
            for run in runs:
                by_run.setdefault(run, set()).add((n, k))
    return {(n, k) for n, ks in real.keys.items() for k in ks}, by_run


def _entry_key(entry):
    kernel = keys.all_kernels()[entry.kernel]
    return (entry.kernel, keys.specialization_key(
        kernel, *[sentries.decode_arg(a) for a in entry.args],
        **{k: sentries.decode_arg(v) for k, v in entry.kwargs.items()}))


def _launched_by(engine, task):
    """{(kernel, key)} that `task` launches for real (a captured forward at its size, or a
    prefill probe), from the engine's neutral state."""
    family, k, bs = task
    engine._reset_neutral()
    engine.drafter._reset_neutral()
    with torch.inference_mode(), keys.KeyRecorder(keys.all_kernels()) as rec:
        if family == sf.PREFILL:
            probes.probe_prefill(engine, bs)
        else:
            sf.forward_of(engine, (family, k))._forward(bs)
    return {(n, k) for n, ks in rec.keys.items() for k in ks}


def needs_of(needs, j):
    """The (engine index, task) contexts whose `needs` hold entry j."""
    return [c for c, js in needs.items() if j in js]


def test_plan_entries_give_back_exactly_the_launched_keys(monkeypatch):
    """`plan_keys` over the representative sizes and the prefill probes: one entry per
    distinct key, and the entries' decoded arguments (mock pointers of the recorded dtype and
    alignment) give back exactly the keys the forwards launch for real at every size of the
    schedule to 8 (two GEMV row tiles at 4 tokens a row) and the real prefill probes, kernel
    by kernel; heavy kernels come first."""
    import json

    e, real = engine_to_8_and_its_census()
    tasks = _gpu_tasks(monkeypatch, e)
    graphs = [t for t in tasks if t[0] != sf.PREFILL]
    probes = [t for t in tasks if t[0] == sf.PREFILL]
    assert tasks == graphs + probes
    assert probes == [(sf.PREFILL, None, n) for n in (8, 32)]  # ragged tiles 16 and 128
    assert len(graphs) >= 8 and len({bs for _, _, bs in graphs}) < len(e.schedule)  # buckets
    spec, _ = wspec.engine_spec(e)
    entries, n_keys, needs = splan.plan_keys([(0, spec, tasks)])
    entries = [sentries.PlanEntry.from_json(json.loads(json.dumps(x.to_json()))) for x in entries]
    got = [_entry_key(x) for x in entries]
    assert len(got) == len(set(got)) == n_keys
    by_probe = {t: _launched_by(e, t) for t in probes}
    prefill_keys = set().union(*by_probe.values())
    recorded, by_run = _recorded_keys(real)
    assert set(got) == recorded | prefill_keys
    assert prefill_keys - recorded  # the eager prefill launches keys of its own
    assert all(x.engine == 0 and x.task in tasks for x in entries)
    # the prefill probes' attention / GEMV keys first (the longest compiles), then each
    # capture task's keys not planned yet in capture order (heavy kernels first within a
    # task), then the probes' other keys; each entry's task is the first capture launching it
    ctxs = [[t for (_, t) in needs_of(needs, j)] for j in range(len(entries))]
    lead = [j for j, x in enumerate(entries) if splan.heavy_rank(x.kernel) < splan._PLAN_NOW
            and any(t in probes for t in ctxs[j])]
    assert lead == list(range(len(lead))) and lead  # a prefix
    assert any(entries[j].kernel.startswith("extend_attention.") for j in lead)
    tail = [j for j in range(len(lead), len(entries)) if all(t in probes for t in ctxs[j])]
    # (none here since commit_pack's prefill flag is a runtime argument: a suffix if any)
    assert tail == list(range(len(entries) - len(tail), len(entries)))
    middle = entries[len(lead): len(entries) - len(tail)]
    order = [(graphs.index(x.task), splan.heavy_rank(x.kernel)) for x in middle]
    assert order == sorted(order)
    rank = {t: r for r, t in enumerate(graphs)}
    for j, x in enumerate(entries):  # the first capture task that launches it, if any
        capture = [t for (_, t) in needs_of(needs, j) if t in rank]
        assert x.task == (min(capture, key=rank.__getitem__) if capture else x.task)
    # each task needs exactly the keys it launches (for real, at its size: the census's run)
    for t in tasks:
        family, k, bs = t
        launched = (by_probe[t] if t in by_probe
                    else by_run[(sf.forward_of(e, (family, k)).name, bs)])
        assert {got[j] for j in needs[(0, t)]} == launched, t


def test_one_plan_for_two_engines_has_each_key_once(monkeypatch):
    """The demo's two engines (target-only and speculative) in one plan: the union of their
    keys, none twice; the target-only engine's own keys are attributed to it only where the
    speculative one launched them not first."""
    from graphdraft.serving.engine import Engine

    spec_e = _full_engine()
    base = Engine(spec_e.target, spec_e.cfg)
    tasks_s = _gpu_tasks(monkeypatch, spec_e)
    from capture import CapturedForward

    monkeypatch.setattr(CapturedForward, "active", property(lambda self: True))
    tasks_b = sf.tasks_of(base)
    assert tasks_b
    (ss, _), (sb, _) = wspec.engine_spec(spec_e), wspec.engine_spec(base)
    batches = []
    both, n, _ = splan.plan_keys([(0, ss, tasks_s), (1, sb, tasks_b)], emit=batches.append)
    # streamed as planned: the batches, in order, are the plan (tasks fixed up after)
    assert len(batches) > 3 and all(batches)
    assert [(x.kernel, x.args, x.kwargs) for b in batches for x in b] == \
        [(x.kernel, x.args, x.kwargs) for x in both]
    alone_s, *_ = splan.plan_keys([(0, ss, tasks_s)])
    alone_b, *_ = splan.plan_keys([(1, sb, tasks_b)])
    keys = lambda es: {_entry_key(x) for x in es}  # noqa: E731
    assert len(both) == n == len(keys(both)) == len(keys(alone_s) | keys(alone_b))
    assert keys(alone_b) - keys(alone_s)  # the target-only engine launches keys of its own
    assert {_entry_key(x) for x in both if x.engine == 1} == keys(alone_b) - keys(alone_s)


def test_arguments_that_cannot_be_encoded_are_named():
    assert sentries.encode_arg(None) is None and sentries.encode_arg(3) == 3 and sentries.encode_arg(0.5) == 0.5
    t = torch.zeros(8, dtype=torch.bfloat16)
    assert sentries.encode_arg(t) == {"tensor": "bfloat16", "aligned": t.data_ptr() % 16 == 0}
    assert sentries.encode_arg(t[1:]) == {"tensor": "bfloat16", "aligned": False}
    m = sentries.decode_arg(sentries.encode_arg(t[1:]))
    assert m.dtype == torch.bfloat16 and m.data_ptr() % 16 != 0
    with pytest.raises(TypeError, match="cannot encode a launch argument of type list"):
        sentries.encode_arg([1, 2])


def test_default_workers_and_config_validation():
    assert wspec.default_workers(_runtime(precompile_workers=3)) == 3
    assert wspec.default_workers(_runtime(precompile_workers=None)) == 0  # CPU
    cuda_like = SimpleNamespace(precompile_workers=None, device="cuda", dp_size=1)
    assert 1 <= wspec.default_workers(cuda_like) <= PRECOMPILE_WORKERS_CAP
    assert wspec.default_workers(SimpleNamespace(precompile_workers=None, device="cuda",
                                              dp_size=2)) == 0
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="precompile_workers"):
            _runtime(precompile_workers=bad)
    with pytest.raises(ValueError, match="precompile_workers.*data parallelism"):
        RuntimeConfig(device="cpu", dp_size=2, precompile_workers=2)
    assert RuntimeConfig(device="cpu", dp_size=2).precompile_workers is None


def test_cli_flag_sets_the_field():
    from graphdraft.serving.cli import build_parser
    from graphdraft.serving.cli.models import runtime_from_args

    p = build_parser()
    a = p.parse_args(["demo", "--device", "cpu", "--precompile-workers", "3"])
    assert runtime_from_args(a).precompile_workers == 3
    a = p.parse_args(["demo", "--device", "cpu"])
    assert runtime_from_args(a).precompile_workers is None
    with pytest.raises(SystemExit):
        p.parse_args(["demo", "--precompile-workers", "-1"])


def test_engine_spec_refuses_what_a_worker_cannot_rebuild():
    from graphdraft.serving.engine import Engine
    from tests.engine_harness import ScriptedDrafter, make_models, runtime

    target, _ = make_models()
    e = Engine(target, runtime(), drafter=None)
    spec, why = wspec.engine_spec(e)
    assert spec is not None and spec.head is None and why == ""
    e.drafter = ScriptedDrafter(e, "random")
    spec, why = wspec.engine_spec(e)
    assert spec is None and "ScriptedDrafter" in why


def test_run_workers_skips_without_work_and_rejects_bad_counts():
    e = _full_engine()  # CPU: nothing is captured, so there is nothing to compile
    assert sphase.run_workers(e, 0).skipped == "precompile_workers=0"
    assert sphase.run_workers(e, 4).skipped == "nothing to capture"
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="precompile_workers"):
            sphase.run_workers(e, bad)


# ------------------------------------------------------------------ the worker process
def _write_plan(workdir, entries, device="cpu", pause=0.0):
    """The plan as `start_workers` streams it: the header, two chunks (`pause` seconds
    apart: workers compile the first while the second is planned), the end marker."""
    import time

    (workdir / "claims").mkdir(exist_ok=True)
    workers.write_atomic(workdir / "plan.json", {"device": device, "target": None})
    half = len(entries) // 2
    for c, part in enumerate((entries[:half], entries[half:])):
        workers.write_atomic(workdir / f"plan.{c}.json", {"entries": [x.to_json() for x in part]})
        time.sleep(pause)
    workers.write_atomic(workdir / "plan.end", {"chunks": 2, "entries": len(entries)})


@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_worker_processes_claim_every_entry_once_and_report(monkeypatch, tmp_path, how):
    """The real worker server (forked from this process, or where there is no fork the
    command `python -m graphdraft.startup.workers DIR 2` with the environment
    `run_workers` gives it), 2 workers, on the CPU, started before the plan exists: each
    worker waits for the plan's header, claims entries as its chunks arrive (the second half
    a while after the first; Triton's warm-up is a no-op under the interpreter: nothing
    built), writes a progress line per entry and its JSON; the server exits 0 after the end
    marker; every entry is claimed by exactly one."""
    if how == "spawn":
        monkeypatch.delattr(workers.os, "fork")
    e = _full_engine()
    tasks = _gpu_tasks(monkeypatch, e)
    spec, _ = wspec.engine_spec(e)
    entries, *_ = splan.plan_keys([(0, spec, tasks)])
    env = workers.worker_env(dataclasses.replace(spec, cache_dir=str(tmp_path / "cache")))
    env["TRITON_INTERPRET"] = "1"
    (tmp_path / "claims").mkdir()
    server = workers.launch_server(tmp_path, 2, tmp_path / "server.txt", env)
    _write_plan(tmp_path, entries, pause=0.5)
    assert server.wait(timeout=300) == 0, (tmp_path / "server.txt").read_text()[-3000:]
    data = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    assert sum(d["compiled"] for d in data) == len(entries) > 10
    assert sorted(int(c.name) for c in (tmp_path / "claims").iterdir()) == list(range(len(entries)))
    assert [workers.read_progress(tmp_path / f"out{i}.json") for i in range(2)] == \
        [d["compiled"] for d in data]
    for d in data:  # builds per entry index (none under the interpreter)
        assert all(0 <= j < len(entries) and n == 0 for j, n in d["built"])
        assert d["wall_s"] >= d["startup_s"] > 0


def test_the_server_reports_a_failed_worker(monkeypatch, tmp_path):
    """A worker that raises: its traceback in its log, the server stops the other and writes
    failed.json (which worker, its status), exit status 1."""
    monkeypatch.setattr(workers, "worker_main", lambda workdir, i: 1 / (i - 1) and 0)
    monkeypatch.setattr(workers.os, "getppid", lambda: 1)  # the parent check stays quiet
    rc = workers.server_main(tmp_path, 2)
    assert rc == 1
    assert json.loads((tmp_path / "failed.json").read_text()) == {"worker": 1, "status": 1}
    assert "ZeroDivisionError" in (tmp_path / "log1.txt").read_text()


def test_a_worker_without_a_plan_gives_up(tmp_path, monkeypatch):
    """No plan within the timeout: exit status 3 (a parent that died never writes one)."""
    from triton.runtime import build

    monkeypatch.setattr(build, "_build", build._build)  # the worker's C-build flags: undone after
    (tmp_path / "claims").mkdir()
    assert workers.worker_main(tmp_path, 0, timeout_s=0.05) == 3


def _fake_active(monkeypatch, engine, builds: int = 1):
    """Make the engine's forwards look capturable on the CPU (tasks to hand out) and their
    precompile count `builds` Triton builds per size (0: a warm cache)."""
    from capture import CapturedForward

    def precompile(self, sizes, stream=None, progress=True):
        for bs in sizes:
            self.stats.built[bs] += builds
        return 0

    monkeypatch.setattr(CapturedForward, "active", property(lambda self: True))
    monkeypatch.setattr(CapturedForward, "precompile", precompile)


def test_failed_worker_is_a_clear_error_and_precompile_falls_back(monkeypatch, tmp_path, caplog):
    """A worker that dies (the server's failed.json and exit status 1): run_workers raises
    PrecompileWorkerError with the worker's status and log; precompile_engine logs it and goes
    on in-process. A server that dies without one: its own log."""
    import logging

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    e = _full_engine(max_running_requests=16, cuda_graph_max_bs=16)
    _fake_active(monkeypatch, e)
    started = []

    def launch(workdir, n, log_path, env):
        (workdir / "log1.txt").write_text("worker exploded\n")
        code = (f"import pathlib, sys; pathlib.Path({str(workdir / 'failed.json')!r})"
                ".write_text('{\"worker\": 1, \"status\": 3}'); sys.exit(1)")
        p = subprocess.Popen([sys.executable, "-c", code])
        started.append(p)
        return p

    monkeypatch.setattr(sphase, "launch_server", launch)
    with pytest.raises(sphase.PrecompileWorkerError,
                       match=r"worker 2 failed \(exit status 3\)(.|\n)*worker exploded"):
        sphase.run_workers(e, 3, progress=False)
    assert len(started) == 1 and started[0].poll() is not None

    def launch_dies(workdir, n, log_path, env):
        with open(log_path, "wb") as log:
            return subprocess.Popen([sys.executable, "-c", "import sys; print('no torch'); "
                                     "sys.exit(4)"], stdout=log, stderr=subprocess.STDOUT)

    monkeypatch.setattr(sphase, "launch_server", launch_dies)
    with pytest.raises(sphase.PrecompileWorkerError, match=r"exit status 4(.|\n)*no torch"):
        sphase.run_workers(e, 3, progress=False)
    monkeypatch.setattr(sphase, "launch_server", launch)
    with caplog.at_level(logging.WARNING):
        counts = warmup.precompile_engine(e, progress=False, workers=3)
    assert "compiling in this process instead" in caplog.text
    assert warmup.worker_report(e) is None and isinstance(counts, dict)


def _idle_server(monkeypatch, started: list, dirs: list | None = None) -> None:
    """`_launch` starts a process that sleeps (a server whose workers never take an entry);
    each goes into `started`, its phase folder into `dirs`."""

    def launch(workdir, n, log_path, env):
        if dirs is not None:
            dirs.append(workdir)
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
        started.append(p)
        return p

    monkeypatch.setattr(sphase, "launch_server", launch)


def test_a_failed_plan_is_a_worker_error_and_stops_the_workers(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    e = _full_engine()
    _fake_active(monkeypatch, e)
    started = []
    _idle_server(monkeypatch, started)

    def boom(plans, emit=None, event=None):
        raise RuntimeError("dry run exploded")

    monkeypatch.setattr(sphase, "plan_keys", boom)
    with pytest.raises(sphase.PrecompileWorkerError, match="plan failed: RuntimeError: dry run"):
        sphase.run_workers(e, 2, progress=False)
    assert len(started) == 1 and all(p.poll() is not None for p in started)


def test_a_failed_plan_header_is_a_worker_error_and_stops_the_workers(monkeypatch, tmp_path):
    """The plan's header (the compile target) is written beside the plan's first steps; its
    failure is raised as the plan's, the server stopped, no entry handed out."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    e = _full_engine()
    _fake_active(monkeypatch, e)
    started, dirs = [], []
    _idle_server(monkeypatch, started, dirs)

    def no_target():
        raise OSError("driver unavailable")

    monkeypatch.setattr(sphase, "current_target", no_target)
    with pytest.raises(sphase.PrecompileWorkerError, match="plan failed: OSError: driver unavailable"):
        sphase.run_workers(e, 2, progress=False)
    assert len(started) == 1 and all(p.poll() is not None for p in started)
    assert not dirs[0].exists()  # the phase's folder (and any chunk) removed


def test_worker_timeout_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    e = _full_engine()
    _fake_active(monkeypatch, e)

    def launch(workdir, n, log_path, env):
        with open(log_path, "wb") as log:
            return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    monkeypatch.setattr(sphase, "launch_server", launch)
    with pytest.raises(sphase.PrecompileWorkerError, match="did not finish within 1 s"):
        sphase.run_workers(e, 2, progress=False, timeout_s=1.0)


def test_workers_report_builds_then_marker_skips_them(monkeypatch, tmp_path):
    """Workers that succeed (stand-ins writing the real output format after claiming nothing:
    this process then compiles every entry itself); their builds land in the forwards'
    `GraphStats.worker_built`, `worker_report` has the phase, and the marker written
    afterwards makes the next precompile skip them."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    e = _full_engine(max_running_requests=16, cuda_graph_max_bs=16)
    _fake_active(monkeypatch, e)
    launched = []
    all_tasks = sf.tasks_of(e)

    def launch(workdir, n, log_path, env):
        assert env["TRITON_CACHE_DIR"] == str(tmp_path / "cache")
        launched.extend(range(n))
        outs = [str(workdir / f"out{i}.json") for i in range(n)]
        code = (  # once the plan is out: 2 builds for every entry, from each worker
            "import json, pathlib, time\n"
            f"end = pathlib.Path({str(workdir / 'plan.end')!r})\n"
            "while not end.exists(): time.sleep(0.01)\n"
            "n = json.loads(end.read_text())['entries']\n"
            "body = json.dumps({'built': [[j, 2] for j in range(n)], 'compiled': 0,"
            " 'startup_s': 0.1, 'plan_wait_s': 0.05, 'wall_s': 0.2})\n"
            f"for o in {outs!r}: pathlib.Path(o).write_text(body)\n")
        with open(log_path, "wb") as log:
            return subprocess.Popen([sys.executable, "-c", code], stdout=log,
                                    stderr=subprocess.STDOUT)

    monkeypatch.setattr(sphase, "launch_server", launch)
    warmup.precompile_engine(e, progress=False, workers=2)
    rep = warmup.worker_report(e)
    assert rep is not None and rep.skipped is None and rep.workers == len(launched) == 2
    assert rep.compiled == [0, 0] and rep.compiled_here == rep.keys > 10
    assert rep.worker_plan_wait_s == [0.05, 0.05] and rep.plan_s > 0
    assert rep.total_built == 2 * 2 * rep.keys
    assert all_tasks[-1][0] == sf.PREFILL  # a probe's builds are in the totals only
    spec, _ = wspec.engine_spec(e)
    per_task = Counter(x.task for x in splan.plan_keys([(0, spec, all_tasks)])[0])
    assert sum(n for t, n in per_task.items() if t[0] != sf.PREFILL) < rep.keys
    for family, k, bs in [t for t in all_tasks if t[0] != sf.PREFILL]:
        f = sf.forward_of(e, (family, k))
        assert f.stats.worker_built[bs] == 4 * per_task[(family, k, bs)]
        # one warm-up per bucket: its representative (largest) size, captured first
        assert f.warmup_iters == 1 and f.warmup_sizes == set(representative_sizes(
            f.batch_sizes, (1, e.cfg.spec_num_tokens), kernels=e.cfg.kernels))
        assert bs in f.warmup_sizes and len(f.warmup_sizes) < len(f.batch_sizes)
    assert list((tmp_path / "cache").glob("graphdraft-precompiled-*.json"))
    launched.clear()
    warmup.precompile_engine(e, progress=False, workers=2)
    assert launched == [] and "warm" in warmup.worker_report(e).skipped
    # a different engine shape has another fingerprint: its workers run
    e2 = _full_engine(max_running_requests=8, cuda_graph_max_bs=8)
    warmup.precompile_engine(e2, progress=False, workers=2)
    assert launched
    # one worker would compile everything serially: none starts
    launched.clear()
    e3 = _full_engine(max_running_requests=12, cuda_graph_max_bs=12)
    assert sphase.run_workers(e3, 1, progress=False).skipped == "one worker only" and not launched


def test_one_started_phase_serves_both_engines_captures(monkeypatch, tmp_path):
    """`start_precompile([base, spec])` (the CLI's call, before the weights are read): one plan
    over both engines, and it returns at once; each engine's `capture_graphs` adopts it (no
    phase of its own): its gates wait for its own index's kernels, the first capture's end
    waits for the phase, the second takes its report; each engine's worker builds land in its
    own forwards' stats, both markers are written, and a second start finds them warm."""
    from capture import CapturedForward
    from graphdraft.serving.engine import Engine

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    spec_e = _full_engine()
    base = Engine(spec_e.target, spec_e.cfg)
    _fake_active(monkeypatch, spec_e)
    phases = []

    def launch(workdir, n, log_path, env):  # 3 builds for every entry, from each worker
        phases.append(workdir)
        outs = [str(workdir / f"out{i}.json") for i in range(n)]
        code = ("import json, pathlib, time\n"
                f"end = pathlib.Path({str(workdir / 'plan.end')!r})\n"
                "while not end.exists(): time.sleep(0.01)\n"
                "n = json.loads(end.read_text())['entries']\n"
                "body = json.dumps({'built': [[j, 3] for j in range(n)], 'compiled': 0,"
                " 'startup_s': 0.1, 'wall_s': 0.2})\n"
                f"for o in {outs!r}: pathlib.Path(o).write_text(body)\n")
        return subprocess.Popen([sys.executable, "-c", code])

    monkeypatch.setattr(sphase, "launch_server", launch)
    assert warmup.start_precompile([base, spec_e], workers=2, progress=False)
    assert len(phases) == 1 and warmup.precompile_running(base) and \
        warmup.precompile_running(spec_e)
    (shared, i0), (shared1, i1) = warmup._PHASES[base], warmup._PHASES[spec_e]
    assert shared is shared1 and (i0, i1) == (0, 1)
    phase = shared.phase
    for index, e in enumerate((base, spec_e)):  # warm-ups per engine, as if planned alone
        spec, _ = wspec.engine_spec(e)
        alone = {x.task for x in splan.plan_keys([(0, spec, sf.tasks_of(e))])[0]
                 if x.task[0] != sf.PREFILL}
        assert set(phase.first_tasks(index)) == alone and alone
    assert {x.engine for x in phase._entries} == {0, 1}  # shared keys: planned once, by base
    with pytest.raises(RuntimeError, match="already runs"):
        warmup.start_precompile([spec_e], workers=2, progress=False)
    gated = []

    def capture(self, stream=None, progress=True):  # the gate a real capture calls first
        for bs in self.batch_sizes:
            if self.before_capture is not None:
                gated.append(self)
                self.before_capture(bs)
        return []

    monkeypatch.setattr(CapturedForward, "capture", capture)
    running = []  # the cost table is timed before the phase ends (its last kernels compiling)
    real_costs = Engine.measure_costs
    monkeypatch.setattr(Engine, "measure_costs", lambda self, **kw: running.append(
        warmup.precompile_running(self)) or real_costs(self, **kw))
    base.capture_graphs(progress=False, precompile_workers=2)
    assert running == [True] and set(base.capture_phases) == {
        "precompile_s", "capture_s", "costs_s", "compile_tail_s"}
    assert len(phases) == 1 and gated and not warmup.precompile_running(base)
    assert all(phase._is_done(j) for (i, _), js in phase._needs.items() if i == 0 for j in js)
    rep = warmup.worker_report(base)
    assert rep is not None and rep.skipped is None and rep.workers == 2
    assert rep.tasks == len(sf.tasks_of(base)) + len(sf.tasks_of(spec_e))
    spec_e.capture_graphs(progress=False, precompile_workers=2)
    assert len(phases) == 1 and warmup.worker_report(spec_e) is rep
    for index, e in enumerate((base, spec_e)):
        stats = sum(f.stats.worker_built[bs] for _, f in sf.forwards(e) for bs in f.batch_sizes)
        want = sum(n for (family, _, _), n in rep.built_of(index).items()
                   if family != sf.PREFILL)
        assert stats == want and (want > 0 or index == 0)
    assert sum(rep.built_of(1).values()) > 0  # the head's kernels: the speculative engine's
    assert marker.is_warm(base) and marker.is_warm(spec_e)
    phases.clear()
    assert not warmup.start_precompile([base, spec_e], workers=2, progress=False)
    assert not phases and "warm" in warmup.worker_report(base).skipped
    assert not warmup.start_precompile([base], workers=0, progress=False)


def test_meanwhile_runs_beside_the_plan_and_its_failure_stops_the_phase(monkeypatch, tmp_path):
    """`start_precompile(meanwhile=...)`: the callable (the CLI's weight read) runs in a thread
    while this process plans (it has started before the plan ends) and is done when the call
    returns; without a phase (workers 0) it still runs; its exception is raised and the
    started phase stopped (no engine left gated)."""
    import threading

    from graphdraft.serving.engine import Engine

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    spec_e = _full_engine()
    base = Engine(spec_e.target, spec_e.cfg)
    _fake_active(monkeypatch, spec_e)

    def launch(workdir, n, log_path, env):
        body = json.dumps({"built": [], "compiled": 0, "startup_s": 0.1, "wall_s": 0.2})
        outs = [str(workdir / f"out{i}.json") for i in range(n)]
        code = f"import pathlib\nfor o in {outs!r}: pathlib.Path(o).write_text({body!r})"
        return subprocess.Popen([sys.executable, "-c", code])

    monkeypatch.setattr(sphase, "launch_server", launch)
    began, planned = threading.Event(), []
    real_plan = splan.plan_keys

    def plan(*args, **kw):  # the plan waits until the read has begun: they overlap
        assert began.wait(10)
        planned.append(True)
        return real_plan(*args, **kw)

    monkeypatch.setattr(sphase, "plan_keys", plan)
    done = []

    def read():
        began.set()
        done.append(threading.current_thread().name)

    assert warmup.start_precompile([base, spec_e], workers=2, progress=False, meanwhile=read)
    assert planned and done == ["graphdraft-meanwhile"]
    for e in (base, spec_e):
        warmup.finish_precompile(e)
    assert not warmup.start_precompile([base], workers=0, meanwhile=read) and len(done) == 2

    def fail():
        began.set()
        raise OSError("disk gone")

    for m in (tmp_path / "cache").glob("graphdraft-precompiled-*.json"):
        m.unlink()  # cold again: the phase starts, then the read fails
    with pytest.raises(OSError, match="disk gone"):
        warmup.start_precompile([base, spec_e], workers=2, progress=False, meanwhile=fail)
    assert not warmup.precompile_running(base) and not warmup.precompile_running(spec_e)
    assert all(f.before_capture is None for e in (base, spec_e)
               for _, f in sf.forwards(e))


def test_counters_tell_builds_from_loads():
    """Triton's compilation listener: a cache miss counts as a build, a hit does not."""
    from capture import compiles

    compiles.install_triton_counter()
    b, tb = compiles.triton_builds(), compiles.thread_builds()
    compiles._on_build(cache_hit=False)
    compiles._on_build(cache_hit=True)
    assert compiles.triton_builds() == b + 1 and compiles.thread_builds() == tb + 1
    import triton

    comp = getattr(getattr(triton, "knobs", None), "compilation", None)
    if comp is not None and hasattr(comp, "listener"):
        assert compiles.builds_counted() and comp.listener is compiles._on_build


def test_env_var_sets_the_default(monkeypatch):
    cuda_like = SimpleNamespace(precompile_workers=None, device="cuda", dp_size=1)
    monkeypatch.setenv(PRECOMPILE_WORKERS_ENV, "3")
    assert wspec.default_workers(cuda_like) == 3
    monkeypatch.setenv(PRECOMPILE_WORKERS_ENV, "0")
    assert wspec.default_workers(cuda_like) == 0
    assert wspec.default_workers(SimpleNamespace(precompile_workers=2, device="cuda",
                                              dp_size=1)) == 2  # the field wins
    monkeypatch.setenv(PRECOMPILE_WORKERS_ENV, "many")
    with pytest.raises(ValueError, match=PRECOMPILE_WORKERS_ENV):
        wspec.default_workers(cuda_like)


# ------------------------------------------------------------------ on the GPU
_GPU_TARGET = ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, intermediate_size=128, num_hidden_layers=5,
                          vocab_size=203, max_position_embeddings=512, rope_theta=10000.0)
"""A shape no other test uses: the model-sized kernels are new to this process's JIT (not in
its memory), so this process's first task builds some (the warm-cache probe sees a cold one)."""


def _gpu_engine(**cfg):
    """An engine of `_GPU_TARGET` and its head on the GPU (random weights, seed 0)."""
    from graphdraft.models.random_models import random_model_pair
    from graphdraft.serving.engine import Engine

    head_cfg = _GPU_TARGET.replace(num_hidden_layers=1, intermediate_size=96,
                                   num_aux_hidden_states=3, draft_vocab_size=100)
    hot = torch.randperm(_GPU_TARGET.vocab_size, generator=torch.Generator().manual_seed(0))[:100]
    target, head = random_model_pair(_GPU_TARGET, head_cfg, torch.bfloat16, 0, std=0.5,
                                     hot_token_ids=hot, device="cuda")
    rc = RuntimeConfig(speculative_num_steps=3, page_size=16, max_context_len=256,
                       dtype="bfloat16", device="cuda", **cfg)
    return Engine(target, rc, head, seed=0)


def _assert_every_size_captured(engine, forwards) -> None:
    """Every active forward captured each of its sizes: the engine's schedule for the
    per-batch-size forwards, the row buckets for the mixed step's (`mixed_target_t<tokens>`)."""
    active = [f for f in forwards if f.active]
    assert active and all(f.captured_sizes == f.batch_sizes for f in active), \
        [(f.name, f.batch_sizes, f.captured_sizes) for f in active]
    assert any(f.batch_sizes == engine.schedule for f in active)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_workers_fill_the_cache_and_the_main_pass_builds_nothing(monkeypatch, tmp_path):
    """A fresh Triton cache, `capture_graphs(precompile_workers=2)`: workers built kernels,
    this process built none while it warmed up and captured every size (every key of the
    plan's reduced engine is one the full engine launches, and none is missing: the premise
    and the plan, on the GPU), graphs replay exactly as eager; a second
    engine of the same shape skips the workers and the precompile pass (marker) and its
    graphs replay exactly as eager too."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))

    def engine():  # one k: exact replay
        return _gpu_engine(max_running_requests=16, cuda_graph_max_bs=16,
                           speculative_policy="fixed")

    e = engine()
    e.capture_graphs(progress=False, precompile_workers=2)
    rep = warmup.worker_report(e)
    assert rep is not None and rep.skipped is None, rep
    assert rep.workers == 2 and rep.total_built > 0 and rep.keys > 0, rep
    assert sum(rep.compiled) + rep.compiled_here == rep.keys, rep  # every key once
    forwards = dict(sf.forwards(e))
    assert sum(f.stats.total_built for f in forwards.values()) == 0
    captures = sum(n for (family, _, _), n in rep.built_of(0).items() if family != sf.PREFILL)
    # the prefill probes' builds (if any: the mixed step's captures may build its kernels)
    # count in the report's totals only, not in any forward's
    assert captures > 0, rep
    assert sum(f.stats.total_worker_built for f in forwards.values()) == captures
    _assert_every_size_captured(e, forwards.values())
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    from graphdraft.serving.verify import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    from capture.compiles import triton_builds

    built = triton_builds()
    graph_out = e.generate(prompts, params)  # prefill (padded mixed graphs), decode cycles
    assert triton_builds() == built, "the first requests built kernels the plan lacks"
    monkeypatch.setenv("GRAPHDRAFT_EAGER", "1")
    eager_out = e.generate(prompts, params)
    monkeypatch.delenv("GRAPHDRAFT_EAGER")
    assert graph_out == eager_out and all(len(o) == 12 for o in graph_out)
    e2 = engine()
    e2.capture_graphs(progress=False, precompile_workers=2)
    assert "warm" in warmup.worker_report(e2).skipped
    forwards2 = dict(sf.forwards(e2))
    _assert_every_size_captured(e2, forwards2.values())
    assert sum(f.stats.total_built for f in forwards2.values()) == 0
    assert sum(f.stats.total_precompile_seconds for f in forwards2.values()) == 0  # no pass
    assert e2.generate(prompts, params) == eager_out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_weights_read_while_two_engines_compile(monkeypatch, tmp_path):
    """The CLI's start-up on a GPU, fresh Triton cache: a saved pair opened (no tensor read),
    the target-only and speculative engines built on its modules, one worker phase started
    for both, the weights read meanwhile; each capture adopts the phase (one phase, every key
    compiled once, every size captured), and both engines' graphs serve what their eager
    forwards serve and what an eager engine on `load_model_pair`'s modules serves."""
    from graphdraft.io.checkpoint import (
        load_model_pair,
        open_model_pair,
        save_eagle3_head,
        save_target,
    )
    from graphdraft.models.random_models import random_model_pair
    from graphdraft.serving.engine import Engine
    from graphdraft.serving.verify import SamplingParams

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    head_cfg = _GPU_TARGET.replace(num_hidden_layers=1, intermediate_size=96,
                                   num_aux_hidden_states=3, draft_vocab_size=100)
    hot = torch.randperm(_GPU_TARGET.vocab_size, generator=torch.Generator().manual_seed(1))[:100]
    target, head = random_model_pair(_GPU_TARGET, head_cfg, torch.bfloat16, 1, std=0.5,
                                     hot_token_ids=hot, device="cuda")
    save_target(target, tmp_path / "t")
    save_eagle3_head(head, tmp_path / "h")
    del target, head
    rc = RuntimeConfig(speculative_num_steps=3, page_size=16, max_context_len=256,
                       max_running_requests=8, cuda_graph_max_bs=8, dtype="bfloat16",
                       device="cuda", speculative_policy="fixed")
    t2, h2, _, weights = open_model_pair(tmp_path / "t", tmp_path / "h", "bfloat16", "cuda")
    base, spec = Engine(t2, rc, seed=0), Engine(t2, rc, h2, seed=0)
    assert warmup.start_precompile([base, spec], workers=2, progress=False,
                                   meanwhile=weights.read)
    assert weights.read_s is not None
    for e in (base, spec):
        e.capture_graphs(progress=False, precompile_workers=2)
    rep = warmup.worker_report(spec)
    assert rep is not None and rep.skipped is None and warmup.worker_report(base) is rep, rep
    assert rep.workers == 2 and sum(rep.compiled) + rep.compiled_here == rep.keys, rep
    assert marker.is_warm(base) and marker.is_warm(spec)
    for e in (base, spec):
        _assert_every_size_captured(e, [f for _, f in sf.forwards(e)])
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11] * 20]
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    graph_out = [e.generate(prompts, params) for e in (base, spec)]
    monkeypatch.setenv("GRAPHDRAFT_EAGER", "1")
    eager_out = [e.generate(prompts, params) for e in (base, spec)]
    ref_t, ref_h, _ = load_model_pair(tmp_path / "t", tmp_path / "h", "bfloat16", "cuda")
    ref_out = Engine(ref_t, rc, ref_h, seed=0).generate(prompts, params)
    monkeypatch.delenv("GRAPHDRAFT_EAGER")
    assert graph_out == eager_out and eager_out[1] == ref_out
    assert all(len(o) == 10 for o in graph_out[1])


def test_plan_bytes_counts_the_reduced_engine(monkeypatch):
    """The plan's throw-away engine: the target less its dropped layers, the head without the
    shared embedding, the KV pools at 2 layers, the overhead; the worker count is what the
    free memory holds beside it and 4 GiB for the capture, a CUDA context each."""
    e = _full_engine()
    spec, _ = wspec.engine_spec(e)
    layer = wspec._param_bytes(e.target.layers[0])
    head = sum(t.numel() * t.element_size() for t in e.drafter.head.parameters()
               if t.data_ptr() != e.target.embed_tokens.data_ptr())
    want = (wspec._param_bytes(e.target) - 4 * layer + head + e.drafter.kv_pool.nbytes()
            + e.kv.nbytes() * 2 // 6 + wspec.PLAN_OVERHEAD_BYTES)
    assert wspec.plan_bytes(e, spec) == want
    assert wspec.memory_cap(e, spec, 5) == 5  # no CUDA: unchanged
    cuda_spec = dataclasses.replace(spec, device="cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ctx = wspec.WORKER_CONTEXT_BYTES
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda d=None: ((4 << 30) + want + 2 * ctx + 1, 80 << 30))
    assert wspec.memory_cap(e, cuda_spec, 5) == 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: ((4 << 30) + want, 80 << 30))
    assert wspec.memory_cap(e, cuda_spec, 5) == 0


def test_build_launcher_runs_the_compiled_kernels_init_hook_and_never_raises():
    """Workers build each kernel's host launcher right after compiling it (Triton 3.6 builds
    it at the first launch otherwise: in the main process, after the workers)."""
    from graphdraft.startup.compile import build_launcher

    class Compiled:
        def __init__(self, fail: bool) -> None:
            self.calls, self.fail = 0, fail

        def _init_handles(self) -> None:
            self.calls += 1
            if self.fail:
                raise RuntimeError("no device")

    ok, bad = Compiled(False), Compiled(True)
    assert build_launcher(ok) and ok.calls == 1
    assert not build_launcher(bad) and bad.calls == 1
    assert not build_launcher(None) and not build_launcher(object())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_second_capture_takes_the_cached_cost_table(monkeypatch, tmp_path):
    """An adaptive engine measures its cycle costs at capture and writes them; a second engine
    of the same shape takes that table (`cost_source` "cached") instead of timing again, and
    serves the same greedy tokens."""
    import graphdraft.serving.engine as engine_mod
    from graphdraft.serving.verify import SamplingParams

    path = tmp_path / "costs.json"
    monkeypatch.setattr(engine_mod, "cost_cache_path", lambda e: path)

    def engine():
        return _gpu_engine(max_running_requests=8, cuda_graph_max_bs=8, precompile_workers=0)

    e1 = engine()
    e1.capture_graphs(progress=False)
    assert e1.cost_source == "measured" and path.exists()
    e2 = engine()
    t = []
    monkeypatch.setattr(engine_mod, "measure_replay_ms", lambda *a, **k: t.append(1) or 1.0)
    e2.capture_graphs(progress=False)
    assert e2.cost_source == "cached" and not t
    assert e2.policy.costs.measured() == e1.policy.costs.measured()
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    assert e2.generate([[1, 2, 3], [4, 5]], params) == e1.generate([[1, 2, 3], [4, 5]], params)


def test_workers_take_the_compile_target_from_the_plan(monkeypatch):
    """A worker answers Triton's target / device / stream questions from the plan (no CUDA
    context of its own) where the driver has those hooks, and builds only the launcher of a
    compiled kernel (`build_launcher(load=False)`: the driver's launcher class, no module
    load); without a target, or with a driver lacking the hooks, nothing changes."""
    from triton.runtime import driver

    class FakeDriver:
        launched = []

        def get_current_target(self):
            raise AssertionError("must not ask the GPU")

        get_current_device = get_current_stream = get_current_target

        def launcher_cls(self, src, metadata):
            self.launched.append((src, metadata))

    fake = FakeDriver()
    monkeypatch.setattr(driver, "_active", fake)
    assert not compile_.use_target(None, "cuda:0") and not compile_.use_target(["cuda", 90, 32], "cpu")
    assert compile_.use_target(["cuda", 90, 32], "cuda:1")
    t = fake.get_current_target()
    assert (t.backend, t.arch, t.warp_size) == ("cuda", 90, 32)
    assert fake.get_current_device() == 1 and fake.get_current_stream(1) == 0
    compiled = SimpleNamespace(src="SRC", metadata="META",
                               _init_handles=lambda: (_ for _ in ()).throw(AssertionError))
    assert compile_.build_launcher(compiled, load=False) and fake.launched == [("SRC", "META")]
    monkeypatch.setattr(driver, "_active", SimpleNamespace(get_current_target=None))
    assert not compile_.use_target(["cuda", 90, 32], "cuda:0")


def test_an_overlapped_phase_gates_each_task_on_its_own_kernels(monkeypatch, tmp_path):
    """`precompile_engine(overlap=True)`: the worker phase (a real forked server, 2 workers,
    the interpreter) runs on while the capture starts; each representative size's
    `before_capture` returns only once every kernel its task launches is compiled (the plan's
    `needs`; those entries are done), other sizes pass at once; `finish_precompile` then
    collects the report (every key compiled once), clears the hooks, writes the marker."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    e = _full_engine(max_running_requests=8, cuda_graph_max_bs=8)
    tasks = _gpu_tasks(monkeypatch, e)
    assert warmup.precompile_engine(e, progress=False, workers=2, overlap=True) == {}
    phase = warmup._PHASES[e][0].phase
    assert set(phase._needs) == {(0, t) for t in tasks}
    assert set().union(*phase._needs.values()) == set(range(len(phase._entries)))
    first = phase.first_tasks(0)
    assert first and set(first) < set(tasks)  # some captures launch no kernel of their own
    assert tasks[-1][0] == sf.PREFILL and all(t[0] != sf.PREFILL for t in first)  # captures
    tasks = [t for t in tasks if t[0] != sf.PREFILL]  # the captures' tasks
    for family, k, bs in tasks:  # the capture order: gates in plan order
        f = sf.forward_of(e, (family, k))
        assert (bs in f.warmup_sizes) == ((family, k, bs) in first)  # warm-ups: first tasks
        f.before_capture(bs)
        assert all(phase._is_done(j) for j in phase._needs[(0, (family, k, bs))])
    rep = warmup.finish_precompile(e)
    assert rep is not None and rep.skipped is None and warmup.worker_report(e) is rep
    assert sum(rep.compiled) + rep.compiled_here == rep.keys == len(phase._entries)
    # the timeline: the plan's events in order, every compile once from the phase's start on
    names = [x[0] for x in rep.plan_events]
    assert names[0] == "server" and names[-1] == "end" and "emit" in names
    assert names.index("header") < names.index("emit") and names.count("engine") == 1
    assert names.count("probes") == 1 and names.index("probes") < names.index("end")
    times = [x[1] for x in rep.plan_events if x[0] != "header"]  # the header: from a thread
    assert times == sorted(times) and times[0] >= 0
    assert sum(n for name, _, n in rep.plan_events if name == "emit") == rep.keys
    line = rep.timeline()
    assert len(line) == rep.keys and [r[1] for r in line] == sorted(r[1] for r in line)
    assert all(0 <= start <= rep.wall_s and sec >= 0 for _, start, sec, *_ in line)
    assert all(len(r) == 4 and 0 <= r[3] <= r[2] for r in line)  # the launcher's share
    assert len(rep.worker_ready_s) == 2 and all(0 <= t <= rep.wall_s for t in rep.worker_ready_s)
    assert all(w > 0 and i == 0 for i, _, _, w in rep.gate_waits)
    assert all(f.before_capture is None for _, f in sf.forwards(e))
    assert marker.is_warm(e) and warmup.finish_precompile(e) is None  # ended once
    # the marker keeps the first tasks: a warm start warms up exactly those
    assert marker.warmup_tasks(e) == first
    for _, f in sf.forwards(e):
        f.warmup_sizes = None
    warmup.precompile_engine(e, progress=False, workers=2, overlap=True)
    assert "warm" in warmup.worker_report(e).skipped
    for family, k, bs in tasks:
        f = sf.forward_of(e, (family, k))
        assert (bs in f.warmup_sizes) == ((family, k, bs) in first)


def test_a_waiting_gate_compiles_only_its_own_kernels(monkeypatch, tmp_path):
    """A gate compiles its task's unclaimed kernels here, nothing of a later capture: while
    a worker holds its own (claimed, marked done a moment later) it waits, then returns."""
    import threading
    import time

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    e = _full_engine(max_running_requests=8, cuda_graph_max_bs=8)
    tasks = _gpu_tasks(monkeypatch, e)
    _idle_server(monkeypatch, [])
    report, phase = sphase.start_workers(e, 2, progress=False)
    try:
        captures = [t for t in tasks if t[0] != sf.PREFILL]
        own = phase._needs[(0, captures[0])]
        for j in own[1:]:  # a worker has all but the first
            assert compile_.claim(phase._workdir, j)

        def finish_own() -> None:
            time.sleep(0.3)
            for j in own[1:]:
                compile_.mark_done(phase._workdir, j)

        worker = threading.Thread(target=finish_own)
        worker.start()
        phase.gate(0, captures[0])
        worker.join()
        done = {j for j in range(len(phase._entries)) if phase._is_done(j)}
        assert done == set(own) and phase._here == 1  # the unclaimed one, here
        assert report.gate_waits and report.gate_waits[0][1] == list(captures[0])
        assert report.gate_waits[0][3] >= 0.25
    finally:
        phase.close()


def test_plan_order_follows_the_capture_order(monkeypatch):
    """`tasks_of` lists tasks in `capture_sequence` order (drafter forwards, then the cycles
    by k descending; sizes largest first), and `capture_graphs` captures in that order."""
    from capture import CapturedForward

    e = _full_engine(max_running_requests=8, cuda_graph_max_bs=8)
    tasks = _gpu_tasks(monkeypatch, e)
    assert tasks[-1][0] == sf.PREFILL  # the prefill probes last (no capture)
    tasks = [t for t in tasks if t[0] != sf.PREFILL]
    seq = e.capture_sequence()
    fwd = dict(sf.forwards(e))
    ranks = [next(i for i, f in enumerate(seq) if f is fwd[(o, a)]) for o, a, _ in tasks]
    assert ranks == sorted(ranks)
    for o, a, _ in tasks:  # within a forward: largest first
        sizes = [bs for o2, a2, bs in tasks if (o2, a2) == (o, a)]
        assert sizes == sorted(sizes, reverse=True)
    captured = []
    monkeypatch.setattr(CapturedForward, "capture",
                        lambda self, stream=None, progress=True: captured.append(self) or [])
    e.capture_graphs(progress=False)
    assert [id(f) for f in captured] == [id(f) for f in seq]


def test_an_overlapped_precompile_of_a_warm_engine_reports_the_skip(monkeypatch, tmp_path):
    """`overlap=True` on a warm cache (the marker): no phase, `worker_report` says why, each
    bucket still warms up once (its kernels load from the cache)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    e = _full_engine()
    _gpu_tasks(monkeypatch, e)
    assert marker.mark_warm(e) is not None
    assert warmup.precompile_engine(e, progress=False, workers=2, overlap=True) == {}
    assert e not in warmup._PHASES and "warm" in warmup.worker_report(e).skipped
    assert all(f.warmup_sizes for _, f in sf.forwards(e) if f.active)


def test_prefill_probes_and_a_probe_leaves_the_engine_as_it_was():
    """`prefill_probes`: a short prompt and a full chunk (rows of the longest prompt), one
    probe when they coincide; `probe_prefill` runs one real prefill step and leaves no
    request, page or committed length behind; a busy engine is refused."""
    from graphdraft.serving.verify import SamplingParams

    e = _full_engine(max_context_len=512, max_num_batched_tokens=1024)
    cap = 512 - 1 - (e.n_row + 3)
    assert probes.prefill_row_cap(e) == cap
    # a row per ragged tile case (2 heads a kv head: 8 and 64 tokens), then 2 rows of the
    # longest prompt (the chunk holds 2)
    assert probes.prefill_probes(e) == [8, 64, 2 * cap]
    assert probes.prefill_probes(_full_engine()) == [8, 32]  # the 32-token chunk caps them
    free = e.pages.num_free_pages
    before = e.states.valid_cache_lengths.clone()
    with torch.inference_mode():
        probes.probe_prefill(e, 8)
    assert not e.has_work and e.stats.steps == 1 and e.stats.prefill_tokens == 8
    assert e.pages.num_free_pages == free and torch.equal(e.states.valid_cache_lengths, before)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="tokens: expected an int >= 1"):
            probes.probe_prefill(e, bad)
    e.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="expected an idle engine"):
        probes.probe_prefill(e, 8)
    assert len(e.waiting) == 1  # the caller's request is untouched


def test_serving_after_the_plan_launches_no_key_it_lacks(monkeypatch):
    """What a fresh engine's first requests launch (prefill steps, a mixed prefill + decode
    step, decode cycles) is all in the plan: nothing is left to compile at the first
    request. Prompts of 5-30 tokens chunked by the 32-token budget, so steps mix prefill
    chunks (of several attention tiles, at odd row offsets) with decode rows."""
    from graphdraft.serving.verify import SamplingParams

    # a vocabulary of 64: logits rows of 16-byte multiples (the token kernel keeps the
    # alignment specialization of its logits, as the 8B's 128256 rows have); 3 layers, the
    # plan's engine 2 (`SHALLOW`)
    e = _full_engine(SHALLOW.replace(vocab_size=64), max_running_requests=4, cuda_graph_max_bs=4)
    tasks = _gpu_tasks(monkeypatch, e)
    spec, _ = wspec.engine_spec(e)
    entries, _, _ = splan.plan_keys([(0, spec, tasks)])
    planned = {_entry_key(x) for x in entries}
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (18, 30, 22, 5)]
    with torch.inference_mode(), keys.KeyRecorder(keys.all_kernels()) as rec:
        e.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    served = {(n, k) for n, ks in rec.keys.items() for k in ks}
    missing = sorted({n for n, _ in served - planned})
    assert not missing, missing
    assert e.stats.steps >= 3


def test_a_forked_child_never_collects_what_the_parent_left(tmp_path):
    """`_fork` freezes the objects alive at the fork out of the child's collector: an
    unreachable cycle the parent had not collected (on a GPU it may hold CUDA tensors, whose
    destructor aborts a forked child) is never finalized there; the parent collects it."""
    import gc
    import os

    class Cycle:
        def __del__(self):
            (tmp_path / f"del{os.getpid()}").write_text("")

    gc.disable()
    try:
        a = Cycle()
        a.me = a
        del a  # garbage, not collected yet
        pid = workers._fork(tmp_path / "log.txt", lambda: (gc.collect(), 0)[1])
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not (tmp_path / f"del{pid}").exists()  # frozen in the child
        assert gc.get_freeze_count() == 0  # the parent's objects are collectable again
        gc.collect()
        assert (tmp_path / f"del{os.getpid()}").exists()
    finally:
        gc.enable()


# ------------------------------------------------------------------ the launchers' C builds
def test_quick_launcher_builds_append_the_flags_to_tritons_c_builds(monkeypatch):
    """`quick_launcher_builds` (what a worker calls first): every C build Triton runs through
    its `_build` gets `LAUNCHER_CFLAGS` after its own flags (positional or keyword `ccflags`),
    once, those of the last call; a `_build` without `ccflags` is left alone."""
    from triton.runtime import build

    calls = []

    def fake(name, src, srcdir, library_dirs, include_dirs, libraries, ccflags, language="c"):
        calls.append((name, list(ccflags), language))
        return "so"

    monkeypatch.setattr(build, "_build", fake)
    assert compile_.quick_launcher_builds(("-O0",)) and compile_.quick_launcher_builds()  # the last flags
    assert build._build("a", "a.c", "d", [], [], [], ["-x"]) == "so"
    build._build("b", "b.c", "d", [], [], [], ccflags=[], language="c++")
    build._build("c", "c.c", "d", [], [], [], None)
    assert calls == [("a", ["-x", *compile_.LAUNCHER_CFLAGS], "c"), ("b", list(compile_.LAUNCHER_CFLAGS), "c++"),
                     ("c", list(compile_.LAUNCHER_CFLAGS), "c")]
    assert compile_.LAUNCHER_CFLAGS == ("-O1",)

    def no_flags(name, src, srcdir, library_dirs, include_dirs, libraries):
        return "so"

    monkeypatch.setattr(build, "_build", no_flags)
    assert not compile_.quick_launcher_builds() and build._build is no_flags


def test_a_c_module_builds_and_loads_with_the_launcher_flags(monkeypatch, tmp_path):
    """Triton's own C build (`compile_module_from_src`: gcc, Python's headers) with flags
    appended builds a module that imports, and the flags reach the compiler (an `#error`
    unless the defined macro arrives), after Triton's -O3: the workers' -O1 is the last."""
    from triton.runtime import build

    monkeypatch.setattr(build, "_build", getattr(build._build, "_graphdraft_original", build._build))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert compile_.quick_launcher_builds(("-DGD_PROBE=1", *compile_.LAUNCHER_CFLAGS))
    src = ("#include <Python.h>\n#ifndef GD_PROBE\n#error expected the appended flags\n#endif\n"
           "static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, \"gd_probe\", NULL, -1, NULL};\n"
           "PyMODINIT_FUNC PyInit_gd_probe(void) { return PyModule_Create(&m); }\n")
    mod = build.compile_module_from_src(src, "gd_probe")
    assert mod.__name__ == "gd_probe"


def test_a_phase_no_capture_adopts_is_stopped_at_once(monkeypatch, tmp_path):
    """An engine on the torch path launches no Triton kernel: the started phase has nothing
    any capture waits for, so `start_precompile` stops it before returning False (its server
    killed, its folder removed, `worker_report` saying why) instead of leaving the workers to
    a garbage collection that removes their folder under them."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    e = _full_engine(kernel_backend="torch")
    _fake_active(monkeypatch, e)
    procs, dirs = [], []

    def launch(workdir, n, log_path, env):  # a server that would run until killed
        dirs.append(workdir)
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                      start_new_session=True))
        return procs[-1]

    monkeypatch.setattr(sphase, "launch_server", launch)
    assert not warmup.start_precompile([e], workers=2, progress=False)
    assert procs and dirs, "the phase should have started (the plan runs before adoption)"
    assert procs[0].poll() is not None and not dirs[0].exists()
    assert not warmup.precompile_running(e)
    assert "no capture needs it" in warmup.worker_report(e).skipped


def test_an_engine_dropped_before_its_capture_stops_its_phase(monkeypatch, tmp_path):
    """The phase an engine adopted but never captured with ends when the engine is collected:
    the workers are killed before their folder is removed."""
    import gc

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    e = _full_engine()
    _fake_active(monkeypatch, e)
    procs, dirs = [], []

    def launch(workdir, n, log_path, env):
        dirs.append(workdir)
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                      start_new_session=True))
        return procs[-1]

    monkeypatch.setattr(sphase, "launch_server", launch)
    assert warmup.start_precompile([e], workers=2, progress=False)
    assert warmup.precompile_running(e) and procs[0].poll() is None and dirs[0].exists()
    del e
    gc.collect()
    assert procs[0].poll() is not None and not dirs[0].exists()


def test_forwards_are_the_engines_registry_in_capture_order():
    """`forwards(engine)`: the graph registry's (key, forward) pairs, capture order; an object
    without a registry is a ValueError naming what was expected."""
    e = _full_engine()
    assert sf.forwards(e) == e.graph_registry.items()
    assert [f for _, f in sf.forwards(e)] == e.capture_sequence()
    key, f = sf.forwards(e)[0]
    assert sf.forward_of(e, key) is f
    with pytest.raises(KeyError, match="no captured forward"):
        sf.forward_of(e, ("no_such_family", None))
    with pytest.raises(ValueError, match="^engine: expected a graph_registry"):
        sf.forwards(SimpleNamespace(drafter=None))
