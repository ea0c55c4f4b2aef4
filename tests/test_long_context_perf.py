"""perf/long.py (issue #42's long-context benchmark) on the CPU: which rows fit a card, the
rows' keys and floors from a tiny run of the same code, the deadline's trimming, the
useless-draft rows imported lazily. Timings on a CPU mean nothing and are not checked."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from perf import long as perf_long
from perf.floors import kv_bytes_per_token
from perf.models_8b import LLAMA31_8B

ROW_KEYS = {"bs", "kv", "target_only_step_ms", "decode_floor_ms", "cycle_ms", "cycle_floor_ms",
            "attention_ms", "attention_floor_ms", "speedup_at_3.0"}
H200_KV_BUDGET = 139 * 2**30 - perf_long.NOT_KV_BYTES


def _tiny(**kw) -> perf_long.Setup:
    base = {**perf_long.TINY, "kv_lens": (32,), "batch_sizes": (2, 1), "long_kv": 80,
            "blocks": 1, "block": 1, "new_tokens": 24}
    return perf_long.Setup(**{**base, **kw})


def test_the_8b_rows_that_fit_an_h200():
    """bs 32 / 64 at 32k need more KV than an H200 holds next to the weights (128 KiB a token
    of target KV, 4 KiB of draft KV); every other row of the issue fits, 128k at bs 1 too."""
    setup = perf_long.Setup(kv_lens=perf_long.KV_LENS, batch_sizes=perf_long.BATCH_SIZES,
                            long_kv=perf_long.LONG_KV, device="cuda")
    assert kv_bytes_per_token(LLAMA31_8B) == 128 * 1024
    groups, skipped = perf_long.plan_groups(setup, H200_KV_BUDGET)
    assert [(g.kv, g.batch_sizes) for g in groups] == [
        (4096, [64, 32, 8, 1]), (8192, [64, 32, 8, 1]), (32768, [8, 1]), (131072, [1])]
    assert [(s["bs"], s["kv"]) for s in skipped] == [(64, 32768), (32, 32768)]
    assert "GiB" in skipped[0]["reason"]
    cfg = perf_long.engine_config(setup, groups)
    assert cfg.max_context_len == 131072 + perf_long.NEW_TOKENS + setup.lookahead
    assert cfg.cuda_graph_bs == (1, 8, 32, 64) and cfg.max_running_requests == 64
    assert cfg.num_kv_pages == setup.pages(64, 8192)  # the largest group's pages


def test_tiny_run_gives_every_row_its_keys_and_floors():
    setup = _tiny()
    data = perf_long.measure(setup, deadline_s=600.0)
    rows = data["rows"]
    assert [(r["bs"], r["kv"]) for r in rows] == [(1, 32), (2, 32), (1, 80)]
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert all(r[k] > 0 for k in ROW_KEYS)
        assert r["kv"] <= r["kv_mean"] <= r["kv"] + setup.new_tokens
        assert r["speedup_at_3.0"] == pytest.approx(3.0 * r["target_only_step_ms"] / r["cycle_ms"])
        assert r["cycle_floor_ms"] > r["decode_floor_ms"] > r["attention_floor_ms"]
    assert {(p["kind"], p["kv"]) for p in data["prefills"]} == {
        (k, kv) for k in ("target_only", "spec") for kv in (32, 80)}
    long_prefill = next(p for p in data["prefills"] if p["kv"] == 80)
    assert long_prefill["steps"] >= 80 // setup.chunk  # chunked
    assert data["rope_scaling"]["rope_type"] == "llama3"
    assert rows[0]["step_over_floor"] == pytest.approx(
        rows[0]["target_only_step_ms"] / rows[0]["decode_floor_ms"])
    assert isinstance(data["goal_misses"], list)


def test_goal_misses_name_the_row_and_the_bound():
    row = {"bs": 8, "kv": 8192, "step_over_floor": 1.2, "cycle_over_floor": None,
           "attention_over_floor": 1.05}
    short = {**row, "kv": 4096, "step_over_floor": 1.0, "cycle_over_floor": 1.0,
             "attention_over_floor": 3.0}  # attention's bound starts at 8192
    assert perf_long.goal_misses([row, short]) == [
        "bs 8 kv 8192: step_over_floor 1.20 > 1.15", "bs 8 kv 8192: cycle_over_floor not measured"]


def test_budget_and_deadline_trim_rows():
    """A KV budget that holds one row of 32 but not two: bs 2 skipped with its size; a
    deadline already spent: every group left out of both phases, named."""
    setup = _tiny(long_kv=None)
    per_row = setup.pages(1, 32) * setup.page_size * (
        kv_bytes_per_token(setup.target_cfg, 4) + kv_bytes_per_token(setup.head_cfg, 4))
    groups, skipped = perf_long.plan_groups(setup, per_row * 1.5)
    assert [(g.kv, g.batch_sizes) for g in groups] == [(32, [1])]
    assert [(s["bs"], s["kv"]) for s in skipped] == [(2, 32)]
    data = perf_long.measure(setup, deadline_s=1e-3)
    assert data["rows"] == []
    assert {(s["bs"], s["kv"], s["reason"]) for s in data["skipped"]} == {
        (2, 32, "target_only: past the deadline"), (1, 32, "target_only: past the deadline")}


def test_useless_rows_are_imported_when_they_run(monkeypatch):
    """Without perf/useless_draft.py: no rows and a note saying so; with it: its rows, asked
    for the issue's batch sizes within the deadline given."""
    monkeypatch.setitem(sys.modules, "perf.useless_draft", None)  # import fails
    rows, note = perf_long.useless_rows(10.0)
    assert rows == [] and "perf.useless_draft" in note
    calls = []

    class Fake:
        @staticmethod
        def run_rows(bs_list, deadline_s, info=None):
            calls.append((bs_list, deadline_s))
            info["skipped_bs"] = []
            return [{"bs": b, "regime": "useless", "adaptive_tps": 1.0, "target_only_tps": 1.0}
                    for b in bs_list]

    monkeypatch.setitem(sys.modules, "perf.useless_draft", Fake)
    monkeypatch.setattr("perf.useless_draft", Fake, raising=False)
    info = {}
    rows, note = perf_long.useless_rows(12.5, info)
    assert note is None and calls == [((1, 8, 64, 128, 256), 12.5)] and info == {"skipped_bs": []}
    assert [r["bs"] for r in rows] == [1, 8, 64, 128, 256]


@pytest.mark.slow  # the whole CLI on the tiny pair: about 25 s on 2 cores
def test_cli_tiny_writes_the_json(tmp_path):
    assert perf_long.main(["--tiny", "--out", str(tmp_path), "--tag", "t", "--no-useless"]) == 0
    doc = json.loads((tmp_path / "t-cpu-long.json").read_text())
    assert doc["card"] == "cpu" and "meaningless" in doc["device"]
    kvs = {(r["bs"], r["kv"]) for r in doc["rows"]}
    assert (1, 256) in kvs and (4, 128) in kvs


def test_attention_only_writes_the_rows_of_a_full_run(tmp_path):
    """`--attention-only` (the tiny pair's shape, synthetic pools): the (bs, kv) rows a full run
    would measure, each with its attention and verify-attention figures over their floors."""
    assert perf_long.main(["--tiny", "--attention-only", "--out", str(tmp_path), "--tag", "t",
                           "--no-long-row"]) == 0
    doc = json.loads((tmp_path / "t-cpu-long-attention.json").read_text())
    setup = perf_long.Setup(**{**perf_long.TINY, "long_kv": None})
    groups, _ = perf_long.plan_groups(setup, float(8 << 30))
    assert [(r["bs"], r["kv"]) for r in doc["rows"]] == [
        (bs, g.kv) for g in groups for bs in g.batch_sizes]
    assert doc["context_len"] == setup.context_len
    for r in doc["rows"]:
        for key in ("attention", "verify_attention"):
            assert r[f"{key}_ms"] > 0 and r[f"{key}_floor_ms"] > 0
            assert r[f"{key}_over_floor"] == pytest.approx(r[f"{key}_ms"] / r[f"{key}_floor_ms"])
    assert doc["rows"][0]["verify_attention_floor_ms"] > doc["rows"][0]["attention_floor_ms"]


def test_attention_rows_sweep_the_split_count_on_the_triton_path():
    """On the Triton path (the interpreter here) each row also times the kernels at the rule's
    split count and its fractions (`SPLIT_SWEEP`), the rule's count named."""
    from graphdraft.kernels.config import TRITON

    setup = _tiny(long_kv=None, kv_lens=(40,), batch_sizes=(1,))
    groups, _ = perf_long.plan_groups(setup, float(8 << 30))
    small = TRITON.replace(decode_block_n=16, extend_tiles=((16, 16, 4),) * 4)
    (row,) = perf_long.attention_rows(setup, groups, 1e9, small)
    for key in ("attention", "verify_attention"):
        default = row[f"{key}_splits_default"]
        assert default > 1  # 40 + 7 positions over 16-position blocks
        swept = {int(k.split("splits")[1].rstrip("]")) for k in row if k.startswith(f"{key}_ms[")}
        assert swept == {default // c for c in perf_long.SPLIT_SWEEP if default // c >= 1}
        assert all(row[f"{key}_ms[splits{s}]"] > 0 for s in swept)


def test_bad_deadline_is_refused():
    with pytest.raises(SystemExit):
        perf_long.parse_args(["--deadline-s", "0"])
    assert replace(_tiny(), long_kv=None).context_len == 32 + 24 + 7


def test_the_useless_draft_module_takes_the_call_perf_long_makes():
    """When perf/useless_draft.py is there, its run_rows accepts perf.long's keywords."""
    import inspect

    useless_draft = pytest.importorskip("perf.useless_draft")
    inspect.signature(useless_draft.run_rows).bind(bs_list=perf_long.USELESS_BS, deadline_s=1.0,
                                                   info={})
