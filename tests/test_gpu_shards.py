"""scripts/gpu_tests.py: the shards cover every collected test once, and a shard's failure fails the run."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_tests", ROOT / "scripts" / "gpu_tests.py")
gpu_tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_tests)


@pytest.mark.parametrize("n,shards", [(1, 3), (7, 3), (143, 3), (4, 4), (5, 1)])
def test_deal_covers_each_test_once(n, shards):
    nodes = [f"tests/t.py::f[{i}]" for i in range(n)]
    parts = gpu_tests.deal(nodes, shards)
    assert sorted(x for p in parts for x in p) == sorted(nodes)
    assert all(parts) and len(parts) == min(n, shards)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_bad_shard_count_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        gpu_tests.main(["--shards", "0"])
    assert "--shards" in capsys.readouterr().err


def test_a_failing_shard_fails_the_run(tmp_path, monkeypatch):
    t = tmp_path / "tests"
    t.mkdir()
    (t / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_ok():\n    pass\n\n"
        "@pytest.mark.gpu\ndef test_bad():\n    assert False\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: gpu\n")
    monkeypatch.setattr(gpu_tests, "ROOT", tmp_path)
    rc = gpu_tests.main(["--shards", "2", "--log-dir", str(tmp_path / "logs")])
    assert rc != 0
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("shard*.txt"))
    assert "1 passed" in logs and "1 failed" in logs


def test_a_shard_that_dies_names_the_test_runs_the_rest_and_reruns_failures_alone(
        tmp_path, monkeypatch, capsys):
    """One shard: a test that kills its process (as a CUDA device-side assert does), tests
    after it, and a test that fails only after another one ran: the trace names the fatal
    test, the tests after it run in a fresh process, and each failure runs again alone."""
    t = tmp_path / "tests"
    t.mkdir()
    (t / "test_x.py").write_text(
        "import os\nimport pytest\n\nSEEN = []\n\n"
        "@pytest.mark.gpu\ndef test_a_sets():\n    SEEN.append(1)\n\n"
        "@pytest.mark.gpu\ndef test_b_order_dependent():\n    assert not SEEN\n\n"
        "@pytest.mark.gpu\ndef test_c_dies():\n    os.abort()\n\n"
        "@pytest.mark.gpu\ndef test_d_after():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: gpu\n")
    monkeypatch.setattr(gpu_tests, "ROOT", tmp_path)
    logs = tmp_path / "logs"
    rc = gpu_tests.main(["--shards", "1", "--log-dir", str(logs)])
    out = capsys.readouterr().out
    assert rc != 0
    started, outcome = gpu_tests.read_trace(logs / "shard0.trace")
    assert [n.split("::")[1] for n in started] == ["test_a_sets", "test_b_order_dependent",
                                                  "test_c_dies"]
    assert outcome == {started[0]: "passed", started[1]: "failed"}
    assert "assert not SEEN" in (logs / "shard0.trace").read_text()  # the report, before death
    assert "the process died in tests/test_x.py::test_c_dies" in out
    assert "1 passed" in (logs / "shard0-rest.txt").read_text()  # test_d_after, fresh process
    assert "test_b_order_dependent: passes alone" in out
    assert "test_c_dies: fails alone" in out
