"""`prompt_logprobs`: each prompt token's log-probability, scored by the prefill's own forward.

A prefill chunk of a request that asked `prompt_logprobs` (an int w: the token's
log-probability and its w likeliest alternatives) adds the chunk's positions whose next
prompt token is known to the forward's logits rows (`DecodeMode.target_forward`: after the
rows the step samples from, so nothing else moves); `ops.token_logprobs` scores them on the
device (the same kernel and distribution as the generated tokens' logprobs:
`graphdraft.sampling.MAX_LOGPROBS`' note, without the penalties, which count generated
tokens only, and with the request's logit_bias not applied: vLLM's prompt logprobs are of
the raw model too) and one non-blocking copy brings them into pinned memory; the Engine
reads them when it retires the step (`apply`), one step late like every token, with no sync
of its own. Eager only (prefill steps are). The prompt's first token has no log-probability
(None), as in vLLM.

Each scored token also gets its rank (`token_ranks`): 1 + the number of vocabulary entries
whose logit is strictly larger than its own, counted by torch on the device beside the
kernel, in the logits' own dtype (exact: log_softmax is a shift, so a strictly larger
logprob is a strictly larger logit; tied entries share a rank; vLLM counts `>=` instead, the
same where nothing ties). It rides in the same copy (one int32 column past the kernel's
`[1 + 2K]` words).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graphdraft import ops
from graphdraft.kernels.logprobs import unpack_row

RANK_CHUNK_ELEMENTS = 1 << 26
"""Logits entries compared at once by `token_ranks` (bounds its `[rows, V]` bool temporary)."""


@dataclass
class ScoredChunk:
    """One chunk's scored positions: `request`, the prompt position of its first scored
    token (`first`), how many (`count`) and the top width asked (`width`)."""

    request: object  # graphdraft.serving.request.Request
    first: int
    count: int
    width: int


@dataclass
class ScorePlan:
    """What `PromptLogprobs.plan` adds to a forward: `token_rows` (InputBuffers token indices
    to compute logits at, appended after the step's own `base` logits rows), their next
    prompt tokens, the chunks they belong to."""

    base: int
    token_rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    chunks: list[ScoredChunk] = field(default_factory=list)


@dataclass
class ScoredStep:
    """A launched step's prompt scores: host (pinned) `[m, 2 + 2K]` int32 rows in chunk order
    (`kernels.logprobs`' `[1 + 2K]` words, then the rank), valid once the step's event
    completed."""

    host: torch.Tensor
    chunks: list[ScoredChunk]
    k: int

    def apply(self) -> None:
        """Append each chunk's log-probabilities and ranks to its request
        (`Request.prompt_logprobs`, `prompt_top_logprobs`, `prompt_ranks`; an aborted
        request's are dropped)."""
        row, width = 0, 1 + 2 * self.k
        ranks = self.host[:, width].tolist()
        for c in self.chunks:
            r = c.request
            if r.prompt_logprobs is not None and r.finish_reason in (None, "stop", "length"):
                del r.prompt_logprobs[c.first:], r.prompt_top_logprobs[c.first:]  # in place
                del r.prompt_ranks[c.first:]
                for i in range(c.count):
                    lps, tops = unpack_row(self.host[row + i, :width], 1, self.k, 1, c.width)
                    r.prompt_logprobs.append(lps[0])
                    r.prompt_top_logprobs.append(tops[0])
                r.prompt_ranks += ranks[row: row + c.count]
            row += c.count


class PromptLogprobs:
    """The mode's prompt scorer: `plan` the extra logits rows, `score` them after the forward,
    `take` the launched step's `ScoredStep` (None: no chunk asked)."""

    def __init__(self, cfg, host_tensor) -> None:
        self.cfg, self.host_tensor = cfg, host_tensor
        self._pending: ScoredStep | None = None

    def plan(self, rows, preqs, base: int) -> ScorePlan:
        plan, tok = ScorePlan(base), 0
        for row, r in zip(rows, preqs, strict=False):
            w = getattr(r.params, "prompt_logprobs", None)
            if row.is_prefill and w is not None and row.next_ids is not None:
                known = [(t, nxt) for t, nxt in enumerate(row.next_ids) if nxt >= 0]
                plan.token_rows += [tok + t for t, _ in known]
                plan.targets += [nxt for _, nxt in known]
                if known:
                    plan.chunks.append(ScoredChunk(r, row.start + known[0][0] + 1, len(known), w))
            tok += len(row.input_ids)
        return plan

    def score(self, plan: ScorePlan, logits: torch.Tensor) -> None:
        """Score `plan`'s rows of `logits` (`[base + m, V]`) on the device and start their
        copy to pinned host memory (stream-ordered: the step's event covers it)."""
        m = len(plan.token_rows)
        if m == 0:
            return
        k, dev = self.cfg.max_logprobs, logits.device
        widths = [-1]
        for c in plan.chunks:
            widths += [c.width] * c.count
        slots = torch.arange(1, m + 1, device=dev)
        out = torch.zeros((m, 2 + 2 * k), dtype=torch.int32, device=dev)
        rows, targets = logits[plan.base: plan.base + m], self.host_tensor(plan.targets)
        ops.token_logprobs(rows, targets.view(m, 1), slots,
                           self.host_tensor(widths).to(torch.int32), out=out[:, : 1 + 2 * k],
                           k=k, kernels=self.cfg.kernels)
        out[:, 1 + 2 * k] = token_ranks(rows, targets)
        host = torch.empty(out.shape, dtype=torch.int32, pin_memory=dev.type == "cuda")
        host.copy_(out, non_blocking=True)
        self._pending = ScoredStep(host, plan.chunks, k)

    def take(self) -> ScoredStep | None:
        pending, self._pending = self._pending, None
        return pending


def token_ranks(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`[m]` int32: 1 + the number of entries of row i of `logits [m, V]` strictly larger than
    `logits[i, tokens[i]]` (`tokens [m]` ids in [0, V)), on `logits`' device without a sync;
    at most `RANK_CHUNK_ELEMENTS` entries compared at once."""
    m, v = logits.shape
    out = torch.empty(m, dtype=torch.int32, device=logits.device)
    step = max(1, RANK_CHUNK_ELEMENTS // max(v, 1))
    for a in range(0, m, step):
        x = logits[a: a + step]
        own = x.gather(1, tokens[a: a + step].view(-1, 1).to(torch.int64))
        out[a: a + step] = (x > own).sum(1) + 1
    return out
