"""Prompts from the command line: `--prompt TEXT` (repeatable) and `--prompt-file PATH`.

A prompt file is either plain text, one prompt per line (blank lines skipped; write `\\n`
for a newline inside a prompt), or JSONL (a `.jsonl` name, or a first non-blank line that
starts with `{`): one object per line with `"prompt"` and optionally the per-prompt
sampling keys `max_new_tokens`, `temperature`, `top_p`, `top_k`, `seed` and `stop` (a
list of strings), which override the flags for that prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphdraft.serving.cli.args import CliError

PER_PROMPT_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")


@dataclass
class PromptSpec:
    text: str
    source: str
    """Where it came from, for error messages: `--prompt #2`, `--prompt-file p.jsonl:3`."""
    overrides: dict[str, Any] = field(default_factory=dict)


def read_prompt_file(path: str) -> list[PromptSpec]:
    """The prompts of `path` (format in the module docstring); CliError naming the line."""
    flag = f"--prompt-file {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"{flag}: expected a readable UTF-8 file ({e})") from e
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    jsonl = path.endswith(".jsonl") or first.lstrip().startswith("{")
    out: list[PromptSpec] = []
    for no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{flag}:{no}"
        if not jsonl:
            out.append(PromptSpec(line.replace("\\n", "\n"), where))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CliError(f"{where}: expected a JSON object per line ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise CliError(f"{where}: expected an object with a non-empty string \"prompt\"")
        unknown = sorted(set(obj) - {"prompt", *PER_PROMPT_KEYS})
        if unknown:
            raise CliError(f"{where}: unknown key {unknown[0]!r}; expected \"prompt\" and any of "
                           f"{', '.join(PER_PROMPT_KEYS)}")
        stop = obj.get("stop", None)
        if stop is not None and not (isinstance(stop, list)
                                     and all(isinstance(s, str) and s for s in stop)):
            raise CliError(f"{where}: stop: expected a list of non-empty strings, got {stop!r}")
        out.append(PromptSpec(obj["prompt"], where,
                              {k: obj[k] for k in PER_PROMPT_KEYS if k in obj}))
    if not out:
        raise CliError(f"{flag}: expected at least one prompt, the file has none")
    return out


def gather(prompts: list[str] | None, prompt_file: str | None) -> list[PromptSpec]:
    """`--prompt` values then the prompt file's; CliError when there is none or one is empty."""
    specs = []
    for i, text in enumerate(prompts or [], start=1):
        if not text:
            raise CliError(f"--prompt #{i}: expected non-empty text")
        specs.append(PromptSpec(text, f"--prompt #{i}"))
    if prompt_file is not None:
        specs += read_prompt_file(prompt_file)
    if not specs:
        raise CliError("--prompt: expected at least one --prompt TEXT or a --prompt-file PATH")
    return specs
