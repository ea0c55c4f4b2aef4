"""Logit controls (issue #43 items 2-3): logit_bias, repetition / frequency / presence
penalties and min_p, exact under speculation.

- the kernels (`graphdraft.kernels.logit_controls`: Triton under the interpreter == torch
  reference == vLLM's formulas written out per position, chain and tree paths; the counts);
- min_p in the chain's acceptance kernel and the tree's `row_target_probs`;
- the slot tables (admission, release, errors that write nothing) and `SamplingParams`;
- engines: greedy speculative (EAGLE chain, tree, an oracle drafter whose drafts are all
  accepted, so every window counts its drafts) == target-only, token for token, with every
  control; sampled chain == target-only token for token (keyed noise);
- sampled distributions (chi-square on a vocabulary of 8): the chain's and the tree's
  acceptance emit what target-only sampling under the controls would, and the window's
  drafts must be counted (the law without them is rejected).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphdraft import ops
from graphdraft.kernels.accept import accept_ref
from graphdraft.kernels.config import TORCH, TRITON
from graphdraft.kernels.logit_controls import COUNT_MASK, PROMPT_FLAG
from graphdraft.kernels.tree_accept import tree_accept_ref
from graphdraft.runtime.slot_state import SlotState
from graphdraft.runtime.tree import TreeSpec
from graphdraft.sampling import COLUMNS, MAX_LOGIT_BIAS, SamplingParams, request_seed
from graphdraft.serving.engine import Engine
from graphdraft.serving.tree_cycle import row_target_probs
from tests.engine_harness import ScriptedDrafter, make_models, runtime
from tests.test_accept import _chi2, _outs

NEUTRAL = {c.name: c.neutral for c in COLUMNS}


def _admit(st: SlotState, slot: int, prompt=(), logit_bias=(), **columns) -> None:
    st.admit(slot, stop_ids=[], prompt=list(prompt), logit_bias=tuple(logit_bias),
             **(NEUTRAL | {"max_new": 10**6} | columns))


def vllm_penalised(x: torch.Tensor, prompt: list[int], output: list[int], rep: float,
                   freq: float, pres: float, bias: dict[int, float]) -> torch.Tensor:
    """One row `[V]` as vLLM transforms it (fp32): logit_bias, then repetition (prompt or
    output), frequency (output count) and presence (output) penalties."""
    x = x.float().clone()
    for t, b in bias.items():
        x[t] += b
    v = x.shape[0]
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=v)[:v].float()
    seen = counts > 0
    if prompt:
        seen[torch.tensor(prompt)] = True
    r = torch.where(seen, torch.tensor(rep), torch.tensor(1.0))
    x = torch.where(x > 0, x / r, x * r)
    return x - freq * counts - pres * (counts > 0).float()


def target_law(x: torch.Tensor, temperature: float, min_p: float = 0.0) -> torch.Tensor:
    """softmax(x / T) restricted to p >= min_p * p_max, renormalised (`[V]`)."""
    p = torch.softmax(x.double() / temperature, -1)
    p = torch.where(p >= min_p * p.max(), p, 0.0)
    return p / p.sum()


# ---------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------
SLOTS = {  # slot: (prompt, earlier output, columns, logit_bias)
    1: ([3, 4, 4, 9], [5, 5, 7], dict(repetition_penalty=1.7), {}),
    2: ([1], [2, 2, 2, 6], dict(frequency_penalty=0.6, presence_penalty=-0.4), {}),
    3: ([], [], {}, {0: 2.5, 11: -100.0, 30: 0.25}),
    4: ([8, 2], [8, 1, 1], dict(repetition_penalty=0.8, frequency_penalty=1.1,
                                presence_penalty=0.3), {2: -1.5, 8: 3.0}),
    5: ([6], [6], dict(repetition_penalty=2.0), {6: 1.0}),  # done: left alone
}


def _slot_state(vocab: int) -> SlotState:
    st = SlotState.allocate(7, 3, 2, "cpu", vocab=vocab)
    for s, (prompt, output, cols, bias) in SLOTS.items():
        _admit(st, s, prompt, sorted(bias.items()), **cols)
        for t in output:
            st.token_counts[s, t] += 1
    st.done[5] = 1
    return st


def _expected(logits, cand, slots, paths, v):
    """Per (row, position): vLLM's transform with the path's candidates as extra output."""
    rows, n = cand.shape
    want = logits.clone()
    for r in range(rows):
        s = int(slots[r])
        if s == 0 or s == 5:
            continue
        prompt, output, cols, bias = SLOTS[s]
        cols = NEUTRAL | cols
        for j in range(n):
            window = [int(cand[r, m]) for m in paths[r][j] if m >= 1 and 0 <= cand[r, m] < v]
            want[r * n + j] = vllm_penalised(
                logits[r * n + j], prompt, output + window, cols["repetition_penalty"],
                cols["frequency_penalty"], cols["presence_penalty"], bias)
    return want


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_kernel_equals_reference_and_vllm_formula(tree):
    torch.manual_seed(0)
    v, n = 37, 4
    slots = torch.tensor([1, 0, 2, 3, 4, 5, 1])
    rows = slots.shape[0]
    cand = torch.randint(0, v, (rows, n))
    cand[0, 1:] = torch.tensor([5, 3, 5])     # a repeated draft, a prompt token
    cand[4, 1:] = torch.tensor([2, 2, 8])
    cand[6, 1:] = torch.tensor([v + 3, -1, 4])  # out-of-range drafts count nowhere
    if tree:  # node parents 0, 0, 1 (node 3 under node 1): ancestor bit masks, self included
        paths_of = [[0], [0, 1], [0, 2], [0, 1, 3]]
    else:
        paths_of = [list(range(j + 1)) for j in range(n)]
    path = torch.tensor([[sum(1 << m for m in p) for p in paths_of]] * rows) if tree else None
    logits = torch.randn(rows * n, v) * 3
    want = _expected(logits, cand, slots, [paths_of] * rows, v)
    for kc in (TORCH, TRITON):
        got = logits.clone()
        ops.apply_logit_controls(got, cand, slots, _slot_state(v), path=path, kernels=kc)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, msg=str(kc.backend))
    assert not torch.equal(want, logits)  # the controls changed something


@pytest.mark.parametrize("group", [0, 1, 2], ids=["no-accepted", "accepted", "beams"])
@pytest.mark.parametrize("mapped", [False, True], ids=["target-vocab", "draft-vocab"])
def test_draft_kernel_equals_reference_and_vllm_formula(mapped, group):
    """A draft step's logits `[B, Vd]`: as the target's row would be after the committed
    tokens, the cycle's accepted tokens not yet counted (the first `accepted_len` of
    `accepted` row `r // group`; group 0: none given) and the row's window of drafts (-1:
    none), read at the draft columns' target ids (a bias on an id outside the draft
    vocabulary is dropped)."""
    torch.manual_seed(6)
    v = 37
    vd = 23 if mapped else v
    g = torch.Generator().manual_seed(1)
    col_ids = torch.randperm(v, generator=g)[:vd] if mapped else None
    col_of = None
    if mapped:
        col_of = torch.full((v,), -1, dtype=torch.int64)
        col_of[col_ids] = torch.arange(vd)
    slots = torch.tensor([1, 2, 3, 4, 5, 0])
    window = torch.randint(0, v, (6, 3))
    window[0, 2] = -1
    logits = torch.randn(6, vd) * 3
    ids = col_ids if mapped else torch.arange(v)
    acc = dict(accepted=None, accepted_len=None)
    if group:
        a = 6 // group
        acc = dict(accepted=torch.randint(0, v, (a, 4)),
                   accepted_len=torch.tensor([4, 0, 2, 1, 3, 4][:a], dtype=torch.int32))
        acc["accepted"][0, :2] = torch.tensor([5, 5])  # a repeat: counted twice
    want = logits.clone()
    for r, s in enumerate(slots.tolist()):
        if s in (0, 5):
            continue
        prompt, output, cols, bias = SLOTS[s]
        cols = NEUTRAL | cols
        full = torch.zeros(v)
        full[ids] = logits[r]
        win = [t for t in window[r].tolist() if t >= 0]
        if group:
            ra = r // group
            win += acc["accepted"][ra, : int(acc["accepted_len"][ra])].tolist()
        want[r] = vllm_penalised(full, prompt, output + win, cols["repetition_penalty"],
                                 cols["frequency_penalty"], cols["presence_penalty"], bias)[ids]
    for kc in (TORCH, TRITON):
        got = logits.clone()
        ops.apply_draft_logit_controls(got, window, slots, _slot_state(v), col_ids=col_ids,
                                       col_of=col_of, kernels=kc, **acc)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, msg=str(kc.backend))
    assert not torch.equal(want, logits)
    if group:  # the accepted tokens changed something
        plain = logits.clone()
        ops.apply_draft_logit_controls(plain, window, slots, _slot_state(v), col_ids=col_ids,
                                       col_of=col_of, kernels=TORCH)
        assert not torch.equal(plain, want)


@pytest.mark.parametrize("kc", [TORCH, TRITON], ids=["torch", "triton"])
def test_draft_kernel_rejects_bad_accepted_writing_nothing(kc):
    v = 37
    logits = torch.randn(6, v)
    before = logits.clone()
    window = torch.full((6, 1), -1)
    slots = torch.tensor([1, 2, 3, 4, 5, 0])
    tok = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^accepted_len: expected a tensor exactly when"):
        ops.apply_draft_logit_controls(logits, window, slots, _slot_state(v), accepted=tok[:3],
                                       kernels=kc)
    with pytest.raises(ValueError, match=r"^accepted: expected a number of rows dividing"):
        ops.apply_draft_logit_controls(logits, window, slots, _slot_state(v), accepted=tok,
                                       accepted_len=torch.ones(4, dtype=torch.int32),
                                       kernels=kc)
    with pytest.raises(ValueError, match=r"^accepted_len: expected"):
        ops.apply_draft_logit_controls(logits, window, slots, _slot_state(v), accepted=tok[:3],
                                       accepted_len=torch.ones(2, dtype=torch.int32),
                                       kernels=kc)
    assert torch.equal(logits, before)


PENALTY_SETS = (dict(), dict(repetition_penalty=1.3), dict(frequency_penalty=0.7),
                dict(presence_penalty=-0.5),
                dict(repetition_penalty=0.9, frequency_penalty=0.2, presence_penalty=0.4))


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), v=st.sampled_from([37, 2049, 5000]),
       kind=st.sampled_from(["chain", "tree", "draft", "draft-mapped"]),
       bf16=st.booleans())
def test_sparse_penalty_launch_equals_reference_over_blocks(seed, v, kind, bf16, monkeypatch):
    """The penalties' launch (one program per (row, block of target ids), every position of
    the row in it, only the changed columns loaded and stored) against the torch reference
    over several blocks of ids, each penalty alone and all together, chain / tree / draft
    steps (target or draft vocabulary): equal values, and every column the controls do not
    touch (no bias, never seen) bit for bit unchanged."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(seed)
    st_ = SlotState.allocate(7, 3, 2, "cpu", vocab=v)
    for slot in range(1, 6):
        prompt = torch.randint(0, v, (int(torch.randint(0, 6, (1,), generator=g)),),
                               generator=g).tolist()
        cols = PENALTY_SETS[(slot + seed) % len(PENALTY_SETS)]
        bias = {int(t): 1.5 for t in torch.randint(0, v, (2,), generator=g)} if slot == 3 else {}
        _admit(st_, slot, prompt, sorted(bias.items()), **cols)
        for t in torch.randint(0, v, (4,), generator=g).tolist():
            st_.token_counts[slot, t] += 1
    st_.done[5] = 1
    rows, n = 6, 4
    slots = torch.tensor([1, 2, 3, 4, 5, 0])
    dtype = torch.bfloat16 if bf16 else torch.float32
    cand = torch.randint(0, v, (rows, n), generator=g)
    cand[0, 2] = cand[0, 1]  # a repeated draft
    kw: dict = {}
    if kind in ("chain", "tree"):
        logits = (torch.randn(rows * n, v, generator=g) * 3).to(dtype)
        if kind == "tree":
            kw["path"] = torch.tensor([[1, 3, 5, 11]] * rows)  # parents 0, 0, 1
        run = ops.apply_logit_controls
    else:
        vd = v // 2 if kind == "draft-mapped" else v
        logits = (torch.randn(rows, vd, generator=g) * 3).to(dtype)
        if vd < v:
            col_ids = torch.randperm(v, generator=g)[:vd]
            col_of = torch.full((v,), -1, dtype=torch.int64)
            col_of[col_ids] = torch.arange(vd)
            kw.update(col_ids=col_ids, col_of=col_of)
        cand[1, 1] = -1
        kw.update(accepted=torch.randint(0, v, (rows, 2), generator=g),
                  accepted_len=torch.randint(0, 3, (rows,), generator=g).to(torch.int32))
        run = ops.apply_draft_logit_controls
    outs = []
    for kc in (TORCH, TRITON):
        got = logits.clone()
        run(got, cand, slots, st_, kernels=kc, **kw)
        outs.append(got)
    tol = 1e-2 if bf16 else 1e-6  # bf16: the interpreter's cast may round another way
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=tol, atol=10 * tol)
    ref32 = logits.float().clone()  # which columns the controls leave alone (bf16 may round back)
    run(ref32, cand, slots, st_, kernels=TORCH, **kw)
    untouched = ref32 == logits.float()
    assert torch.equal(outs[1][untouched], logits[untouched])


def test_kernel_in_bfloat16_rounds_once_per_launch_alike():
    torch.manual_seed(1)
    v, n = 37, 3
    slots = torch.tensor([4, 2])
    cand = torch.randint(0, v, (2, n))
    logits = (torch.randn(2 * n, v) * 3).bfloat16()
    a, b = logits.clone(), logits.clone()
    ops.apply_logit_controls(a, cand, slots, _slot_state(v), kernels=TORCH)
    ops.apply_logit_controls(b, cand, slots, _slot_state(v), kernels=TRITON)
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def test_count_tokens_counts_accepted_tokens_only():
    v = 13
    counts = torch.zeros(4, v, dtype=torch.int32)
    counts[2, 5] = PROMPT_FLAG | 1
    tokens = torch.tensor([[5, 5, 9], [1, 2, 3], [4, 4, 4], [7, 8, 9]])
    accept = torch.tensor([3, 0, 2, 1], dtype=torch.int32)
    slots = torch.tensor([2, 1, 3, 0])
    want = counts.clone()
    for r in range(4):
        for j in range(int(accept[r])):
            want[slots[r], tokens[r, j]] += 1
    for kc in (TORCH, TRITON):
        got = counts.clone()
        ops.count_tokens(tokens, accept, slots, got, kernels=kc)
        assert torch.equal(got, want), kc.backend
    assert int(want[2, 5]) == PROMPT_FLAG | 3


@pytest.mark.parametrize("kc", [TORCH, TRITON], ids=["torch", "triton"])
def test_min_p_in_the_acceptance_kernel(kc):
    """Sampled rows never emit a token below min_p * p_max; greedy rows ignore min_p; the
    Triton kernel writes what the reference writes."""
    torch.manual_seed(2)
    v, n, rows = 30, 2, 64
    st = SlotState.allocate(3, 1, 1, "cpu", vocab=v)
    _admit(st, 1, temperature=1.2, min_p=0.2, seed=5)
    _admit(st, 2, temperature=0.0, min_p=0.9)
    logits = torch.randn(rows * n, v) * 2
    cand = torch.zeros(rows, n, dtype=torch.int64)
    slots = torch.tensor([1, 2] * (rows // 2))
    seq = torch.arange(rows, dtype=torch.int32) + 20
    out = _outs(rows, n)
    ops.accept_tokens(logits, cand, slots, seq, st, kernels=kc, **out)
    ref = _outs(rows, n)
    accept_ref(logits, cand, slots, seq, st, **ref)
    assert torch.equal(out["tokens"], ref["tokens"])
    p = torch.softmax(logits.view(rows, n, v) / 1.2, -1)
    tok = out["tokens"]
    for r in range(rows):
        for j in range(n):
            if r % 2 == 0:
                assert p[r, j, tok[r, j]] >= 0.2 * p[r, j].max()
            else:
                assert tok[r, j] == logits[r * n + j].argmax()


def test_verify_target_probs_min_p():
    from graphdraft.serving.verify import target_probs

    torch.manual_seed(8)
    logits = torch.randn(3, 9) * 2
    got = target_probs(logits, SamplingParams(temperature=0.8, min_p=0.25))
    for r in range(3):
        torch.testing.assert_close(got[r].double(), target_law(logits[r], 0.8, 0.25))


def test_row_target_probs_min_p():
    torch.manual_seed(3)
    logits = torch.randn(4, 9) * 2
    temp = torch.tensor([0.7, 1.0, 1.3, 0.0])
    got = row_target_probs(logits, temp, torch.zeros(4, dtype=torch.int64), torch.ones(4),
                           logits.argmax(-1), torch.tensor([0.3, 0.0, 0.05, 0.5]))
    for r, mp in enumerate((0.3, 0.0, 0.05)):
        torch.testing.assert_close(got[r].double(), target_law(logits[r], float(temp[r]), mp))
    assert got[3, logits[3].argmax()] == 1.0


# ---------------------------------------------------------------------------------------
# Slot tables and parameters
# ---------------------------------------------------------------------------------------
def test_admit_sets_prompt_flags_and_bias_release_keeps_other_slots():
    v = 20
    st = SlotState.allocate(4, 2, 2, "cpu", vocab=v)
    _admit(st, 2, prompt=[3, 3, 7], logit_bias=[(1, 2.0), (19, -5.0)], repetition_penalty=1.3)
    st.token_counts[2, 4] += 2  # an earlier output, reset by the next admission
    _admit(st, 1, prompt=[5], logit_bias=[(0, 1.0)])
    assert st.token_counts[2].tolist() == [PROMPT_FLAG if t in (3, 7) else 2 * (t == 4)
                                           for t in range(v)]
    assert st.bias_len[2] == 2 and st.bias_ids[2, :3].tolist() == [1, 19, -1]
    assert st.bias_values[2, :2].tolist() == [2.0, -5.0]
    before = {k: t.clone() for k, t in st.tables().items()}
    _admit(st, 2, prompt=[4])
    assert st.token_counts[2].tolist() == [PROMPT_FLAG * (t == 4) for t in range(v)]
    assert st.bias_len[2] == 0
    st.release(2)
    assert st.repetition_penalty[2] == 1.0 and st.bias_len[2] == 0
    for k, t in st.tables().items():  # slot 1 untouched by slot 2's admissions and release
        assert torch.equal(t[1], before[k][1]), k


def test_admit_rejects_bad_ids_writing_nothing():
    st = SlotState.allocate(3, 2, 2, "cpu", vocab=10)
    before = {k: t.clone() for k, t in st.tables().items()}
    with pytest.raises(ValueError, match=r"^logit_bias: expected token ids in \[0, 10\)"):
        _admit(st, 1, logit_bias=[(10, 1.0)])
    with pytest.raises(ValueError, match=r"^prompt: expected token ids in \[0, 10\)"):
        _admit(st, 1, prompt=[3, 12])
    for k, t in st.tables().items():
        assert torch.equal(t, before[k]), k


@pytest.mark.parametrize("kw, name", [
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"presence_penalty": True}, "presence_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 100.5}}, "logit_bias"),
    ({"logit_bias": {3: math.inf}}, "logit_bias"),
    ({"logit_bias": {3: True}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
])
def test_bad_values_name_the_field(kw, name):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        SamplingParams(**kw)


def test_logit_bias_forms():
    p = SamplingParams(logit_bias={"12": -3, 4: 1.5})
    assert p.logit_bias == ((4, 1.5), (12, -3.0))
    assert SamplingParams(logit_bias=[(4, 1.5), [12, -3]]).logit_bias == p.logit_bias
    assert hash(p) == hash(SamplingParams(logit_bias={4: 1.5, 12: -3.0}))
    assert len(SamplingParams(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS)}).logit_bias) == 300


def test_engine_rejects_a_bias_id_outside_the_vocab():
    target, _ = make_models(0)
    eng = Engine(target, runtime())
    v = target.config.vocab_size
    with pytest.raises(ValueError, match=rf"^params.logit_bias: expected token ids in \[0, {v}\)"):
        eng.add_request([1, 2], SamplingParams(logit_bias={v: 1.0}))
    assert not eng.waiting


@pytest.mark.parametrize("flags, message", [
    (["--logit-bias", "{x"], "argument --logit-bias: expected a map of token id"),
    (["--logit-bias", '{"5": 500}'], "argument --logit-bias: expected a map of token id"),
    (["--repetition-penalty", "0"], "argument --repetition-penalty: expected a number > 0"),
    (["--frequency-penalty", "-3"], "argument --frequency-penalty: expected a number in [-2, 2]"),
    (["--presence-penalty", "x"], "argument --presence-penalty: expected a number in [-2, 2]"),
    (["--min-p", "2"], "argument --min-p: expected a number in [0, 1]"),
    (["--min-p", "0.1"], "argument --min-p: has no effect when greedy"),
])
def test_bad_control_flags_name_the_flag(flags, message, capsys):
    from graphdraft.__main__ import main

    assert main(["generate", "--random-models", "--prompt", "ab", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_control_flags_and_prompt_file_keys_reach_sampling_params(tmp_path):
    import argparse

    from graphdraft.serving.cli.args import CliError, add_sampling_flags
    from graphdraft.serving.cli.generate import sampling_for
    from graphdraft.serving.cli.prompts import read_prompt_file

    p = argparse.ArgumentParser()
    add_sampling_flags(p, 8)
    p.add_argument("--stop", default=None)
    a = p.parse_args(["--repetition-penalty", "1.1", "--min-p", "0.05", "--logit-bias",
                      '{"7": -100, "9": 2}'])
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "frequency_penalty": 0.5, "logit_bias": {"3": 1}}\n'
                 '{"prompt": "b", "presence_penalty": 9}\n')
    specs = read_prompt_file(str(f))
    got = sampling_for(a, specs[0], (1,), 1)[0]
    assert (got.repetition_penalty, got.min_p, got.frequency_penalty) == (1.1, 0.05, 0.5)
    assert got.logit_bias == ((3, 1.0),)  # the line's map replaces the flag's
    with pytest.raises(CliError, match=r"p.jsonl:2: presence_penalty: expected in \[-2, 2\]"):
        sampling_for(a, specs[1], (1,), 1)
    from graphdraft.serving.cli.prompts import PromptSpec
    plain = sampling_for(a, PromptSpec("c", "--prompt #1"), (1,), 1)[0]
    assert plain.logit_bias == ((7, -100.0), (9, 2.0))


# ---------------------------------------------------------------------------------------
# Engines: speculative == target-only
# ---------------------------------------------------------------------------------------
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6], [10, 20, 30], [5, 6]]


def _controls(max_new: int, temperature: float = 0.0, seed: int | None = None
              ) -> list[SamplingParams]:
    kw = dict(max_new_tokens=max_new, temperature=temperature, seed=seed)
    return [SamplingParams(repetition_penalty=1.6, **kw),
            SamplingParams(frequency_penalty=2.0, **kw),
            SamplingParams(presence_penalty=1.5, logit_bias={3: 2.0, 5: -100}, **kw),
            SamplingParams(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.4,
                           logit_bias={"40": 1.5}, min_p=0.1, **kw),
            SamplingParams(min_p=0.3, **kw)]


@pytest.fixture(scope="module")
def pair():
    return make_models(0)


@pytest.fixture(scope="module")
def greedy_reference(pair):
    target, _ = pair
    params = _controls(16)
    ref = Engine(target, runtime(), eos_token_id=None).generate(PROMPTS, params)
    plain = Engine(target, runtime(), eos_token_id=None).generate(
        PROMPTS, [SamplingParams(max_new_tokens=16)] * len(PROMPTS))
    # every penalty / bias changed the text (the comparisons below can fail); min_p alone
    # is argmax-invariant
    assert all(a != b for a, b in zip(ref[:4], plain[:4], strict=True))
    assert ref[4] == plain[4]
    return params, ref


@pytest.mark.parametrize("mode", ["chain", "tree", "oracle"])
def test_greedy_speculative_equals_target_only_under_every_control(pair, greedy_reference, mode):
    target, head = pair
    params, ref = greedy_reference
    if mode == "chain":
        eng = Engine(target, runtime(), head, eos_token_id=None)
    elif mode == "tree":
        eng = Engine(target, runtime(speculative_eagle_topk=2, speculative_num_draft_tokens=6),
                     head, eos_token_id=None)
    else:  # drafts = the controlled target-only text: every window's drafts are accepted
        eng = Engine(target, runtime(), eos_token_id=None,
                     drafter=ScriptedDrafter.__new__(ScriptedDrafter))
        eng.drafter.__init__(eng, "oracle", expected={tuple(p): p + r for p, r in
                                                      zip(PROMPTS, ref, strict=True)})
    assert eng.generate(PROMPTS, params) == ref
    if mode == "oracle":
        assert eng.stats.mean_accept_length > 3.5


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_the_drafter_proposes_under_the_controls(mode):
    """The drafters read the rows' logit controls (the EAGLE drafter through
    `DraftBinding.slots`, the tree drafter's beams through `EngineTrees`): with the tokens
    they draft most often banned by logit_bias, no draft of a banned token is ever stored
    (without the controls in the draft, some are); the output is the same either way (the
    verify decides) and has none of them."""
    target, head = make_models(0, draft_vocab=40)  # a draft vocabulary: ids mapped
    extra = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6) if mode == "tree" else {}

    def drafts(params, controls: bool) -> tuple[list[int], list[list[int]]]:
        eng = Engine(target, runtime(**extra), head, eos_token_id=None)
        drafter = eng.mode.trees.drafter if mode == "tree" else eng.drafter
        table = eng.mode.trees.trees.tokens[:, 1:] if mode == "tree" else eng.slots.drafts
        if not controls:
            drafter.controls = None
        reqs = [eng.add_request(p, params) for p in PROMPTS[:3]]
        seen = []
        while eng.has_work:
            eng.step()
            seen += [t for r in reqs if r.slot is not None for t in table[r.slot].tolist()]
        return seen, [r.output for r in reqs]

    seen, _ = drafts(SamplingParams(max_new_tokens=12), controls=True)
    banned = torch.bincount(torch.tensor(seen)).topk(4).indices.tolist()
    params = SamplingParams(max_new_tokens=12, logit_bias={t: -100 for t in banned})
    with_controls, out = drafts(params, controls=True)
    assert not set(with_controls) & set(banned)
    without, out_without = drafts(params, controls=False)
    assert set(without) & set(banned)
    assert out == out_without and not set(t for o in out for t in o) & set(banned)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_draft_controls_see_the_cycles_accepted_tokens(pair, monkeypatch, mode):
    """The counts change only in the commit, after the draft; every draft step's controls
    see, per live row, the slot's counts plus its accepted window, which equals the slot's
    counts once the step committed (decode cycles, prefill / mixed steps, requests joining)."""
    target, head = pair
    extra = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6) if mode == "tree" else {}
    eng = Engine(target, runtime(**extra), head, eos_token_id=None)
    real = ops.apply_draft_logit_controls
    seen: list[tuple[int, torch.Tensor]] = []

    def spy(logits, window, slots, state, *, accepted=None, accepted_len=None, **kw):
        group = slots.shape[0] // accepted.shape[0] if accepted is not None else 1
        for r, s in enumerate(slots.tolist()):
            if s == 0 or state.done[s]:
                continue
            c = state.token_counts[s] & COUNT_MASK
            if accepted is not None:
                ra = r // group
                for t in accepted[ra, : int(accepted_len[ra])].tolist():
                    c[t] += 1
            seen.append((s, c))
        real(logits, window, slots, state, accepted=accepted, accepted_len=accepted_len, **kw)

    monkeypatch.setattr(ops, "apply_draft_logit_controls", spy)
    params = _controls(8)
    reqs = [eng.add_request(p, q) for p, q in zip(PROMPTS[:2], params[:2], strict=True)]
    checked, step = 0, 0
    while eng.has_work or step < 2:
        if step == 2:
            reqs += [eng.add_request(p, q) for p, q in zip(PROMPTS[2:], params[2:], strict=True)]
        eng.step()
        step += 1
        for s, c in seen:
            assert torch.equal(c, eng.slots.token_counts[s] & COUNT_MASK), (step, s)
        checked += len(seen)
        seen.clear()
    assert checked > 3 * len(PROMPTS) and all(len(r.output) == 8 for r in reqs)


def test_sampled_chain_equals_target_only_token_for_token(pair):
    """Keyed noise (seed, position): a sampled request's tokens do not depend on how many
    drafts were accepted, so the chain's are target-only's under the controls too."""
    target, head = pair
    params = _controls(12, temperature=0.9, seed=7)
    ref = Engine(target, runtime(), eos_token_id=None).generate(PROMPTS, params)
    got = Engine(target, runtime(), head, eos_token_id=None).generate(PROMPTS, params)
    assert got == ref


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_launch_reads_no_device_value_with_controls(pair, monkeypatch, mode):
    """Every control on (greedy and sampled rows): a step's launch (prefill, decode, a
    request joining) does no host read of a device value (every read path of torch.Tensor
    trapped while `launch` runs), as without them."""
    target, head = pair
    extra = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6) if mode == "tree" else {}
    eng = Engine(target, runtime(**extra), head, eos_token_id=None)
    real_launch = eng.launch

    def trap(*a, **k):
        raise AssertionError("host read of a device value during launch")

    def launch(*a, **k):
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__int__", "__bool__", "__float__", "numpy"):
                m.setattr(torch.Tensor, name, trap)
            return real_launch(*a, **k)

    eng.launch = launch
    params = _controls(6)[:4] + _controls(6, temperature=0.8, seed=1)[3:4]
    reqs = [eng.add_request(p, q) for p, q in zip(PROMPTS[:2], params[:2], strict=True)]
    eng.step()
    eng.step()
    reqs += [eng.add_request(p, q) for p, q in zip(PROMPTS[2:], params[2:], strict=True)]
    while eng.has_work:
        eng.step()
    assert all(len(r.output) == 6 for r in reqs)


# ---------------------------------------------------------------------------------------
# Sampled distributions (chi-square, fail at p < 1e-4)
# ---------------------------------------------------------------------------------------
V8 = 8
PROMPT8, OUT8 = [1, 6], [2, 2]
COLS8 = dict(repetition_penalty=2.5, frequency_penalty=0.8, presence_penalty=0.3, min_p=0.02)
BIAS8 = {0: 1.0}
T8 = 0.9


def _state8() -> SlotState:
    st = SlotState.allocate(2, 3, 1, "cpu", vocab=V8)
    _admit(st, 1, PROMPT8, sorted(BIAS8.items()), temperature=T8,
           seed=request_seed(11, 0), **COLS8)
    for t in OUT8:
        st.token_counts[1, t] += 1
    return st


def _law(x: torch.Tensor, window: list[int]) -> torch.Tensor:
    c = NEUTRAL | COLS8
    y = vllm_penalised(x, PROMPT8, OUT8 + window, c["repetition_penalty"],
                       c["frequency_penalty"], c["presence_penalty"], BIAS8)
    return target_law(y, T8, c["min_p"])


def test_sampled_chain_follows_target_only_law_under_controls():
    """Rows of one slot, distinct positions: the first token ~ the controlled law, the
    second (after the accepted draft d) ~ the law with d counted as emitted."""
    torch.manual_seed(4)
    rows, n = 30000, 2
    base = torch.randn(n, V8) * 1.2 + 1.0
    p0 = _law(base[0], [])
    d = int(p0.argmax())
    p1, p1_uncounted = _law(base[1], [d]), _law(base[1], [])
    st = _state8()
    logits = base.repeat(rows, 1)
    cand = torch.tensor([2, d]).expand(rows, n).contiguous()
    slots = torch.ones(rows, dtype=torch.int64)
    ops.apply_logit_controls(logits, cand, slots, st, kernels=TORCH)
    out = _outs(rows, n)
    accept_ref(logits, cand, slots, torch.arange(rows, dtype=torch.int32) * 5 + 40, st, **out)
    tok = out["tokens"]
    assert _chi2(torch.bincount(tok[:, 0], minlength=V8), p0.float()) > 1e-4
    sel = tok[:, 0] == d
    second = torch.bincount(tok[sel, 1], minlength=V8)
    assert _chi2(second, p1.float()) > 1e-4
    assert _pvalue_loose(second, p1_uncounted) < 1e-4  # the draft must be counted


def _pvalue_loose(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square p-value where a zero-probability cell with counts is a certain rejection."""
    if int(counts[p == 0].sum()) > 0:
        return 0.0
    return _fit(counts, p)


def _fit(counts: torch.Tensor, p: torch.Tensor) -> float:
    """`_chi2` (a filtered token emitted: assertion error); a point mass fits with p-value 1."""
    if int((p > 0).sum()) == 1:
        assert int(counts[p == 0].sum()) == 0, "a filtered-out token was emitted"
        return 1.0
    return _chi2(counts, p.float())


def test_sampled_tree_follows_target_only_law_under_controls():
    """A root with two children (tokens a, b) and a grandchild under a: the tree's sampled
    acceptance over the controlled logits (each node counting its path) emits the first
    token ~ the root's law and the second, given child c accepted, ~ the law with c's token
    counted."""
    torch.manual_seed(5)
    rows, spec = 30000, TreeSpec(2, 2, 4)
    n = spec.n
    base = torch.randn(n, V8) * 0.8 + 0.5
    p_root = _law(base[0], [])
    a, b = [int(t) for t in p_root.argsort(descending=True)[:2]]
    c3 = int(_law(base[1], [a]).argmax())
    tok = torch.tensor([2, a, b, c3])
    parents = [-1, 0, 0, 1]
    mask = torch.tensor([(1 << i) | (sum(1 << m for m in _ancestors(parents, i)))
                         for i in range(n)])
    st = _state8()
    logits = base.repeat(rows, 1)
    cand = tok.expand(rows, n).contiguous()
    slots = torch.ones(rows, dtype=torch.int64)
    ops.apply_logit_controls(logits, cand, slots, st, path=mask.expand(rows, n).contiguous(),
                             kernels=TORCH)
    rep = lambda t, dt: torch.full((rows * n,), t, dtype=dt)  # noqa: E731
    probs = row_target_probs(logits, rep(T8, torch.float32), rep(0, torch.int64),
                             rep(1.0, torch.float32), logits.argmax(-1),
                             rep(COLS8["min_p"], torch.float32))
    first = torch.tensor([1, -1, 3, -1]).expand(rows, n).contiguous()   # root: a, b; a: c3
    nxt = torch.tensor([-1, 2, -1, -1]).expand(rows, n).contiguous()
    o = dict(accept_len=torch.zeros(rows, dtype=torch.int32),
             accept_index=torch.zeros(rows, spec.P, dtype=torch.int64),
             out_tokens=torch.zeros(rows, spec.P, dtype=torch.int64),
             bonus=torch.zeros(rows, dtype=torch.int64))
    g = torch.Generator().manual_seed(6)
    tree_accept_ref(spec, cand, first, nxt, probs=probs, coins=torch.rand(rows, n, generator=g),
                    final_coin=torch.rand(rows, generator=g), **o)
    out, idx = o["out_tokens"], o["accept_index"]
    assert _fit(torch.bincount(out[:, 0], minlength=V8), p_root) > 1e-4
    for node, t in ((1, a), (2, b)):
        sel = idx[:, 1] == node
        second = torch.bincount(out[sel, 1], minlength=V8)
        assert _fit(second, _law(base[node], [t])) > 1e-4, node
    sel = idx[:, 1] == 1
    assert _pvalue_loose(torch.bincount(out[sel, 1], minlength=V8), _law(base[1], [])) < 1e-4


def _ancestors(parents: list[int], i: int) -> list[int]:
    out = []
    while parents[i] >= 0:
        i = parents[i]
        out.append(i)
    return out


# ---------------------------------------------------------------------------------------
# GPU: the cycle graphs (fused chain, tree) under the controls == target-only (fp32)
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_gpu_cycle_graphs_equal_target_only_under_controls(mode):
    """Greedy requests with every control beside sampled ones, fp32, the decode cycle
    replayed as one graph (`spec_cycle` / `tree_cycle_sampled`): greedy == target-only token
    for token (the torch kernel path, as the other fp32 equality tests: the Triton GEMV's
    shapes differ between the two engines). The tree cycle is captured on the Triton kernels
    (its KV move's torch reference is not capturable) with every matmul on cuBLAS
    (`small_m_max=0`), the matmuls of the torch path."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from graphdraft.kernels.config import KernelConfig
    target, head = make_models(0, dtype=torch.float32, device="cuda")
    cfg = dict(dtype="float32", device="cuda", kernel_backend="torch")
    if mode == "tree":
        cfg = dict(cfg, kernel_backend="triton", kernels=KernelConfig(small_m_max=0))
    params = _controls(24) + _controls(24, temperature=0.8, seed=3)
    prompts = PROMPTS + PROMPTS[::-1]
    base = Engine(target, runtime(**cfg), eos_token_id=None)
    base.capture_graphs(progress=False)
    ref = base.generate(prompts, params)
    extra = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6) if mode == "tree" else {}
    eng = Engine(target, runtime(**cfg, **extra), head, eos_token_id=None)
    eng.capture_graphs(progress=False)
    got = eng.generate(prompts, params)
    assert got[: len(PROMPTS)] == ref[: len(PROMPTS)]
    family = "spec_cycle" if mode == "chain" else "tree_cycle_sampled"
    replays, _ = eng.graph_summary()[family]
    assert replays > 0, eng.graph_summary()


@pytest.mark.gpu
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_gpu_triton_kernels_equal_the_reference(tree):
    """The Triton kernels on the GPU (bf16 and fp32 logits, a 32,000-id vocabulary, 64 rows):
    the torch reference's writes."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(7)
    v, n, rows = 32000, 4, 64
    st = SlotState.allocate(9, 3, 2, "cuda", vocab=v)
    for s in range(1, 9):
        ids = torch.randperm(v)[:20].tolist()
        bias = sorted(zip(ids, (torch.randn(20) * 5).tolist(), strict=True))
        _admit(st, s, torch.randint(0, v, (50,)).tolist(), bias,
               repetition_penalty=1.0 + 0.1 * s, frequency_penalty=0.2 * (s % 3),
               presence_penalty=-0.3 * (s % 2))
        st.token_counts[s, torch.randint(0, v, (30,))] += 1
    slots = torch.randint(0, 9, (rows,), device="cuda")
    cand = torch.randint(0, v, (rows, n), device="cuda")
    path = torch.tensor([1, 3, 5, 11], device="cuda").expand(rows, n).contiguous() if tree else None
    for dt in (torch.bfloat16, torch.float32):
        logits = (torch.randn(rows * n, v, device="cuda") * 4).to(dt)
        a, b = logits.clone(), logits.clone()
        ops.apply_logit_controls(a, cand, slots, st, path=path, kernels=TORCH)
        ops.apply_logit_controls(b, cand, slots, st, path=path, kernels=TRITON)
        tol = 2e-2 if dt == torch.bfloat16 else 1e-5  # bf16: one ulp where a rounding differs
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    counts = st.token_counts.clone()
    accept = torch.randint(0, n + 1, (rows,), device="cuda", dtype=torch.int32)
    ops.count_tokens(cand, accept, slots, counts, kernels=TRITON)
    want = st.token_counts.clone()
    ops.count_tokens(cand, accept, slots, want, kernels=TORCH)
    assert torch.equal(counts, want)
