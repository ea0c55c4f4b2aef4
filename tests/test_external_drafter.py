"""A drafter written outside the package runs in the chain cycle through the public interface.

`RepeatLastDrafter` proposes the last accepted token again, k times. It meets
`graphdraft.runtime.drafter_protocol.Drafter` on the public `TokenDrafter` base (the buffers
the acceptance writes, allocated at `bind`) with torch ops only, so its `draft` is capturable:
the Engine runs it inside the cycle graph on a GPU and eagerly on the CPU. Greedy speculative decoding with it equals target-only decoding.
"""

from __future__ import annotations

import pytest
import torch

from graphdraft.runtime.drafter_protocol import Drafter, TokenDrafter, check_drafter
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime
from tests.test_engine import prompts, target_only


class RepeatLastDrafter(TokenDrafter):
    """Drafts the last accepted token k times (any k in 0..S; capturable)."""

    def __init__(self) -> None:
        super().__init__()
        self.mixed_calls = 0
        self.drafted_k: set[int] = set()

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
