"""Precompile worker processes (`graphdraft.kernels.precompile_workers`): the premise (a worker's
reduced-layer engine launches exactly the Triton specialization keys of the full engine), the
split of the work (disjoint shares of the distinct keys that together are the keys the forwards
launch), the worker process itself, failures, the warm-cache marker, and the config.

The keys are computed on the host as Triton's launcher does (`warmup.specialization_key`), so
the premise is checked under the interpreter, for every kernel of `graphdraft.kernels`
(attention's included: `warmup.all_kernels`).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from graphdraft.config import ModelConfig, RuntimeConfig
from graphdraft.kernels import precompile_workers as pw
from graphdraft.kernels import warmup
from graphdraft.kernels.buckets import representative_sizes

TARGET = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     intermediate_size=64, num_hidden_layers=6, vocab_size=61,
                     max_position_embeddings=512, rope_theta=10000.0,
                     aux_hidden_state_layer_ids=(1, 3, 4))
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


def _keys(engine, sizes):
    """{(forward attribute, bs): {(kernel, key)}} over every captured forward of the engine and
    its drafter (run eagerly: the code their graphs capture)."""
    forwards = warmup.captured_forwards(engine, engine.drafter)
    out = {}
    for attr, f in forwards.items():
        for bs in sizes:
            engine._reset_neutral()
            engine.drafter._reset_neutral()
            with torch.inference_mode(), warmup.KeyRecorder(warmup.all_kernels()) as rec:
                f._forward(bs)
            out[(attr, bs)] = {(n, k) for n, ks in rec.keys.items() for k in ks}
    return out


# ------------------------------------------------------------------ the premise
def test_reduced_config_keeps_shapes_and_maps_aux_ids():
    r = pw.reduced_target_config(TARGET)
    assert r.num_hidden_layers == 2 and r.aux_layer_ids() == (1, 1, 1)
    assert (r.hidden_size, r.intermediate_size, r.vocab_size, r.head_dim) == (32, 64, 61, 8)
    assert len(r.aux_layer_ids()) == len(TARGET.aux_layer_ids())  # fc width k * H unchanged
    r0 = pw.reduced_target_config(TARGET.replace(aux_hidden_state_layer_ids=(0, 2, 5)))
    assert r0.aux_layer_ids() == (0, 1, 1)
    one = pw.reduced_target_config(TARGET.replace(num_hidden_layers=1,
                                                  aux_hidden_state_layer_ids=(0, 0, 0)))
    assert one.num_hidden_layers == 1 and one.aux_layer_ids() == (0, 0, 0)
    # the default ids of a deep target: [2, L//2, L-3] -> every one a later layer
    deep = pw.reduced_target_config(TARGET.replace(num_hidden_layers=32,
                                                   aux_hidden_state_layer_ids=None))
    assert deep.aux_layer_ids() == (1, 1, 1)


def test_reduced_engine_launches_the_full_engines_keys():
    """A worker's engine (`build_engine(engine_spec(full))`: 2 target layers, random weights)
    launches, for every captured forward at two sizes of two buckets, exactly the kernel keys
    of the full 6-layer engine (every kernel module, attention included), and at least one
    kernel of the layer stack (so the check can fail)."""
    full = _full_engine()
    spec, why = pw.engine_spec(full)
    assert spec is not None, why
    assert spec.target.num_hidden_layers == 2 and spec.runtime.num_kv_pages == full.cfg.num_kv_pages
    reduced = pw.build_engine(spec)
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
    a = _keys(_full_engine(), (1,))
    b = _keys(_full_engine(TARGET.replace(intermediate_size=72)), (1,))
    assert any(a[t] != b[t] for t in a)


# ------------------------------------------------------------------ the split of the work
def _gpu_tasks(monkeypatch, engine):
    """`tasks_of(engine)` as on a GPU: the forwards a CUDA capture captures (the cycle graphs
    and the multi-step) count as active."""
    from capture import CapturedForward
    from perf.compile_census import gpu_forwards

    on = {id(f) for f in gpu_forwards(engine).values()}
    monkeypatch.setattr(CapturedForward, "active", property(lambda self: id(self) in on))
    return pw.tasks_of(engine)


def test_key_shares_are_disjoint_and_cover_every_launched_key(monkeypatch):
    """Three workers' shares (`compile_share`, dry runs of the representative sizes): no key
    in two shares, and together exactly the keys the forwards launch (for real) at every
    size of the schedule to 8 (1, 2, 4, 8: two GEMV row tiles at 4 tokens a row), kernel by
    kernel: a worker compiles what capture needs and nothing else."""
    from perf.compile_census import census

    e = _full_engine(max_running_requests=8, cuda_graph_max_bs=8)
    tasks = _gpu_tasks(monkeypatch, e)
    assert len(tasks) >= 8 and len({bs for _, _, bs in tasks}) < len(e.schedule)  # buckets
    shares = [pw.compile_share(e, tasks, (i, 3)) for i in range(3)]
    got = [{(n, k) for n, k, _ in s["compiled"]} for s in shares]
    assert all(got) and sum(len(g) for g in got) == len(set().union(*got))  # disjoint
    assert max(len(g) for g in got) - min(len(g) for g in got) <= 1  # balanced
    real = census(e, launch=True)  # every size of the schedule, kernels run
    launched = {(n, k) for n, ks in real.keys.items() for k in ks}
    assert set().union(*got) == launched
    assert all(s["keys"] == len(launched) for s in shares)
    assert all(t in tasks for s in shares for _, _, t in s["compiled"])
    with pytest.raises(ValueError, match="share"):
        pw.compile_share(e, tasks, (3, 3))


def test_default_workers_and_config_validation():
    assert pw.default_workers(_runtime(precompile_workers=3)) == 3
    assert pw.default_workers(_runtime(precompile_workers=None)) == 0  # CPU
    cuda_like = SimpleNamespace(precompile_workers=None, device="cuda", dp_size=1)
    assert 1 <= pw.default_workers(cuda_like) <= pw.MAX_DEFAULT_WORKERS
    assert pw.default_workers(SimpleNamespace(precompile_workers=None, device="cuda",
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
    spec, why = pw.engine_spec(e)
    assert spec is not None and spec.head is None and why == ""
    e.drafter = ScriptedDrafter(e, "random")
    spec, why = pw.engine_spec(e)
    assert spec is None and "ScriptedDrafter" in why


def test_run_workers_skips_without_work_and_rejects_bad_counts():
    e = _full_engine()  # CPU: nothing is captured, so there is nothing to compile
    assert pw.run_workers(e, 0).skipped == "precompile_workers=0"
    assert pw.run_workers(e, 4).skipped == "nothing to capture"
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="precompile_workers"):
            pw.run_workers(e, bad)


# ------------------------------------------------------------------ the worker process
def test_worker_process_builds_the_engine_and_reports(tmp_path):
    """The real worker command (`python -m graphdraft.kernels.precompile_workers SPEC OUT`, the
    environment `run_workers` gives it) on the CPU: it rebuilds the engine, dry-runs the tasks,
    compiles its share of the keys (Triton's warm-up is a no-op under the interpreter: nothing
    built), writes its progress lines (`keys K`, then `1` per key) and its JSON, exits 0."""
    full = _full_engine()
    spec, _ = pw.engine_spec(full)
    tasks = (("engine", "cycle_graphs", 4), ("drafter", "multi_step_graphs", 1))
    sp, out, log = tmp_path / "spec.pkl", tmp_path / "out.json", tmp_path / "log.txt"
    sp.write_bytes(pickle.dumps(pw.dataclasses.replace(spec, tasks=tasks, share=(1, 2),
                                                       cache_dir=str(tmp_path / "cache"))))
    env = pw._env(pw.dataclasses.replace(spec, cache_dir=str(tmp_path / "cache")))
    env["TRITON_INTERPRET"] = "1"
    proc = pw._launch(sp, out, log, env)
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    data = json.loads(out.read_text())
    assert data["keys"] > 10 and data["compiled"] == data["keys"] // 2  # j % 2 == 1
    assert all(tuple(x[:3]) in tasks and x[3] == 0 for x in data["built"])
    assert pw._read_progress(out) == (data["compiled"], data["compiled"])
    assert data["wall_s"] >= data["startup_s"] > 0 and data["plan_s"] > 0


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
    """A worker that dies: run_workers raises PrecompileWorkerError with its exit status and
    log; the others are stopped; precompile_engine logs it and goes on in-process."""
    import logging

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    e = _full_engine(max_running_requests=16, cuda_graph_max_bs=16)
    _fake_active(monkeypatch, e)
    started = []

    def launch(spec_path, out_path, log_path, env):
        cmd = [sys.executable, "-c", "import sys, time; print('worker exploded'); sys.exit(3)"]
        if started:  # the others would run long: they must be stopped
            cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
        with open(log_path, "wb") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        started.append(p)
        return p

    monkeypatch.setattr(pw, "_launch", launch)
    with pytest.raises(pw.PrecompileWorkerError, match=r"exit status 3(.|\n)*worker exploded"):
        pw.run_workers(e, 3, progress=False)
    assert len(started) >= 2 and all(p.poll() is not None for p in started)
    started.clear()
    with caplog.at_level(logging.WARNING):
        counts = warmup.precompile_engine(e, progress=False, workers=3)
    assert "compiling in this process instead" in caplog.text
    assert warmup.worker_report(e) is None and isinstance(counts, dict)


def test_worker_timeout_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    e = _full_engine()
    _fake_active(monkeypatch, e)

    def launch(spec_path, out_path, log_path, env):
        with open(log_path, "wb") as log:
            return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                    stdout=log, stderr=subprocess.STDOUT)

    monkeypatch.setattr(pw, "_launch", launch)
    with pytest.raises(pw.PrecompileWorkerError, match="did not finish within 1 s"):
        pw.run_workers(e, 2, progress=False, timeout_s=1.0)


def test_workers_report_builds_then_marker_skips_them(monkeypatch, tmp_path):
    """Workers that succeed (stand-ins writing the real output format): each got every task
    and its own share (i, n); their builds land in the forwards' `GraphStats.worker_built`,
    `worker_report` has the phase, and the marker written afterwards makes the next
    precompile skip them."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    e = _full_engine(max_running_requests=16, cuda_graph_max_bs=16)
    _fake_active(monkeypatch, e)
    launched = []

    def launch(spec_path, out_path, log_path, env):
        spec = pickle.loads(spec_path.read_bytes())
        assert env["TRITON_CACHE_DIR"] == str(tmp_path / "cache")
        launched.append(spec)
        body = json.dumps({"built": [[*t, 2] for t in spec.tasks], "keys": 7, "compiled": 3,
                           "startup_s": 0.1, "plan_s": 0.05, "wall_s": 0.2})
        code = f"import pathlib; pathlib.Path({str(out_path)!r}).write_text({body!r})"
        with open(log_path, "wb") as log:
            return subprocess.Popen([sys.executable, "-c", code], stdout=log,
                                    stderr=subprocess.STDOUT)

    monkeypatch.setattr(pw, "_launch", launch)
    warmup.precompile_engine(e, progress=False, workers=2)
    rep = warmup.worker_report(e)
    assert rep is not None and rep.skipped is None and rep.workers == len(launched) == 2
    all_tasks = pw.tasks_of(e)
    assert all(list(s.tasks) == all_tasks for s in launched)
    assert sorted(s.share for s in launched) == [(0, 2), (1, 2)]
    assert rep.keys == 7 and rep.compiled == [3, 3] and rep.worker_plan_s == [0.05, 0.05]
    assert rep.total_built == 2 * 2 * len(all_tasks)
    owners = {"engine": e, "drafter": e.drafter}
    for owner, attr, bs in all_tasks:
        assert getattr(owners[owner], attr).stats.worker_built[bs] == 4
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
    assert pw.run_workers(e3, 1, progress=False).skipped == "one worker only" and not launched


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
    monkeypatch.setenv(pw.ENV, "3")
    assert pw.default_workers(cuda_like) == 3
    monkeypatch.setenv(pw.ENV, "0")
    assert pw.default_workers(cuda_like) == 0
    assert pw.default_workers(SimpleNamespace(precompile_workers=2, device="cuda",
                                              dp_size=1)) == 2  # the field wins
    monkeypatch.setenv(pw.ENV, "many")
    with pytest.raises(ValueError, match=pw.ENV):
        pw.default_workers(cuda_like)


# ------------------------------------------------------------------ on the GPU
_GPU_TARGET = ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, intermediate_size=128, num_hidden_layers=5,
                          vocab_size=203, max_position_embeddings=512, rope_theta=10000.0)
"""A shape no other test uses: the model-sized kernels are new to this process's JIT (not in
its memory), so this process's first task builds some (the warm-cache probe sees a cold one)."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_workers_fill_the_cache_and_the_main_pass_builds_nothing(monkeypatch, tmp_path):
    """A fresh Triton cache, `capture_graphs(precompile_workers=2)`: workers built kernels,
    this process built none while it warmed up and captured every size (every key the
    workers' reduced engines compiled is one the full engine launches, and none is missing:
    the premise and the key shares, on the GPU), graphs replay exactly as eager; a second
    engine of the same shape skips the workers and the precompile pass (marker) and its
    graphs replay exactly as eager too."""
    from graphdraft.models.random_models import random_model_pair
    from graphdraft.serving.engine import Engine

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    head_cfg = _GPU_TARGET.replace(num_hidden_layers=1, intermediate_size=96,
                                   num_aux_hidden_states=3, draft_vocab_size=100)
    hot = torch.randperm(_GPU_TARGET.vocab_size, generator=torch.Generator().manual_seed(0))[:100]

    def engine():
        target, head = random_model_pair(_GPU_TARGET, head_cfg, torch.bfloat16, 0, std=0.5,
                                         hot_token_ids=hot, device="cuda")
        cfg = RuntimeConfig(speculative_num_steps=3, page_size=16, max_running_requests=16,
                            max_context_len=256, cuda_graph_max_bs=16, dtype="bfloat16",
                            device="cuda", speculative_policy="fixed")  # one k: exact replay
        return Engine(target, cfg, head, seed=0)

    e = engine()
    e.capture_graphs(progress=False, precompile_workers=2)
    rep = warmup.worker_report(e)
    assert rep is not None and rep.skipped is None, rep
    assert rep.workers == 2 and rep.total_built > 0 and rep.keys > 0, rep
    assert sum(rep.compiled) == rep.keys, rep  # every key compiled once, by one worker
    forwards = warmup.captured_forwards(e, e.drafter)
    assert sum(f.stats.total_built for f in forwards.values()) == 0
    assert sum(f.stats.total_worker_built for f in forwards.values()) == rep.total_built
    assert all(f.captured_sizes == e.schedule for f in forwards.values() if f.active)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    from graphdraft.serving.verify import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    graph_out = e.generate(prompts, params)
    monkeypatch.setenv("GRAPHDRAFT_EAGER", "1")
    eager_out = e.generate(prompts, params)
    monkeypatch.delenv("GRAPHDRAFT_EAGER")
    assert graph_out == eager_out and all(len(o) == 12 for o in graph_out)
    e2 = engine()
    e2.capture_graphs(progress=False, precompile_workers=2)
    assert "warm" in warmup.worker_report(e2).skipped
    forwards2 = warmup.captured_forwards(e2, e2.drafter)
    assert all(f.captured_sizes == e2.schedule for f in forwards2.values() if f.active)
    assert sum(f.stats.total_built for f in forwards2.values()) == 0
    assert sum(f.stats.total_precompile_seconds for f in forwards2.values()) == 0  # no pass
    assert e2.generate(prompts, params) == eager_out


def test_worker_bytes_counts_the_reduced_engine(monkeypatch):
    """A worker's memory: the target less its dropped layers, the head without the shared
    embedding, the KV pools at 2 layers, the overhead; the count is capped by free memory."""
    e = _full_engine()
    spec, _ = pw.engine_spec(e)
    layer = pw._param_bytes(e.target.layers[0])
    head = sum(t.numel() * t.element_size() for t in e.drafter.head.parameters()
               if t.data_ptr() != e.target.embed_tokens.data_ptr())
    want = (pw._param_bytes(e.target) - 4 * layer + head + e.drafter.kv_pool.nbytes()
            + e.kv.nbytes() * 2 // 6 + pw.WORKER_OVERHEAD_BYTES)
    assert pw.worker_bytes(e, spec) == want
    assert pw.memory_cap(e, spec, 5) == 5  # no CUDA: unchanged
    cuda_spec = pw.dataclasses.replace(spec, device="cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda d=None: ((4 << 30) + 2 * want + 1, 80 << 30))
    assert pw.memory_cap(e, cuda_spec, 5) == 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (1 << 30, 80 << 30))
    assert pw.memory_cap(e, cuda_spec, 5) == 0


def test_build_launcher_runs_the_compiled_kernels_init_hook_and_never_raises():
    """Workers build each kernel's host launcher right after compiling it (Triton 3.6 builds
    it at the first launch otherwise: in the main process, after the workers)."""
    from graphdraft.kernels.precompile_workers import build_launcher

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
