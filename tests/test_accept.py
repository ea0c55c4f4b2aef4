"""The device accept kernel: Triton == torch reference, greedy == verify_greedy, the sampled
acceptance reproduces the target distribution (chi-square), stop cut, Philox noise."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from graphdraft.kernels.accept import (
    FINISH_LENGTH,
    FINISH_STOP,
    _uniform,
    accept_ref,
    philox_uniform_ref,
)
from graphdraft.kernels.config import TORCH, TRITON
from graphdraft.ops import accept_tokens
from graphdraft.runtime.slot_state import SlotState, StopTableFullError
from graphdraft.sampling import COLUMNS
from graphdraft.serving.verify import SamplingParams, request_seed, target_probs, verify_greedy


def _outs(rows, n):
    return dict(tokens=torch.zeros(rows, n, dtype=torch.int64),
                accept=torch.zeros(rows, dtype=torch.int32),
                draft_accept=torch.zeros(rows, dtype=torch.int32),
                finish=torch.zeros(rows, dtype=torch.int32), err=torch.zeros(rows, dtype=torch.int32))


def _state(slots=6, steps=3, width=2):
    return SlotState.allocate(slots, steps, width, "cpu")


def _admit(st, slot, **columns):
    """`st.admit` with every sampling column not given at its neutral value."""
    st.admit(slot, **({c.name: c.neutral for c in COLUMNS} | columns))


@triton.jit
def _uniform_kernel(seed_ptr, pos_ptr, out, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(out + i, _uniform(tl.load(seed_ptr), tl.load(pos_ptr + i)))


@pytest.mark.parametrize("seed", [0, 123, 2**40 + 17, 2**62 + 5])
def test_philox_reference_matches_tl_randint(seed):
    pos = torch.arange(32, dtype=torch.int64) * 977
    out = torch.zeros(32)
    _uniform_kernel[(1,)](torch.tensor([seed]), pos, out, B=32)
    ref = philox_uniform_ref(torch.tensor([seed]), pos)
    assert torch.equal(out, ref)
    assert bool(((ref > 0) & (ref < 1)).all())


def test_kernel_matches_reference_mixed_rows():
    """Greedy, sampled (temperature, top-k, top-p), stop and length cut, inert and done rows,
    a bad draft id: the Triton kernel writes what the torch reference writes."""
    torch.manual_seed(0)
    n, v, rows = 4, 50, 7
    st = _state()
    _admit(st, 1, temperature=0.0, top_p=1.0, top_k=0, seed=1, stop_ids=[7], max_new=100)
    _admit(st, 2, temperature=0.8, top_p=1.0, top_k=0, seed=2, stop_ids=[], max_new=100)
    _admit(st, 3, temperature=1.0, top_p=0.9, top_k=10, seed=3, stop_ids=[5, 6], max_new=100)
    _admit(st, 4, temperature=1.3, top_p=0.7, top_k=0, seed=4, stop_ids=[], max_new=3)
    _admit(st, 5, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop_ids=[], max_new=100)
    st.emitted[4] = 1
    st.done[5] = 1
    logits = torch.randn(rows * n, v, dtype=torch.float64) * 2
    greedy = torch.argmax(logits, -1).view(rows, n)
    cand = torch.randint(0, v, (rows, n))
    cand[0, 1:] = greedy[0, :-1]
    stop_at = int(greedy[0, 1])
    st.stop_ids[1, 0] = stop_at  # a stop inside row 0's accepted block
    cand[1, 1:] = greedy[1, :-1]
    cand[6, 1:] = greedy[6, :-1]
    cand[6, 2] = v + 3  # a bad draft id
    slots = torch.tensor([1, 2, 3, 4, 0, 5, 1])
    seq = torch.tensor([10, 20, 30, 40, 1, 9, 12], dtype=torch.int32)
    a, b = _outs(rows, n), _outs(rows, n)
    accept_tokens(logits, cand, slots, seq, st, kernels=TRITON, **a)
    accept_ref(logits, cand, slots, seq, st, **b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert a["accept"][0] == 2 and a["finish"][0] == FINISH_STOP  # cut at the stop token
    assert a["accept"][4] == 0 and a["accept"][5] == 0  # padded and done rows are inert
    assert a["draft_accept"][4] == 1
    assert int(a["err"][6]) == 1 and int(a["err"][:6].abs().sum()) == 0


@pytest.mark.parametrize("use_triton", [True, False])
def test_greedy_rows_equal_verify_greedy(use_triton):
    torch.manual_seed(1)
    n, v, rows = 3, 40, 6
    st = _state(slots=rows + 1)
    for s in range(1, rows + 1):
        _admit(st, s, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop_ids=[], max_new=1000)
    logits = torch.randn(rows * n, v)
    g = torch.argmax(logits, -1).view(rows, n)
    cand = torch.randint(0, v, (rows, n))
    for r in range(rows):  # r leading matches (capped)
        k = min(r, n - 1)
        cand[r, 1:1 + k] = g[r, :k]
    out = _outs(rows, n)
    accept_tokens(logits, cand, torch.arange(1, rows + 1), torch.full((rows,), 20, dtype=torch.int32),
                  st, kernels=TRITON if use_triton else TORCH, **out)
    tok, acc = verify_greedy(cand, logits)
    assert torch.equal(out["tokens"].view(-1), tok) and torch.equal(out["accept"], acc)


def test_length_cut_and_stop_precedence():
    n, v = 4, 16
    st = _state()
    _admit(st, 1, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop_ids=[], max_new=5)
    st.emitted[1] = 3
    logits = torch.randn(n, v)
    g = torch.argmax(logits, -1)
    cand = torch.cat([torch.tensor([0]), g[:-1]]).unsqueeze(0)  # all accepted
    for use_triton in (True, False):
        out = _outs(1, n)
        accept_tokens(logits, cand, torch.tensor([1]), torch.tensor([20], dtype=torch.int32), st,
                      kernels=TRITON if use_triton else TORCH, **out)
        assert int(out["accept"][0]) == 2 and int(out["finish"][0]) == FINISH_LENGTH
    st.stop_ids[1, 0] = int(g[1])  # the stop token is the length-limited one too: stop wins
    out = _outs(1, n)
    accept_tokens(logits, cand, torch.tensor([1]), torch.tensor([20], dtype=torch.int32), st,
                  kernels=TRITON, **out)
    if int(g[0]) != int(g[1]):
        assert int(out["accept"][0]) == 2 and int(out["finish"][0]) == FINISH_STOP


def _chi2_sf(x: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts against probs (cells with p > 0; filtered cells must be 0)."""
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "a filtered-out token was emitted"
    total = counts.sum()
    exp = probs[keep].double() * total
    stat = float(((counts[keep].double() - exp) ** 2 / exp).sum())
    return _chi2_sf(stat, int(keep.sum()) - 1)


def test_sampled_acceptance_reproduces_target_distribution():
    """Chi-square (fail at p < 1e-4) on a vocab of 8, 30,000 rows with keyed noise (one
    seed, distinct positions): the first emitted token ~ p0, the second given the first
    draft was accepted ~ p1, under temperature + top-k + top-p (the reference algorithm
    that the kernel equals, `test_kernel_matches_reference_mixed_rows`)."""
    torch.manual_seed(0)
    v, n, rows = 8, 3, 30000
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.9)
    logits = torch.randn(n, v) * 1.5
    p = target_probs(logits, params)
    st = _state(slots=2)
    _admit(st, 1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
             seed=request_seed(77, 0), stop_ids=[], max_new=10**6)
    d1, d2 = int(p[0].argmax()), int(p[1].argmax())
    cand = torch.tensor([0, d1, d2]).expand(rows, n).contiguous()
    seq = (torch.arange(rows, dtype=torch.int32) * 7 + 50)
    out = _outs(rows, n)
    accept_ref(logits.repeat(rows, 1), cand, torch.ones(rows, dtype=torch.int64), seq, st, **out)
    tok, acc = out["tokens"], out["accept"]
    first = torch.bincount(tok[:, 0], minlength=v)
    assert _chi2(first, p[0]) > 1e-4
    sel = tok[:, 0] == d1
    assert bool((acc[sel] >= 2).all()) and bool((acc[~sel] == 1).all())
    second = torch.bincount(tok[sel, 1], minlength=v)
    assert _chi2(second, p[1]) > 1e-4
    # the test can fail: the greedy law is rejected
    wrong = torch.zeros(v)
    wrong[p[0].argmax()] = 1.0
    wrong = 0.5 * wrong + 0.5 * p[0]
    assert _chi2(first, wrong) < 1e-4


def test_noise_depends_on_seed_and_position_only():
    """The same (seed, position) draws the same token whatever the row, batch or padding."""
    torch.manual_seed(3)
    v, n = 20, 2
    st = _state(slots=4)
    for s in (1, 2):
        _admit(st, s, temperature=1.0, top_p=1.0, top_k=0, seed=99, stop_ids=[], max_new=100)
    _admit(st, 3, temperature=1.0, top_p=1.0, top_k=0, seed=98, stop_ids=[], max_new=100)
    row = torch.randn(n, v)
    logits = torch.cat([row, torch.randn(n, v), row, row])
    cand = torch.zeros(4, n, dtype=torch.int64)
    out = _outs(4, n)
    accept_tokens(logits, cand, torch.tensor([1, 3, 2, 3]), torch.tensor([30, 30, 30, 31],
                  dtype=torch.int32), st, kernels=TRITON, **out)
    t = out["tokens"]
    assert torch.equal(t[0], t[2])  # slots 1 and 2: same seed, same positions, same logits


def test_stop_table_width_enforced():
    st = _state(width=2)
    with pytest.raises(StopTableFullError, match="stop_token_ids"):
        _admit(st, 1, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop_ids=[1, 2, 3], max_new=4)
    assert int(st.stop_ids[1].max()) == -1  # nothing written


def test_request_seed_rule():
    assert request_seed(5, 0) == 5
    seeds = {request_seed(5, k) for k in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)
