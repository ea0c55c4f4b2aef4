"""kernels/mixed_draft_inputs.py (a prefill / mixed batch's first draft step inputs in one
launch): the kernel (TRITON_INTERPRET=1 on the CPU) writes what the torch path writes, and
the torch path what the module doc's rule says, entry by entry."""

from __future__ import annotations

import os

import pytest
import torch

from graphdraft.kernels.mixed_draft_inputs import mixed_draft_inputs, mixed_draft_inputs_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton needs CUDA or TRITON_INTERPRET=1")
KINDS = (0, 1, 2)
MAX_T, MAX_B = 700, 12


def _case(seed, lens, nd, n, pad_rows, pad_tokens, tok_dtype=torch.int64):
    """Inputs and (pre-filled, garbage) outputs of a batch of prefill chunks `lens`."""
    g = torch.Generator().manual_seed(seed)
    ne, npt = len(lens), sum(lens)
    bs, t = ne + nd, npt + nd * n
    shifted = torch.randint(0, 90, (MAX_T,), generator=g)
    ends = torch.tensor(lens).cumsum(0) - 1
    final = torch.rand(ne, generator=g) < 0.6  # a final chunk: its last shifted id is -1
    shifted[ends[final]] = -1
    shifted[ends[:1]] = -1  # at least one
    if ne > 1:
        shifted[ends[1]] = 77  # a mid chunk: its next prompt token stays
    extend_lens = torch.zeros(MAX_B, dtype=torch.int32)
    extend_lens[:ne] = torch.tensor(lens, dtype=torch.int32)
    out_tok = torch.randint(100, 200, (ne + nd * n,), generator=g).to(tok_dtype)
    accept = torch.randint(0, n + 1, (bs,), generator=g, dtype=torch.int32)
    outs = dict(ids=torch.randint(-5, 5, (MAX_T,), generator=g),
                accept_out=torch.randint(-5, 5, (MAX_B,), generator=g, dtype=torch.int32),
                row_kind=torch.randint(5, 9, (MAX_B,), generator=g, dtype=torch.int32),
                accepted=torch.randint(-9, -2, (MAX_B, n), generator=g))
    args = (ne, nd, n, npt, bs + pad_rows, t + pad_tokens,
            *(x.to(DEV) for x in (shifted, extend_lens, out_tok, accept)))
    return args, {k: v.to(DEV) for k, v in outs.items()}


def _run(fn, args, outs, with_accepted):
    o = {k: v.clone() for k, v in outs.items()}
    if not with_accepted:
        o["accepted"] = None
    fn(*args, **o, kinds=KINDS, pad_id=0)
    return o


CASES = [([5], 0, 3, 0, 0), ([5, 3, 7], 2, 3, 0, 0), ([1, 1], 4, 4, 3, 17),
         ([300, 250], 3, 3, 2, 40), ([4], 5, 1, 0, 5), ([9, 2, 6, 1], 0, 3, 4, 0)]


@pytest.mark.parametrize("case", CASES)
def test_ref_is_the_rule(case):
    lens, nd, n, pad_rows, pad_tokens = case
    args, outs = _case(1, *case)
    ne, _, _, npt, rows, tokens, shifted, extend_lens, out_tok, accept = args
    o = _run(mixed_draft_inputs_ref, args, outs, True)
    bs, t = ne + nd, npt + nd * n
    want = shifted[:npt].clone()
    for r, end in enumerate(torch.tensor(lens).cumsum(0).tolist()):
        if want[end - 1] < 0:
            want[end - 1] = out_tok[r]
    assert torch.equal(o["ids"][:npt], want)
    assert torch.equal(o["ids"][npt:t], out_tok[ne:])
    assert (o["ids"][t:tokens] == 0).all() and torch.equal(o["ids"][tokens:], outs["ids"][tokens:])
    assert torch.equal(o["accept_out"][:bs], accept)
    assert torch.equal(o["accept_out"][bs:], outs["accept_out"][bs:])
    assert o["row_kind"][:rows].tolist() == [0] * ne + [1] * nd + [2] * (rows - bs)
    assert torch.equal(o["row_kind"][rows:], outs["row_kind"][rows:])
    acc, acc0 = o["accepted"], outs["accepted"]
    assert torch.equal(acc[:ne, 0], out_tok[:ne]) and torch.equal(acc[:ne, 1:], acc0[:ne, 1:])
    assert torch.equal(acc[ne:bs], out_tok[ne:].view(nd, n))
    assert torch.equal(acc[bs:], acc0[bs:])


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_accepted", [False, True])
def test_kernel_matches_ref(case, with_accepted):
    args, outs = _case(2, *case)
    a = _run(mixed_draft_inputs_ref, args, outs, with_accepted)
    b = _run(mixed_draft_inputs, args, outs, with_accepted)
    for k in a:
        assert (a[k] is None and b[k] is None) or torch.equal(a[k], b[k]), k


@needs_triton
def test_kernel_reads_int32_output_tokens():
    args, outs = _case(3, [4, 2], 2, 3, 1, 2, tok_dtype=torch.int32)
    a = _run(mixed_draft_inputs_ref, args, outs, True)
    b = _run(mixed_draft_inputs, args, outs, True)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_bad_arguments_name_themselves():
    args, outs = _case(4, [3], 1, 3, 0, 0)
    with pytest.raises(ValueError, match="tokens"):
        _run(mixed_draft_inputs_ref, (*args[:5], args[5] - 1, *args[6:]), outs, True)
    with pytest.raises(ValueError, match="output_tokens"):
        _run(mixed_draft_inputs_ref, (*args[:8], args[8][:-1], args[9]), outs, True)
    with pytest.raises(ValueError, match="extend_lens"):
        _run(mixed_draft_inputs_ref, (*args[:7], args[7].long(), *args[8:]), outs, True)
    o = dict(outs, accepted=outs["accepted"][:, :2].contiguous())
    with pytest.raises(ValueError, match="accepted"):
        _run(mixed_draft_inputs_ref, args, o, True)
