"""Accept-rate control (graphdraft/kernels/accept_control.py): Triton kernel vs torch reference,
the realised match fraction, keyed noise, bad input."""

from __future__ import annotations

import pytest
import torch

from graphdraft.kernels.accept_control import accept_control, accept_control_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 1000


def _case(bs: int, s: int, rows: int = 9, ctx: int = 64, seed: int = 0, dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    oracle = torch.randint(0, VOCAB, (rows, ctx), generator=g, dtype=torch.int32)
    nxt = torch.randint(0, VOCAB, (bs, s + 1), generator=g).to(dtype)
    slots = torch.randperm(rows, generator=g)[:bs] if bs <= rows else torch.randint(0, rows, (bs,), generator=g)
    pos = torch.randint(0, ctx - s - 1, (bs,), generator=g, dtype=torch.int32)
    return nxt.to(DEV), slots.to(DEV), pos.to(DEV), oracle.to(DEV)


@pytest.mark.parametrize("bs,s,p,dtype", [(1, 1, 0.5, torch.int32), (5, 3, 0.7, torch.int32),
                                          (7, 5, 0.3, torch.int64), (4, 3, 0.0, torch.int32),
                                          (4, 3, 1.0, torch.int64)])
def test_matches_reference(bs, s, p, dtype):
    nxt, slots, pos, oracle = _case(bs, s, seed=bs * 10 + s, dtype=dtype)
    got, ref = nxt.clone(), nxt.clone()
    accept_control(got, slots, pos, oracle, p, 1234, VOCAB)
    accept_control_ref(ref, slots, pos, oracle, p, 1234, VOCAB)
    assert torch.equal(got, ref)
    assert torch.equal(got[:, 0], nxt[:, 0])  # column 0 (the verified token) is kept
    want = oracle[slots.long()[:, None], pos.long()[:, None] + torch.arange(1, s + 1, device=DEV)]
    hit = got[:, 1:].to(torch.int32) == want
    if p == 1.0:
        assert hit.all()
    if p == 0.0:
        assert not hit.any()
    assert ((got[:, 1:] >= 0) & (got[:, 1:] < VOCAB)).all()


def test_host_and_tensor_p_give_the_same_threshold():
    from graphdraft.kernels.accept_control import _check

    nxt, slots, pos, oracle = _case(1, 1)
    for p in (0.0, 0.1, 0.3, 0.6, 0.9, 1.0, 1 / 3):
        host, _ = _check(nxt, slots, pos, oracle, p, 0, VOCAB)
        dev = int((torch.tensor(p, dtype=torch.float32) * (1 << 24)).to(torch.int32))
        assert host == dev


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_p_as_a_device_tensor(p):
    nxt, slots, pos, oracle = _case(5, 3, seed=13)
    pt = torch.tensor([p], dtype=torch.float32, device=DEV)
    got, ref, host = nxt.clone(), nxt.clone(), nxt.clone()
    accept_control(got, slots, pos, oracle, pt, 77, VOCAB)
    accept_control_ref(ref, slots, pos, oracle, pt, 77, VOCAB)
    accept_control(host, slots, pos, oracle, p, 77, VOCAB)
    assert torch.equal(got, ref) and torch.equal(got, host)  # same threshold either way
    with pytest.raises(ValueError, match="p"):
        accept_control(got, slots, pos, oracle, pt.double(), 77, VOCAB)


def test_edges_left_unchanged_and_strided_output():
    bs, s, rows, ctx = 6, 3, 4, 16
    nxt, _, _, oracle = _case(bs, s, rows=rows, ctx=ctx, seed=5)
    oracle[2, 5:9] = -1  # unknown oracle entries
    slots = torch.tensor([1, 2, -1, rows, 3, 0], device=DEV)  # two slots out of the table
    pos = torch.tensor([0, 4, 0, 0, ctx - 2, 3], dtype=torch.int64, device=DEV)  # row 4 runs off
    table = torch.full((bs, s + 3), -5, dtype=torch.int32, device=DEV)
    table[:, 1: s + 2] = nxt  # next_tokens as a strided view inside a wider buffer
    view = table[:, 1: s + 2]
    ref = view.clone()
    accept_control(view, slots, pos, oracle, 1.0, 7, VOCAB)
    accept_control_ref(ref, slots, pos, oracle, 1.0, 7, VOCAB)
    assert torch.equal(view, ref)
    assert torch.equal(table[:, 0], torch.full((bs,), -5, dtype=torch.int32, device=DEV))
    assert torch.equal(table[:, s + 2], torch.full((bs,), -5, dtype=torch.int32, device=DEV))
    assert torch.equal(view[2], nxt[2]) and torch.equal(view[3], nxt[3])  # bad slots: unchanged
    assert torch.equal(view[1, 1:], nxt[1, 1:])  # oracle unknown at 5..7: unchanged
    assert view[4, 1] == oracle[3, ctx - 1] and torch.equal(view[4, 2:], nxt[4, 2:])  # past ctx
    assert torch.equal(view[0, 1:], oracle[1, 1: s + 1]) and torch.equal(view[5, 1:], oracle[0, 4: 4 + s])


@pytest.mark.parametrize("p", [0.25, 0.8])
def test_realised_match_fraction_kernel(p):
    bs, s = 16, 64  # 1024 drafts: sd of the fraction <= 0.016
    nxt, slots, pos, oracle = _case(bs, s, rows=17, ctx=160, seed=11)
    accept_control(nxt, slots, pos, oracle, p, 99, VOCAB)
    want = oracle[slots.long()[:, None], pos.long()[:, None] + torch.arange(1, s + 1, device=DEV)]
    frac = (nxt[:, 1:] == want).float().mean().item()
    assert abs(frac - p) < 0.06


@pytest.mark.parametrize("p", [0.4, 0.75])
def test_accept_lengths_truncated_geometric(p):
    """Chains through the reference (bit-equal to the kernel): mean accept length
    (1 - p^(S+1)) / (1 - p) and P(accept = 1) = 1 - p."""
    bs, s, rows, ctx = 4096, 3, 4097, 64
    g = torch.Generator().manual_seed(3)
    oracle = torch.randint(0, VOCAB, (rows, ctx), generator=g, dtype=torch.int32)
    nxt = torch.zeros(bs, s + 1, dtype=torch.int32)
    slots = torch.arange(1, bs + 1)
    pos = torch.randint(0, ctx - s - 1, (bs,), generator=g)
    accept_control_ref(nxt, slots, pos, oracle, p, 2024, VOCAB)
    want = oracle[slots[:, None], pos[:, None] + torch.arange(1, s + 1)]
    accept = 1 + torch.cumprod((nxt[:, 1:] == want).long(), dim=1).sum(dim=1)
    mean = (1 - p ** (s + 1)) / (1 - p)
    assert abs(accept.float().mean().item() - mean) < 0.06
    assert abs((accept == 1).float().mean().item() - (1 - p)) < 0.03


def test_keyed_noise_independent_of_row_order_and_seeded():
    nxt, slots, pos, oracle = _case(6, 4, seed=21)
    a = nxt.clone()
    accept_control(a, slots, pos, oracle, 0.5, 5, VOCAB)
    perm = torch.tensor([3, 0, 5, 1, 4, 2], device=DEV)
    b = nxt[perm].clone()
    accept_control(b, slots[perm].contiguous(), pos[perm].contiguous(), oracle, 0.5, 5, VOCAB)
    assert torch.equal(b, a[perm])  # keyed by (slot, position), not by row
    c = nxt.clone()
    accept_control_ref(c, slots, pos, oracle, 0.5, 6, VOCAB)
    assert not torch.equal(c, a)  # another seed, other draws


def test_bad_input_named_and_nothing_written():
    nxt, slots, pos, oracle = _case(3, 3, seed=2)
    before = nxt.clone()
    for kwargs, name in ((dict(p=1.5), "p"), (dict(seed=-1), "seed"), (dict(seed=2**31), "seed"),
                         (dict(vocab_size=1), "vocab_size"),
                         (dict(slots=slots[:2]), "slots"), (dict(positions=pos.float()), "positions"),
                         (dict(oracle=oracle.long()), "oracle"),
                         (dict(next_tokens=nxt.float()), "next_tokens")):
        args = dict(next_tokens=nxt, slots=slots, positions=pos, oracle=oracle, p=0.5, seed=1,
                    vocab_size=VOCAB)
        args.update(kwargs)
        for fn in (accept_control, accept_control_ref):
            with pytest.raises(ValueError, match=name):
                fn(**args)
    assert torch.equal(nxt, before)


@pytest.mark.gpu
def test_graph_replay_matches_reference():
    nxt, slots, pos, oracle = _case(8, 3, seed=8)
    buf = nxt.clone()
    accept_control(buf, slots, pos, oracle, 0.6, 42, VOCAB)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    pt = torch.tensor([0.6], device="cuda")
    with torch.cuda.graph(g):
        accept_control(buf, slots, pos, oracle, pt, 42, VOCAB)
    for p in (0.6, 0.1, 0.9):  # one graph, every regime
        pt.fill_(p)
        buf.copy_(nxt)
        pos.add_(5)  # live inputs change between replays
        g.replay()
        ref = nxt.clone()
        accept_control_ref(ref, slots, pos, oracle, p, 42, VOCAB)  # host p: the same threshold
        torch.cuda.synchronize()
        assert torch.equal(buf, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_kernel_matches_reference_at_8b_shape(dtype):
    """bs 256, S 3, vocab 128256, oracle [257, 4096], on the device."""
    bs, s, rows, ctx, vocab = 256, 3, 257, 4096, 128256
    g = torch.Generator().manual_seed(4)
    oracle = torch.randint(0, vocab, (rows, ctx), generator=g, dtype=torch.int32).cuda()
    nxt = torch.randint(0, vocab, (bs, s + 1), generator=g).to(dtype).cuda()
    slots = torch.randperm(rows, generator=g)[:bs].cuda()
    pos = torch.randint(0, ctx, (bs,), generator=g, dtype=torch.int32).cuda()  # some run off the end
    got, ref = nxt.clone(), nxt.clone()
    accept_control(got, slots, pos, oracle, 0.7, 31337, vocab)
    accept_control_ref(ref, slots, pos, oracle, 0.7, 31337, vocab)
    assert torch.equal(got, ref)
