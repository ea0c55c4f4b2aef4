"""The sampling record (`graphdraft.sampling`): one field list -> SamplingParams, its
validation, the slot tables and the CLI flags."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from graphdraft.runtime.slot_state import SlotState, StopTableFullError
from graphdraft.sampling import COLUMNS, SAMPLING_FIELDS, SamplingParams, device_row
from graphdraft.serving.cli.args import add_sampling_flags
from graphdraft.serving.verify import SamplingParams as VerifySamplingParams


def test_the_params_fields_are_the_record_in_order():
    assert VerifySamplingParams is SamplingParams
    assert [f.name for f in dataclasses.fields(SamplingParams)] == [f.name for f in SAMPLING_FIELDS]
    p = SamplingParams()
    assert all(getattr(p, f.name) == f.default for f in SAMPLING_FIELDS)
    assert p.greedy and not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize("kw, message", [
    (dict(max_new_tokens=0), "max_new_tokens: expected an int >= 1, got 0"),
    (dict(max_new_tokens=2.0), "max_new_tokens: expected an int >= 1, got 2.0"),
    (dict(temperature=-0.1), "temperature: expected >= 0, got -0.1"),
    (dict(temperature=float("nan")), "temperature: expected >= 0, got nan"),
    (dict(top_p=0.0), r"top_p: expected in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p: expected in \(0, 1\], got 1.5"),
    (dict(top_k=-1), r"top_k: expected an int >= 0 \(0: off\), got -1"),
    (dict(seed="7"), "seed: expected an int or None, got '7'"),
    (dict(stop_token_ids=(3, -1)), "stop_token_ids: expected a sequence of token ids >= 0"),
    (dict(ignore_eos=1), "ignore_eos: expected a bool, got 1"),
])
def test_a_bad_value_names_its_field(kw, message):
    with pytest.raises(ValueError, match="^" + message):
        SamplingParams(**kw)


def test_stop_ids_given_as_a_list_are_stored_as_a_tuple():
    assert SamplingParams(stop_token_ids=[4, 5]).stop_token_ids == (4, 5)


def test_admit_writes_every_column_and_release_restores_the_neutral_row():
    st = SlotState.allocate(3, 2, 4, "cpu")
    neutral = {k: v.clone() for k, v in st.tables().items()}
    p = SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.8, top_k=5, seed=3)
    row = device_row(p, request_seed=1234)
    assert set(row) == {c.name for c in COLUMNS} and row["seed"] == 1234
    st.admit(2, stop_ids=[7, 8], **row)
    assert st.max_new[2] == 9 and st.top_k[2] == 5 and st.seed[2] == 1234
    assert st.temperature[2] == pytest.approx(0.7) and st.top_p[2] == pytest.approx(0.8)
    assert st.stop_ids[2].tolist() == [7, 8, -1, -1] and st.done[2] == 0
    assert all(torch.equal(t[:2], neutral[k][:2]) for k, t in st.tables().items())  # others
    st.release(2)
    for c in COLUMNS:
        assert getattr(st, c.name)[2] == c.neutral
    assert st.done[2] == 1 and st.stop_ids[2].tolist() == [-1] * 4


def test_admit_rejects_a_full_stop_table_and_missing_columns_writing_nothing():
    st = SlotState.allocate(3, 2, 1, "cpu")
    before = {k: v.clone() for k, v in st.tables().items()}
    with pytest.raises(StopTableFullError, match="^stop_token_ids: expected at most 1"):
        st.admit(1, stop_ids=[1, 2], **device_row(SamplingParams(), 0))
    with pytest.raises(ValueError, match="^columns: expected"):
        st.admit(1, stop_ids=[], temperature=0.0)
    assert all(torch.equal(v, before[k]) for k, v in st.tables().items())


def test_the_cli_flags_follow_the_record():
    p = argparse.ArgumentParser()
    add_sampling_flags(p, max_new_tokens=17)
    a = p.parse_args([])
    assert (a.max_new_tokens, a.temperature, a.top_p, a.top_k, a.seed) == (17, 0.0, 1.0, 0, 0)
    a = p.parse_args(["--temperature", "0.5", "--top-p", "0.9", "--top-k", "4"])
    assert (a.temperature, a.top_p, a.top_k) == (0.5, 0.9, 4)
    for bad in (["--top-p", "0"], ["--top-k", "-1"], ["--temperature", "-1"],
                ["--max-new-tokens", "0"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
