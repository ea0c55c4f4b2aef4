"""One generation request as the Engine tracks it on the host.

The decode progress itself lives on the device (`runtime.slot_state.SlotState`, the KV
lengths); the host keeps what it has read back one step later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphdraft.serving.verify import SamplingParams


@dataclass
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    committed: int = 0                   # prompt positions prefilled (decode progress: on device)
    last_verified: int | None = None     # the last emitted token, as the host has read it
    finish_reason: str | None = None
    seed: int = 0                        # Philox key of sampled tokens (verify.request_seed)
    in_flight: int = 0                   # launched steps that emit for it, not yet retired
    drafts_ready: int = 0                # drafts its slot holds that were drafted for it (the
                                         # rest: filler), as of the last launched step
    logprobs: list[float] | None = None  # per output token (params.logprobs set; else None)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per output token, its `params.logprobs` likeliest (token id, log-probability), best first."""
    prompt_logprobs: list[float | None] | None = None
    """Per prompt token (params.prompt_logprobs set): its log-probability; the first: None."""
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per prompt token, the `params.prompt_logprobs` likeliest alternatives (the first: [])."""
    prompt_ranks: list[int | None] | None = None
    """Per prompt token, its rank: 1 + the vocabulary entries likelier than it (the first: None)."""

    def __post_init__(self) -> None:
        """The log-probability lists its params ask for, empty (the prompt's: its first
        token's None / [] entries)."""
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs, self.top_logprobs = [], []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs, self.prompt_top_logprobs, self.prompt_ranks = [None], [[]], [None]

    @property
    def prefilling(self) -> bool:
        return self.committed < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
