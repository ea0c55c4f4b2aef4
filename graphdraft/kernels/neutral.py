"""The dummy request slot, page and KV slot, and the neutral values of padded rows and tokens:
the one home of them (`graphdraft.runtime.buffers` re-exports them beside the buffers they fill).

Rows past the live batch and up to the padded batch size hold these values before each replay:
request slot 0 (the reserved dummy request, whose page-table row is all zeros, so every position
maps to the dummy page 0), seq len 1, accept length 1, out-cache location 0 (the dummy slot),
token id 0, hidden 0. `graphdraft.kernels.stage_inputs`' Triton kernel writes the same values in
its body; its torch reference reads them from here.
"""

from __future__ import annotations

__all__ = ["DUMMY_KV_SLOT", "DUMMY_PAGE", "DUMMY_REQ_SLOT", "NEUTRAL_DRAFT_ROW",
           "NEUTRAL_DRAFT_TOKEN", "NEUTRAL_ROW", "NEUTRAL_TOKEN"]

DUMMY_REQ_SLOT = 0
"""Request-pool slot reserved for padded rows; its page-table row stays all zeros."""
DUMMY_PAGE = 0
"""KV page reserved for padded rows and unmapped positions; slot 0 is its first slot."""
DUMMY_KV_SLOT = 0
"""The KV slot padded tokens write (the dummy page's first slot)."""

NEUTRAL_ROW = {"seq_lens": 1, "req_pool_indices": DUMMY_REQ_SLOT, "extend_lens": 1}
"""`InputBuffers` per row: the dummy request, seq len 1, one input token."""
NEUTRAL_TOKEN = {"input_ids": 0, "positions": 0, "out_cache_loc": DUMMY_KV_SLOT}
"""`InputBuffers` per token: token id 0 at position 0, writing the dummy slot."""
NEUTRAL_DRAFT_ROW = {"accept_lengths": 1, "write_start": 1, "ids": 0, "hidden": 0}
"""`DraftBuffers` per row: accept length 1, draft step 1 writes position 1, id 0, hidden 0."""
NEUTRAL_DRAFT_TOKEN = {"first_input_ids": 0, "first_hidden": 0}
"""`DraftBuffers` per token of the first step: id 0, hidden 0."""
