"""Compiled variants do not multiply with the batch size: every size of one bucket launches
each kernel under one Triton specialization key (what the JIT compiles per key), and the
kernels still match their torch references at those sizes.

The keys are computed on the host as Triton's launcher does (`keys.specialization_key`:
constexprs, launch options, value specialization of ints and pointer alignment), so the
check runs under the interpreter, which compiles nothing itself.
"""

from __future__ import annotations

import pytest
import torch

from graphdraft.kernels import keys
from graphdraft.kernels.argmax import argmax_stage2, argmax_with_map, argmax_with_map_ref
from graphdraft.kernels.buckets import representative_sizes, row_bucket, rows_block
from graphdraft.kernels.cache_loc import (
    advance_positions_and_seq_lens,
    advance_positions_and_seq_lens_ref,
    compute_out_cache_loc_uniform,
    compute_out_cache_loc_uniform_ref,
)
from graphdraft.kernels.draft_indices import decode_draft_indices, decode_draft_indices_ref
from graphdraft.kernels.fused_inputs import SplitK
from graphdraft.kernels.gemv import (
    gemv_config,
    linear_small_m,
    linear_small_m_ref,
    linear_small_m_residual_norm,
    m_bucket,
)
from graphdraft.kernels.norm import rms_norm, rms_norm_cat, rms_norm_ref
from graphdraft.kernels.rope import rope_and_store_kv, rope_and_store_kv_partials
from graphdraft.kernels.stage_inputs import stage_decode_inputs, stage_decode_inputs_ref
from graphdraft.startup import warmup
from perf.compile_census import gpu_dry_keys

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = keys.kernels()


def _record(names):
    return keys.KeyRecorder({n: KERNELS[n] for n in names})


def _one_key_per_bucket(rec, name, sizes, bucket_of):
    """Group the launches' keys by bucket (launch order follows `sizes`): one key per bucket,
    distinct buckets distinct keys."""
    keys = rec.keys[name]
    assert rec.launches[name] == len(sizes), (name, rec.launches[name])
    buckets = {bucket_of(s) for s in sizes}
    assert len(keys) == len(buckets), (name, sorted(buckets), len(keys))


# ------------------------------------------------------------------ the key itself
def test_key_sees_value_specialization_and_do_not_specialize():
    """The key function tells 1 / multiple of 16 / other apart for a specialized int (so the
    bucket checks below can fail), and not for a do_not_specialize one."""
    k = KERNELS["cache_loc._uniform_kernel"]  # n_reqs: do_not_specialize; page_size: not
    t = torch.zeros(4, dtype=torch.int64)
    base = dict(BLOCK=16, FIRST=False, pdl_trigger=1, PDL=False, EARLY=False)

    def key(n_reqs, page_size):
        return keys.specialization_key(k, t, t, t, t, 3, 1, 3, 1, 1, n_reqs, 4, 4, 1,
                                         page_size, t, t, **base)

    assert key(1, 5) == key(16, 5) == key(17, 5)
    assert len({key(3, 1), key(3, 16), key(3, 17)}) == 3
    assert key(3, 17) == key(3, 19)
    # the PDL trigger is a runtime argument: one variant on either side of its row limit
    assert keys.specialization_key(k, t, t, t, t, 3, 1, 3, 1, 1, 3, 4, 4, 1, 17, t, t,
                                     **(base | {"pdl_trigger": 0})) == key(3, 17)
    # alignment: a pointer one element past an aligned one is a different key
    assert keys.specialization_key(k, t[1:], t, t, t, 3, 1, 3, 1, 1, 2, 4, 4, 1, 5, t, t,
                                     **base) != key(2, 5)


def test_kernel_list_covers_the_chain():
    for n in ("gemv._gemv_kernel", "gemv._gemv_kernel_m1", "gemv._sum_residual_norm_kernel",
              "argmax._argmax_stage2_kernel", "cache_loc._advance_kernel",
              "draft_indices._decode_draft_indices_kernel", "norm._rms_norm_cat_kernel",
              "rope._rope_store_kernel", "stage_inputs._stage_kernel"):
        assert n in KERNELS


# ------------------------------------------------------------------ buckets
def test_bucket_functions():
    assert [m_bucket(m) for m in (1, 2, 4, 16, 17, 32, 33, 64)] == [1, 16, 16, 16, 32, 32, 64, 64]
    assert [rows_block(r) for r in (1, 16, 17, 160)] == [64, 64, 64, 64]
    with pytest.raises(ValueError, match="m: expected"):
        m_bucket(65)
    assert row_bucket(24) == row_bucket(32) != row_bucket(16)
    assert row_bucket(40) == row_bucket(160)  # above small_m_max (32): cuBLAS, same lanes
    sched = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    reps = representative_sizes(sched, (1, 4))
    assert reps == sorted(reps, reverse=True) and set(reps) <= set(sched)
    # every size shares its bucket with exactly one representative
    for bs in sched:
        same = [r for r in reps if all(row_bucket(bs * m) == row_bucket(r * m) for m in (1, 4))]
        assert len(same) == 1, bs
    assert len(reps) <= 6
    with pytest.raises(ValueError, match="row_multipliers"):
        representative_sizes(sched, (0,))


# ------------------------------------------------------------------ per kernel
@pytest.mark.parametrize("dtype", [torch.float32])
def test_gemv_one_key_per_m_bucket(dtype):
    g = torch.Generator().manual_seed(0)
    k, n = 64, 48
    w = torch.randn(n, k, generator=g, dtype=dtype).to(DEV)
    sizes = [1, 2, 3, 16, 17, 24, 32]
    with _record(["gemv._gemv_kernel", "gemv._gemv_kernel_m1"]) as rec:
        for m in sizes:
            x = torch.randn(m, k, generator=g, dtype=dtype).to(DEV)
            torch.testing.assert_close(linear_small_m(x, w), linear_small_m_ref(x, w))
    assert rec.launches["gemv._gemv_kernel_m1"] == 1 and len(rec.keys["gemv._gemv_kernel_m1"]) == 1
    assert rec.launches["gemv._gemv_kernel"] == len(sizes) - 1
    assert len(rec.keys["gemv._gemv_kernel"]) == 2  # BLOCK_M 16 (2, 3, 16) and 32 (17, 24, 32)


@pytest.mark.parametrize("finish_max_m", [1, 4])
def test_gemv_residual_norm_split_one_key_per_bucket(finish_max_m):
    """Split K (workspace stride M * N) and the second-launch norm (M > `finish_norm_max_m`),
    and the in-launch finisher (2 <= M <= 4 when the limit is 4; the default 1 keeps it for
    single rows): one key per bucket for both kernels."""
    from graphdraft.kernels.config import default as default_kernels

    kc = default_kernels().replace(finish_norm_max_m=finish_max_m)
    g = torch.Generator().manual_seed(1)
    k, n = 256, 32
    w = torch.randn(n, k, generator=g).to(DEV)
    nw = torch.rand(n, generator=g).to(DEV) + 0.5
    cfg = gemv_config(2, n, k, split=2)
    sizes = [2, 3, 4, 5, 7, 16]
    with _record(["gemv._gemv_kernel", "gemv._sum_residual_norm_kernel"]) as rec:
        for m in sizes:
            x = torch.randn(m, k, generator=g).to(DEV)
            r = torch.randn(m, n, generator=g).to(DEV)
            out, h = linear_small_m_residual_norm(x, w, r, nw, 1e-6, config=cfg, kernels=kc)
            h_ref = linear_small_m_ref(x, w) + r
            torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
            ref = (h_ref * torch.rsqrt(h_ref.pow(2).mean(-1, keepdim=True) + 1e-6)) * nw
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    second = [m for m in sizes if m > finish_max_m]
    # finisher (2-4) | partials only (5-16); at the default limit partials only
    assert len(rec.keys["gemv._gemv_kernel"]) == (2 if finish_max_m == 4 else 1)
    _one_key_per_bucket(rec, "gemv._sum_residual_norm_kernel", second, m_bucket)


def test_argmax_second_stage_one_key_for_varying_splits():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 8192, generator=g).to(DEV)
    hot = torch.randperm(8192, generator=g).to(DEV)
    splits = [2, 3, 5, 8]
    with _record(["argmax._argmax_stage1_kernel", "argmax._argmax_stage2_kernel"]) as rec:
        for s in splits:
            assert torch.equal(argmax_with_map(logits, hot, num_splits=s),
                               argmax_with_map_ref(logits, hot))
    assert len(rec.keys["argmax._argmax_stage1_kernel"]) == 1
    assert len(rec.keys["argmax._argmax_stage2_kernel"]) == 1


def test_draft_indices_one_key_per_rows_bucket():
    n = 4
    sizes = [1, 3, 16, 17, 40]
    with _record(["draft_indices._decode_draft_indices_kernel"]) as rec:
        for bs in sizes:
            g = torch.Generator().manual_seed(bs)
            accept = torch.randint(0, n + 1, (bs,), generator=g, dtype=torch.int32).to(DEV)
            seq = torch.randint(1, 40, (bs,), generator=g, dtype=torch.int32).to(DEV)
            req = torch.randperm(bs + 3, generator=g)[:bs].to(DEV)
            valid = torch.randint(0, 100, (bs + 3,), generator=g, dtype=torch.int32).to(DEV)
            outs = [(torch.zeros(bs, dtype=torch.int64, device=DEV),
                     torch.zeros(bs, dtype=torch.int32, device=DEV),
                     torch.zeros(bs, dtype=torch.int64, device=DEV)) for _ in range(2)]
            decode_draft_indices(accept, seq, req, valid, n, 0, *outs[0])
            decode_draft_indices_ref(accept, seq, req, valid, n, 0, *outs[1])
            for a, b in zip(*outs, strict=True):
                assert torch.equal(a, b)
    _one_key_per_bucket(rec, "draft_indices._decode_draft_indices_kernel", sizes, rows_block)


def test_cache_loc_uniform_and_advance_one_key_per_rows_bucket():
    g = torch.Generator().manual_seed(3)
    rtp = torch.randint(1, 500, (50, 8), generator=g, dtype=torch.int32).to(DEV)
    length = 3
    sizes = [1, 3, 16, 17, 40]
    with _record(["cache_loc._uniform_kernel", "cache_loc._advance_kernel"]) as rec:
        for bs in sizes:
            reqs = torch.randperm(50, generator=g)[:bs].to(DEV)
            starts = torch.randint(0, 20, (bs,), generator=g, dtype=torch.int32).to(DEV)
            kw = {"out_stride_req": 1, "out_stride_tok": bs}  # [length, bs]: strides scale with bs
            got = torch.full((bs * length,), -7, dtype=torch.int64, device=DEV)
            exp = got.clone()
            compute_out_cache_loc_uniform(got, reqs, starts, rtp, 4, length, **kw)
            compute_out_cache_loc_uniform_ref(exp, reqs, starts, rtp, 4, length, **kw)
            assert torch.equal(got, exp)
            seq = torch.randint(1, 9, (bs,), generator=g, dtype=torch.int32).to(DEV)
            pos = torch.randint(0, 9, (bs,), generator=g).to(DEV)
            seq2, pos2 = seq.clone(), pos.clone()
            advance_positions_and_seq_lens(seq, pos)
            advance_positions_and_seq_lens_ref(seq2, pos2)
            assert torch.equal(seq, seq2) and torch.equal(pos, pos2)
    assert len(rec.keys["cache_loc._uniform_kernel"]) == 1
    _one_key_per_bucket(rec, "cache_loc._advance_kernel", sizes, rows_block)


def test_stage_inputs_one_key():
    n, kh, max_bs = 4, 40, 20
    t = max_bs * n
    bufs = dict(accept=torch.zeros(max_bs, dtype=torch.int32), first_ids=torch.zeros(t, dtype=torch.int64),
                first_hidden=torch.zeros(t, kh), seq_lens=torch.zeros(max_bs, dtype=torch.int32),
                req=torch.zeros(max_bs, dtype=torch.int64),
                extend_lens=torch.zeros(max_bs, dtype=torch.int32),
                input_ids=torch.zeros(t, dtype=torch.int64), positions=torch.zeros(t, dtype=torch.int64),
                out_cache_loc=torch.zeros(t, dtype=torch.int64))
    bufs = {k: v.to(DEV) for k, v in bufs.items()}
    ref = {k: v.clone() for k, v in bufs.items()}
    sizes = [(1, 1), (3, 4), (5, 8), (16, 16), (17, 17)]
    with _record(["stage_inputs._stage_kernel"]) as rec:
        for bs, pbs in sizes:
            g = torch.Generator().manual_seed(bs)
            accept = torch.randint(0, n + 1, (bs,), generator=g, dtype=torch.int32).to(DEV)
            tokens = torch.randint(0, 99, (bs * n,), generator=g).to(DEV)
            hidden = torch.randn(bs * n, kh, generator=g).to(DEV)
            stage_decode_inputs(bs, pbs, n, accept, tokens, hidden, **bufs)
            stage_decode_inputs_ref(bs, pbs, n, accept, tokens, hidden, **ref)
            for name in bufs:
                assert torch.equal(bufs[name], ref[name]), (bs, name)
    assert len(rec.keys["stage_inputs._stage_kernel"]) == 1


def test_fused_partials_consumers_one_key():
    """RoPE + KV store and the [embedding ; fc] norm take split partials whose split stride
    (T * width) scales with the rows but stays a multiple of 16 (width is): one key over rows
    2, 3, 16, 17."""
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, split = 2, 1, 8, 2
    width = (hq + 2 * hkv) * d
    kc = torch.zeros(64, hkv, d).to(DEV)
    vc = torch.zeros(64, hkv, d).to(DEV)
    cs = torch.randn(32, d, generator=g).to(DEV)
    nn = 16
    wa = torch.rand(nn, generator=g).to(DEV) + 0.5
    wb = torch.rand(nn, generator=g).to(DEV) + 0.5
    sizes = [2, 3, 16, 17]
    with _record(["rope._rope_store_kernel", "norm._rms_norm_cat_kernel"]) as rec:
        for rows in sizes:
            qkv = torch.randn(split, rows, width, generator=g).to(DEV)
            pos = torch.randint(0, 32, (rows,), generator=g).to(DEV)
            loc = torch.randperm(64, generator=g)[:rows].to(DEV)
            q = rope_and_store_kv_partials(SplitK(qkv, qkv.dtype), pos, cs, kc, vc, loc)
            summed = qkv.sum(0).view(rows, hq + 2 * hkv, d)
            c, s = cs[pos][:, None, : d // 2], cs[pos][:, None, d // 2:]
            q1, q2 = summed[:, :hq, : d // 2], summed[:, :hq, d // 2:]
            torch.testing.assert_close(q, torch.cat([q1 * c - q2 * s, q2 * c + q1 * s], -1))
            torch.testing.assert_close(vc[loc], summed[:, hq + hkv:])
            a = torch.randn(rows, nn, generator=g).to(DEV)
            b = torch.randn(split, rows, nn, generator=g).to(DEV)
            b_out = torch.empty(rows, nn).to(DEV)
            out = rms_norm_cat(a, wa, 1e-6, SplitK(b, a.dtype), wb, 1e-6, b_out=b_out)
            torch.testing.assert_close(b_out, b.sum(0))
            ref = torch.cat([rms_norm_ref(a, wa, 1e-6), rms_norm_ref(b_out, wb, 1e-6)], -1)
            torch.testing.assert_close(out, ref)
    assert len(rec.keys["rope._rope_store_kernel"]) == 1
    assert len(rec.keys["norm._rms_norm_cat_kernel"]) == 1


# ------------------------------------------------------------------ one key across modes
def test_rope_one_key_across_modes():
    """The forward's RoPE + KV store and the KV-only step's (one q head, given the forward's
    head count as `max_q_heads`), each on activations and on split partials (splits 3 and 4):
    one key. Without the hint the KV-only step's q lanes differ: a second key."""
    bf = torch.bfloat16
    hq, hkv, d = 4, 2, 16
    kc, vc = torch.zeros(64, hkv, d, dtype=bf), torch.zeros(64, hkv, d, dtype=bf)
    cs = torch.randn(64, d)

    def calls(hint=hq):
        for t in (1, 3, 16):
            pos, loc = torch.arange(t), torch.arange(t) + 1
            for heads in (hq, 1):  # the forward, the KV-only step
                x = torch.randn(t, (heads + 2 * hkv) * d).to(bf).view(t, -1, d)
                q, k, v = x.split([heads, hkv, hkv], dim=1)
                rope_and_store_kv(q, k, v, pos, cs, kc, vc, loc, max_q_heads=hint)
                for split in (3, 4):
                    ws = SplitK(torch.randn(split, t, x.shape[1] * d), bf)
                    rope_and_store_kv_partials(ws, pos, cs, kc, vc, loc, max_q_heads=hint)

    name = "rope._rope_store_kernel"
    rec = gpu_dry_keys(calls)
    assert rec.launches[name] == 18 and len(rec.keys[name]) == 1
    assert len(gpu_dry_keys(lambda: calls(None)).keys[name]) == 2


def test_rope_padded_q_lanes_same_bits():
    """q lanes sized for more heads (`max_q_heads`) change no written bit."""
    g = torch.Generator().manual_seed(6)
    bf = torch.bfloat16
    t, hkv, d = 5, 2, 16
    cs = torch.randn(64, d, generator=g)
    pos, loc = torch.randint(0, 64, (t,), generator=g), torch.randperm(32, generator=g)[:t]
    qkv = torch.randn(t, (1 + 2 * hkv) * d, generator=g).to(bf)
    ws = SplitK(torch.randn(3, t, qkv.shape[1], generator=g), bf)
    outs = []
    for hint in (None, 8):
        kc, vc = torch.zeros(32, hkv, d, dtype=bf), torch.zeros(32, hkv, d, dtype=bf)
        x = qkv.clone().view(t, -1, d)
        rope_and_store_kv(*x.split([1, hkv, hkv], dim=1), pos, cs, kc, vc, loc, max_q_heads=hint)
        q = rope_and_store_kv_partials(ws, pos, cs, kc, vc, loc, max_q_heads=hint)
        outs.append((x, q, kc, vc))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_norms_one_key_across_modes():
    """RMSNorm with and without the residual; the [a ; b] norm with b as activations and as
    split partials (splits 3 and 4): one key each."""
    bf = torch.bfloat16
    n = 64
    w = torch.rand(n).to(bf)
    table = torch.randn(50, n).to(bf)

    def calls():
        for m in (1, 5, 16):
            x, r = torch.randn(m, n).to(bf), torch.randn(m, n).to(bf)
            rms_norm(x, w, 1e-6)
            rms_norm(x, w, 1e-6, residual=r)
            index = torch.arange(m)
            rms_norm_cat(table, w, 1e-6, x, w, 1e-6, a_index=index)
            for split in (3, 4):
                b = SplitK(torch.randn(split, m, n), bf)
                rms_norm_cat(table, w, 1e-6, b, w, 1e-6, a_index=index, b_out=torch.empty_like(x))

    names = ["norm._rms_norm_kernel", "norm._rms_norm_cat_kernel"]
    rec = gpu_dry_keys(calls)
    assert [rec.launches[n] for n in names] == [6, 9]
    assert [len(rec.keys[n]) for n in names] == [1, 1]


def test_argmax_second_stage_one_key_across_sizes():
    """The split argmax's second stage from `argmax_with_map` (1 to 64 rows: 264 splits down
    to a few) and from the LM-head GEMV's call (500 and 250 blocks, its num_warps): one key;
    and past one pass of lanes (1100 splits) still the row's first maximum."""
    name = "argmax._argmax_stage2_kernel"

    def calls():
        for b in (1, 2, 8, 40, 64):
            argmax_with_map(torch.randn(b, 32000).to(torch.bfloat16), torch.arange(32000),
                            tokens_out=torch.empty(b, dtype=torch.int32))
        for b, splits in ((1, 500), (8, 250)):
            ids = torch.empty(b, dtype=torch.int64)
            argmax_stage2(torch.randn(b, splits), torch.zeros(b, splits, dtype=torch.int32), ids,
                          torch.arange(32000), torch.empty(b, dtype=torch.int32))

    rec = gpu_dry_keys(calls)
    assert rec.launches[name] == 7 and len(rec.keys[name]) == 1
    val = torch.randn(2, 1100).round()
    val[1, 700] = val[1, 1050] = 9.0  # a tie in the second pass: the first wins
    ids = torch.empty(2, dtype=torch.int64)
    argmax_stage2(val, torch.arange(1100, dtype=torch.int32).repeat(2, 1) * 3, ids)
    assert ids.tolist() == [3 * int(val[0].argmax()), 3 * 700]


# ------------------------------------------------------------------ on the GPU
def _gpu_drafter(sizes):
    from tests.drafter_harness import make_setup

    return make_setup(steps=3, page_size=16, hot=True, seed=5, device="cuda", dtype="bfloat16",
                      max_running_requests=max(sizes), cuda_graph_max_bs=max(sizes),
                      cuda_graph_bs=tuple(sizes)).drafter


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_draft_capture_second_size_of_a_bucket_launches_known_keys():
    """Draft graphs at 32 then 24 (one bucket for rows bs and 4 * bs): every launch of the
    chain's kernels (not attention) at 24 reuses a key that 32 compiled."""
    sizes = (24, 32)
    assert len(representative_sizes(sizes, (1, 4))) == 1
    drafter = _gpu_drafter(sizes)
    seen: dict[int, set] = {}
    orig = drafter.decode_graphs._forward

    def forward(bs):
        with keys.KeyRecorder() as rec:
            out = orig(bs)
        seen.setdefault(bs, set()).update((n, k) for n, ks in rec.keys.items() for k in ks)
        return out

    drafter.decode_graphs._forward = forward
    drafter.capture_graphs()
    assert drafter.decode_graphs.captured_sizes == [24, 32]
    assert seen[24] <= seen[32], sorted(n for n, _ in seen[24] - seen[32])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_draft_capture_second_size_of_a_bucket_compiles_nothing():
    """The same with Triton's own count (every kernel, attention's included): capturing 24
    after 32 compiles nothing, in either draft forward; 32 compiled what it needed."""
    drafter = _gpu_drafter((24, 32))
    drafter.capture_graphs()
    for f in (drafter.decode_graphs, drafter.multi_step_graphs):
        assert f.captured_sizes == [24, 32]
        assert f.stats.compiles[24] == 0, (f.name, dict(f.stats.compiles), f.stats.summary())
    assert f"compiles {drafter.decode_graphs.stats.total_compiles}" in drafter.decode_graphs.stats.summary()


# ------------------------------------------------------------------ the whole chain, on CPU
def _chain_keys(run, sizes):
    """Keys of the chain's kernels (attention excluded: not these modules) per size."""
    out = {}
    for bs in sizes:
        with torch.inference_mode(), keys.KeyRecorder() as rec:
            run(bs)
        out[bs] = {(n, k) for n, ks in rec.keys.items() for k in ks}
    return out


@pytest.mark.parametrize("sizes", [(2, 3), (5, 6)])
def test_drafter_decode_one_key_set_per_bucket(sizes):
    """The drafter's whole decode draft (first step + multi-step, the code its graphs capture)
    at two sizes of one bucket, an odd and an even one (row slices of persistent buffers at
    offsets of step * bs: pointer alignment), launches the same keys."""
    from tests.drafter_harness import make_setup

    assert len(representative_sizes(sizes, (1, 4))) == 1
    s = make_setup(steps=3, page_size=16, hot=True, seed=1, dtype="bfloat16",
                   max_running_requests=8, cuda_graph_max_bs=8, kernel_backend="triton")
    s.drafter._reset_neutral()
    keys = _chain_keys(s.drafter._decode, sizes)
    a, b = sizes
    assert keys[a] == keys[b], sorted({n for n, _ in keys[a] ^ keys[b]})


def test_engine_verify_one_key_set_per_bucket():
    from graphdraft.serving.engine import Engine
    from tests.engine_harness import make_models, runtime

    target, head = make_models(dtype=torch.bfloat16, draft_vocab=40, layers=2)
    cfg = runtime(dtype="bfloat16", kernel_backend="triton", max_running_requests=8,
                  cuda_graph_max_bs=8, max_num_batched_tokens=64)
    e = Engine(target, cfg, head)
    e.inputs.pad_rows(0, cfg.max_bs)
    e.inputs.pad_tokens(0, cfg.max_bs * e.n_row)
    keys = _chain_keys(lambda bs: e.mode.verify(bs, n=e.n_row), (5, 6))  # aux into the drafter
    assert keys[5] == keys[6], sorted({n for n, _ in keys[5] ^ keys[6]})


# ------------------------------------------------------------------ precompile_engine
@pytest.mark.parametrize("parallel", [False, True])
def test_precompile_engine_runs_one_size_per_bucket(monkeypatch, parallel):
    """With graphs 'available' (the side-stream call replaced by a plain call): every captured
    forward of the engine and its drafter runs at its representative sizes, the drafter's
    buffers are reset before and after, compiles are counted per forward."""
    import threading
    from types import SimpleNamespace

    from capture import CapturedForward, GraphRegistry
    from capture import graphs as graphs_mod

    calls, lock = [], threading.Lock()
    monkeypatch.setattr(graphs_mod, "graphs_available", lambda: True)
    monkeypatch.setattr(CapturedForward, "_run_side",
                        lambda self, bs, stream: self._forward(bs))

    def fwd(name):
        def f(bs):
            with lock:
                calls.append((name, bs, threading.current_thread().name))
            return torch.zeros(bs)
        return f

    sched = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    counter = {"n": 0}
    cf = {name: CapturedForward(name, fwd(name), sched, compile_counter=lambda: counter["n"])
          for name in ("target_verify", "draft_decode", "draft_multi_step")}
    resets = []
    drafter_graphs = GraphRegistry()
    drafter_graphs.add("draft_decode", None, cf["draft_decode"])
    drafter_graphs.add("draft_multi_step", None, cf["draft_multi_step"])
    registry = GraphRegistry()
    registry.add("target_verify", None, cf["target_verify"])
    registry.extend(drafter_graphs)
    drafter = SimpleNamespace(graphs=lambda: drafter_graphs,
                              _reset_neutral=lambda: resets.append(len(calls)))
    engine = SimpleNamespace(cfg=SimpleNamespace(spec_num_tokens=4), graph_registry=registry,
                             drafter=drafter)
    counts = warmup.precompile_engine(engine, progress=False, parallel=parallel)
    assert set(counts) == set(cf) and all(v == 0 for v in counts.values())
    reps = representative_sizes(sched, (1, 4))
    for name in cf:
        assert [bs for n, bs, _ in calls if n == name] == reps, name
        assert sorted(cf[name].stats.precompile_seconds) == sorted(reps)
    assert resets == [0, len(calls)]
    threads = {t for _, _, t in calls}
    if parallel:  # in the pool's threads (one may take both owners when the first is quick)
        assert threads and all(t.startswith("jit-warmup") for t in threads)
    else:
        assert threads == {threading.current_thread().name}
