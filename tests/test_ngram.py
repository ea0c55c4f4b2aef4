"""N-gram (prompt-lookup) drafting (issue #44): the lookup kernel against a plain Python lookup,
the `NgramDrafter` through the Engine (greedy == target-only with joins, leaves and prefill
chunks; sampled == target-only sampling, token for token, and the acceptance's point-mass
law), and the configuration / CLI errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphdraft import ops
from graphdraft.config import RuntimeConfig
from graphdraft.kernels.accept import accept_ref
from graphdraft.kernels.config import TORCH, TRITON
from graphdraft.runtime.drafter_protocol import check_drafter
from graphdraft.runtime.ngram_drafter import NgramDrafter
from graphdraft.sampling import COLUMNS
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams, request_seed, target_probs
from tests.engine_harness import make_models, runtime
from tests.test_accept import _chi2, _outs, _state
from tests.test_engine import prompts, target_only


def lookup(h: list[int], k: int, nmin: int, nmax: int) -> tuple[list[int], int]:
    """The plain Python lookup over one history `h` -> (the up to k tokens after the most
    recent earlier match of its last n tokens, n from nmax down to nmin; how many)."""
    for n in range(nmax, nmin - 1, -1):
        if len(h) < n + 1:
            continue
        suffix = h[len(h) - n:]
        for i in range(len(h) - n - 1, -1, -1):
            if h[i: i + n] == suffix:
                follow = h[i + n: i + n + k]
                return follow, len(follow)
    return [], 0


def expected_row(h: list[int], k: int, s: int, nmin: int, nmax: int) -> tuple[list[int], int]:
    drafts, found = lookup(h, k, nmin, nmax)
    last = h[-1] if h else 0
    row = [last] + [drafts[min(j, found) - 1] if min(j, found) > 0 else last
                    for j in range(1, s + 1)]
    return row, found


@st.composite
def histories(draw):
    rows = draw(st.integers(1, 5))
    width = draw(st.integers(1, 300))  # > NGRAM_BLOCK: the scan crosses blocks
    vocab = draw(st.sampled_from([2, 3, 50]))  # few symbols: repeats and ties
    hs = []
    for _ in range(rows):
        length = draw(st.integers(0, width))
        period = draw(st.integers(1, 8))
        base = draw(st.lists(st.integers(0, vocab - 1), min_size=period, max_size=period))
        noise = draw(st.booleans())
        h = [base[i % period] for i in range(length)]
        if noise and length:
            at = draw(st.lists(st.integers(0, length - 1), max_size=5))
            for i in at:
                h[i] = draw(st.integers(0, vocab - 1))
        hs.append(h)
    s = draw(st.integers(1, 6))
    k = draw(st.integers(0, s))
    nmin = draw(st.integers(1, 4))
    nmax = draw(st.integers(nmin, nmin + 4))
    return hs, width, s, k, nmin, nmax


@pytest.mark.parametrize("kernels", [TORCH, TRITON], ids=["torch", "triton"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=histories())
def test_ngram_propose_equals_a_python_lookup(kernels, case):
    hs, width, s, k, nmin, nmax = case
    rows = len(hs)
    history = torch.full((rows + 1, width), 7, dtype=torch.int32)  # slot 0: the dummy slot
    lengths = torch.zeros(rows + 1, dtype=torch.int32)
    for i, h in enumerate(hs):
        history[i + 1, : len(h)] = torch.tensor(h, dtype=torch.int32)
        lengths[i + 1] = len(h)
    slots = torch.tensor([0] + list(range(rows, 0, -1)), dtype=torch.int64)  # reversed, inert
    out = torch.full((rows + 1, s + 1), -5, dtype=torch.int32)
    found = torch.full((rows + 1,), -5, dtype=torch.int32)
    ops.ngram_propose(history, lengths, slots, k, nmin, nmax, out=out, found=found,
                      kernels=kernels)
    for r, slot in enumerate(slots.tolist()):
        h = hs[slot - 1] if slot else []
        row, f = expected_row(h, k, s, nmin, nmax)
        assert out[r].tolist() == row, (r, h, k, nmin, nmax)
        assert int(found[r]) == f


@pytest.mark.gpu
def test_ngram_kernel_on_the_gpu_equals_the_torch_reference():
    """The compiled kernel (not the interpreter) over 64 random periodic histories of up to
    1,000 tokens (several scan blocks), every k and two n ranges."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    rows, width, s = 64, 1000, 5
    period = torch.randint(1, 40, (rows + 1, 1), generator=g)
    base = torch.randint(0, 6, (rows + 1, width), generator=g)
    history = base.gather(1, torch.arange(width)[None, :] % period).to(torch.int32)
    lengths = torch.randint(0, width + 1, (rows + 1,), generator=g).to(torch.int32)
    lengths[0] = 0
    slots = torch.randperm(rows + 1, generator=g)
    for k in range(s + 1):
        for nmin, nmax in ((1, 4), (3, 3)):
            outs = []
            for kernels, dev in ((TORCH, "cpu"), (TRITON, "cuda")):
                out = torch.zeros(rows + 1, s + 1, dtype=torch.int32, device=dev)
                found = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
                ops.ngram_propose(history.to(dev), lengths.to(dev), slots.to(dev), k, nmin,
                                  nmax, out=out, found=found, kernels=kernels)
                outs.append((out.cpu(), found.cpu()))
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_ngram_propose_errors_name_the_argument():
    h = torch.zeros(2, 8, dtype=torch.int32)
    ln = torch.zeros(2, dtype=torch.int32)
    sl = torch.zeros(1, dtype=torch.int64)
    out, found = torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    for kw, name in (({"k": 4}, "k"), ({"ngram_min": 0}, "ngram_min"),
                     ({"ngram_min": 3, "ngram_max": 2}, "ngram_max")):
        args = dict(k=1, ngram_min=1, ngram_max=2) | kw
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            ops.ngram_propose(h, ln, sl, args["k"], args["ngram_min"], args["ngram_max"],
                              out=out, found=found, kernels=TRITON)
    with pytest.raises(ValueError, match="^history: expected"):
        ops.ngram_propose(h.float(), ln, sl, 1, 1, 2, out=out, found=found)


# --- through the Engine -----------------------------------------------------------------------
def copy_heavy(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a passage (2-3 times, the last copy cut short)."""
    out = []
    for i, p in enumerate(prompts(seed, count, 4, 14)):
        out.append(p * (2 + i % 2) + p[: 1 + i % len(p)])
    return out


def ngram_cfg(**kw) -> RuntimeConfig:
    return runtime(speculative_algorithm="ngram", ngram_min=1, ngram_max=3, **kw)


def test_greedy_ngram_equals_target_only_with_joins_leaves_and_chunks():
    """5 copy-heavy prompts over 3 slots (joins and leaves mid-run), 16-token prefill chunks,
    the adaptive policy (k in 0, 1, 3): the same tokens as target-only decoding, and lookup
    drafts were accepted."""
    target, _ = make_models(5)
    ps = copy_heavy(11, 5)
    cfg = ngram_cfg(max_num_batched_tokens=16, speculative_policy="adaptive",
                    max_running_requests=3, cuda_graph_max_bs=3)
    expected = target_only(target, cfg.replace(speculative_algorithm="eagle3"), ps, 14)
    eng = Engine(target, cfg)
    assert isinstance(eng.drafter, NgramDrafter) and check_drafter(eng.drafter)
    assert eng.generate(ps, SamplingParams(max_new_tokens=14)) == expected
    assert eng.drafter.cycles > 0 and eng.stats.mean_accept_length > 1.0


def test_greedy_ngram_on_the_shipped_byte_pair_equals_target_only():
    from graphdraft.io.bytes_tokenizer import ByteTokenizer
    from graphdraft.io.checkpoint import load_target
    from graphdraft.serving.cli.models import SHIPPED_TARGET

    target, _ = load_target(SHIPPED_TARGET, "float32")
    tok = ByteTokenizer()
    passage = "def add(a, b):\n    return a + b\n\n"
    texts = [passage * 2 + "def add(", "the cat sat on the mat. " * 2 + "the cat"]
    ps = [tok.encode(t) for t in texts]
    cfg = ngram_cfg(max_running_requests=1, cuda_graph_max_bs=1, max_context_len=128,
                    max_num_batched_tokens=32, dtype="float32")
    expected = target_only(target, cfg.replace(speculative_algorithm="eagle3"), ps, 12)
    eng = Engine(target, cfg)
    assert eng.generate(ps, SamplingParams(max_new_tokens=12)) == expected
    assert eng.stats.mean_accept_length > 1.5  # the copies are found and accepted


def test_sampled_ngram_equals_target_only_sampling():
    """Sampled rows: the acceptance draws each position's target token from (seed, position)
    and accepts a lookup draft exactly when it equals it, so the n-gram engine emits the
    target-only engine's samples token for token (temperature, top-k, top-p; 2 seeds a prompt; 6 requests over 3 slots)."""
    target, _ = make_models(5)
    ps = copy_heavy(3, 3) * 2
    params = [SamplingParams(max_new_tokens=10, temperature=t, top_k=k, top_p=p, seed=100 + i)
              for i, (t, k, p) in enumerate([(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8),
                                             (0.9, 4, 0.9), (1.0, 0, 1.0), (0.8, 3, 0.95)])]
    cfg = ngram_cfg(max_num_batched_tokens=24, max_running_requests=3, cuda_graph_max_bs=3)
    expected = Engine(target, cfg.replace(speculative_algorithm="eagle3")).generate(ps, params)
    eng = Engine(target, cfg)
    assert eng.generate(ps, params) == expected
    assert eng.stats.mean_accept_length > 1.0


def test_point_mass_lookup_drafts_keep_the_target_distribution():
    """The chain's sampled acceptance with lookup drafts (q one-hot, a low-probability token
    and a likely one): chi-square (fail at p < 1e-4) of 30,000 rows against the target's
    first-token law, and the second token's law given the first draft was accepted."""
    torch.manual_seed(1)
    v, n, rows = 8, 3, 30000
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    logits = torch.randn(n, v) * 1.2
    p = target_probs(logits, params)
    d1 = int(p[0].argsort()[2])  # neither the likeliest nor impossible
    history = torch.tensor([[0] * 6, [3, 4, d1, 5, 3, 4]], dtype=torch.int32)
    out, found = torch.zeros(1, n, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    ops.ngram_propose(history, torch.tensor([0, 6], dtype=torch.int32),
                      torch.tensor([1]), 2, 1, 2, out=out, found=found)
    assert out[0].tolist() == [4, d1, 5] and int(found[0]) == 2
    st_ = _state(slots=2)
    st_.admit(1, **({c.name: c.neutral for c in COLUMNS}
                    | dict(temperature=1.0, top_p=1.0, top_k=0, seed=request_seed(5, 0),
                           max_new=10**6)), stop_ids=[])
    cand = out.long().expand(rows, n).contiguous()
    seq = torch.arange(rows, dtype=torch.int32) * 5 + 40
    o = _outs(rows, n)
    accept_ref(logits.repeat(rows, 1), cand, torch.ones(rows, dtype=torch.int64), seq, st_, **o)
    tok, acc = o["tokens"], o["accept"]
    assert _chi2(torch.bincount(tok[:, 0], minlength=v), p[0]) > 1e-4
    sel = tok[:, 0] == d1
    assert bool((acc[sel] >= 2).all()) and bool((acc[~sel] == 1).all()) and int(sel.sum()) > 500
    assert _chi2(torch.bincount(tok[sel, 1], minlength=v), p[1]) > 1e-4


# --- configuration and flags ------------------------------------------------------------------
@pytest.mark.parametrize("kw,name", [
    ({"speculative_algorithm": "medusa"}, "speculative_algorithm"),
    ({"ngram_min": 0}, "ngram_min"), ({"ngram_max": 65}, "ngram_max"),
    ({"ngram_min": 3, "ngram_max": 2}, "ngram_max"), ({"ngram_min": True}, "ngram_min"),
    ({"speculative_algorithm": "ngram", "speculative_eagle_topk": 2, "speculative_num_steps": 3,
      "speculative_num_draft_tokens": 5}, "speculative_eagle_topk")])
def test_bad_ngram_config_names_the_field(kw, name):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        runtime(**kw)


def test_ngram_with_a_head_or_a_drafter_is_refused():
    target, head = make_models(5)
    with pytest.raises(ValueError, match="^speculative_algorithm: expected 'eagle3'"):
        Engine(target, ngram_cfg(), head)
    with pytest.raises(ValueError, match="^speculative_algorithm: expected 'eagle3'"):
        Engine(target, ngram_cfg(), drafter=NgramDrafter())


@pytest.mark.parametrize("flags,message", [
    (["--speculative-algorithm", "medusa"], "argument --speculative-algorithm: invalid choice"),
    (["--speculative-algorithm", "ngram", "--ngram-min", "0"], "argument --ngram-min: expected"),
    (["--speculative-algorithm", "ngram", "--ngram-min", "5", "--ngram-max", "3"],
     "argument --ngram-max: expected >= --ngram-min (5)"),
    (["--speculative-algorithm", "ngram", "--ngram-max", "65"], "--ngram-max: expected an int"),
    (["--speculative-algorithm", "ngram", "--target", "t", "--draft", "d"],
     "argument --draft: expected none with --speculative-algorithm ngram")])
def test_bad_ngram_flags_name_the_flag(flags, message, capsys):
    from graphdraft.__main__ import main

    argv = ["generate", "--prompt", "ab", "--max-new-tokens", "2", *flags]
    assert main(argv if "--target" in flags else [*argv, "--random-models"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.gpu
def test_greedy_ngram_in_the_cycle_graph_equals_target_only():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target, _ = make_models(5, dtype=torch.float32, device="cuda")
    ps = copy_heavy(11, 9)
    cfg = ngram_cfg(dtype="float32", device="cuda", max_num_batched_tokens=16)
    expected = target_only(target, cfg.replace(speculative_algorithm="eagle3"), ps, 20)
    eng = Engine(target, cfg)
    eng.capture_graphs(progress=False)
    assert eng.generate(ps, SamplingParams(max_new_tokens=20)) == expected
    replays, eager = eng.graph_summary()["spec_cycle"]
    assert replays > 0 and eager == 0 and eng.drafter.cycles >= replays  # drafted in the graph
    assert eng.stats.mean_accept_length > 1.0


def test_start_up_rebuilds_the_ngram_engine_from_its_config():
    """The precompile plan's throw-away engine (`startup.spec`): an n-gram engine's spec has
    no head and its factory's engine drafts by lookup again; the plan counts its history."""
    from graphdraft.startup import spec as wspec

    target, _ = make_models(5)
    eng = Engine(target, ngram_cfg())
    spec, why = wspec.engine_spec(eng)
    assert spec is not None and spec.head is None, why
    assert spec.runtime.speculative_algorithm == "ngram"
    rebuilt = wspec.build_engine(spec)
    assert isinstance(rebuilt.drafter, NgramDrafter) and rebuilt.steps == eng.steps
    assert wspec.plan_bytes(eng, spec) > eng.drafter.history.nbytes
    own = Engine(target, runtime(), drafter=NgramDrafter())  # a caller's instance: not rebuilt
    assert wspec.engine_spec(own)[0] is None
