"""Chain verification: greedy and speculative rejection sampling.

A decode row carries N candidates `[c_0, d_1, ..., d_{N-1}]` (c_0 the last
verified token, d_j the drafts); the target scored each position:
`logits [nd * N, V]`, row j predicting the token after candidate j.

Greedy: accept the longest prefix where `d_{j+1} == argmax_j`, plus the
target's token at the first mismatch (the bonus).
Sampled: the drafts are greedy (a point mass), so draft j+1 is accepted with
probability `p_j(d_{j+1})`; at the first rejection the token is drawn from
`p_j` with `d_{j+1}` removed (renormalised); when all are accepted a bonus is
drawn from `p_{N-1}`. The emitted sequence is distributed exactly as sampling
the target token by token.

Returns `output_tokens [nd * N]` (row j: the token after candidate j; valid
for j < accept) and `accept_lengths [nd]` int32 in 1..N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters; `temperature == 0` is greedy.

    Seeds (sampled requests): the Engine samples on device with Philox noise keyed by the
    request's seed and the absolute position of each sampled token, so a request's tokens
    depend only on its seed, its prompt and the models: not on the other requests of the
    batch, the padded batch size, prefill chunking or how many drafts were accepted.
    `seed=None`: the Engine draws a distinct seed from its own `Engine(seed=...)`.
    `seed=s`: the k-th request of an Engine carrying seed s (k = 0, 1, ... in `add_request`
    order) uses `request_seed(s, k)`: one request with seed s reproduces alone or in any
    batch, and several requests sharing one SamplingParams(seed=s) get distinct streams,
    the same ones again whenever the same requests are added in the same order.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: expected >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0: off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def request_seed(seed: int, k: int) -> int:
    """The Philox key of the k-th request carrying `seed` (k = 0: the seed itself, masked to
    63 bits; k > 0: a splitmix64 mix of (seed, k))."""
    m = (1 << 64) - 1
    if k == 0:
        return seed & ((1 << 63) - 1)
    z = (seed + 0x9E3779B97F4A7C15 * (k + 1)) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`[M, V]` logits -> fp32 probabilities after temperature, top-k and top-p."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw, one per row: probs `[M, V]`, u `[M]` in [0, 1)."""
    cdf = torch.cumsum(probs, dim=-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def verify_greedy(candidates: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """candidates `[nd, N]`, logits `[nd * N, V]` -> (output_tokens `[nd * N]`, accept `[nd]`)."""
    nd, n = candidates.shape
    target = torch.argmax(logits, dim=-1).view(nd, n)
    matches = (candidates[:, 1:] == target[:, :-1]).to(torch.int32)
    accept = torch.cumprod(matches, dim=1).sum(dim=1).to(torch.int32) + 1
    return target.reshape(-1), accept


def verify_sampled(candidates: torch.Tensor, logits: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling for rows sharing `params` and one host `generator`."""
    nd, n = candidates.shape
    probs = target_probs(logits, params).view(nd, n, -1)
    u = torch.rand((nd, n + 1), generator=generator).to(logits.device)
    drafts = candidates[:, 1:]
    p_draft = probs[:, :-1].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)       # [nd, N-1]
    ok = (u[:, : n - 1] < p_draft).to(torch.int32)
    accept = torch.cumprod(ok, dim=1).sum(dim=1) + 1                               # [nd] in 1..N
    last = (accept - 1).long()                                                      # where we draw
    p_last = probs[torch.arange(nd, device=probs.device), last]                    # [nd, V]
    rejected = last < n - 1
    if rejected.any():
        removed = drafts.gather(1, last.clamp(max=n - 2).unsqueeze(1)).squeeze(1)
        residual = p_last.scatter(1, removed.unsqueeze(1), 0.0)
        residual_ok = residual.sum(-1, keepdim=True) > 0
        p_last = torch.where(rejected.unsqueeze(1) & residual_ok, residual, p_last)
    drawn = _draw(p_last, u[:, n])
    out = torch.cat([drafts, drafts[:, -1:]], dim=1) if n > 1 else candidates.clone()
    out = out.clone()
    out[torch.arange(nd, device=out.device), last] = drawn
    return out.reshape(-1), accept.to(torch.int32)


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `logits [M, V]` (a prefill row's first output, or no-draft decode)."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    u = torch.rand(logits.shape[0], generator=generator).to(logits.device)
    return _draw(target_probs(logits, params), u)
