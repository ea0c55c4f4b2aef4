"""`python -m graphdraft` as a user meets it: one-line errors naming the flag, help with
defaults, conflicts rejected, prompts from flags and files, streaming, stop strings, JSON
output, metrics, logging confined to the 'graphdraft' loggers, no CPU timing presented as a
result. The runs use the shipped pair (or a saved tiny pair) on the CPU, a few tokens each."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from graphdraft.__main__ import main, report_greedy_match
from graphdraft.io.checkpoint import save_eagle3_head, save_target
from graphdraft.serving.cli import build_parser
from graphdraft.serving.cli.args import CliError
from graphdraft.serving.cli.generate import Stream, run_streams, sampling_for
from graphdraft.serving.cli.prompts import PromptSpec, gather, read_prompt_file
from tests.engine_harness import make_models


def _one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    # one error line, last; before it at most the command's status lines (stderr): no usage
    # block, no traceback
    errors = [ln for ln in lines if "error:" in ln]
    assert errors == [lines[-1]], err
    assert "Traceback" not in err and not any(ln.startswith("usage:") for ln in lines), err
    for n in needles:
        assert n in lines[-1], lines[-1]
    return lines[-1]


# --- parsing -----------------------------------------------------------------------------
def test_every_flag_has_help_and_its_default_shown():
    parser = build_parser()
    subs = parser._subparsers._group_actions[0].choices
    assert set(subs) == {"demo", "generate", "serve"}
    for name, sub in subs.items():
        assert sub.allow_abbrev is False
        text = sub.format_help()
        for action in sub._actions:
            if action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings}: no help text"
            assert "%(default)" in sub._get_formatter()._get_help_string(action), action.dest
        assert text.count("(default:") == len(sub._actions) - 1


@pytest.mark.parametrize("argv, needles", [
    (["demo", "--num-p", "2"], ["--num-p"]),                       # abbreviations refused
    (["demo", "--num-prompts", "0"], ["--num-prompts", "expected an int >= 1", "'0'"]),
    (["demo", "--max-new-tokens", "-3"], ["--max-new-tokens", ">= 1"]),
    (["demo", "--speculative-num-steps", "x"], ["--speculative-num-steps", "'x'"]),
    (["generate", "--temperature", "1", "--top-p", "1.5"], ["--top-p", "(0, 1]"]),
    (["generate", "--temperature", "-1"], ["--temperature", ">= 0"]),
    (["demo", "--top-k", "5"], ["--top-k", "--temperature > 0"]),  # no effect when greedy
    (["demo", "--cuda-graph-max-bs", "8", "--max-running-requests", "4"],
     ["--cuda-graph-max-bs", "--max-running-requests (4)", "got 8"]),   # rejected, not capped
    (["demo", "--target", "somewhere"], ["--draft", "--target"]),
    (["demo", "--random-models", "--target", "a", "--draft", "b"], ["--random-models"]),
    (["demo", "--device", "tpu"], ["--device", "'cpu', 'cuda' or 'cuda:N'"]),
    (["demo", "--log-level", "loud"], ["--log-level"]),
    (["demo", "--kv-cache-memory-gb", "0"], ["--kv-cache-memory-gb", "> 0"]),
    (["demo", "--speculative-policy", "sometimes"],
     ["--speculative-policy", "['adaptive', 'fixed']", "'sometimes'"]),
])
def test_bad_flags_are_one_line_errors_naming_the_flag(capsys, argv, needles):
    _one_line_error(capsys, argv, *needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_device_cuda_without_a_gpu_is_a_one_line_error(capsys):
    _one_line_error(capsys, ["demo", "--device", "cuda"], "--device", "no CUDA device")


def test_config_errors_name_the_flag_not_the_field(capsys):
    line = _one_line_error(capsys, ["demo", "--random-models", "--cuda-graph-bs", "4", "32",
                                    "--max-running-requests", "16"], "--cuda-graph-bs")
    assert "cuda_graph_bs" not in line and "cuda_graph_max_bs" not in line
    # the engine's check against the shipped target's 256 positions
    line = _one_line_error(capsys, ["demo", "--max-context-len", "512", "--quiet"],
                           "--max-context-len", "(256)", "got 512")
    assert "max_context_len" not in line


@pytest.mark.parametrize("flag", [None, "fixed", "adaptive"])
def test_speculative_policy_flag_reaches_the_config(flag):
    from graphdraft.serving.cli.models import runtime_from_args
    argv = ["demo", "--device", "cpu"] + (["--speculative-policy", flag] if flag else [])
    a = build_parser().parse_args(argv)
    assert runtime_from_args(a).speculative_policy == (flag or "adaptive")


def test_checkpoint_errors_are_one_line(capsys, tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "d").mkdir()
    _one_line_error(capsys, ["demo", "--target", str(tmp_path / "t"), "--draft",
                             str(tmp_path / "d")], "--target/--draft")


def test_logging_stays_on_the_graphdraft_loggers(capsys):
    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    # gets past parsing (logging configured), then fails: the random pair has no tokenizer
    _one_line_error(capsys, ["generate", "--random-models", "--prompt", "hi", "--log-level",
                             "debug"], "--prompt", "no tokenizer")
    assert (root.level, list(root.handlers)) == before
    assert logging.getLogger("graphdraft").level == logging.DEBUG
    assert logging.getLogger("capture").level == logging.DEBUG
    assert main(["generate", "--random-models", "--prompt", "hi", "--log-level", "error"]) == 2
    assert logging.getLogger("graphdraft").level == logging.ERROR
    capsys.readouterr()


# --- prompts -----------------------------------------------------------------------------
def test_prompt_files_lines_and_jsonl(tmp_path):
    plain = tmp_path / "p.txt"
    plain.write_text("first prompt\n\nsecond\\nline two\n")
    assert [(s.text, s.source) for s in read_prompt_file(str(plain))] == [
        ("first prompt", f"--prompt-file {plain}:1"), ("second\nline two", f"--prompt-file {plain}:3")]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a", "max_new_tokens": 3, "stop": ["x"]}\n{"prompt": "b"}\n')
    specs = read_prompt_file(str(jl))
    assert specs[0].overrides == {"max_new_tokens": 3, "stop": ["x"]} and specs[1].overrides == {}
    both = gather(["cli"], str(jl))
    assert [s.text for s in both] == ["cli", "a", "b"] and both[0].source == "--prompt #1"


@pytest.mark.parametrize("content, needle", [
    ('{"prompt": "a"}\n{"prompt": "b", "topp": 0.5}\n', ":2: unknown key 'topp'"),
    ('{"prompt": "a"}\n{"prompt": \n', ":2: expected a JSON object per line"),
    ('{"text": "a"}\n', ':1: expected an object with a non-empty string "prompt"'),
    ('{"prompt": "a", "stop": "x"}\n', ":1: stop: expected a list of non-empty strings"),
    ("\n\n", "expected at least one prompt"),
])
def test_bad_prompt_files_name_file_and_line(tmp_path, content, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(CliError, match="--prompt-file .*bad.jsonl") as e:
        read_prompt_file(str(f))
    assert needle in str(e.value)


def test_prompt_needed_and_per_prompt_params_checked():
    with pytest.raises(CliError, match="--prompt: expected at least one"):
        gather(None, None)
    with pytest.raises(CliError, match="--prompt-file .*missing.txt: expected a readable"):
        gather(None, "/nonexistent/missing.txt")
    a = build_parser().parse_args(["generate", "--prompt", "x", "--max-new-tokens", "8",
                                   "--stop", "##"])
    params, stops = sampling_for(a, PromptSpec("x", "--prompt #1"), (257,), 257)
    assert params.max_new_tokens == 8 and stops == ("##",) and params.stop_token_ids == (257,)
    spec = PromptSpec("x", "--prompt-file f.jsonl:4", {"temperature": 0.7, "top_p": 2.0})
    with pytest.raises(CliError, match=r"f.jsonl:4: top_p: expected in \(0, 1\]"):
        sampling_for(a, spec, (), None)


def test_choice_text_holds_back_partial_characters_and_stop_prefixes():
    from graphdraft.io.tokenizer import ByteLevelTokenizer
    from graphdraft.serving.openai_api.text import ChoiceText
    tok = ByteLevelTokenizer()
    t = ChoiceText(tok)
    assert t.push(list(b"abc") + [0xC3]) == "abc"  # half of "é" waits
    assert t.push([0xA9], "length") == "é" and t.done
    t = ChoiceText(tok, stops=("\n##",))
    assert t.push(list(b"value = 1\n#")) == "value = 1"          # may become the stop string
    assert t.push(list(b"x")) == "\n#x"
    t = ChoiceText(tok, stops=("\n##",))
    assert t.push(list(b"value = 1\n#")) == "value = 1"
    assert t.push(list(b"# tail"), None) == "" and t.stopped and t.done   # cut before the stop
    t = ChoiceText(tok, stops=("##",))
    assert t.push(list(b"a#b")) == "a#b"
    t = ChoiceText(tok, stop_ids=(257,))
    assert t.push([104, 105, 257], "stop") == "hi" and t.tokens == 3     # the stop id is no text


# --- runs --------------------------------------------------------------------------------
def test_demo_on_cpu_prints_no_timing_and_writes_metrics(capsys, tmp_path):
    path = tmp_path / "m" / "metrics.json"
    assert main(["demo", "--num-prompts", "2", "--max-new-tokens", "8", "--device", "cpu",
                 "--quiet", "--metrics-json", str(path)]) == 0
    cap = capsys.readouterr()
    out = cap.out  # results; status lines go to stderr
    assert "running eagerly on the CPU" in cap.err and "running eagerly" not in out
    assert "see timings above" not in out
    assert "mean accept length" in out and "histogram" in out
    assert "greedy outputs identical to target-only: True" in out
    assert "not a performance figure" in out
    assert "tokens/s" not in out and not re.search(r"\d\.\d+x", out)  # before: "speed-up 0.77x"
    assert "speed-up over target-only: not measured" in out
    snap = json.loads(path.read_text())
    assert snap["timings_are_performance"] is False and snap["greedy_identical"] is True
    m = snap["metrics"]
    assert m["requests"] == 2 and m["output_tokens"] == 16
    assert {"ttft_s", "itl_s", "tokens_per_s", "accept_length", "graphs"} <= set(m)
    assert sum(m["accept_length"]["histogram"].values()) > 0
    assert set(m["graphs"]) == {"spec_cycle", "target_verify", "draft_decode", "draft_multi_step",
                                "draft_kv_rebuild"}
    # the wall clock by phase is kept in the JSON, never printed on a CPU
    assert "wall clock" not in out
    wall = snap["wall_s"]
    assert {"models_and_engines", "weights_compile_and_capture", "serving", "total"} <= set(wall)
    assert wall["total"] >= wall["serving"] > 0


def test_wall_clock_adds_its_phases_to_the_process_age(monkeypatch):
    from graphdraft.serving.cli import report

    age = report.process_age_s()
    assert age is not None and 0 < age < 7 * 24 * 3600  # Linux: this process's age
    clock = iter([10.0, 10.5, 12.0, 12.25])
    monkeypatch.setattr(report.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(report, "process_age_s", lambda: 1.5)
    w = report.WallClock()
    w.mark("setup")
    w.mark("serving")
    w.mark("setup")  # a phase marked twice adds up
    assert w.seconds() == {"before_the_command": 1.5, "setup": 0.75, "serving": 1.5, "total": 3.75}
    assert w.line() == ("wall clock: 3.8 s since the process started (before the command 1.5, "
                        "setup 0.8, serving 1.5)")
    monkeypatch.setattr(report, "process_age_s", lambda: None)
    clock = iter([0.0, 2.0])
    w = report.WallClock()
    w.mark("all")
    assert w.seconds() == {"all": 2.0, "total": 2.0}
    assert w.line() == "wall clock: 2.0 s in the command (all 2.0)"


def test_demo_random_pair(capsys):
    assert main(["demo", "--random-models", "--num-prompts", "2", "--max-new-tokens", "8",
                 "--device", "cpu", "--max-running-requests", "4", "--quiet"]) == 0
    cap = capsys.readouterr()
    out = cap.out  # results; status lines go to stderr
    assert "running eagerly on the CPU" in cap.err and "running eagerly" not in out
    assert "see timings above" not in out
    assert "mean accept length" in out and "greedy outputs identical to target-only: True" in out


def test_demo_checkpoint_pair(tmp_path, capsys):
    target, head = make_models(4, dtype=torch.float32)
    save_target(target, tmp_path / "t")
    save_eagle3_head(head, tmp_path / "d")
    assert main(["demo", "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"),
                 "--num-prompts", "2", "--max-new-tokens", "6", "--device", "cpu",
                 "--max-context-len", "256", "--quiet"]) == 0
    assert "identical to target-only: True" in capsys.readouterr().out


def test_generate_json_prompt_file_and_per_prompt_params(capsys, tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "import os\\n", "max_new_tokens": 5}\n'
                  '{"prompt": "class A:\\n", "temperature": 0.8, "top_k": 20, "seed": 3}\n')
    argv = ["generate", "--prompt", "def main():\n", "--prompt-file", str(jl),
            "--max-new-tokens", "12", "--json", "--quiet"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    outs = res["outputs"]
    assert [o["prompt"] for o in outs] == ["def main():\n", "import os\n", "class A:\n"]
    assert [len(o["token_ids"]) for o in outs] == [12, 5, 12]
    assert outs[2]["params"]["temperature"] == 0.8 and outs[2]["params"]["seed"] == 3
    from graphdraft.io.bytes_tokenizer import ByteTokenizer
    for o in outs:
        assert o["text"] == ByteTokenizer().decode(o["token_ids"]) and o["finish_reason"] == "length"
    assert res["metrics"]["output_tokens"] == 29 and res["timings_are_performance"] is False
    # the same greedy prompt again, streamed, with a stop string taken from its text
    text = outs[0]["text"]
    stop = text[4:7]
    assert main(["generate", "--prompt", "def main():\n", "--max-new-tokens", "12",
                 "--stop", stop, "--quiet"]) == 0
    cap = capsys.readouterr()
    assert cap.out == text[: text.index(stop)] + "\n"
    assert "[0] finished: stop" in cap.err and "not a performance figure" in cap.err


def test_generate_streams_every_step():
    from graphdraft.serving.cli import models
    from graphdraft.serving.engine import Engine
    from graphdraft.serving.verify import SamplingParams
    a = build_parser().parse_args(["generate", "--prompt", "x", "--device", "cpu"])
    m = models.load(a)
    engine = Engine(m.target, m.cfg, m.head, eos_token_id=m.eos)
    req = engine.add_request(m.tokenizer.encode("for i in range("),
                             SamplingParams(max_new_tokens=20, ignore_eos=True))
    pieces = []
    from graphdraft.serving.openai_api.text import ChoiceText
    stream = Stream(0, req, ChoiceText(m.tokenizer))
    run_streams(engine, [stream], lambda s, t: pieces.append(t) if t else None)
    assert len(pieces) > 2 and "".join(pieces) == m.tokenizer.decode(req.output)


def test_greedy_mismatch_fails_in_float32_and_is_explained_in_bf16(capsys):
    base, spec = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 7, 6]]
    assert report_greedy_match(base, base, torch.float32) == 0
    assert report_greedy_match(base, spec, torch.float32) == 1
    out = capsys.readouterr().out
    assert "1/2 requests identical; request 1 differs from token 1" in out
    assert report_greedy_match(base, spec, torch.bfloat16) == 0
    assert "expected in bfloat16" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_demo_on_gpu_times_repetitions_and_prints_the_spread(capsys, tmp_path):
    path = tmp_path / "gpu_metrics.json"
    assert main(["demo", "--num-prompts", "4", "--max-new-tokens", "32", "--repeats", "3",
                 "--quiet", "--metrics-json", str(path)]) == 0
    cap = capsys.readouterr()
    out = cap.out
    assert "speed-up over target-only" in out and "median of 3 runs; range" in out
    assert "time to first token: p50" in out and "inter-token latency: p50" in out
    assert "captured speculative graphs in" in cap.err  # status lines: stderr
    assert "wall clock: " in out and "timed runs" in out
    res = json.loads(path.read_text())
    assert res["timings_are_performance"] is True and res["speed_up"]["n"] == 3
    assert {"warm_up_runs", "timed_runs", "total"} <= set(res["wall_s"])
    assert res["metrics"]["graphs"]["spec_cycle"]["replays"] > 0


def test_quiet_reaches_capture_graphs_when_the_engine_accepts_progress(capsys):
    from types import SimpleNamespace

    from graphdraft.serving.cli.demo import capture

    calls = []

    class WithProgress:
        device, cfg = torch.device("cpu"), SimpleNamespace(enforce_eager=False)

        def capture_graphs(self, progress: bool = True) -> None:
            calls.append(progress)

    class Without(WithProgress):
        def capture_graphs(self) -> None:  # the Engine before the capture change
            calls.append("no flag")

    capture(WithProgress(), "x", quiet=True)
    capture(WithProgress(), "x", quiet=False)
    capture(Without(), "x", quiet=True)
    assert calls == [False, True, "no flag"]


def test_help_exits_zero_and_lists_both_commands(capsys):
    assert main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out
    assert main(["generate", "--help"]) == 0
    assert "--prompt-file PATH" in capsys.readouterr().out
    assert main([]) == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_tree_flags_reach_the_config_and_bad_ones_name_the_flag(capsys):
    from graphdraft.serving.cli.models import runtime_from_args
    a = build_parser().parse_args(["demo", "--device", "cpu", "--speculative-eagle-topk", "4",
                                   "--speculative-num-draft-tokens", "8"])
    cfg = runtime_from_args(a)
    assert (cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens) == (4, 8)
    a = build_parser().parse_args(["demo", "--device", "cpu"])
    assert runtime_from_args(a).tree_spec.n == a.speculative_num_steps + 1
    line = _one_line_error(capsys, ["demo", "--device", "cpu", "--speculative-eagle-topk", "2",
                                    "--speculative-num-draft-tokens", "20"],
                           "--speculative-num-draft-tokens", "1 + topk")
    assert "speculative_num_draft_tokens" not in line
    _one_line_error(capsys, ["demo", "--speculative-eagle-topk", "0"], "--speculative-eagle-topk")


def test_demo_tree_prints_the_drafting_mode_and_stays_exact(capsys, tmp_path):
    path = tmp_path / "metrics.json"
    assert main(["demo", "--num-prompts", "2", "--max-new-tokens", "8", "--device", "cpu",
                 "--quiet", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens",
                 "8", "--metrics-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "drafting: tree (steps 3, topk 4, 8 tokens verified per request)" in out
    assert "mean accept length" in out and "greedy outputs identical to target-only: True" in out
    m = json.loads(path.read_text())["metrics"]
    assert m["accept_length"]["drafting"]["mode"] == "tree"
    assert {"tree_cycle", "tree_cycle_sampled"} <= set(m["graphs"])


def test_demo_captures_up_to_its_batch_unless_told(monkeypatch):
    """`graphdraft demo` serves --num-prompts requests at once: without --cuda-graph-max-bs
    its graphs stop there (no larger graph would replay); an explicit value is kept."""
    import graphdraft.serving.cli.demo as demo_mod
    from graphdraft.serving.cli import build_parser

    seen = []

    def load(a, read=True):
        seen.append(a.cuda_graph_max_bs)
        raise KeyboardInterrupt  # stop here: only the arguments matter

    monkeypatch.setattr(demo_mod.models, "load", load)
    p = build_parser()
    for argv, want in ((["--num-prompts", "3"], 3), (["--num-prompts", "40"], 16),
                       (["--num-prompts", "3", "--cuda-graph-max-bs", "8"], 8)):
        with pytest.raises(KeyboardInterrupt):
            demo_mod.demo(p.parse_args(["demo", "--device", "cpu", *argv]))
        assert seen[-1] == want


def test_weights_are_read_while_the_kernels_compile(monkeypatch, tmp_path):
    """The CLI's start-up with graphs on a GPU: the checkpoint's tensors (none read by
    `load(read=False)`) are read as the `meanwhile` of the engines' one compile phase, and
    fill the modules as `load` does; a failed read is a CliError naming the pair; on a CPU
    (no graphs) the read runs alone."""
    from types import SimpleNamespace

    import graphdraft.serving.cli.demo as demo_mod
    from graphdraft.serving.cli import models
    from tests.checkpoint_fixtures import assert_same_state

    events = []

    def start(engines, workers, progress, meanwhile):
        events.append(("start", len(engines), workers))
        meanwhile()
        return True

    monkeypatch.setattr(demo_mod, "start_precompile", start)
    monkeypatch.setattr(demo_mod, "precompile_running", lambda e: True)
    target, head = make_models(4, dtype=torch.float32)
    save_target(target, tmp_path / "t")
    save_eagle3_head(head, tmp_path / "d")
    a = build_parser().parse_args(["demo", "--target", str(tmp_path / "t"), "--draft",
                                   str(tmp_path / "d"), "--device", "cpu"])
    gpu = SimpleNamespace(device="cuda", enforce_eager=False, precompile_workers=3, dp_size=1)
    m = models.load(a, read=False)
    real_read = m.pending.read
    m.pending.read = lambda: events.append(("read",)) or real_read()
    assert demo_mod.read_while_compiling(m, ["base", "spec"], gpu, quiet=True) >= 0
    assert events == [("start", 2, 3), ("read",)] and m.pending is None
    assert_same_state(m.target, models.load(a).target)
    assert m.read_weights() == 0.0  # nothing left to read

    m = models.load(a, read=False)

    def fail():
        raise ValueError("model.safetensors: cannot read tensor 'lm_head.weight'")

    m.pending.read = fail
    with pytest.raises(CliError, match="cannot read tensor 'lm_head.weight'"):
        demo_mod.read_while_compiling(m, ["base", "spec"], gpu, quiet=True)
    events.clear()
    cpu = SimpleNamespace(device="cpu", enforce_eager=False, precompile_workers=3, dp_size=1)
    m = models.load(a, read=False)
    real_read = m.pending.read
    m.pending.read = lambda: events.append(("read",)) or real_read()
    demo_mod.read_while_compiling(m, ["x"], cpu, quiet=True)
    assert events == [("read",)]  # no graphs on a CPU: no phase
