"""Train an EAGLE-3 head for a pretrained chat target (e.g. SmolLM2-135M-Instruct), the EAGLE-3 way.

0. The head's size (`check_head_size`: `max_head_bytes`) before anything else.
1. Prompts (`graphdraft.train.chat_prompts`: stdlib functions and classes as code requests,
   each function also laid out and asked as HumanEval asks; typed problems with `>>>`
   examples in HumanEval's layout (`graphdraft.train.code_problems`); instruction templates
   over everyday topics), each one user message under the target's chat template.
2. Responses: the target's own (`graphdraft.train.responses`): graphdraft's `Engine`, target
   only, CUDA graphs, `gen_batch` requests live; per prompt one greedy response and
   `responses_per_prompt - 1` sampled at `sample_temperature` (distinct seeds), up to
   `max_new_tokens`, stopping at EOS / end of turn.
3. Held out: whole prompts (`split_heldout`). Draft vocabulary: the `draft_vocab` most
   frequent target ids of the training responses (EOS and the end-of-turn token always in),
   the head's `hot_token_ids` (saved as `d2t` / `t2d`).
4. Training (`train._train_loop`): the target frozen (its weights as loaded, bf16 on CUDA),
   its aux hidden states (`train.forward.target_forward`) the head's input; the head's
   training-time test unrolled `ttt_steps` steps (`forward.head_ttt_forward`); step k's loss
   (`train.ttt_loss`) the cross-entropy against the target's softmax over the draft
   vocabulary, weighted `decay ** (k - 1)`, on response positions only and only where the
   target's greedy token is in the draft vocabulary (EAGLE-3's position mask); batches of
   similar lengths within `batch_tokens` (`LengthBatches`). `lm_head` "target"
   (`--lm-head target`): the head's LM head is the target's rows of the draft vocabulary,
   frozen (not in the optimizer), so a larger `draft_vocab` costs 8 bytes an id (d2t), not an
   LM-head row.
5. The head is saved (`save_eagle3_head`, `save_dtype`; with `lm_head` "target" without
   its LM head, the config saying `graphdraft_lm_head: "target"`) with `training.json`: the
   data, the run, the held-out agreement and expected accept length (overall, per prompt
   kind), each phase's seconds and the GPU.

Time: `gen_max_minutes` caps generation, `max_minutes` training, and `deadline_minutes` the
whole run (`_deadlines`). Progress lines carry the UTC time and the seconds since the start.

Over several calls (a lent GPU runs one command for minutes; its /tmp stays between calls):
`responses_cache` DIR keeps the responses (step 2) and a later run whose key matches
(`responses.responses_key`: target identity, prompts, sampling settings, seed) loads them
instead of generating; `checkpoint` DIR saves the training state when training stops
(`graphdraft.train.resume`: fp32 weights, AdamW, step, schedule position, draft vocabulary,
data order) and `resume` goes on from it exactly (N steps then M more == N + M in one run);
`total_minutes` spans the cosine over every call's training minutes (each call keeps its own
`max_minutes` / `deadline_minutes`) and `call_steps` caps one call's steps. `init_from` DIR
starts from a saved head's weights and draft vocabulary (a fresh optimizer and schedule).

`python -m graphdraft.train real --target DIR_OR_GGUF --out DIR --recipe gpu` runs it.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from graphdraft.io.checkpoint import load_target, save_eagle3_head
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.llama import LlamaForCausalLM
from graphdraft.train.chat_prompts import training_prompts
from graphdraft.train.forward import head_ttt_forward, target_forward
from graphdraft.train.responses import (
    Samples,
    cached_key,
    generate_samples,
    load_responses,
    responses_key,
    samples_digest,
    save_responses,
    target_identity,
)
from graphdraft.train.resume import TrainState, check_state, load_state, plan_of, save_state
from graphdraft.train.train import (
    SUMMARY_NAME,
    HeadTraining,
    LoopStart,
    _hardware,
    _optimizer,
    _round,
    _sync,
    _train_loop,
    autocast,
    init_for_training_,
    matmul_precision,
    resolve_device,
    resolve_precision,
    seed_everything,
    trained_parameters,
    ttt_loss,
)


@dataclass(kw_only=True)
class RealHeadRun(HeadTraining):
    """A chat target's EAGLE-3 head: the shared training settings (`HeadTraining`; `batch`
    is the most sequences a step takes) and the data's."""

    target: str
    """A converted target directory (config.json, safetensors, tokenizer.json) or a .gguf file."""
    out: str
    code_prompts: int = 8000
    """Standard-library code prompts at most (`chat_prompts.code_prompts`)."""
    forms_per_function: int = 4
    """Prompts per stdlib definition: HumanEval's form and `forms_per_function - 1` others."""
    typed_problems: int = 0
    """Typed problems with `>>>` examples in HumanEval's layout (`code_problems`)."""
    prose_prompts: int = 2240
    responses_per_prompt: int = 2
    """Responses per prompt: the first greedy, the others sampled at `sample_temperature`."""
    sample_temperature: float = 0.7
    max_prompt_tokens: int = 384
    max_new_tokens: int = 256
    gen_batch: int = 512
    """Requests the generating Engine runs at once (its largest CUDA graph)."""
    gen_graphs: bool = True
    """On CUDA: generate with the Engine's CUDA graphs and Triton kernels (else eagerly)."""
    gen_max_minutes: float | None = None
    """No response starts after this many minutes of the generation phase (prompt encoding
    and the engine's capture included; the live ones finish)."""
    draft_vocab: int = 1536
    ffn: int = 192
    """Draft vocabulary and MLP width: for SmolLM2-135M (hidden 576) a 3.65 M-parameter head,
    7.37 MB in bf16 with d2t / t2d; each draft id adds 1,160 bytes (a bf16 LM-head row and a
    d2t entry; with `lm_head` "target" only the 8-byte d2t entry), each MLP unit 3,456."""
    max_head_bytes: int | None = None
    """The saved model.safetensors may not exceed this (`predicted_head_bytes`, checked before
    any response is generated); None: no limit."""
    ttt_steps: int = 5
    batch_tokens: int = 16384
    """Tokens a training step takes at most (its sequences padded to the longest)."""
    heldout_fraction: float = 0.01
    heldout_max: int = 256
    """Held-out responses at most (whole prompts: no held-out prompt is trained on)."""
    deadline_minutes: float | None = None
    """The whole run's wall cap from its start: generation stops adding responses at half of
    it, and training stops early enough to evaluate and save before it."""
    responses_cache: str | None = None
    """A directory for the responses (`responses.save_responses`): a run whose responses key
    (`responses.responses_key`) matches the one there loads them instead of generating; else
    it generates and writes them there. None: generate, keep nothing."""
    checkpoint: str | None = None
    """A directory for the training state (`graphdraft.train.resume`), written when training
    stops (deadline, caps or the end), before the head is evaluated and saved."""
    resume: bool = False
    """Go on from `checkpoint`'s state (the same plan, target and responses: `resume.check_state`)
    instead of a fresh head and optimizer."""
    total_minutes: float | None = None
    """Training minutes the learning-rate schedule spans over every call of a checkpointed
    training (the cosine's time fraction counts them all; training ends once they are
    reached). None: each call's own time cap, as a run of one call."""
    call_steps: int | None = None
    """Steps this call trains at most (`steps` stays the whole training's, the schedule's
    length); a checkpointed run goes on with `resume`."""
    init_from: str | None = None
    """A head directory to start from (a fresh optimizer and schedule): its weights and its
    draft vocabulary (d2t / t2d) instead of a new head and the responses' most frequent ids;
    its MLP width and draft vocabulary size must be the run's `ffn` and `draft_vocab`."""


def hot_token_ids(samples: Samples, vocab_size: int, size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent response ids (`always` forced in), sorted ascending `[size]`."""
    mask = samples.label_mask()
    nxt = torch.zeros_like(mask)
    nxt[:, 1:] = mask[:, :-1]  # the response tokens themselves (positions j + 1)
    counts = torch.bincount(samples.ids[nxt], minlength=vocab_size).float()
    counts[torch.tensor(always, dtype=torch.long)] = float("inf")
    return torch.topk(counts, min(size, vocab_size)).indices.sort().values


class DraftLabels:
    """The target's labels over the draft vocabulary: `hot [Vd]`, `to_draft [V]` (-1: none)."""

    def __init__(self, hot: torch.Tensor, vocab_size: int) -> None:
        self.hot = hot
        self.to_draft = torch.full((vocab_size,), -1, dtype=torch.long, device=hot.device)
        self.to_draft[hot] = torch.arange(hot.numel(), device=hot.device)

    def __call__(self, target_logits: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """target logits `[B, L, V]`, label mask `[B, L]` -> (probs over the draft vocab
        `[B, L, Vd]` fp32, the greedy token's draft id `[B, L]` (-1: not in it), the position
        mask `[B, L]`: a response label whose greedy token is in the draft vocab)."""
        greedy = self.to_draft[target_logits.argmax(-1)]
        probs = torch.softmax(target_logits[..., self.hot].float(), -1)
        return probs, greedy, mask & (greedy >= 0)

    def coverage(self, samples: Samples) -> float:
        """The share of `samples`' response tokens in the draft vocabulary."""
        resp = samples.ids[torch.roll(samples.label_mask(), 1, 1)]
        return round((self.to_draft.cpu()[resp] >= 0).float().mean().item(), 4)


def _padded(length: int, width: int) -> int:
    return min(width, -(-length // 16) * 16)


class LengthBatches:
    """Training batches of sequences of similar length within a token budget.

    Each epoch sorts the sequences by length (ties in random order), cuts that order into
    batches of at most `batch` sequences whose count x padded longest length (a multiple of
    16) stays within `batch_tokens` (a longer sequence alone), and visits the batches in
    random order: every sequence once an epoch, little padding. Calling it -> (ids `[b, l]`,
    label mask `[b, l]`) on `device`.
    """

    def __init__(self, samples: Samples, batch: int, batch_tokens: int, device: torch.device,
                 gen: torch.Generator) -> None:
        self.ids, self.mask = samples.ids.to(device), samples.label_mask().to(device)
        self.lens = samples.lens.tolist()
        self.batch, self.batch_tokens, self.device, self.gen = batch, batch_tokens, device, gen
        self.queue: deque[list[int]] = deque()
        self.batches_per_epoch = len(self._plan())
        self.mean_tokens = sum(self.lens) / self.batches_per_epoch
        self.epochs = 0

    def _plan(self) -> list[list[int]]:
        n, width = len(self.lens), self.ids.shape[1]
        key = torch.tensor(self.lens, dtype=torch.float64) + torch.rand(n, generator=self.gen,
                                                                        dtype=torch.float64)
        batches, cur = [], []
        for i in torch.argsort(key).tolist():
            longest = _padded(self.lens[i], width)  # ascending: the newcomer is the longest
            if cur and (len(cur) == self.batch or (len(cur) + 1) * longest > self.batch_tokens):
                batches.append(cur)
                cur = []
            cur.append(i)
        batches.append(cur)
        return [batches[j] for j in torch.randperm(len(batches), generator=self.gen).tolist()]

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.queue:
            self.queue.extend(self._plan())
            self.epochs += 1
        idx = self.queue.popleft()
        length = _padded(max(self.lens[i] for i in idx), self.ids.shape[1])
        t = torch.tensor(idx, dtype=torch.long).to(self.device)
        return self.ids[t, :length], self.mask[t, :length]


def _agreement(ok: torch.Tensor) -> dict:
    """ok `[positions, steps]` (step k agrees) -> per-step top-1 agreement and the chain's
    expected accept length `1 + sum_k P(steps 1..k all agree)` for 1..steps."""
    ok = ok.float()
    chain = torch.cumprod(ok, -1)
    return {"step_top1_agreement": [round(x, 4) for x in ok.mean(0).tolist()],
            "expected_accept_length": {f"steps_{s}": round(1 + chain[:, :s].sum(-1).mean().item(), 3)
                                       for s in range(1, ok.shape[1] + 1)},
            "positions": int(ok.shape[0])}


@torch.no_grad()
def eval_real_head(target: LlamaForCausalLM, head: Eagle3DraftHead, samples: Samples,
                   labels: DraftLabels, steps: int, batch: int, precision: str) -> dict:
    """Held-out agreement (`_agreement`) over response positions whose `steps` labels all
    exist, overall and per prompt kind ("by_kind")."""
    device = target.embed_tokens.device
    oks, kinds = [], []
    for i in range(0, samples.ids.shape[0], batch):
        part = samples.subset(list(range(i, min(i + batch, samples.ids.shape[0]))))
        ids, mask = part.ids.to(device), part.label_mask().to(device)
        with autocast(precision, device):
            tl, aux = target_forward(target, ids)
            outs = head_ttt_forward(head, ids, aux, steps)
        _, greedy, _ = labels(tl, mask)
        n = ids.shape[1] - steps
        ok = torch.stack([lg[:, :n].argmax(-1) == greedy[:, k: k + n]
                          for k, lg in enumerate(outs, start=1)], -1)
        valid = torch.stack([mask[:, k: k + n] for k in range(1, steps + 1)], -1).all(-1)
        oks.append(ok[valid].cpu())
        kinds += [kind for row, kind in enumerate(part.kinds) for _ in range(int(valid[row].sum()))]
    ok = torch.cat(oks)
    out = _agreement(ok)
    out["by_kind"] = {k: _agreement(ok[torch.tensor([x == k for x in kinds])])
                      for k in sorted(set(kinds))}
    return out


def load_chat_target(path: str, device: torch.device) -> tuple[LlamaForCausalLM, object, Path]:
    """(target, tokenizer, its directory): a directory as is, a .gguf converted once into the
    cache (float32). The target in bf16 on CUDA (frozen teacher and generator), else fp32."""
    from graphdraft.io.gguf_convert import cached_conversion, is_gguf_file
    from graphdraft.io.tokenizer import load_tokenizer
    d = cached_conversion(path) if is_gguf_file(path) else Path(path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, _ = load_target(d, dtype, device)
    tokenizer = load_tokenizer(d)
    if tokenizer is None or not tokenizer.has_chat_template:
        raise ValueError(f"{path}: training a chat head needs a tokenizer with a chat template")
    for p in target.parameters():
        p.requires_grad_(False)
    return target, tokenizer, d


SAFETENSORS_HEADER_BYTES = 2048
"""A bound on the safetensors header of a saved head (its JSON of tensor names and shapes)."""


def predicted_head_bytes(target_config, draft_vocab: int, ffn: int, save_dtype: str,
                         lm_head: str = "own") -> int:
    """model.safetensors bytes of a head `new_chat_head` builds for a target of `target_config`
    (its weights in `save_dtype`, d2t int64 `[draft_vocab]`, t2d bool `[vocab]`; `lm_head`
    "target": no LM head), at most."""
    cfg = target_config.replace(num_hidden_layers=1, intermediate_size=ffn,
                                draft_vocab_size=draft_vocab, tie_word_embeddings=False)
    with torch.device("meta"):
        head = Eagle3DraftHead(cfg, torch.float32, lm_head_source=lm_head)
    n = sum(p.numel() for p in trained_parameters(head).values())  # what the saver writes
    width = torch.empty((), dtype=getattr(torch, save_dtype)).element_size()
    return n * width + 8 * draft_vocab + target_config.vocab_size + SAFETENSORS_HEADER_BYTES


def check_head_size(run: RealHeadRun, target_config) -> int:
    """`predicted_head_bytes` of `run`'s head; ValueError naming draft_vocab / ffn when it
    exceeds `run.max_head_bytes` (checked before any GPU minute is spent)."""
    size = predicted_head_bytes(target_config, run.draft_vocab, run.ffn, run.save_dtype,
                                run.lm_head)
    if run.max_head_bytes is not None and size > run.max_head_bytes:
        hint = " or lm_head 'target'" if run.lm_head == "own" else ""
        raise ValueError(f"draft_vocab={run.draft_vocab}, ffn={run.ffn}: the head (LM head "
                         f"{run.lm_head}) would be {size:,} bytes, over max_head_bytes="
                         f"{run.max_head_bytes:,}; expected a smaller draft vocabulary or "
                         f"MLP{hint}")
    return size


def new_chat_head(target: LlamaForCausalLM, hot: torch.Tensor, ffn: int, seed: int,
                  lm_head: str = "own") -> Eagle3DraftHead:
    """An fp32 head (one layer of the target's attention shape, `ffn` MLP width, draft vocab
    `hot`) sharing the target's embedding; LM head rows and final norm from the target's
    (`lm_head` "target": the LM head stays the target's rows, `tie_lm_head_`, frozen)."""
    tc = target.config
    cfg = tc.replace(num_hidden_layers=1, intermediate_size=ffn, draft_vocab_size=hot.numel(),
                     tie_word_embeddings=False,
                     aux_hidden_state_layer_ids=tuple(target.aux_layer_ids))
    head = Eagle3DraftHead(cfg, torch.float32, hot_token_ids=hot.cpu())
    init_for_training_(head, seed, 1)
    head = head.to(target.embed_tokens.device)
    with torch.no_grad():
        head.lm_head.copy_(target.lm_head[hot.to(target.lm_head.device)].float())
        head.norm.weight.copy_(target.norm.weight.float())
    if lm_head == "target":
        head.tie_lm_head_(target.lm_head)
    head.embed_tokens = target.embed_tokens
    return head


@torch.no_grad()
def head_copy(head: Eagle3DraftHead, dtype: torch.dtype, embed: torch.Tensor,
              via: torch.dtype | None = None) -> Eagle3DraftHead:
    """`head` in `dtype` around the embedding `embed` (its device), hot tokens and LM head
    source kept; `via`: round every weight through that dtype first (what a checkpoint holds;
    not an LM head taken from the target, which the loader gathers in the target's dtype)."""
    out = Eagle3DraftHead(head.config, dtype, embed_tokens=embed,
                          hot_token_ids=head.hot_token_ids.to(embed.device),
                          lm_head_source=head.lm_head_source).to(embed.device)
    for (n, dst), (_, src) in zip(out.named_parameters(), head.named_parameters(), strict=True):
        if n == "embed_tokens":
            continue
        rounded = via is not None and not (n == "lm_head" and head.lm_head_source == "target")
        dst.copy_((src.to(via) if rounded else src).to(dtype))
    return out


def split_heldout(samples: Samples, run: RealHeadRun, gen: torch.Generator
                  ) -> tuple[Samples, Samples]:
    """(held-out, train): whole prompts held out (every response of a held-out prompt), about
    `heldout_fraction` of the responses, at least 8 and at most `heldout_max`."""
    n = samples.ids.shape[0]
    want = min(run.heldout_max, max(8, int(n * run.heldout_fraction)), n - 1)
    by_prompt: dict[int, list[int]] = {}
    for i, p in enumerate(samples.prompt.tolist()):
        by_prompt.setdefault(p, []).append(i)
    prompts = list(by_prompt)
    held: list[int] = []
    for j in torch.randperm(len(prompts), generator=gen).tolist():
        if len(held) >= want:
            break
        held += by_prompt[prompts[j]]
    chosen = set(held)
    return samples.subset(sorted(held)), samples.subset([i for i in range(n) if i not in chosen])


class RunLog:
    """Progress lines stamped with the UTC time and the seconds since the run began."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        stamp = datetime.now(timezone.utc).strftime("%H:%M:%S")
        print(f"[{stamp} +{self.elapsed():6.1f} s] {msg}", flush=True)


FINISH_RESERVE_S = 25.0
"""Seconds a deadline keeps after training: the held-out evaluation (at most `heldout_max`
sequences) and the save."""


def _deadlines(run: RealHeadRun, log: RunLog) -> tuple[float, float | None]:
    """(when generation stops starting responses, when training must stop) as perf_counter
    times: `gen_max_minutes` from now and half the run's deadline, the earlier; the deadline
    less `FINISH_RESERVE_S`."""
    now, inf = time.perf_counter(), float("inf")
    gen = now + 60 * run.gen_max_minutes if run.gen_max_minutes is not None else inf
    if run.deadline_minutes is None:
        return gen, None
    end = log.t0 + 60 * run.deadline_minutes
    return min(gen, log.t0 + 30 * run.deadline_minutes), end - FINISH_RESERVE_S


def _restore(state: TrainState, opt: torch.optim.Optimizer, batches: LengthBatches,
             gen: torch.Generator, start: LoopStart) -> LoopStart:
    """Put a checkpoint's optimizer state, epoch queue and data generator back (after
    `LengthBatches` drew its epoch count) -> the loop's start at the checkpoint's step."""
    opt.load_state_dict(state.optimizer)
    batches.queue.clear()
    batches.queue.extend(state.queue)
    batches.epochs = state.epochs
    gen.set_state(state.gen_state)
    return replace(start, step=state.step, ema=state.ema, trained_seconds=state.trained_seconds)


def train_stage(run: RealHeadRun, target: LlamaForCausalLM, head: Eagle3DraftHead,
                labels: DraftLabels, train: Samples, device: torch.device, precision: str,
                gen: torch.Generator, stop_at: float | None, log: RunLog,
                resume: TrainState | None = None, record: dict | None = None) -> dict:
    """Train `head` on `train` (module docstring, step 4) until `run.steps`, `run.call_steps`
    more, `run.total_minutes` of training over every call, `run.max_minutes` or `stop_at`
    (perf_counter) -> `_train_loop`'s record, plus epochs and the cap used. `resume`: go on
    from that checkpoint's state (`head` holds its weights already); `run.checkpoint`: save
    the state there when the loop stops, with `record` (what it belongs to)."""
    params = trained_parameters(head)  # lm_head "target": the LM head stays frozen
    for p in params.values():
        p.requires_grad_(True)
    opt = _optimizer(params, run.lr, run.weight_decay, device)

    def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]):
        ids, mask = batch
        with torch.no_grad(), autocast(precision, device):
            tl, aux = target_forward(target, ids)
        probs, greedy, pmask = labels(tl, mask)
        del tl
        with autocast(precision, device):
            outs = head_ttt_forward(head, ids, aux, run.ttt_steps)
        return ttt_loss(outs, greedy, run.decay, probs, pmask)

    batches = LengthBatches(train, run.batch, run.batch_tokens, device, gen)
    start = LoopStart(total_minutes=run.total_minutes, call_steps=run.call_steps)
    if resume is not None:
        start = _restore(resume, opt, batches, gen, start)
    cap = run.max_minutes
    if stop_at is not None:
        left = max(0.0, stop_at - time.perf_counter()) / 60
        cap = left if cap is None else min(cap, left)
    since = f" (from step {start.step})" if start.step else ""
    log(f"head: training for at most {run.steps - start.step} steps{since} / "
        f"{cap if cap is None else round(cap, 2)} min, {batches.batches_per_epoch} batches an "
        f"epoch (~{batches.mean_tokens:,.0f} tokens each)")
    step_fn = torch.compile(loss_fn) if run.compile else loss_fn
    with matmul_precision(precision):
        res = _train_loop("head", replace(run, max_minutes=cap), device, params, opt, step_fn,
                          loss_fn, batches, int(batches.mean_tokens), start)
    for p in params.values():
        p.requires_grad_(False)
    if run.checkpoint is not None:
        save_state(run.checkpoint, TrainState(
            res["next_step"], res["trained_seconds"], res["ema"], batches.epochs,
            {n: p.detach() for n, p in params.items()}, head.hot_token_ids, opt.state_dict(),
            gen.get_state(), [list(b) for b in batches.queue],
            dict(record or {}, history=list(run.history))))
        of = "" if run.total_minutes is None else f" of the schedule's {run.total_minutes}"
        more = ("" if res["stopped_by"] in ("steps", "total minutes")
                else "; its schedule is not done: go on with --resume")
        log(f"head: training state at step {res['next_step']} ({res['trained_seconds'] / 60:.2f}"
            f"{of} training minutes) saved to {run.checkpoint}{more}")
    res["epochs"] = round(res["next_step"] / batches.batches_per_epoch, 2)
    res["cap_minutes"] = None if cap is None else round(cap, 2)
    res["tokens_seen"] = int(res["next_step"] * batches.mean_tokens)
    return res


def _save(run: RealHeadRun, head: Eagle3DraftHead, target: LlamaForCausalLM,
          held: Samples, labels: DraftLabels, precision: str, log: RunLog) -> tuple[dict, int]:
    """Evaluate the weights as saved (`save_dtype`) on `held`, write the head -> (held-out
    record, model.safetensors bytes)."""
    save_dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[run.save_dtype]
    shipped = head_copy(head, torch.float32, target.embed_tokens.data.float(), via=save_dt)
    ev = eval_real_head(target, shipped, held, labels, run.ttt_steps, 16, precision)
    log(f"head held-out ({run.save_dtype} weights): {ev}")
    out = Path(run.out)
    save_eagle3_head(head_copy(head, save_dt, target.embed_tokens.data.to("cpu", save_dt)), out)
    return ev, (out / "model.safetensors").stat().st_size


def _responses(run: RealHeadRun, target: LlamaForCausalLM, tokenizer,
               prompts: list[tuple[str, str]], target_id: dict | None, gen: torch.Generator,
               gen_stop: float, log: RunLog) -> tuple[Samples, dict]:
    """`generate_samples`, or with `run.responses_cache` the cached responses when their key
    matches (the generator set to its state after their generation) and else generated and
    written there."""
    if run.responses_cache is None:
        return generate_samples(target, tokenizer, prompts, run, gen, gen_stop, log)
    key, where = responses_key(target_id, prompts, run), run.responses_cache
    have = cached_key(where)
    if have == key:
        t0 = time.perf_counter()
        samples, data, gen_state = load_responses(where)
        gen.set_state(gen_state)
        data = dict(data, responses_cache={"dir": str(where), "loaded": True,
                                           "load_seconds": round(time.perf_counter() - t0, 1)})
        log(f"responses: {samples.ids.shape[0]} loaded from the cache {where} "
            f"({data['responses_cache']['load_seconds']} s; generated in {data['seconds']} s)")
        return samples, data
    have = have or {}
    differ = sorted(k for k in key.keys() | have.keys() if key.get(k) != have.get(k))
    if run.resume:  # other responses than the first call's: check_state would refuse them
        raise ValueError(f"responses_cache {where}: resume needs the first call's responses, "
                         + (f"those there have another key ({', '.join(differ)} differ)"
                            if have else "none are there"))
    if not have:
        log(f"responses: no cached responses in {where}: generating")
    else:
        log(f"responses: the cache {where} holds responses of another key ({', '.join(differ)} "
            f"differ): generating anew")
    samples, data = generate_samples(target, tokenizer, prompts, run, gen, gen_stop, log)
    save_responses(where, key, samples, data, tokenizer.eos_token_ids[0], gen.get_state())
    data = dict(data, responses_cache={"dir": str(where), "loaded": False})
    log(f"responses: saved to the cache {where}")
    return samples, data


def _copy_trained(head: Eagle3DraftHead, weights: dict[str, torch.Tensor], what: str) -> None:
    """`head`'s trained parameters from `weights` (by name); ValueError naming `what` when
    the names or shapes differ."""
    params = trained_parameters(head)
    have = {n: tuple(t.shape) for n, t in weights.items()  # an LM head kept frozen: not copied
            if n != "lm_head" or n in params}
    want = {n: tuple(p.shape) for n, p in params.items()}
    if have != want:
        diff = sorted(n for n in have.keys() | want.keys() if have.get(n) != want.get(n))
        raise ValueError(f"{what}: its weights do not fit this run's head: "
                         + "; ".join(f"{n} {have.get(n)} there, {want.get(n)} here" for n in diff))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[n].to(p.device, p.dtype))


def _warm_start(run: RealHeadRun, target: LlamaForCausalLM) -> tuple[torch.Tensor, dict]:
    """`run.init_from`'s draft vocabulary `[Vd]` and weights (fp32 on the host); ValueError
    naming init_from when its MLP, draft vocabulary or aux layers differ from the run's."""
    from graphdraft.io.checkpoint import load_eagle3_head
    loaded = load_eagle3_head(run.init_from, target=target)
    cfg, vocab = loaded.config, target.config.vocab_size
    problems = [f"{name} {have} there, {want} here" for name, have, want in (
        ("ffn", cfg.intermediate_size, run.ffn),
        ("draft_vocab", cfg.output_vocab_size, run.draft_vocab),
        ("aux layers", tuple(cfg.aux_layer_ids()), tuple(target.aux_layer_ids))) if have != want]
    if problems:
        raise ValueError(f"init_from {run.init_from}: another head's shape: "
                         + "; ".join(problems))
    hot = loaded.hot_token_ids
    hot = torch.arange(vocab) if hot is None else hot.detach().cpu()
    weights = {n: p.detach().float().cpu() for n, p in loaded.named_parameters()
               if n != "embed_tokens"}
    return hot, weights


def _initial_head(run: RealHeadRun, target: LlamaForCausalLM, train: Samples, tokenizer,
                  state: TrainState | None, log: RunLog) -> Eagle3DraftHead:
    """The head training starts from: a checkpoint's (`state`), `run.init_from`'s, or a new
    one over the training responses' most frequent ids."""
    device = target.embed_tokens.device
    weights, what = None, None
    if state is not None:
        hot, weights, what = state.hot, state.head, f"checkpoint {run.checkpoint} (--resume)"
        if run.init_from is not None:
            log(f"head: init_from {run.init_from} not used: resuming from {run.checkpoint}")
    elif run.init_from is not None:
        (hot, weights), what = _warm_start(run, target), f"init_from {run.init_from}"
    else:
        hot = hot_token_ids(train, target.config.vocab_size, run.draft_vocab,
                            list(tokenizer.eos_token_ids))
    head = new_chat_head(target, hot.to(device), run.ffn, run.seed + 1, run.lm_head)
    if weights is not None:
        _copy_trained(head, weights, what)
        log(f"head: weights and draft vocabulary from {what}")
    return head


def _resume_state(run: RealHeadRun, target_id: dict | None) -> TrainState | None:
    """`run.checkpoint`'s state when `run.resume` (checked against the run's plan and target
    before any response is generated), else None; ValueError naming the flags when resume
    has no checkpoint."""
    if not run.resume:
        return None
    if run.checkpoint is None:
        raise ValueError("resume: needs --checkpoint DIR (the directory the first call wrote)")
    state = load_state(run.checkpoint)
    check_state(run.checkpoint, state, plan=plan_of(run), target=target_id)
    run.history[:] = state.record.get("history", [])
    return state


def train_real_head(run: RealHeadRun) -> dict:
    """The whole recipe of the module docstring -> the summary written as training.json."""
    log = RunLog()
    device = resolve_device(run.device)
    precision = resolve_precision(run.precision, device)
    gen = seed_everything(run.seed)
    target, tokenizer, target_dir = load_chat_target(run.target, device)
    phases = {"load_seconds": round(log.elapsed(), 1)}
    log(f"target: {target_dir} ({target.dtype}, {device})")
    check_head_size(run, target.config)
    keep = run.responses_cache is not None or run.checkpoint is not None
    target_id = target_identity(run.target) if keep else None
    state = _resume_state(run, target_id)
    prompts = training_prompts(run.code_prompts, run.prose_prompts, run.seed,
                               run.typed_problems, run.forms_per_function)
    phases["prompts_seconds"] = round(log.elapsed() - phases["load_seconds"], 1)
    log(f"prompts: {len(prompts)} built")
    gen_stop, train_stop = _deadlines(run, log)
    samples, data = _responses(run, target, tokenizer, prompts, target_id, gen, gen_stop, log)
    held, train = split_heldout(samples, run, gen)
    record = None
    if run.checkpoint is not None:
        record = {"target": target_id, "plan": plan_of(run), "responses": {
            "digest": samples_digest(samples), "heldout": held.prompt.tolist()}}
        if state is not None:
            check_state(run.checkpoint, state, plan=record["plan"], responses=record["responses"])
    head = _initial_head(run, target, train, tokenizer, state, log)
    labels = DraftLabels(head.hot_token_ids, target.config.vocab_size)
    data["draft_vocab_coverage"] = labels.coverage(train)
    n_params = sum(p.numel() for p in trained_parameters(head).values())
    log(f"head: {n_params:,} trained parameters, draft vocab {head.hot_token_ids.numel()} "
        f"(covers {data['draft_vocab_coverage']:.1%} of response tokens), LM head "
        f"{run.lm_head}, {head.config}")
    res = train_stage(run, target, head, labels, train, device, precision, gen, train_stop, log,
                      state, record)
    ev, size = _save(run, head, target, held, labels, precision, log)
    _sync(device)
    summary = _summary(run, target_dir, n_params, size, data, res, ev, held, phases, log,
                       device, precision, state)
    (Path(run.out) / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    log(f"head: wrote {run.out} ({res['steps']} steps, {res['seconds']:.1f} s, "
        f"{size:,} bytes of weights)")
    return summary


def _summary(run: RealHeadRun, target_dir: Path, n_params: int, size: int, data: dict,
             res: dict, ev: dict, held: Samples, phases: dict, log: RunLog,
             device: torch.device, precision: str, state: TrainState | None) -> dict:
    """training.json: the data, the run, the held-out agreement, each phase's seconds; a
    checkpointed run's steps and training seconds count every call ("steps_this_call")."""
    out = {"model": "eagle3_head", "target": str(run.target),
           "target_config": json.loads((target_dir / "config.json").read_text()),
           "parameters_trained": n_params, "safetensors_bytes": size, "data": data,
           "steps": res["next_step"], "epochs": res["epochs"], "tokens_seen": res["tokens_seen"],
           "ttt_steps": run.ttt_steps, "final_train_loss_ema": res["ema"], "heldout": ev,
           "heldout_sequences": int(held.ids.shape[0]),
           "train_seconds": round(res["seconds"], 1), "train_cap_minutes": res["cap_minutes"],
           "first_step_seconds": _round(res["first_step_seconds"]),
           "stopped_by": res["stopped_by"], **phases,
           "wall_seconds": round(log.elapsed(), 1), "device": str(device),
           "precision": precision, "hardware": _hardware(device),
           "python": platform.python_version(), "run": asdict(run)}
    if run.checkpoint is not None or state is not None:
        out |= {"steps_this_call": res["steps"], "resumed_from_step": state.step if state else 0,
                "trained_seconds_all_calls": round(res["trained_seconds"], 1)}
    return out


GPU_RECIPE = {"device": "cuda", "code_prompts": 40000, "forms_per_function": 6,
              "typed_problems": 4000, "prose_prompts": 12000, "responses_per_prompt": 2,
              "gen_batch": 512, "gen_max_minutes": 2.25, "lm_head": "target",
              "draft_vocab": 8192, "ffn": 768, "max_head_bytes": 7_850_000, "ttt_steps": 5,
              "batch": 64, "batch_tokens": 16384, "steps": 100000, "lr": 1.5e-3, "warmup": 200,
              "max_minutes": 6.6, "deadline_minutes": 9.2, "compile": False, "log_every": 250}
"""One GPU, at most 9.2 minutes from the start (loading included; convert the GGUF before):
responses for up to 2.25 minutes (encoding and the engine's capture included; CUDA graphs, 512
live) to every stdlib function in HumanEval's form and 5 more forms, 4,000 typed problems and
the prose prompts, then training until the deadline (6.6 minutes at most); the held-out
evaluation and the save fit in the rest. The head: LM head from the target (`lm_head`
"target": not stored, so a draft id costs 8 bytes, not a 1,160-byte LM-head row), draft
vocabulary 8,192 (97.6 % of SmolLM2's response tokens; the head shipped before, 1,536 ids
with an own LM head and MLP 192, covered 84.3 %), MLP 768. The shipped assets must stay under
20 MB in all, the other assets take 12.1 MB, so this head's weights may take 7.85 MB
(`max_head_bytes`): 8,192 ids and MLP 768 predict 7,641,600 bytes, MLP 832 would be 7,862,784.
The shipped `graphdraft/assets/smollm2-eagle3` is this recipe's run of 2026-12-07 on one H100
with `--deadline-minutes 8` (5.67 minutes of training): held-out expected accept 2.54 at 3
steps against the head shipped before's 2.25 (`MODEL_CARD.md` beside it)."""
CPU_SMOKE_RECIPE = {"device": "cpu", "code_prompts": 6, "typed_problems": 2, "prose_prompts": 6,
                    "max_new_tokens": 12, "max_prompt_tokens": 200, "gen_batch": 8, "batch": 4,
                    "batch_tokens": 512,
                    "steps": 4, "draft_vocab": 96, "ffn": 64, "ttt_steps": 3, "log_every": 1,
                    "warmup": 2, "compile": False, "save_dtype": "float32"}
"""A CPU smoke run (tests, tiny targets): a few prompts and steps, nothing learned."""
REAL_RECIPES = {"gpu": GPU_RECIPE, "cpu-smoke": CPU_SMOKE_RECIPE}


def main(argv: list[str] | None = None) -> int:
    """`python -m graphdraft.train real --target T --out DIR [--recipe gpu] [--FIELD VALUE]`."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m graphdraft.train real",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="converted target directory or .gguf file")
    ap.add_argument("--out", required=True, help="directory for the head")
    ap.add_argument("--recipe", choices=sorted(REAL_RECIPES), default="gpu")
    ap.add_argument("--resume", action="store_true",
                    help="go on from --checkpoint DIR's training state (graphdraft.train.resume)")
    skip = {"target", "out", "history", "resume"}
    fields = {f.name: f for f in dataclasses.fields(RealHeadRun) if f.name not in skip}
    for name, f in fields.items():
        kind = {int: int, float: float, str: str, bool: int}.get(type(f.default), float)
        if f.default is None and str(f.type).startswith(("str", "int")):
            kind = str if str(f.type).startswith("str") else int  # (other None defaults: float)
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                        help=f"default {f.default!r} (the recipe may set it)")
    a = ap.parse_args(argv)
    values = dict(REAL_RECIPES[a.recipe], resume=a.resume)
    values |= {k: getattr(a, k) for k in fields if getattr(a, k) is not None}
    for k in ("compile", "gen_graphs"):
        if k in values:
            values[k] = bool(values[k])
    train_real_head(RealHeadRun(target=a.target, out=a.out, **values))
    return 0
