"""Prompts from the command line: `--prompt TEXT` (repeatable) and `--prompt-file PATH`.

A prompt file is either plain text, one prompt per line (blank lines skipped; write `\\n`
for a newline inside a prompt), or JSONL (a `.jsonl` name, or a first non-blank line that
starts with `{`): one object per line with `"prompt"` and optionally the per-prompt
sampling keys `max_new_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop` (a
list of strings), `min_p`, `repetition_penalty`, `frequency_penalty`, `presence_penalty` and
`logit_bias` (an object of token id -> bias), `logprobs`, `prompt_logprobs` (ints) and
`include_stop_str_in_output` (a bool), which override the flags for that prompt. A
JSONL line may hold a conversation instead of a prompt: `"messages": [{"role": "system" |
"user" | "assistant", "content": "..."}, ...]` (multi-turn; the chat template renders it,
ending with the assistant's turn to come).

`--chat` (`add_chat_flags`) applies the target's chat template: each `--prompt` / plain line
becomes one user message (after `--system-prompt`, when given, as the system message), and a
`messages` line gets the system prompt first unless it has one. `encode_prompts(tokenizer,
specs, chat=..., system_prompt=...)` turns the specs into token ids; the CLI's commands call
it (a `messages` line without `--chat` is rendered with the template too).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphdraft.serving.cli.args import CliError

PER_PROMPT_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "min_p",
                   "repetition_penalty", "frequency_penalty", "presence_penalty",
                   "logit_bias", "logprobs", "prompt_logprobs", "include_stop_str_in_output")


@dataclass
class PromptSpec:
    text: str
    source: str
    """Where it came from, for error messages: `--prompt #2`, `--prompt-file p.jsonl:3`."""
    overrides: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None
    """A conversation (a JSONL `messages` line), rendered with the chat template; `text` is
    then its last user message (for display)."""


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
        if isinstance(obj, dict) and "messages" in obj and "prompt" not in obj:
            messages = _messages(obj["messages"], where)
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"]:
            messages = None
        else:
            raise CliError(f"{where}: expected an object with a non-empty string \"prompt\" "
                           "or a \"messages\" list")
        unknown = sorted(set(obj) - {"prompt", "messages", *PER_PROMPT_KEYS})
        if unknown:
            raise CliError(f"{where}: unknown key {unknown[0]!r}; expected \"prompt\" or "
                           f"\"messages\" and any of {', '.join(PER_PROMPT_KEYS)}")
        stop = obj.get("stop", None)
        if stop is not None and not (isinstance(stop, list)
                                     and all(isinstance(s, str) and s for s in stop)):
            raise CliError(f"{where}: stop: expected a list of non-empty strings, got {stop!r}")
        text = obj["prompt"] if messages is None else _last_user_text(messages)
        out.append(PromptSpec(text, where, {k: obj[k] for k in PER_PROMPT_KEYS if k in obj},
                              messages))
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


def _messages(value: Any, where: str) -> list[dict[str, Any]]:
    from graphdraft.io.chat import validate_messages
    try:
        return validate_messages(value)
    except ValueError as e:
        raise CliError(f"{where}: {e}") from None


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else messages[-1]["content"]


def add_chat_flags(p: argparse.ArgumentParser) -> None:
    """`--chat` and `--system-prompt` (read by `encode_prompts` through the namespace)."""
    g = p.add_argument_group("chat")
    g.add_argument("--chat", action="store_true",
                   help="apply the target's chat template: each prompt is a user message")
    g.add_argument("--system-prompt", default=None, metavar="TEXT",
                   help="with --chat: the system message before each conversation")


def conversation(spec: PromptSpec, system_prompt: str | None) -> list[dict[str, Any]]:
    """The messages of `spec` under `--chat`: its own list, or one user message, with the
    system prompt first unless the list has a system message."""
    messages = list(spec.messages) if spec.messages is not None else [
        {"role": "user", "content": spec.text}]
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def encode_prompts(tokenizer: Any, specs: list[PromptSpec], *, chat: bool = False,
                   system_prompt: str | None = None) -> list[list[int]]:
    """Token ids of each spec (`graphdraft.io.tokenizer.Tokenizer`): plain text as is (no
    special tokens added); with `chat`, or for a `messages` line, the chat template's text
    with the generation prompt. CliError naming the spec when the model has no tokenizer, no
    chat template, or the encoding is empty."""
    if tokenizer is None:
        raise CliError("--prompt: the model pair has no tokenizer (--random-models has none; a "
                       "--target needs tokenizer.json and the `tokenizers` package)")
    if system_prompt is not None and not chat:
        raise CliError("--system-prompt: needs --chat (the system message goes through the "
                       "chat template)")
    out = []
    for spec in specs:
        try:
            if chat or spec.messages is not None:
                text = tokenizer.apply_chat_template(conversation(spec, system_prompt))
            else:
                text = spec.text
            ids = tokenizer.encode(text)
        except ValueError as e:
            flag = "--chat" if chat else spec.source
            raise CliError(f"{spec.source}: {e}" if flag == spec.source else
                           f"{flag} ({spec.source}): {e}") from None
        if not ids:
            raise CliError(f"{spec.source}: the prompt encodes to no tokens")
        out.append(ids)
    return out
