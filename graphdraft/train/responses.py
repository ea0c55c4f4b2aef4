"""The target's own responses to a prompt set, through graphdraft's `Engine` (EAGLE-3 data).

Each prompt is one user message under the target's chat template. A prompt gets
`responses_per_prompt` jobs: the first greedy, the others sampled at `sample_temperature`,
each with its own seed. The jobs run in rounds (every prompt's greedy response, shuffled,
then every prompt's first sampled one, ...), so a time cap keeps the most distinct prompts.

On CUDA the Engine runs target-only decode cycles as CUDA graph replays with the Triton
kernels, `gen_batch` requests live at once; `serve_refilling` tops the batch up whenever a
quarter of it has finished (each top-up is one or a few eager prefill steps; the rest are
graph replays at 3/4 to full batch). If building, capturing or running the graph engine
fails, the remaining jobs run on an eager Engine over the torch kernels (slower, same
tokens' distribution) and the run records why.

The responses cache (`save_responses` / `load_responses`, `--responses-cache DIR` of
`graphdraft.train.real`): the samples unpadded (int32 ids back to back, lengths, prompt
indices, kinds) in safetensors, and a JSON record holding the key that produced them
(`responses_key`: the target's identity, the prompts' sha256, the sampling settings), the
generation's data record and the sampling generator's state after generation, so a run that
loads them goes on exactly as the run that generated them did.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from graphdraft.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from graphdraft.serving.engine import Engine


class ResponseSettings(Protocol):
    """What generation reads of a run (`graphdraft.train.real.RealHeadRun` has these)."""

    seed: int
    responses_per_prompt: int
    sample_temperature: float
    max_prompt_tokens: int
    max_new_tokens: int
    gen_batch: int
    gen_graphs: bool

REFILL_DIVISOR = 4
"""Top the live batch up once `gen_batch // REFILL_DIVISOR` of its requests have finished."""
GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
"""Padded batch sizes captured for generation (those up to `gen_batch`, and `gen_batch`)."""
PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True)
class Job:
    """One response to generate: prompt `prompt` (its index among the kept prompts)."""

    index: int
    prompt: int
    kind: str
    temperature: float
    seed: int


@dataclass
class Samples:
    """Prompt + response sequences, right-padded: ids `[N, L]`; prompt_lens, lens, prompt
    (the prompt's index), sampled (bool) `[N]`; kinds (the prompt's kind) per row."""

    ids: torch.Tensor
    prompt_lens: torch.Tensor
    lens: torch.Tensor
    prompt: torch.Tensor
    sampled: torch.Tensor
    kinds: list[str]

    def label_mask(self) -> torch.Tensor:
        """`[N, L]` bool: position j's next token is a response token (j+1 in the response)."""
        j = torch.arange(self.ids.shape[1])[None, :]
        return (j >= self.prompt_lens[:, None] - 1) & (j < self.lens[:, None] - 1)

    def subset(self, idx: list[int]) -> Samples:
        t = torch.tensor(idx, dtype=torch.long)
        length = int(self.lens[t].max()) if idx else 1
        return Samples(self.ids[t, :length], self.prompt_lens[t], self.lens[t], self.prompt[t],
                       self.sampled[t], [self.kinds[i] for i in idx])

    @property
    def response_tokens(self) -> int:
        return int((self.lens - self.prompt_lens).sum())


def chat_prompt_ids(tokenizer, texts: list[str], max_tokens: int) -> list[list[int] | None]:
    """Each text as one user message under the chat template -> ids (None: over max_tokens).
    A `tokenizers`-backed tokenizer encodes the batch at once (its own threads)."""
    from graphdraft.io.tokenizer import PretrainedTokenizer
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    if isinstance(tokenizer, PretrainedTokenizer):
        ids = [e.ids for e in tokenizer.backend.encode_batch(rendered, add_special_tokens=False)]
    else:
        ids = [tokenizer.encode(r) for r in rendered]
    return [x if len(x) <= max_tokens else None for x in ids]


def make_jobs(kinds: list[str], run: ResponseSettings, gen: torch.Generator) -> list[Job]:
    """`responses_per_prompt` rounds over the prompts, each round in its own random order:
    round 0 greedy, the later rounds sampled (seed distinct per job)."""
    jobs: list[Job] = []
    for r in range(run.responses_per_prompt):
        for p in torch.randperm(len(kinds), generator=gen).tolist():
            jobs.append(Job(len(jobs), p, kinds[p], 0.0 if r == 0 else run.sample_temperature,
                            run.seed * 1_000_003 + len(jobs)))
    return jobs


def generation_engine(target: LlamaForCausalLM, run: ResponseSettings, eos_token_id: int,
                      graphs: bool) -> Engine:
    """A target-only Engine for `run.gen_batch` live requests; `graphs` (CUDA): Triton
    kernels and captured CUDA graphs, else eager over the torch kernels."""
    from graphdraft.config import RuntimeConfig
    from graphdraft.serving.engine import Engine
    tc, page = target.config, 16
    context = -(-(run.max_prompt_tokens + run.max_new_tokens + 8) // page) * page
    context = min(context, tc.max_position_embeddings)
    kv_gb = run.gen_batch * (context + page) * tc.kv_bytes_per_token(target.dtype) / 1e9 + 0.25
    sizes = tuple(sorted({s for s in GRAPH_SIZES if s < run.gen_batch} | {run.gen_batch}))
    rc = RuntimeConfig(speculative_num_steps=1, speculative_policy="fixed", page_size=page,
                       max_running_requests=run.gen_batch, max_context_len=context,
                       max_num_batched_tokens=8192, kv_cache_memory_gb=kv_gb,
                       cuda_graph_max_bs=run.gen_batch, cuda_graph_bs=sizes,
                       dtype=str(target.dtype).removeprefix("torch."),
                       device=str(target.embed_tokens.device),
                       kernel_backend="auto" if graphs else "torch", enforce_eager=not graphs,
                       validate_inputs=False)
    eng = Engine(target, rc, eos_token_id=eos_token_id, seed=run.seed)
    if graphs:
        eng.capture_graphs(progress=False)
    return eng


def serve_refilling(eng: Engine, jobs: list[Job], prompts: list[list[int]], run: ResponseSettings,
                    stops: tuple[int, ...], deadline: float, done: dict[int, list[int]],
                    log) -> None:
    """Serve `jobs` in order, at most `run.gen_batch` live, topping up once a quarter has
    finished; no job starts after `deadline` (perf_counter), the live ones finish. Each
    finished job's output tokens go into `done[job.index]` as it retires."""
    from graphdraft.serving.verify import SamplingParams
    pending, live = deque(jobs), {}
    refill = max(1, run.gen_batch // REFILL_DIVISOR)
    t0 = last = time.perf_counter()
    tokens = 0
    while True:
        room = run.gen_batch - len(eng.running) - len(eng.waiting)
        now = time.perf_counter()
        if pending and now < deadline and room >= min(refill, len(pending)):
            for _ in range(min(room, len(pending))):
                job = pending.popleft()
                params = SamplingParams(max_new_tokens=run.max_new_tokens, stop_token_ids=stops,
                                        temperature=job.temperature, seed=job.seed)
                live[eng.add_request(prompts[job.prompt], params).rid] = job
        if not eng.has_work:
            break
        for r in eng.step():
            done[live.pop(r.rid).index] = r.output
            tokens += len(r.output)
        if now - last > PROGRESS_EVERY_S:
            last = now
            log(f"responses: {len(done)} done, {len(pending)} waiting, {tokens:,} tokens, "
                f"{tokens / (now - t0):,.0f} tok/s")
    for r in eng.drain():
        done[live.pop(r.rid).index] = r.output


def _run_jobs(target: LlamaForCausalLM, jobs: list[Job], prompts: list[list[int]],
              run: ResponseSettings, tokenizer, deadline: float, log) -> tuple[dict, dict]:
    """The jobs through the graph engine (CUDA, `run.gen_graphs`), the rest through an eager
    one if that fails -> ({job index: output}, what ran: engine, seconds, fallback)."""
    stops = tuple(tokenizer.eos_token_ids)
    done: dict[int, list[int]] = {}
    graphs = run.gen_graphs and target.embed_tokens.device.type == "cuda"
    info: dict = {"engine": "cuda graphs, triton kernels" if graphs else "eager, torch kernels"}
    t0 = time.perf_counter()
    try:
        eng = generation_engine(target, run, stops[0], graphs)
        info["engine_build_seconds"] = round(time.perf_counter() - t0, 1)
        log(f"responses: engine ready ({info['engine']}, {info['engine_build_seconds']} s)")
        serve_refilling(eng, jobs, prompts, run, stops, deadline, done, log)
    except Exception as e:  # noqa: BLE001 -- the graph path failed: the eager one goes on
        if not graphs:
            raise
        info["fallback"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
        log(f"responses: the graph engine failed ({info['fallback']}); "
            f"{len(done)} kept, the rest eagerly over the torch kernels")
        eng = None
        torch.cuda.empty_cache()
        eng = generation_engine(target, run, stops[0], graphs=False)
        serve_refilling(eng, [j for j in jobs if j.index not in done], prompts, run, stops,
                        deadline, done, log)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    return done, info


def generate_samples(target: LlamaForCausalLM, tokenizer, prompts: list[tuple[str, str]],
                     run: ResponseSettings, gen: torch.Generator, deadline: float,
                     log=print) -> tuple[Samples, dict]:
    """The target's responses to `prompts` ((kind, text)) (module docstring); no job starts
    after `deadline` (perf_counter). -> (samples in job order, the data record)."""
    t0 = time.perf_counter()
    encoded = chat_prompt_ids(tokenizer, [t for _, t in prompts], run.max_prompt_tokens)
    kept = [(k, ids) for (k, _), ids in zip(prompts, encoded, strict=True) if ids is not None]
    log(f"prompts: {len(kept)} of {len(prompts)} within {run.max_prompt_tokens} tokens "
        f"({time.perf_counter() - t0:.1f} s to encode)")
    ids_of = [ids for _, ids in kept]
    jobs = make_jobs([k for k, _ in kept], run, gen)
    done, info = _run_jobs(target, jobs, ids_of, run, tokenizer, deadline, log)
    rows = [(j, ids_of[j.prompt], done[j.index]) for j in jobs if j.index in done]
    if not rows:
        raise ValueError("responses: none finished (gen_max_minutes / deadline_minutes too short)")
    length = max(len(p) + len(o) for _, p, o in rows)
    ids = torch.full((len(rows), length), tokenizer.eos_token_ids[0], dtype=torch.long)
    for r, (_, p, o) in enumerate(rows):
        ids[r, : len(p) + len(o)] = torch.tensor(p + o)
    samples = Samples(ids, torch.tensor([len(p) for _, p, _ in rows]),
                      torch.tensor([len(p) + len(o) for _, p, o in rows]),
                      torch.tensor([j.prompt for j, _, _ in rows]),
                      torch.tensor([j.temperature > 0 for j, _, _ in rows]),
                      [j.kind for j, _, _ in rows])
    kinds = samples.kinds
    data = {"prompts": len(prompts), "over_max_prompt_tokens": len(prompts) - len(kept),
            "jobs": len(jobs), "responses": len(rows),
            "distinct_prompts": len({j.prompt for j, _, _ in rows}),
            "greedy": int((~samples.sampled).sum()), "sampled": int(samples.sampled.sum()),
            "response_tokens": samples.response_tokens,
            "tokens": int(samples.lens.sum()),
            **{k: kinds.count(k) for k in sorted(set(kinds))}, **info}
    data["response_tokens_per_s"] = round(data["response_tokens"] / max(info["seconds"], 1e-9))
    log(f"responses: {data}")
    return samples, data


# ---------------------------------------------------------------------------
# The responses cache (`--responses-cache DIR`): generate once, train over several calls
# ---------------------------------------------------------------------------
CACHE_FORMAT = 1
CACHE_TENSORS = "responses.safetensors"
CACHE_RECORD = "responses.json"
IDENTITY_BYTES = 16 << 20
"""A target file's identity: its size and the sha256 of its first 16 MiB."""


def _file_identity(path: Path) -> dict:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(IDENTITY_BYTES))
    return {"bytes": path.stat().st_size, "sha256_first_16mib": digest.hexdigest()}


def target_identity(path: str | os.PathLike) -> dict:
    """What a target is, cheaply: a file (a .gguf) its `_file_identity`; a converted directory
    each of its config / tokenizer / weight files' (by name). Renaming or moving it keeps it."""
    p = Path(path)
    if p.is_file():
        return _file_identity(p)
    if not p.is_dir():
        raise ValueError(f"target {path}: neither a file nor a directory")
    names = sorted(f.name for f in p.iterdir() if f.is_file() and (
        f.suffix in (".safetensors", ".gguf") or f.name in ("config.json", "tokenizer.json",
                                                             "tokenizer_config.json")))
    return {n: _file_identity(p / n) for n in names}


def responses_key(target_id: dict, prompts: list[tuple[str, str]], run: ResponseSettings) -> dict:
    """What produced a response set: the target's identity, the prompts ((kind, text), by
    sha256) and the settings that shape the responses (seed, responses per prompt, sampling
    temperature, prompt and response lengths). Caps on time or batch are not in it: a cache
    written under a shorter cap (fewer responses) is reused as it is."""
    text = json.dumps(prompts, ensure_ascii=False).encode()
    return {"format": CACHE_FORMAT, "target": target_id, "prompts": len(prompts),
            "prompts_sha256": hashlib.sha256(text).hexdigest(), "seed": run.seed,
            "responses_per_prompt": run.responses_per_prompt,
            "sample_temperature": run.sample_temperature,
            "max_prompt_tokens": run.max_prompt_tokens, "max_new_tokens": run.max_new_tokens}


def _packed(samples: Samples) -> dict[str, torch.Tensor]:
    """The samples' tensors without padding: the sequences' ids back to back, int32."""
    keep = torch.arange(samples.ids.shape[1])[None, :] < samples.lens[:, None]
    names = sorted(set(samples.kinds))
    return {"tokens": samples.ids[keep].to(torch.int32), "lens": samples.lens.long(),
            "prompt_lens": samples.prompt_lens.long(), "prompt": samples.prompt.long(),
            "sampled": samples.sampled.to(torch.uint8),
            "kinds": torch.tensor([names.index(k) for k in samples.kinds], dtype=torch.int64)}


def samples_digest(samples: Samples) -> str:
    """sha256 of the samples' unpadded ids, lengths, prompts and kinds (equal samples, equal
    digest, whatever the padding)."""
    digest = hashlib.sha256()
    for name, t in sorted(_packed(samples).items()):
        digest.update(name.encode())
        digest.update(t.contiguous().numpy().tobytes())
    digest.update(json.dumps(sorted(set(samples.kinds))).encode())
    return digest.hexdigest()


def save_responses(cache_dir: str | os.PathLike, key: dict, samples: Samples, data: dict,
                   pad_id: int, gen_state: torch.Tensor) -> None:
    """Write `samples` (unpadded, `_packed`), the generation's data record, the pad id and
    `gen_state` (the generator after generation, `torch.Generator.get_state()`) under `key`:
    safetensors and JSON, each written to a temporary name and renamed, the record last."""
    from safetensors.torch import save_file
    d = Path(cache_dir)
    d.mkdir(parents=True, exist_ok=True)
    tensors = _packed(samples) | {"gen_state": gen_state.to(torch.uint8)}
    save_file(tensors, str(d / (CACHE_TENSORS + ".tmp")))
    os.replace(d / (CACHE_TENSORS + ".tmp"), d / CACHE_TENSORS)
    record = {"key": key, "pad_id": int(pad_id), "kinds": sorted(set(samples.kinds)),
              "digest": samples_digest(samples), "data": data}
    (d / (CACHE_RECORD + ".tmp")).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(d / (CACHE_RECORD + ".tmp"), d / CACHE_RECORD)


def cached_key(cache_dir: str | os.PathLike) -> dict | None:
    """The key of the responses in `cache_dir` (None: none there, or not readable)."""
    path = Path(cache_dir) / CACHE_RECORD
    if not path.is_file() or not (Path(cache_dir) / CACHE_TENSORS).is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("key")
    except (OSError, ValueError):
        return None


def load_responses(cache_dir: str | os.PathLike) -> tuple[Samples, dict, torch.Tensor]:
    """(samples as `generate_samples` returned them, its data record, the generator state
    after generation) from `cache_dir`; ValueError naming responses_cache when the files
    disagree with their record (a damaged cache)."""
    from safetensors.torch import load_file
    d = Path(cache_dir)
    record = json.loads((d / CACHE_RECORD).read_text(encoding="utf-8"))
    t = load_file(str(d / CACHE_TENSORS))
    lens = t["lens"]
    width = int(lens.max())
    keep = torch.arange(width)[None, :] < lens[:, None]
    if int(keep.sum()) != t["tokens"].numel():
        raise ValueError(f"responses_cache {d}: {t['tokens'].numel()} tokens stored, the "
                         f"lengths say {int(keep.sum())} (a damaged cache: delete it)")
    ids = torch.full((lens.numel(), width), record["pad_id"], dtype=torch.long)
    ids[keep] = t["tokens"].long()
    samples = Samples(ids, t["prompt_lens"], lens, t["prompt"], t["sampled"].bool(),
                      [record["kinds"][i] for i in t["kinds"].tolist()])
    if samples_digest(samples) != record["digest"]:
        raise ValueError(f"responses_cache {d}: the samples' digest differs from the record's "
                         f"(a damaged cache: delete it)")
    return samples, record["data"], t["gen_state"]
