"""graphdraft.train.real / train.responses on the CPU: the whole chat-head recipe end to end on
a tiny chat GGUF (tests/test_gguf.py's writer), and its parts: length batches, the held-out
split by prompt, the one TTT loss with and without a mask, the CLI's recipes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from graphdraft.train.real import (
    CPU_SMOKE_RECIPE,
    GPU_RECIPE,
    LengthBatches,
    RealHeadRun,
    check_head_size,
    main,
    predicted_head_bytes,
    split_heldout,
    train_real_head,
)
from graphdraft.train.responses import Samples, make_jobs
from graphdraft.train.train import HeadRun, HeadTraining, ttt_loss


def _samples(lens: list[int], prompt_lens: list[int], prompts: list[int]) -> Samples:
    n, width = len(lens), max(lens)
    ids = torch.arange(n * width).reshape(n, width) % 97
    return Samples(ids, torch.tensor(prompt_lens), torch.tensor(lens), torch.tensor(prompts),
                   torch.zeros(n, dtype=torch.bool), ["code" if p % 2 else "prose" for p in prompts])


def test_length_batches_cover_each_sequence_once_an_epoch_within_the_budget():
    gen = torch.Generator().manual_seed(0)
    lens = [int(x) for x in torch.randint(20, 200, (57,), generator=gen)]
    s = _samples(lens, [10] * 57, list(range(57)))
    b = LengthBatches(s, batch=8, batch_tokens=512, device=torch.device("cpu"), gen=gen)
    seen = []
    for _ in range(b.batches_per_epoch):
        ids, mask = b()
        assert ids.shape[0] <= 8 and (ids.shape[0] == 1 or ids.numel() <= 512)
        assert ids.shape[1] % 16 == 0 or ids.shape[1] == s.ids.shape[1]
        seen += [tuple(r[:4].tolist()) for r in ids]
        assert mask.shape == ids.shape
    assert b.epochs == 1 and len(seen) == 57
    assert sorted(seen) == sorted(tuple(r[:4].tolist()) for r in s.ids)
    b()
    assert b.epochs == 2


def test_heldout_split_keeps_whole_prompts_apart():
    prompts = [i // 3 for i in range(90)]  # 30 prompts, 3 responses each
    s = _samples([40] * 90, [10] * 90, prompts)
    run = RealHeadRun(target="t", out="o", heldout_fraction=0.1, heldout_max=256)
    held, train = split_heldout(s, run, torch.Generator().manual_seed(1))
    assert 9 <= held.ids.shape[0] <= 11 and held.ids.shape[0] + train.ids.shape[0] == 90
    assert not set(held.prompt.tolist()) & set(train.prompt.tolist())


def test_jobs_run_greedy_rounds_first_with_distinct_seeds():
    run = RealHeadRun(target="t", out="o", responses_per_prompt=3, sample_temperature=0.7)
    jobs = make_jobs(["code", "prose", "code", "prose"], run, torch.Generator().manual_seed(0))
    assert [j.temperature for j in jobs] == [0.0] * 4 + [0.7] * 8
    assert sorted(j.prompt for j in jobs[:4]) == [0, 1, 2, 3]
    assert len({j.seed for j in jobs}) == 12 and [j.index for j in jobs] == list(range(12))


def test_one_ttt_loss_mask_none_is_every_position_and_hard_labels_are_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(2, 7, 11, generator=g) for _ in range(3)]
    target = torch.randn(2, 8, 11, generator=g)
    probs, greedy = torch.softmax(target, -1), target.argmax(-1)
    soft, acc = ttt_loss(logits, greedy, 0.8, probs)
    masked, acc_m = ttt_loss(logits, greedy, 0.8, probs, torch.ones(2, 8, dtype=torch.bool))
    assert torch.allclose(soft, masked) and torch.allclose(acc, acc_m) and acc.shape == (3,)
    hard, _ = ttt_loss(logits, greedy, 1.0)
    ref = sum(F.cross_entropy(lg[:, : 8 - k].reshape(-1, 11), greedy[:, k:].reshape(-1))
              for k, lg in enumerate(logits, start=1))
    assert torch.allclose(hard, ref)
    # a mask drops positions: only the kept labels count (-1 labels are never kept)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 3] = True
    greedy_m = greedy.clone()
    greedy_m[1] = -1
    one, _ = ttt_loss(logits[:1], greedy_m, 0.8, None, mask)
    assert torch.allclose(one, F.cross_entropy(logits[0][0, 2][None], greedy[0, 3][None]))


def test_runs_share_one_training_record():
    shared = {f for f in HeadTraining.__dataclass_fields__}
    assert shared <= set(HeadRun.__dataclass_fields__)
    assert shared <= set(RealHeadRun.__dataclass_fields__)
    assert issubclass(HeadRun, HeadTraining) and issubclass(RealHeadRun, HeadTraining)


@pytest.fixture(scope="module")
def tiny_chat_target(tmp_path_factory):
    pytest.importorskip("gguf")
    from graphdraft.io.gguf_convert import convert_gguf
    from tests.test_gguf import write_tiny_gguf
    d = tmp_path_factory.mktemp("tiny_chat")
    return convert_gguf(write_tiny_gguf(d / "tiny.gguf"), d / "hf", "float32")


def test_train_real_head_end_to_end_on_a_tiny_chat_target(tiny_chat_target, tmp_path, capsys):
    from graphdraft.io.checkpoint import load_eagle3_head, load_target
    out = tmp_path / "head"
    recipe = dict(CPU_SMOKE_RECIPE, code_prompts=4, prose_prompts=4, max_new_tokens=6,
                  max_prompt_tokens=220, draft_vocab=48, ffn=32, steps=3)
    summary = train_real_head(RealHeadRun(target=str(tiny_chat_target), out=str(out), **recipe))
    data = summary["data"]
    assert data["responses"] == data["jobs"] == 2 * (data["prompts"] - data["over_max_prompt_tokens"])
    assert data["greedy"] == data["sampled"] and data["engine"] == "eager, torch kernels"
    assert summary["steps"] == 3 and len(summary["heldout"]["step_top1_agreement"]) == 3
    assert set(summary["heldout"]["by_kind"]) <= {"code", "prose"}
    assert summary["safetensors_bytes"] == (out / "model.safetensors").stat().st_size
    from graphdraft.io.checkpoint import read_config
    cfg, _ = read_config(tiny_chat_target)
    predicted = predicted_head_bytes(cfg, 48, 32, "float32")
    assert 0 <= predicted - summary["safetensors_bytes"] <= 2048
    assert json.loads((out / "training.json").read_text())["run"]["draft_vocab"] == 48
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {"d2t", "t2d"} <= set(f.keys())
    target, _ = load_target(tiny_chat_target, torch.float32, "cpu")
    head = load_eagle3_head(out, target=target)
    assert head.config.draft_vocab_size == 48 and head.config.intermediate_size == 32
    lines = capsys.readouterr().out.splitlines()
    assert any(ln.startswith("[") and "UTC" not in ln and "s] responses:" in ln for ln in lines)


def _smollm2_config(tmp_path):
    """SmolLM2-135M's config, as the shipped head's training.json records it."""
    from graphdraft.io.checkpoint import read_config
    from graphdraft.serving.cli.models import SHIPPED_SMOLLM2_HEAD
    record = json.loads((SHIPPED_SMOLLM2_HEAD / "training.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(record["target_config"]))
    return read_config(tmp_path)[0], record


def test_predicted_head_bytes_bound_the_shipped_head_and_the_gpu_recipe_fits(tmp_path):
    """The shipped head's file is within the header bound of the prediction; it is the GPU
    recipe's head (LM head from the target, draft vocab 8,192, MLP 768), which fits its
    max_head_bytes, which keeps graphdraft/assets under 20 MB in all."""
    from graphdraft.serving.cli.models import SHIPPED_SMOLLM2_HEAD
    cfg, record = _smollm2_config(tmp_path)
    run = record["run"]
    shipped = predicted_head_bytes(cfg, run["draft_vocab"], run["ffn"], run["save_dtype"],
                                   run.get("lm_head", "own"))  # (absent: heads before the key)
    assert 0 <= shipped - record["safetensors_bytes"] <= 2048
    gpu = RealHeadRun(target="t", out="o", **{k: v for k, v in GPU_RECIPE.items()})
    size = check_head_size(gpu, cfg)
    assert size <= GPU_RECIPE["max_head_bytes"] and size == shipped
    recipe = (gpu.lm_head, gpu.draft_vocab, gpu.ffn, gpu.save_dtype)
    assert recipe == (run.get("lm_head", "own"), run["draft_vocab"], run["ffn"],
                      run["save_dtype"]) == ("target", 8192, 768, "bfloat16")
    config = json.loads((SHIPPED_SMOLLM2_HEAD / "config.json").read_text())
    assert (config["graphdraft_lm_head"], config["draft_vocab_size"],
            config["intermediate_size"]) == ("target", 8192, 768)
    assets = SHIPPED_SMOLLM2_HEAD.parent
    others = sum(f.stat().st_size for f in assets.rglob("*") if f.is_file()
                 and f != SHIPPED_SMOLLM2_HEAD / "model.safetensors")
    assert others + GPU_RECIPE["max_head_bytes"] < 20_000_000


def test_a_head_over_max_head_bytes_is_refused_before_any_work(tmp_path):
    cfg, _ = _smollm2_config(tmp_path)
    run = RealHeadRun(target="t", out="o", draft_vocab=4096, ffn=192, max_head_bytes=7_850_000)
    with pytest.raises(ValueError, match=r"draft_vocab=4096, ffn=192: .* over max_head_bytes"):
        check_head_size(run, cfg)
    assert check_head_size(RealHeadRun(target="t", out="o", max_head_bytes=None), cfg) > 0


def test_cli_recipe_and_flags(monkeypatch):
    seen = {}
    monkeypatch.setattr("graphdraft.train.real.train_real_head", lambda run: seen.setdefault("r", run))
    assert main(["--target", "T", "--out", "O", "--recipe", "cpu-smoke", "--steps", "7",
                 "--gen-graphs", "0", "--lr", "0.01"]) == 0
    run = seen["r"]
    assert run.steps == 7 and run.gen_graphs is False and run.lr == 0.01
    assert run.draft_vocab == CPU_SMOKE_RECIPE["draft_vocab"] and run.device == "cpu"
    with pytest.raises(SystemExit):
        main(["--out", "O"])
