"""The draft KV of k = 0 cycles, deferred: kept as the head's inputs, written in one batch later.

A k = 0 decode cycle (the speculation policy stopped drafting) drafts nothing, but the draft
KV of the position it commits must exist before the head attends over it again. Writing it
in every k = 0 cycle (`Eagle3DraftHead.store_kv` over one token a row: fc over the target's
aux hidden state, the input norms, the k / v rows of qkv, RoPE, the store) reads the head's
fc and k / v weights every cycle (about 135 MB at the Llama-3.1-8B head's shape) for a few
rows of work. `DeferredDraftKV` instead keeps that step's inputs per batch row and column,
  hidden  `[max_bs, P, kH]`   the target's aux hidden states of the position (the verify's
                              `drafter.hidden_buffer(bs, 1)`)
  tokens  `[3, max_bs, P]`    int64: the token id the head embeds there (the accepted token),
                              its position and its draft KV slot (0: an inert entry, the
                              dummy slot padded and done rows write)
  column  `[1]` int64         the column the next stash writes (device; mod P)
and the drafter writes all of them at once (`EagleDrafter.rebuild_deferred_kv`: `store_kv`
over `bs * P` tokens, then every entry of those rows inert again): one read of the weights
per P deferred cycles, and none at all for a request that finishes first.

The rebuilt KV is the KV the per-cycle step writes: the same head, the same inputs (the aux
hidden states, ids, positions and slots are the stored ones, not recomputed) and the same
kernels (`store_kv`); only the matmul's row count differs (`bs * P` instead of `bs`), so
its values are those of the per-cycle step up to the matmul's rounding where a kernel's
reduction order depends on the row count (as the full first step's and the KV-only step's
already do, `Eagle3DraftHead._kv_rows`); entries are written where they were stashed, so
rows may be reordered between cycles.

Host bookkeeping (`pending`: columns stashed since the last rebuild; `rows`: the widest
padded batch stashed) is kept in a CPU tensor beside the device tables, so that
`state_tables()` (the Engine's `state_snapshot` / `restore_state`) carries both. The decode
mode (`serving/cycles/chain.py`, `ChainMode`) rebuilds before anything reads the draft KV
again: before a cycle with k > 0, before a prefill / mixed step, and before a stash that
would find every column taken (`full`); so the device column never wraps onto a live entry.
"""

from __future__ import annotations

import torch

__all__ = ["DEFERRED_KV_COLUMNS_MAX", "DeferredDraftKV"]

DEFERRED_KV_COLUMNS_MAX = 64
"""Most columns (deferred cycles) a ring may hold (`RuntimeConfig.deferred_draft_kv`)."""


class DeferredDraftKV:
    """The deferred draft-KV ring of one drafter (module docstring): `max_bs` rows, `columns`
    (P) deferred cycles, aux hidden width `width` (kH), the head's dtype, on `device`."""

    def __init__(self, max_bs: int, columns: int, width: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        for name, v, lo in (("max_bs", max_bs, 1), ("columns", columns, 1), ("width", width, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
        if columns > DEFERRED_KV_COLUMNS_MAX:
            raise ValueError(f"columns: expected <= {DEFERRED_KV_COLUMNS_MAX}, got {columns}")
        self.max_bs, self.columns = max_bs, columns
        self.hidden = torch.zeros(max_bs, columns, width, dtype=dtype, device=device)
        self.tokens = torch.zeros(3, max_bs, columns, dtype=torch.int64, device=device)
        self.column = torch.zeros(1, dtype=torch.int64, device=device)
        self.host = torch.zeros(2, dtype=torch.int64)  # [pending, rows], on the host

    # --- device side (graph-capturable: no sync, no host read) ---------------------------
    def stash(self, bs: int, ids: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor,
              hidden: torch.Tensor) -> None:
        """Keep one token a row for rows [0, bs) in the current column: `ids`, `positions`,
        `locs` `[bs]` int64, `hidden` `[bs, kH]`; then advance the column (mod P)."""
        col = self.column
        self.hidden[:bs].index_copy_(1, col, hidden[:bs].unsqueeze(1))
        meta = torch.stack((ids[:bs], positions[:bs], locs[:bs]))  # [3, bs]
        self.tokens[:, :bs].index_copy_(2, col, meta.unsqueeze(2))
        col.add_(1).remainder_(self.columns)

    def inputs(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, positions, locs `[bs * P]`, hidden `[bs * P, kH]`): every entry of rows
        [0, bs), inert ones (slot 0) included."""
        t = bs * self.columns
        ids, pos, locs = (self.tokens[i, :bs].reshape(t) for i in range(3))
        return ids, pos, locs, self.hidden[:bs].view(t, -1)

    def clear(self, bs: int) -> None:
        """Rows [0, bs) inert again (slot 0) and the column back to 0: after their rebuild."""
        self.tokens[2, :bs].zero_()
        self.column.zero_()

    # --- host side -----------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Columns stashed since the last rebuild (0: nothing to write)."""
        return int(self.host[0])

    @property
    def rows(self) -> int:
        """The widest (padded) batch stashed since the last rebuild: the rows it must cover."""
        return int(self.host[1])

    @property
    def full(self) -> bool:
        """Every column holds a live entry: the next stash needs a rebuild first."""
        return self.pending >= self.columns

    def stashed(self, bs: int) -> None:
        """Record a launched stash of `bs` rows (host; after the cycle was launched)."""
        if self.full:
            raise ValueError("deferred draft KV: a stash into a full ring (rebuild first)")
        self.host[0] += 1
        self.host[1] = max(self.rows, bs)

    def rebuilt(self) -> None:
        """Record a launched rebuild (host)."""
        self.host.zero_()

    def state_tables(self) -> dict[str, torch.Tensor]:
        """The ring's tables for a state snapshot (the host counters as a CPU tensor)."""
        return {"deferred_kv.hidden": self.hidden, "deferred_kv.tokens": self.tokens,
                "deferred_kv.column": self.column, "deferred_kv.host": self.host}
