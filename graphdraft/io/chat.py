"""Chat templates: a checkpoint's Jinja template rendered the way transformers renders it.

A chat template (`tokenizer_config.json`'s `chat_template`, or a `chat_template.jinja` file
beside it) turns a list of messages `[{"role": "system" | "user" | "assistant", "content":
str}, ...]` into the prompt text the model was tuned on. Rendering follows transformers'
`apply_chat_template`: a sandboxed Jinja environment (`ImmutableSandboxedEnvironment`,
`trim_blocks`, `lstrip_blocks`, the `loopcontrols` extension), a `tojson` filter that does not
escape HTML, the `raise_exception` and `strftime_now` globals, and the tokenizer's special
tokens (`bos_token`, `eos_token`, ...) as variables.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """A template that does not compile, or raised while rendering (its `raise_exception`)."""


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """`messages` as a list of `{"role", "content"}` dicts; ValueError naming the bad field.

    Expected: a non-empty list; each item a dict with `role` one of `ROLES` and `content` a
    string; other keys (`name`, `tool_calls`, ...) are passed to the template unchanged.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages: expected a list of {{'role', 'content'}} objects, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages: expected at least one message, got an empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}]: expected an object with 'role' and 'content', "
                             f"got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role: expected one of {', '.join(ROLES)}, "
                             f"got {role!r}")
        content = msg.get("content")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: expected a string, "
                             f"got {type(content).__name__}")
        out.append(dict(msg))
    return out


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class ChatTemplate:
    """One compiled chat template; `render(messages)` -> the prompt text.

    `special_tokens`: the variables the template may read besides `messages` and
    `add_generation_prompt` (`{"bos_token": "<s>", "eos_token": "</s>", ...}`).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None,
                 where: str = "chat_template") -> None:
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{where}: expected a non-empty Jinja template string")
        import jinja2
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{where}: the chat template does not compile ({e})") from e
        self.source, self.where = source, where
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for `messages` (validated first: ValueError naming `messages`)."""
        import jinja2
        msgs = validate_messages(messages)
        try:
            return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **kwargs)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.where}: rendering messages failed: {e}") from e
