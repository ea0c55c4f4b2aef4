"""One choice's text as its token ids arrive: decoded incrementally, cut exactly at stop strings.

The one rule the CLI (`graphdraft generate`) and the OpenAI server share:
  - a stop string ends the choice at its first occurrence in the decoded text, wherever the
    token boundaries fall (across tokens, inside one token's text, across verify windows);
    the text before it is returned, the stop string itself only with
    `include_stop_str_in_output` (vLLM's name; OpenAI never returns it), nothing after it;
  - the tokens kept are those up to and including the one that completed the stop string
    (vLLM's convention: they were generated); every later token, with its log-probabilities,
    is dropped, and the engine request should be aborted (`stopped`);
  - a choice that ends on a stop token id (EOS, end-of-turn, `stop_token_ids`) returns the
    text before that token; the id is kept in `token_ids` (it counts in usage) but has no
    text and no `Token` entry;
  - while a choice runs, only a tail of its text that could still be the start of a stop
    string is held back (and bytes of a character not complete yet: `IncrementalDecoder`),
    so nothing streamed is ever taken back.

`push(ids, finish_reason, logprobs)` returns the text that may be shown now; `take_tokens()`
the kept tokens whose text has been shown (all of them once the choice is done), each a
`Token` (id, its text, its offset in the choice's text, its log-probability and top
alternatives when the request asked).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from graphdraft.io.tokenizer import IncrementalDecoder, Tokenizer

TokenLogprob = tuple[float, list[tuple[int, float]]]
"""One token's (log-probability, [(alternative id, log-probability), ...] best first)."""


@dataclass(frozen=True)
class Token:
    """A kept token: its id, the text it added (`start` .. `end` in the choice's text, before
    any cut) and, when asked, its log-probability and top alternatives."""

    id: int
    start: int
    end: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class ChoiceText:
    """The text of one choice (module docstring). `stopped` turns True once a stop string
    ended it; `done` once nothing more will be returned."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = (),
                 stop_ids: Iterable[int] = (), include_stop: bool = False) -> None:
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop: expected non-empty strings, got {list(stops)!r}")
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = tuple(stops)
        self.stop_ids = frozenset(stop_ids)
        self.include_stop = include_stop
        self.text = ""        # decoded so far (cut at a stop string once one is found)
        self.sent = 0         # characters of `text` returned by push
        self.token_ids: list[int] = []  # kept ids (a final stop id included)
        self.entries: list[Token] = []  # kept tokens with text (no stop id)
        self._released = 0    # entries handed out by take_tokens
        self.stopped = False  # a stop string ended the choice
        self.done = False

    @property
    def tokens(self) -> int:
        """Completion tokens kept (usage): nothing after a stop string counts."""
        return len(self.token_ids)

    def push(self, ids: Sequence[int], finish_reason: str | None = None,
             logprobs: Sequence[TokenLogprob] | None = None) -> str:
        """`ids` accepted since the last push (with their `logprobs`, when asked);
        `finish_reason` when the engine request ended with them. Returns the text to show now
        ("" when nothing new may be shown)."""
        if self.done:
            return ""
        final = finish_reason is not None
        last_is_stop_id = finish_reason == "stop" and bool(ids) and ids[-1] in self.stop_ids
        for j, t in enumerate(ids):
            self.token_ids.append(int(t))
            if last_is_stop_id and j == len(ids) - 1:
                break  # the stop token itself is not text
            start = len(self.text)
            self.text += self.decoder.push([t])
            lp, top = logprobs[j] if logprobs is not None else (None, ())
            self.entries.append(Token(int(t), start, len(self.text), lp, tuple(top)))
            if self._cut_at_stop():
                final = True
                break
        if final and not self.stopped:
            self.text += self.decoder.flush()
            final = True
            self._cut_at_stop()
        self.done = final
        end = len(self.text) if final else len(self.text) - self._held_back()
        piece = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return piece

    def take_tokens(self) -> list[Token]:
        """Kept tokens not handed out yet whose text has been returned (every kept token once
        the choice is done); a token whose text is empty so far (bytes of an incomplete
        character) goes with the next one shown."""
        if self.done:
            upto = len(self.entries)
        else:
            upto = self._released
            while upto < len(self.entries) and self.entries[upto].end <= self.sent:
                upto += 1
        out = self.entries[self._released: upto]
        self._released = upto
        return out

    def _cut_at_stop(self) -> bool:
        """Cut `text` at the earliest stop string (searching only what was not shown: a
        shown character was never part of a possible stop string)."""
        hits = [(i, len(s)) for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if not hits:
            return False
        i, n = min(hits)
        self.text = self.text[: i + n if self.include_stop else i]
        self.stopped = True
        return True

    def _held_back(self) -> int:
        """Characters at the end of `text` that may be the start of a stop string."""
        tail = self.text[self.sent:]
        for k in range(min(len(tail), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stops):
                return k
        return 0

    @property
    def finish_reason_override(self) -> str | None:
        """"stop" once a stop string ended the choice (whatever the engine says later)."""
        return "stop" if self.stopped else None
