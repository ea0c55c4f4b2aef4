"""Serving loop: lossless greedy speculative decoding, rejection sampling, lifecycle."""

from __future__ import annotations

import random

import pytest
import torch

from graphdraft.ops import rope_cos_sin_cache
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams, verify_sampled
from tests.engine_harness import TARGET, ScriptedDrafter, make_models, runtime


def dense_greedy(target, prompt: list[int], max_new: int) -> list[int]:
    """Target-only greedy decoding by full recomputation: no KV cache, no paging, float64."""
    cfg = target.config
    w = {n: p.detach().double() for n, p in target.named_parameters()}
    cs = rope_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta).double()
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w[name]

    def rope(x, n):  # x [n, heads, d]
        cos, sin = cs[:n, : d // 2].unsqueeze(1), cs[:n, d // 2:].unsqueeze(1)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    ids = list(prompt)
    for _ in range(max_new):
        n = len(ids)
        h = w["embed_tokens"][torch.tensor(ids)]
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            qkv = rms(h, p + "input_layernorm.weight") @ w[p + "self_attn.qkv_proj"].T
            q = rope(qkv[:, : hq * d].view(n, hq, d), n)
            k = rope(qkv[:, hq * d: (hq + hkv) * d].view(n, hkv, d), n)
            v = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
            k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
            att = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
            att = att.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, hq * d)
            h = h + o @ w[p + "self_attn.o_proj"].T
            gu = rms(h, p + "post_attention_layernorm.weight") @ w[p + "mlp.gate_up_proj"].T
            f = gu.shape[1] // 2
            h = h + (torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]) @ w[p + "mlp.down_proj"].T
        logits = rms(h[-1], "norm.weight") @ w["lm_head"].T
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def prompts(seed: int, count: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TARGET.vocab_size) for _ in range(rng.randint(lo, hi))]
            for _ in range(count)]


def target_only(target, cfg, ps, max_new):
    eng = Engine(target, cfg)
    return eng.generate(ps, SamplingParams(max_new_tokens=max_new))


def test_target_only_matches_dense_recomputation():
    target, _ = make_models(0)
    ps = prompts(1, 3)
    got = target_only(target, runtime(max_num_batched_tokens=16), ps, 12)  # chunked prefill
    for p, g in zip(ps, got, strict=True):
        assert g == dense_greedy(target, p, 12)
    assert len(set(tuple(g) for g in got)) > 1  # not a degenerate model


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_speculative_greedy_equals_target_only(steps, page_size):
    target, head = make_models(steps, draft_vocab=40 if steps % 2 else None)
    ps = prompts(steps * 10 + page_size, 7)
    cfg = runtime(speculative_num_steps=steps, page_size=page_size)
    expected = target_only(target, cfg, ps, 14)
    eng = Engine(target, cfg, head)
    # staggered arrivals: some requests join while others decode
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=14)) for p in ps[:3]]
    eng.step()
    reqs += [eng.add_request(p, SamplingParams(max_new_tokens=14)) for p in ps[3:5]]
    eng.step()
    eng.step()
    reqs += [eng.add_request(p, SamplingParams(max_new_tokens=14)) for p in ps[5:]]
    while eng.has_work:
        eng.step()
    assert [r.output for r in reqs] == expected
    assert eng.stats.decode_rows > 0


def test_decode_steps_run_the_cycle_not_drafter_run():
    """Pure decode steps run the cycle (the drafter's decode body inside it: no `run` call,
    no staging copy; the target's aux hidden states land in the drafter's buffer); only
    prefill / mixed steps call `draft_mixed` (`run`'s body: zero-copy view, no deferred device
    checks). Output still equals target-only."""
    target, head = make_models(3)
    ps = prompts(5, 3)
    cfg = runtime(speculative_num_steps=3)
    expected = target_only(target, cfg, ps, 10)
    eng = Engine(target, cfg, head)
    real_run, seen = eng.drafter._run, []

    def run(ctx, hidden, tokens, accept, copy_output, **kw):
        seen.append(ctx.num_extends > 0)
        assert copy_output is False and kw == {"device_checks": False}
        return real_run(ctx, hidden, tokens, accept, copy_output, **kw)

    eng.drafter._run = run
    assert eng.generate(ps, SamplingParams(max_new_tokens=10)) == expected
    assert seen and all(seen)
    assert eng.graph_summary()["spec_cycle"][1] > 0  # cycles ran (eagerly on CPU)
    assert eng.graph_summary()["draft_decode"] == (0, 0)


def test_target_rejects_a_bad_aux_out():
    target, _ = make_models(0)
    ids = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="^aux_out: "):
        target(ids, ids, ids, None, None, None, aux_out=torch.zeros(4, 3))


@pytest.mark.parametrize("mode", ["oracle", "random"])
def test_scripted_drafts_full_acceptance_and_rejection(mode):
    target, _ = make_models(3)
    ps = prompts(7, 5)
    cfg = runtime(speculative_num_steps=3)
    expected = target_only(target, cfg, ps, 16)
    eng = Engine(target, cfg, drafter=None)
    exp_map = {tuple(p): p + e for p, e in zip(ps, expected, strict=True)}
    eng = Engine(target, cfg, drafter=ScriptedDrafter.__new__(ScriptedDrafter))
    eng.drafter.__init__(eng, mode, seed=3, expected=exp_map)
    out = eng.generate(ps, SamplingParams(max_new_tokens=16))
    assert out == expected
    if mode == "oracle":
        assert eng.stats.mean_accept_length > 3.5  # every draft accepted (N = 4)
    else:
        assert eng.stats.mean_accept_length < 1.3


def test_pages_returned_and_committed_kv_never_overwritten():
    target, head = make_models(5)
    cfg = runtime(speculative_num_steps=2, page_size=4)
    eng = Engine(target, cfg, head)
    free0 = eng.pages.num_free_pages
    for p in prompts(3, 6):
        eng.add_request(p, SamplingParams(max_new_tokens=10))
    pools = [eng.kv, eng.drafter.kv_pool]
    while eng.has_work:
        snap = {}
        eng.drain()  # the committed lengths are device state: read them settled
        for r in eng.running:
            pages = eng.pages.pages_of(r.slot)
            committed = int(eng.states.valid_cache_lengths[r.slot])
            slots = [pages[q // 4] * 4 + q % 4 for q in range(committed)]
            snap[r.rid] = (slots, [(k[slots].clone(), v[slots].clone())
                                   for pool in pools for k, v in zip(pool.k, pool.v, strict=True)])
        eng.step()
        for r in eng.running:
            if r.rid in snap:
                slots, before = snap[r.rid]
                after = [(k[slots], v[slots]) for pool in pools
                         for k, v in zip(pool.k, pool.v, strict=True)]
                for (k0, v0), (k1, v1) in zip(before, after, strict=True):
                    assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert eng.pages.num_free_pages == free0
    assert eng.pages.num_free_slots == cfg.max_running_requests
    assert int(eng.states.valid_cache_lengths.abs().sum()) == 0


def test_back_pressure_queues_and_rejects_impossible():
    target, head = make_models(6)
    cfg = runtime(num_kv_pages=24, page_size=4)  # room for about two requests at a time
    eng = Engine(target, cfg, head)
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request([1] * 100, SamplingParams(max_new_tokens=50))  # can never fit
    for bad in ([TARGET.vocab_size], [], [3, -1, 4], [3, 1.0], [3, "4"], [2] * 50 + [None]):
        with pytest.raises(ValueError, match=r"prompt: expected a non-empty list of token ids"):
            eng.add_request(bad, SamplingParams())
    assert not eng.waiting  # nothing queued by the rejected calls
    ps = prompts(4, 6, lo=10, hi=20)
    expected = target_only(target, runtime(), ps, 12)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=12)) for p in ps]
    eng.step()
    assert eng.waiting, "pool too small for all: some must queue"
    while eng.has_work:
        eng.step()
    assert [r.output for r in reqs] == expected
    assert eng.pages.num_free_pages == 24


def test_stop_tokens_and_abort():
    target, head = make_models(8)
    p = prompts(9, 1)[0]
    full = target_only(target, runtime(), [p], 12)[0]
    stop = full[5]
    eng = Engine(target, runtime(), head)
    r = eng.add_request(p, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)))
    other = eng.add_request(p, SamplingParams(max_new_tokens=12))
    eng.step()
    eng.abort(other)
    while eng.has_work:
        eng.step()
    assert r.output == full[: full.index(stop) + 1] and r.finish_reason == "stop"
    assert other.finish_reason == "abort"


def test_bad_sampling_params():
    for kw, name in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                     ({"top_k": -2}, "top_k"), ({"max_new_tokens": 0}, "max_new_tokens")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw)


def test_rejection_sampling_matches_target_distribution():
    """Emitted tokens ~ target distribution: first token ~ p0, second | first == d1 ~ p1.

    20,000 independent rows; total-variation distance to the exact law < 0.02
    (the expected TV of 20k samples over 8 outcomes is about 0.008).
    """
    torch.manual_seed(0)
    v, n, rows = 8, 3, 20000
    logits = torch.randn(n, v) * 1.5
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.95)
    from graphdraft.serving.verify import target_probs
    p = target_probs(logits, params)
    drafts = torch.tensor([0, int(p[0].argmax()), int(p[1].argmax())])
    cand = drafts.expand(rows, n).contiguous()
    out, acc = verify_sampled(cand, logits.repeat(rows, 1), params, torch.Generator().manual_seed(1))
    out = out.view(rows, n)
    first = torch.bincount(out[:, 0], minlength=v).double() / rows
    assert 0.5 * (first - p[0].double()).abs().sum() < 0.02
    sel = out[:, 0] == drafts[1]
    second = torch.bincount(out[sel, 1], minlength=v).double() / int(sel.sum())
    assert 0.5 * (second - p[1].double()).abs().sum() < 0.03
    assert ((acc >= 1) & (acc <= n)).all()
    # filtered-out tokens are never emitted
    assert first[p[0] == 0].sum() == 0


def test_sampled_generation_reproducible_with_seed():
    target, head = make_models(2)
    ps = prompts(2, 2)
    params = SamplingParams(max_new_tokens=10, temperature=0.8, seed=123)
    a = Engine(target, runtime(), head).generate(ps, params)
    b = Engine(target, runtime(), head).generate(ps, params)
    assert a == b


def _drain_outputs(engine: Engine, reqs: list) -> list[list[int]]:
    while engine.has_work:
        engine.step()
    return [list(r.output) for r in reqs]


def test_seed_stream_reproduces_a_request_whatever_came_before():
    """`add_request(seed_stream=i)`: the key is request_seed(seed, i), not the Engine's count
    of earlier requests with that seed; the count is untouched; bad values name the argument."""
    target, head = make_models(2)
    p = prompts(1, 2)[0]
    params = SamplingParams(max_new_tokens=10, temperature=0.8, seed=123)
    eng = Engine(target, runtime(), head)
    first = _drain_outputs(eng, [eng.add_request(p, params, seed_stream=i) for i in range(2)])
    again = _drain_outputs(eng, [eng.add_request(p, params, seed_stream=i) for i in range(2)])
    assert first == again and first[0] != first[1]
    counted = Engine(target, runtime(), head)  # no seed_stream: streams 0, 1 by count
    assert _drain_outputs(counted, [counted.add_request(p, params) for _ in range(2)]) == first
    for bad, why in ((-1, params), (True, params), (0, SamplingParams(temperature=0.8))):
        with pytest.raises(ValueError, match="^seed_stream: expected"):
            eng.add_request(p, why, seed_stream=bad)
    assert not eng.has_work


def test_generate_progress_bar_shows_no_rate_off_a_gpu(capsys):
    """`generate(progress=True)` on a CPU counts tokens but prints no tokens/s: a rate measured
    off a GPU is no performance figure (the outputs are those of a run without the bar)."""
    target, head = make_models(3)
    ps = prompts(5, 2)
    cfg = runtime()
    out = Engine(target, cfg, head).generate(ps, SamplingParams(max_new_tokens=6), progress=True)
    err = capsys.readouterr().err
    assert "tokens: 12/12" in err and "tok/s" not in err and "it/s" not in err, err
    assert out == Engine(target, cfg, head).generate(ps, SamplingParams(max_new_tokens=6))
