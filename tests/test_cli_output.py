"""What the commands write where: stdout holds results only (text, JSON), every status line
goes to stderr. `generate --json` is one JSON document with and without --quiet; several
prompts come out readable (whole texts under headers, or JSON lines with index and delta).
The shipped pair on the CPU, a few tokens each."""

from __future__ import annotations

import json

import pytest

from graphdraft.__main__ import main

GEN = ["generate", "--device", "cpu", "--max-new-tokens", "8"]


@pytest.mark.parametrize("quiet", [False, True])
def test_generate_json_is_one_document_with_or_without_quiet(capsys, quiet):
    argv = GEN + ["--prompt", "def main():\n", "--prompt", "import os\n", "--json"]
    assert main(argv + (["--quiet"] if quiet else [])) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)  # the whole of stdout: one document, no status line before it
    assert [o["index"] for o in doc["outputs"]] == [0, 1]
    assert all(len(o["token_ids"]) == 8 for o in doc["outputs"])
    if not quiet:
        assert "read the weights" in cap.err  # the status line went to stderr


def test_one_prompt_streams_only_its_text(capsys):
    assert main(GEN + ["--prompt", "def main():\n", "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["outputs"][0]["text"]
    assert main(GEN + ["--prompt", "def main():\n"]) == 0
    cap = capsys.readouterr()
    assert cap.out == text + "\n"
    assert "[0] finished: length, 8 tokens" in cap.err and "output tokens" in cap.err


def test_several_prompts_are_readable_blocks_or_json_lines(capsys):
    prompts = ["def main():\n", "import os\n", "class A:\n"]
    argv = GEN + [x for p in prompts for x in ("--prompt", p)]
    assert main(argv + ["--json", "--quiet"]) == 0
    texts = [o["text"] for o in json.loads(capsys.readouterr().out)["outputs"]]
    assert main(argv) == 0
    out = capsys.readouterr().out
    blocks = {}
    for block in out.split("==> [")[1:]:
        head, _, body = block.partition(" <==\n")
        blocks[int(head.rstrip("]"))] = body[:-2]  # each block ends with "\n\n"
    assert blocks == dict(enumerate(texts))
    assert main(argv + ["--json-lines"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    got = {i: "".join(x["text"] for x in lines if x["index"] == i and "text" in x)
           for i in range(3)}
    assert got == dict(enumerate(texts))
    ends = [x for x in lines if "finish_reason" in x]
    assert sorted(x["index"] for x in ends) == [0, 1, 2]
    assert all(x["completion_tokens"] == 8 for x in ends)
    assert len(lines) > len(ends) + 3  # streamed in pieces, not one line per request


def test_json_and_json_lines_conflict(capsys):
    assert main(GEN + ["--prompt", "x", "--json", "--json-lines"]) == 2
    assert "--json-lines" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--dp-size", "2"], "--dp-size"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["serve", "--random-models"], "tokenizer"),
])
def test_serve_flag_errors_are_one_line(capsys, argv, needle):
    assert main(argv + ["--device", "cpu", "--quiet"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1 and needle in cap.err
