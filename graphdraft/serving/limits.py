"""What an Engine can serve, as plain numbers: `EngineLimits` and its request check.

`Engine.limits` is `EngineLimits.of(engine)`, built once; `Engine.check_request` is its
`check`. The server's engine-core process sends them at start-up, so the HTTP process
answers 400 for a request that can never fit before anything is queued, and the largest
`max_tokens` that fits, without asking the engine (tests/test_server.py compares the two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphdraft.runtime.slot_state import StopTableFullError
from graphdraft.serving.verify import SamplingParams


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_context_len: int
    lookahead: int
    """KV positions reserved per request past its prompt and max_new_tokens."""
    page_size: int
    pool_pages: int
    """KV pages a request may hold at most (the pool's pages less the null page)."""
    stop_table_width: int
    eos_token_id: int | None
    max_logprobs: int = 20
    """The widest logprobs / prompt_logprobs a request may ask (`RuntimeConfig.max_logprobs`)."""

    @classmethod
    def of(cls, engine: Any) -> EngineLimits:
        """An `Engine`'s limits (in the engine-core process)."""
        return cls(vocab_size=int(engine.target.config.vocab_size),
                   max_context_len=int(engine.cfg.max_context_len),
                   lookahead=int(engine.lookahead), page_size=int(engine.pages.page_size),
                   pool_pages=int(engine.pages.num_pages) - 1,
                   stop_table_width=int(engine.cfg.stop_table_width),
                   eos_token_id=engine.eos_token_id,
                   max_logprobs=int(engine.cfg.max_logprobs))

    def stop_ids(self, params: SamplingParams) -> list[int]:
        """The ids that end the request: its stop ids, EOS first unless ignore_eos."""
        stops = list(dict.fromkeys(params.stop_token_ids))
        if self.eos_token_id is not None and not params.ignore_eos \
                and self.eos_token_id not in stops:
            stops.insert(0, self.eos_token_id)
        return stops

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """ValueError naming the argument when `prompt` / `params` can never be served
        (`StopTableFullError`, a ValueError, for too many stop ids)."""
        vocab = self.vocab_size
        if not prompt or not _token_ids(prompt, vocab):
            raise ValueError(f"prompt: expected a non-empty list of token ids in [0, {vocab})")
        bad_bias = [t for t, _ in params.logit_bias if t >= vocab]
        if bad_bias:
            raise ValueError(f"params.logit_bias: expected token ids in [0, {vocab}), got "
                             f"{bad_bias[:4]}")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                raise ValueError(f"params.{name}: expected at most {self.max_logprobs} "
                                 f"(RuntimeConfig.max_logprobs), got {asked}")
        stops = self.stop_ids(params)
        if len(stops) > self.stop_table_width:
            raise StopTableFullError(
                f"params.stop_token_ids: expected at most {self.stop_table_width} stop ids "
                f"with EOS (RuntimeConfig.stop_table_width), got {len(stops)}")
        need = len(prompt) + params.max_new_tokens + self.lookahead
        if need > self.max_context_len:
            raise ValueError(f"prompt: {len(prompt)} tokens + max_new_tokens "
                             f"{params.max_new_tokens} + look-ahead {self.lookahead} exceed "
                             f"max_context_len ({self.max_context_len})")
        pages = -(-need // self.page_size)
        if pages > self.pool_pages:
            raise ValueError(f"prompt: needs {pages} KV pages, the pool has {self.pool_pages}")


def _token_ids(ids: list[int], vocab: int) -> bool:
    """Whether every element of the non-empty `ids` is an int in [0, vocab) (C-level passes:
    this runs for every prompt at admission)."""
    if set(map(type, ids)) != {int}:  # bools, int subclasses, anything else: one by one
        return all(isinstance(t, int) and 0 <= t < vocab for t in ids)
    return min(ids) >= 0 and max(ids) < vocab
