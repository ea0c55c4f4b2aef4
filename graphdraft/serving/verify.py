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

import math

import torch

from graphdraft.sampling import SamplingParams, request_seed

__all__ = ["SamplingParams", "request_seed", "target_probs", "verify_greedy", "verify_sampled",
           "sample_tokens"]


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`[M, V]` logits -> fp32 probabilities after temperature, top-k, min_p and top-p (the
    logits as the request's logit controls left them: `graphdraft.kernels.logit_controls`)."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.min_p > 0:  # p >= min_p * p_max
        bound = x.amax(-1, keepdim=True) + math.log(params.min_p)
        x = x.masked_fill(x < bound, float("-inf"))
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
