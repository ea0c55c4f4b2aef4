"""Log-probabilities (issue #43 item 1): the `token_logprobs` kernel against torch, and the
Engine's `logprobs` / `top_logprobs` / `prompt_logprobs`: a speculative run (chain and tree)
returns, for the same tokens, what a target-only run returns (fp32: within 1e-5) at every
position of a verify window (accepted drafts and corrections), which is the log_softmax of the
target's logits over the whole sequence; bad values are named errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphdraft
from graphdraft import ops
from graphdraft.config import RuntimeConfig
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.logprobs import pack_width, unpack_row
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.checkpoint_fixtures import full_logits
from tests.engine_harness import runtime

ASSETS = Path(graphdraft.__file__).resolve().parent / "assets"
TOL = 1e-5
"""fp32: |a - b| <= TOL * max(1, |b|) (absolute for log-probabilities in [-1, 0]); a
top entry deep in the tail (log-probability -8 and below) inherits the fp32 rounding of its
logit, which differs by ~1e-6 relative between a tree-masked verify forward and a one-token
decode forward (the kernels themselves are exact against torch: the kernel test below)."""
SERVE = dict(max_running_requests=3, cuda_graph_max_bs=3, max_num_batched_tokens=24,
             max_context_len=128, dtype="float32")
TREE = dict(speculative_eagle_topk=4, speculative_num_draft_tokens=8)


# --- the kernel ------------------------------------------------------------------------
def _kernel_case(seed: int, rows: int, n: int, v: int, k: int, with_rows: bool):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows * n + 3, v, generator=g) * 3
    logits[::2, 7] = logits[::2].amax(1) + 1  # even rows: a tie for the best value ...
    logits[:, :5] = logits[:, 7:8]  # ties: the lower id first
    logits[:, v - 1] = logits[:, 7]  # ... across V blocks too (v = 5000)
    logits[1::2, v - 2] = logits[1::2].amax(1) + 1  # odd rows: the best in the last block
    tokens = torch.randint(0, v, (rows, n), generator=g)
    slots = torch.arange(rows) % 5  # slot 0: inert
    widths = torch.tensor([-1, 0, k, -1, 2], dtype=torch.int32)
    done = torch.tensor([0, 0, 0, 0, 1 if rows > 4 else 0], dtype=torch.int32)
    lrows = (torch.randperm(rows * n + 3, generator=g)[: rows * n].view(rows, n)
             if with_rows else None)
    return logits, tokens, slots, widths, done, lrows


@pytest.mark.parametrize("with_rows", [False, True])
@pytest.mark.parametrize("v", [37, 300, 5000])  # 5000: two V blocks
def test_kernel_matches_torch_and_log_softmax(with_rows, v, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows, n, k = 6, 3, 4
    logits, tokens, slots, widths, done, lrows = _kernel_case(v, rows, n, v, k, with_rows)
    outs = {}
    for backend in ("torch", "triton"):
        out = torch.full((rows, pack_width(n + 1, k) + 5), -7, dtype=torch.int32)
        view = out[:, 5:]  # a row view at an offset, as the pack's
        ops.token_logprobs(logits, tokens, slots, widths, out=view, k=k, logit_rows=lrows,
                           done=done, kernels=KernelConfig(backend=backend))
        outs[backend] = out
        assert torch.equal(out[:, :5], torch.full((rows, 5), -7, dtype=torch.int32))
    idx = lrows if lrows is not None else torch.arange(rows * n).view(rows, n)
    for r in range(rows):
        s = int(slots[r])
        w = int(widths[s])
        asked = s != 0 and w >= 0 and not done[s]
        for backend, out in outs.items():
            region = out[r, 5:]
            if not asked:  # untouched
                assert torch.equal(region, torch.full_like(region, -7)), (backend, r)
                continue
            lps, tops = unpack_row(region, n + 1, k, n, w)
            for j in range(n):
                ref = torch.log_softmax(logits[idx[r, j]].double(), -1)
                assert abs(lps[j] - float(ref[tokens[r, j]])) < TOL, (backend, r, j)
                order = sorted(range(v), key=lambda t: (-float(logits[idx[r, j], t]), t))[:w]
                assert [t for t, _ in tops[j]] == order, (backend, r, j)
                assert all(abs(lp - float(ref[t])) < TOL for t, lp in tops[j])
                assert [lp for _, lp in tops[j]] == sorted((lp for _, lp in tops[j]), reverse=True)


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), v=st.sampled_from([3, 9, 4096, 4097, 9000]),
       rows=st.integers(1, 4), n=st.integers(1, 4), k=st.integers(0, 6),
       with_accept=st.booleans(), ties=st.booleans())
def test_split_kernel_equals_torch_on_random_cases(seed, v, rows, n, k, with_accept, ties,
                                                    monkeypatch):
    """The two-launch kernel (V blocks read once, their best entries merged) writes exactly
    what the torch path writes: the same ids (ties across blocks: the lower id first), the
    same log-probabilities to fp32 rounding, nothing past a row's accept length, nothing for
    slots that asked none, no top entry past the vocabulary (w > V)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows * n, v, generator=g) * 4
    if ties:  # the best value repeated in every V block
        logits[:, :: max(1, v // 5)] = logits.amax(1, keepdim=True) + 1
    tokens = torch.randint(0, v, (rows, n), generator=g)
    slots = torch.randint(0, 4, (rows,), generator=g)
    widths = torch.randint(-1, k + 1, (4,), generator=g).to(torch.int32)
    accept = torch.randint(0, n + 1, (rows,), generator=g) if with_accept else None
    outs = []
    for backend in ("torch", "triton"):
        out = torch.full((rows, pack_width(n, k)), -7, dtype=torch.int32)
        ops.token_logprobs(logits, tokens, slots, widths, out=out, k=k, accept=accept,
                           kernels=KernelConfig(backend=backend))
        outs.append(out)
    ref, got = outs
    lp_ref, lp_got = ref.view(torch.float32), got.view(torch.float32)
    exact = (ref == got) | ((lp_ref - lp_got).abs() <= 1e-5)
    assert bool(exact.all()), (ref, got)
    ids = slice(n, n + n * k)
    assert torch.equal(ref[:, ids], got[:, ids])
    if accept is not None:
        for r in range(rows):
            past = got[r, int(accept[r]): n]
            assert torch.equal(past, torch.full_like(past, -7))


def test_accept_limits_the_written_positions(monkeypatch):
    """`accept`: positions j >= accept[r] are left as they were (both paths); the accepted
    ones carry what a run without `accept` writes."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows, n, k, v = 6, 3, 4, 300
    logits, tokens, slots, widths, done, _ = _kernel_case(1, rows, n, v, k, False)
    accept = torch.tensor([3, 0, 1, 2, 3, 1])
    for backend in ("torch", "triton"):
        kc = KernelConfig(backend=backend)
        full = torch.full((rows, pack_width(n, k)), -7, dtype=torch.int32)
        cut = full.clone()
        ops.token_logprobs(logits, tokens, slots, widths, out=full, k=k, done=done, kernels=kc)
        ops.token_logprobs(logits, tokens, slots, widths, out=cut, k=k, done=done,
                           accept=accept, kernels=kc)
        for r in range(rows):
            for j in range(n):
                cols = [j, *range(n + j * k, n + (j + 1) * k),
                        *range(n + n * k + j * k, n + n * k + (j + 1) * k)]
                want = full[r, cols] if j < accept[r] else torch.full((len(cols),), -7,
                                                                     dtype=torch.int32)
                assert torch.equal(cut[r, cols], want), (backend, r, j)
    with pytest.raises(ValueError, match="accept"):
        ops.token_logprobs(logits, tokens, slots, widths, out=cut, k=k,
                           accept=torch.zeros(rows + 1, dtype=torch.int64))


def test_kernel_rejects_bad_arguments():
    logits = torch.zeros(4, 9)
    tok = torch.zeros(2, 2, dtype=torch.int64)
    slots, widths = torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="out"):
        ops.token_logprobs(logits, tok, slots, widths, out=torch.zeros(2, 3, dtype=torch.int32), k=1)
    with pytest.raises(ValueError, match="out"):
        ops.token_logprobs(logits, tok, slots, widths, out=torch.zeros(2, 6), k=1)
    with pytest.raises(ValueError, match="logits"):
        ops.token_logprobs(logits[:3], tok, slots, widths,
                           out=torch.zeros(2, 6, dtype=torch.int32), k=1)


# --- the Engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained():
    """The shipped pair in float32: it accepts several drafts a cycle (accepted drafts and
    corrections at every position of a window)."""
    from graphdraft.io.checkpoint import load_model_pair
    from graphdraft.train.evaluate import prompt_ids
    target, head, _ = load_model_pair(ASSETS / "target", ASSETS / "eagle3", dtype="float32")
    prompts = [p[: 18 + 4 * i] for i, p in enumerate(prompt_ids(4, 96))]
    return target, head, prompts


def _params(**kw) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=m, logprobs=w, **kw)
            for m, w in zip((10, 7, 12, 8), (5, 0, 20, 3), strict=True)]


def _assert_same_logprobs(spec, ref) -> None:
    for a, b in zip(spec, ref, strict=True):
        assert a.output == b.output
        assert len(a.logprobs) == len(a.output) == len(a.top_logprobs)
        assert all(abs(x - y) <= TOL * max(1.0, abs(y))
                   for x, y in zip(a.logprobs, b.logprobs, strict=True))
        for ta, tb in zip(a.top_logprobs, b.top_logprobs, strict=True):
            assert len(ta) == len(tb) == a.params.logprobs
            assert [t for t, _ in ta] == [t for t, _ in tb]
            assert all(abs(x - y) <= TOL * max(1.0, abs(y))
                       for (_, x), (_, y) in zip(ta, tb, strict=True))


def _run(target, head, prompts, params, **kw):
    e = Engine(target, runtime(**SERVE, **kw), head)
    return e, e.generate_requests(prompts, params)


@pytest.fixture(scope="module")
def target_only(trained):
    """Target-only runs of the greedy and the sampled params (computed once)."""
    target, _, prompts = trained
    return {sampled: _run(target, None, prompts, _sampled_params(sampled))[1]
            for sampled in (False, True)}


def _sampled_params(sampled: bool) -> list[SamplingParams]:
    return _params(temperature=0.8, top_k=12, seed=5) if sampled else _params()


@pytest.mark.parametrize("kind, sampled", [("chain", False), ("chain", True), ("tree", False)])
def test_speculative_logprobs_equal_target_only(trained, target_only, kind, sampled):
    """Sampled: the chain samples target-only's token stream exactly (Philox per position);
    sampled tree acceptance draws other (equally exact) streams: the next test checks its
    values against the sequence's logits instead."""
    target, head, prompts = trained
    params, ref = _sampled_params(sampled), target_only[sampled]
    e, spec = _run(target, head, prompts, params, **(TREE if kind == "tree" else {}))
    assert e.stats.accepted_tokens > e.stats.decode_rows  # drafts were accepted
    _assert_same_logprobs(spec, ref)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_logprobs_are_log_softmax_of_the_sequence_logits(trained, kind):
    """Independent of the engines: each emitted token's entry is log_softmax of the target's
    logits over prompt + output at its position (the model's distribution at temperature 1:
    no truncation, also for a sampled top-k request)."""
    target, head, prompts = trained
    p = SamplingParams(max_new_tokens=10, logprobs=4, temperature=0.7, top_k=3, seed=1)
    _, (r,) = _run(target, head, prompts[:1], [p], **(TREE if kind == "tree" else {}))
    ids = r.prompt + r.output
    lsm = torch.log_softmax(full_logits(target, ids[:-1]).double(), -1)
    for i, tok in enumerate(r.output):
        row = lsm[len(r.prompt) - 1 + i]
        assert abs(r.logprobs[i] - float(row[tok])) < 1e-4
        best = torch.sort(row, descending=True, stable=True)
        assert [t for t, _ in r.top_logprobs[i]] == best.indices[:4].tolist()


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_prompt_logprobs_equal_log_softmax_of_the_prefill_logits(trained, kind):
    """Prompts over several prefill chunks (24-token budget), beside decode rows."""
    target, head, prompts = trained
    params = [SamplingParams(max_new_tokens=6, prompt_logprobs=w) for w in (3, None, 0, 20)]
    _, reqs = _run(target, head, prompts, params, **(TREE if kind == "tree" else {}))
    for r, p in zip(reqs, params, strict=True):
        if p.prompt_logprobs is None:
            assert r.prompt_logprobs is None and r.prompt_top_logprobs is None
            continue
        assert len(r.prompt_logprobs) == len(r.prompt) == len(r.prompt_top_logprobs)
        assert r.prompt_logprobs[0] is None and r.prompt_top_logprobs[0] == []
        lsm = torch.log_softmax(full_logits(target, r.prompt).double(), -1)
        for i in range(1, len(r.prompt)):
            assert abs(r.prompt_logprobs[i] - float(lsm[i - 1, r.prompt[i]])) < 1e-4, i
            top = r.prompt_top_logprobs[i]
            assert len(top) == p.prompt_logprobs
            assert [t for t, _ in top] == torch.sort(lsm[i - 1], descending=True,
                                                     stable=True).indices[: len(top)].tolist()


def test_requests_without_logprobs_carry_none(trained):
    target, head, prompts = trained
    _, (r,) = _run(target, head, prompts[:1], [SamplingParams(max_new_tokens=4)])
    assert r.logprobs is None and r.top_logprobs is None and r.prompt_logprobs is None


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("bad", [21, -1, "3", True, 2.0])
def test_bad_logprobs_values_name_the_field(field, bad):
    with pytest.raises(ValueError, match=rf"^{field}: expected None or an int in \[0, 20\]"):
        SamplingParams(**{field: bad})


def test_engine_limit_and_config_are_named(trained):
    target, _, prompts = trained
    e = Engine(target, runtime(**SERVE, max_logprobs=2), None)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"params.{field}: expected at most 2 "
                                             r"\(RuntimeConfig.max_logprobs\), got 3"):
            e.add_request(prompts[0], SamplingParams(**{field: 3}))
    assert not e.waiting
    with pytest.raises(ValueError, match="max_logprobs"):
        RuntimeConfig(max_logprobs=21)


# --- the graph path (CUDA) -------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_graph_logprobs_equal_target_only_on_gpu(kind):
    """Captured cycles (Triton kernels, CUDA graphs), fp32: speculative == target-only."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from graphdraft.io.checkpoint import load_model_pair
    from graphdraft.train.evaluate import prompt_ids
    target, head, _ = load_model_pair(ASSETS / "target", ASSETS / "eagle3", dtype="float32",
                                      device="cuda")
    prompts = [p[: 18 + 4 * i] for i, p in enumerate(prompt_ids(4, 96))]
    params = _params()
    out = {}
    for name, h, kw in (("ref", None, {}), ("spec", head, TREE if kind == "tree" else {})):
        e = Engine(target, runtime(**{**SERVE, "device": "cuda"}, **kw), h)
        e.capture_graphs(progress=False)
        out[name] = e.generate_requests(prompts, params)
        assert sum(r for r, _ in e.graph_summary().values()) > 0  # the graphs ran
    _assert_same_logprobs(out["spec"], out["ref"])


@pytest.mark.gpu
def test_split_kernel_equals_torch_at_the_8b_vocabulary_on_gpu():
    """The compiled two-launch kernel at the 8B target's vocabulary (128,256 ids: 32 blocks of
    4,096), bf16 and fp32 logits, 64 rows of 4 positions, widths up to 20 and accept lengths:
    the torch path's ids exactly, its log-probabilities to fp32 rounding, nothing elsewhere."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(3)
    rows, n, k, v = 64, 4, 20, 128256
    tokens = torch.randint(0, v, (rows, n), device="cuda", generator=g)
    slots = torch.randint(0, 6, (rows,), device="cuda", generator=g)
    widths = torch.tensor([-1, 0, 5, 20, -1, 1], dtype=torch.int32, device="cuda")
    accept = torch.randint(0, n + 1, (rows,), device="cuda", generator=g)
    for dt in (torch.bfloat16, torch.float32):
        logits = (torch.randn(rows * n, v, device="cuda", generator=g) * 4).to(dt)
        logits[:, 4096:: 4096] = logits.amax(1, keepdim=True)  # ties across blocks
        outs = []
        for backend in ("torch", "triton"):
            out = torch.full((rows, pack_width(n, k)), -7, dtype=torch.int32, device="cuda")
            ops.token_logprobs(logits, tokens, slots, widths, out=out, k=k, accept=accept,
                               kernels=KernelConfig(backend=backend))
            outs.append(out)
        ref, got = outs
        assert torch.equal(ref[:, n: n + n * k], got[:, n: n + n * k]), dt
        close = (ref == got) | ((ref.view(torch.float32) - got.view(torch.float32)).abs() <= 1e-4)
        assert bool(close.all()), dt


@pytest.mark.gpu
def test_logprobs_add_no_host_sync_on_gpu():
    """The same greedy requests with logprobs 5 take no more synchronizing CUDA calls than
    without (torch's sync debug mode counts them) over the whole run: the log-probabilities
    come back in the step's one copy."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import warnings

    from graphdraft.io.checkpoint import load_model_pair
    from graphdraft.train.evaluate import prompt_ids
    target, head, _ = load_model_pair(ASSETS / "target", ASSETS / "eagle3", dtype="float32",
                                      device="cuda")
    prompts = [p[:24] for p in prompt_ids(4, 96)]
    counts = {}
    for width in (None, 5):
        e = Engine(target, runtime(**{**SERVE, "device": "cuda"}), head)
        e.capture_graphs(progress=False)
        params = SamplingParams(max_new_tokens=16, logprobs=width)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                reqs = e.generate_requests(prompts, params)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[width] = sum("synchroniz" in str(w.message) for w in caught)
        assert all(len(r.output) == 16 or r.finish_reason == "stop" for r in reqs)
    # the first engine of the process may pay a one-time sync (lazy initialisation): at most
    # as many with logprobs as without
    assert counts[5] <= counts[None], counts


# --- the CLI -----------------------------------------------------------------------------
def test_cli_logprobs_json_jsonl_keys_and_bad_values(tmp_path, capsys):
    import json

    from graphdraft.serving.cli import main
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "def f(x):", "logprobs": 1, "prompt_logprobs": 2}) + "\n"
                 + json.dumps({"prompt": "import os"}) + "\n")
    base = ["generate", "--device", "cpu", "--quiet", "--max-new-tokens", "6"]
    assert main([*base, "--prompt-file", str(f), "--json"]) == 0
    a, b = json.loads(capsys.readouterr().out)["outputs"]
    assert "logprobs" not in b and "prompt_logprobs" not in b
    kept = len(a["token_ids"]) - (a["finish_reason"] == "stop")
    assert len(a["logprobs"]) == kept
    assert all(len(e["top_logprobs"]) == 1 and e["logprob"] <= 0 for e in a["logprobs"])
    prompt = a["prompt_logprobs"]
    assert prompt[0] is None and all(len(e["top_logprobs"]) == 2 for e in prompt[1:])
    for e in prompt[1:]:  # rank: 1 + the entries likelier than the prompt token
        above = sum(t["logprob"] > e["logprob"] for t in e["top_logprobs"])
        assert e["rank"] >= 1 + above and (e["rank"] > 2 or e["rank"] == 1 + above)
    assert len(prompt) == len(b"def f(x):")  # the shipped pair's byte tokens
    for bad in ("21", "-1", "x"):
        assert main([*base, "--prompt", "hi", "--logprobs", bad]) == 2
        assert "--logprobs" in capsys.readouterr().err
    f.write_text(json.dumps({"prompt": "hi", "logprobs": 30}) + "\n")
    assert main([*base, "--prompt-file", str(f)]) == 2
    assert "p.jsonl:1: logprobs: expected None or an int in [0, 20], got 30" in (
        capsys.readouterr().err)
