"""Train the shipped byte-level model pair: a small Llama target, then its EAGLE-3 head.

Target: next-byte cross-entropy on random 256-byte windows of the stdlib corpus
(`graphdraft.train.data`), AdamW, fp32, linear warm-up then cosine decay.
Head: the target frozen; the head's training-time test (`forward.head_ttt_forward`)
unrolled `--ttt-steps` steps over every position of each window; loss = cross-entropy
against the target's soft labels (its softmax at the position the step predicts; `--hard-labels`:
its greedy token instead), step k weighted `decay ** (k - 1)`. The head shares (and does
not train) the target's embedding; its LM head and final norm start from the target's.

Both write graphdraft checkpoints (`graphdraft.checkpoint.save_target` / `save_eagle3_head`)
and a `training.json` summary next to the weights.
"""

from __future__ import annotations

import json
import math
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from graphdraft.bytes_tokenizer import BOS_ID, CONFIG_KEY, EOS_ID, VOCAB_SIZE
from graphdraft.checkpoint import load_eagle3_head, load_target, save_eagle3_head, save_target
from graphdraft.config import ModelConfig
from graphdraft.eagle3 import Eagle3DraftHead
from graphdraft.llama import LlamaForCausalLM
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


def _optimizer(params: dict[str, torch.nn.Parameter], lr: float, wd: float) -> torch.optim.AdamW:
    decay = [p for n, p in params.items() if p.ndim == 2 and "embed" not in n]
    rest = [p for n, p in params.items() if not (p.ndim == 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def _lr_at(step: int, steps: int, lr: float, warmup: int, elapsed: float = 0.0,
           max_seconds: float | None = None) -> float:
    """Linear warm-up, then cosine decay to lr/10 over the run's progress: the step's fraction
    of `steps`, or (with a time cap) the larger of that and the elapsed fraction of the cap."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    if max_seconds is not None:
        t = max(t, elapsed / max_seconds)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _hardware() -> str:
    import os
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")


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
    history: list = field(default_factory=list)


@dataclass
class HeadRun:
    seed: int = 0
    steps: int = 600
    batch: int = 16
    context: int = 256
    ttt_steps: int = 3
    decay: float = 0.8
    hard_labels: bool = False
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup: int = 10
    max_minutes: float | None = None
    compile: bool = True
    eval_windows: int = 64
    log_every: int = 10
    target: str = "graphdraft/assets/target"
    out: str = "graphdraft/assets/eagle3"
    ffn: int = 768
    generated: int = 0
    """Sequences in the self-distillation pool: a training window's first 16..192 bytes then
    the target's greedy continuation up to `context` (0: train on corpus windows only)."""
    generated_fraction: float = 0.75
    """Share of each batch drawn from the pool (the rest: corpus windows)."""
    init_from: str | None = None
    """Start from this head checkpoint instead of a fresh initialisation."""
    save_dtype: str = "bfloat16"
    history: list = field(default_factory=list)


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
    gen = seed_everything(run.seed)
    corpus = corpus or load_corpus()
    print(f"corpus: {corpus.describe()}", flush=True)
    cfg = target_config(context=run.context)
    model = LlamaForCausalLM(cfg, torch.float32)
    init_for_training_(model, run.seed, cfg.num_hidden_layers)
    params = dict(model.named_parameters())
    for p in params.values():
        p.requires_grad_(True)
    n_params = sum(p.numel() for p in params.values())
    print(f"target: {n_params:,} parameters, {cfg}", flush=True)
    opt = _optimizer(params, run.lr, run.weight_decay)
    held = eval_windows(corpus.heldout, run.eval_windows, run.context + 1)

    def loss_fn(w: torch.Tensor) -> torch.Tensor:
        logits, _ = target_forward(model, w[:, :-1], capture_aux=False)
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), w[:, 1:].reshape(-1))

    if run.compile:
        loss_fn = torch.compile(loss_fn)
    t0 = time.perf_counter()
    ema, done = None, 0
    for step in range(run.steps):
        if run.max_minutes is not None and time.perf_counter() - t0 > 60 * run.max_minutes:
            print(f"stopping at step {step}: --max-minutes {run.max_minutes} reached", flush=True)
            break
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, run.steps, run.lr, run.warmup, time.perf_counter() - t0,
                             None if run.max_minutes is None else 60 * run.max_minutes)
        w = sample_windows(corpus.train, run.batch, run.context + 1, gen)
        loss = loss_fn(w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        done += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % run.log_every == 0 or step == run.steps - 1:
            el = time.perf_counter() - t0
            run.history.append({"step": step, "loss": round(loss.item(), 4),
                                "ema_loss": round(ema, 4), "seconds": round(el, 1)})
            print(f"target step {step:5d}  loss {loss.item():.4f}  ema {ema:.4f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {el:7.1f} s", flush=True)
    steps_done = done
    wall = time.perf_counter() - t0
    for p in params.values():
        p.requires_grad_(False)
    # ship in save_dtype, and report what ships: evaluate the rounded weights
    shipped = _round_trip(model, run.save_dtype)
    ev = eval_target(shipped, held)
    print(f"target held-out ({run.save_dtype} weights): {ev}", flush=True)
    out = Path(run.out)
    save_target(_cast_target(shipped, _dtype(run.save_dtype)), out, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    mark_byte_tokenizer(out)
    summary = {"model": "target", "parameters": n_params, "config": _cfg_dict(cfg),
               "steps": steps_done, "tokens_seen": steps_done * run.batch * run.context,
               "final_train_loss_ema": ema, "heldout": ev, "wall_seconds": round(wall, 1),
               "hardware": _hardware(), "corpus": corpus.describe(), "run": asdict(run)}
    _write_summary(out, summary)
    return summary


# ---------------------------------------------------------------------------
# Head
# ---------------------------------------------------------------------------
def _ttt_loss(step_logits: list[torch.Tensor], target_logits: torch.Tensor, decay: float,
              hard: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted loss and per-step top-1 agreement with the target's greedy token.

    Step k's logits at chain t predict position t+k+1: the target's logits at t+k.
    """
    length = target_logits.shape[1]
    total, accs = 0.0, []
    for k, lg in enumerate(step_logits, start=1):
        pred = lg[:, : length - k]
        tl = target_logits[:, k:]
        if hard:
            loss = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), tl.argmax(-1).reshape(-1))
        else:
            p = torch.softmax(tl.float(), -1)
            loss = -(p * torch.log_softmax(pred, -1)).sum(-1).mean()
        total = total + decay ** (k - 1) * loss
        accs.append((pred.argmax(-1) == tl.argmax(-1)).float().mean())
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


def new_head(target: LlamaForCausalLM, cfg: ModelConfig, seed: int) -> Eagle3DraftHead:
    """A freshly initialised fp32 head sharing (not copying) the target's embedding; its LM
    head and final norm start from the target's.

    Built with its own embedding, initialised, then given the target's: constructed around
    `target.embed_tokens.data`, the initialisation would overwrite the target's embedding in
    place (the two parameters would share storage).
    """
    head = Eagle3DraftHead(cfg, torch.float32)
    init_for_training_(head, seed, 1)
    with torch.no_grad():
        head.lm_head.copy_(target.lm_head)
        head.norm.weight.copy_(target.norm.weight)
    head.embed_tokens = target.embed_tokens  # shared (and frozen), as the loader shares it
    return head


def train_head(run: HeadRun, corpus: Corpus | None = None) -> dict:
    gen = seed_everything(run.seed)
    corpus = corpus or load_corpus()
    print(f"corpus: {corpus.describe()}", flush=True)
    # the target as shipped (its rounded weights), computed in fp32
    target, _ = load_target(run.target, torch.float32)
    tc = target.config
    cfg = head_config(tc, ffn=run.ffn)
    if run.init_from is not None:
        head = load_eagle3_head(run.init_from, target=target)
        if head.config.replace(draft_vocab_size=None) != cfg:  # the saver writes Vd = V
            raise ValueError(f"--init-from {run.init_from}: expected a head shaped {cfg}, "
                             f"got {head.config}")
        print(f"head: starting from {run.init_from}", flush=True)
    else:
        head = new_head(target, cfg, run.seed + 1)
    pool = None
    if run.generated:
        t_gen = time.perf_counter()
        pool = generate_pool(target, corpus.train, run.generated, run.context, gen)
        print(f"self-distillation pool: {pool.shape[0]} sequences of {pool.shape[1]} tokens in "
              f"{time.perf_counter() - t_gen:.1f} s", flush=True)
    n_gen = round(run.batch * run.generated_fraction) if pool is not None else 0
    params = {n: p for n, p in head.named_parameters() if n != "embed_tokens"}
    for p in params.values():
        p.requires_grad_(True)
    n_params = sum(p.numel() for p in params.values())
    print(f"head: {n_params:,} trained parameters (embedding shared with the target), {cfg}",
          flush=True)
    opt = _optimizer(params, run.lr, run.weight_decay)
    held = eval_windows(corpus.heldout, run.eval_windows, run.context)

    def teacher(w: torch.Tensor):
        return target_forward(target, w)

    def loss_fn(w: torch.Tensor, tl: torch.Tensor, aux: torch.Tensor):
        outs = head_ttt_forward(head, w, aux, run.ttt_steps)
        return _ttt_loss(outs, tl, run.decay, run.hard_labels)

    if run.compile:
        teacher, loss_fn = torch.compile(teacher), torch.compile(loss_fn)
    t0 = time.perf_counter()
    ema, done = None, 0
    for step in range(run.steps):
        if run.max_minutes is not None and time.perf_counter() - t0 > 60 * run.max_minutes:
            print(f"stopping at step {step}: --max-minutes {run.max_minutes} reached", flush=True)
            break
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, run.steps, run.lr, run.warmup, time.perf_counter() - t0,
                             None if run.max_minutes is None else 60 * run.max_minutes)
        w = sample_windows(corpus.train, run.batch - n_gen, run.context, gen)
        if n_gen:
            w = torch.cat([w, pool[torch.randint(0, pool.shape[0], (n_gen,), generator=gen)]])
        with torch.no_grad():
            tl, aux = teacher(w)
        loss, accs = loss_fn(w, tl, aux)
        accs = accs.tolist()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        done += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % run.log_every == 0 or step == run.steps - 1:
            el = time.perf_counter() - t0
            run.history.append({"step": step, "loss": round(loss.item(), 4),
                                "ema_loss": round(ema, 4),
                                "step_top1": [round(a, 3) for a in accs],
                                "seconds": round(el, 1)})
            print(f"head step {step:5d}  loss {loss.item():.4f}  ema {ema:.4f}  top1/step "
                  f"{' '.join(f'{a:.3f}' for a in accs)}  {el:7.1f} s", flush=True)
    steps_done = done
    wall = time.perf_counter() - t0
    for p in params.values():
        p.requires_grad_(False)
    shipped = _round_trip_head(head, target, run.save_dtype)
    ev = eval_head(target, shipped, held, run.ttt_steps)
    print(f"head held-out ({run.save_dtype} weights): {ev}", flush=True)
    out = Path(run.out)
    save_eagle3_head(_cast_head(shipped, target, run.save_dtype), out)
    summary = {"model": "eagle3_head", "parameters_trained": n_params, "config": _cfg_dict(cfg),
               "steps": steps_done, "ttt_steps": run.ttt_steps, "final_train_loss_ema": ema,
               "heldout": ev, "wall_seconds": round(wall, 1), "hardware": _hardware(),
               "corpus": corpus.describe(), "run": asdict(run)}
    _write_summary(out, summary)
    return summary


@torch.no_grad()
def generate_pool(target: LlamaForCausalLM, ids: torch.Tensor, count: int, context: int,
                  gen: torch.Generator, min_prompt: int = 16, max_prompt: int = 192,
                  chunk: int = 64) -> torch.Tensor:
    """`[count, context]` sequences: a random corpus window's first 16..192 ids, then the
    target's greedy continuation (through graphdraft's own `Engine`, CPU, float32)."""
    from graphdraft.config import RuntimeConfig
    from graphdraft.engine import Engine
    from graphdraft.verify import SamplingParams

    max_prompt = min(max_prompt, context - min_prompt)
    lens = torch.randint(min_prompt, max_prompt + 1, (count,), generator=gen).tolist()
    windows = sample_windows(ids, count, max_prompt, gen)
    prompts = [windows[i, :n].tolist() for i, n in enumerate(lens)]
    rc = RuntimeConfig(speculative_num_steps=1, page_size=16, max_running_requests=chunk,
                       max_context_len=context + 8, max_num_batched_tokens=4096,
                       cuda_graph_max_bs=chunk, dtype="float32", device="cpu",
                       kernel_backend="torch", validate_inputs=False)
    if target.config.max_position_embeddings < rc.max_context_len:  # RoPE table only
        target = _with_longer_rope(target, rc.max_context_len)
    eng = Engine(target, rc)
    out = []
    for i in range(0, count, chunk):
        ps = prompts[i: i + chunk]
        params = [SamplingParams(max_new_tokens=context - len(p), ignore_eos=True) for p in ps]
        outs = eng.generate(ps, params)
        out += [torch.tensor(p + o[: context - len(p)]) for p, o in zip(ps, outs, strict=True)]
    return torch.stack(out)


def _with_longer_rope(model: LlamaForCausalLM, positions: int) -> LlamaForCausalLM:
    """The same weights with a RoPE table of `positions` rows (the engine reserves look-ahead
    slots past the context; generation itself stays within it)."""
    cfg = model.config.replace(max_position_embeddings=positions)
    out = LlamaForCausalLM(cfg, model.dtype)
    out.load_state_dict(model.state_dict())
    return out


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------
def _dtype(name: str) -> torch.dtype:
    from graphdraft.config import resolve_dtype
    return resolve_dtype(name)


def _cfg_dict(cfg: ModelConfig) -> dict:
    d = asdict(cfg)
    d["aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids())
    return d


@torch.no_grad()
def _cast_target(model: LlamaForCausalLM, dtype: torch.dtype) -> LlamaForCausalLM:
    out = LlamaForCausalLM(model.config, dtype)
    for (_, dst), (_, src) in zip(out.named_parameters(), model.named_parameters(), strict=True):
        dst.copy_(src.detach().to(dtype))
    return out


def _round_trip(model: LlamaForCausalLM, dtype: str) -> LlamaForCausalLM:
    """An fp32 copy of `model` whose weights went through `dtype` (what the checkpoint holds)."""
    return _cast_target(_cast_target(model, _dtype(dtype)), torch.float32)


@torch.no_grad()
def _round_trip_head(head: Eagle3DraftHead, target: LlamaForCausalLM, dtype: str) -> Eagle3DraftHead:
    out = Eagle3DraftHead(head.config, torch.float32, embed_tokens=target.embed_tokens.data)
    for (n, dst), (_, src) in zip(out.named_parameters(), head.named_parameters(), strict=True):
        if n != "embed_tokens":
            dst.copy_(src.detach().to(_dtype(dtype)).float())
    return out


@torch.no_grad()
def _cast_head(head: Eagle3DraftHead, target: LlamaForCausalLM, dtype: str) -> Eagle3DraftHead:
    dt = _dtype(dtype)
    out = Eagle3DraftHead(head.config, dt, embed_tokens=target.embed_tokens.data.to(dt))
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
