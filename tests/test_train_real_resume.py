"""graphdraft.train.real across calls, on the CPU with a tiny chat GGUF (tests/test_gguf.py's
writer): the responses cache (`--responses-cache`: a run that loads them trains the same head
as the run that generated them; another key generates anew), the training checkpoint
(`--checkpoint` / `--resume`: N steps, then M more from the checkpoint, equal to N + M steps
in one run, bit for bit in fp32), the schedule over several calls (`total_minutes`), a warm
start (`--init-from`), and the refusals (each one ValueError naming the flag)."""

from __future__ import annotations

import json

import pytest
import torch

from graphdraft.train.real import CPU_SMOKE_RECIPE, RealHeadRun, main, train_real_head
from graphdraft.train.responses import (
    Samples,
    load_responses,
    samples_digest,
    save_responses,
    target_identity,
)
from graphdraft.train.resume import STATE_RECORD, STATE_TENSORS, load_state
from graphdraft.train.train import LoopStart, _Clock, _train_loop

RECIPE = dict(CPU_SMOKE_RECIPE, code_prompts=4, prose_prompts=4, max_new_tokens=6,
              max_prompt_tokens=220, draft_vocab=48, ffn=32, steps=8, warmup=2, batch=2,
              batch_tokens=256, log_every=100)
"""Several batches an epoch (8 steps cross an epoch's end), a warm-up and a cosine in steps."""


@pytest.fixture(scope="module")
def tiny_targets(tmp_path_factory):
    """Two tiny chat targets of one shape and tokenizer, other weights (converted once)."""
    pytest.importorskip("gguf")
    from graphdraft.io.gguf_convert import convert_gguf
    from tests.test_gguf import write_tiny_gguf
    d = tmp_path_factory.mktemp("tiny_chat_resume")
    return [str(convert_gguf(write_tiny_gguf(d / f"tiny{s}.gguf", seed=s), d / f"hf{s}", "float32"))
            for s in (0, 1)]


def _run(target: str, out, **kw) -> dict:
    return train_real_head(RealHeadRun(target=target, out=str(out), **(RECIPE | kw)))


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


def _assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _samples() -> Samples:
    ids = torch.tensor([[5, 6, 7, 8, 2, 2], [5, 9, 3, 4, 1, 7]])
    return Samples(ids, torch.tensor([2, 3]), torch.tensor([4, 6]), torch.tensor([0, 1]),
                   torch.tensor([False, True]), ["code", "prose"])


def test_responses_round_trip_unpadded_with_the_generator_state(tmp_path):
    s, state = _samples(), torch.Generator().manual_seed(3).get_state()
    save_responses(tmp_path, {"k": 1}, s, {"responses": 2}, 2, state)
    back, data, gen_state = load_responses(tmp_path)
    assert torch.equal(back.ids, s.ids) and back.kinds == s.kinds and data == {"responses": 2}
    assert torch.equal(back.sampled, s.sampled) and back.sampled.dtype == torch.bool
    assert torch.equal(gen_state, state) and samples_digest(back) == samples_digest(s)
    assert not list(tmp_path.glob("*.tmp"))
    other = _samples()
    other.ids[1, 2] = 4
    assert samples_digest(other) != samples_digest(s)
    record = json.loads((tmp_path / "responses.json").read_text())
    record["digest"] = samples_digest(other)
    (tmp_path / "responses.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="responses_cache .* digest differs"):
        load_responses(tmp_path)


def test_target_identity_follows_the_content_not_the_name(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"x" * 1000)
    (tmp_path / "b.gguf").write_bytes(b"x" * 1000)
    (tmp_path / "c.gguf").write_bytes(b"x" * 999 + b"y")
    ids = [target_identity(tmp_path / n) for n in ("a.gguf", "b.gguf", "c.gguf")]
    assert ids[0] == ids[1] != ids[2] and ids[0]["bytes"] == 1000
    with pytest.raises(ValueError, match="neither a file nor a directory"):
        target_identity(tmp_path / "missing")


def test_cached_responses_train_the_same_head_and_another_key_regenerates(tiny_targets,
                                                                           tmp_path, capsys):
    cache = tmp_path / "responses"
    first = _run(tiny_targets[0], tmp_path / "a", responses_cache=str(cache))
    assert first["data"]["responses_cache"]["loaded"] is False
    assert "no cached responses" in capsys.readouterr().out
    again = _run(tiny_targets[0], tmp_path / "b", responses_cache=str(cache))
    assert again["data"]["responses_cache"]["loaded"] is True
    assert "loaded from the cache" in capsys.readouterr().out
    assert again["data"]["responses"] == first["data"]["responses"]
    _assert_same_tensors(_tensors(tmp_path / "a" / "model.safetensors"),
                         _tensors(tmp_path / "b" / "model.safetensors"))
    assert again["heldout"] == first["heldout"]
    other = _run(tiny_targets[0], tmp_path / "c", responses_cache=str(cache), max_new_tokens=5,
                 steps=1)
    assert other["data"]["responses_cache"]["loaded"] is False
    assert "another key (max_new_tokens differ): generating anew" in capsys.readouterr().out
    moved = _run(tiny_targets[1], tmp_path / "d", responses_cache=str(cache), max_new_tokens=5,
                 steps=1)
    assert moved["data"]["responses_cache"]["loaded"] is False
    assert "another key (target differ)" in capsys.readouterr().out


def test_resumed_training_equals_one_uninterrupted_run(tiny_targets, tmp_path):
    """8 steps in one run == 3 steps, a checkpoint, then 5 more: the saved heads, and the fp32
    weights, AdamW moments, data order and generator state of both end states, bit for bit."""
    t = tiny_targets[0]
    whole = _run(t, tmp_path / "whole", checkpoint=str(tmp_path / "ck_whole"))
    assert whole["steps"] == 8 and whole["stopped_by"] == "steps"
    part = _run(t, tmp_path / "part", checkpoint=str(tmp_path / "ck"), call_steps=3)
    assert (part["steps"], part["steps_this_call"], part["stopped_by"]) == (3, 3, "call steps")
    assert load_state(tmp_path / "ck").step == 3
    rest = _run(t, tmp_path / "rest", checkpoint=str(tmp_path / "ck"), resume=True)
    assert (rest["steps"], rest["steps_this_call"], rest["resumed_from_step"]) == (8, 5, 3)
    assert rest["stopped_by"] == "steps" and rest["final_train_loss_ema"] == whole["final_train_loss_ema"]
    _assert_same_tensors(_tensors(tmp_path / "whole" / "model.safetensors"),
                         _tensors(tmp_path / "rest" / "model.safetensors"))
    _assert_same_tensors(_tensors(tmp_path / "ck_whole" / STATE_TENSORS),
                         _tensors(tmp_path / "ck" / STATE_TENSORS))
    a, b = load_state(tmp_path / "ck_whole"), load_state(tmp_path / "ck")
    assert (a.step, a.epochs, a.queue) == (b.step, b.epochs, b.queue) and a.epochs >= 2
    assert a.optimizer["param_groups"] == b.optimizer["param_groups"]
    assert [h["step"] for h in rest["run"]["history"]] == [h["step"] for h in whole["run"]["history"]]
    assert rest["heldout"] == whole["heldout"]


def test_a_checkpoint_of_another_training_is_refused_naming_the_flag(tiny_targets, tmp_path):
    t, ck, cache = tiny_targets[0], str(tmp_path / "ck"), str(tmp_path / "responses")
    with pytest.raises(ValueError, match=r"checkpoint .* \(--resume\): no training state"):
        _run(t, tmp_path / "o", checkpoint=ck, resume=True)
    with pytest.raises(ValueError, match="resume: needs --checkpoint"):
        _run(t, tmp_path / "o", resume=True)
    _run(t, tmp_path / "a", checkpoint=ck, call_steps=1, responses_cache=cache)
    with pytest.raises(ValueError, match=r"responses_cache .*: resume needs the first call's "
                                         r"responses, those there have another key "
                                         r"\(max_new_tokens differ\)"):
        _run(t, tmp_path / "o", checkpoint=ck, resume=True, responses_cache=cache,
             max_new_tokens=5)
    with pytest.raises(ValueError, match="resume needs the first call's responses, none are"):
        _run(t, tmp_path / "o", checkpoint=ck, resume=True,
             responses_cache=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"\(--resume\): written by another training: ffn 32 "
                                         r"there, 16 here"):
        _run(t, tmp_path / "o", checkpoint=ck, resume=True, ffn=16)
    with pytest.raises(ValueError, match="draft_vocab 48 there, 40 here"):
        _run(t, tmp_path / "o", checkpoint=ck, resume=True, draft_vocab=40)
    with pytest.raises(ValueError, match="another target"):
        _run(tiny_targets[1], tmp_path / "o", checkpoint=ck, resume=True)
    with pytest.raises(ValueError, match=r"other training samples \(digest differs"):
        _run(t, tmp_path / "o", checkpoint=ck, resume=True, max_new_tokens=5)
    record = json.loads((tmp_path / "ck" / STATE_RECORD).read_text())
    record["saved"] = "0" * 32  # a record of another save than the tensors'
    (tmp_path / "ck" / STATE_RECORD).write_text(json.dumps(record))
    with pytest.raises(ValueError, match="are not one save's"):
        _run(t, tmp_path / "o", checkpoint=ck, resume=True)


def test_init_from_keeps_the_heads_weights_and_draft_vocabulary(tiny_targets, tmp_path):
    t = tiny_targets[0]
    _run(t, tmp_path / "a", steps=2)
    # lr 0: the warm-started head is saved as it was loaded
    _run(t, tmp_path / "b", init_from=str(tmp_path / "a"), steps=1, lr=0.0, draft_vocab=48)
    _assert_same_tensors(_tensors(tmp_path / "a" / "model.safetensors"),
                         _tensors(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"init_from .*: another head's shape: ffn 32 there, "
                                         r"16 here"):
        _run(t, tmp_path / "c", init_from=str(tmp_path / "a"), ffn=16)


class _Rec:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def test_the_schedule_spans_every_calls_training_minutes():
    clock = _Clock(None, trained_seconds=30.0, total_minutes=1.0)
    assert 0.5 <= clock.fraction() < 0.6 and not clock.total_reached()
    assert _Clock(None, trained_seconds=60.0, total_minutes=1.0).total_reached()
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1)
    run = _Rec(max_minutes=None, steps=5, lr=0.1, warmup=0, log_every=100, history=[])

    def loss(_):
        return (w ** 2).sum(), None
    done = _train_loop("t", run, torch.device("cpu"), {"w": w}, opt, loss, loss, lambda: None, 1,
                       LoopStart(step=2, trained_seconds=60.0, total_minutes=1.0))
    assert (done["steps"], done["stopped_by"], done["next_step"]) == (0, "total minutes", 2)
    done = _train_loop("t", run, torch.device("cpu"), {"w": w}, opt, loss, loss, lambda: None, 1,
                       LoopStart(step=2, call_steps=2))
    assert (done["steps"], done["stopped_by"], done["next_step"]) == (2, "call steps", 4)
    done = _train_loop("t", run, torch.device("cpu"), {"w": w}, opt, loss, loss, lambda: None, 1,
                       LoopStart(step=4, call_steps=2))
    assert (done["steps"], done["stopped_by"], done["next_step"]) == (1, "steps", 5)


def test_cli_flags_of_a_training_over_several_calls(monkeypatch):
    seen = {}
    monkeypatch.setattr("graphdraft.train.real.train_real_head", lambda run: seen.setdefault("r", run))
    assert main(["--target", "T", "--out", "O", "--recipe", "cpu-smoke", "--responses-cache", "R",
                 "--checkpoint", "C", "--resume", "--total-minutes", "14.5", "--call-steps", "3",
                 "--init-from", "H"]) == 0
    run = seen["r"]
    assert (run.responses_cache, run.checkpoint, run.resume, run.total_minutes, run.call_steps,
            run.init_from) == ("R", "C", True, 14.5, 3, "H")
    seen.clear()
    assert main(["--target", "T", "--out", "O", "--recipe", "cpu-smoke"]) == 0
    assert (seen["r"].resume, seen["r"].checkpoint, seen["r"].responses_cache) == (False, None, None)
