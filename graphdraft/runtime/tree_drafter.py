"""Tree drafting with `k` beams: an EAGLE-3 head's first step, its `K-1`
beam-expanding decode steps, and the tree build, over fixed-shape buffers (no host sync, the
same code eagerly and inside a captured CUDA graph).

Symbols: `graphdraft.runtime.tree` (K steps, k beams, n verified nodes, P = min(K+1, n),
M candidates). A batch of `B` rows; row r is request slot `req[r]`.

First step (`first_step`, chain's layout of width P): ids `[B*P]` (the target's tokens at the
accepted path's nodes, then the bonus: `out_tokens` of tree acceptance), hidden `[B*P, kH]`
(the target's aux hidden states at those nodes: `hid_c`), positions `L + d`, KV written
through the page table at `L .. L+P-1` (only `< Ld = L + accept_len` is ever read), the LM
head on row `r*P + accept_len - 1`, attending over `[0, Ld)`. A prefill hands the same
level-1 inputs (`expand`: logits `[B, Vd]`, hidden `[B, H]`) from its own first step.

Decode step j = 1 .. K-1 (`expand`), one query per beam (row `r*k + b`): token `beam_tok`,
hidden = the parent beam's output hidden (level 1: the first step's), rope position
`Ld + j - 1` (chain's step-j position), KV written to the scratch slot `scratch(r, b, j)`,
attending to the committed draft prefix `[0, Ld)` plus exactly its `j` ancestor-or-self
scratch slots `anc[r, b, :j]` (`models.attention.BeamMetadata`): never a cousin's KV.
`graphdraft.runtime.beams` keeps the beams, the candidate store and the ancestor table.

Scratch region: the draft KV pool holds `num_pages` pages the page table can address, then
`ceil(max_bs*k*(K-1) / page_size)` more that no page table ever points at (beam KV never lands
in a request's pages); `scratch_base = num_pages * page_size`.

k = 1 is chain, bit for bit: the decode steps write through the page table at `Ld + j - 1`
and attend over `[0, Ld + j)` (the chain drafter's multi-step exactly), the selection is the
argmax (`beams`), so tokens and KV equal `EagleDrafter`'s on the same inputs.

Tree build (`kernels.tree_build`): root = the bonus token, `L = Ld`; writes `tree`.
"""

from __future__ import annotations

import torch

from graphdraft import ops
from graphdraft.checks import INDEX_DTYPES, expect_tensor
from graphdraft.kernels.cache_loc import kv_slots
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.tree_build import TreeBuffers
from graphdraft.models.attention import BeamMetadata, PagedAttentionBackend
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.runtime.beams import BeamState, decode_step, first_step, scratch_table
from graphdraft.runtime.draft_controls import DraftControls
from graphdraft.runtime.kv_cache import KVPool
from graphdraft.runtime.tree import TreeSpec, scratch_slots

__all__ = ["TreeDrafter"]


class TreeDrafter:
    """Beam drafting for one `Eagle3DraftHead` over a shared page table.

    `kernels`: the kernel settings the head, the attention and the tree build run under (the
    head is set to them before each draft: `set_kernels`).

    Buffers (allocated once for `max_bs` rows; a batch of B uses the first rows):

    | buffer | shape | dtype |
    |---|---|---|
    | first_ids, first_pos, first_loc | `[max_bs*P]` | int64 (first step's ids, rope positions, KV slots) |
    | first_hidden | `[max_bs*P, kH]` | head dtype (`hid_c`) |
    | gather | `[max_bs]` | int64 (the LM-head row of each request) |
    | prefix | `[max_bs]` | int32 (`Ld`: the draft prefix every beam sees) |
    | hid1 | `[max_bs, H]` | head dtype (first step's output hidden) |
    | beam_loc, beam_req | `[max_bs*k]` | int64 (k = 1: the step's KV slots; the beams' request slots) |
    | step_pos | `[max(K-1, 1), max_bs*k]` | int64 (rope position of each decode step's queries, `Ld + j - 1`, all steps written before the first) |
    | scratch | `[max(K-1, 1), max_bs*k]` | int64 (`runtime.beams.scratch_table`, constant: each step's own KV slots) |
    | beam_lens | `[max_bs*k]` | int32 (Ld per beam; k = 1: Ld + j) |
    | hid_in, hid_out | `[max_bs*k, H]` | head dtype (a step's hidden input / output) |
    | beams | `runtime.beams.BeamState` | |
    | tree | `kernels.tree_build.TreeBuffers` | |
    """

    def __init__(self, head: Eagle3DraftHead, spec: TreeSpec, *, req_to_page: torch.Tensor,
                 page_size: int, num_pages: int, max_context_len: int, max_bs: int,
                 kernels: KernelConfig, device: str | torch.device) -> None:
        if not isinstance(spec, TreeSpec):
            raise ValueError(f"spec: expected a TreeSpec, got {type(spec).__name__}")
        if not isinstance(kernels, KernelConfig):
            raise ValueError(f"kernels: expected a KernelConfig, got {type(kernels).__name__}")
        if spec.topk > head.config.output_vocab_size:
            raise ValueError(f"speculative_eagle_topk: expected <= the draft vocab "
                             f"{head.config.output_vocab_size}, got {spec.topk}")
        self.head, self.spec = head, spec
        self.device = torch.device(device)
        self.req_to_page, self.page_size = req_to_page, page_size
        self.max_bs, self.kernels = max_bs, kernels
        mc = head.config
        extra = -(-scratch_slots(spec, max_bs) // page_size) if spec.steps > 1 else 0
        self.num_pages = num_pages
        self.scratch_base = num_pages * page_size
        self.kv = KVPool(1, num_pages + max(extra, 0), page_size, mc.num_key_value_heads,
                         mc.head_dim, head.dtype, self.device)
        self.backend = PagedAttentionBackend(req_to_page, page_size, max_context_len,
                                             kernels=kernels)
        P, k, dev = spec.P, spec.topk, self.device
        i64 = dict(dtype=torch.int64, device=dev)
        self.first_ids = torch.zeros(max_bs * P, **i64)
        self.first_pos = torch.zeros(max_bs * P, **i64)
        self.first_loc = torch.zeros(max_bs * P, **i64)
        self.first_hidden = torch.zeros(max_bs * P, head.target_hidden_width, dtype=head.dtype,
                                        device=dev)
        self.gather = torch.zeros(max_bs, **i64)
        self.prefix = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.hid1 = torch.zeros(max_bs, mc.hidden_size, dtype=head.dtype, device=dev)
        lv = max(spec.steps - 1, 1)
        self.step_pos = torch.zeros(lv, max_bs * k, **i64)
        self.scratch = scratch_table(spec, self.scratch_base, max_bs, dev)
        self.beam_loc = torch.zeros(max_bs * k, **i64)
        self.beam_req = torch.zeros(max_bs * k, **i64)
        self.beam_lens = torch.ones(max_bs * k, dtype=torch.int32, device=dev)
        self.hid_in = torch.zeros(max_bs * k, mc.hidden_size, dtype=head.dtype, device=dev)
        self.hid_out = torch.zeros(max_bs * k, mc.hidden_size, dtype=head.dtype, device=dev)
        self.beams = BeamState.allocate(spec, max_bs, dev)
        self.rank_at_temperature = True
        """Sampled rows score candidates at their temperature (`expand`); False: at T 1 (an
        A/B switch for measurements, read when a draft is traced or captured)."""
        self.tree = TreeBuffers.allocate(spec, max_bs, dev)
        self.beam_window = torch.full((max_bs * k, max(spec.steps - 1, 1)), -1,
                                      dtype=torch.int32, device=dev)
        self.controls: DraftControls | None = None
        """The Engine's logit controls (`serving.tree_cycle.EngineTrees` sets them; None: the
        head's own logits): every level's logits transformed as the verify transforms the
        target's, the cycle's accepted path not yet counted (`expand`'s `accepted`) and each
        beam's path so far (`beam_window [max_bs*k, K-1]`, target ids, -1 unused) counted
        as emitted."""

    @property
    def use_triton(self) -> bool:
        """The Triton path (`kernels.use_triton`): also picks the tree kernels over their refs."""
        return self.kernels.use_triton

    def _use_head_kernels(self) -> None:
        if self.head.kernels != self.kernels:
            self.head.set_kernels(self.kernels)

    # ------------------------------------------------------------------
    def first_step(self, bs: int, req: torch.Tensor, prefix_len: torch.Tensor,
                   accept_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first draft step over `first_ids` / `first_hidden` `[bs*P]` (module doc):
        `req` `[bs]`, `prefix_len` `[bs]` (`L`, the accepted path's first position),
        `accept_len` `[bs]` in 1..P. Writes `prefix` = `L + accept_len`; returns the level-1
        logits `[bs, Vd]` and hidden `[bs, H]` (`expand`'s inputs)."""
        P = self.spec.P
        for name, t in (("req", req), ("prefix_len", prefix_len), ("accept_len", accept_len)):
            expect_tensor(name, t, shape=(bs,), dtypes=INDEX_DTYPES)
        self._use_head_kernels()
        ops.tree_first_inputs(req, prefix_len, accept_len, self.req_to_page, self.page_size, P,
                              self.first_pos[: bs * P], self.first_loc[: bs * P],
                              self.gather[:bs], self.prefix[:bs], kernels=self.kernels)
        meta = self.backend.bind_metadata(req, self.prefix[:bs])
        out = self.head(self.first_ids[: bs * P], self.first_pos[: bs * P],
                        self.first_hidden[: bs * P], self.first_loc[: bs * P], self.kv.layer(0),
                        self.backend, meta, self.gather[:bs], hidden_out=self.hid1[:bs])
        return out.logits, self.hid1[:bs], out.ids

    def expand(self, bs: int, logits: torch.Tensor, hidden: torch.Tensor, req: torch.Tensor,
               prefix: torch.Tensor, root: torch.Tensor,
               ids: torch.Tensor | None = None,
               temperature: torch.Tensor | None = None,
               accepted: tuple[torch.Tensor, torch.Tensor] | None = None) -> TreeBuffers:
        """Level 1 from `logits [bs, Vd]` / `hidden [bs, H]`, the K-1 beam steps, the tree
        build (root token `root [bs]`, prefix `prefix [bs]` = Ld, the root's position);
        returns `tree.rows(bs)`. `ids [bs]`: the head's greedy target ids of `logits` (k = 1:
        chain's own selection, used as the level-1 tokens). `temperature [bs]` float32: the
        rows' sampling temperatures (0: greedy); rows with T > 0 score candidates by the
        draft's log-probs at T (`runtime.beams`, "Scores"), unless `rank_at_temperature` is
        False (then every row at T 1, as greedy). `accepted`: the rows' tokens accepted
        this cycle and not yet counted (`[bs, P]` and their lengths `[bs]`: a decode cycle's
        path, counted in its commit after this draft; None: nothing pending), which the
        logit controls count as emitted at every level."""
        spec, k = self.spec, self.spec.topk
        expect_tensor("hidden", hidden, shape=(bs, self.head.config.hidden_size))
        for name, t in (("req", req), ("prefix", prefix), ("root", root)):
            expect_tensor(name, t, shape=(bs,), dtypes=INDEX_DTYPES)
        self._use_head_kernels()
        st = self.beams.rows(bs)
        hot = self.head.hot_token_ids
        chain = k == 1
        temp = temperature if (self.rank_at_temperature and not chain) else None
        ctl = self.controls is not None
        if ctl:  # the pick is redone from the transformed logits (chain: no head ids)
            self._controlled(logits, req, None, accepted)
        bk = bs * k
        hid_in, hid_out = self.hid_in[:bk], self.hid_out[:bk]
        window = self.beam_window[:bk] if ctl else None
        more = spec.steps > 1  # the beam steps' inputs, written by level 1's launch
        first_step(spec, logits, st, hot_token_ids=hot, scratch_base=self.scratch_base,
                   greedy_ids=ids if chain and not ctl else None, temperature=temp,
                   scratch=self.scratch, hid_src=hidden if more else None,
                   hid_dst=hid_in if more else None, window=window,
                   setup=(req, prefix, self.beam_req[:bk], self.beam_lens[:bk], self.step_pos)
                   if more else None, kernels=self.kernels)
        for j in range(1, spec.steps):
            ids = st.beam_tok.view(bk)  # read by the head before this level's re-rank writes it
            pos = self.step_pos[j - 1, :bk]
            if k == 1:  # chain: through the page table, attending [0, Ld + j)
                self.beam_loc[:bk].copy_(kv_slots(self.req_to_page, self.beam_req[:bk], pos,
                                                  self.page_size))
                self.beam_lens[:bk].copy_(prefix.long() + j)
                loc = self.beam_loc[:bk]
                meta = self.backend.bind_metadata(self.beam_req[:bk], self.beam_lens[:bk])
            else:       # own scratch slot (= anc[:, :, j - 1]); prefix + the j ancestor-or-self slots
                loc = self.scratch[j - 1, :bk]
                meta = BeamMetadata(self.beam_req[:bk], self.beam_lens[:bk],
                                    st.anc.view(bk, spec.anc_width), j)
            out = self.head(ids, pos, hid_in, loc, self.kv.layer(0), self.backend, meta,
                            hidden_out=hid_out)
            if ctl:
                self._controlled(out.logits, self.beam_req[:bk], self.beam_window[:bk, :j],
                                 accepted)
            decode_step(spec, j, out.logits, st, hot_token_ids=hot, scratch_base=self.scratch_base,
                        hid_out=hid_out, hid_next=hid_in,
                        greedy_ids=out.ids if chain and not ctl else None, temperature=temp,
                        scratch=self.scratch, window=window, kernels=self.kernels)
        tree = self.tree.rows(bs)
        ops.build_tree(spec, st.cand_score, st.cand_tok, st.cand_parent, root, prefix, tree,
                       kernels=self.kernels)
        return tree

    def _controlled(self, logits: torch.Tensor, slots: torch.Tensor,
                    window: torch.Tensor | None,
                    accepted: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """`logits [R, Vd]` in place under the rows' logit controls (`slots [R]`, `window
        [R, j]` the beams' paths; None: level 1, nothing drafted yet; `accepted` `[bs, P]`,
        `[bs]`: the requests' pending accepted tokens, R = bs or bs * k beams)."""
        c = self.controls
        win = window if window is not None else c.no_window[: slots.shape[0]]
        tok, lens = accepted if accepted is not None else (None, None)
        ops.apply_draft_logit_controls(logits, win, slots, c.slots, accepted=tok,
                                       accepted_len=lens, col_ids=c.col_ids, col_of=c.col_of,
                                       kernels=self.kernels)

    def draft(self, bs: int, req: torch.Tensor, prefix_len: torch.Tensor,
              accept_len: torch.Tensor, root: torch.Tensor) -> TreeBuffers:
        """`first_step` then `expand` (root = the bonus token, prefix `L + accept_len`)."""
        logits, hidden, ids = self.first_step(bs, req, prefix_len, accept_len)
        return self.expand(bs, logits, hidden, req, self.prefix[:bs], root, ids)
