"""The mixed step's draft first step padded to the target's (rows, tokens) bucket
(`EagleDrafter.draft_mixed_padded`, `serving/cycles/mixed_graphs.py`): on the CPU the padded
step run eagerly gives what today's unpadded step gives (the target padded in both, so only
the draft's padding differs): the same drafts and text, the KV within rounding; on the GPU the replayed graphs == the same padded
step run eagerly (enforce_eager), every state tensor after every step."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from graphdraft.kernels.draft_indices import decode_draft_indices_ref
from graphdraft.runtime.batch import ForwardContext
from graphdraft.runtime.buffers import ROW_DECODE, ROW_PAD, ROW_PREFILL
from graphdraft.runtime.drafter_protocol import PadsMixedDraft
from graphdraft.runtime.kv_cache import kv_slot
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.drafter_harness import make_setup
from tests.engine_harness import make_models, runtime
from tests.test_mixed_graphs import _state

CUDA = torch.cuda.is_available()


def _padded(engine: Engine, draft: bool) -> list[tuple[int, int, int, int, int]]:
    """The padded target forward on (eager here); with `draft`, the padded draft too. Returns
    the list the padded draft's steps record into: (bs, ne, t, R, Tb)."""
    mode = engine.mode
    mode.mixed_target.active = True
    seen: list[tuple[int, int, int, int, int]] = []
    if not draft:
        return seen
    assert not mode.padded_draft and mode.mixed_target.aux_out is None  # CPU: off by default
    mode.padded_draft = mode._pad_mixed_draft(mode.drafter)
    assert mode.padded_draft and mode.mixed_target.aux_out is mode.drafter.mixed_hidden
    run = mode.drafter.draft_mixed_padded

    def spy(ctx, tokens, accept, bucket):
        seen.append((ctx.bs, ctx.num_extends, ctx.input_num_tokens, *bucket))
        return run(ctx, tokens, accept, bucket)
    mode.drafter.draft_mixed_padded = spy
    return seen


JOINS = {0: [0, 1, 2], 1: [3], 3: [4, 5], 4: [6], 6: [7, 8, 9], 8: [10], 9: [11, 12], 12: [13]}
"""Step -> the prompts that join then (mixed steps of 1..3 prefill rows beside decode rows)."""


def _lockstep(engines: list[Engine], ps: list[list[int]], params: SamplingParams,
              tol: float | None, *, joins: dict[int, list[int]] = JOINS,
              second=contextlib.nullcontext) -> list[list[list[int]]]:
    """Both engines step together, `joins` adding requests (step -> prompt indices), the
    second engine's steps inside the context `second()` makes; after every step their state
    (`test_mixed_graphs._state`) equal: bit for bit, or floating tensors within `tol`.
    Returns each engine's outputs."""
    reqs, step = [[], []], 0
    while step in joins or any(e.has_work for e in engines):
        for i, e in enumerate(engines):
            reqs[i].extend(e.add_request(ps[j], params) for j in joins.get(step, []))
            with second() if i else contextlib.nullcontext():
                e.step()
        if engines[0].device.type == "cuda":
            torch.cuda.synchronize()
        a, b = _state(engines[0]), _state(engines[1])
        for k in a:
            if tol is not None and a[k].is_floating_point():
                torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=(step, k))
            else:
                assert torch.equal(a[k], b[k]), (step, k)
        step += 1
    return [[r.output for r in rs] for rs in reqs]


PARAMS = {"greedy": SamplingParams(max_new_tokens=10),
          "sampled": SamplingParams(max_new_tokens=10, temperature=0.9, top_k=12, seed=4,
                                    repetition_penalty=1.3, presence_penalty=0.4,
                                    logit_bias={3: 2.0, 7: -1.5})}


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_padded_draft_first_step_equals_the_unpadded_one(kind):
    """Two Engines in lockstep (fp32, torch path), both with the padded target forward, joins
    at several steps and chunked prompts (mixed steps of 1..several prefill rows beside
    0..several decode rows): the one drafting padded to the target's bucket (rows of no
    token, padded tokens on the dummy slot) == the one drafting unpadded after every step:
    every integer state tensor (the slots' drafts, last tokens, counts, the pack, lengths)
    and the text exactly; the KV caches within 1e-5. Not bit for bit there: the CPU's sgemm
    rounds a row differently with the row count M (small M: M = 3 and M = 8 differ), and
    the head's projections after attention run over R rows instead of bs (the drafts'
    hidden states, hence the multi-step's KV, differ in the last bits; ~2e-6 seen). On the
    GPU the padded step is the one both graphs on and off run: bit for bit (below)."""
    target, head = make_models(3, dtype=torch.float32)
    rng = random.Random(9)
    ps = [[rng.randrange(61) for _ in range(rng.randint(3, 45))] for _ in range(14)]
    cfg = runtime(dtype="float32", max_running_requests=10, cuda_graph_max_bs=10,
                  max_num_batched_tokens=60)
    engines = [Engine(target, cfg, head, seed=7) for _ in range(2)]
    _padded(engines[0], draft=False)
    seen = _padded(engines[1], draft=True)
    outs = _lockstep(engines, ps, PARAMS[kind], tol=1e-5)
    assert outs[0] == outs[1] and all(len(o) == 10 for o in outs[0])
    assert all(r >= bs and tb >= t for bs, _, t, r, tb in seen)
    assert any(ne >= 2 and bs > ne for bs, ne, *_ in seen)  # several prefill rows + decode rows
    assert any(ne == bs for bs, ne, *_ in seen)  # prefill rows only
    assert any(bs - ne >= 2 for bs, ne, *_ in seen)  # several decode rows
    assert any(r > bs for bs, _, _, r, _ in seen) and any(tb > t for _, _, t, _, tb in seen)
    assert len({r for *_, r, _ in seen}) > 1  # two row buckets (8, 10)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("ne", "nd", "pad"), [(1, 0, 0), (3, 0, 2), (1, 2, 0), (2, 3, 3),
                                               (0, 4, 1), (4, 4, 0)])
def test_mixed_first_step_indices_follow_each_rows_kind(ne, nd, pad, backend):
    """The padded first step's indices over rows of every kind at once (`_mixed_indices`),
    against the per-kind formulas the unpadded step used: a prefill row gathers its last
    token (cumsum of the chunks - 1) and attends over / writes from its seq len; decode rows
    `decode_draft_indices_ref` at token offset npt; padded rows stay inert (seq len 1, draft
    step 2 at position 1, a gather inside the tokens). next_tokens[:bs, 0] = the gathered ids;
    the drafts next_tokens[:bs, 1] == the same step unpadded (bs rows, t tokens)."""
    s = make_setup(steps=3, seed=ne * 5 + nd, kernel_backend=backend)
    d, ib, b, n = s.drafter, s.inputs, s.drafter.bufs, s.drafter.N
    g = torch.Generator().manual_seed(ne * 10 + nd + pad)
    bs, rows = ne + nd, ne + nd + pad
    ext = torch.cat([torch.randint(1, 9, (ne,), generator=g), torch.full((nd,), n)])
    t = int(ext.sum())
    ib.extend_lens[:bs] = ext.to(torch.int32)
    seqs = ext + torch.randint(0, 20, (bs,), generator=g)
    ib.seq_lens[:bs] = seqs.to(torch.int32)
    slots = [s.pages.alloc_slot() for _ in range(bs)]
    ib.req_pool_indices[:bs] = torch.tensor(slots)
    tok = 0  # each row's tokens at its positions seq - ext .. seq - 1, in its own pages
    for r, slot in enumerate(slots):
        s.pages.reserve(slot, int(seqs[r]))
        pos = torch.arange(int(seqs[r] - ext[r]), int(seqs[r]))
        ib.positions[tok: tok + len(pos)] = pos
        ib.out_cache_loc[tok: tok + len(pos)] = kv_slot(s.pages.req_to_page, slot, pos, 16)
        tok += len(pos)
    s.states.valid_cache_lengths[1:] = torch.randint(0, 30, (8,), generator=g).to(torch.int32)
    b.accept_lengths[:rows] = torch.randint(0, n + 1, (rows,), generator=g).to(torch.int32)
    b.accept_lengths[:ne] = 1
    ib.pad_rows(bs, rows)  # (padded rows keep a stale accept length: not read)
    b.row_kind[:rows] = torch.tensor([ROW_PREFILL] * ne + [ROW_DECODE] * nd + [ROW_PAD] * pad)
    tokens = t + 5 if pad else t  # padded tokens too
    b.first_input_ids[:tokens] = torch.randint(0, 97, (tokens,), generator=g)
    hidden = torch.randn(tokens, d.head.target_hidden_width, generator=g)
    d._mixed_first_step(rows, tokens, hidden)
    gather, seq, start = b.gather_ids[:rows].clone(), b.seq_lens[:rows].clone(), b.write_start[:rows].clone()
    drafts = b.next_tokens[:bs, :2].clone()
    end = torch.cumsum(ext, 0)
    assert gather[:ne].tolist() == (end[:ne] - 1).tolist()
    assert seq[:ne].tolist() == start[:ne].tolist() == ib.seq_lens[:ne].tolist()
    ref = [torch.zeros(nd, dtype=dt) for dt in (torch.int64, torch.int32, torch.int64)]
    npt = int(ext[:ne].sum())
    decode_draft_indices_ref(b.accept_lengths[ne:bs], ib.seq_lens[ne:bs],
                             ib.req_pool_indices[ne:bs], s.states.valid_cache_lengths, n, npt,
                             *ref)
    assert [gather[ne:bs].tolist(), seq[ne:bs].tolist(), start[ne:bs].tolist()] == \
        [r.tolist() for r in ref]
    assert seq[bs:].tolist() == [1] * pad and start[bs:].tolist() == [1] * pad
    assert all(0 <= x < t for x in gather[bs:].tolist())
    assert b.next_tokens[:rows, 0].tolist() == b.first_input_ids[gather].tolist()
    d._mixed_first_step(bs, t, hidden[:t])  # unpadded: the same step at (bs, t)
    assert torch.equal(b.gather_ids[:bs], gather[:bs]) and torch.equal(b.next_tokens[:bs, :2], drafts)


def test_pad_mixed_checks_its_arguments():
    target, head = make_models(4)
    engine = Engine(target, runtime(max_running_requests=8, cuda_graph_max_bs=8), head)
    drafter = engine.drafter
    assert isinstance(drafter, PadsMixedDraft)
    with pytest.raises(ValueError, match="rows"):
        drafter.pad_mixed([0], [64])
    with pytest.raises(ValueError, match="tokens"):
        drafter.pad_mixed([8], [10 ** 9])
    ctx = ForwardContext(bs=2, num_extends=1, input_num_tokens=10)
    tokens = torch.zeros(1 + engine.n_row, dtype=torch.int64)
    accept = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="bucket"):  # no pad_mixed yet
        drafter.draft_mixed_padded(ctx, tokens, accept, (8, 40))
    hidden = drafter.pad_mixed([8], [40])  # (max_num_tokens 48 here)
    assert hidden.shape == (40, head.target_hidden_width) and not drafter.mixed_graphs  # CPU
    with pytest.raises(ValueError, match="already"):
        drafter.pad_mixed([8], [40])
    for bad in ((1, 40), (8, 9), (8, 41), (9, 40)):  # R < bs, Tb < t, Tb past the buffer, R > max
        with pytest.raises(ValueError, match="bucket"):
            drafter.draft_mixed_padded(ctx, tokens, accept, bad)


def _draft_replays(engine: Engine) -> int:
    return sum(sum(f.stats.replays.values()) for f in engine.drafter.mixed_graphs.values())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "kind"), [("bfloat16", "greedy"), ("float32", "sampled")])
def test_captured_mixed_draft_equals_the_padded_eager_one(dtype, kind):
    """Two Engines in lockstep (graphs on / enforce_eager), joins at several steps: the one
    replaying the captured padded draft first steps (and target forwards) == the one running
    the same padded steps eagerly, every state tensor (draft KV included) after every step;
    the draft graphs replayed, over several buckets; the tokens equal (greedy, or sampled
    under penalties and logit_bias: the draft controls inside the graph)."""
    target, head = make_models(2, dtype=getattr(torch, dtype), device="cuda")
    rng = random.Random(6)
    ps = [[rng.randrange(61) for _ in range(rng.randint(3, 70))] for _ in range(14)]
    engines = []
    for kw in ({}, {"enforce_eager": True}):
        cfg = runtime(device="cuda", dtype=dtype, cuda_graph_bs=(1, 2, 4, 8, 16, 24, 32),
                      cuda_graph_max_bs=32, max_running_requests=32, max_num_batched_tokens=200,
                      **kw)
        e = Engine(target, cfg, head, seed=7)
        e.capture_graphs(progress=False)
        assert e.mode.padded_draft and e.mode.mixed_target.aux_out is e.drafter.mixed_hidden
        engines.append(e)
    g = engines[0].drafter.mixed_graphs
    assert g and not engines[1].drafter.mixed_graphs
    assert all(f.captured_sizes == f.batch_sizes for f in g.values())
    keys = [k for k, _ in engines[0].graph_registry.items()]
    assert [k for k in keys if k[0] == "draft_mixed"] == [("draft_mixed", tb) for tb in g]
    outs = _lockstep(engines, ps, PARAMS[kind], tol=None)
    assert outs[0] == outs[1] and all(len(o) == 10 for o in outs[0])
    used = [tb for tb, f in g.items() if sum(f.stats.replays.values())]
    assert _draft_replays(engines[0]) > 0 and len(used) >= 2, used
