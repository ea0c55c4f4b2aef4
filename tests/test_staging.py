"""Host -> device staging without a host sync (`graphdraft.runtime.staging.HostStaging`), the
slot tables' batched admission / release written through it, and the hot path's freedom from
syncing scalar writes (`t[i] = 0` on a CUDA tensor copies from pageable memory and waits)."""

from __future__ import annotations

import pytest
import torch

from graphdraft.runtime.slot_state import SlotState, StopTableFullError
from graphdraft.runtime.staging import HostStaging
from graphdraft.sampling import COLUMNS, SamplingParams, device_row

CUDA = torch.cuda.is_available()


def test_tensor_pack_and_copy_into_hold_the_values_in_their_dtypes():
    st = HostStaging("cpu")
    assert st.tensor([3, -1, 7]).tolist() == [3, -1, 7]
    a, b, c = st.pack(([1, 2], torch.int64), ([0.5, -2.25], torch.float32), ((), torch.int32))
    assert a.dtype == torch.int64 and b.dtype == torch.float32 and c.dtype == torch.int32
    assert a.tolist() == [1, 2] and b.tolist() == [0.5, -2.25] and c.numel() == 0
    dst = torch.full((5,), 9, dtype=torch.int32)
    st.copy_into(dst, [4, 5])
    assert dst.tolist() == [4, 5, 9, 9, 9]
    with pytest.raises(ValueError, match="^dtype: expected"):
        st.tensor([1], torch.bool)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="^segments / capacity"):
        HostStaging("cpu", capacity=64, segments=1)


def _admit(st: SlotState, slot: int, params: SamplingParams, prompt=(), stop=(2,)) -> None:
    st.admit(slot, stop_ids=list(stop), prompt=list(prompt), logit_bias=params.logit_bias,
             **device_row(params, request_seed=slot * 1000 + 7))


_ROWS = [(1, SamplingParams(temperature=0.7, top_k=5, seed=3), [3, 3, 9], (2, 11)),
         (3, SamplingParams(repetition_penalty=1.2, logit_bias={4: 1.5, 8: -2.0}), [1], (2,)),
         (2, SamplingParams(max_new_tokens=9, min_p=0.1, logprobs=2), [], ())]


def test_admitting_writes_the_same_tables_as_one_admit_at_a_time():
    one, many = (SlotState.allocate(5, 3, 4, "cpu", vocab=16) for _ in range(2))
    for slot, p, prompt, stop in _ROWS:
        _admit(one, slot, p, prompt, stop)
    with many.admitting():
        for slot, p, prompt, stop in _ROWS:
            _admit(many, slot, p, prompt, stop)
        assert many.seed[1] == 0  # not written before the block ends
    for name, t in one.tables().items():
        assert torch.equal(t, getattr(many, name)), name
    with one.releasing():
        one.release(1)
        one.release(3)
    many.release(1)
    many.release(3)
    for name, t in one.tables().items():
        assert torch.equal(t, getattr(many, name)), name
    assert one.done[1] == 1 and one.bias_len[3] == 0 and one.done[2] == 0
    assert all(getattr(one, c.name)[1] == c.neutral for c in COLUMNS)


def test_admitting_writes_the_rows_before_a_failing_admit_and_nothing_of_it():
    st = SlotState.allocate(4, 2, 2, "cpu", vocab=16)
    with pytest.raises(StopTableFullError), st.admitting():
        _admit(st, 1, SamplingParams(seed=5), [1, 2])
        _admit(st, 2, SamplingParams(seed=6), [3], stop=(1, 2, 3))
    assert st.seed[1] == 1007 and st.seed[2] == 0 and st.token_counts[2].sum() == 0


def test_a_slot_admitted_twice_in_one_block_keeps_its_last_row():
    st = SlotState.allocate(4, 2, 2, "cpu", vocab=16)
    with st.admitting():
        _admit(st, 1, SamplingParams(temperature=0.5), [1])
        st.release(1)
        _admit(st, 1, SamplingParams(temperature=0.9), [2])
    assert st.temperature[1] == pytest.approx(0.9) and st.done[1] == 0
    assert st.token_counts[1, 1] == 0 and st.token_counts[1, 2] != 0


def test_engine_steps_write_no_scalar_into_a_device_tensor(monkeypatch):
    """Every `tensor[i] = number` on a 0-dim selection copies a pageable scalar (a stream
    sync on CUDA): none in admission, mixed / decode steps or retirement."""
    from graphdraft.serving.engine import Engine
    from tests.engine_harness import make_models, runtime

    target, head = make_models()
    engine = Engine(target, runtime(), head)
    seen = []
    orig = torch.Tensor.__setitem__

    def setitem(self, idx, value):
        if isinstance(value, (int, float, bool)) and self[idx].dim() == 0:
            seen.append(idx)
        return orig(self, idx, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", setitem)
    engine.generate([[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(max_new_tokens=4))
    assert seen == []


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_ring_pack_places_empty_pieces_anywhere_in_the_list():
    """Empty pieces first, between and last (an empty view's data_ptr() is 0): every piece
    keeps its values and dtype, through the ring's one copy."""
    st = HostStaging("cuda")
    for pieces in ([((), torch.int64), ([1, 2, 3], torch.int32), ((), torch.float32)],
                   [([5], torch.int64), ((), torch.int32), ([0.5, 1.5], torch.float32)]):
        got = st.pack(*pieces)
        assert [g.dtype for g in got] == [dt for _, dt in pieces]
        assert [g.tolist() for g in got] == [list(v) for v, _ in pieces]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_ring_reuse_waits_for_the_copies_still_queued():
    """Many staged copies queued behind a long kernel: every one lands with its own values
    (a region is rewritten only after its copies ran)."""
    st = HostStaging("cuda", capacity=4096, segments=4)
    outs = []
    torch.cuda._sleep(50_000_000)
    for i in range(200):
        outs.append(st.tensor(list(range(i, i + 40))))
    torch.cuda.synchronize()
    for i, o in enumerate(outs):
        assert o.tolist() == list(range(i, i + 40))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_admission_mixed_launch_and_release_issue_no_host_sync():
    """Under torch's sync debug mode "error": admitting two requests, launching their
    prefill / mixed step beside a decoding one, and releasing slots raise nothing (no
    cudaStreamSynchronize, no pageable copy, no device value read on the host)."""
    from graphdraft.serving.engine import Engine
    from tests.engine_harness import make_models, runtime

    target, head = make_models(2, dtype=torch.float32, device="cuda")
    engine = Engine(target, runtime(device="cuda", dtype="float32"), head, seed=3)
    engine.capture_graphs(progress=False)
    params = SamplingParams(max_new_tokens=12)
    engine.generate([[1, 2, 3, 4], [5, 6, 7]], params)  # kernels compiled, pools warm
    engine.add_request([9, 8, 7, 6, 5], params)
    engine.step()  # its prefill
    engine.step()  # it decodes
    for p in ([3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]):
        engine.add_request(p, params)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan, work = engine.planner.agree(engine, engine.plan_step())
        assert plan.mixed and work.dreqs
        engine.launch(work, plan)
        free = sorted(set(range(1, 7)) - {r.slot for r in engine.running})
        with engine.slots.releasing():  # slots no request holds (rows already neutral)
            engine.slots.release(free[0])
            engine.slots.release(free[1])
        engine.slots.release(free[2])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    engine.drain()
