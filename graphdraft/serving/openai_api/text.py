"""One choice's text as its token ids arrive: decoded incrementally, cut at stop strings.

The OpenAI API's `stop` ends a choice at the first occurrence of any stop string: the text
before it is returned, the stop string and anything after it are not. While a choice runs,
a tail of its text that could still become a stop string (and a character whose bytes have
not all come, `IncrementalDecoder`) is held back, so no streamed piece is ever taken back.

A choice that ends on a stop token id (EOS, the chat template's end-of-turn token, a
request's `stop_token_ids`) returns the text before that token, as for a stop string; the
token still counts in `usage.completion_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from graphdraft.io.tokenizer import IncrementalDecoder, Tokenizer


class ChoiceText:
    """The text of one choice. `push(ids, finish_reason)` returns the new text that may be
    shown; `stopped` turns True once a stop string ended it (the engine request should then be
    aborted: its later tokens are ignored)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = (),
                 stop_ids: Iterable[int] = ()) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = tuple(stops)
        self.stop_ids = frozenset(stop_ids)
        self.text = ""        # decoded so far (cut at a stop string once one is found)
        self.sent = 0         # characters of `text` returned by push
        self.tokens = 0       # completion tokens received
        self.stopped = False  # a stop string ended the choice
        self.done = False

    def push(self, ids: Sequence[int], finish_reason: str | None = None) -> str:
        """`ids` accepted since the last push; `finish_reason` when the engine request ended
        with them. Returns the text to show now ("" when nothing new may be shown)."""
        if self.done:
            return ""
        self.tokens += len(ids)
        if finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]  # the stop token itself is not text
        self.text += self.decoder.push(ids)
        final = finish_reason is not None
        if final:
            self.text += self.decoder.flush()
        if self._cut_at_stop():
            final = True
        self.done = final
        end = len(self.text) if final else len(self.text) - self._held_back()
        piece = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return piece

    def _cut_at_stop(self) -> bool:
        """Cut `text` before the earliest stop string (searching only what was not shown: a
        shown character was never part of a possible stop string)."""
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
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
