"""The tree speculative cycle, a runner that drives it, and the Engine's tree decode mode.

`TreeCycle` holds the cycle's device stages over fixed-shape buffers (first `bs` rows of
buffers allocated for `max_bs`); every stage is graph-capturable (no host sync, no
data-dependent shape) and the same code runs eagerly:

  verify   the target over n tree tokens per row: ids = tree tokens `[B*n]`, rope positions
           `L + depth`, KV written at the page-table slots of `L + i` (the node's logical
           index, not its depth), `RowMetadata` of uniform rows of n with the ancestor mask
           bits (`kernels.extend_attention`; page_size 1 and 16 alike)
  accept   `kernels.tree_accept`: greedy walk (argmax at every node) or, for rows with
           temperature > 0, sampled tree acceptance (exact: each emitted token follows the
           target's softmax(logits / T)); greedy rows in a sampled batch are one-hot rows
  compact  `kernels.tree_kv_move`: the accepted path's target KV moved to `L .. L+acc-1`
           (overlap-safe; every layer in one launch), its aux hidden states gathered to `hid_c [B*P, kH]` (the drafter's
           first-step hidden buffer: no copy), its tokens (`out_tokens`) written by accept
           straight into the drafter's first-step ids
  draft    `runtime.tree_drafter.TreeDrafter`: chain's first step of width P (so the next
           cycle's first step is the chain's), the K-1 beam steps, the tree build (a
           sampling cycle hands the rows' temperatures: sampled rows score candidates at T)
  commit   L += accept_len; pack `[B, P + 1]` int64 = out_tokens, accept_len

Per row state between cycles: `req` (request slot), `prefix_len` (L: committed target KV
length = the root's position), the drafter's tree (root = the last bonus token).

`TreeRunner` drives whole speculative steps for a fixed batch of requests (eager prefill,
then cycles), eagerly or as one captured CUDA graph per padded batch size
(`capture.CapturedForward`); padded rows are reset to an inert state before every run
(dummy request slot 0: every KV write lands on the reserved page 0; a root-only tree).
"""

from __future__ import annotations

import functools

import torch

from capture import CapturedForward, GraphPool, batch_size_schedule, eager_forced, padded_batch_size
from graphdraft import ops
from graphdraft.kernels.accept import philox4x32_ref
from graphdraft.kernels.cache_loc import kv_slots
from graphdraft.kernels.config import KernelConfig
from graphdraft.kernels.tree_kv_move import kv_pointer_table
from graphdraft.kernels.tree_slots import TREE_FIELDS
from graphdraft.models.attention import PagedAttentionBackend
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.llama import LlamaForCausalLM
from graphdraft.runtime.batch import BatchRow, ForwardContext, write_batch
from graphdraft.runtime.draft_controls import DraftControls
from graphdraft.runtime.kv_cache import KVPool, PageTable
from graphdraft.runtime.tree import TreeSpec
from graphdraft.runtime.tree_drafter import TreeDrafter
from graphdraft.serving.cycles.base import CycleParts, DecodeMode
from graphdraft.serving.data_parallel import StepPlan
from graphdraft.serving.request import Request

__all__ = ["EngineTrees", "SlotTrees", "TreeCycle", "TreeRunner", "TreeStepResult",
           "chain_pool_view", "row_target_probs"]


def row_target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, greedy_ids: torch.Tensor,
                     min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row `serving.verify.target_probs` in fixed shapes (capturable): logits `[R, V]`,
    temperature / top_p `[R]` float32, top_k `[R]` int64 (0: off), greedy_ids `[R]` (the
    argmax), min_p `[R]` float32 (None or 0: off) -> fp32 probabilities `[R, V]`:
    softmax(logits / T) restricted to the top_k largest and to x >= max(x) + log(min_p)
    (p >= min_p * p_max; the chain's acceptance kernel uses the same bound), then to the
    smallest prefix (by probability) whose mass before a token stays below top_p,
    renormalised; a row with temperature 0 is one-hot at `greedy_ids`."""
    r, v = logits.shape
    temp = temperature.float().unsqueeze(1)
    x = logits.float() / temp.clamp(min=1e-6)
    sx, order = torch.sort(x, dim=-1, descending=True)
    kk = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v)).unsqueeze(1)
    kth = sx.gather(1, kk - 1)
    if min_p is not None:
        mp = min_p.float().unsqueeze(1)
        kth = torch.where(mp > 0, torch.maximum(kth, sx[:, :1] + torch.log(mp)), kth)
    x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    sp = probs.gather(1, order)                              # sorted probabilities
    before = torch.cumsum(sp, dim=-1) - sp
    sp = sp.masked_fill(before >= top_p.float().unsqueeze(1), 0.0)
    nucleus = torch.zeros_like(probs).scatter_(1, order, sp)
    nucleus = nucleus / nucleus.sum(-1, keepdim=True)
    probs = torch.where((top_p < 1).unsqueeze(1), nucleus, probs)
    onehot = torch.zeros_like(probs).scatter_(1, greedy_ids.long().unsqueeze(1), 1.0)
    return torch.where(temp > 0, probs, onehot)


class SlotTrees:
    """Each request slot's tree between cycles, for a serving loop whose rows change between
    steps (the Engine keeps per-slot state: `SlotState`): `[num_slots, n]` int64 tables of
    the `TREE_FIELDS` of `kernels.tree_build.TreeBuffers`. `store` after the draft (rows of
    slot 0, padded or inert, leave every table as it was: slot 0 keeps the neutral root-only
    tree), `load` before the verify (positions = `prefix_len + depth`, retrieve_index
    `r*n + i` recomputed). Fixed shapes, no host sync."""

    TREE_FIELDS = TREE_FIELDS

    def __init__(self, spec: TreeSpec, num_slots: int, device: str | torch.device) -> None:
        self.spec = spec
        self.num_slots = num_slots
        # each table is the first num_slots rows of one with a spare last row, where `store`
        # sends the rows it must not keep (one index for all tables instead of a select each)
        self._full = {f: torch.zeros(num_slots + 1, spec.n, dtype=torch.int64, device=device)
                      for f in self.TREE_FIELDS}
        for f in self.TREE_FIELDS:
            setattr(self, f, self._full[f][:num_slots])
        i = torch.arange(spec.n, device=device)
        self.tokens.zero_()
        self.parents.copy_(torch.where(i == 0, -1, 0).expand_as(self.parents))
        self.depths.copy_((i > 0).long().expand_as(self.depths))
        self.mask.copy_(((1 << i) | 1).expand_as(self.mask))
        self.first_child.fill_(-1)
        self.next_sibling.fill_(-1)

    def tables(self, spare: bool = False) -> list[torch.Tensor]:
        """The `TREE_FIELDS` tables `[num_slots, n]` (spare: with the spare last row)."""
        return [(self._full if spare else vars(self))[f] for f in self.TREE_FIELDS]

    def store(self, tree, slot_rows: torch.Tensor, *, kernels: KernelConfig | None = None
              ) -> None:
        """`tree` (TreeBuffers rows `[bs, n]`) into the tables at `slot_rows [bs]` int64 (rows
        of slot 0 store nothing; `ops.tree_store_rows`: one launch on the Triton path)."""
        ops.tree_store_rows([getattr(tree, f) for f in self.TREE_FIELDS], slot_rows,
                            self.tables(spare=True), kernels=kernels)

    def load(self, tree, slot_rows: torch.Tensor, done: torch.Tensor, vcl: torch.Tensor,
             live: torch.Tensor, req: torch.Tensor, prefix_len: torch.Tensor, *,
             kernels: KernelConfig | None = None, **io) -> None:
        """Rows `slot_rows [bs]` in (`ops.tree_load_rows`): `live`, `req` (dead rows: slot 0)
        and `prefix_len` (L from `vcl`, 0 on dead rows) `[bs]`, the slots' trees into `tree`
        (TreeBuffers rows `[bs, n]`: positions `L + depth`, retrieve_index `r*n + i`); `io`:
        the optional `columns` and `verify` outputs of the same launch."""
        ops.tree_load_rows(slot_rows, done, vcl, self.tables(),
                           [getattr(tree, f) for f in self.TREE_FIELDS], tree.positions,
                           tree.retrieve_index, live, req, prefix_len, kernels=kernels, **io)


class TreeCycle:
    """The cycle's stages (module doc) over these buffers (`max_bs` rows):

    | buffer | shape | dtype |
    |---|---|---|
    | req, prefix_len | `[max_bs]` | int64 (request slot; L) |
    | live | `[max_bs]` | bool (the Engine's rows: a running request's slot, not done) |
    | temperature, top_p, min_p | `[max_bs]` | float32 (0: greedy row; 1: no nucleus filter; 0: no min_p) |
    | top_k | `[max_bs]` | int64 (0: off) |
    | v_loc | `[max_bs*n]` | int64 (verify KV slots of `L + i`) |
    | v_seq | `[max_bs]` | int32 (`L + n`) |
    | aux | `[max_bs*n, kH]` | target dtype (aux hidden states at every node) |
    | target_ids | `[max_bs*n]` | int64 (argmax at every node) |
    | coins, final_coin | `[max_bs, n]`, `[max_bs]` | float32 (filled before each run) |
    | accept_len | `[max_bs]` | int32 |
    | accept_index | `[max_bs, P]` | int64 |
    | bonus | `[max_bs]` | int64 |
    | pack | `[max_bs, P + 1]` | int64 (out_tokens, accept_len) |
    | kv_table | `[2 * layers]` | int64 (the target KV's layer addresses: `compact`'s one launch) |
    """

    def __init__(self, target: LlamaForCausalLM, drafter: TreeDrafter, kv: KVPool,
                 backend: PagedAttentionBackend, *, sampling: bool = False) -> None:
        spec = drafter.spec
        if target.aux_hidden_width != drafter.head.target_hidden_width:
            raise ValueError(f"head: its fc input width ({drafter.head.target_hidden_width}) "
                             f"does not match the target's aux hidden width "
                             f"({target.aux_hidden_width})")
        self.target, self.drafter, self.kv, self.backend = target, drafter, kv, backend
        self.spec, self.sampling = spec, bool(sampling)
        mb, n, P, dev = drafter.max_bs, spec.n, spec.P, drafter.device
        i64 = dict(dtype=torch.int64, device=dev)
        self.req = torch.zeros(mb, **i64)
        self.prefix_len = torch.zeros(mb, **i64)
        self.live = torch.zeros(mb, dtype=torch.bool, device=dev)
        self.temperature = torch.zeros(mb, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(mb, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(mb, **i64)
        self.min_p = torch.zeros(mb, dtype=torch.float32, device=dev)
        self.v_loc = torch.zeros(mb * n, **i64)
        self.v_seq = torch.ones(mb, dtype=torch.int32, device=dev)
        self.aux = torch.zeros(mb * n, target.aux_hidden_width, dtype=target.dtype, device=dev)
        self.target_ids = torch.zeros(mb * n, **i64)
        self.coins = torch.full((mb, n), 0.5, dtype=torch.float32, device=dev)
        self.final_coin = torch.full((mb,), 0.5, dtype=torch.float32, device=dev)
        self.accept_len = torch.ones(mb, dtype=torch.int32, device=dev)
        self.accept_index = torch.zeros(mb, P, **i64)
        self.bonus = torch.zeros(mb, **i64)
        self.pack = torch.zeros(mb, P + 1, **i64)
        self.kv_table = kv_pointer_table(kv.k, kv.v)

    @property
    def use_triton(self) -> bool:
        return self.drafter.use_triton

    def out_tokens(self, bs: int) -> torch.Tensor:
        """`[bs, P]`: tree acceptance's tokens, written into the drafter's first-step ids."""
        return self.drafter.first_ids[: bs * self.spec.P].view(bs, self.spec.P)

    # --- stages -------------------------------------------------------------
    def verify_slots(self, bs: int) -> tuple:
        """`SlotTrees.load`'s `verify` outputs: (req_to_page, page_size, v_loc, v_seq) rows."""
        return (self.backend.req_to_page, self.backend.page_size,
                self.v_loc[: bs * self.spec.n], self.v_seq[:bs])

    def verify(self, bs: int, slots_ready: bool = False):
        """The target's forward over the tree (module doc) -> TargetOutput (logits `[bs*n, V]`).
        `slots_ready`: v_loc / v_seq already written (`verify_slots`, by the Engine's load)."""
        n, tree = self.spec.n, self.drafter.tree.rows(bs)
        if not slots_ready:
            ops.out_cache_loc_uniform(self.v_loc[: bs * n], self.req[:bs], self.prefix_len[:bs],
                                      self.backend.req_to_page, self.backend.page_size, n,
                                      row_major=True, kernels=self.drafter.kernels)
            torch.add(self.prefix_len[:bs], n, out=self.v_seq[:bs])
        meta = self.backend.uniform_row_metadata(self.req[:bs], self.v_seq[:bs], n,
                                                 mask_bits=tree.mask.view(bs * n))
        return self.target(tree.tokens.view(bs * n), tree.positions.view(bs * n),
                           self.v_loc[: bs * n], self.kv, self.backend, meta, None,
                           capture_aux=True, aux_out=self.aux[: bs * n])

    def accept(self, bs: int, logits: torch.Tensor) -> None:
        """Tree acceptance over `logits [bs*n, V]` -> accept_len, accept_index, out_tokens, bonus."""
        n, tree = self.spec.n, self.drafter.tree.rows(bs)
        torch.argmax(logits, dim=-1, out=self.target_ids[: bs * n])
        outs = dict(accept_len=self.accept_len[:bs], accept_index=self.accept_index[:bs],
                    out_tokens=self.out_tokens(bs), bonus=self.bonus[:bs])
        kc = self.drafter.kernels
        if not self.sampling:
            ops.tree_accept(self.spec, tree.tokens, tree.first_child, tree.next_sibling,
                            target=self.target_ids[: bs * n], kernels=kc, **outs)
            return
        rep = lambda t: t[:bs].repeat_interleave(n)                          # [bs*n]
        probs = row_target_probs(logits, rep(self.temperature), rep(self.top_k), rep(self.top_p),
                                 self.target_ids[: bs * n], rep(self.min_p))
        ops.tree_accept(self.spec, tree.tokens, tree.first_child, tree.next_sibling, probs=probs,
                        coins=self.coins[:bs], final_coin=self.final_coin[:bs], kernels=kc,
                        **outs)

    def compact(self, bs: int) -> None:
        """Target KV of the accepted path to `L .. L+acc-1`; its aux hidden to `hid_c`."""
        n, P = self.spec.n, self.spec.P
        kc = self.drafter.kernels
        ops.tree_move_accepted_kv(self.kv.k, self.kv.v, self.kv_table, self.backend.req_to_page,
                                  self.req[:bs], self.prefix_len[:bs], self.accept_index[:bs],
                                  self.accept_len[:bs], self.backend.page_size, kernels=kc)
        ops.gather_accepted_hidden(self.aux[: bs * n], self.accept_index[:bs],
                                   self.accept_len[:bs], n, self.drafter.first_hidden[: bs * P],
                                   kernels=kc)

    def draft(self, bs: int) -> None:
        """The drafter's first step (L, accept_len), the beam steps and the tree build over
        the prefix `L + accept_len` (root = bonus; the logit controls, when set, count the
        accepted path `out_tokens` within accept_len as emitted: the Engine counts it after
        this draft). `prefix_len` stays L (`draft_and_commit` advances it)."""
        d = self.drafter
        logits, hidden, ids = d.first_step(bs, self.req[:bs], self.prefix_len[:bs],
                                           self.accept_len[:bs])
        d.expand(bs, logits, hidden, self.req[:bs], d.prefix[:bs], self.bonus[:bs], ids,
                 temperature=self.temperature[:bs] if self.sampling else None,
                 accepted=(self.out_tokens(bs), self.accept_len[:bs]))

    def draft_and_commit(self, bs: int) -> torch.Tensor:
        """`draft`, then L += accept_len and the pack; returns pack[:bs] `[bs, P + 1]`."""
        P = self.spec.P
        self.draft(bs)
        self.prefix_len[:bs].copy_(self.drafter.prefix[:bs])
        self.pack[:bs, :P].copy_(self.out_tokens(bs))
        self.pack[:bs, P].copy_(self.accept_len[:bs])
        return self.pack[:bs]

    def run(self, bs: int) -> torch.Tensor:
        """One whole cycle over `bs` rows (graph-capturable); returns pack[:bs]."""
        out = self.verify(bs)
        self.accept(bs, out.logits)
        self.compact(bs)
        return self.draft_and_commit(bs)

    def neutral_rows(self, start: int, stop: int) -> None:
        """Rows [start, stop) inert: request slot 0 (every write on the dummy page), L = 0,
        greedy, a root-only tree (no child: accept 1)."""
        if stop <= start:
            return
        tree = self.drafter.tree
        n = self.spec.n
        self.req[start:stop] = 0
        self.prefix_len[start:stop] = 0
        self.temperature[start:stop] = 0.0
        self.top_k[start:stop] = 0
        self.top_p[start:stop] = 1.0
        self.min_p[start:stop] = 0.0
        i = torch.arange(n, device=self.req.device)
        tree.tokens[start:stop] = 0
        tree.parents[start:stop] = torch.where(i == 0, -1, 0)
        tree.depths[start:stop] = (i > 0).long()
        tree.positions[start:stop] = (i > 0).long()
        tree.mask[start:stop] = (1 << i) | 1
        tree.first_child[start:stop] = -1
        tree.next_sibling[start:stop] = -1


class TreeStepResult:
    """One step's host copy: `tokens[r]` the tokens row r emitted (accepted drafts + bonus),
    `accept[r]` their count."""

    def __init__(self, tokens: list[list[int]], accept: list[int]) -> None:
        self.tokens, self.accept = tokens, accept


class TreeRunner:
    """Whole tree speculative steps for one batch of requests (module doc).

    `target` / `head`: the models (same device and dtype). `spec`: the tree shape
    (`TreeSpec` validates steps / topk / num_draft_tokens). The runner owns its page table,
    the target's KV pool, the drafter (its KV pool with the scratch region) and the
    `TreeCycle`; `capture_graphs()` captures `tree_cycle` per padded batch size of
    `batch_size_schedule(max_bs, cuda_graph_bs)` (on CUDA, unless `enforce_eager` or
    GRAPHDRAFT_EAGER=1). `sampling=True` computes the target's probabilities at every node
    (needed for any row with temperature > 0). `kernels`: the kernel settings of the target,
    the head, the attention and the tree kernels (None: the target's config with the Triton
    backend on CUDA, the torch one elsewhere)."""

    def __init__(self, target: LlamaForCausalLM, head: Eagle3DraftHead, spec: TreeSpec, *,
                 max_bs: int = 8, page_size: int = 16, max_context_len: int = 512,
                 cuda_graph_bs: list[int] | None = None, kernels: KernelConfig | None = None,
                 enforce_eager: bool = False, sampling: bool = False, seed: int = 0,
                 graph_pool: GraphPool | None = None) -> None:
        if not isinstance(spec, TreeSpec):
            raise ValueError(f"spec: expected a TreeSpec, got {type(spec).__name__}")
        for name, v in (("max_bs", max_bs), ("page_size", page_size),
                        ("max_context_len", max_context_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        param = next(target.parameters())
        if next(head.parameters()).dtype != param.dtype or head.dtype != target.dtype:
            raise ValueError(f"head: expected the target's dtype {target.dtype}, got {head.dtype}")
        if max_context_len > min(target.config.max_position_embeddings,
                                 head.config.max_position_embeddings):
            raise ValueError(f"max_context_len: expected <= the models' max_position_embeddings, "
                             f"got {max_context_len}")
        self.device = param.device
        self.spec, self.max_bs, self.page_size = spec, max_bs, page_size
        self.max_context_len = max_context_len
        if kernels is not None and not isinstance(kernels, KernelConfig):
            raise ValueError(f"kernels: expected a KernelConfig or None, got "
                             f"{type(kernels).__name__}")
        self.kernels = (target.kernels.with_backend(
            "triton" if self.device.type == "cuda" else "torch") if kernels is None else kernels)
        self.target, self.head = target, head
        target.set_kernels(self.kernels)
        tc = target.config
        max_pages = -(-max_context_len // page_size)
        num_pages = max_bs * max_pages + 1
        self.pages = PageTable(max_bs, max_pages, num_pages, page_size, self.device)
        self.kv = KVPool(tc.num_hidden_layers, num_pages, page_size, tc.num_key_value_heads,
                         tc.head_dim, target.dtype, self.device)
        self.backend = PagedAttentionBackend(self.pages.req_to_page, page_size, max_context_len,
                                             kernels=self.kernels)
        self.drafter = TreeDrafter(head, spec, req_to_page=self.pages.req_to_page,
                                   page_size=page_size, num_pages=num_pages,
                                   max_context_len=max_context_len, max_bs=max_bs,
                                   kernels=self.kernels, device=self.device)
        self.cycle = TreeCycle(target, self.drafter, self.kv, self.backend, sampling=sampling)
        self.schedule = batch_size_schedule(max_bs, cuda_graph_bs)
        enabled = not (enforce_eager or eager_forced()) and self.device.type == "cuda"
        self.graphs = CapturedForward("tree_cycle", self.cycle.run, self.schedule,
                                      pool=graph_pool, enabled=enabled)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.host_gen = torch.Generator().manual_seed(seed)
        self.slots: list[int] = []
        self.done: list[bool] = []     # rows that reached max_new_tokens: inert from then on
        self.cycle.neutral_rows(0, max_bs)

    @property
    def bs(self) -> int:
        return len(self.slots)

    # ------------------------------------------------------------------
    @torch.inference_mode()
    def capture_graphs(self, progress: bool = False) -> None:
        """Capture `tree_cycle` for every scheduled size (largest first), before any request
        is added (warm-up and capture run inert rows only)."""
        if self.slots:
            raise ValueError("capture_graphs: expected no active requests (call reset() first)")
        self.cycle.neutral_rows(0, self.max_bs)
        self.graphs.capture(progress=progress)
        self.cycle.neutral_rows(0, self.max_bs)

    def state_snapshot(self) -> dict[str, torch.Tensor]:
        """Clones of the per-row state a step reads and commits (request slots, L,
        temperatures, the drafter's tree). A benchmark replaying `graphs` alone advances the
        requests at every replay; `restore_state` puts them back (KV past L is never read)."""
        c, tree = self.cycle, self.drafter.tree
        snap = {name: getattr(c, name).clone()
                for name in ("req", "prefix_len", "temperature", "top_k", "top_p")}
        snap.update({f"tree.{f}": getattr(tree, f).clone() for f in vars(tree)})
        return snap

    def restore_state(self, snap: dict[str, torch.Tensor]) -> None:
        """Copy a `state_snapshot` back in place (stream-ordered; no sync)."""
        c, tree = self.cycle, self.drafter.tree
        for name in ("req", "prefix_len", "temperature", "top_k", "top_p"):
            getattr(c, name).copy_(snap[name])
        for f in vars(tree):
            getattr(tree, f).copy_(snap[f"tree.{f}"])

    def reset(self) -> None:
        """Free every request; all rows inert."""
        for s in self.slots:
            self.pages.free(s)
        self.slots = []
        self.done = []
        self.cycle.neutral_rows(0, self.max_bs)

    def finish(self, row: int) -> None:
        """Row `row` is done: from the next step on it is inert (the dummy slot, a root-only
        tree: it writes no page of its request and its output is to be ignored), so no row
        ever grows past the pages `add` reserved for it."""
        if not 0 <= row < self.bs:
            raise ValueError(f"row: expected 0..{self.bs - 1}, got {row}")
        self.done[row] = True

    @torch.inference_mode()
    def add(self, prompts: list[list[int]], max_new_tokens: int,
            temperature: float | list[float] = 0.0, *, top_k: int = 0,
            top_p: float = 1.0) -> list[int]:
        """Prefill `prompts` as the batch (eager, one request at a time), sample or pick each
        one's first token, draft its first tree. `temperature` per prompt (or one for all);
        `top_k` (0: off) / `top_p` (1: off) for every sampled row. Returns each request's
        first token. ValueError (nothing changed) when a prompt is empty, holds ids outside
        the vocab, does not fit, the batch would exceed max_bs, or a sampling parameter is
        out of range."""
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0: off), got {top_k!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p: expected in (0, 1], got {top_p!r}")
        temps = temperature if isinstance(temperature, list) else [temperature] * len(prompts)
        vocab = self.target.config.vocab_size
        if len(temps) != len(prompts):
            raise ValueError(f"temperature: expected one per prompt ({len(prompts)}), got {len(temps)}")
        if any(not isinstance(t, (int, float)) or t < 0 for t in temps):
            raise ValueError(f"temperature: expected numbers >= 0, got {temps!r}")
        if self.slots:
            raise ValueError("prompts: expected no active requests (a batch is added at once; "
                             "reset() first)")
        if not prompts or len(prompts) > self.max_bs:
            raise ValueError(f"prompts: expected 1..{self.max_bs} prompts, got {len(prompts)}")
        if any(t > 0 for t in temps) and not self.cycle.sampling:
            raise ValueError("temperature: expected 0 (greedy) for a runner built with sampling=False")
        for i, p in enumerate(prompts):
            if not p or not all(isinstance(t, int) and 0 <= t < vocab for t in p):
                raise ValueError(f"prompts[{i}]: expected a non-empty list of ids in [0, {vocab})")
            need = len(p) + max_new_tokens + self.spec.n + self.spec.P + 1
            if need > self.max_context_len:
                raise ValueError(f"prompts[{i}]: {len(p)} tokens + max_new_tokens {max_new_tokens} "
                                 f"+ look-ahead exceed max_context_len ({self.max_context_len})")
        roots, logits1, hid1, ids1 = [], [], [], []
        for i, p in enumerate(prompts):
            slot = self.pages.alloc_slot()
            self.pages.reserve(slot, len(p) + max_new_tokens + self.spec.n + self.spec.P + 1)
            self.slots.append(slot)
            self.done.append(False)
            root, lg, h, did = self._prefill(slot, p, float(temps[i]), top_k, top_p)
            roots.append(root)
            logits1.append(lg)
            hid1.append(h)
            ids1.append(did)
        bs, c, dev = self.bs, self.cycle, self.device
        c.req[:bs] = torch.tensor(self.slots, dtype=torch.int64, device=dev)
        c.prefix_len[:bs] = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=dev)
        c.temperature[:bs] = torch.tensor([float(t) for t in temps], dtype=torch.float32,
                                          device=dev)
        c.top_k[:bs] = top_k
        c.top_p[:bs] = top_p
        self.drafter.expand(bs, torch.cat(logits1), torch.cat(hid1), c.req[:bs],
                            c.prefix_len[:bs], torch.tensor(roots, dtype=torch.int64, device=dev),
                            torch.cat(ids1), temperature=c.temperature[:bs] if c.sampling else None)
        return roots

    def _prefill(self, slot: int, prompt: list[int], temperature: float, top_k: int,
                 top_p: float):
        """Target + head over the whole prompt (eager) -> (first token, level-1 logits
        `[1, Vd]`, hidden `[1, H]`, greedy ids `[1]`)."""
        dev, L = self.device, len(prompt)
        ids = torch.tensor(prompt, dtype=torch.int64, device=dev)
        pos = torch.arange(L, device=dev)
        req = torch.tensor([slot], dtype=torch.int64, device=dev)
        loc = kv_slots(self.pages.req_to_page, req, pos, self.page_size)
        seq = torch.tensor([L], dtype=torch.int32, device=dev)
        meta = self.backend.row_metadata(req, seq, seq.clone(), L)
        last = torch.tensor([L - 1], dtype=torch.int64, device=dev)
        out = self.target(ids, pos, loc, self.kv, self.backend, meta, last, capture_aux=True)
        if temperature > 0:
            one = lambda v, dt: torch.tensor([v], dtype=dt)
            p = row_target_probs(out.logits[:1].float().cpu(), one(temperature, torch.float32),
                                 one(top_k, torch.int64), one(top_p, torch.float32),
                                 one(0, torch.int64))[0]
            root = int(torch.multinomial(p, 1, generator=self.host_gen))
        else:
            root = int(torch.argmax(out.logits[0]))
        d = self.drafter
        d._use_head_kernels()
        dids = torch.cat([ids[1:], torch.tensor([root], device=dev)])
        dmeta = d.backend.bind_metadata(req, seq)
        dout = self.head(dids, pos, out.aux_hidden, loc, d.kv.layer(0), d.backend, dmeta, last)
        return root, dout.logits, dout.hidden, dout.ids

    @torch.inference_mode()
    def step(self) -> TreeStepResult:
        """One speculative step over the active rows (graph replay at the padded size, or the
        same functions eagerly); one device-to-host copy."""
        bs = self.bs
        if bs == 0:
            raise ValueError("step: expected active requests (add() first)")
        pbs = padded_batch_size(self.schedule, bs) or bs
        self.cycle.neutral_rows(bs, pbs)
        for row, done in enumerate(self.done):
            if done:
                self.cycle.neutral_rows(row, row + 1)
        if self.cycle.sampling:
            self.cycle.coins[:pbs].uniform_(0.0, 1.0, generator=self.gen)
            self.cycle.final_coin[:pbs].uniform_(0.0, 1.0, generator=self.gen)
        pack = self.graphs.run(pbs, padded_bs=pbs)
        host = pack[:bs].cpu().tolist()
        P = self.spec.P
        return TreeStepResult([row[: row[P]] for row in host], [row[P] for row in host])

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 temperature: float | list[float] = 0.0, *, top_k: int = 0,
                 top_p: float = 1.0, by_row: bool = False
                 ) -> tuple[list[list[int]], list[int] | list[list[int]]]:
        """Serve `prompts` to `max_new_tokens` each (the batch steps together; a finished row
        turns inert, `finish`). Returns (outputs, accept lengths of every (row, step) of a
        live row, in step order; `by_row`: one list per prompt instead, e.g. for a bootstrap
        over prompts); the runner is reset after."""
        firsts = self.add(prompts, max_new_tokens, temperature, top_k=top_k, top_p=top_p)
        outs = [[t] for t in firsts]
        accepts: list[int] = []
        rows: list[list[int]] = [[] for _ in prompts]
        for row, o in enumerate(outs):
            if len(o) >= max_new_tokens:
                self.finish(row)
        while not all(self.done):
            res = self.step()
            for row, (o, toks, a) in enumerate(zip(outs, res.tokens, res.accept, strict=True)):
                if not self.done[row]:
                    o.extend(toks)
                    accepts.append(a)
                    rows[row].append(a)
                    if len(o) >= max_new_tokens:
                        self.finish(row)
        self.reset()
        return [o[:max_new_tokens] for o in outs], (rows if by_row else accepts)


def chain_pool_view(pool: KVPool, num_pages: int) -> KVPool:
    """A `KVPool` over the first `num_pages` pages of `pool` (views, no copy): the chain
    drafter's pool inside the tree drafter's (whose scratch pages follow), so the KV the
    chain drafter writes during prefill is the prefix the beams attend to."""
    if not 2 <= num_pages <= pool.num_pages:
        raise ValueError(f"num_pages: expected 2..{pool.num_pages}, got {num_pages}")
    view = KVPool.__new__(KVPool)
    view.num_pages, view.page_size = num_pages, pool.page_size
    slots = num_pages * pool.page_size
    view.k = [t[:slots] for t in pool.k]
    view.v = [t[:slots] for t in pool.v]
    return view


SALT_TREE = 2
"""Philox counter word of the tree acceptance coins (the target's sampled chain tokens use
`kernels.accept.SALT_TARGET` = 1)."""


class EngineTrees:
    """Tree drafting inside `serving.engine.Engine` (`RuntimeConfig.speculative_eagle_topk > 1`).

    Holds the `TreeDrafter` (its KV pool = the chain drafter's pool + the beam scratch pages:
    `chain_kv` is the view the Engine's `EagleDrafter` gets), two `TreeCycle`s over it
    (greedy, and sampled: target probabilities at every node, used when any running request
    samples) and the per-slot trees (`SlotTrees`). The Engine's state stays where the chain
    keeps it: `SlotState` (sampling parameters, stop table, emitted, max_new, done, seed),
    `valid_cache_lengths` (L) and `CycleBuffers` (slot_rows in; accept, finish, err, pack out).

    `run(bs, sampled)` is the Engine's decode cycle over `slot_rows[:bs]` (graph-capturable,
    one graph per padded bs and kind: `graphs[sampled]`):
      rows      live = slot > 0 and not done; dead rows use slot 0 (L = 0, greedy, root-only)
      load      TreeCycle.req / prefix_len / sampling tables from SlotState, the slot's tree
      coins     sampled: Philox of (the slot's seed; counter (L + 1) * 64 + node, SALT_TREE)
      verify    TreeCycle.verify, then the logit controls in place on its logits
                (`ops.apply_logit_controls`, each node counting its path's drafts as emitted)
      accept    TreeCycle.accept
      cut       stop ids / max_new_tokens cut of the accept length (`stop_cut`: the chain's
                accept kernel rules, a stop token winning over the length limit at one position)
      logprobs  rows that asked: the path's tokens scored from their nodes' logits
                (`token_logprobs`) into `CycleBuffers.logprobs`
      compact, draft (TreeCycle: the beams' logit controls count the accepted path within
                the cut as emitted), SlotTrees.store
      commit    `ops.count_tokens` of the out tokens within the cut (the penalties' counts,
                only now: a cycle that fails before its commit counts nothing), then
                `cycle_kernels.commit_pack` over the out tokens `[bs, P]` (L += accept,
                last_token, emitted, done; pack `[bs, n + 3]`)
    `expand_prefilled` drafts the first tree of requests whose last prefill chunk ran (from
    the chain drafter's first-step hidden state at the prompt's last token).
    """

    def __init__(self, target: LlamaForCausalLM, head: Eagle3DraftHead, spec: TreeSpec, cfg, *,
                 req_to_page: torch.Tensor, kv: KVPool, backend: PagedAttentionBackend,
                 slots, valid_cache_lengths: torch.Tensor, cycle_buffers, schedule: list[int],
                 graph_pool: GraphPool, enabled: bool, on_oom: str = "drop") -> None:
        if spec.is_chain:
            raise ValueError("speculative_eagle_topk: expected > 1 for tree drafting, got 1")
        self.spec, self.cfg = spec, cfg
        self.drafter = TreeDrafter(head, spec, req_to_page=req_to_page, page_size=cfg.page_size,
                                   num_pages=cfg.total_kv_pages,
                                   max_context_len=cfg.max_context_len, max_bs=cfg.max_bs,
                                   kernels=cfg.kernels, device=cfg.device)
        if slots.vocab:  # the beams propose under the rows' logit controls
            self.drafter.controls = DraftControls.build(slots, head.hot_token_ids, cfg.max_bs,
                                                        self.drafter.device)
        self.chain_kv = chain_pool_view(self.drafter.kv, cfg.total_kv_pages)
        self.cycles = {False: TreeCycle(target, self.drafter, kv, backend, sampling=False),
                       True: TreeCycle(target, self.drafter, kv, backend, sampling=True)}
        self.trees = SlotTrees(spec, slots.done.shape[0], self.drafter.device)
        dev = self.drafter.device
        self.logit_rows = torch.zeros(cfg.max_bs, spec.P, dtype=torch.int64, device=dev)
        """`[max_bs, P]` the accepted path's verify rows `r*n + node` (`stop_cut` writes them,
        `token_logprobs` reads them)."""
        self.slots, self.vcl, self.cb = slots, valid_cache_lengths, cycle_buffers
        self.graphs = {s: CapturedForward("tree_cycle_sampled" if s else "tree_cycle",
                                          functools.partial(self.run, sampled=s), schedule,
                                          pool=graph_pool, enabled=enabled, on_oom=on_oom)
                       for s in (False, True)}
        self.reset_neutral()

    def reset_neutral(self) -> None:
        for c in self.cycles.values():
            c.neutral_rows(0, self.drafter.max_bs)

    # --- the decode cycle ------------------------------------------------------------
    def run(self, bs: int, sampled: bool = False) -> torch.Tensor:
        """The module's decode cycle over `cycle_buffers.slot_rows[:bs]` (graph-capturable);
        returns `pack[:bs]` `[bs, n + 3]` int32."""
        c, st, cb, kc = self.cycles[sampled], self.slots, self.cb, self.drafter.kernels
        tree = self.drafter.tree.rows(bs)
        cols = [(getattr(st, f), getattr(c, f)[:bs]) for f in ("temperature", "top_k", "top_p",
                                                              "min_p")] if sampled else ()
        self.trees.load(tree, cb.slot_rows[:bs], st.done, self.vcl, c.live[:bs], c.req[:bs],
                        c.prefix_len[:bs], columns=cols, verify=c.verify_slots(bs), kernels=kc)
        live = c.live[:bs]
        if sampled:
            self.coins(bs, c)
        out = c.verify(bs, slots_ready=True)
        ops.apply_logit_controls(out.logits, tree.tokens, c.req[:bs], st, path=tree.mask,
                                 kernels=self.drafter.kernels)
        c.accept(bs, out.logits)
        self.stop_cut(bs, c, live)
        self.token_logprobs(bs, c, out.logits)
        c.compact(bs)
        c.draft(bs)  # the Engine's commit keeps L and the pack (commit_pack)
        self.trees.store(self.drafter.tree.rows(bs), c.req[:bs], kernels=kc)
        ops.count_tokens(c.out_tokens(bs), cb.accept[:bs], c.req[:bs], st.token_counts,
                         kernels=self.drafter.kernels)
        ops.commit_pack(c.out_tokens(bs), None, accept=cb.accept[:bs], finish=cb.finish[:bs],
                        err=cb.err[:bs], req=c.req[:bs], seq_lens=c.v_seq[:bs], vcl=self.vcl,
                        last_token=st.last_token, drafts=st.drafts, emitted=st.emitted,
                        done=st.done, pack=cb.pack[:bs], prefill=False,
                        kernels=self.drafter.kernels)
        return cb.pack[:bs]

    def coins(self, bs: int, c: TreeCycle) -> None:
        """`c.coins[:bs]` `[bs, n]` and `c.final_coin[:bs]` from Philox-4x32-10 keyed by the
        rows' seeds, counter `(L + 1) * 64 + node` (L grows every cycle: fresh coins; a row's
        coins depend only on its seed and L, not on the batch)."""
        n = self.spec.n
        seed = self.slots.seed.index_select(0, c.req[:bs]).unsqueeze(1)
        cnt = (c.prefix_len[:bs] + 1).unsqueeze(1) * 64 + torch.arange(n, device=seed.device)
        w0, w1, _, _ = philox4x32_ref(seed, cnt, SALT_TREE)
        c.coins[:bs].copy_(((w0 >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0))
        c.final_coin[:bs].copy_(((w1[:, 0] >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0))

    def stop_cut(self, bs: int, c: TreeCycle, live: torch.Tensor) -> None:
        """Cut `c.accept_len[:bs]` at the first emitted stop id (finish 1) or where emitted
        reaches max_new (finish 2; a stop wins at the same position); writes the Engine's
        accept (0 on dead rows), finish and err (0) of rows [0, bs)
        (`kernels.tree_stop_cut`: one launch on the Triton path), and `logit_rows[:bs]`, the
        verify rows of the accepted path's nodes (`token_logprobs`)."""
        st, cb = self.slots, self.cb
        ops.tree_stop_cut(c.out_tokens(bs), c.accept_len[:bs], c.req[:bs], live, st.stop_ids,
                          st.max_new, st.emitted, cb.accept[:bs], cb.finish[:bs], cb.err[:bs],
                          rows=(c.accept_index[:bs], self.spec.n, self.logit_rows[:bs]),
                          kernels=self.drafter.kernels)

    def token_logprobs(self, bs: int, c: TreeCycle, logits: torch.Tensor) -> None:
        """Log-probabilities of the accepted path's tokens `out_tokens [bs, P]` (rows that
        asked: `SlotState.logprobs` >= 0) into `CycleBuffers.logprobs[:bs]`: token d was
        chosen from the logits of the path's node `accept_index[r, d]`, row
        `r * n + accept_index[r, d]` of `logits [bs * n, V]` (the chain's rule per node;
        `logit_rows`, written by `stop_cut`)."""
        ops.token_logprobs(logits, c.out_tokens(bs), c.req[:bs], self.slots.logprobs,
                           out=self.cb.logprobs[:bs], k=self.cfg.max_logprobs,
                           logit_rows=self.logit_rows[:bs],
                           done=self.slots.done, kernels=self.drafter.kernels)

    # --- after a prompt's last prefill chunk (eager) ---------------------------------
    def expand_prefilled(self, req: torch.Tensor, prefix: torch.Tensor, root: torch.Tensor,
                         hidden: torch.Tensor) -> None:
        """First trees of `m` requests: `req [m]` slots, `prefix [m]` their prompt lengths
        (L, the root's position), `root [m]` the first token, `hidden [m, H]` the chain
        drafter's first-step (pre-norm) hidden at the prompt's last token; the level-1
        logits are the head's LM head over it. Stores the trees into the slots' rows."""
        m, head = req.shape[0], self.drafter.head
        if m == 0:
            return
        logits = head.logits_processor(head.norm(hidden), head.lm_head).next_token_logits
        tree = self.drafter.expand(m, logits, hidden, req, prefix, root,
                                   temperature=self.slots.temperature.index_select(0, req.long()))
        self.trees.store(tree, req.long(), kernels=self.drafter.kernels)

    def forwards(self) -> list[CapturedForward]:
        return list(self.graphs.values())


class TreeMode(DecodeMode):
    """Tree drafting as an Engine decode mode (`cycles.base.DecodeMode`;
    `RuntimeConfig.speculative_eagle_topk > 1`, the built-in EAGLE-3 drafter only).

    Verify width n = `TreeSpec.n`; one draft KV pool (`EngineTrees`: the `TreeDrafter`'s pool
    is the chain pool's pages plus the beam scratch pages; `chain_drafter`, the Engine's
    `EagleDrafter`, gets the view of its first pages, so the draft KV it writes during
    prefill is the prefix the beams attend to). Decode cycle: `EngineTrees.run`, one graph
    per padded bs and kind (greedy ("tree_cycle", None) / sampled ("tree_cycle_sampled",
    None), the sampled one whenever any running request samples). Prefill / mixed steps
    (eager): the decode rows run the tree cycle first (its graph at their padded size); the
    prefill rows run the chain's prefill (target, first-token accept, the chain drafter's
    first step for the draft KV, its multi-step skipped) and `EngineTrees.expand_prefilled`
    drafts the first tree of each prompt whose last chunk ran. The policy stays fixed."""

    name = "tree"
    precompiles = False

    def __init__(self, parts: CycleParts, trees: EngineTrees, chain_drafter) -> None:
        super().__init__(parts, trees.spec.n, (parts.cfg.speculative_num_steps,))
        self.trees, self.drafter = trees, chain_drafter
        for fwd in trees.graphs.values():
            parts.registry.add(fwd.name, None, fwd)

    def run(self, bs: int, pbs: int, k: int, running: list[Request]) -> None:
        sampled = any(not r.params.greedy for r in running)
        self.trees.graphs[sampled].run(pbs, padded_bs=pbs)

    def drafts_made(self, k: int) -> int:
        return self.n_row - 1

    def drafter_cycle(self, k: int) -> None:
        """The tree drafter drafted inside the cycle; the chain drafter did not run."""

    def reset_neutral(self) -> None:
        super().reset_neutral()
        self.drafter.reset_neutral()
        self.trees.reset_neutral()

    def state_tables(self) -> dict[str, torch.Tensor]:
        t = self.trees.trees
        return {f"trees.{f}": getattr(t, f) for f in t.TREE_FIELDS}

    def decode_forwards(self) -> list[CapturedForward]:
        return self.trees.forwards()

    def cost_forwards(self) -> dict[int, CapturedForward]:
        return {}

    def mixed(self, rows: list[BatchRow], preqs: list[Request], dreqs: list[Request],
              plan: StepPlan) -> None:
        """Pack rows: prefill rows first, then decode rows (the order the Engine records)."""
        ne, nd = len(rows), len(dreqs)
        cb = self.parts.cycle
        dec_pack = None
        if nd:
            pnd = self.padded(nd)
            self.parts.stage_rows([r.slot for r in dreqs] + [0] * (pnd - nd))
            self.run(nd, pnd, max(self.steps), self.parts.running())
            dec_pack = cb.wire[:nd].clone()  # pack and logprobs
        if ne:
            self._prefill(rows, preqs)
        if nd:
            cb.wire[ne: ne + nd].copy_(dec_pack)

    def _prefill(self, rows: list[BatchRow], preqs: list[Request]) -> None:
        p = self.parts
        ne, cb = len(rows), p.cycle
        pctx = write_batch(p.inputs, p.pages, rows)
        ctx = ForwardContext(bs=ne, num_extends=ne, input_num_tokens=pctx.input_num_tokens,
                             all_extends_mid_chunk=pctx.all_extends_mid_chunk)
        out = self.target_forward(ctx, rows, capture_aux=True, preqs=preqs)
        final = [r.slot if row.end == len(r.prompt) else 0
                 for row, r in zip(rows, preqs, strict=True)]
        p_tok = cb.tokens[:ne].view(ne, 1)
        cb.err[:ne] = 0
        accept = self.drafter.accept_lengths(ne)
        self.accept(0, 0, ne, 1, out.logits[:ne], p.host_tensor(final), p_tok, accept)
        accept = accept.clone()
        accept[:] = 1
        dctx = ForwardContext(bs=ne, num_extends=ne, input_num_tokens=ctx.input_num_tokens,
                              all_extends_mid_chunk=True)  # first step only (draft KV)
        nxt = self.drafter.draft_mixed(dctx, out.aux_hidden, cb.tokens[:ne], accept)
        self.commit(0, ne, p_tok, nxt[:ne], prefill=True)
        last = [i for i, s in enumerate(final) if s]
        if last:
            idx = p.host_tensor(last)
            self.trees.expand_prefilled(
                p.host_tensor([final[i] for i in last]),
                p.host_tensor([len(preqs[i].prompt) for i in last]),
                p_tok[:, 0].index_select(0, idx), self.drafter.first_step_hidden(idx))
