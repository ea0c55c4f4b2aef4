"""The perf harness without a GPU: floor arithmetic, one tiny case end to end, the report."""

from __future__ import annotations

import json

import pytest
import torch

from graphdraft.config import ModelConfig
from perf import report
from perf.bench import (
    LLAMA31_8B_HEAD,
    Case,
    GroupCache,
    build_head,
    cases_from_env,
    compiler_from_env,
    context_positions,
    copy_bandwidth,
    default_cases,
    fill_decode_batch,
    floor_bytes,
    floor_info,
    group_batch_sizes,
    measure_case,
    measure_compiled,
    ordered_params,
    runtime_config,
    weight_bytes_per_step,
)

TINY = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   intermediate_size=48, vocab_size=97, draft_vocab_size=53,
                   max_position_embeddings=256, rope_theta=10000.0)


def test_floor_bytes_for_the_8b_head():
    # qkv 6144x8192 + o 4096x4096 + gate_up 28672x4096 + down 4096x14336 + lm_head 32000x4096, bf16
    weights = (6144 * 8192 + 4096 * 4096 + 28672 * 4096 + 4096 * 14336 + 32000 * 4096) * 2
    assert weights == 748_683_264  # DESIGN.md's "749 MB per step"
    assert weight_bytes_per_step(LLAMA31_8B_HEAD) == weights
    fb = floor_bytes(LLAMA31_8B_HEAD, bs=2, kv_len=4096, steps=3)
    assert fb.fc == 4096 * 12288 * 2
    assert fb.kv_per_step == 2 * 4096 * 2 * 8 * 128 * 2
    assert fb.hidden_in == 2 * 4 * 12288 * 2
    assert fb.total == 3 * weights + fb.fc + 3 * fb.kv_per_step + fb.hidden_in
    # DESIGN.md anchor: 3 steps x 749 MB at 4.27 TB/s is about 526 us.
    info = floor_info(LLAMA31_8B_HEAD, 1, 1000, bandwidth=4.27e12)
    assert info["weights_floor_us"] == pytest.approx(526, abs=1)
    assert info["floor_us"] > info["weights_floor_us"]


def test_cases_and_sizes():
    cases = default_cases()
    assert len(cases) == 11 and Case(1, 4096, 64) in cases
    assert group_batch_sizes(cases, (16, 512)) == (1, 8, 32, 64, 128)
    assert group_batch_sizes(cases, (1, 4096)) == (64,)
    assert [c.bs for c in cases_from_env({"GRAPHDRAFT_PERF_BS": "1,8"})] == [1, 8, 1, 8, 8]
    assert compiler_from_env({"GRAPHDRAFT_PERF_COMPILE": "0"}) == (None, "off")
    assert compiler_from_env({})[1] == "static"
    assert compiler_from_env({"GRAPHDRAFT_PERF_COMPILE": "dynamic"})[1] == "dynamic"
    cfg = runtime_config(16, 4096, (1, 8, 32, 64, 128), device="cpu")
    assert cfg.max_context_len == 4112 >= context_positions(4096)
    assert cfg.total_kv_pages == 128 * 4112 // 16 + 1
    assert cfg.cuda_graph_bs == (1, 8, 32, 64, 128) and not cfg.validate_inputs


def _fail(fn):
    raise RuntimeError("no compiler here")


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
    assert group.reference[3].shape == (3, 4)
    # "compile" with the identity: the baseline's code path, on the torch backend, no inductor.
    res.update(measure_compiled(group, batch, lambda fn: fn, warmup=1, reps=2))
    for key in ("eager", "graph", "compile"):
        for part in ("run", "first", "multi"):
            assert res[f"{key}_{part}_us"] > 0
    assert res["compile_agreement"] == 1.0  # torch path both ways on CPU
    assert group.drafter.head.midlayer.self_attn.use_triton is False
    with pytest.raises(RuntimeError, match="cuBLAS workspace"):
        measure_case(group, batch)  # graphs are stale once the baseline exists
    group.baseline = None  # build the baseline again, with a compiler that raises
    failed = measure_compiled(group, fill_decode_batch(group, 1), _fail, warmup=0, reps=1)
    assert failed == {"compile_error": "RuntimeError: no compiler here"}
    cache.close()
    assert cache.group is None
    assert copy_bandwidth("cpu", nbytes=1 << 20, reps=2) > 0


def _info(bs, variant, **extra):
    info = dict(page_size=16, kv_len=512, bs=bs, floor_us=600.0, copy_bw=4.27e12,
                gpu="NVIDIA H200", torch="2.11", triton="3.6", steps=3, variant=variant,
                compile_mode="static")
    if variant == "graph":
        info.update(eager_run_us=4000.0, graph_run_us=800.0, capture_s=1.5, pool_bytes=64 << 20)
    else:
        info.update(compile_run_us=1000.0)
    info.update(extra)
    return {"name": f"test_draft[{bs}-{variant}]", "extra_info": info, "stats": {}}


def test_report_renders_one_table(tmp_path, capsys):
    data = {"benchmarks": [_info(1, "graph"), _info(8, "graph", eager_equals_graph=False),
                           _info(1, "compile", compile_cudagraph_skips=2),
                           _info(8, "compile", compile_error="BackendCompilerFailed: boom"),
                           {"name": "other", "extra_info": {}}]}
    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps(data))
    assert report.main([str(path)]) == 0
    out = capsys.readouterr().out
    table = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert len(table) == 4  # header, rule, two cases
    assert table[0].count("|") == len(report.COLUMNS) + 1
    assert table[2] == ("| page16 | 1 | 512 | 4000 | 800 | 1000* | 600 | 1.33x | 1.25x | 5.0x "
                        "| 1.50 | 64.0 |")
    assert "skipped cudagraphs for part of the baseline in 1 of 2 cases" in out
    assert "failed: BackendCompilerFailed" in table[3]
    assert "4.27 TB/s" in out and "NVIDIA H200" in out
    assert "differs from eager" in out and "boom" in out
    assert report.main([str(tmp_path / "missing.json")]) == 1
    assert "skipped" in report.render([])


def test_soak_code_path_on_cpu():
    """The soak loop (requests coming and going, graph-vs-eager checks) runs a few steps on CPU."""
    from perf.soak import build, soak

    engine = build("cpu", "float32", max_running_requests=4, cuda_graph_max_bs=4,
                   max_context_len=512)
    report = soak(engine, steps=30, check_every=10)
    assert report.draft_steps >= 30 and report.checks >= 2
    assert not report.failures, report.failures


def test_report_schedule_line(tmp_path):
    import json

    from perf.report import load_schedule, schedule_line

    info = {"schedule": [1, 2], "schedule_per_size": {"1": {"first_s": 0.5, "multi_s": 0.25,
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
