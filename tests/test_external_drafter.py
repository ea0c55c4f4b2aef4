"""A drafter written outside the package runs in the chain cycle through the public interface.

`RepeatLastDrafter` proposes the last accepted token again, k times. It meets
`graphdraft.runtime.drafter_protocol.Drafter` with its own buffers (allocated at `bind`) and
torch ops only, so its `draft` is capturable: the Engine runs it inside the cycle graph on a
GPU and eagerly on the CPU. Greedy speculative decoding with it equals target-only decoding.
"""

from __future__ import annotations

import pytest
import torch

from capture import GraphRegistry
from graphdraft.runtime.drafter_protocol import DraftBinding, Drafter, check_drafter
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime
from tests.test_engine import prompts, target_only


class RepeatLastDrafter:
    """Drafts the last accepted token k times (any k in 0..S; capturable)."""

    capturable = True
    variable_draft_length = True

    def __init__(self) -> None:
        self.cycles = 0
        self.mixed_calls = 0
        self.drafted_k: set[int] = set()

    def bind(self, binding: DraftBinding) -> None:
        cfg = binding.cfg
        self.S = cfg.speculative_num_steps
        mb, n, dev = cfg.max_bs, cfg.spec_num_tokens, cfg.device
        self.tokens = torch.zeros(mb * n, dtype=torch.int64, device=dev)    # [max_bs * N]
        self.accept = torch.zeros(mb, dtype=torch.int32, device=dev)        # [max_bs]
        self.next = torch.zeros(mb, self.S + 1, dtype=torch.int32, device=dev)  # [max_bs, S + 1]

    def graphs(self) -> GraphRegistry:
        return GraphRegistry()

    def reset_neutral(self) -> None:
        self.tokens.zero_()
        self.accept.zero_()
        self.next.zero_()

    def hidden_buffer(self, bs: int, n: int) -> None:
        return None  # reads no hidden state

    def accepted_tokens(self, rows: int, n: int) -> torch.Tensor:
        return self.tokens[: rows * n].view(rows, n)

    def accept_lengths(self, rows: int) -> torch.Tensor:
        return self.accept[:rows]

    def _repeat(self, last: torch.Tensor, bs: int) -> torch.Tensor:
        out = self.next[:bs]
        out.copy_(last.to(torch.int32).unsqueeze(1).expand(bs, self.S + 1))
        return out

    def draft(self, bs: int, k: int) -> torch.Tensor:
        self.drafted_k.add(k)
        toks = self.accepted_tokens(bs, k + 1)
        at = (self.accept[:bs].long() - 1).clamp(min=0).unsqueeze(1)        # [bs, 1]
        return self._repeat(toks.gather(1, at).squeeze(1), bs)

    def draft_mixed(self, ctx, hidden_states, output_tokens, accept_lengths) -> torch.Tensor:
        self.mixed_calls += 1
        ne, nd, n = ctx.num_extends, ctx.bs - ctx.num_extends, self.S + 1
        dec = output_tokens[ne:].view(nd, n)
        at = (accept_lengths[ne:].long() - 1).clamp(0, n - 1).unsqueeze(1)
        last = torch.cat([output_tokens[:ne], dec.gather(1, at).squeeze(1)])
        return self._repeat(last, ctx.bs)

    def on_cycle(self, k: int) -> None:
        self.cycles += 1


def _serve(target, cfg, drafter, ps, max_new: int):
    eng = Engine(target, cfg, drafter=drafter)
    if cfg.device.startswith("cuda"):
        eng.capture_graphs(progress=False)
    return eng, eng.generate(ps, SamplingParams(max_new_tokens=max_new))


def test_the_external_drafter_meets_the_protocol():
    d = RepeatLastDrafter()
    assert check_drafter(d) is d and isinstance(d, Drafter)


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_greedy_with_an_external_drafter_equals_target_only_eagerly(policy):
    target, _ = make_models(5)
    ps = prompts(6, 5)
    cfg = runtime(speculative_num_steps=3, speculative_policy=policy)
    expected = target_only(target, cfg, ps, 14)
    d = RepeatLastDrafter()
    eng, got = _serve(target, cfg, d, ps, 14)
    assert got == expected
    summary = eng.graph_summary()
    assert summary["spec_cycle"][1] == d.cycles > 0  # every decode cycle ran its draft
    assert d.mixed_calls > 0 and "draft_multi_step" not in summary
    assert d.drafted_k <= set(eng.steps)


@pytest.mark.gpu
def test_greedy_with_an_external_drafter_in_the_cycle_graph_equals_target_only():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target, _ = make_models(5, dtype=torch.float32, device="cuda")
    ps = prompts(6, 5)
    cfg = runtime(speculative_num_steps=3, dtype="float32", device="cuda")
    expected = target_only(target, cfg, ps, 14)
    d = RepeatLastDrafter()
    eng, got = _serve(target, cfg, d, ps, 14)
    assert got == expected
    replays, eager = eng.graph_summary()["spec_cycle"]
    assert replays > 0 and eager == 0 and d.cycles == replays  # drafted inside the graph
