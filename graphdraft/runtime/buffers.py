"""Every persistent buffer of the runtime, documented in one place.

Each buffer is allocated once, for the largest batch, and written in place:
a captured CUDA graph holds pointers into these tensors, so they are never
re-allocated, resized or replaced. A forward over `bs` rows reads and writes
their first rows (`buf[:bs]`, `buf[:num_tokens]`). Rows past the live batch
and up to the padded batch size hold neutral values written before each
replay: request slot 0 (the reserved dummy request, whose page-table row is
all zeros, so every position maps to the dummy page 0), seq len 1, accept
length 1, out-cache location 0 (the dummy slot), token id 0, hidden 0.
For a decode batch one kernel writes the drafter's inputs and all of these
(`graphdraft.kernels.stage_inputs`); `pad_rows` / `pad_tokens` below do it
for the other paths.

The speculative cycle's per request-slot tables (last token, drafts, sampling parameters,
stop table, max_new, emitted, done; slot 0 the inert dummy) are `graphdraft.runtime.slot_state.SlotState`
(documented there, allocated once by the Engine); its per-row buffers and the packed output
are `CycleBuffers` below.

Sizes: `max_bs = RuntimeConfig.max_bs`, `max_tokens = RuntimeConfig.max_num_tokens`,
`N = spec_num_tokens`, `S = speculative_num_steps`, `H` the draft hidden size,
`kH` the width of the target's captured hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from graphdraft.config import RuntimeConfig

# The dummy slots and the neutral values of padded rows and tokens, by buffer field (their one
# home is `graphdraft.kernels.neutral`, below the kernels that write them; re-exported here).
from graphdraft.kernels.neutral import (  # noqa: F401
    DUMMY_KV_SLOT,
    DUMMY_PAGE,
    DUMMY_REQ_SLOT,
    NEUTRAL_DRAFT_ROW,
    NEUTRAL_DRAFT_TOKEN,
    NEUTRAL_ROW,
    NEUTRAL_TOKEN,
)


def fill_neutral(buffers: object, neutral: dict[str, int], start: int, stop: int) -> None:
    """Write `neutral`'s value into rows [start, stop) of each named field of `buffers`."""
    if stop <= start:
        return
    for name, value in neutral.items():
        getattr(buffers, name)[start:stop] = value


def _zeros(shape, dtype, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


ROW_PREFILL, ROW_DECODE, ROW_PAD = 0, 1, 2
"""`DraftBuffers.row_kind` values: a prefill row (its chunk's tokens), a decode row (N tokens),
a padded row (no token: the dummy request)."""


@dataclass
class InputBuffers:
    """The target forward's inputs, filled by the engine; the draft's first step reuses them.

    input_ids            [max_tokens] int64  target input token ids (prefill rows first, then N per decode row)
    positions            [max_tokens] int64  position of each input token in its request
    out_cache_loc        [max_tokens] int64  KV slot each input token writes
    seq_lens             [max_bs] int32      KV length of each row after this step's input
    req_pool_indices     [max_bs] int64      each row's request-pool slot
    extend_lens          [max_bs] int32      input tokens of each row this step (N for decode rows)
    shifted_prefill_ids  [max_tokens] int64  prefill rows: the next token of each position
                                             (prompt shifted one left; -1 where it is the target's output)
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    extend_lens: torch.Tensor
    shifted_prefill_ids: torch.Tensor

    @classmethod
    def allocate(cls, cfg: RuntimeConfig) -> InputBuffers:
        t, b, dev = cfg.max_num_tokens, cfg.max_bs, cfg.device
        return cls(
            input_ids=_zeros(t, torch.int64, dev),
            positions=_zeros(t, torch.int64, dev),
            out_cache_loc=_zeros(t, torch.int64, dev),
            seq_lens=torch.ones(b, dtype=torch.int32, device=dev),
            req_pool_indices=_zeros(b, torch.int64, dev),
            extend_lens=torch.ones(b, dtype=torch.int32, device=dev),
            shifted_prefill_ids=_zeros(t, torch.int64, dev),
        )

    @property
    def max_bs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def max_tokens(self) -> int:
        return self.input_ids.shape[0]

    def pad_rows(self, start: int, stop: int) -> None:
        """`NEUTRAL_ROW` in rows [start, stop): dummy request, seq len 1."""
        fill_neutral(self, NEUTRAL_ROW, start, stop)

    def pad_tokens(self, start: int, stop: int) -> None:
        """`NEUTRAL_TOKEN` in tokens [start, stop): id 0, position 0, dummy slot 0."""
        fill_neutral(self, NEUTRAL_TOKEN, start, stop)


@dataclass
class RuntimeStates:
    """Per request slot state that outlives a step.

    valid_cache_lengths  [max_reqs + 1] int32  committed KV length of each request slot
                                               before the current step (slot 0: dummy, always 0)
    """

    valid_cache_lengths: torch.Tensor

    @classmethod
    def allocate(cls, cfg: RuntimeConfig) -> RuntimeStates:
        return cls(valid_cache_lengths=_zeros(cfg.max_running_requests + 1, torch.int32, cfg.device))


@dataclass
class CycleBuffers:
    """The speculative cycle's own buffers (graphdraft.serving.engine; the per-slot tables are
    `graphdraft.runtime.slot_state.SlotState`, documented there).

    slot_rows     [max_bs] int64       each row's request slot (host-staged when the rows
                                       change; 0: a padded row)
    tokens        [max_tokens] int64   accepted tokens of prefill / mixed steps and of
                                       target-only decode cycles (with a drafter, a decode
                                       cycle writes them into its `Drafter.accepted_tokens`)
    accept        [max_bs] int32       accepted tokens per row after the stop cut (0: inert)
    draft_accept  [max_bs] int32       max(accept, 1) of target-only decode cycles (with a
                                       drafter: its `Drafter.accept_lengths`)
    finish        [max_bs] int32       0 running, 1 stop token, 2 max_new_tokens
    err           [max_bs] int32       error bits (engine.ERR_*), read one step later
    pack          [max_bs, N + 3] int32  tokens (N), accept, finish, err (a view of `wire`)
    logprobs      [max_bs, N * (1 + 2K)] int32  the rows' log-probabilities, K =
                                       `cfg.max_logprobs` (`graphdraft.kernels.logprobs`'
                                       layout; a view of `wire`, written for rows that ask)
    wire          [max_bs, N + 3 + N * (1 + 2K)] int32  pack then logprobs: the one D2H copy
    """

    slot_rows: torch.Tensor
    tokens: torch.Tensor
    accept: torch.Tensor
    draft_accept: torch.Tensor
    finish: torch.Tensor
    err: torch.Tensor
    pack: torch.Tensor
    logprobs: torch.Tensor
    wire: torch.Tensor

    @classmethod
    def allocate(cls, cfg: RuntimeConfig, n: int) -> CycleBuffers:
        b, dev = cfg.max_bs, cfg.device
        wire = _zeros((b, n + 3 + n * (1 + 2 * cfg.max_logprobs)), torch.int32, dev)
        return cls(slot_rows=_zeros(b, torch.int64, dev),
                   tokens=_zeros(cfg.max_num_tokens, torch.int64, dev),
                   accept=_zeros(b, torch.int32, dev),
                   draft_accept=torch.ones(b, dtype=torch.int32, device=dev),
                   finish=_zeros(b, torch.int32, dev), err=_zeros(b, torch.int32, dev),
                   pack=wire[:, : n + 3], logprobs=wire[:, n + 3:], wire=wire)

    def reset(self) -> None:
        """Every buffer back to its allocated value (after warm-up and capture)."""
        for t in (self.slot_rows, self.tokens, self.accept, self.finish, self.err, self.wire):
            t.zero_()
        self.draft_accept.fill_(NEUTRAL_DRAFT_ROW["accept_lengths"])


@dataclass
class DraftBuffers:
    """The drafter's own static inputs and outputs (what its CUDA graphs read and write).

    first_input_ids   [max_tokens] int64      first step's token ids (target output tokens, shifted layout)
    first_hidden      [max_bs * N, kH] dtype  target hidden states of a decode batch (graph input;
                                              `decode_hidden_buffer(bs)` is `[:bs * N]` of it)
    accept_lengths    [max_bs] int32          tokens committed this step per row (prefill rows: 1)
    gather_ids        [max_bs] int64          first step: the token row that goes to the LM head
    write_start       [max_bs] int64          position draft step 1 writes (accepted prefix end)
    positions         [max_bs] int64          multi-step: current draft position per row
    seq_lens          [max_bs] int32          the draft attention's seq-len alias: KV length per row,
                                              advanced in place before each draft step
    out_cache_loc     [(S - 1) * max_bs] int64  KV slots of draft steps 2..S; a batch of bs uses the
                                              first (S - 1) * bs entries viewed `[S - 1, bs]`
    ids               [max_bs] int64          current draft token per row (target vocab ids)
    hidden            [max_bs, H] dtype       current draft hidden (pre-norm) per row
    next_tokens       [max_bs, S + 1] int32   column 0: last verified token; 1..S: draft tokens
                                              (`run(copy_output=False)` returns `[:bs]` of it;
                                              a cycle of k < S drafts: columns past max(k, 1)
                                              repeat that column, filler)
    err               [1] int32               deferred validation's error word (bits: EagleDrafter.ERR_BITS)
    row_kind          [max_bs] int32          a prefill / mixed step's first step: each row's kind
                                              (`ROW_PREFILL`, `ROW_DECODE`, `ROW_PAD`: a padded row
                                              of no token), so the per-row indices are computed for
                                              every row at once, whatever the prefill rows' count
    """

    first_input_ids: torch.Tensor
    first_hidden: torch.Tensor
    accept_lengths: torch.Tensor
    gather_ids: torch.Tensor
    write_start: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    ids: torch.Tensor
    hidden: torch.Tensor
    next_tokens: torch.Tensor
    err: torch.Tensor
    row_kind: torch.Tensor

    @classmethod
    def allocate(cls, cfg: RuntimeConfig, hidden_size: int, target_hidden_width: int,
                 dtype: torch.dtype) -> DraftBuffers:
        b, n, s, dev = cfg.max_bs, cfg.spec_num_tokens, cfg.speculative_num_steps, cfg.device
        return cls(
            first_input_ids=_zeros(cfg.max_num_tokens, torch.int64, dev),
            first_hidden=_zeros((b * n, target_hidden_width), dtype, dev),
            accept_lengths=torch.ones(b, dtype=torch.int32, device=dev),
            gather_ids=_zeros(b, torch.int64, dev),
            write_start=torch.ones(b, dtype=torch.int64, device=dev),
            positions=_zeros(b, torch.int64, dev),
            seq_lens=torch.ones(b, dtype=torch.int32, device=dev),
            out_cache_loc=_zeros(max(s - 1, 1) * b, torch.int64, dev),
            ids=_zeros(b, torch.int64, dev),
            hidden=_zeros((b, hidden_size), dtype, dev),
            next_tokens=_zeros((b, s + 1), torch.int32, dev),
            err=_zeros(1, torch.int32, dev),
            row_kind=torch.full((b,), ROW_PAD, dtype=torch.int32, device=dev),
        )

    def pad_rows(self, start: int, stop: int, n: int) -> None:
        """`NEUTRAL_DRAFT_ROW` in rows [start, stop) and `NEUTRAL_DRAFT_TOKEN` in their
        first-step tokens [start * n, stop * n) (`n` = N tokens per decode row)."""
        fill_neutral(self, NEUTRAL_DRAFT_TOKEN, start * n, stop * n)
        fill_neutral(self, NEUTRAL_DRAFT_ROW, start, stop)

    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))
