"""Tests of capture/: batch-size schedules and CapturedForward.

CPU tests run the real CPU path (graphs unavailable: everything eager) and, with
the ``fake_cuda`` fixture, the capture/run bookkeeping over a stand-in for the
two CUDA-touching steps (warm-up, record). ``gpu`` tests use real CUDA graphs.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from capture import (
    EAGER_ENV,
    CapturedForward,
    GraphPool,
    batch_size_schedule,
    eager_forced,
    graphs_available,
    padded_batch_size,
)
from capture import graphs as graphs_mod

LOGGER = "capture.graphs"
SCHED16 = [1, 2, 4, 8, 16]


@pytest.fixture(autouse=True)
def _no_eager_env(monkeypatch):
    monkeypatch.delenv(EAGER_ENV, raising=False)


# ----------------------------------------------------------------- schedule
@pytest.mark.parametrize(
    ("max_bs", "expected"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (12, [1, 2, 4, 8, 12]),
        (20, [1, 2, 4, 8, 16, 20]),
        (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
        (100, [1, 2, 4, 8, *range(16, 97, 8), 100]),
    ],
)
def test_default_schedule(max_bs, expected):
    assert batch_size_schedule(max_bs) == expected


@pytest.mark.parametrize("max_bs", [0, -1, 2.5, True, "8"])
def test_schedule_rejects_bad_max_bs(max_bs):
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        batch_size_schedule(max_bs)


def test_explicit_sizes_returned_as_list():
    assert batch_size_schedule(8, (1, 3, 5)) == [1, 3, 5]  # max_bs need not be included
    assert batch_size_schedule(8, [8]) == [8]


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ([], "at least one"),
        ([0, 1], "ints >= 1"),
        ([1, 2.0], "ints >= 1"),
        ([True, 2], "ints >= 1"),
        ([2, 1], "strictly ascending"),
        ([1, 1, 2], "strictly ascending"),
        ([1, 16], "<= cuda_graph_max_bs=8"),
    ],
)
def test_explicit_sizes_errors_name_the_argument(sizes, expected):
    with pytest.raises(ValueError, match="cuda_graph_bs") as e:
        batch_size_schedule(8, sizes)
    assert expected in str(e.value)


def test_padded_batch_size_boundaries():
    s = [1, 2, 4, 8, 16, 24]
    got = {bs: padded_batch_size(s, bs) for bs in (1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 25, 1000)}
    assert got == {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 24, 24: 24,
                   25: None, 1000: None}
    assert padded_batch_size([], 1) is None
    for bad in (0, -3):
        with pytest.raises(ValueError):
            padded_batch_size(s, bad)


@given(st.integers(1, 300), st.integers(1, 400))
def test_padded_batch_size_is_smallest_cover(max_bs, bs):
    s = batch_size_schedule(max_bs)
    p = padded_batch_size(s, bs)
    if bs > max_bs:
        assert p is None
    else:
        assert p in s and p >= bs and all(x < bs for x in s if x < p)


# ------------------------------------------------------------ eager_forced
@pytest.mark.parametrize(
    ("value", "forced"),
    [("1", True), ("true", True), ("YES", True), (" True ", True),
     ("0", False), ("false", False), ("", False), ("no", False), ("2", False)],
)
def test_eager_forced_env_values(monkeypatch, value, forced):
    monkeypatch.setenv(EAGER_ENV, value)
    assert eager_forced() is forced
    assert eager_forced(True) is True


def test_eager_forced_read_at_call_time_and_custom_var(monkeypatch):
    assert eager_forced() is False
    monkeypatch.setenv(EAGER_ENV, "1")
    assert eager_forced() is True
    monkeypatch.delenv(EAGER_ENV)
    assert eager_forced() is False
    monkeypatch.setenv("MY_EAGER", "yes")
    assert eager_forced(env_var="MY_EAGER") is True and eager_forced() is False


def test_env_reader_follows_os_environ(monkeypatch):
    read = graphs_mod._env_reader("GD_TEST_VAR")
    monkeypatch.delenv("GD_TEST_VAR", raising=False)
    assert read() == ""
    monkeypatch.setenv("GD_TEST_VAR", "Yes")
    assert read() == "Yes"
    monkeypatch.delenv("GD_TEST_VAR")
    assert read() == ""
    monkeypatch.setattr(graphs_mod.os, "environ", {"GD_TEST_VAR": "1"})  # no `_data`: public path
    assert graphs_mod._env_reader("GD_TEST_VAR")() == "1"


def test_graphs_available_is_decided_once(monkeypatch):
    """torch's answer, read once: a later change (a CUDA context lost, a test patching torch)
    does not flip graph forwards between replay and eager mid-run."""
    first = graphs_available()
    assert first is torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: not first)
    assert graphs_available() is first
    cf = CapturedForward("g", lambda bs: None, [1])
    cf.run(1)
    assert cf.stats.eager["disabled"] == (0 if first else 1)  # built on the first answer


# ------------------------------------------------------------ helpers
def linear_forward(rows: int = 32, dim: int = 8, device: str = "cpu", log: list | None = None):
    """A forward over static buffers: y[:bs] = x[:bs] @ w + 1; returns (forward, x, w, y)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, dim, generator=g).to(device)
    w = torch.randn(dim, dim, generator=g).to(device)
    y = torch.zeros(rows, dim, device=device)

    def forward(bs: int) -> torch.Tensor:
        if log is not None:
            log.append(bs)
        y[:bs] = x[:bs] @ w + 1
        return y[:bs]

    return forward, x, w, y


class FakeGraph:
    """Stands in for a CUDAGraph: replay re-runs the (in-place) forward at its size."""

    def __init__(self, forward, bs):
        self.forward, self.bs = forward, bs

    def replay(self):
        self.forward(self.bs)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Graphs 'available'; warm-up and record replaced by host stand-ins.

    ``state.calls`` logs ("warmup"|"record", bs); forwards may look at
    ``state.capturing`` (True while recording) to simulate capture-time errors.
    """
    state = SimpleNamespace(calls=[], capturing=False)

    def warmup(self, bs, stream):
        state.calls.append(("warmup", bs))
        for _ in range(self.warmup_iters):
            graphs_mod._check_outputs(self.name, bs, self._forward(bs))
        return 2e-3 if self.warmup_iters else None

    def record(self, bs, stream):
        state.calls.append(("record", bs))
        state.capturing = True
        try:
            out = self._forward(bs)
        finally:
            state.capturing = False
        return FakeGraph(self._forward, bs), out, 1024 * bs, 1e-3

    def run_side(self, bs, stream):
        state.calls.append(("precompile", bs))
        graphs_mod._check_outputs(self.name, bs, self._forward(bs))

    monkeypatch.setattr(graphs_mod, "graphs_available", lambda: True)
    monkeypatch.setattr(CapturedForward, "_warmup", warmup)
    monkeypatch.setattr(CapturedForward, "_record", record)
    monkeypatch.setattr(CapturedForward, "_run_side", run_side)
    return state


# ------------------------------------------------- CapturedForward, CPU path
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cpu_capture_is_noop_and_run_is_eager(caplog):
    calls = []
    fwd, x, w, _ = linear_forward(rows=64, log=calls)
    cf = CapturedForward("draft", fwd, SCHED16)
    with caplog.at_level(logging.DEBUG, LOGGER):
        assert cf.capture() == []
    assert calls == [] and cf.captured_sizes == []
    assert "capture skipped" in caplog.text
    for bs in (3, 16, 40):
        out = cf.run(bs)
        assert out.shape[0] == bs and torch.equal(out, x[:bs] @ w + 1)
    assert calls == [3, 16, 40]
    assert cf.stats.eager == {"disabled": 3, "env": 0, "above_max": 0, "not_captured": 0}
    assert cf.stats.total_replays == 0
    s = repr(cf.stats)
    assert s.startswith("draft: 0 graphs") and "eager 3 (disabled=3)" in s
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_sizes_outside_warmup_sizes_skip_the_warmup():
    """`warmup_sizes` (the caller's JIT buckets): a size outside it is captured with no
    eager warm-up run (None seconds), whatever `warmup_iters` says."""
    calls = []
    fwd, *_ = linear_forward(rows=64, log=calls)
    cf = CapturedForward("draft", fwd, SCHED16, warmup_iters=1)
    cf.warmup_sizes = {16}
    assert cf._warmup(8, None) is None and calls == []


def test_constructor_validation():
    f = lambda bs: None
    for bad in ([], [0, 1], [1.5], [True]):
        with pytest.raises(ValueError, match="batch_sizes"):
            CapturedForward("g", f, bad)
    with pytest.raises(ValueError, match="warmup_iters"):
        CapturedForward("g", f, [1], warmup_iters=-1)
    with pytest.raises(ValueError, match="on_oom"):
        CapturedForward("g", f, [1], on_oom="ignore")
    assert CapturedForward("g", f, [8, 2, 2, 1]).batch_sizes == [1, 2, 8]
    # pool=None: a pool of its own (handle made lazily); a given pool is shared as given
    assert CapturedForward("a", f, [1]).pool is not CapturedForward("b", f, [1]).pool
    pool = GraphPool()
    assert CapturedForward("c", f, [1], pool=pool).pool is pool


def test_enabled_false_never_captures(fake_cuda):
    cf = CapturedForward("g", linear_forward()[0], SCHED16, enabled=False)
    assert cf.capture(progress=False) == [] and fake_cuda.calls == []
    cf.run(99)
    assert cf.stats.eager["disabled"] == 1 and cf.stats.eager["above_max"] == 0


# ---------------------------------------- CapturedForward, fake CUDA bookkeeping
def test_capture_largest_first_with_warmup_before_each(fake_cuda):
    cf = CapturedForward("draft", linear_forward()[0], SCHED16)
    assert cf.capture(progress=False) == SCHED16
    expected = [(step, bs) for bs in reversed(SCHED16) for step in ("warmup", "record")]
    assert fake_cuda.calls == expected
    st_ = cf.stats
    assert sorted(st_.capture_seconds) == SCHED16 and st_.dropped == []
    assert st_.pool_bytes == {bs: 1024 * bs for bs in SCHED16}
    assert st_.total_pool_bytes == 1024 * 31 and st_.speedup == pytest.approx(2.0)
    assert repr(st_).startswith("draft: 5 graphs [1..16]") and "~2.0x" in repr(st_)
    # a second capture() has nothing left to do
    fake_cuda.calls.clear()
    assert cf.capture(progress=False) == SCHED16 and fake_cuda.calls == []


def test_run_replays_padded_graph_and_counts(fake_cuda):
    calls = []
    fwd, x, w, y = linear_forward(log=calls)
    cf = CapturedForward("draft", fwd, SCHED16)
    cf.capture(progress=False)
    pads = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8, 7: 8, 8: 8, **dict.fromkeys(range(9, 17), 16)}
    for bs in range(1, 17):
        out = cf.run(bs)
        assert out.shape[0] == pads[bs]  # padded graph's rows
        assert torch.equal(out[:bs], x[:bs] @ w + 1)
    assert cf.stats.replays == {1: 1, 2: 1, 4: 2, 8: 4, 16: 8}
    assert cf.stats.total_eager == 0
    assert cf.run(16) is cf.run(16)  # the same static outputs object every replay


def test_above_max_warns_once_and_counts(fake_cuda, caplog):
    fwd, x, w, _ = linear_forward()
    cf = CapturedForward("draft", fwd, SCHED16)
    cf.capture(progress=False)
    with caplog.at_level(logging.DEBUG, LOGGER):
        for bs in (17, 30, 17):
            assert torch.equal(cf.run(bs), x[:bs] @ w + 1)  # bs rows: eager, not padded
    warns = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 1
    msg = warns[0].getMessage()
    assert "draft" in msg and "17" in msg and "about 2.0x slower" in msg
    assert "raise cuda_graph_max_bs" in msg
    assert cf.stats.eager["above_max"] == 3


def test_env_var_rechecked_at_run(fake_cuda, monkeypatch):
    calls = []
    cf = CapturedForward("draft", linear_forward(log=calls)[0], SCHED16)
    cf.capture(progress=False)
    calls.clear()
    monkeypatch.setenv(EAGER_ENV, "1")
    assert cf.run(3).shape[0] == 3 and calls == [3]
    assert cf.stats.eager["env"] == 1 and cf.stats.total_replays == 0
    monkeypatch.setenv(EAGER_ENV, "0")  # flipped back: replays resume
    assert cf.run(3).shape[0] == 4 and cf.stats.replays[4] == 1


def test_env_var_at_construction_skips_capture_for_life(fake_cuda, monkeypatch):
    monkeypatch.setenv(EAGER_ENV, "true")
    cf = CapturedForward("draft", linear_forward()[0], SCHED16)
    monkeypatch.delenv(EAGER_ENV)
    assert cf.capture(progress=False) == [] and fake_cuda.calls == []
    cf.run(3)
    assert cf.stats.eager["env"] == 1


def test_env_var_at_capture_time_skips_capture(fake_cuda, monkeypatch):
    cf = CapturedForward("draft", linear_forward()[0], SCHED16)
    monkeypatch.setenv(EAGER_ENV, "1")
    assert cf.capture(progress=False) == [] and fake_cuda.calls == []
    monkeypatch.delenv(EAGER_ENV)
    cf.run(3)
    assert cf.stats.eager["not_captured"] == 1


def test_not_captured_when_capture_never_called(fake_cuda):
    cf = CapturedForward("draft", linear_forward()[0], SCHED16)
    cf.run(3)
    cf.run(40)
    assert cf.stats.eager["not_captured"] == 1 and cf.stats.eager["above_max"] == 1


def _oom_forward(fake_cuda, too_big, log=None):
    fwd, x, w, y = linear_forward(log=log)

    def forward(bs):
        if fake_cuda.capturing and too_big(bs):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return fwd(bs)

    return forward, x, w


def test_oom_drops_sizes_and_keeps_going(fake_cuda, caplog):
    fwd, x, w = _oom_forward(fake_cuda, lambda bs: bs > 4)
    cf = CapturedForward("draft", fwd, SCHED16)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert cf.capture(progress=False) == [1, 2, 4]
    assert [bs for step, bs in fake_cuda.calls if step == "record"] == [16, 8, 4, 2, 1]
    assert cf.stats.dropped == [8, 16]
    (warn,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "draft" in warn and "[8, 16]" in warn and "captured [1, 2, 4]" in warn
    for bs in range(1, 18):
        assert torch.equal(cf.run(bs)[:bs], x[:bs] @ w + 1)
    assert cf.stats.eager == {"disabled": 0, "env": 0, "above_max": 1, "not_captured": 12}
    assert cf.stats.replays == {1: 1, 2: 1, 4: 2}


def test_oom_in_middle_pads_to_next_larger(fake_cuda):
    fwd, x, w = _oom_forward(fake_cuda, lambda bs: bs == 8)
    cf = CapturedForward("draft", fwd, SCHED16)
    assert cf.capture(progress=False) == [1, 2, 4, 16]
    assert [cf.run(bs).shape[0] for bs in (5, 8, 9)] == [16, 16, 16]
    assert torch.equal(cf.run(6)[:6], x[:6] @ w + 1)


def test_oom_everywhere_runs_eagerly(fake_cuda, caplog):
    fwd, x, w = _oom_forward(fake_cuda, lambda bs: True)
    cf = CapturedForward("draft", fwd, SCHED16)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert cf.capture(progress=False) == []
    assert "every batch runs eagerly" in caplog.text
    assert torch.equal(cf.run(5), x[:5] @ w + 1) and cf.stats.eager["not_captured"] == 1


def test_capture_again_retries_dropped_sizes(fake_cuda):
    fail = {"on": True}
    fwd, _, _ = _oom_forward(fake_cuda, lambda bs: fail["on"] and bs > 4)
    cf = CapturedForward("draft", fwd, SCHED16)
    cf.capture(progress=False)
    fail["on"] = False
    fake_cuda.calls.clear()
    assert cf.capture(progress=False) == SCHED16
    assert [bs for step, bs in fake_cuda.calls if step == "record"] == [16, 8]
    assert cf.stats.dropped == []


def test_on_oom_raise_and_other_errors_propagate(fake_cuda):
    fwd, _, _ = _oom_forward(fake_cuda, lambda bs: bs > 4)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        CapturedForward("draft", fwd, SCHED16, on_oom="raise").capture(progress=False)

    def broken(bs):
        raise KeyError("bug in forward")

    with pytest.raises(KeyError):
        CapturedForward("draft", broken, SCHED16).capture(progress=False)


def test_output_guard_names_graph_and_bs(fake_cuda):
    y = torch.zeros(16, 4)
    short = CapturedForward("draft.head", lambda bs: {"y": y[: bs - 1]}, [2, 4])
    with pytest.raises(RuntimeError, match=r"'draft.head'.*forward\(4\).*bs=4"):
        short.capture(progress=False)
    assert short.captured_sizes == []
    scalar = CapturedForward("g", lambda bs: (y[:bs], y.sum()), [2], warmup_iters=0)
    with pytest.raises(RuntimeError, match="forward\\(2\\)"):
        scalar.capture(progress=False)  # guard also checks the captured outputs
    ok = CapturedForward("g", lambda bs: None, [2])  # forward writing caller buffers only
    assert ok.capture(progress=False) == [2]


def test_padded_bs_pins_run_choice(fake_cuda):
    fwd, x, w, _ = linear_forward()
    cf = CapturedForward("draft", fwd, SCHED16)
    cf.capture(progress=False)
    assert cf.run(3, padded_bs=4).shape[0] == 4 and cf.stats.replays[4] == 1
    assert cf.run(3, padded_bs=8).shape[0] == 8 and cf.stats.replays[8] == 1
    assert cf.run(3, padded_bs=3).shape[0] == 3 and cf.stats.eager["not_captured"] == 1
    with pytest.raises(ValueError, match="padded_bs"):
        cf.run(5, padded_bs=4)
    with pytest.raises(ValueError):
        cf.run(0)


def test_restrict_to_multi_rank_hook(fake_cuda):
    cf = CapturedForward("draft", linear_forward()[0], SCHED16)
    cf.capture(progress=False)
    assert cf.restrict_to([1, 2, 4, 16, 99]) == [1, 2, 4, 16]
    assert 8 not in cf.stats.pool_bytes
    fake_cuda.calls.clear()
    assert cf.capture(progress=False) == [1, 2, 4, 16] and fake_cuda.calls == []  # no recapture
    assert cf.run(5).shape[0] == 16 and cf.stats.replays[16] == 1  # 8 is gone: pads to 16
    assert cf.restrict_to([]) == []
    assert cf.run(5).shape[0] == 5
    cf.run(17)
    assert cf.stats.eager["not_captured"] == 1 and cf.stats.eager["above_max"] == 1


def test_progress_bar_or_info_lines(fake_cuda, monkeypatch, caplog):
    cf = CapturedForward("draft", linear_forward()[0], [1, 2])
    assert cf.capture(progress=True) == [1, 2]  # tqdm bar
    monkeypatch.setattr(graphs_mod, "tqdm", None)  # no tqdm: an INFO line per size
    cf = CapturedForward("draft", linear_forward()[0], [1, 2])
    with caplog.at_level(logging.INFO, LOGGER):
        cf.capture(progress=True)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert [m.split(" in ")[0] for m in lines[:2]] == ["draft: captured bs=2", "draft: captured bs=1"]
    assert lines[2].startswith("draft: 2 graphs [1..2]")  # the closing summary


# --------------------------------------------------------------------- GPU
def mlp_forward(rows: int = 16, dim: int = 64, log: list | None = None):
    """Static-buffer forward with an intermediate output allocated inside the graph."""
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(rows, dim, device=dev)
    w1 = torch.randn(dim, dim, device=dev) / dim**0.5
    w2 = torch.randn(dim, dim, device=dev) / dim**0.5
    y = torch.zeros(rows, dim, device=dev)

    def forward(bs: int) -> dict[str, torch.Tensor]:
        if log is not None:
            log.append((bs, torch.cuda.is_current_stream_capturing(), torch.cuda.current_stream()))
        h = torch.relu(x[:bs] @ w1 + 1)
        y[:bs] = torch.softmax(h @ w2, dim=-1) * 2 - h.tanh()
        return {"y": y[:bs], "h": h}

    return forward, x


def _clone(out):
    return {k: v.clone() for k, v in out.items()}


@pytest.mark.gpu
def test_gpu_replay_matches_eager_bit_for_bit():
    fwd, x = mlp_forward()
    cf = CapturedForward("mlp", fwd, SCHED16, pool=GraphPool())
    assert cf.capture(progress=False) == SCHED16
    for bs in range(1, 17):
        p = padded_batch_size(SCHED16, bs)
        x.normal_()
        got = _clone(cf.run(bs))
        assert got["y"].shape[0] == p and got["h"].shape[0] == p  # the padded graph's rows
        ref = _clone(fwd(p))  # eager at the same (padded) size: identical kernels
        for k in ("y", "h"):
            assert torch.equal(got[k], ref[k]), (bs, k)
            torch.testing.assert_close(got[k][:bs], _clone(fwd(bs))[k])
    assert cf.stats.replays == {1: 1, 2: 1, 4: 2, 8: 4, 16: 8}
    assert cf.stats.total_eager == 0
    assert cf.stats.pool_bytes[16] > 0 and cf.stats.speedup is not None
    assert "mlp: 5 graphs [1..16]" in repr(cf.stats)


@pytest.mark.gpu
def test_gpu_capture_order_largest_first_warmup_on_side_stream():
    log = []
    fwd, _ = mlp_forward(log=log)
    pool = GraphPool()
    cf = CapturedForward("mlp", fwd, SCHED16, pool=pool, warmup_iters=2)
    cf.capture(progress=False)
    captured = [bs for bs, capturing, _ in log if capturing]
    assert captured == [16, 8, 4, 2, 1]
    warm = [(bs, s) for bs, capturing, s in log if not capturing]
    assert [bs for bs, _ in warm] == [b for b in (16, 8, 4, 2, 1) for _ in range(2)]
    assert all(s == pool.stream for _, s in warm) and pool.stream != torch.cuda.default_stream()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


@pytest.mark.gpu
def test_gpu_shared_pool_two_sets_do_not_clobber():
    pool = GraphPool()
    fa, xa = mlp_forward()
    fb, xb = mlp_forward()
    a = CapturedForward("a", fa, SCHED16, pool=pool)
    b = CapturedForward("b", fb, [1, 2, 4, 8], pool=pool)
    a.capture(progress=False)
    b.capture(progress=False)
    assert a.pool is b.pool is pool
    xa.normal_()
    xb.normal_()
    out_a = a.run(8)
    want_a = _clone(out_a)
    out_b = b.run(8)  # b's replay reuses pool memory freed by a's capture, never a's outputs
    torch.cuda.synchronize()
    for k in ("y", "h"):
        assert torch.equal(out_a[k], want_a[k])
        assert torch.equal(out_b[k], _clone(fb(8))[k])


@pytest.mark.gpu
def test_gpu_many_replays_no_memory_growth():
    fwd, x = mlp_forward()
    cf = CapturedForward("mlp", fwd, SCHED16, pool=GraphPool())
    cf.capture(progress=False)
    cf.run(5)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for i in range(1000):
        x.normal_()
        cf.run(i % 16 + 1)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert cf.stats.total_replays == 1001
    got = _clone(cf.run(16))
    assert torch.equal(got["y"], _clone(fwd(16))["y"])


@pytest.mark.gpu
def test_gpu_env_var_forces_eager_at_run(monkeypatch):
    fwd, x = mlp_forward()
    cf = CapturedForward("mlp", fwd, SCHED16, pool=GraphPool())
    cf.capture(progress=False)
    static = cf.run(3)
    monkeypatch.setenv(EAGER_ENV, "1")
    out = cf.run(3)
    assert out is not static and out["h"].shape[0] == 3
    assert cf.stats.eager["env"] == 1
    monkeypatch.delenv(EAGER_ENV)
    assert cf.run(3) is static and cf.stats.replays[4] == 2


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
@pytest.mark.parametrize("how", ["raise", "allocate"])
def test_gpu_oom_during_capture_drops_sizes(caplog, how):
    fwd, x = mlp_forward()

    def forward(bs):
        if bs > 4 and torch.cuda.is_current_stream_capturing():
            if how == "raise":
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
            torch.empty(1 << 42, dtype=torch.uint8, device="cuda")  # 4 TiB: a real OOM
        return fwd(bs)

    cf = CapturedForward("mlp", forward, SCHED16, pool=GraphPool())
    with caplog.at_level(logging.WARNING, LOGGER):
        assert cf.capture(progress=False) == [1, 2, 4]
    assert "[8, 16]" in caplog.text and cf.stats.dropped == [8, 16]
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    for bs in range(1, 17):
        x.normal_()
        got = _clone(cf.run(bs))
        ref = _clone(fwd(padded_batch_size(cf.captured_sizes, bs) or bs))
        assert torch.equal(got["y"][:bs], ref["y"][:bs]), bs
    assert cf.stats.eager["not_captured"] == 12 and cf.stats.total_replays == 4


@pytest.mark.gpu
def test_gpu_output_guard():
    fwd, _ = mlp_forward()
    cf = CapturedForward("mlp", lambda bs: fwd(bs)["y"][: bs // 2], SCHED16, pool=GraphPool())
    with pytest.raises(RuntimeError, match=r"'mlp'.*forward\(16\)"):
        cf.capture(progress=False)
    assert cf.captured_sizes == []
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


@pytest.mark.gpu
def test_graph_survives_torch_compile_reduce_overhead():
    """torch.compile(mode="reduce-overhead") frees cuBLAS's cached workspace before recording;
    graphs captured earlier must not point at it (seen on the H200: illegal memory access)."""
    from capture import CapturedForward, GraphPool

    x = torch.randn(64, 256, device="cuda")
    w = torch.randn(256, 256, device="cuda")
    y = torch.empty(64, 256, device="cuda")

    def fwd(bs):
        torch.matmul(x[:bs], w, out=y[:bs])
        return y[:bs]

    f = CapturedForward("mm", fwd, [8, 64], pool=GraphPool(), enabled=True)
    f.capture(progress=False)
    ref = (x @ w).clone()
    compiled = torch.compile(lambda a, b: a @ b, mode="reduce-overhead")
    for _ in range(3):
        compiled(x, w)
    torch.cuda.empty_cache()
    out = f.run(64)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.gpu
def test_gpu_dropped_graphs_are_not_collected_mid_capture():
    """A dropped CapturedForward whose forward is a bound method of its owner (an object
    cycle) is freed only by the cyclic GC. Capturing another set must not let that GC run
    mid-capture (freeing the old graphs' pool then invalidates the capture); it runs after."""
    import gc
    import weakref

    class Owner:  # the drafter's shape: owner -> CapturedForward -> bound method -> owner
        def __init__(self):
            self.fwd, _ = mlp_forward()
            self.graphs = CapturedForward("old", self.forward, [1, 2], pool=GraphPool())

        def forward(self, bs):
            return self.fwd(bs)

    old = Owner()
    old.graphs.capture(progress=False)
    gone = weakref.ref(old)
    box = [old]
    del old
    collected_while_capturing = []

    def watch(phase, info):
        if phase == "start":
            collected_while_capturing.append(torch.cuda.is_current_stream_capturing())

    fwd, x = mlp_forward()

    def forward(bs):
        if box and torch.cuda.is_current_stream_capturing():
            box.clear()  # the old set becomes cyclic garbage while a capture runs
            _ = [[i] for i in range(5000)]  # allocations that would start a collection
        return fwd(bs)

    new = CapturedForward("new", forward, [1, 2], pool=GraphPool())
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(watch)
    try:
        assert new.capture(progress=False) == [1, 2]
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*thresholds)
    assert not any(collected_while_capturing) and gc.isenabled()
    gc.collect()
    assert gone() is None
    x.normal_()
    got = _clone(new.run(2))
    assert torch.equal(got["y"], _clone(fwd(2))["y"])


# ------------------------------------------------------------ compile counts
class BucketJit:
    """A stand-in JIT: a forward at bs 'compiles' once per new bucket (next power of two)."""

    def __init__(self):
        self.count = 0
        self.seen: set[int] = set()

    def wrap(self, forward):
        def f(bs):
            b = 1 << (bs - 1).bit_length()
            if b not in self.seen:
                self.seen.add(b)
                self.count += 1
            return forward(bs)
        return f


def test_compiles_per_size_in_stats_and_summary(fake_cuda):
    jit = BucketJit()
    cf = CapturedForward("draft", jit.wrap(linear_forward()[0]), [1, 2, 3, 4, 6, 8],
                         compile_counter=lambda: jit.count)
    cf.capture(progress=False)
    # largest first: 8 compiles bucket 8, 6 nothing (same bucket), 4, 3 nothing, 2, 1
    assert dict(cf.stats.compiles) == {8: 1, 6: 0, 4: 1, 3: 0, 2: 1, 1: 1}
    assert cf.stats.total_compiles == 4
    assert " compiles 4" in cf.stats.summary()


def test_precompile_runs_given_sizes_then_capture_compiles_nothing(fake_cuda):
    jit = BucketJit()
    cf = CapturedForward("draft", jit.wrap(linear_forward()[0]), [1, 2, 3, 4, 6, 8],
                         compile_counter=lambda: jit.count)
    assert cf.precompile([2, 8, 4, 1], progress=False) == 4
    assert [c for c in fake_cuda.calls if c[0] == "precompile"] == [
        ("precompile", 8), ("precompile", 4), ("precompile", 2), ("precompile", 1)]
    assert sorted(cf.stats.precompile_seconds) == [1, 2, 4, 8]
    cf.capture(progress=False)
    assert cf.stats.total_compiles == 4
    assert all(cf.stats.compiles[bs] == 0 for bs in (3, 6))
    assert "precompile)" in cf.stats.summary()
    with pytest.raises(ValueError, match="scheduled sizes"):
        cf.precompile([5])
    with pytest.raises(ValueError, match="compile_counter"):
        CapturedForward("g", lambda bs: None, [1], compile_counter=3)


def test_precompile_noop_when_disabled(fake_cuda):
    cf = CapturedForward("g", linear_forward()[0], [1, 2], enabled=False)
    assert cf.precompile([1, 2], progress=False) == 0 and fake_cuda.calls == []


def test_default_counter_is_tritons():
    from capture import compiles

    cf = CapturedForward("g", lambda bs: None, [1])
    assert cf._compiles is compiles.thread_compiles
    assert isinstance(compiles.triton_compiles(), int)
    # the hook counts globally and per thread, and chains to a hook installed before it
    before, mine = compiles.triton_compiles(), compiles.thread_compiles()
    compiles._on_compile(key="k")
    assert compiles.triton_compiles() == before + 1 and compiles.thread_compiles() == mine + 1
    assert compiles.install_triton_counter() is compiles.install_triton_counter()


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    from capture import compiles

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert compiles.cache_dir() == tmp_path
    assert compiles.cache_entries() == 0
    (tmp_path / "abc").mkdir()
    (tmp_path / "abc" / "k.cubin").write_bytes(b"")
    (tmp_path / "stray.txt").write_text("")
    assert compiles.cache_entries() == 1
    assert compiles.cache_entries(tmp_path / "missing") == 0


# ------------------------------------------------------------ perf.capture's report
def test_perf_capture_report_keys(monkeypatch, tmp_path, capsys):
    """The parent's assembly of capture.json from its runs (the subprocess runner replaced:
    the child needs CUDA): the issue's keys from the first schedule top's cold run with
    workers (kernels built anywhere: here and in the workers) and its warm run, the in-process
    cold run beside them, every run kept, a failed in-process run recorded without failing
    the benchmark."""
    import json

    from perf import capture as perf_capture

    calls = []

    def fake_spawn(max_bs, cache, result, timeout_s, workers=None):
        assert cache.is_dir() and cache.parent == result.parent
        marker = cache / "graphdraft-precompiled-x.json"
        listed = marker.exists() and "warmup" in json.loads(marker.read_text())
        calls.append((max_bs, cache.name, workers, result.stem, listed))
        warm = any(cache.iterdir())
        (cache / f"k{max_bs}").mkdir(exist_ok=True)
        if workers != 0 and not warm:  # the cold run's marker, with its warm-up list
            marker.write_text(json.dumps({"tasks": 2, "warmup": [["engine", "g", max_bs]]}))
        fw = {"draft_decode": {"attribute": "decode_graphs", "sizes": [1, 2], "capture_s": 0.5,
                               "compiles": 3, "built": 0 if warm else 1,
                               "worker_built": 0 if warm else 2, "pool_mib": 4.0,
                               "summary": "s"}}
        here, there = (0, 0) if warm else ((3, 0) if workers == 0 else (1, 2))
        repeat = {"r2": 2.0, "r3": 0.5}.get(result.stem.rsplit("-", 1)[-1], 1.0)
        return {"max_bs": max_bs,
                "capture_s": repeat if warm else (9.0 if workers == 0 else 4.0),
                "workers": 0 if warm or workers == 0 else 2, "worker_phase_s": 0 if warm else 2.5,
                "worker_wall_s": [] if warm else [2.0, 2.1], "precompile_s": None,
                "triton_compiles": 3, "built_here": here, "built_in_workers": there,
                "triton_compiles_total": here + there, "cache_entries_new": 0 if warm else 3,
                "sizes": [1, 2], "pool_mib": 4.0, "per_forward": fw,
                "census_keys": 0 if warm or workers == 0 else 7,
                "plan_events": [] if warm else [["server", 0.01, 0], ["header", 0.3, 0],
                                                ["emit", 0.6, 5], ["emit", 0.9, 2],
                                                ["end", 1.0, 7]],
                "worker_ready_s": [] if warm else [0.31, 0.32],
                "timeline": [] if warm else [["extend_attention._extend_split_kernel", 0.6, 2.5],
                                             ["gemv._gemv_kernel", 0.7, 1.0, 0.25]],
                "gate_waits": [] if warm else [[0, ["engine", "g", 64], 1.1, 1.5]],
                "compile_s_sum": 0.0 if warm else 3.5, "launcher_s_sum": 0.0 if warm else 0.25,
                "breakdown": {"precompile_s": 0.0 if warm else 3.0, "worker_phase_s": 0.0,
                              "capture_s": 0.6, "capture_warmup_s": 0.2,
                              "capture_record_s": 0.3, "capture_replay_timing_s": 0.1,
                              "cost_table_s": 0.3, "other_s": 0.1, "graphs": 2,
                              "warmup_runs": 2, "cost_cells": 2, "cost_replays": 6}}

    monkeypatch.setattr(perf_capture, "_spawn", fake_spawn)
    assert perf_capture.main(["--out", str(tmp_path), "--max-bs", "64,160"]) == 0
    data = json.loads((tmp_path / "capture.json").read_text())
    # warm_s: the median of the 3 warm runs (1.0, 2.0, 0.5), not their mean
    assert (data["cold_s"], data["warm_s"], data["triton_compiles_cold"]) == (4.0, 1.0, 3)
    assert data["warm_s_runs"] == [1.0, 2.0, 0.5] == data["warm_every_bucket_s_runs"]
    host = data["host"]
    assert host["cpu_count"] >= 1 and host["python_loop_s"] > 0 and isinstance(host["cpu_model"], str)
    assert (data["triton_compiles_cold_here"], data["triton_compiles_cold_workers"]) == (1, 2)
    assert (data["cold_inprocess_s"], data["triton_compiles_cold_inprocess"]) == (9.0, 3)
    assert data["workers"] == 2 and data["worker_wall_s"] == [2.0, 2.1]
    assert data["sizes"] == [1, 2] and data["pool_mib"] == 4.0
    assert data["per_forward"]["draft_decode"]["worker_built"] == 2
    assert data["census_keys"] == 7 and data["census_keys_loaded_warm"] == 3
    assert data["warm_breakdown"]["precompile_s"] == 0.0
    assert (data["compile_s_sum"], data["launcher_s_sum"]) == (3.5, 0.25)
    assert data["timeline"] == [["extend_attention._extend_split_kernel", 0.6, 2.5],
                                ["gemv._gemv_kernel", 0.7, 1.0, 0.25]]
    text = perf_capture.timeline_lines(data)
    assert "first emit 0.60, 2 emits, plan end 1.00" in text and "workers ready 0.31-0.32" in text
    assert "  0.60 ->   3.10  extend_attention._extend_split_kernel\n" in text
    assert "  0.70 ->   1.70  gemv._gemv_kernel (launcher 0.25)" in text
    assert "compiles: 3.50 s in all (every process), of it the host launchers' C builds 0.25 s" in text
    assert "gate 0 engine/g/64: 1.10 + 1.50" in text
    assert data["cold_breakdown"]["precompile_s"] == 3.0
    assert list(data["runs"]) == ["cold-64-inprocess", "cold-64", "warm-64",
                                  "warm-64-every-bucket", "warm-64-r2",
                                  "warm-64-every-bucket-r2", "warm-64-r3",
                                  "warm-64-every-bucket-r3", "cold-160", "warm-160",
                                  "warm-160-r2", "warm-160-r3"]
    # the in-process cold run has its own empty cache; cold and warm share one
    assert calls[0][:3] == (64, "triton-cache-64-inprocess", 0)
    assert calls[1][1] == calls[2][1] == "triton-cache-64" and calls[1][2] is None
    # the A/B warm run sees the marker without its warm-up list, which is restored after
    assert [c[3:] for c in calls[2:4]] == [("warm-64", True), ("warm-64-every-bucket", False)]
    assert [c[3:] for c in calls[4:6]] == [("warm-64-r2", True), ("warm-64-every-bucket-r2", False)]
    assert calls[9][3:] == ("warm-160", True) and data["warm_every_bucket_s"] == 1.0
    out = capsys.readouterr().out
    assert "cold-64-inprocess" in out and "warm-160" in out and "cost replays" in out
    def solo_fails(max_bs, cache, result, timeout_s, workers=None):
        if workers == 0:
            raise RuntimeError("boom")
        return fake_spawn(max_bs, cache, result, timeout_s, workers)

    monkeypatch.setattr(perf_capture, "_spawn", solo_fails)
    assert perf_capture.main(["--out", str(tmp_path), "--max-bs", "64"]) == 0
    data = json.loads((tmp_path / "capture.json").read_text())
    assert "boom" in data["runs"]["cold-64-inprocess"]["error"] and data["cold_inprocess_s"] is None
    with pytest.raises(SystemExit):
        perf_capture.main(["--out", str(tmp_path), "--max-bs", "0"])
    with pytest.raises(SystemExit):
        perf_capture.main(["--out", str(tmp_path), "--warm-repeats", "0"])
