"""The training package's device plumbing, on tiny runs (CPU; one GPU-marked test).

- `--device` / `--precision` resolution, the host-built batch's trip to the device;
- the bf16 autocast path (CPU autocast here): bf16 matmuls, fp32 master weights and grads;
- a time cap stops a stage and the schedule's clock starts after the first (compile) step;
- a torch.compile that fails on the first step falls back to eager training;
- `python -m graphdraft.train evaluate` (and `--baseline`) on a tiny trained pair;
- the `--recipe gpu` flags and their overrides.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from graphdraft.io.checkpoint import load_model_pair
from graphdraft.train import train as tr
from graphdraft.train.__main__ import GPU_RECIPE, main, parser, resolve
from graphdraft.train.data import Corpus, _concat, documents, is_held_out
from graphdraft.train.forward import target_forward

CONTEXT = 32


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    docs = [d for _, d in documents(is_held_out)][:4]
    ids = _concat(docs)
    return Corpus(ids, ids, len(docs), len(docs), [])


def _target_run(out, **kw) -> tr.TargetRun:
    base = dict(steps=2, batch=2, context=CONTEXT, eval_windows=2, compile=False, device="cpu",
                log_every=1, out=str(out))
    return tr.TargetRun(**{**base, **kw})


@pytest.fixture(scope="module")
def bf16_pair(corpus, tmp_path_factory):
    """A tiny pair trained 2 steps a stage under CPU bf16 autocast (head with a pool)."""
    d = tmp_path_factory.mktemp("pair")
    t = tr.train_target(_target_run(d / "target", precision="bf16"), corpus)
    h = tr.train_head(tr.HeadRun(steps=2, batch=2, context=CONTEXT, eval_windows=2, compile=False,
                                 device="cpu", precision="bf16", generated=2, log_every=1,
                                 generated_fraction=0.5, target=str(d / "target"),
                                 out=str(d / "eagle3")), corpus)
    return d, t, h


def test_resolve_device_and_precision():
    cpu = torch.device("cpu")
    assert tr.resolve_device("cpu") == cpu
    assert tr.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            tr.resolve_device("cuda")
    with pytest.raises(ValueError):
        tr.resolve_device("mps")
    assert tr.resolve_precision("auto", cpu) == "fp32"
    assert tr.resolve_precision("auto", torch.device("cuda")) == "bf16"
    assert tr.resolve_precision("bf16", cpu) == "bf16"
    with pytest.raises(ValueError, match="tf32"):
        tr.resolve_precision("tf32", cpu)
    with pytest.raises(ValueError):
        tr.resolve_precision("fp8", cpu)
    w = torch.arange(12).view(3, 4)
    assert torch.equal(tr.to_device(w, cpu), w)


def test_bf16_autocast_step_keeps_fp32_master_weights():
    """Under autocast the matmuls run in bf16; parameters and their grads stay fp32, and the
    loss is close to the fp32 one."""
    cfg = tr.target_config(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, context=CONTEXT,
                           aux_layer_ids=(0, 1))
    model = tr.LlamaForCausalLM(cfg, torch.float32)
    tr.init_for_training_(model, 0, cfg.num_hidden_layers)
    for p in model.parameters():
        p.requires_grad_(True)
    w = torch.randint(0, 256, (2, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    with tr.autocast("bf16", cpu):
        logits, _ = target_forward(model, w[:, :-1], capture_aux=False)
    assert logits.dtype == torch.bfloat16
    loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), w[:, 1:].reshape(-1))
    loss.backward()
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
               and torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        ref, _ = target_forward(model, w[:, :-1], capture_aux=False)
        ref_loss = F.cross_entropy(ref.reshape(-1, cfg.vocab_size), w[:, 1:].reshape(-1))
    assert abs(loss.item() - ref_loss.item()) < 0.05
    with tr.autocast("fp32", cpu):
        plain, _ = target_forward(model, w[:, :1], capture_aux=False)
    assert plain.dtype == torch.float32


def test_bf16_training_writes_a_loadable_pair(bf16_pair):
    d, t, h = bf16_pair
    for s in (t, h):
        assert s["steps"] == 2 and s["device"] == "cpu" and s["precision"] == "bf16"
        assert s["stopped_by"] == "steps" and not s["compiled"]
        assert math.isfinite(s["final_train_loss_ema"])
        assert len(s["run"]["history"]) == 2 and "tokens_per_s" in s["run"]["history"][1]
    assert math.isfinite(t["heldout"]["loss"]) and h["pool_sequences"] == 2
    target, head, _ = load_model_pair(d / "target", d / "eagle3", torch.float32)
    assert head.embed_tokens is target.embed_tokens
    assert all(p.dtype == torch.float32 for p in head.parameters())


def test_time_cap_stops_after_the_first_step(corpus, tmp_path, capsys):
    s = tr.train_target(_target_run(tmp_path / "target", steps=50, max_minutes=1e-6), corpus)
    assert s["steps"] == 1 and s["stopped_by"] == "time cap"
    assert "time cap" in capsys.readouterr().out


def test_schedule_clock_starts_after_the_first_step():
    clock = tr._Clock(max_minutes=10.0)
    assert clock.fraction() is None and not clock.expired()  # the compile step: no fraction
    clock.t0 -= 300.0                                        # a 5-minute compile...
    clock.first_step_done()
    assert 0.0 <= clock.fraction() < 0.01                    # ...leaves the schedule at its start
    clock.t0 -= 150.0                                        # 150 s of training later:
    clock.t_first -= 150.0                                   # half the remaining 5 minutes
    assert clock.fraction() == pytest.approx(0.5, abs=0.01) and not clock.expired()
    assert tr._Clock(None).fraction() is None
    lr = 1e-3
    assert tr._lr_at(0, 100, lr, 10) == pytest.approx(lr / 10)
    assert tr._lr_at(10, 100, lr, 10, time_fraction=0.0) == pytest.approx(lr)
    assert tr._lr_at(10, 100, lr, 10, time_fraction=1.0) == pytest.approx(lr / 10)
    assert tr._lr_at(99, 100, lr, 10, time_fraction=0.2) == pytest.approx(lr * 0.1, rel=0.01)


def test_failed_compile_falls_back_to_eager(corpus, tmp_path, monkeypatch, capsys):
    def broken_compile(fn, *args, **kwargs):
        def compiled(*a, **k):
            raise RuntimeError("inductor: no compiler here")
        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    s = tr.train_target(_target_run(tmp_path / "target", compile=True), corpus)
    assert s["steps"] == 2 and not s["compiled"]
    assert "torch.compile failed on the first step" in capsys.readouterr().out


def test_evaluate_command(bf16_pair, capsys):
    d, _, _ = bf16_pair
    args = ["evaluate", "--dir", str(d), "--baseline", str(d), "--prompt-counts", "2,1",
            "--prompt-bytes", "8", "--new-tokens", "6", "--eval-windows", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "target held-out loss" in out and "head mean accept length" in out
    assert "baseline" in out
    summary = json.loads((d / "evaluation.json").read_text())
    pair = summary["pair"]
    assert set(pair["mean_accept_length"]) == {"2_prompts", "1_prompts"}
    assert all(1.0 <= v <= 4.0 for v in pair["mean_accept_length"].values())
    assert math.isfinite(pair["target_heldout"]["loss"]) and pair["target_heldout"]["tokens"] > 0
    base = summary["baseline"]  # the same pair, the same way: the same numbers
    assert base["mean_accept_length"] == pair["mean_accept_length"]
    assert base["target_heldout"] == pair["target_heldout"]
    assert summary["setting"]["device"] == "cpu" and summary["setting"]["prompt_counts"] == [2, 1]


def test_cli_recipes_and_required_out():
    a = parser().parse_args(["all", "--recipe", "gpu", "--out", "x", "--head-steps", "5",
                             "--device", "cpu"])
    r = resolve(a)
    assert r["head_steps"] == 5 and r["device"] == "cpu"  # explicit flags win
    assert r["target_batch"] == GPU_RECIPE["target_batch"] and r["generated"] == GPU_RECIPE["generated"]
    assert not r["compile"]
    cpu = resolve(parser().parse_args(["target", "--out", "x"]))
    assert cpu["target_batch"] == tr.TargetRun.batch and cpu["target_max_minutes"] is None
    assert cpu["compile"] and not resolve(parser().parse_args(["target", "--no-compile"]))["compile"]
    assert GPU_RECIPE["device"] == "cuda"  # never silently a 4-minute CPU run
    with pytest.raises(SystemExit):
        main(["target"])  # --out is required: never graphdraft/assets by default
    with pytest.raises(SystemExit):
        main(["evaluate"])


@pytest.mark.gpu
def test_cuda_training_and_pool(corpus, tmp_path):
    """Both stages on the GPU (bf16 autocast), the pool through the Engine on CUDA."""
    t = tr.train_target(_target_run(tmp_path / "target", device="cuda", steps=3), corpus)
    h = tr.train_head(tr.HeadRun(steps=3, batch=4, context=CONTEXT, eval_windows=2, compile=False,
                                 device="cuda", generated=8, generated_fraction=0.5, log_every=1,
                                 target=str(tmp_path / "target"), out=str(tmp_path / "eagle3")),
                      corpus)
    for s in (t, h):
        assert s["device"] == "cuda" and s["precision"] == "bf16" and s["steps"] == 3
        assert math.isfinite(s["final_train_loss_ema"])
    assert h["pool_sequences"] == 8
    target, head, _ = load_model_pair(tmp_path / "target", tmp_path / "eagle3", torch.float32)
    assert head.embed_tokens is target.embed_tokens
