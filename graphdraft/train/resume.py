"""A chat head's training state between calls: `--checkpoint DIR` / `--resume` of
`graphdraft.train.real`.

A training too long for one call (a lent GPU runs a command for minutes) stops at its
deadline with a checkpoint and the next call goes on from it, as if it had never stopped:
the state holds everything the next step depends on

  head.<name>         fp32   the trained parameters (`train.trained_parameters`)
  hot                 int64  `[Vd]` the draft vocabulary (draft id -> target id: d2t / t2d)
  opt.<i>.<key>              the AdamW state of parameter i (step, exp_avg, exp_avg_sq)
  gen_state           uint8  the data generator (`torch.Generator.get_state()`)
  queue, queue_sizes  int64  the epoch's batches not yet taken (`real.LengthBatches`)

in `state.safetensors`, and in `state.json` the next step's index, the training seconds so
far (the schedule's time position), the loss EMA, the epochs begun, the optimizer's param
groups, the run's history, and what the state belongs to: the target's identity
(`responses.target_identity`), the training samples' digest (`responses.samples_digest`) and
the training plan (`PLAN_FIELDS`: the settings that shape the head, the data order and the
schedule). A resumed run checks all three (`check_state`) and refuses a checkpoint of another
with one ValueError naming `--checkpoint`. Both files are written to temporary names and
renamed, the record last, and share a token (`saved`), so a half-written pair is refused too.
No pickle: tensors in safetensors, the rest JSON.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = 1
STATE_TENSORS = "state.safetensors"
STATE_RECORD = "state.json"
PLAN_FIELDS = ("seed", "steps", "warmup", "lr", "weight_decay", "decay", "ttt_steps", "batch",
               "batch_tokens", "draft_vocab", "ffn", "lm_head", "total_minutes",
               "heldout_fraction", "heldout_max")
"""The run's settings a resumed run must share with the checkpoint's: the head's shape, the
loss, the data's split and order, the learning-rate schedule. Per-call caps (`max_minutes`,
`deadline_minutes`, `call_steps`), logging and precision may change between calls."""


def plan_of(run) -> dict:
    """The run's `PLAN_FIELDS` values."""
    return {name: getattr(run, name) for name in PLAN_FIELDS}


@dataclass
class TrainState:
    """What the next call continues from (module docstring)."""

    step: int
    """The next step's index: steps 0 .. step - 1 are done."""
    trained_seconds: float
    ema: float | None
    epochs: int
    head: dict[str, torch.Tensor]
    """The trained parameters, fp32 on the host, by name."""
    hot: torch.Tensor
    optimizer: dict
    """`torch.optim.Optimizer.state_dict()`."""
    gen_state: torch.Tensor
    queue: list[list[int]]
    record: dict = field(default_factory=dict)
    """What the state belongs to: "target", "responses", "plan" (`check_state`), "history"."""


def _optimizer_tensors(sd: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    tensors = {}
    for idx, st in sd["state"].items():
        for key, value in st.items():
            if not torch.is_tensor(value):
                raise ValueError(f"optimizer state {idx}.{key}: expected a tensor, got "
                                 f"{type(value).__name__}")
            tensors[f"opt.{idx}.{key}"] = value.detach().to("cpu").contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
              for g in sd["param_groups"]]
    return tensors, groups


def save_state(path: str | os.PathLike, state: TrainState) -> Path:
    """Write `state` into the directory `path` (made if missing) -> the directory."""
    from safetensors.torch import save_file
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    opt, groups = _optimizer_tensors(state.optimizer)
    flat = [i for b in state.queue for i in b]
    tensors = {**{f"head.{n}": t.detach().to("cpu", torch.float32).contiguous()
                  for n, t in state.head.items()},
               "hot": state.hot.detach().to("cpu", torch.int64).contiguous(), **opt,
               "gen_state": state.gen_state.to(torch.uint8),
               "queue": torch.tensor(flat, dtype=torch.int64),
               "queue_sizes": torch.tensor([len(b) for b in state.queue], dtype=torch.int64)}
    token = uuid.uuid4().hex
    save_file(tensors, str(d / (STATE_TENSORS + ".tmp")), metadata={"saved": token})
    os.replace(d / (STATE_TENSORS + ".tmp"), d / STATE_TENSORS)
    record = {"format": FORMAT, "saved": token, "step": state.step,
              "trained_seconds": state.trained_seconds, "ema": state.ema, "epochs": state.epochs,
              "optimizer_groups": groups, **state.record}
    (d / (STATE_RECORD + ".tmp")).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(d / (STATE_RECORD + ".tmp"), d / STATE_RECORD)
    return d


def _refuse(path: Path, why: str) -> ValueError:
    return ValueError(f"checkpoint {path} (--resume): {why}")


def load_state(path: str | os.PathLike) -> TrainState:
    """The state `save_state` wrote into `path`; ValueError naming the checkpoint when it is
    missing, of another format, or its two files are not one save's."""
    from safetensors import safe_open
    d = Path(path)
    if not (d / STATE_RECORD).is_file() or not (d / STATE_TENSORS).is_file():
        raise _refuse(d, f"no training state there (expected {STATE_RECORD} and {STATE_TENSORS}, "
                         f"written by a run with --checkpoint)")
    record = json.loads((d / STATE_RECORD).read_text(encoding="utf-8"))
    if record.get("format") != FORMAT:
        raise _refuse(d, f"format {record.get('format')!r}, expected {FORMAT}")
    with safe_open(str(d / STATE_TENSORS), "pt") as f:
        if (f.metadata() or {}).get("saved") != record["saved"]:
            raise _refuse(d, f"{STATE_TENSORS} and {STATE_RECORD} are not one save's "
                             f"(an interrupted save: resume from an older copy or start fresh)")
        t = {k: f.get_tensor(k) for k in f.keys()}
    state: dict[int, dict] = {}
    for name in (k for k in t if k.startswith("opt.")):
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = t[name]
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()}
              for g in record["optimizer_groups"]]
    queue, at = [], 0
    for n in t["queue_sizes"].tolist():
        queue.append(t["queue"][at: at + n].tolist())
        at += n
    meta = {k: record[k] for k in ("target", "responses", "plan", "history") if k in record}
    return TrainState(record["step"], record["trained_seconds"], record["ema"], record["epochs"],
                      {k[len("head."):]: v for k, v in t.items() if k.startswith("head.")},
                      t["hot"], {"state": dict(sorted(state.items())), "param_groups": groups},
                      t["gen_state"], queue, meta)


def check_state(path: str | os.PathLike, state: TrainState, *, plan: dict,
                target: dict | None = None, responses: dict | None = None) -> None:
    """ValueError naming the checkpoint (every difference listed) unless `state` was written
    by a run of the same training `plan` (`plan_of`), for the same target identity and
    (when given) the same training samples (`{"digest": ..., "heldout": ...}`)."""
    rec, problems = state.record, []
    for name, want in plan.items():
        have = rec.get("plan", {}).get(name)
        if have != want:
            problems.append(f"{name} {have!r} there, {want!r} here")
    if target is not None and rec.get("target") != target:
        problems.append(f"another target (identity {rec.get('target')} there, {target} here)")
    if responses is not None:
        for name, want in responses.items():
            if rec.get("responses", {}).get(name) != want:
                problems.append(f"other training samples ({name} differs: the responses must "
                                f"be the same, e.g. from the same --responses-cache)")
    if problems:
        raise _refuse(Path(path), "written by another training: " + "; ".join(problems)
                      + " (resume with the first call's flags, or start fresh without --resume)")
