"""Where one prefill / mixed step's launches go, per phase (issue #41): a CPU count, not a timing.

`TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 -m perf.studies.mixed_launches [--decoding 16]
[--admitted 4] [--unpadded]`

The shipped pair on the CPU with the Triton kernels (under the interpreter), `--decoding`
requests decoding, then `--admitted` more join: the next `Engine.step()` is a mixed step, its
aten ops and Triton launches counted by phase (`tree_launches.launch_counter`, the phases
below). By default the padded path a CUDA server takes is forced on (`MixedTargetGraphs`
active, the padded draft, as tests/test_mixed_draft_graphs.py does on the CPU): the phases
marked "(graph)" are one CUDA-graph replay each on a GPU; the rest runs eagerly there, each
launch a few microseconds of host time. `--unpadded`: the CPU's own unpadded path.
"""

from __future__ import annotations

import argparse
import sys

import torch

from perf.studies import tree_launches as tl


def phase_points() -> list[tuple[object, str, str]]:
    from capture import CapturedForward
    from graphdraft import ops
    from graphdraft.models.eagle3 import Eagle3DraftHead
    from graphdraft.models.llama import LlamaForCausalLM
    from graphdraft.runtime.drafter import EagleDrafter
    from graphdraft.runtime.slot_state import SlotState
    from graphdraft.serving.cycles import base, chain, mixed_graphs
    from graphdraft.serving.engine import Engine
    return [
        (CapturedForward, "run", "captured (graph)"), (Engine, "plan_step", "plan_step"),
        (SlotState, "_write_admissions", "admission"), (Engine, "_stage_rows", "stage_rows"),
        (chain, "write_batch", "write_batch"), (base.DecodeMode, "prepare", "prepare"),
        (base.DecodeMode, "target_forward", "target_forward"),
        (mixed_graphs.MixedTargetGraphs, "run", "padded target set-up"),
        (mixed_graphs.MixedTargetGraphs, "_forward", "target fwd (graph)"),
        (base.DecodeMode, "accept", "accept"), (base.DecodeMode, "token_logprobs", "logprobs"),
        (ops, "apply_logit_controls", "controls"), (base.DecodeMode, "commit", "commit"),
        (EagleDrafter, "draft_mixed", "draft set-up"),
        (EagleDrafter, "draft_mixed_padded", "draft set-up"),
        (EagleDrafter, "_prepare_mixed_ids", "draft ids"),
        (EagleDrafter, "_mixed_first_step", "draft first step (graph)"),
        (EagleDrafter, "_multi_step", "draft multi-step (graph)"),
        (LlamaForCausalLM, "forward", "target fwd (graph)"),
        (Eagle3DraftHead, "forward", "draft head (graph)"),
        (chain.ChainMode, "rebuild_deferred_kv", "draft KV rebuild")]


def count(decoding: int, admitted: int, padded: bool) -> tl.Counts:
    """The launches of the mixed step that admits `admitted` requests beside `decoding`."""
    from graphdraft.serving.cli import build_parser
    from graphdraft.serving.cli.serve import build_engine
    from graphdraft.serving.verify import SamplingParams

    eng, _ = build_engine(build_parser().parse_args(
        ["serve", "--device", "cpu", "--kernel-backend", "triton", "--quiet",
         "--max-running-requests", str(decoding + admitted)]))
    if padded:
        eng.mode.mixed_target.active = True
        eng.mode.padded_draft = eng.mode._pad_mixed_draft(eng.mode.drafter)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)

    def add(n: int) -> None:
        for _ in range(n):
            eng.add_request(torch.randint(3, 200, (40,), generator=gen).tolist(), params)
    add(decoding)
    while eng.waiting or any(r.prefilling for r in eng.running):
        eng.step()
    for _ in range(3):
        eng.step()
    add(admitted)
    stack = tl._PhaseStack()
    with tl.labelled(stack, phase_points()), tl.launch_counter(stack) as counts:
        eng.step()
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decoding", type=int, default=16)
    p.add_argument("--admitted", type=int, default=4)
    p.add_argument("--unpadded", action="store_true")
    a = p.parse_args(argv)
    counts = count(a.decoding, a.admitted, not a.unpadded)
    eager = sum(v for ph, v in counts.ops.items() if "(graph)" not in ph)
    print(f"mixed step ({'unpadded' if a.unpadded else 'padded'}), {a.decoding} decoding + "
          f"{a.admitted} admitted: {counts.total} launches, {eager} outside '(graph)' phases")
    for ph, n in counts.ops.most_common():
        print(f"  {ph:<26}{n:>5}   " + ", ".join(
            f"{o} x{v}" for o, v in counts.by_phase_op[ph].most_common(8)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
