"""Train the shipped byte-level model pair: a small Llama target, then its EAGLE-3 head.

Target: next-byte cross-entropy on random 256-byte windows of the stdlib corpus
(`graphdraft.train.data`), AdamW, fp32, linear warm-up then cosine decay.
Head: the target frozen; the head's training-time test (`forward.head_ttt_forward`)
unrolled `--ttt-steps` steps over every position of each window; loss = cross-entropy
against the target's soft labels (its softmax at the position the step predicts; `--hard-labels`:
its greedy token instead), step k weighted `decay ** (k - 1)`. The head shares (and does
not train) the target's embedding; its LM head and final norm start from the target's.
`lm_head` "target" (`--lm-head target`): the LM head IS the target's (frozen, not in the
optimizer, not saved; the checkpoint's config says `graphdraft_lm_head: "target"` and the
loader gathers the target's rows again).

Both write graphdraft checkpoints (`graphdraft.io.checkpoint.save_target` / `save_eagle3_head`)
and a `training.json` summary next to the weights.

Devices: `device` "auto" (CUDA when available), "cpu" or "cuda". The master weights and the
optimizer state are fp32 everywhere; `precision` "auto" is bf16 autocast on CUDA (the
forward and backward's matmuls and attention in bf16) and plain fp32 on the CPU; "tf32" (CUDA)
keeps fp32 tensors with TF32 matmuls; "bf16" works on the CPU too. Batches are sampled on the
host (the same seeded generator on every device) and copied with non_blocking from pinned
memory; the loop does not synchronise with the device except at its log steps.

Time caps (`max_minutes`) bound a stage's wall time, the first step's torch.compile warm-up
included; with a cap the learning-rate schedule follows the larger of the step fraction and
the time fraction, counted from the end of that first step (a slow compile then shortens the
run instead of spending the schedule's high-learning-rate part).
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from graphdraft.config import ModelConfig
from graphdraft.io.bytes_tokenizer import BOS_ID, CONFIG_KEY, EOS_ID, VOCAB_SIZE
from graphdraft.io.checkpoint import load_eagle3_head, load_target, save_eagle3_head, save_target
from graphdraft.models.eagle3 import LM_HEAD_SOURCES, Eagle3DraftHead
from graphdraft.models.llama import LlamaForCausalLM
from graphdraft.train.data import Corpus, eval_windows, load_corpus, sample_windows
from graphdraft.train.forward import head_ttt_forward, target_forward

SUMMARY_NAME = "training.json"


def target_config(hidden: int = 256, layers: int = 6, heads: int = 8, kv_heads: int = 4,
                  ffn: int = 768, context: int = 256,
                  aux_layer_ids: tuple[int, ...] = (1, 3, 5)) -> ModelConfig:
    return ModelConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=hidden // heads, intermediate_size=ffn, num_hidden_layers=layers,
                       vocab_size=VOCAB_SIZE, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=context, tie_word_embeddings=False,
                       aux_hidden_state_layer_ids=aux_layer_ids)


def head_config(target: ModelConfig, ffn: int = 768) -> ModelConfig:
    """Same attention shape as the target, one layer, the full vocab (no draft vocab / d2t)."""
    return target.replace(num_hidden_layers=1, intermediate_size=ffn, draft_vocab_size=None)


DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "bf16", "tf32", "fp32")


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """"auto" (or None): cuda when available, else cpu; "cuda" without a GPU raises."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected one of {DEVICES}, got {name!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: no CUDA device (torch.cuda.is_available() is False)")
    return dev


def resolve_precision(name: str, device: torch.device) -> str:
    """"auto": bf16 autocast on CUDA, fp32 on the CPU. "tf32" needs CUDA."""
    if name not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {name!r}")
    if name == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if name == "tf32" and device.type != "cuda":
        raise ValueError("precision 'tf32': a CUDA device only (use fp32 or bf16 on the CPU)")
    return name


def autocast(precision: str, device: torch.device):
    """bf16 autocast around a training forward (fp32 master weights), else a no-op."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


@contextlib.contextmanager
def matmul_precision(precision: str):
    """TF32 matmuls inside the block for "tf32" (restored on exit); nothing otherwise."""
    if precision != "tf32":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


_pinning = {"ok": True}


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built batch on `device`: pinned and copied non_blocking on CUDA (a plain copy
    if pinning host memory fails)."""
    if device.type != "cuda":
        return batch.to(device)
    if _pinning["ok"]:
        try:
            return batch.pin_memory().to(device, non_blocking=True)
        except RuntimeError as e:
            _pinning["ok"] = False
            print(f"pinned host memory unavailable ({_first_line(e)}): plain copies", flush=True)
    return batch.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def init_for_training_(module: torch.nn.Module, seed: int, num_layers: int,
                       std: float = 0.02) -> None:
    """Norm weights 1; matrices N(0, std), residual-branch outputs (o, down) N(0, std/sqrt(2L))."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        if p.ndim == 1:
            p.fill_(1.0)
            continue
        s = std / math.sqrt(2 * num_layers) if name.endswith(("o_proj", "down_proj")) else std
        p.copy_(torch.randn(p.shape, generator=gen) * s)


def _optimizer(params: dict[str, torch.nn.Parameter], lr: float, wd: float,
               device: torch.device | None = None) -> torch.optim.AdamW:
    decay = [p for n, p in params.items() if p.ndim == 2 and "embed" not in n]
    rest = [p for n, p in params.items() if not (p.ndim == 2 and "embed" not in n)]
    fused = {"fused": True} if device is not None and device.type == "cuda" else {}
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, **fused)


def _lr_at(step: int, steps: int, lr: float, warmup: int,
           time_fraction: float | None = None) -> float:
    """Linear warm-up, then cosine decay to lr/10 over the run's progress: the step's fraction
    of `steps`, or (with a time cap) the larger of that and `time_fraction` (`_Clock`)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    if time_fraction is not None:
        t = max(t, time_fraction)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


class _Clock:
    """A stage's wall clock: its time cap and the schedule's time fraction.

    The cap counts from the stage's first step, the torch.compile warm-up included, so it
    bounds the stage's wall time (the first step always runs, however long it takes). The fraction counts from the end of that first step to the
    cap, so the learning-rate schedule spans the steps that actually train.

    `total_minutes` (a training spread over several calls, `LoopStart`): the fraction is
    instead the training seconds of every call so far (`trained_seconds` before this one,
    then this call's, its first step included) over `total_minutes`, whatever this call's cap.
    """

    def __init__(self, max_minutes: float | None, trained_seconds: float = 0.0,
                 total_minutes: float | None = None) -> None:
        self.t0 = time.perf_counter()
        self.cap = None if max_minutes is None else 60.0 * max_minutes
        self.t_first: float | None = None
        self.before = trained_seconds
        self.total = None if total_minutes is None else 60.0 * total_minutes

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def trained(self) -> float:
        """Training seconds of every call so far, this one's included."""
        return self.before + self.elapsed()

    def first_step_done(self) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()

    def expired(self) -> bool:
        return self.cap is not None and self.elapsed() > self.cap

    def total_reached(self) -> bool:
        return self.total is not None and self.trained() >= self.total

    def fraction(self) -> float | None:
        if self.total is not None:
            return min(1.0, self.trained() / self.total)
        if self.cap is None or self.t_first is None:
            return None
        left = self.t0 + self.cap - self.t_first
        return 1.0 if left <= 0 else (time.perf_counter() - self.t_first) / left


@dataclass
class LoopStart:
    """Where `_train_loop` starts and how far one call goes: the defaults are a whole run in
    one call; a run spread over several calls (`graphdraft.train.resume`) starts each later
    call where the checkpoint of the one before stopped."""

    step: int = 0
    """The first step's index (steps 0 .. step - 1 ran in earlier calls)."""
    ema: float | None = None
    """The loss EMA the earlier calls ended with (None: none ran)."""
    trained_seconds: float = 0.0
    """Training seconds of the earlier calls (`_Clock`)."""
    total_minutes: float | None = None
    """Training minutes the schedule's time fraction spans over every call, which stop once
    they are reached (None: this call's time cap, as a run of one call)."""
    call_steps: int | None = None
    """Steps this call runs at most (None: up to the run's `steps`)."""


def _hardware(device: torch.device | None = None) -> str:
    import os
    host = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if device is not None and device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}); host: {host}"
    return host


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _stop_reason(clock: _Clock, done: int, run) -> tuple[str, str] | None:
    """Why the loop stops before its next step, (record, words): the schedule's total
    training time reached, or this call's time cap (never before this call's first step);
    None: it goes on."""
    if clock.total_reached():
        return "total minutes", f"the schedule's {clock.total / 60:g} training minutes are reached"
    if done and clock.expired():  # the first step always runs
        return "time cap", f"the time cap ({run.max_minutes} min) is reached"
    return None


def _log_step(tag: str, step: int, loss, ema, lr: float, extra, clock: _Clock, run,
              last: tuple[float, int], tokens_per_step: int) -> tuple[float, int]:
    """One progress line and its `run.history` entry (`loss.item()`: the loop's only sync);
    the rate since `last` (seconds, step of the line before) -> this line's (seconds, step)."""
    lv, ev = loss.item(), ema.item()
    el = clock.elapsed()
    last_t, last_step = last
    rate = ((step - last_step) * tokens_per_step / (el - last_t)
            if step > 0 and el > last_t else None)
    entry = {"step": step, "loss": round(lv, 4), "ema_loss": round(ev, 4),
             "lr": float(f"{lr:.3e}"), "seconds": round(el, 1)}
    line = f"{tag} step {step:5d}  loss {lv:.4f}  ema {ev:.4f}  lr {lr:.2e}"
    if extra is not None:
        accs = extra.tolist()
        entry["step_top1"] = [round(a, 3) for a in accs]
        line += f"  top1/step {' '.join(f'{a:.3f}' for a in accs)}"
    if rate is not None:
        entry["tokens_per_s"] = round(rate)
        line += f"  {rate:,.0f} tok/s"
    run.history.append(entry)
    print(f"{line}  {el:7.1f} s", flush=True)
    return el, step


def _train_loop(tag: str, run, device: torch.device, params: dict[str, torch.nn.Parameter],
                opt: torch.optim.Optimizer, loss_fn, eager_loss_fn, next_batch,
                tokens_per_step: int, start: LoopStart | None = None) -> dict:
    """The shared optimisation loop of both stages.

    `loss_fn(batch)` -> (loss, per-step agreement or None); `eager_loss_fn` is the same
    function uncompiled: if the compiled one fails on the first step (forward or backward),
    the loop says so and trains eagerly. Syncs with the device only at log steps (and after
    the first step, to time the warm-up). `start` (`LoopStart`; None: a fresh run of one
    call): the first step's index, the EMA and training time so far, the schedule's total
    minutes and this call's step cap. -> steps (this call's), final EMA loss, seconds, first-step
    seconds, why it stopped, the next step's index and the training seconds of every call.
    """
    start = start or LoopStart()
    clock = _Clock(run.max_minutes, start.trained_seconds, start.total_minutes)
    fn = loss_fn
    ema = None if start.ema is None else torch.tensor(start.ema, device=device)
    done, stop, first_s = 0, "steps", None
    last = (0.0, start.step - 1)  # the last progress line's seconds and step
    end = run.steps if start.call_steps is None else min(run.steps, start.step + start.call_steps)
    for step in range(start.step, end):
        why = _stop_reason(clock, done, run)
        if why is not None:
            stop = why[0]
            print(f"{tag}: stopping at step {step}: {why[1]}", flush=True)
            break
        lr = _lr_at(step, run.steps, run.lr, run.warmup, clock.fraction())
        for g in opt.param_groups:
            g["lr"] = lr
        batch = next_batch()
        try:
            loss, extra = fn(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except Exception as e:  # noqa: BLE001 -- only a first compiled step falls back
            if fn is eager_loss_fn or done:
                raise
            print(f"{tag}: torch.compile failed on the first step ({_first_line(e)}); "
                  f"training eagerly", flush=True)
            fn = eager_loss_fn
            opt.zero_grad(set_to_none=True)
            loss, extra = fn(batch)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        done += 1
        ld = loss.detach().float()
        ema = ld.clone() if ema is None else ema.mul_(0.95).add_(ld, alpha=0.05)
        if done == 1:
            _sync(device)
            clock.first_step_done()
            first_s = clock.elapsed()
            print(f"{tag}: first step {first_s:.1f} s"
                  f"{' (torch.compile warm-up)' if fn is not eager_loss_fn else ''}", flush=True)
        if step % run.log_every == 0 or step == run.steps - 1:
            last = _log_step(tag, step, loss, ema, lr, extra, clock, run, last, tokens_per_step)
    else:
        stop = "steps" if end == run.steps else "call steps"
    _sync(device)
    final = None if ema is None else ema.item()
    return {"steps": done, "ema": final, "seconds": clock.elapsed(), "first_step_seconds": first_s,
            "stopped_by": stop, "compiled": fn is not eager_loss_fn,
            "next_step": start.step + done, "trained_seconds": clock.trained()}


@dataclass
class TargetRun:
    seed: int = 0
    steps: int = 1200
    batch: int = 16
    context: int = 256
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup: int = 15
    max_minutes: float | None = None
    compile: bool = True
    eval_windows: int = 64
    log_every: int = 10
    out: str = "graphdraft/assets/target"
    save_dtype: str = "bfloat16"
    device: str = "auto"
    """"auto" (CUDA when available), "cpu" or "cuda"."""
    precision: str = "auto"
    """"auto" (bf16 autocast on CUDA, fp32 on the CPU), "bf16", "tf32" (CUDA) or "fp32"."""
    history: list = field(default_factory=list)


@dataclass(kw_only=True)
class HeadTraining:
    """The settings every EAGLE-3 head training run shares (`HeadRun`: the byte-level pair's
    head; `graphdraft.train.real.RealHeadRun`: a pretrained chat target's), read by
    `_train_loop`, the TTT loss and the saver. Defaults: the byte-level head's CPU run."""

    seed: int = 0
    steps: int = 600
    batch: int = 16
    """Sequences per step (`RealHeadRun`: at most this many, within `batch_tokens`)."""
    ttt_steps: int = 3
    """Training-time test steps unrolled per start position."""
    decay: float = 0.8
    """Step k's loss weight is decay ** (k - 1)."""
    ffn: int = 768
    """The head's MLP width."""
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup: int = 10
    max_minutes: float | None = None
    """The training loop's time cap (the first step's compile warm-up included)."""
    compile: bool = True
    log_every: int = 10
    save_dtype: str = "bfloat16"
    device: str = "auto"
    """"auto" (CUDA when available), "cpu" or "cuda"."""
    precision: str = "auto"
    """"auto" (bf16 autocast on CUDA, fp32 on the CPU), "bf16", "tf32" (CUDA) or "fp32"."""
    lm_head: str = "own"
    """"own": the head's LM head starts from the target's rows and is trained and saved;
    "target": it is the target's rows of the draft vocabulary, frozen (not in the optimizer)
    and not saved (the config's `graphdraft_lm_head: "target"`: the loader gathers them), so
    the draft vocabulary costs no LM-head bytes."""
    history: list = field(default_factory=list)
    """The loop's log entries (filled while training)."""

    def __post_init__(self) -> None:
        if self.lm_head not in LM_HEAD_SOURCES:
            raise ValueError(f"lm_head: expected one of {LM_HEAD_SOURCES}, got {self.lm_head!r}")


@dataclass(kw_only=True)
class HeadRun(HeadTraining):
    """The byte-level pair's head: corpus windows of `context` bytes (and a pool of the
    target's own continuations)."""

    context: int = 256
    hard_labels: bool = False
    eval_windows: int = 64
    target: str = "graphdraft/assets/target"
    out: str = "graphdraft/assets/eagle3"
    generated: int = 0
    """Sequences in the self-distillation pool: a training window's first 16..192 bytes then
    the target's greedy continuation up to `context` (0: train on corpus windows only)."""
    generated_fraction: float = 0.75
    """Share of each batch drawn from the pool (the rest: corpus windows)."""
    init_from: str | None = None
    """Start from this head checkpoint instead of a fresh initialisation."""
    pool_chunk: int | None = None
    """Requests the pool's Engine runs at once (None: 64 on the CPU, 512 on CUDA)."""
    pool_max_minutes: float | None = None
    """Stop generating the pool after the chunk that passes this (the pool is then smaller)."""


# ---------------------------------------------------------------------------
# Target
# ---------------------------------------------------------------------------
@torch.no_grad()
def eval_target(model: LlamaForCausalLM, windows: torch.Tensor, batch: int = 16) -> dict:
    """Held-out next-byte loss (nats), bits per byte and top-1 accuracy (targets: bytes/EOS)."""
    tot_loss, tot_ok, n = 0.0, 0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i: i + batch]
        logits, _ = target_forward(model, w[:, :-1], capture_aux=False)
        y = w[:, 1:]
        keep = y != BOS_ID  # a document's first byte is unpredictable from the previous one
        tot_loss += F.cross_entropy(logits[keep], y[keep], reduction="sum").item()
        tot_ok += (logits.argmax(-1)[keep] == y[keep]).sum().item()
        n += int(keep.sum())
    return {"loss": tot_loss / n, "bits_per_byte": tot_loss / n / math.log(2),
            "top1_accuracy": tot_ok / n, "tokens": n}


def train_target(run: TargetRun, corpus: Corpus | None = None) -> dict:
    device = resolve_device(run.device)
    precision = resolve_precision(run.precision, device)
    gen = seed_everything(run.seed)
    corpus = corpus or load_corpus()
    print(f"corpus: {corpus.describe()}", flush=True)
    cfg = target_config(context=run.context)
    model = LlamaForCausalLM(cfg, torch.float32)
    init_for_training_(model, run.seed, cfg.num_hidden_layers)  # on the host: same on any device
    model = model.to(device)
    params = dict(model.named_parameters())
    for p in params.values():
        p.requires_grad_(True)
    n_params = sum(p.numel() for p in params.values())
    print(f"target: {n_params:,} parameters, {cfg}", flush=True)
    print(f"target: device {device}, precision {precision}, batch {run.batch} x {run.context}, "
          f"{run.steps} steps, cap {run.max_minutes} min, compile {run.compile}", flush=True)
    opt = _optimizer(params, run.lr, run.weight_decay, device)
    held = eval_windows(corpus.heldout, run.eval_windows, run.context + 1)

    def loss_fn(w: torch.Tensor):
        with autocast(precision, device):
            logits, _ = target_forward(model, w[:, :-1], capture_aux=False)
        return F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), w[:, 1:].reshape(-1)), None

    def next_batch() -> torch.Tensor:
        return to_device(sample_windows(corpus.train, run.batch, run.context + 1, gen), device)

    step_fn = torch.compile(loss_fn) if run.compile else loss_fn
    with matmul_precision(precision):
        res = _train_loop("target", run, device, params, opt, step_fn, loss_fn, next_batch,
                          run.batch * run.context)
    for p in params.values():
        p.requires_grad_(False)
    # ship in save_dtype, and report what ships: evaluate the rounded weights (fp32 compute)
    shipped = _round_trip(model, run.save_dtype)
    ev = eval_target(shipped.to(device), held.to(device))
    print(f"target held-out ({run.save_dtype} weights): {ev}", flush=True)
    out = Path(run.out)
    save_target(_cast_target(shipped, _dtype(run.save_dtype)), out, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    mark_byte_tokenizer(out)
    summary = {"model": "target", "parameters": n_params, "config": _cfg_dict(cfg),
               "steps": res["steps"], "tokens_seen": res["steps"] * run.batch * run.context,
               "final_train_loss_ema": res["ema"], "heldout": ev,
               "wall_seconds": round(res["seconds"], 1),
               "first_step_seconds": _round(res["first_step_seconds"]),
               "stopped_by": res["stopped_by"], "compiled": res["compiled"],
               "device": str(device), "precision": precision, "hardware": _hardware(device),
               "python": platform.python_version(), "corpus": corpus.describe(), "run": asdict(run)}
    _write_summary(out, summary)
    print(f"target: wrote {out} ({res['steps']} steps, {res['seconds']:.1f} s)", flush=True)
    return summary


# ---------------------------------------------------------------------------
# Head
# ---------------------------------------------------------------------------
def trained_parameters(head: Eagle3DraftHead) -> dict[str, torch.nn.Parameter]:
    """The head's parameters an optimizer trains: all but the embedding (the target's, shared)
    and, when `head.lm_head_source` is "target", the LM head (the target's rows, frozen)."""
    frozen = {"embed_tokens"} | ({"lm_head"} if head.lm_head_source == "target" else set())
    return {n: p for n, p in head.named_parameters() if n not in frozen}


def ttt_loss(step_logits: list[torch.Tensor], greedy: torch.Tensor, decay: float,
             probs: torch.Tensor | None = None, mask: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The training-time test's loss and each step's top-1 agreement with the target.

    Step k's logits `[B, L-1, Vh]` at chain t predict position t+k+1, labelled at t+k:
    `greedy` `[B, L]` (the target's greedy token as a head id; -1: none) and, for soft
    labels, `probs` `[B, L, Vh]` (the target's softmax over the head's vocabulary; None: the
    cross-entropy against `greedy`). `mask` `[B, L]` (None: every position) keeps the labels
    that count. Step k's mean over the kept positions is weighted `decay ** (k - 1)`.
    -> (loss, agreement `[steps]`).
    """
    length = greedy.shape[1]
    total, accs = 0.0, []
    for k, lg in enumerate(step_logits, start=1):
        pred, g = lg[:, : length - k].float(), greedy[:, k:]
        if probs is None:
            ce = F.cross_entropy(pred.transpose(1, 2), g, ignore_index=-1, reduction="none")
        else:
            ce = -(probs[:, k:] * torch.log_softmax(pred, -1)).sum(-1)
        hit = (pred.argmax(-1) == g).float()
        if mask is None:
            total = total + decay ** (k - 1) * ce.mean()
            accs.append(hit.mean())
            continue
        m = mask[:, k:].float()
        denom = m.sum().clamp_min(1.0)
        total = total + decay ** (k - 1) * (ce * m).sum() / denom
        accs.append((hit * m).sum() / denom)
    return total, torch.stack(accs).detach()


@torch.no_grad()
def eval_head(target: LlamaForCausalLM, head: Eagle3DraftHead, windows: torch.Tensor,
              ttt_steps: int, batch: int = 16) -> dict:
    """Per-step top-1 agreement with the target's greedy token on held-out windows, and the
    chain's expected accept length `1 + sum_k P(steps 1..k all agree)` (3 steps)."""
    oks = [[] for _ in range(ttt_steps)]
    for i in range(0, windows.shape[0], batch):
        w = windows[i: i + batch]
        tl, aux = target_forward(target, w)
        outs = head_ttt_forward(head, w, aux, ttt_steps)
        length = tl.shape[1]
        n = length - ttt_steps  # chains with every step labelled
        for k, lg in enumerate(outs, start=1):
            oks[k - 1].append(lg[:, :n].argmax(-1) == tl[:, k: k + n].argmax(-1))
    ok = [torch.cat(o) for o in oks]
    acc = [o.float().mean().item() for o in ok]
    chain = torch.cumprod(torch.stack(ok, -1).float(), -1)  # [.., steps]: all agree up to k
    accept = {f"steps_{s}": 1 + chain[..., :s].sum(-1).mean().item()
              for s in range(1, ttt_steps + 1)}
    return {"step_top1_agreement": acc, "expected_accept_length": accept}


def new_head(target: LlamaForCausalLM, cfg: ModelConfig, seed: int,
             lm_head: str = "own") -> Eagle3DraftHead:
    """A freshly initialised fp32 head sharing (not copying) the target's embedding; its LM
    head and final norm start from the target's (`lm_head` "target": the LM head is the
    target's, `Eagle3DraftHead.tie_lm_head_`, frozen).

    Built with its own embedding, initialised, then given the target's: constructed around
    `target.embed_tokens.data`, the initialisation would overwrite the target's embedding in
    place (the two parameters would share storage).
    """
    head = Eagle3DraftHead(cfg, torch.float32)
    init_for_training_(head, seed, 1)  # on the host: the same on any device
    head = head.to(target.embed_tokens.device)
    with torch.no_grad():
        head.lm_head.copy_(target.lm_head)
        head.norm.weight.copy_(target.norm.weight)
    if lm_head == "target":
        head.tie_lm_head_(target.lm_head)
    head.embed_tokens = target.embed_tokens  # shared (and frozen), as the loader shares it
    return head


def _initial_head(run: HeadRun, target: LlamaForCausalLM, cfg: ModelConfig) -> Eagle3DraftHead:
    """The head training starts from: `run.init_from`'s (shaped `cfg`) or a new one; with
    `run.lm_head` "target" its LM head is the target's (frozen), whatever it started as."""
    if run.init_from is None:
        return new_head(target, cfg, run.seed + 1, run.lm_head)
    head = load_eagle3_head(run.init_from, target=target)
    if head.config.replace(draft_vocab_size=None) != cfg:  # the saver writes Vd = V
        raise ValueError(f"--init-from {run.init_from}: expected a head shaped {cfg}, "
                         f"got {head.config}")
    if run.lm_head == "target":
        head.tie_lm_head_(target.lm_head)
    print(f"head: starting from {run.init_from}", flush=True)
    return head


def _self_distillation_pool(run: HeadRun, target: LlamaForCausalLM, corpus: Corpus,
                            gen: torch.Generator) -> tuple[torch.Tensor | None, float]:
    """(`run.generated` target continuations `[n, context]` or None, seconds spent)."""
    if not run.generated:
        return None, 0.0
    t_gen = time.perf_counter()
    pool = generate_pool(target, corpus.train, run.generated, run.context, gen,
                         chunk=run.pool_chunk, max_minutes=run.pool_max_minutes)
    pool_seconds = time.perf_counter() - t_gen
    print(f"self-distillation pool: {pool.shape[0]} sequences of {pool.shape[1]} tokens in "
          f"{pool_seconds:.1f} s", flush=True)
    return pool, pool_seconds


def train_head(run: HeadRun, corpus: Corpus | None = None) -> dict:
    device = resolve_device(run.device)
    precision = resolve_precision(run.precision, device)
    gen = seed_everything(run.seed)
    corpus = corpus or load_corpus()
    print(f"corpus: {corpus.describe()}", flush=True)
    # the target as shipped (its rounded weights), fp32 parameters
    target, _ = load_target(run.target, torch.float32, device)
    tc = target.config
    cfg = head_config(tc, ffn=run.ffn)
    head = _initial_head(run, target, cfg)
    pool, pool_seconds = _self_distillation_pool(run, target, corpus, gen)
    n_gen = round(run.batch * run.generated_fraction) if pool is not None else 0
    params = trained_parameters(head)
    for p in params.values():
        p.requires_grad_(True)
    n_params = sum(p.numel() for p in params.values())
    frozen = "embedding" + (" and LM head" if head.lm_head_source == "target" else "")
    print(f"head: {n_params:,} trained parameters ({frozen} the target's, frozen), {cfg}",
          flush=True)
    print(f"head: device {device}, precision {precision}, batch {run.batch} x {run.context} "
          f"({n_gen} from the pool), {run.steps} steps, cap {run.max_minutes} min, "
          f"compile {run.compile}", flush=True)
    opt = _optimizer(params, run.lr, run.weight_decay, device)
    held = eval_windows(corpus.heldout, run.eval_windows, run.context)

    def teacher(w: torch.Tensor):
        with autocast(precision, device):
            return target_forward(target, w)

    def loss_fn(w: torch.Tensor, tl: torch.Tensor, aux: torch.Tensor):
        with autocast(precision, device):
            outs = head_ttt_forward(head, w, aux, run.ttt_steps)
        greedy = tl.argmax(-1)
        probs = None if run.hard_labels else torch.softmax(tl.float(), -1)
        return ttt_loss(outs, greedy, run.decay, probs)

    def make_step(teach, lossf):
        def step(w: torch.Tensor):
            with torch.no_grad():
                tl, aux = teach(w)
            return lossf(w, tl, aux)
        return step

    def next_batch() -> torch.Tensor:
        w = sample_windows(corpus.train, run.batch - n_gen, run.context, gen)
        if n_gen:
            w = torch.cat([w, pool[torch.randint(0, pool.shape[0], (n_gen,), generator=gen)]])
        return to_device(w, device)

    eager = make_step(teacher, loss_fn)
    step_fn = make_step(torch.compile(teacher), torch.compile(loss_fn)) if run.compile else eager
    with matmul_precision(precision):
        res = _train_loop("head", run, device, params, opt, step_fn, eager, next_batch,
                          run.batch * run.context)
    for p in params.values():
        p.requires_grad_(False)
    shipped = _round_trip_head(head, target, run.save_dtype)
    ev = eval_head(target, shipped, held.to(device), run.ttt_steps)
    print(f"head held-out ({run.save_dtype} weights): {ev}", flush=True)
    out = Path(run.out)
    save_eagle3_head(_cast_head(shipped, target, run.save_dtype), out)
    summary = {"model": "eagle3_head", "parameters_trained": n_params, "config": _cfg_dict(cfg),
               "steps": res["steps"], "ttt_steps": run.ttt_steps,
               "final_train_loss_ema": res["ema"], "heldout": ev,
               "wall_seconds": round(res["seconds"], 1),
               "first_step_seconds": _round(res["first_step_seconds"]),
               "stopped_by": res["stopped_by"], "compiled": res["compiled"],
               "pool_sequences": 0 if pool is None else pool.shape[0],
               "pool_seconds": round(pool_seconds, 1),
               "device": str(device), "precision": precision, "hardware": _hardware(device),
               "python": platform.python_version(), "corpus": corpus.describe(), "run": asdict(run)}
    _write_summary(out, summary)
    print(f"head: wrote {out} ({res['steps']} steps, {res['seconds']:.1f} s)", flush=True)
    return summary


@torch.no_grad()
def generate_pool(target: LlamaForCausalLM, ids: torch.Tensor, count: int, context: int,
                  gen: torch.Generator, min_prompt: int = 16, max_prompt: int = 192,
                  chunk: int | None = None, max_minutes: float | None = None) -> torch.Tensor:
    """`[n, context]` sequences (n = count, fewer when `max_minutes` stops it early): a random
    corpus window's first 16..192 ids, then the target's greedy continuation, through
    graphdraft's own `Engine` on the target's device (float32 target: CPU or CUDA, the torch
    kernel path, eager). `chunk` requests run at once (None: 64 on the CPU, 512 on CUDA)."""
    from graphdraft.config import RuntimeConfig
    from graphdraft.serving.engine import Engine
    from graphdraft.serving.verify import SamplingParams

    device = target.embed_tokens.device
    cuda = device.type == "cuda"
    chunk = min(count, chunk or (512 if cuda else 64))
    max_prompt = min(max_prompt, context - min_prompt)
    lens = torch.randint(min_prompt, max_prompt + 1, (count,), generator=gen).tolist()
    windows = sample_windows(ids, count, max_prompt, gen)
    prompts = [windows[i, :n].tolist() for i, n in enumerate(lens)]
    rc = RuntimeConfig(speculative_num_steps=1, page_size=16, max_running_requests=chunk,
                       max_context_len=context + 8,
                       max_num_batched_tokens=8192 if cuda else 4096,
                       cuda_graph_max_bs=chunk, dtype="float32", device=str(device),
                       kernel_backend="torch", enforce_eager=True, validate_inputs=False)
    if target.dtype != torch.float32:
        raise ValueError(f"generate_pool: expected a float32 target, got {target.dtype}")
    if target.config.max_position_embeddings < rc.max_context_len:  # RoPE table only
        target = _with_longer_rope(target, rc.max_context_len)
    eng = Engine(target, rc)
    out = []
    t0 = time.perf_counter()
    for i in range(0, count, chunk):
        if max_minutes is not None and out and time.perf_counter() - t0 > 60 * max_minutes:
            print(f"self-distillation pool: stopping at {len(out)} of {count} sequences: "
                  f"the time cap ({max_minutes} min) is reached", flush=True)
            break
        ps = prompts[i: i + chunk]
        params = [SamplingParams(max_new_tokens=context - len(p), ignore_eos=True) for p in ps]
        outs = eng.generate(ps, params)
        out += [torch.tensor(p + o[: context - len(p)]) for p, o in zip(ps, outs, strict=True)]
        print(f"self-distillation pool: {len(out)} of {count} sequences, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    return torch.stack(out)


def _with_longer_rope(model: LlamaForCausalLM, positions: int) -> LlamaForCausalLM:
    """The same weights with a RoPE table of `positions` rows (the engine reserves look-ahead
    slots past the context; generation itself stays within it)."""
    cfg = model.config.replace(max_position_embeddings=positions)
    out = LlamaForCausalLM(cfg, model.dtype)
    out.load_state_dict(model.state_dict())
    return out.to(model.embed_tokens.device)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------
def _dtype(name: str) -> torch.dtype:
    from graphdraft.config import resolve_dtype
    return resolve_dtype(name)


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


def _cfg_dict(cfg: ModelConfig) -> dict:
    d = asdict(cfg)
    d["aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids())
    return d


@torch.no_grad()
def _cast_target(model: LlamaForCausalLM, dtype: torch.dtype) -> LlamaForCausalLM:
    """A host copy of `model` in `dtype`."""
    out = LlamaForCausalLM(model.config, dtype)
    for (_, dst), (_, src) in zip(out.named_parameters(), model.named_parameters(), strict=True):
        dst.copy_(src.detach().to(dtype))
    return out


def _round_trip(model: LlamaForCausalLM, dtype: str) -> LlamaForCausalLM:
    """An fp32 copy of `model` whose weights went through `dtype` (what the checkpoint holds)."""
    return _cast_target(_cast_target(model, _dtype(dtype)), torch.float32)


@torch.no_grad()
def _round_trip_head(head: Eagle3DraftHead, target: LlamaForCausalLM, dtype: str) -> Eagle3DraftHead:
    """An fp32 copy of `head` whose weights went through `dtype`, on the target's device,
    sharing the target's embedding (an LM head taken from the target: copied as is, the
    loader gathers it again in the target's dtype)."""
    out = Eagle3DraftHead(head.config, torch.float32, lm_head_source=head.lm_head_source)
    for (n, dst), (_, src) in zip(out.named_parameters(), head.named_parameters(), strict=True):
        if n == "lm_head" and head.lm_head_source == "target":
            dst.copy_(src.detach().float())
        elif n != "embed_tokens":
            dst.copy_(src.detach().to(_dtype(dtype)).float())
    out = out.to(target.embed_tokens.device)
    out.embed_tokens = target.embed_tokens
    return out


@torch.no_grad()
def _cast_head(head: Eagle3DraftHead, target: LlamaForCausalLM, dtype: str) -> Eagle3DraftHead:
    dt = _dtype(dtype)  # a host copy (the saver writes no embedding)
    out = Eagle3DraftHead(head.config, dt, embed_tokens=target.embed_tokens.data.to("cpu", dt),
                          lm_head_source=head.lm_head_source)
    for (n, dst), (_, src) in zip(out.named_parameters(), head.named_parameters(), strict=True):
        if n != "embed_tokens":
            dst.copy_(src.to(dt))
    return out


def mark_byte_tokenizer(target_dir: str | Path) -> None:
    """Add `graphdraft_tokenizer: "bytes"` to a target's config.json (loaders ignore the key)."""
    path = Path(target_dir) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config[CONFIG_KEY] = "bytes"
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _write_summary(out: Path, summary: dict) -> None:
    (out / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
