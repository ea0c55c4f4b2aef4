"""Train an EAGLE-3 head for a pretrained chat target (e.g. SmolLM2-135M-Instruct), the EAGLE-3 way.

1. Prompts (`graphdraft.train.chat_prompts`: stdlib functions as code requests, instruction
   templates over everyday topics), each one user message under the target's chat template.
2. Responses: the target's own, through graphdraft's `Engine` (target only, large batches,
   the torch kernel path, eager), up to `max_new_tokens`, stopping at EOS / end of turn; a
   `sampled_fraction` of them sampled at `sample_temperature`, the rest greedy.
3. Draft vocabulary: the `draft_vocab` most frequent target ids of the responses (EOS and
   the end-of-turn token always in), the head's `hot_token_ids` (saved as `d2t` / `t2d`).
4. Training (`train._train_loop`): the target frozen (its weights as loaded, bf16 on CUDA),
   its aux hidden states (`train.forward.target_forward`) the head's input; the head's
   training-time test unrolled `ttt_steps` steps (`forward.head_ttt_forward`); step k's loss
   the cross-entropy against the target's softmax over the draft vocabulary, weighted
   `decay ** (k - 1)`, on response positions only and only where the target's greedy token
   is in the draft vocabulary (EAGLE-3's position mask).
5. The head is saved (`save_eagle3_head`, `save_dtype`) with `training.json`: the data, the
   run, the held-out agreement and expected accept length, the wall time and the GPU.

`python -m graphdraft.train real --target DIR_OR_GGUF --out DIR --recipe gpu` runs it.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from graphdraft.io.checkpoint import load_target, save_eagle3_head
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.llama import LlamaForCausalLM
from graphdraft.train.chat_prompts import training_prompts
from graphdraft.train.forward import head_ttt_forward, target_forward
from graphdraft.train.train import (
    SUMMARY_NAME,
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
)


@dataclass
class RealHeadRun:
    target: str
    """A converted target directory (config.json, safetensors, tokenizer.json) or a .gguf file."""
    out: str
    seed: int = 0
    code_prompts: int = 8000
    prose_prompts: int = 2240
    max_prompt_tokens: int = 384
    max_new_tokens: int = 256
    sampled_fraction: float = 0.3
    sample_temperature: float = 0.7
    gen_chunk: int = 512
    gen_max_minutes: float | None = None
    draft_vocab: int = 4096
    ffn: int = 512
    ttt_steps: int = 5
    decay: float = 0.8
    batch: int = 32
    steps: int = 20000
    lr: float = 1.5e-3
    weight_decay: float = 0.0
    warmup: int = 100
    max_minutes: float | None = None
    heldout_fraction: float = 0.03
    compile: bool = False
    log_every: int = 100
    save_dtype: str = "bfloat16"
    device: str = "auto"
    precision: str = "auto"
    history: list = field(default_factory=list)


@dataclass
class Samples:
    """Prompt + response sequences, right-padded: ids `[N, L]`, prompt_lens / lens `[N]`."""

    ids: torch.Tensor
    prompt_lens: torch.Tensor
    lens: torch.Tensor
    kinds: list[str]

    def label_mask(self) -> torch.Tensor:
        """`[N, L]` bool: position j's next token is a response token (j+1 in the response)."""
        j = torch.arange(self.ids.shape[1])[None, :]
        return (j >= self.prompt_lens[:, None] - 1) & (j < self.lens[:, None] - 1)

    def subset(self, idx: list[int]) -> Samples:
        t = torch.tensor(idx, dtype=torch.long)
        return Samples(self.ids[t], self.prompt_lens[t], self.lens[t], [self.kinds[i] for i in idx])


def chat_prompt_ids(tokenizer, texts: list[str], max_tokens: int) -> list[list[int] | None]:
    """Each text as one user message under the chat template -> ids (None: over max_tokens)."""
    out = []
    for t in texts:
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]))
        out.append(ids if len(ids) <= max_tokens else None)
    return out


@torch.no_grad()
def generate_samples(target: LlamaForCausalLM, tokenizer, prompts: list[tuple[str, str]],
                     run: RealHeadRun, gen: torch.Generator) -> tuple[Samples, dict]:
    """The target's responses to `prompts` ((kind, text)) through the Engine (module
    docstring, step 2); stops after the chunk that passes `gen_max_minutes`."""
    from graphdraft.config import RuntimeConfig
    from graphdraft.serving.engine import Engine
    from graphdraft.serving.verify import SamplingParams

    device = target.embed_tokens.device
    encoded = chat_prompt_ids(tokenizer, [t for _, t in prompts], run.max_prompt_tokens)
    kept = [(k, ids) for (k, _), ids in zip(prompts, encoded, strict=True) if ids is not None]
    chunk = min(len(kept), run.gen_chunk)
    context = run.max_prompt_tokens + run.max_new_tokens
    rc = RuntimeConfig(speculative_num_steps=1, page_size=16, max_running_requests=chunk,
                       max_context_len=min(context + 8, target.config.max_position_embeddings),
                       max_num_batched_tokens=16384,
                       kv_cache_memory_gb=(chunk * (context + 64) * target.config.num_hidden_layers
                                           * 4 * target.config.num_key_value_heads
                                           * target.config.head_dim / 1e9) + 0.5,
                       cuda_graph_max_bs=chunk, dtype=_dtype_name(target.dtype),
                       device=str(device), kernel_backend="torch", enforce_eager=True,
                       validate_inputs=False)
    eng = Engine(target, rc, eos_token_id=tokenizer.eos_token_ids[0])
    stops = tuple(tokenizer.eos_token_ids)
    rows, kinds, t0 = [], [], time.perf_counter()
    for i in range(0, len(kept), chunk):
        if run.gen_max_minutes is not None and rows and \
                time.perf_counter() - t0 > 60 * run.gen_max_minutes:
            print(f"responses: stopping at {len(rows)} of {len(kept)}: the time cap "
                  f"({run.gen_max_minutes} min) is reached", flush=True)
            break
        part = kept[i: i + chunk]
        draws = torch.rand(len(part), generator=gen).tolist()
        params = [SamplingParams(max_new_tokens=run.max_new_tokens, stop_token_ids=stops,
                                 temperature=run.sample_temperature if d < run.sampled_fraction
                                 else 0.0, seed=run.seed + i + j)
                  for j, d in enumerate(draws)]
        outs = eng.generate([ids for _, ids in part], params)
        rows += [(ids, out) for (_, ids), out in zip(part, outs, strict=True)]
        kinds += [k for k, _ in part]
        print(f"responses: {len(rows)} of {len(kept)}, {time.perf_counter() - t0:.1f} s", flush=True)
    seconds = time.perf_counter() - t0
    length = max(len(p) + len(o) for p, o in rows)
    ids = torch.full((len(rows), length), tokenizer.eos_token_ids[0], dtype=torch.long)
    for r, (p, o) in enumerate(rows):
        ids[r, : len(p) + len(o)] = torch.tensor(p + o)
    samples = Samples(ids, torch.tensor([len(p) for p, _ in rows]),
                      torch.tensor([len(p) + len(o) for p, o in rows]), kinds)
    response_tokens = int((samples.lens - samples.prompt_lens).sum())
    info = {"prompts": len(prompts), "over_max_prompt_tokens": len(prompts) - len(kept),
            "responses": len(rows), "response_tokens": response_tokens,
            "code": kinds.count("code"), "prose": kinds.count("prose"),
            "seconds": round(seconds, 1)}
    print(f"responses: {info}", flush=True)
    return samples, info


def hot_token_ids(samples: Samples, vocab_size: int, size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent response ids (`always` forced in), sorted ascending `[size]`."""
    mask = samples.label_mask()
    nxt = torch.zeros_like(mask)
    nxt[:, 1:] = mask[:, :-1]  # the response tokens themselves (positions j + 1)
    counts = torch.bincount(samples.ids[nxt], minlength=vocab_size).float()
    counts[torch.tensor(always, dtype=torch.long)] = float("inf")
    return torch.topk(counts, min(size, vocab_size)).indices.sort().values


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


class DraftLabels:
    """The target's labels over the draft vocabulary: `hot [Vd]`, `to_draft [V]` (-1: none)."""

    def __init__(self, hot: torch.Tensor, vocab_size: int) -> None:
        self.hot = hot
        self.to_draft = torch.full((vocab_size,), -1, dtype=torch.long, device=hot.device)
        self.to_draft[hot] = torch.arange(hot.numel(), device=hot.device)

    def __call__(self, target_logits: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """target logits `[B, L, V]`, label mask `[B, L]` -> (probs over the draft vocab
        `[B, L, Vd]` fp32, the greedy token's draft id `[B, L]`, the position mask `[B, L]`:
        a response label whose greedy token is in the draft vocab)."""
        greedy = self.to_draft[target_logits.argmax(-1)]
        probs = torch.softmax(target_logits[..., self.hot].float(), -1)
        return probs, greedy, mask & (greedy >= 0)


def masked_ttt_loss(step_logits: list[torch.Tensor], probs: torch.Tensor, greedy: torch.Tensor,
                    mask: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Step k's logits `[B, L-1, Vd]` at chain t predict position t+k+1 (labels at t+k):
    weighted soft cross-entropy over the masked positions, and each step's top-1 agreement."""
    length = probs.shape[1]
    total, accs = 0.0, []
    for k, lg in enumerate(step_logits, start=1):
        pred, p, m = lg[:, : length - k], probs[:, k:], mask[:, k:].float()
        ce = -(p * torch.log_softmax(pred.float(), -1)).sum(-1)
        denom = m.sum().clamp_min(1.0)
        total = total + decay ** (k - 1) * (ce * m).sum() / denom
        accs.append(((pred.argmax(-1) == greedy[:, k:]).float() * m).sum() / denom)
    return total, torch.stack(accs).detach()


@torch.no_grad()
def eval_real_head(target: LlamaForCausalLM, head: Eagle3DraftHead, samples: Samples,
                   labels: DraftLabels, steps: int, batch: int, precision: str) -> dict:
    """Held-out per-step top-1 agreement (response positions) and the chain's expected accept
    length `1 + sum_k P(steps 1..k all agree)` over chains whose `steps` labels all exist."""
    device = target.embed_tokens.device
    oks, valid = [[] for _ in range(steps)], []
    for i in range(0, samples.ids.shape[0], batch):
        part = samples.subset(list(range(i, min(i + batch, samples.ids.shape[0]))))
        length = int(part.lens.max())
        ids = part.ids[:, :length].to(device)
        mask = part.label_mask()[:, :length].to(device)
        with autocast(precision, device):
            tl, aux = target_forward(target, ids)
            outs = head_ttt_forward(head, ids, aux, steps)
        _, greedy, _ = labels(tl, mask)
        n = length - steps
        for k, lg in enumerate(outs, start=1):
            oks[k - 1].append((lg[:, :n].argmax(-1) == greedy[:, k: k + n]).flatten())
        valid.append(torch.stack([mask[:, k: k + n] for k in range(1, steps + 1)], -1)
                     .all(-1).flatten())
    ok = torch.stack([torch.cat(o) for o in oks], -1)[torch.cat(valid)].float()
    chain = torch.cumprod(ok, -1)
    return {"step_top1_agreement": [round(x, 4) for x in ok.mean(0).tolist()],
            "expected_accept_length": {f"steps_{s}": round(1 + chain[:, :s].sum(-1).mean().item(), 3)
                                       for s in range(1, steps + 1)},
            "positions": int(ok.shape[0])}


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


def new_chat_head(target: LlamaForCausalLM, hot: torch.Tensor, ffn: int, seed: int
                  ) -> Eagle3DraftHead:
    """An fp32 head (one layer of the target's attention shape, `ffn` MLP width, draft vocab
    `hot`) sharing the target's embedding; LM head rows and final norm from the target's."""
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
    head.embed_tokens = target.embed_tokens
    return head


@torch.no_grad()
def head_copy(head: Eagle3DraftHead, dtype: torch.dtype, embed: torch.Tensor,
              via: torch.dtype | None = None) -> Eagle3DraftHead:
    """`head` in `dtype` around the embedding `embed` (its device), hot tokens kept;
    `via`: round every weight through that dtype first (what a checkpoint holds)."""
    out = Eagle3DraftHead(head.config, dtype, embed_tokens=embed,
                          hot_token_ids=head.hot_token_ids.to(embed.device)).to(embed.device)
    for (n, dst), (_, src) in zip(out.named_parameters(), head.named_parameters(), strict=True):
        if n != "embed_tokens":
            dst.copy_((src.to(via) if via is not None else src).to(dtype))
    return out


def _batches(train: Samples, run: RealHeadRun, device: torch.device, gen: torch.Generator):
    ids, mask, lens = train.ids.to(device), train.label_mask().to(device), train.lens

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, ids.shape[0], (run.batch,), generator=gen)
        length = min(ids.shape[1], -(-int(lens[idx].max()) // 64) * 64)
        idx = idx.to(device)
        return ids[idx, :length], mask[idx, :length]
    return next_batch


def train_real_head(run: RealHeadRun) -> dict:
    """The whole recipe of the module docstring -> the summary written as training.json."""
    t_start = time.perf_counter()
    device = resolve_device(run.device)
    precision = resolve_precision(run.precision, device)
    gen = seed_everything(run.seed)
    target, tokenizer, target_dir = load_chat_target(run.target, device)
    prompts = training_prompts(run.code_prompts, run.prose_prompts, run.seed)
    samples, data = generate_samples(target, tokenizer, prompts, run, gen)
    hot = hot_token_ids(samples, target.config.vocab_size, run.draft_vocab,
                        list(tokenizer.eos_token_ids)).to(device)
    labels = DraftLabels(hot, target.config.vocab_size)
    resp = samples.ids[torch.roll(samples.label_mask(), 1, 1)]
    data["draft_vocab_coverage"] = round(
        (labels.to_draft.cpu()[resp] >= 0).float().mean().item(), 4)
    order = torch.randperm(samples.ids.shape[0], generator=gen).tolist()
    n_held = max(8, int(len(order) * run.heldout_fraction))
    held, train = samples.subset(order[:n_held]), samples.subset(order[n_held:])
    head = new_chat_head(target, hot, run.ffn, run.seed + 1)
    params = {n: p for n, p in head.named_parameters() if n != "embed_tokens"}
    for p in params.values():
        p.requires_grad_(True)
    n_params = sum(p.numel() for p in params.values())
    print(f"head: {n_params:,} trained parameters, draft vocab {hot.numel()} "
          f"(covers {data['draft_vocab_coverage']:.1%} of response tokens), {head.config}",
          flush=True)
    opt = _optimizer(params, run.lr, run.weight_decay, device)

    def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]):
        ids, mask = batch
        with torch.no_grad(), autocast(precision, device):
            tl, aux = target_forward(target, ids)
        probs, greedy, pmask = labels(tl, mask)
        del tl
        with autocast(precision, device):
            outs = head_ttt_forward(head, ids, aux, run.ttt_steps)
        return masked_ttt_loss(outs, probs, greedy, pmask, run.decay)

    step_fn = torch.compile(loss_fn) if run.compile else loss_fn
    mean_len = float(train.lens.float().mean())
    with matmul_precision(precision):
        res = _train_loop("head", run, device, params, opt, step_fn, loss_fn,
                          _batches(train, run, device, gen), int(run.batch * mean_len))
    for p in params.values():
        p.requires_grad_(False)
    save_dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[run.save_dtype]
    shipped = head_copy(head, torch.float32, target.embed_tokens.data.float(), via=save_dt)
    ev = eval_real_head(target, shipped, held, labels, run.ttt_steps, 16, precision)
    print(f"head held-out ({run.save_dtype} weights): {ev}", flush=True)
    out = Path(run.out)
    save_eagle3_head(head_copy(head, save_dt, target.embed_tokens.data.to("cpu", save_dt)), out)
    _sync(device)
    summary = {"model": "eagle3_head", "target": str(run.target),
               "target_config": json.loads((target_dir / "config.json").read_text()),
               "parameters_trained": n_params, "data": data, "steps": res["steps"],
               "ttt_steps": run.ttt_steps, "final_train_loss_ema": res["ema"], "heldout": ev,
               "heldout_sequences": int(held.ids.shape[0]),
               "train_seconds": round(res["seconds"], 1),
               "first_step_seconds": _round(res["first_step_seconds"]),
               "wall_seconds": round(time.perf_counter() - t_start, 1),
               "stopped_by": res["stopped_by"], "device": str(device), "precision": precision,
               "hardware": _hardware(device), "python": platform.python_version(),
               "run": asdict(run)}
    (out / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"head: wrote {out} ({res['steps']} steps, {res['seconds']:.1f} s)", flush=True)
    return summary


GPU_RECIPE = {"device": "cuda", "code_prompts": 8000, "prose_prompts": 2240,
              "gen_max_minutes": 1.4, "batch": 32, "steps": 20000, "max_minutes": 2.4,
              "log_every": 100}
"""One GPU, about 5 minutes: up to ~10,000 prompts (responses for as many as 1.4 minutes
allow), then a 2.4-minute head."""
CPU_SMOKE_RECIPE = {"device": "cpu", "code_prompts": 6, "prose_prompts": 6, "max_new_tokens": 12,
                    "max_prompt_tokens": 200,
                    "gen_chunk": 16, "batch": 2, "steps": 4, "draft_vocab": 96, "ffn": 64,
                    "ttt_steps": 3, "log_every": 1, "save_dtype": "float32"}
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
    skip = {"target", "out", "history"}
    for name, f in RealHeadRun.__dataclass_fields__.items():
        if name in skip:
            continue
        kind = {int: int, float: float, str: str, bool: int}.get(type(f.default), float)
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                        help=f"default {f.default!r} (the recipe may set it)")
    a = ap.parse_args(argv)
    values = dict(REAL_RECIPES[a.recipe])
    values |= {k: getattr(a, k) for k in RealHeadRun.__dataclass_fields__
               if k not in skip and getattr(a, k) is not None}
    if "compile" in values:
        values["compile"] = bool(values["compile"])
    train_real_head(RealHeadRun(target=a.target, out=a.out, **values))
    return 0
