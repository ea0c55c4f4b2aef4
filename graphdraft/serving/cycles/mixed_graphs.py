"""The prefill / mixed step's target forward as CUDA graphs over padded (rows, tokens) buckets.

Eagerly, a mixed step's target forward (`DecodeMode.target_forward`) launches every op of
every layer from Python; with a small model that host time is most of the step. As vLLM does
for mixed batches, `MixedTargetGraphs` captures the forward once per token bucket
(`token_buckets`: powers of two from `MIN_TOKENS` and their 1.5x, at most `MAX_TOKENS` and the
token buffers' size) and row bucket (`row_buckets`: 8, 32, 128, ... and the Engine's largest
graph size), reading everything from persistent buffers:

  InputBuffers  ids / positions / KV slots `[Tb]`, rows `[R]` (req, seq_lens, extend_lens)
  logit_rows    `[L]` int64 here: the rows whose logits the step samples, then 0 (L = min(R *
                n_row, Tb): a mixed step samples a prefill row's last token and a decode
                row's n_row tokens)

A step of `bs` rows and `t` tokens runs the smallest bucket with R >= bs and Tb >= t. The
rows' metadata is this module's (`req`, `seq`, `ext`: the step's rows copied from
InputBuffers, rows [bs, R) of no token, then `cover_rows` rows of the dummy request covering
the padded tokens [t, Tb), max_context_len tokens each at most); the padded tokens are token 0
at position 0 writing the dummy KV slot (what they compute stays in the dummy page, which
inert rows alone read, and stays finite: each attends over written KV). The returned views
are the step's: logits `[L_real, V]`, aux hidden states `[t, kH]`.

`active` says whether mixed steps take this path: on a CUDA device, the model on one device
(no tensor or data parallelism), with graphs on or off: graphs off (`enforce_eager`,
GRAPHDRAFT_EAGER=1) or a size without a graph runs the same padded forward eagerly, so
graph == eager bit for bit, as for the decode cycle. The forwards are registered (captured)
only with graphs on. On the CPU the unpadded forward runs (tests set `active` to run the
padded one eagerly).
Not taken (the unpadded eager forward): steps past the largest bucket, steps that score
prompt log-probabilities.

The chain's draft follows the same buckets: with a `PadsMixedDraft` drafter (the
`EagleDrafter`) the forward writes its aux hidden states `[Tb, kH]` into the drafter's buffer
(`aux_out`) and the drafter's first step over the step runs padded to the same (R, Tb)
(`EagleDrafter.draft_mixed_padded`: its padded tokens are these padded tokens, its rows
[bs, R) padded rows of no token), replayed from ("draft_mixed", Tb) in the drafter's
`graphs()`: one small graph (one head layer) per target bucket; graphs off, eagerly.
"""

from __future__ import annotations

import functools

import torch

from capture import CapturedForward
from graphdraft.models.llama import TargetOutput

MIN_TOKENS = 64
MAX_TOKENS = 4096
"""Token buckets stop here: a larger step is prefill-bound (its launches are a small part)."""


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from MIN_TOKENS and the halfway points 1.5x (a step computes at most
    1.5x its tokens), up to the first >= min(max_tokens, MAX_TOKENS), the last capped at
    `max_tokens` (the token buffers' rows)."""
    top = min(max_tokens, MAX_TOKENS)
    out, b = [], MIN_TOKENS
    while True:
        for x in (b, b * 3 // 2):
            out.append(min(x, max_tokens))
            if x >= top:
                return sorted(set(out))
        b *= 2


ROW_STEP = 4
"""Row buckets: 8, 32, 128, ... (x ROW_STEP) and the largest graph size: a padded row covers
no token, so coarse buckets cost little and keep the graphs few."""


def row_buckets(schedule: list[int]) -> list[int]:
    """8 x ROW_STEP^i below the schedule's largest size, and that size."""
    top, out, r = max(schedule), set(), 8
    while r < top:
        out.add(r)
        r *= ROW_STEP
    return sorted(out | {top})


def cover_rows(tokens: int, chunk: int) -> int:
    """Rows that cover a bucket's padded tokens, `chunk` tokens each at most."""
    return -(-tokens // chunk)


class MixedTargetGraphs:
    """The captured mixed-step target forwards of one decode mode (module docstring)."""

    def __init__(self, parts, n_row: int, capture_aux: bool, active: bool) -> None:
        self.parts, self.n_row, self.capture_aux = parts, n_row, capture_aux
        self.active = active
        ib = parts.inputs
        self.chunk = parts.cfg.max_context_len
        self.rows = [r for r in row_buckets(parts.schedule) if r <= ib.max_bs]
        self.tokens = token_buckets(ib.max_tokens)
        dev = ib.input_ids.device
        self.logit_rows = torch.zeros(max(self.rows) * n_row, dtype=torch.int64, device=dev)
        n = max(self.rows) + cover_rows(max(self.tokens), self.chunk)
        self.req = torch.zeros(n, dtype=ib.req_pool_indices.dtype, device=dev)
        self.seq = torch.ones(n, dtype=ib.seq_lens.dtype, device=dev)
        self.ext = torch.zeros(n, dtype=ib.extend_lens.dtype, device=dev)
        self.aux_out: torch.Tensor | None = None
        """`[>= max(tokens), kH]`: where the forward writes its aux hidden states (set before
        capture: a `PadsMixedDraft` drafter's `pad_mixed` buffer, whose padded first step
        reads them there); None: the graph's own output."""
        self.by_tokens: dict[int, CapturedForward] = {}
        if not (active and parts.graphs_enabled):
            return  # (active: the same padded forward, eagerly)
        for tb in sorted(self.tokens, reverse=True):
            sizes = [r for r in self.rows if r <= tb]
            fwd = CapturedForward(f"mixed_target_t{tb}", functools.partial(self._forward, tokens=tb),
                                  sizes, pool=parts.graph_pool, enabled=parts.graphs_enabled,
                                  on_oom=parts.on_oom)
            self.by_tokens[tb] = parts.registry.add("mixed_target", tb, fwd)

    def bucket(self, bs: int, t: int) -> tuple[int, int] | None:
        """(R, Tb): the smallest buckets holding `bs` rows and `t` tokens (None: none)."""
        r = next((x for x in self.rows if x >= bs), None)
        tb = next((x for x in self.tokens if x >= t and x >= (r or 0)), None)
        return None if r is None or tb is None else (r, tb)

    def run(self, bs: int, t: int, logit_rows, bucket: tuple[int, int]) -> TargetOutput:
        """The forward of a step written into InputBuffers (`bs` rows, `t` tokens; its logits
        rows `logit_rows`, a host int64 array) at `bucket` (`bucket()`): its rows, then
        R - bs rows of no token, then the rows covering the padded tokens [t, Tb) (each a
        row of the dummy request over at most max_context_len tokens: every token's
        attention reads written KV, so every value stays finite)."""
        p = self.parts
        r, tb = bucket
        ib, staging = p.inputs, p.slots.staging
        self.req[:bs].copy_(ib.req_pool_indices[:bs])
        self.seq[:bs].copy_(ib.seq_lens[:bs])
        self.ext[:bs].copy_(ib.extend_lens[:bs])
        pad, c = tb - t, self.chunk
        tail = [0] * (r - bs) + [min(c, max(0, pad - i * c)) for i in range(cover_rows(tb, c))]
        staging.copy_into(self.ext[bs:], tail)
        staging.copy_into(self.seq[bs:], [max(1, e) for e in tail])
        self.req[bs: bs + len(tail)].zero_()
        if tb > t:
            ib.pad_tokens(t, tb)
        n = len(logit_rows)
        staging.copy_into(self.logit_rows, logit_rows)
        width = self._logit_width(r, tb)
        if width > n:
            self.logit_rows[n:width].zero_()
        fwd = self.by_tokens.get(tb)
        out = fwd.run(r, padded_bs=r) if fwd is not None else self._forward(r, tokens=tb)
        return TargetOutput(out.logits[:n], None if out.aux_hidden is None
                            else out.aux_hidden[:t])

    def reset_neutral(self) -> None:
        """Rows of no token (what the captures run over), logits rows 0."""
        self.req.zero_()
        self.seq.fill_(1)
        self.ext.zero_()
        self.logit_rows.zero_()

    def captured(self, fwd: CapturedForward) -> None:
        """After `fwd`'s capture: if it is one of these, the target's dummy KV page zeroed
        again (the captures ran over rows of no token, whose tokens' values are undefined:
        what they wrote there must not reach the inert rows that read it)."""
        if fwd in self.by_tokens.values():
            self.parts.kv.zero_dummy_page()

    # --- the captured function -----------------------------------------------------------
    def _logit_width(self, rows: int, tokens: int) -> int:
        return min(rows * self.n_row, tokens)

    def _forward(self, rows: int, tokens: int) -> TargetOutput:
        """The target over `tokens` tokens of `rows` ragged rows and the rows covering the
        padded tokens (graph-capturable)."""
        p = self.parts
        ib = p.inputs
        n = rows + cover_rows(tokens, self.chunk)
        meta = p.backend.row_metadata(self.req[:n], self.seq[:n], self.ext[:n], tokens)
        idx = self.logit_rows[: self._logit_width(rows, tokens)]
        aux = None if self.aux_out is None else self.aux_out[:tokens]
        return p.target(ib.input_ids[:tokens], ib.positions[:tokens], ib.out_cache_loc[:tokens],
                        p.kv, p.backend, meta, idx, capture_aux=self.capture_aux, aux_out=aux)
