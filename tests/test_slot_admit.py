"""kernels/slot_admit.py (the admission's rows of the SlotState tables): the kernel
(TRITON_INTERPRET=1 on the CPU) writes what the torch path writes, the torch path what the
module doc's rule says, and SlotState admits through it with either path to the same tables."""

from __future__ import annotations

import os
import re

import pytest
import torch

from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.logit_controls import PROMPT_FLAG
from graphdraft.kernels.slot_admit import TABLES, admit_rows, admit_rows_ref
from graphdraft.runtime.slot_state import SlotState
from graphdraft.sampling import COLUMNS, SamplingParams, device_row

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton needs CUDA or TRITON_INTERPRET=1")


def _tables(g, r=6, s=3, w=4, v=37, b=5):
    """Random (non-neutral) tables: every value an admission must overwrite is visible."""
    def ri(shape, dt):
        return torch.randint(-3, 50, shape, generator=g).to(dt).to(DEV)
    shapes = {"last_token": (r,), "drafts": (r, s), "stop_ids": (r, w), "emitted": (r,),
              "done": (r,), "token_counts": (r, v), "bias_ids": (r, b), "bias_values": (r, b),
              "bias_len": (r,)}
    t = {n: ri(shapes[n], dt) if dt != torch.float32 else torch.randn(shapes[n], generator=g)
         .to(DEV) for n, dt in TABLES.items()}
    cols = [torch.randn(r, generator=g).to(DEV), ri((r,), torch.int32), ri((r,), torch.int64)]
    return t, cols


def _rows(g, slots, w=4, v=37, b=5):
    m = len(slots)
    lens = [int(x) for x in torch.randint(0, 9, (m,), generator=g)]
    lens[0] = 0  # a row without a prompt
    counted = torch.cat([torch.randint(0, v, (n,), generator=g) + s * v
                         for n, s in zip(lens, slots, strict=True)]).long()
    off = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    blen = torch.randint(0, b + 1, (m,), generator=g, dtype=torch.int32)
    bias_ids = torch.randint(0, v, (m, b), generator=g, dtype=torch.int32)
    bias_values = torch.randn(m, b, generator=g)
    keep = torch.arange(b) < blen.long()[:, None]
    bias_ids, bias_values = torch.where(keep, bias_ids, -1), torch.where(keep, bias_values, 0.0)
    stop = torch.randint(-1, v, (m, w), generator=g)
    srcs = [torch.randn(m, generator=g), torch.randint(0, 9, (m,), generator=g).int(),
            torch.randint(0, 2**40, (m,), generator=g)]
    args = [torch.tensor(slots), stop, counted, off, bias_ids, bias_values, blen]
    return [a.to(DEV) for a in args], [s.to(DEV) for s in srcs], lens


def _clone(t, cols):
    return {k: x.clone() for k, x in t.items()}, [c.clone() for c in cols]


def test_ref_is_the_rule():
    g = torch.Generator().manual_seed(1)
    t, cols = _tables(g)
    slots = [4, 1, 5]
    args, srcs, lens = _rows(g, slots)
    before, before_cols = _clone(t, cols)
    admit_rows_ref(t, *args, list(zip(cols, srcs, strict=True)))
    _, stop, counted, off, bias_ids, bias_values, blen = args
    for i, s in enumerate(slots):
        for name in ("last_token", "drafts", "emitted", "done"):
            assert (t[name][s] == 0).all(), name
        want = torch.zeros(t["token_counts"].shape[1], dtype=torch.int32, device=DEV)
        want[counted[int(off[i]): int(off[i + 1])] - s * want.shape[0]] = PROMPT_FLAG
        assert torch.equal(t["token_counts"][s], want)
        assert torch.equal(t["stop_ids"][s], stop[i])
        assert torch.equal(t["bias_ids"][s], bias_ids[i])
        assert torch.equal(t["bias_values"][s], bias_values[i])
        assert t["bias_len"][s] == blen[i]
        for c, src in zip(cols, srcs, strict=True):
            assert c[s] == src[i]
    for s in (0, 2, 3):  # other rows untouched
        for name, x in t.items():
            assert torch.equal(x[s], before[name][s]), name
        for c, c0 in zip(cols, before_cols, strict=True):
            assert c[s] == c0[s]


@needs_triton
@pytest.mark.parametrize("slots", [[3], [4, 1, 5], [1, 2, 3, 4, 5]])
@pytest.mark.parametrize("ncols", [0, 3])
def test_kernel_matches_ref(slots, ncols):
    g = torch.Generator().manual_seed(len(slots) * 7 + ncols)
    t, cols = _tables(g)
    args, srcs, _ = _rows(g, slots)
    (ta, ca), (tb, cb) = _clone(t, cols), _clone(t, cols)
    admit_rows_ref(ta, *args, list(zip(ca, srcs, strict=True))[:ncols])
    admit_rows(tb, *args, list(zip(cb, srcs, strict=True))[:ncols])
    for name in TABLES:
        assert torch.equal(ta[name], tb[name]), name
    for a, b in zip(ca, cb, strict=True):
        assert torch.equal(a, b)


@needs_triton
def test_kernel_wide_vocab_and_long_prompts():
    """token_counts wider than one zeroing block, prompts longer than one flag block."""
    g = torch.Generator().manual_seed(3)
    v = 2500
    t, cols = _tables(g, v=v)
    slots = [2, 5]
    m = len(slots)
    lens = [300, 130]
    counted = torch.cat([torch.randint(0, v, (n,), generator=g) + s * v
                         for n, s in zip(lens, slots, strict=True)]).to(DEV)
    off = torch.tensor([0, 300, 430], device=DEV)
    stop = torch.full((m, 4), -1, device=DEV)
    bias = (torch.full((m, 5), -1, dtype=torch.int32, device=DEV), torch.zeros(m, 5, device=DEV),
            torch.zeros(m, dtype=torch.int32, device=DEV))
    (ta, _), (tb, _) = _clone(t, cols), _clone(t, cols)
    idx = torch.tensor(slots, device=DEV)
    admit_rows_ref(ta, idx, stop, counted, off, *bias)
    admit_rows(tb, idx, stop, counted, off, *bias)
    for name in TABLES:
        assert torch.equal(ta[name], tb[name]), name


def test_bad_arguments_name_themselves():
    g = torch.Generator().manual_seed(4)
    t, _ = _tables(g)
    args, _, _ = _rows(g, [1, 2])
    with pytest.raises(ValueError, match="counted_off"):
        admit_rows_ref(t, *args[:3], args[3][:-1], *args[4:])
    with pytest.raises(ValueError, match="stop"):
        admit_rows_ref(t, args[0], args[1].int(), *args[2:])
    with pytest.raises(ValueError, match="tables"):
        admit_rows_ref({k: x for k, x in t.items() if k != "done"}, *args)
    with pytest.raises(ValueError, match=r"columns\[0\] source"):
        admit_rows_ref(t, *args, [(torch.zeros(6, device=DEV), torch.zeros(2, dtype=torch.int64,
                                                                           device=DEV))])


_ADMITS = [(3, SamplingParams(temperature=0.7, top_k=5, seed=3), [3, 3, 9, 15], (2, 11)),
           (1, SamplingParams(repetition_penalty=1.2, logit_bias={4: 1.5, 8: -2.0}), [1], (2,)),
           (2, SamplingParams(max_new_tokens=9, min_p=0.1, logprobs=2), [], ())]


@needs_triton
def test_slot_state_admits_the_same_tables_on_either_path():
    sts = [SlotState.allocate(5, 3, 4, DEV, vocab=16, kernels=KernelConfig(backend=b))
           for b in ("torch", "triton")]
    for st in sts:
        st.release(4)
        with st.admitting():
            for slot, p, prompt, stop in _ADMITS:
                st.admit(slot, stop_ids=list(stop), prompt=prompt,
                         logit_bias=p.logit_bias,
                         **device_row(p, request_seed=1000 + slot))
    for name, x in sts[0].tables().items():
        assert torch.equal(x, getattr(sts[1], name)), name
    assert sts[1].token_counts[3, 3] == PROMPT_FLAG and sts[1].bias_len[1] == 2
    assert sts[1].done[4] == 1 and all(getattr(sts[1], c.name)[4] == c.neutral for c in COLUMNS)


@pytest.mark.parametrize("prompt", [[1, -2, 99, 3, 40, 50, 60], (1, -2, 99, 3, 40, 50, 60),
                                    [1, -2, 99, 3, 40, 50, 2**70]])
def test_admit_names_the_first_prompt_ids_outside_the_vocab(prompt):
    st = SlotState.allocate(3, 2, 2, "cpu", vocab=16)
    want = [t for t in prompt if not 0 <= t < 16][:4]
    msg = f"prompt: expected token ids in [0, 16), got {want}"
    with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
        st.admit(1, stop_ids=[2], prompt=prompt, **device_row(SamplingParams(), request_seed=1))
    assert st.token_counts.sum() == 0
    st.admit(1, stop_ids=[2], prompt=[0, 15, 15], **device_row(SamplingParams(), request_seed=1))
    assert st.token_counts[1, 15] == PROMPT_FLAG
