"""The perf harness without a GPU: floor arithmetic, one tiny case end to end (graph and both
baseline structures, with graphs off and an identity "compiler"), the launch count, the report,
the soak loop."""

from __future__ import annotations

import json
import re

import pytest
import torch

from capture import CapturedForward
from graphdraft.config import ModelConfig
from perf import report
from perf.bench import measure_case
from perf.cases import Case, cases_from_env, default_cases, group_batch_sizes, ordered_params
from perf.compile_baseline import (
    COMPILE_GRAPH,
    REDUCE_OVERHEAD,
    REDUCE_OVERHEAD_DYNAMIC,
    Baseline,
    baseline_from_env,
    inductor,
    measure_compiled,
    reduce_overhead,
)
from perf.draft_group import GroupCache, context_positions, fill_decode_batch, runtime_config
from perf.floors import floor_bytes, floor_info, weight_bytes_per_step
from perf.launches import (
    CALL_MARK,
    GRAPH_LAUNCH_HOST,
    count_launches,
    launches_enabled,
    profile_launches,
)
from perf.models_8b import LLAMA31_8B_HEAD, build_head
from perf.timing import copy_bandwidth

TINY = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   intermediate_size=48, vocab_size=97, draft_vocab_size=53,
                   max_position_embeddings=256, rope_theta=10000.0)


def test_floor_bytes_for_the_8b_head():
    # qkv 6144x8192 + o 4096x4096 + gate_up 28672x4096 + down 4096x14336 + lm_head 32000x4096, bf16
    weights = (6144 * 8192 + 4096 * 4096 + 28672 * 4096 + 4096 * 14336 + 32000 * 4096) * 2
    assert weights == 748_683_264  # 749 MB per step
    assert weight_bytes_per_step(LLAMA31_8B_HEAD) == weights
    fb = floor_bytes(LLAMA31_8B_HEAD, bs=2, kv_len=4096, steps=3)
    assert fb.fc == 4096 * 12288 * 2
    assert fb.kv_per_step == 2 * 4096 * 2 * 8 * 128 * 2
    assert fb.hidden_in == 2 * 4 * 12288 * 2
    assert fb.total == 3 * weights + fb.fc + 3 * fb.kv_per_step + fb.hidden_in
    # the anchor: 3 steps x 749 MB at 4.27 TB/s is about 526 us.
    info = floor_info(LLAMA31_8B_HEAD, 1, 1000, bandwidth=4.27e12)
    assert info["weights_floor_us"] == pytest.approx(526, abs=1)
    assert info["floor_us"] > info["weights_floor_us"]


def test_cases_and_sizes():
    cases = default_cases()
    assert len(cases) == 11 and Case(1, 4096, 64) in cases
    assert group_batch_sizes(cases, (16, 512)) == (1, 8, 32, 64, 128)
    assert group_batch_sizes(cases, (1, 4096)) == (64,)
    assert [c.bs for c in cases_from_env({"GRAPHDRAFT_PERF_BS": "1,8"})] == [1, 8, 1, 8, 8]
    assert baseline_from_env({"GRAPHDRAFT_PERF_COMPILE": "0"}) is None
    default = baseline_from_env({})
    assert default.mode == COMPILE_GRAPH and default.own_graphs and not default.stales_graphs
    assert default.compiler is inductor
    assert baseline_from_env({"GRAPHDRAFT_PERF_COMPILE": "compile+graph"}) == default
    ro = baseline_from_env({"GRAPHDRAFT_PERF_COMPILE": "reduce-overhead"})
    assert ro.mode == REDUCE_OVERHEAD and ro.stales_graphs and ro.compiler.keywords == {
        "dynamic": False} and ro.compiler.func is reduce_overhead
    assert baseline_from_env({"GRAPHDRAFT_PERF_COMPILE": "static"}) == ro  # the old name
    for raw in ("dynamic", "reduce-overhead-dynamic"):
        dyn = baseline_from_env({"GRAPHDRAFT_PERF_COMPILE": raw})
        assert dyn.mode == REDUCE_OVERHEAD_DYNAMIC and dyn.compiler is reduce_overhead
    with pytest.raises(ValueError, match="GRAPHDRAFT_PERF_COMPILE='reduce_overhead'"):
        baseline_from_env({"GRAPHDRAFT_PERF_COMPILE": "reduce_overhead"})
    assert launches_enabled({}) and not launches_enabled({"GRAPHDRAFT_PERF_LAUNCHES": "0"})
    cfg = runtime_config(16, 4096, (1, 8, 32, 64, 128), device="cpu")
    assert cfg.max_context_len == 4112 >= context_positions(4096)
    assert cfg.total_kv_pages == 128 * 4112 // 16 + 1
    assert cfg.cuda_graph_bs == (1, 8, 32, 64, 128) and not cfg.validate_inputs


def _fail(fn):
    raise RuntimeError("no compiler here")


def _identity(calls):
    def compiler(fn):
        calls.append(fn.__name__)
        return fn
    return compiler


def test_tiny_case_end_to_end_on_cpu():
    head = build_head(TINY, "cpu", dtype=torch.float32, std=0.3)
    cases = [Case(4, 24, 1), Case(4, 24, 3)]
    assert [(c.bs, v) for c, v in ordered_params(cases, True)] == [
        (1, "graph"), (3, "graph"), (1, "compile"), (3, "compile")]
    cache = GroupCache(head, cases)
    group = cache.get(4, 24)
    assert cache.get(4, 24) is group
    assert group.cfg.cuda_graph_bs == (1, 3) and group.kv_pool.k[0].abs().sum() > 0
    batch = fill_decode_batch(group, 3)
    assert batch.ctx.bs == 3 and batch.ctx.input_num_tokens == 12
    res = measure_case(group, batch, warmup=1, reps=2, eager_reps=2)
    assert res["eager_equals_graph"] is True
    assert res["graph_replayed"] is False  # no graphs on CPU
    assert res["refresh_diff_us"] == pytest.approx(res["graph_run_us"] - res["graph_decode_us"])
    assert res["graph_first_us"] == pytest.approx(res["graph_decode_us"] - res["graph_multi_us"])
    assert res["refresh_events_us"] > 0 and res["refresh_events_in_place_us"] > 0  # host clock
    assert res["in_place_equals_copy"] is True
    assert "run" not in vars(group.drafter.decode_graphs)  # time_refresh_us unwrapped it
    assert "refresh_launches" not in res  # the profiler pass is CUDA only
    assert group.reference[3].shape == (3, 4)

    # compile+graph with the identity as "compiler": the baseline's structure (a torch-path
    # drafter, compiled forwards in enabled CapturedForwards over its own pool, captured at
    # build) without inductor; on CPU the capture is a no-op and every forward runs eagerly.
    calls = []
    inputs_before = group.inputs.positions.clone(), group.inputs.req_pool_indices.clone()
    res.update(measure_compiled(group, batch, Baseline(COMPILE_GRAPH, _identity(calls), True),
                                warmup=1, reps=2))
    base = group.baseline
    assert calls == ["_decode", "_multi_step"]
    assert isinstance(base.decode_graphs, CapturedForward)
    assert base.decode_graphs.name == "compiled_decode"
    assert base.multi_step_graphs.name == "compiled_multi_step"
    assert base.decode_graphs.pool is base.graph_pool is base.multi_step_graphs.pool
    assert base.graph_pool is not group.drafter.graph_pool
    assert base.decode_graphs.warmup_iters == 3
    assert not base.cfg.use_triton and base.schedule == group.drafter.schedule
    # the capture reset the shared inputs to neutral rows; build_baseline restored them
    assert torch.equal(group.inputs.positions, inputs_before[0])
    assert torch.equal(group.inputs.req_pool_indices, inputs_before[1])
    for key in ("eager", "graph", "compile"):
        for part in ("run", "decode", "multi"):
            assert res[f"{key}_{part}_us"] > 0
        assert isinstance(res[f"{key}_first_us"], float)  # decode - multi (noise on CPU)
    assert res["compile_agreement"] == 1.0  # torch path both ways on CPU
    assert res["compile_graph_replayed"] is False  # CPU: disabled, eager
    assert res["compile_replays"] == 0 and res["compile_eager_forwards"] > 0
    assert res["compile_dropped"] == [] and res["compile_pool_bytes"] == 0
    assert res["compile_s"] > 0 and res["compile_group_s"] > 0
    assert res["compile_case_fx_graphs"] == 0 and "compile_cudagraph_skips" not in res
    assert not group.graphs_stale
    assert group.drafter.head.midlayer.self_attn.kernels.use_triton is False
    res1 = measure_case(group, fill_decode_batch(group, 1), warmup=1, reps=2, eager_reps=2)
    assert res1["eager_equals_graph"] is True  # graphs stay valid after compile+graph

    # reduce-overhead: disabled CapturedForwards, and the group's graphs go stale.
    group.baseline, calls = None, []
    ro = measure_compiled(group, batch, Baseline(REDUCE_OVERHEAD, _identity(calls), False),
                          warmup=0, reps=1)
    assert calls == ["_decode", "_multi_step"] and "compile_error" not in ro
    assert ro["compile_agreement"] == 1.0 and "compile_cudagraph_skips" in ro
    assert "compile_graph_replayed" not in ro
    assert group.baseline.cfg.enforce_eager
    with pytest.raises(RuntimeError, match="cuBLAS workspace"):
        measure_case(group, batch)  # graphs are stale once that baseline exists

    group.baseline = None  # build the baseline again, with a compiler that raises
    failing = Baseline(COMPILE_GRAPH, _fail, True)
    failed = measure_compiled(group, fill_decode_batch(group, 1), failing, warmup=0, reps=1)
    assert failed == {"compile_error": "RuntimeError: no compiler here"}
    assert group.baseline is None and group.baseline_error == failed["compile_error"]
    calls = []  # a failed build is not retried for the group's later cases
    assert measure_compiled(group, batch, Baseline(COMPILE_GRAPH, _identity(calls), True)) == failed
    assert calls == []
    cache.close()
    assert cache.group is None
    assert copy_bandwidth("cpu", nbytes=1 << 20, reps=2) > 0


def _trace(*calls, mark=CALL_MARK):
    """A chrome trace: one `mark` span per call of (api name, gpu name or None) pairs."""
    events, ts, corr = [{"ph": "M", "name": "process_name"}], 0.0, 0
    for call in calls:
        events.append({"ph": "X", "cat": "user_annotation", "name": mark, "ts": ts, "dur": 90.0})
        events.append({"ph": "X", "cat": "gpu_user_annotation", "name": mark, "ts": ts + 500,
                       "dur": 5.0})
        for i, (api, gpu) in enumerate(call):
            corr += 1
            cat = "cuda_driver" if api.startswith("cu") and not api.startswith("cuda") \
                else "cuda_runtime"
            events.append({"ph": "X", "cat": cat, "name": api, "ts": ts + 1 + i, "dur": 0.5,
                           "args": {"correlation": corr}})
            for g in ([] if gpu is None else gpu if isinstance(gpu, list) else [gpu]):
                gcat = ("gpu_memcpy" if g.startswith("Memcpy") else
                        "gpu_memset" if g.startswith("Memset") else "kernel")
                events.append({"ph": "X", "cat": gcat, "name": g, "ts": ts + 200 + i,
                               "dur": 1.0, "args": {"correlation": corr}})
        ts += 100.0
    # outside every span: not counted
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts + 50,
                   "dur": 1.0, "args": {"correlation": 10_000}})
    return events


def test_count_launches_separates_graph_replays():
    call = [("cudaMemcpyAsync", "Memcpy DtoD (Device -> Device)"),
            ("cudaLaunchKernel", "elementwise_kernel"),
            ("cudaStreamIsCapturing", None),          # not a launch
            ("cudaGraphLaunch", ["gemv", "attention", "argmax"]),
            ("cuLaunchKernelEx", "triton_fill"),      # driver API (Triton)
            ("cudaMemsetAsync", "Memset (Device)"),
            ("cudaGraphLaunch", ["gemv"]),
            ("cudaMemcpyAsync", None)]                # a GPU record the profiler dropped
    first = call[:1] + [("cudaLaunchKernel", "warmup_kernel")] + call[1:]
    out = count_launches(_trace(first, call))
    assert len(out) == 2
    last = out[-1]
    assert last["launches"] == 5 and last["graph_launches"] == 2
    assert last["gpu_outside"] == 4 and last["gpu_inside"] == 4
    assert last["ops"] == {"Memcpy DtoD (Device -> Device)": 1, "Memset (Device)": 1,
                           "elementwise_kernel": 1, "triton_fill": 1}
    # GPU ops at 200 + i (1 us each): the call spans 200..207, its graph work 203..207
    assert last["refresh_gpu_us"] == pytest.approx(3.0)
    # host API calls at 1 + i (0.5 us each): 199 us before the GPU ran them
    assert [op[0] for op in last["timeline"]] == [
        GRAPH_LAUNCH_HOST, GRAPH_LAUNCH_HOST, "Memcpy DtoD (Device -> Device)",
        "elementwise_kernel", "graph: gemv", "triton_fill", "Memset (Device)"]
    assert last["timeline"][0][1:] == [-196.0, -195.5] and last["timeline"][1][1:] == [-193.0, -192.5]
    assert last["timeline"][4][1:] == [3.0, 7.0]
    assert out[0]["launches"] == 6
    with pytest.raises(ValueError, match="no 'graphdraft_perf_call' spans"):
        count_launches(_trace(call, mark="other"))


def test_profile_launches_on_cpu():
    """The profiler pass end to end (CPU: host ops only, so nothing to count)."""
    x = torch.randn(64)
    res = profile_launches(lambda: (x * 2).sum(), calls=2, device="cpu")
    assert res == {"refresh_launches": 0, "graph_launches": 0, "refresh_gpu_ops": 0,
                   "graph_gpu_ops": 0, "refresh_ops": {}, "refresh_gpu_us": None,
                   "refresh_timeline": [], "launch_counts_stable": True}


def _info(bs, variant, mode="compile+graph", **extra):
    info = dict(page_size=16, kv_len=512, bs=bs, floor_us=600.0, copy_bw=4.27e12,
                gpu="NVIDIA H200", torch="2.11", triton="3.6", steps=3, variant=variant,
                compile_mode=mode)
    if variant == "graph":
        info.update(eager_run_us=4000.0, graph_run_us=800.0, graph_first_us=300.0,
                    graph_multi_us=488.0, graph_decode_us=788.0, capture_s=1.5, pool_bytes=64 << 20)
    else:
        info.update(compile_run_us=1000.0, compile_s=12.34)
    info.update(extra)
    return {"name": f"test_draft[{bs}-{variant}]", "extra_info": info, "stats": {}}


def _table(tmp_path, capsys, benchmarks):
    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps({"benchmarks": benchmarks}))
    assert report.main([str(path)]) == 0
    out = capsys.readouterr().out
    return [ln for ln in out.splitlines() if ln.startswith("|")], out


def test_report_renders_one_table(tmp_path, capsys):
    ops = {"Memcpy DtoD (Device -> Device)": 3, "elementwise_kernel": 1}
    table, out = _table(tmp_path, capsys, [
        _info(1, "graph", refresh_gpu_us=6.25, refresh_gpu_in_place_us=4.5, refresh_events_us=9.75,
              refresh_launches=4, refresh_gpu_ops=4, graph_launches=1, refresh_ops=ops,
              launch_counts_stable=True, refresh_launches_in_place=1),
        _info(8, "graph", eager_equals_graph=False, refresh_launches=5, refresh_gpu_ops=3,
              graph_launches=3, refresh_ops=ops, in_place_equals_copy=False),
        _info(1, "compile", compile_graph_replayed=True, compile_agreement=0.96875,
              compile_group_s=20.5),
        _info(8, "compile", compile_error="BackendCompilerFailed: boom"),
        {"name": "other", "extra_info": {}}])
    assert len(table) == 4  # header, rule, two cases
    assert table[0] == ("| case | bs | kv | eager us | graph us | compile+graph us | floor us "
                        "| graph/floor | replay/floor | compile+graph/graph | eager/graph | refresh us "
                        "| in place | with host | launches | capture s | pool MB | compile+graph s |")
    assert table[0].count("|") == len(report.COLUMNS) + 1 == len(report.columns("x")) + 1
    assert table[2] == ("| page16 | 1 | 512 | 4000 | 800 | 1000 | 600 | 1.33x | 1.313x | 1.25x | 5.0x "
                        "| 6.2 | 4.5 | 9.8 | 4 / 1 | 1.50 | 64.0 | 12.3 |")
    assert "failed: BackendCompilerFailed" in table[3]
    assert "| 12.0 | — | — | 5 (3 on GPU) |" in table[3]  # refresh from the medians (older runs)
    assert "page16 kv512 bs8: drafts with the hidden states in place (and not copied out) differ" in out
    assert "4.27 TB/s" in out and "NVIDIA H200" in out and "compile+graph = torch-path" in out
    assert "differs from eager" in out and "boom" in out
    assert "96.9% to 96.9% of draft tokens" in out and "page16 kv512 20.5 s" in out
    assert "page16 kv512 bs8: 3 graph launches" in out
    assert ("GPU work outside the graph replays per draft call (page16 kv512 bs1, page16 kv512 "
            "bs8): Memcpy DtoD (Device -> Device) x3, elementwise_kernel x1") in out
    assert report.main([str(tmp_path / "missing.json")]) == 1
    assert "skipped" in report.render([])


def test_report_marks_ungraphed_baselines(tmp_path, capsys):
    table, out = _table(tmp_path, capsys, [
        _info(1, "graph", mode="static"), _info(1, "compile", mode="static",
                                                compile_cudagraph_skips=2)])
    assert "| reduce-overhead us |" in table[0] and "| reduce-overhead s |" in table[0]
    assert "| 1000* |" in table[2] and "| — | 1.50 |" in table[2]  # no launch count recorded
    assert "skipped cudagraphs for part of the baseline in 1 of 1 cases" in out
    table, out = _table(tmp_path, capsys, [
        _info(1, "graph", launches_error="RuntimeError: cupti"),
        _info(1, "compile", compile_graph_replayed=False)])
    assert "| 1000* |" in table[2] and "| failed |" in table[2]
    assert "did not all replay a CUDA graph in 1 of 1 cases (page16 kv512 bs1" in out
    assert "launch count failed: RuntimeError: cupti" in out
    table, _ = _table(tmp_path, capsys, [_info(1, "graph", mode="off")])
    assert "| compile us |" in table[0] and "| — |" in table[2]


def test_soak_code_path_on_cpu():
    """The soak loop (requests coming and going, graph-vs-eager checks) runs a few steps on CPU."""
    from perf.soak import build, soak

    engine = build("cpu", "float32", max_running_requests=4, cuda_graph_max_bs=4,
                   max_context_len=512)
    report = soak(engine, steps=30, check_every=10)
    assert report.draft_steps >= 30 and report.checks >= 2
    assert not report.failures, report.failures
    assert not report.stopped_early and report.exit_code == 0
    text = "\n".join(report.lines())
    assert "mean engine step" in text and "TARGET NOT REACHED" not in text
    assert report.mean_engine_step_ms == pytest.approx(1e3 * report.seconds / report.engine_steps)


def test_soak_time_cap_and_progress_lines(capsys):
    """`max_seconds` stops the soak early (exit code 2 when the checks pass); progress lines
    every `progress_every` draft steps; the check wrapper does not outlive the soak."""
    import io

    from perf.soak import build, main, soak

    engine = build("cpu", "float32", max_running_requests=4, cuda_graph_max_bs=4,
                   max_context_len=512)
    out = io.StringIO()
    report = soak(engine, steps=10**9, check_every=10**6, max_seconds=3.0, progress_every=1,
                  out=out)
    assert report.stopped_early and report.exit_code == 2 and not report.failures
    assert 0 < report.draft_steps < 10**9 and report.target_steps == 10**9
    lines = out.getvalue().splitlines()
    assert 1 <= len(lines) <= report.draft_steps
    for line in lines:
        assert re.fullmatch(r"\[soak\] draft steps \d+, engine steps \d+, elapsed [\d.]+ s, "
                            r"allocated n/a \(CPU\)", line), line
    text = "\n".join(report.lines())
    assert (f"TARGET NOT REACHED: stopped after {report.draft_steps} of 1000000000 draft steps "
            "at the 0.05-minute cap") in text
    assert "run" not in vars(engine.drafter)  # no check wrapper left behind
    report.failures.append("x")
    assert report.exit_code == 1  # a failed check wins over the early stop

    assert main(["--device", "cpu", "--dtype", "float32", "--steps", "1000000000",
                 "--max-minutes", "0.01"]) == 2
    printed = capsys.readouterr().out
    assert "TARGET NOT REACHED" in printed and "mean engine step" in printed


def test_report_schedule_line(tmp_path):
    import json

    from perf.report import load_schedule, schedule_line

    info = {"schedule": [1, 2], "schedule_per_size": {"1": {"decode_s": 0.5, "multi_s": 0.25,
                                                             "pool_bytes": 0},
                                                       "2": {"first_s": 0.1, "multi_s": 0.1,
                                                             "pool_bytes": 2**20}},
            "schedule_capture_s": 0.95, "schedule_pool_bytes": 2**20}
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"benchmarks": [{"extra_info": info}]}))
    line = schedule_line(load_schedule(path))
    assert "0.95 s" in line and "1.0 MiB" in line and "1: 0.75s" in line


def test_report_gemv_lines(tmp_path):
    import json

    from perf.report import gemv_lines

    rec = {"gemv_shape": "o", "m": 1, "cublas_us": 23.4, "triton_gemv_us": 10.0,
           "weights_floor_us": 7.9, "cublas_bw_share": 0.34, "triton_bw_share": 0.79}
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"benchmarks": [{"extra_info": rec}]}))
    lines = gemv_lines(path)
    assert lines[-1] == "| o | 1 | 23.4 | 10.0 | 7.9 | 34% | 79% |"


def test_write_json_and_probe_without_cuda(tmp_path, capsys):
    from perf.studies import graph_start_probe
    from perf.timing import write_json

    path = write_json(tmp_path / "new" / "dir", "r.json", {"a": [1, 2]})
    assert path == tmp_path / "new" / "dir" / "r.json"
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    assert graph_start_probe.main(["--out", str(tmp_path / "probe")]) == 0  # CPU: says so, writes nothing
    assert "no CUDA device" in capsys.readouterr().out and not (tmp_path / "probe").exists()
    from perf.studies import fp32_prefill

    assert fp32_prefill.main(["--out", str(tmp_path / "fp32")]) == 0
    assert "no CUDA device" in capsys.readouterr().out and not (tmp_path / "fp32").exists()
    with pytest.raises(SystemExit):
        fp32_prefill.main(["--tokens", "0"])
    assert "--tokens / --reps: expected ints >= 1" in capsys.readouterr().err


def test_verify_kernels_summary(capsys):
    """`perf.studies.verify_kernels`: per-name totals without template / argument lists, the
    union of overlapping kernel intervals as busy time, one middle layer's timeline with its
    gaps; on CPU main says it measured nothing."""
    from perf.studies import verify_kernels as vk

    assert vk.short_name("void gemv_kernel<64, 2>(float*, int)") == "gemv_kernel"
    ks = [("void a<1>(x)", 0.0, 5.0), ("b", 3.0, 8.0),  # layer 0: overlapping (PDL)
          ("a", 10.0, 12.0), ("b", 15.0, 20.0)]  # layer 1: 2 us and 3 us idle
    s = vk.summarize(ks, layers=2)
    assert s["kernels"][0] == {"kernel": "b", "count": 2, "total_us": 10.0, "mean_us": 5.0}
    assert s["kernels"][1] == {"kernel": "a", "count": 2, "total_us": 7.0, "mean_us": 3.5}
    assert s["busy_ms"] == pytest.approx(0.015) and s["span_ms"] == pytest.approx(0.020)
    assert s["idle_ms"] == pytest.approx(0.005)
    assert [(k["kernel"], k["start_us"], k["gap_before_us"]) for k in s["layer"]] == [
        ("a", 0.0, 0.0), ("b", 5.0, 3.0)]
    assert vk.summarize([], layers=2) == {"n_kernels": 0}
    if not torch.cuda.is_available():
        assert vk.main(["--out", "unused"]) == 0
        assert "no CUDA device" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        vk.main(["--out", "unused", "--n", "0"])
    assert "--n: expected a positive token count" in capsys.readouterr().err


def test_verify_goal_bounds(tmp_path, capsys):
    """`perf.verify --bounds`: issue #23's goal (1.3 x max(floors)) against the sequential floor
    (matmul + attention floors) per row of a verify.json, on CPU; the prefill row is skipped."""
    from perf import verify

    mem = {"bs": 8, "kv": 512, "verify_ms": 5.0, "hbm_floor_ms": 4.0, "compute_floor_ms": 1.0,
           "matmul_ms": 4.0, "matmul_floor_ms": 3.5, "attention_ms": 0.6, "attention_floor_ms": 0.5,
           "sum_floor_ms": 4.0, "verify_over_sum_floor": 1.25}
    both = {"bs": 128, "kv": 4096, "verify_ms": 27.8, "hbm_floor_ms": 19.7,
            "compute_floor_ms": 10.9, "matmul_ms": 10.2, "matmul_floor_ms": 9.5,
            "attention_ms": 16.4, "attention_floor_ms": 16.2, "sum_floor_ms": 25.7,
            "verify_over_sum_floor": 27.8 / 25.7}
    rows = [mem, both, {"prefill_tokens": 8192, "prefill_ms": 1.4, "sdpa_prefill_ms": 1.7}]
    a, b = verify.goal_bounds(rows)
    assert a["goal_ms"] == pytest.approx(5.2) and a["met"]
    assert a["goal_over_sum"] == pytest.approx(5.2 / 4.0) and a["verify_over_sum"] == pytest.approx(1.25)
    assert b["goal_ms"] == pytest.approx(1.3 * 19.7) and not b["met"]
    assert b["goal_over_sum"] < 1  # the goal lies below the sum of the two floors
    assert b["matmul_over_floor"] == pytest.approx(10.2 / 9.5)
    path = tmp_path / "verify.json"
    path.write_text(json.dumps({"rows": rows}))
    assert verify.main(["--bounds", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and out[2].startswith("| 8 | 512 | 5.00 | 5.20 | 4.00 | 1.30 | 1.25 |")
    assert out[3].endswith("| no |")
    with pytest.raises(SystemExit):
        verify.main([])
    assert "--out: expected a folder" in capsys.readouterr().err


def test_kernel_resources_compiles_for_sm90_without_a_gpu(tmp_path):
    """`perf.kernel_resources`' compile phase: a recorded launch (the silu_mul kernel with the
    GPU's launch options) compiled by Triton for sm_90 on this machine, and ptxas's register
    count and the compile's seconds by stage read back; a subprocess (the interpreter is off
    there)."""
    from perf.kernel_resources import compile_entries, encode_entry

    x, out = torch.empty(2, 64, dtype=torch.bfloat16), torch.empty(2, 32, dtype=torch.bfloat16)
    entry = encode_entry("gemv._silu_mul_kernel", (x, out, 32, 64, 32),
                         {"BLOCK": 1024, "pdl_trigger": 1, "PDL": True, "launch_pdl": True}, ["test"])
    (row,) = compile_entries([entry], tmp_path)
    assert row["kernel"] == "gemv._silu_mul_kernel" and 8 <= row["registers"] <= 255
    assert row["spill_stores"] == 0 and row["kwargs"]["BLOCK"] == 1024
    st = row["stages_s"]  # the compile's seconds, split into Triton's stages
    assert {"frontend", "ttir", "ttgir", "llir", "ptx", "cubin"} <= set(st)
    assert row["compile_s"] > 0 and abs(sum(st.values()) - row["compile_s"]) < 0.01
    assert row["ptx_bytes"] > 0


def test_benchmark_size_lists_parse():
    """perf.verify's --bs / --kv, perf.e2e's --bs, gemv_sweep's --ms (`cases.int_list`):
    positive ints separated by commas, within a bound where one is given; anything else is
    refused naming what was expected."""
    import argparse

    from perf.cases import int_list

    assert int_list("1,8, 64") == (1, 8, 64)
    assert int_list("64", 64) == (64,)
    for bad, hi in (("", None), ("0", None), ("1,-8", None), ("a,b", None), ("65", 64)):
        with pytest.raises(argparse.ArgumentTypeError, match="positive ints"):
            int_list(bad, hi)


def test_time_us_runs_setup_before_each_call_outside_its_time():
    """`timing.time_us(setup=...)`: the setup (a state restore) precedes every call, warm-ups
    included, and its time is not the call's."""
    import time as _time

    from perf.timing import time_us

    order = []
    times = time_us(lambda: order.append("call"), warmup=2, reps=3, device="cpu",
                    setup=lambda: order.append("setup") or _time.sleep(0.02))
    assert order == ["setup", "call"] * 5
    assert len(times) == 3 and max(times) < 15_000  # the 20 ms sleeps are outside
