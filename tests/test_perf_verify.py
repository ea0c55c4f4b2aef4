"""`perf.verify`'s decode accounting (issue #42 item 2) and the verify's sum-of-floors goal
(item 3) in its bounds tables, on CPU from rows of a verify.json."""

from __future__ import annotations

import json

import pytest

from perf import verify


def _row(bs, kv, decode_ms, **over):
    row = {"bs": bs, "kv": kv, "verify_ms": 9.7, "hbm_floor_ms": 6.4, "compute_floor_ms": 5.0,
           "matmul_ms": 7.0, "matmul_floor_ms": 4.97, "attention_ms": 1.8,
           "attention_floor_ms": 1.43, "sum_floor_ms": 6.4, "verify_over_sum_floor": 9.7 / 6.4,
           "decode_ms": decode_ms, "decode_hbm_floor_ms": 10.7, "decode_compute_floor_ms": 5.5,
           "decode_matmul_ms": 7.0, "decode_matmul_floor_ms": 4.97, "decode_attention_ms": 6.1,
           "decode_attention_floor_ms": 5.73, "decode_other_ms": 0.8}
    row.update(over)
    return row


def test_decode_bounds_goal_rows_and_the_sum_goal(tmp_path, capsys):
    rows = [_row(256, 512, 13.94), _row(128, 512, 9.8, decode_hbm_floor_ms=7.84,
                                        verify_ms=8.0, verify_over_sum_floor=8.0 / 6.4),
            _row(8, 4096, 7.6), {"prefill_tokens": 8192, "prefill_ms": 1.4}]
    a, b, c = verify.decode_bounds(rows)
    assert a["decode_floor_ms"] == 10.7 and a["decode_over_floor"] == pytest.approx(13.94 / 10.7)
    assert a["goal_row"] and not a["met"]  # 1.30 > 1.25
    assert b["goal_row"] and b["met"]  # 9.8 <= 1.25 x 7.84
    assert not c["goal_row"]
    assert a["matmul_over_floor"] == pytest.approx(7.0 / 4.97)
    g = verify.goal_bounds(rows)
    assert [x["sum_met"] for x in g] == [False, True, False]  # 9.7 > 1.3 x 6.4; 8.0 <= 8.32
    path = tmp_path / "verify.json"
    path.write_text(json.dumps({"rows": rows}))
    assert verify.main(["--bounds", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 + 5  # two tables of three rows each, header and rule
    assert "1.3 x sum (#42)" in out[0] and out[2].endswith("| no | no |")
    assert "1.25 x floor (#42 item 2)" in out[5]
    assert out[7].startswith("| 256 | 512 | 13.94 | 10.70 | 1.303 |") and out[7].endswith("| no |")
    assert out[8].endswith("| yes |") and out[9].endswith("(not a goal row) |")


def test_decode_bounds_skip_rows_without_decode_keys():
    old = {k: v for k, v in _row(64, 512, 7.9).items() if not k.startswith("decode_")}
    old["decode_ms"] = 7.9
    assert verify.decode_bounds([old]) == [] and verify.decode_bounds_lines([old]) == []


def test_gemm_routes_of_a_sweep(tmp_path, capsys):
    from graphdraft.kernels.config import TRITON

    rows = [{"m": 128, "n": 4096, "k": 14336, "variants": {
        "cublas": {"us": 50.8, "rel_err": 0.0}, "cublas_lt_bias": {"us": 44.3, "rel_err": 0.0}}}]
    path = tmp_path / "mid_m_gemm.json"
    path.write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "rows": rows}))
    routes = verify.gemm_routes_of(str(path))
    assert routes == ((("NVIDIA H100 80GB HBM3", 128, 4096, 14336), "cublaslt"),)
    assert TRITON.replace(gemm_routes=routes).gemm_routes == routes  # a valid config value
    assert "('NVIDIA H100 80GB HBM3', 128, 4096, 14336): 'cublaslt'" in capsys.readouterr().out
