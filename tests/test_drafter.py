"""The drafter equals a slow per-request reference; bad input raises and changes nothing."""

from __future__ import annotations

import pytest
import torch

from graphdraft.runtime.batch import ForwardContext
from graphdraft.runtime.buffers import InputBuffers, RuntimeStates
from graphdraft.runtime.drafter import EagleDrafter
from tests.drafter_harness import FakeServingLoop, make_setup
from tests.reference_eagle import ReferenceEagle3


def check_against_reference(ref, s, rows, ctx, hidden, out_tokens, accept, next_tokens, vcl):
    n, steps = s.cfg.spec_num_tokens, s.cfg.speculative_num_steps
    ne = ctx.num_extends
    tok = 0
    hidden = hidden.cpu()
    for i, row in enumerate(rows):
        length = len(row.input_ids)
        hid = hidden[tok: tok + length]
        positions = list(range(row.start, row.end))
        got = [int(t) for t in next_tokens[i]]
        if row.is_prefill:
            ids = list(row.next_ids)
            if ids[-1] < 0:
                ids[-1] = int(out_tokens[i])
            gather, kv_len, write_start = length - 1, row.end, row.end
        else:
            base = ne + (i - ne) * n
            ids = [int(t) for t in out_tokens[base: base + n]]
            a = int(accept[i])
            gather = max(1, min(a, n)) - 1
            kv_len = row.start + gather + 1
            write_start = int(vcl[row.slot]) + a
        run_steps = 1 if ctx.all_extends_mid_chunk else steps
        ref.draft_row(row.slot, positions, ids, hid, gather, kv_len, write_start, run_steps, got,
                      f"row {i} (slot {row.slot}, {'prefill' if row.is_prefill else 'decode'})")
        tok += length


def drive(s, seed, iters, prompts, accept_choices=None, join_at=None):
    loop, ref = FakeServingLoop(s, seed), ReferenceEagle3(s.head)
    for plen, chunk in prompts:
        loop.add(plen, chunk)
    for it in range(iters):
        if join_at and it in join_at:
            loop.add(*join_at[it])
        result = loop.step(accept_choices)
        rows, ctx, hidden, out_tokens, accept, next_tokens, vcl = result
        assert next_tokens.shape == (ctx.bs, s.cfg.speculative_num_steps + 1)
        assert next_tokens.dtype == torch.int32
        check_against_reference(ref, s, rows, ctx, hidden, out_tokens, accept, next_tokens, vcl)
    return loop


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hot", [False, True])
def test_matches_reference_extend_mixed_decode(steps, page_size, hot):
    s = make_setup(steps=steps, page_size=page_size, hot=hot, seed=steps * 7 + page_size)
    # two requests prefill in one chunk, one in three chunks: extend, mixed and decode batches
    drive(s, seed=steps + page_size, iters=6, prompts=[(5, 16), (9, 16), (20, 7)],
          join_at={3: (6, 4)})


def test_accept_length_zero_is_safe():
    s = make_setup(steps=3, page_size=16, seed=3)
    drive(s, seed=5, iters=4, prompts=[(4, 16), (6, 16)], accept_choices=[0, 1, 4])


def test_all_mid_chunk_skips_multi_step():
    s = make_setup(steps=3, page_size=16, seed=4)
    loop = FakeServingLoop(s, 1)
    loop.add(30, 8)
    rows, ctx, *_, next_tokens, _ = loop.step()
    assert ctx.all_extends_mid_chunk
    assert s.drafter.stats.skipped_multi_step == 1
    assert (next_tokens[:, 2:] == next_tokens[:, :1]).all()


def test_rejected_tail_kv_never_read():
    """Poison every KV slot past each request's committed prefix: drafts do not change."""
    outs = []
    for poison in (False, True):
        s = make_setup(steps=3, page_size=4, seed=11)
        loop = FakeServingLoop(s, 2)
        loop.add(7, 16)
        loop.add(5, 16)
        for it in range(4):
            if poison and it > 0:
                k, v = s.drafter.kv_pool.layer(0)
                for r in loop.reqs:
                    for p, page in enumerate(s.pages.pages_of(r.slot)):
                        for off in range(s.cfg.page_size):
                            if p * s.cfg.page_size + off >= r.committed:
                                slot = page * s.cfg.page_size + off
                                k[slot] = float("nan")
                                v[slot] = float("nan")
            out = loop.step()[5]
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_output_is_a_copy():
    """`run`'s default result is a tensor of its own: the runs after it rewrite the drafter's
    `next_tokens` buffer, the kept result keeps its values."""
    s = make_setup(steps=2, seed=6)
    loop = FakeServingLoop(s, 3)
    loop.add(5, 16)
    loop.step()  # prefill
    kept = loop.step()[5]  # a decode result, kept without cloning
    values = kept.clone()
    loop.step()
    loop.step()
    assert not torch.equal(s.drafter.bufs.next_tokens[: kept.shape[0]], values)  # rewritten
    assert torch.equal(kept, values)
    assert kept.untyped_storage().data_ptr() != s.drafter.bufs.next_tokens.untyped_storage().data_ptr()


@pytest.mark.parametrize("decode", [False, True])
def test_output_view_without_copy(decode):
    """`copy_output=False` returns the persistent `next_tokens[:bs]` itself, with the values
    the copying call returns; a non-bool is refused before anything is written."""
    s = make_setup(steps=3, seed=6)
    loop = FakeServingLoop(s, 4)
    for _ in range(3):
        loop.add(5, 16)
    if decode:
        loop.step()  # prefill: the next call is a decode batch
    rows, order, ctx, hidden, tokens, accept = loop.prepare()
    assert (ctx.num_extends == 0) == decode
    k, v = s.drafter.kv_pool.layer(0)
    kv0 = (k.clone(), v.clone())
    copied = s.drafter.run(ctx, hidden, tokens, accept)
    k.copy_(kv0[0])
    v.copy_(kv0[1])
    view = s.drafter.run(ctx, hidden, tokens, accept, copy_output=False)
    assert view.data_ptr() == s.drafter.bufs.next_tokens.data_ptr()
    assert view.shape == copied.shape and torch.equal(view, copied)
    before = s.drafter.bufs.next_tokens.clone()
    calls = s.drafter.stats.calls
    with pytest.raises(ValueError, match="^copy_output: expected a bool, got int"):
        s.drafter.run(ctx, hidden, tokens, accept, copy_output=0)
    assert torch.equal(before, s.drafter.bufs.next_tokens) and s.drafter.stats.calls == calls


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_hidden_written_into_the_drafter_buffer(kernel_backend):
    """A target that writes its hidden states into `decode_hidden_buffer(bs)` and passes that
    view drafts exactly what a separate hidden tensor drafts (bs 3 padded to 4)."""
    s = make_setup(steps=3, seed=8, kernel_backend=kernel_backend)
    loop = FakeServingLoop(s, 8)
    for _ in range(3):
        loop.add(6, 16)
    loop.step()  # prefill
    rows, order, ctx, hidden, tokens, accept = loop.prepare()
    assert ctx.num_extends == 0 and ctx.bs == 3
    k, v = s.drafter.kv_pool.layer(0)
    kv0 = (k.clone(), v.clone())
    separate = s.drafter.run(ctx, hidden, tokens, accept)
    kv_separate = (k.clone(), v.clone())
    k.copy_(kv0[0])
    v.copy_(kv0[1])
    view = s.drafter.decode_hidden_buffer(ctx.bs)
    assert view.shape == hidden.shape and view.data_ptr() == s.drafter.bufs.first_hidden.data_ptr()
    view.copy_(hidden)
    in_place = s.drafter.run(ctx, view, tokens, accept)
    assert torch.equal(separate, in_place)
    assert torch.equal(kv_separate[0], k) and torch.equal(kv_separate[1], v)
    with pytest.raises(ValueError, match="bs: expected 0..8"):
        s.drafter.decode_hidden_buffer(9)


# --- bad input ---------------------------------------------------------------------------
def _decode_call(s):
    loop = FakeServingLoop(s, 9)
    loop.add(5, 16)
    loop.add(6, 16)
    loop.step()  # prefill
    return loop


@pytest.mark.parametrize("case,arg", [
    ("accept_too_long", "accept_lengths"),
    ("accept_negative", "accept_lengths"),
    ("token_out_of_vocab", "output_tokens"),
    ("tokens_wrong_shape", "output_tokens"),
    ("tokens_float", "output_tokens"),
    ("hidden_wrong_width", "hidden_states"),
    ("hidden_wrong_dtype", "hidden_states"),
    ("bs_too_large", "ctx.bs"),
])
def test_bad_input_raises_and_changes_nothing(case, arg):
    """validation="sync": the call raises at once and writes nothing."""
    s = make_setup(steps=3, seed=8, validation="sync")
    _decode_call(s)
    n, bs = s.cfg.spec_num_tokens, 2
    ctx = ForwardContext(bs=bs, num_extends=0, input_num_tokens=bs * n)
    tokens = torch.randint(0, 97, (bs * n,))
    hidden = torch.randn(bs * n, s.head.target_hidden_width)
    accept = torch.tensor([1, 2], dtype=torch.int32)
    if case == "accept_too_long":
        accept = torch.tensor([1, n + 1], dtype=torch.int32)
    elif case == "accept_negative":
        accept = torch.tensor([-1, 1], dtype=torch.int32)
    elif case == "token_out_of_vocab":
        tokens[3] = 97
    elif case == "tokens_wrong_shape":
        tokens = tokens[:-1]
    elif case == "tokens_float":
        tokens = tokens.float()
    elif case == "hidden_wrong_width":
        hidden = hidden[:, :-1]
    elif case == "hidden_wrong_dtype":
        hidden = hidden.double()
    elif case == "bs_too_large":
        big = s.cfg.max_bs + 1
        ctx = ForwardContext(bs=big, num_extends=0, input_num_tokens=big * n)
    before = {k: v.clone() for k, v in vars(s.drafter.bufs).items()}
    kv_before = [t.clone() for t in s.drafter.kv_pool.k]
    with pytest.raises(ValueError, match=arg.replace(".", r"\.")):
        s.drafter.run(ctx, hidden, tokens, accept)
    for k, v in vars(s.drafter.bufs).items():
        assert torch.equal(v, before[k]), k
    assert all(torch.equal(a, b) for a, b in zip(kv_before, s.drafter.kv_pool.k, strict=True))


@pytest.mark.parametrize("case,arg", [
    ("accept_too_long", "accept_lengths"),
    ("token_out_of_vocab", "output_tokens"),
    ("slot_out_of_range", "input_buffers.req_pool_indices"),
])
def test_deferred_validation_flags_values_without_a_sync(case, arg):
    """validation="deferred" (default): value errors go to the device error word (the run
    itself reads no device value and does not fault: the values are clamped), and
    check_errors() raises the named ValueError once; shape errors still raise at once."""
    s = make_setup(steps=3, seed=8)
    assert s.cfg.validation_mode == "deferred"
    _decode_call(s)
    n, bs = s.cfg.spec_num_tokens, 2
    ctx = ForwardContext(bs=bs, num_extends=0, input_num_tokens=bs * n)
    tokens = torch.randint(0, 97, (bs * n,))
    hidden = torch.randn(bs * n, s.head.target_hidden_width)
    accept = torch.tensor([1, 2], dtype=torch.int32)
    s.drafter.check_errors()  # clean so far
    if case == "accept_too_long":
        accept = torch.tensor([1, n + 1], dtype=torch.int32)
    elif case == "token_out_of_vocab":
        tokens[3] = 97
    else:
        s.inputs.req_pool_indices[1] = 10**6
    real_item = torch.Tensor.item
    out = s.drafter.run(ctx, hidden, tokens, accept)
    assert out.shape == (bs, n) and int(out.min()) >= 0
    with pytest.raises(ValueError, match="^" + arg.replace(".", r"\.")):
        s.drafter.check_errors()
    s.drafter.check_errors()  # the word was reset
    assert torch.Tensor.item is real_item
    with pytest.raises(ValueError, match="output_tokens"):
        s.drafter.run(ctx, hidden, tokens[:-1], accept)  # a shape error: immediate


def test_deferred_run_does_no_host_sync(monkeypatch):
    """A deferred-mode decode run reads no device value: every host read is trapped."""
    s = make_setup(steps=3, seed=8)
    _decode_call(s)
    n, bs = s.cfg.spec_num_tokens, 2
    ctx = ForwardContext(bs=bs, num_extends=0, input_num_tokens=bs * n)
    tokens = torch.randint(0, 97, (bs * n,))
    hidden = torch.randn(bs * n, s.head.target_hidden_width)
    accept = torch.tensor([1, 2], dtype=torch.int32)

    def trap(*a, **k):
        raise AssertionError("host read of a device value")

    for name in ("item", "tolist", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, trap)
    s.drafter.run(ctx, hidden, tokens, accept)
    monkeypatch.undo()
    s.drafter.check_errors()


def test_validation_can_be_turned_off():
    s = make_setup(steps=2, seed=8, validate_inputs=False)
    called = []
    s.drafter.validate = lambda *a: called.append(a)
    loop = FakeServingLoop(s, 1)
    loop.add(4, 16)
    loop.step()
    assert not called


def test_decode_batch_padded_to_schedule_with_neutral_rows():
    """bs=3 runs at the padded size 4 (eager too), and row 3 holds neutral values, not stale data."""
    s = make_setup(steps=3, page_size=16, seed=12, cuda_graph_bs=(1, 2, 4, 8))
    loop = FakeServingLoop(s, 4)
    for _ in range(3):
        loop.add(6, 16)
    loop.step()  # prefill
    ib, b = s.inputs, s.drafter.bufs
    # stale garbage in the padded row, as an earlier larger batch would leave
    ib.req_pool_indices[3] = 5
    ib.seq_lens[3] = 99
    ib.out_cache_loc[12:16] = 77
    b.accept_lengths[3] = 4
    b.first_hidden[12:16] = float("nan")
    seen = []
    original = s.drafter._first_step

    def spy(bs, num_tokens, hidden):
        seen.append((bs, num_tokens))
        return original(bs, num_tokens, hidden)

    s.drafter._first_step = spy
    loop.step()
    assert seen == [(4, 16)]
    assert int(ib.req_pool_indices[3]) == 0 and int(ib.seq_lens[3]) == 1
    assert (ib.out_cache_loc[12:16] == 0).all() and int(b.accept_lengths[3]) == 1
    assert not b.first_hidden[12:16].isnan().any()
    assert s.drafter.decode_graphs.stats.eager["disabled"] >= 1


@pytest.mark.parametrize("page_size,hot", [(1, True), (16, False)])
def test_triton_path_matches_reference_under_interpreter(page_size, hot):
    """The whole Triton path (attention, RoPE+KV, norms, argmax, cache locations) vs the reference."""
    s = make_setup(steps=3, page_size=page_size, hot=hot, seed=21, kernel_backend="triton")
    assert s.drafter.cfg.use_triton
    drive(s, seed=21, iters=3, prompts=[(5, 16), (9, 4)])


def test_triton_path_with_32_row_gemvs_matches_reference():
    """Six decode rows (padded to 8): the first step's matmuls take 32 rows, which run on the
    GEMV kernel's 32-row tile (`KernelConfig.small_m_max` = 32)."""
    s = make_setup(steps=3, page_size=16, hot=True, seed=22, kernel_backend="triton")
    assert s.head.kernels.small_m_max >= 32
    drive(s, seed=22, iters=3, prompts=[(3, 16)] * 6)


def test_triton_path_above_small_m_matches_reference():
    """34 rows: every matmul has more than `KernelConfig.small_m_max` rows (cuBLAS, with the
    Triton silu_mul, the norm writing the hidden output and the argmax writing the token column)."""
    s = make_setup(steps=2, page_size=4, seed=23, kernel_backend="triton", max_running_requests=40,
                   max_num_batched_tokens=160)
    assert 34 > s.head.kernels.small_m_max
    drive(s, seed=23, iters=2, prompts=[(2, 16)] * 34)


def test_head_shared_by_drafters_of_two_kernel_paths():
    """A second drafter over the same head (another kernel path) must not change the first's runs."""
    s = make_setup(steps=3, page_size=4, seed=31, kernel_backend="torch")
    cfg = s.cfg.replace(kernel_backend="triton")
    EagleDrafter(s.head, cfg, req_to_page=s.pages.req_to_page, input_buffers=InputBuffers.allocate(cfg),
                 runtime_states=RuntimeStates.allocate(cfg))
    assert s.head.use_triton  # the newest drafter set the head's layers to its path
    drive(s, seed=31, iters=2, prompts=[(6, 8), (3, 4)])  # checked against the reference
    assert not s.head.use_triton  # the first drafter's runs switched it back


# --- the KV-only step (k = 0 cycles) -----------------------------------------------------
@pytest.mark.parametrize("kernel_backend,tokens,wide", [
    ("torch", 5, True), ("torch", 3, False),      # fp32 torch path; fc input and H-wide hidden
    ("triton", 4, True), ("triton", 3, False),    # Triton path (interpreter): SplitK GEMVs
    ("triton", 34, True)])                        # above small_m: the plain matmul
def test_store_kv_writes_the_full_steps_kv(kernel_backend, tokens, wide):
    """`Eagle3DraftHead.store_kv` writes bit for bit the KV the full step writes (and nothing
    else: every other cache slot untouched)."""
    s = make_setup(steps=3, seed=41, kernel_backend=kernel_backend, max_running_requests=40,
                   max_num_batched_tokens=160)
    head, d = s.head, s.drafter
    g = torch.Generator().manual_seed(41 + tokens)
    width = head.target_hidden_width if wide else head.config.hidden_size
    ids = torch.randint(0, head.config.vocab_size, (tokens,), generator=g)
    hidden = torch.randn(tokens, width, generator=g).to(head.dtype)
    positions = torch.randint(0, 150, (tokens,), generator=g)
    k, v = d.kv_pool.layer(0)
    k.normal_(generator=g)
    v.normal_(generator=g)
    locs = 1 + torch.randperm(k.shape[0] - 1, generator=g)[:tokens]
    start = (k.clone(), v.clone())
    meta = d.backend.bind_metadata(torch.zeros(tokens, dtype=torch.int64),
                                   torch.full((tokens,), 7, dtype=torch.int32))
    head(ids, positions, hidden, locs, (k, v), d.backend, meta)
    full = (k.clone(), v.clone())
    assert not torch.equal(full[0], start[0]) and not torch.equal(full[1], start[1])
    k.copy_(start[0])
    v.copy_(start[1])
    head.store_kv(ids, positions, hidden, locs, (k, v))
    assert torch.equal(k, full[0]) and torch.equal(v, full[1])


def test_store_kv_bad_input_raises_and_writes_nothing():
    s = make_setup(steps=3, seed=42)
    head, d = s.head, s.drafter
    k, v = d.kv_pool.layer(0)
    before = (k.clone(), v.clone())
    ids, pos, locs = torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([3, 4])
    hid = torch.zeros(2, head.target_hidden_width)
    with pytest.raises(ValueError, match="^positions: expected shape \\(2,\\)"):
        head.store_kv(ids, pos[:1], hid, locs, (k, v))
    with pytest.raises(ValueError, match="^out_cache_loc: expected shape \\(2,\\)"):
        head.store_kv(ids, pos, hid, locs[:1], (k, v))
    with pytest.raises(ValueError, match="^hidden: expected shape"):
        head.store_kv(ids, pos, hid[:, :5], locs, (k, v))
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])
