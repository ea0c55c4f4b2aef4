"""The documented meaning (README, "Two cases where next_tokens rows hold no drafts") of an
accept length of 0 and of mid-chunk-only batches, pinned on the drafter's torch path."""

from __future__ import annotations

import torch

from tests.drafter_harness import FakeServingLoop, make_setup


def _decode_step(accept_values: list[int]):
    """Two requests prefilled, then one decode batch with the given accept lengths."""
    s = make_setup(steps=3, page_size=16, seed=21)
    loop = FakeServingLoop(s, 4)
    loop.add(6, 16)
    loop.add(9, 16)
    loop.step()  # prefill both
    rows, order, ctx, hidden, out_tokens, accept = loop.prepare()
    assert ctx.num_extends == 0
    accept = torch.tensor(accept_values, dtype=torch.int32)
    valid = s.states.valid_cache_lengths.clone()
    nxt = s.drafter.run(ctx, hidden, out_tokens, accept)
    slots = [r.slot for r in order]
    return s, out_tokens, nxt, valid, slots


def test_accept_length_zero_gathers_like_one_and_writes_from_the_committed_length():
    n = 4
    s0, out0, nxt0, valid0, slots = _decode_step([0, 2])
    s1, out1, nxt1, _, _ = _decode_step([1, 2])
    assert torch.equal(out0, out1)
    # column 0: output_tokens at the row's first position (not a committed token for 0)
    assert int(nxt0[0, 0]) == int(out0[0 * n]) == int(nxt1[0, 0])
    # the first draft step is the same as for accept 1 (same gathered row, same KV length)
    assert torch.equal(nxt0[:, :2], nxt1[:, :2])
    # later steps write from valid_cache_lengths + accept: + 0 for the discarded row
    assert int(s0.drafter.bufs.write_start[0]) == int(valid0[slots[0]]) + 0
    assert int(s1.drafter.bufs.write_start[0]) == int(valid0[slots[0]]) + 1
    assert int(s0.drafter.bufs.write_start[1]) == int(valid0[slots[1]]) + 2
    # the other row is unaffected by its neighbour's 0
    assert torch.equal(nxt0[1], nxt1[1])


def test_mid_chunk_only_batch_returns_the_prompts_next_token_and_copies():
    s = make_setup(steps=3, page_size=16, seed=4)
    loop = FakeServingLoop(s, 1)
    req = loop.add(30, 8)
    rows, ctx, _, _, _, next_tokens, _ = loop.step()
    assert ctx.all_extends_mid_chunk and s.drafter.stats.skipped_multi_step == 1
    assert int(next_tokens[0, 0]) == req.prompt[8]       # the prompt's token after the chunk
    assert (next_tokens[:, 2:] == next_tokens[:, :1]).all()  # copies, not drafts
