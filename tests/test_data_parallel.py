"""Data-parallel attention on CPU: 2 and 4 gloo ranks (spawned, FileStore) in lock-step.

Every rank serves its own requests (different counts, prompt lengths and arrival steps: a
rank idle for several steps, one rank only mid-chunk prefill while another decodes, joins
and leaves) with the MLPs split over the ranks (`shard_dense_`), and must emit exactly the
tokens a single-process run over its requests emits (greedy, float64 tiny models). Every
rank records its collectives and each step's agreed plan: all ranks must have issued the
same sequence. The process group has a 30 s timeout, so a rank waiting on a collective the
others never issue raises (the spawn fails the test) instead of hanging.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from capture import CapturedForward
from capture.graphs import _Graph
from graphdraft.serving.data_parallel import (
    PLAN_FIELDS,
    DataParallel,
    agree_sizes,
    gather_outputs,
    local_plan,
    lockstep_plan,
    replay_mask,
    shard_dense_,
    spread,
)
from graphdraft.serving.engine import Engine
from graphdraft.serving.verify import SamplingParams
from tests.engine_harness import make_models, runtime

TIMEOUT_S = 30
LAST_JOIN = 12  # the last step any rank admits a request at (`_joins`)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 61, (n,), generator=g).tolist()


def _joins(rank: int, world: int) -> dict[int, list[tuple[list[int], int]]]:
    """Per step, the (prompt, max_new_tokens) this rank admits at that step.

    rank 0: a 20-token prompt at step 0 (chunks of 16: mid-chunk), a short one at step 1
            that decodes for many steps;
    rank 1: a 24-token prompt at step 0 (both ranks mid-chunk: the global multi-step skip)
            that leaves after 2 tokens; idle for 3 steps; a 40-token prompt joins at
            step 6 (mid-chunk for 2 steps while rank 0 decodes); another at step 12;
    rank 2: two requests at once, different lengths and budgets;
    rank 3: idle all along (the dummy row every step).
    """
    if rank == 0:
        return {0: [(_prompt(1, 20), 6)], 1: [(_prompt(2, 3), 16)]}
    if rank == 1:
        return {0: [(_prompt(7, 24), 2)], 6: [(_prompt(3, 40), 5)], 12: [(_prompt(4, 5), 4)]}
    if rank == 2:
        return {0: [(_prompt(5, 7), 3), (_prompt(6, 11), 8)]}
    return {}


def _cfg(**kw):
    return runtime(speculative_num_steps=3, max_num_batched_tokens=16, **kw)


def _drive(eng: Engine, joins: dict) -> list[list[int]]:
    """Step with the given arrivals until no rank has work (the loop condition is agreed)."""
    reqs, k = [], 0
    while k <= LAST_JOIN or eng.keep_stepping:  # same k and agreed work flag on every rank
        for prompt, new in joins.get(k, []):
            reqs.append(eng.add_request(prompt, SamplingParams(max_new_tokens=new)))
        eng.step()
        k += 1
        assert k < 200
    eng.drain()
    return [r.output for r in reqs]


def _scenarios(dp: DataParallel, world: int) -> dict:
    res: dict = {}
    joins = _joins(dp.rank, world)
    # speculative decoding, target and head MLPs split over the ranks
    target, head = make_models(3, draft_vocab=40)
    shard_dense_(target, dp)
    shard_dense_(head, dp)
    dp.log, dp.decisions = [], []
    eng = Engine(target, _cfg(dp_size=world), head)
    res["spec"] = _drive(eng, joins)
    res["spec_log"], res["spec_plans"] = dp.log, dp.decisions
    res["skipped"] = eng.drafter.stats.skipped_multi_step
    res["mlp_shape"] = tuple(target.layers[0].mlp.down_proj.shape)
    if world == 2:
        # target-only (one token a row) and a replicated head (no collective in the draft)
        target, head = make_models(3, draft_vocab=40)
        shard_dense_(target, dp)
        dp.log, dp.decisions = [], []
        res["target_only"] = _drive(Engine(target, _cfg(dp_size=world)), joins)
        res["target_only_log"] = dp.log
        dp.log = []
        res["replicated_head"] = _drive(Engine(target, _cfg(dp_size=world, cycle_graph=False),
                                               head), joins)
        res["replicated_head_log"] = dp.log
        # requests spread over ranks, outputs gathered to rank 0 (Engine.generate)
        prompts = [_prompt(20 + i, 4 + 3 * i) for i in range(5)]
        mine = spread(prompts, dp)
        target, head = make_models(3, draft_vocab=40)
        shard_dense_(target, dp)
        shard_dense_(head, dp)
        dp.log = None
        outs = Engine(target, _cfg(dp_size=world), head).generate(
            [prompts[i] for i in mine], SamplingParams(max_new_tokens=6))
        res["gathered"] = gather_outputs(outs, mine, len(prompts), dp)
        res["spread_prompts"] = prompts
        # capture sizes agreed after a (simulated) out-of-memory drop on rank 1
        cf = CapturedForward("dp_test", lambda bs: torch.zeros(bs), [1, 2, 4, 8], enabled=False)
        for bs in ([1, 2, 4, 8] if dp.rank == 0 else [1, 2, 8]):
            cf._graphs[bs] = _Graph(None, None)
        cf._reindex()
        res["agreed"] = cf.restrict_to(agree_sizes(dp, cf.captured_sizes, 8))
        res["lookup_3"] = cf._lookup[3]
    return res


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        res = _scenarios(DataParallel.from_group(), world)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path_factory, world: int) -> list[dict]:
    d = tmp_path_factory.mktemp(f"dp{world}")
    torch.multiprocessing.spawn(_worker, args=(world, str(d / "store"), str(d)), nprocs=world,
                                join=True)
    return [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _spawn(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _spawn(tmp_path_factory, 4)


def _reference(rank: int, world: int, head: bool = True) -> list[list[int]]:
    """A single-process run (no data parallelism) over `rank`'s requests."""
    target, h = make_models(3, draft_vocab=40)
    joins = _joins(rank, world)
    items = [x for k in sorted(joins) for x in joins[k]]
    if not items:
        return []
    eng = Engine(target, _cfg(), h if head else None)
    return [eng.generate([p], SamplingParams(max_new_tokens=n))[0] for p, n in items]


# ---------------------------------------------------------------------------
# Lock-step runs == single-process runs over each rank's requests
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_matches_a_single_process_run(world, request):
    ranks = request.getfixturevalue({2: "two", 4: "four"}[world])
    for rank, got in enumerate(ranks):
        ref = _reference(rank, world)
        assert got["spec"] == ref, f"rank {rank}"
        assert all(len(o) > 0 for o in got["spec"])
        # the MLP holds this rank's slice: F / world columns of down_proj
        assert got["mlp_shape"] == (32, 64 // world)
    if world == 4:
        assert ranks[3]["spec"] == []


def test_target_only_and_replicated_head_match(two):
    for rank, got in enumerate(two):
        assert got["target_only"] == _reference(rank, 2, head=False)
        assert got["replicated_head"] == _reference(rank, 2)
        # a replicated head draws no collective: per step only the target's MLPs gather
        names = {n for n, _ in got["replicated_head_log"]}
        assert names == {"all_gather_ints", "all_gather", "reduce_scatter"}


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_issued_the_same_collectives_and_plans(world, request):
    ranks = request.getfixturevalue({2: "two", 4: "four"}[world])
    keys = ["spec_log", "spec_plans"] + (["target_only_log", "replicated_head_log"]
                                         if world == 2 else [])
    for key in keys:
        first = ranks[0][key]
        assert len(first) > 10
        for got in ranks[1:]:
            assert got[key] == first, key
    plans = ranks[0]["spec_plans"]
    # the scenario covers: mixed and pure decode steps, a rank idle while others run,
    # graph-or-eager decided for all, the global multi-step skip (every rank mid-chunk)
    assert any(p.mixed for p in plans) and any(not p.mixed and p.any_rows for p in plans)
    assert all(p.eager for p in plans)  # CPU: graphs off on every rank
    assert all(p.rows is None for p in plans if not p.mixed)
    assert any(p.all_mid_chunk for p in plans) == (world == 2)
    rows = lambda p, r: dict(zip(PLAN_FIELDS, p.table[r][:len(PLAN_FIELDS)], strict=True))
    # a rank idle for several consecutive steps while another runs
    idle = [not rows(p, 1 if world == 2 else 3)["has_rows"] and p.any_rows for p in plans]
    assert any(all(idle[i:i + 3]) for i in range(len(idle)))
    # one rank only mid-chunk prefill while another decodes
    assert any(rows(p, 1)["mid_chunk"] and rows(p, 0)["has_rows"] and not rows(p, 0)["mixed"]
               for p in plans) or world == 4


def test_multi_step_skip_is_global(two, four):
    # 2 ranks: at step 0 both ranks only prefill mid-chunk -> both skipped the multi-step
    assert two[0]["skipped"] == two[1]["skipped"] > 0
    # 4 ranks: rank 3 is idle every step (its dummy row drafts) -> nobody skipped
    assert all(got["skipped"] == 0 for got in four)


def test_outputs_are_gathered_to_rank_0(two):
    prompts = two[0]["spread_prompts"]
    target, head = make_models(3, draft_vocab=40)
    ref = Engine(target, _cfg(), head).generate(prompts, SamplingParams(max_new_tokens=6))
    assert two[0]["gathered"] == ref
    assert two[1]["gathered"] is None


def test_capture_sizes_agreed_after_an_oom_drop(two):
    # rank 1 lost bs 4 to out-of-memory: every rank keeps [1, 2, 8] and pads 3 -> 8 alike
    assert two[0]["agreed"] == two[1]["agreed"] == [1, 2, 8]
    assert two[0]["lookup_3"] == two[1]["lookup_3"] == 8


# ---------------------------------------------------------------------------
# The decision functions (no processes)
# ---------------------------------------------------------------------------
SCHED = [1, 2, 4, 8, 16]
FULL = (1 << len(SCHED)) - 1  # every size would replay


def test_lockstep_plan_pads_to_the_largest_rank_and_mixes_all():
    decode = local_plan(SCHED, 4, prefill_lens=[], num_decodes=3, mid_chunk=False,
                        replay=FULL, has_work=True)
    idle = local_plan(SCHED, 4, prefill_lens=[], num_decodes=0, mid_chunk=False,
                      replay=FULL, has_work=False)
    prefill = local_plan(SCHED, 4, prefill_lens=[10, 3], num_decodes=1, mid_chunk=False,
                         replay=FULL, has_work=True)
    p = lockstep_plan([decode, idle], SCHED)
    assert (p.any_rows, p.mixed, p.padded_bs, p.rows, p.eager, p.any_work) == (
        True, False, 4, None, False, True)
    assert not p.all_mid_chunk  # the idle rank's dummy decode row drafts every step
    p = lockstep_plan([decode, prefill, idle], SCHED)
    # mixed everywhere, eager, gather size = the largest need: 10 + 3 + 1 * 4 tokens
    assert (p.mixed, p.eager, p.rows) == (True, True, 17)
    p = lockstep_plan([idle, idle], SCHED)
    assert not p.any_rows and not p.any_work


def test_lockstep_plan_mid_chunk_skip_needs_every_rank():
    mid = local_plan(SCHED, 4, prefill_lens=[16], num_decodes=0, mid_chunk=True,
                     replay=FULL, has_work=True)
    last = local_plan(SCHED, 4, prefill_lens=[16], num_decodes=0, mid_chunk=False,
                      replay=FULL, has_work=True)
    assert lockstep_plan([mid, mid], SCHED).all_mid_chunk
    assert not lockstep_plan([mid, last], SCHED).all_mid_chunk


def _rank_forward(captured: list[int]) -> CapturedForward:
    """A rank's forward as a CUDA machine would hold it: enabled, `captured` graphs present
    (placeholders: only the decision is under test on CPU)."""
    cf = CapturedForward("f", lambda bs: torch.zeros(bs), SCHED, enabled=False)
    cf._enabled = True
    for bs in captured:
        cf._graphs[bs] = _Graph(None, None)
    cf._reindex()
    return cf


def test_graph_or_eager_decision_is_the_same_for_every_rank(monkeypatch):
    monkeypatch.delenv("GRAPHDRAFT_EAGER", raising=False)
    # per-rank captured sets differ (an OOM drop of 4 on rank 1)
    ranks = [_rank_forward(c) for c in ([1, 2, 4, 8, 16], [1, 2, 8, 16], [1, 2, 4, 8, 16])]
    masks = [replay_mask([f], SCHED) for f in ranks]
    assert masks == [FULL, FULL & ~(1 << 2), FULL]

    def plan(bs_per_rank):
        return lockstep_plan([local_plan(SCHED, 4, prefill_lens=[], num_decodes=b,
                                         mid_chunk=False, replay=m, has_work=True)
                              for b, m in zip(bs_per_rank, masks, strict=True)], SCHED)

    # rank 1 alone lacks the graph of 4: a batch padded to 4 runs eagerly on every rank
    assert plan([3, 1, 0]).padded_bs == 4 and plan([3, 1, 0]).eager
    assert plan([1, 2, 0]).padded_bs == 2 and not plan([1, 2, 0]).eager
    assert not plan([5, 0, 0]).eager and plan([5, 0, 0]).padded_bs == 8
    # above the schedule: eager everywhere
    big = lockstep_plan([local_plan(SCHED, 4, prefill_lens=[], num_decodes=17, mid_chunk=False,
                                    replay=FULL, has_work=True)] * 2, SCHED)
    assert big.eager and big.padded_bs == 17
    # GRAPHDRAFT_EAGER on one rank only: its mask is empty, so all run eagerly
    monkeypatch.setenv("GRAPHDRAFT_EAGER", "1")
    assert replay_mask([ranks[0]], SCHED) == 0
    monkeypatch.delenv("GRAPHDRAFT_EAGER")
    # after the capture agreement (restrict_to the intersection) every rank decides alike
    common = sorted(set.intersection(*(set(f.captured_sizes) for f in ranks)))
    for f in ranks:
        f.restrict_to(common)
    assert len({replay_mask([f], SCHED) for f in ranks}) == 1
    assert {f._decide(3) for f in ranks} == {8}


def test_replay_mask_words_cover_long_schedules():
    sched = list(range(1, 131))  # 130 sizes: 3 words of 63 bits
    row = local_plan(sched, 1, prefill_lens=[], num_decodes=129, mid_chunk=False,
                     replay=1 << 128, has_work=True)
    assert len(row) == len(PLAN_FIELDS) + 3
    assert not lockstep_plan([row, row], sched).eager  # 129 -> bit 128 set on both
    other = local_plan(sched, 1, prefill_lens=[], num_decodes=1, mid_chunk=False,
                       replay=(1 << 128) - 1, has_work=True)
    assert lockstep_plan([row, other], sched).eager
    with pytest.raises(ValueError, match="table"):
        lockstep_plan([row[:-1], row[:-1]], sched)


def test_forced_eager_runs_eagerly_and_counts_it():
    cf = CapturedForward("f", lambda bs: torch.ones(bs), [1, 2], enabled=False)
    with cf.forced_eager():
        assert torch.equal(cf.run(2), torch.ones(2))
    assert cf.stats.eager["disabled"] == 1  # not enabled (CPU): rule 1 comes first
    cf._enabled = True  # what a CUDA machine has: forced_eager comes before any graph
    cf._graphs[2] = _Graph(None, None)
    cf._reindex()
    with cf.forced_eager():
        assert cf._decide(2) == "lockstep"
        cf.run(1)
    assert cf._decide(2) == 2 and cf.stats.eager["lockstep"] == 1


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------
def test_dp_size_one_is_todays_engine():
    target, head = make_models(0)
    before = {n: p for n, p in target.named_parameters()}
    assert shard_dense_(target, None) is target and shard_dense_(target, DataParallel(0, 1))
    assert all(a is before[n] for n, a in target.named_parameters()) and target.dp is None
    eng = Engine(target, _cfg(), head)
    assert eng.dp is None and _cfg().dp_size == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="dp_size"):
        _cfg(dp_size=0)
    with pytest.raises(ValueError, match="rank"):
        DataParallel(2, 2)
    target, head = make_models(0)
    with pytest.raises(ValueError, match="dp_size"):  # dp_size 2 without split models
        Engine(target, _cfg(dp_size=2), head)
    shard_dense_(target, DataParallel(0, 2))  # slicing needs no group
    with pytest.raises(ValueError, match="dp_size"):
        Engine(target, _cfg(), head)
    eng = Engine(target, _cfg(dp_size=2), head)  # a whole head is fine (no collective)
    with pytest.raises(ValueError, match="parallel_precompile"):
        eng.capture_graphs(parallel_precompile=True)
    with pytest.raises(ValueError, match="already sharded"):
        shard_dense_(target, DataParallel(0, 2))
    t3, _ = make_models(0)
    with pytest.raises(ValueError, match="intermediate_size"):
        shard_dense_(t3, DataParallel(0, 3))
    assert t3.dp is None and t3.layers[0].mlp.dp is None
    from graphdraft.parallel import TensorParallel, shard_
    with pytest.raises(ValueError, match="data-parallel"):
        shard_(target, TensorParallel(0, 2))
    dp = DataParallel(0, 2)
    dp.rows = 1
    with pytest.raises(ValueError, match="rows"):
        dp.dense(torch.zeros(2, 4), lambda x: x)


# ---------------------------------------------------------------------------
# The CLI: torchrun-style environment, `graphdraft generate --dp-size 2`
# ---------------------------------------------------------------------------
CLI_ARGS = ["generate", "--device", "cpu", "--prompt", "def foo", "--prompt", "import os",
            "--prompt", "class A", "--max-new-tokens", "10", "--json", "--quiet"]


def _cli_worker(rank: int, port: int, out_dir: str) -> None:
    import contextlib
    import io

    from graphdraft.serving.cli import main

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(CLI_ARGS + ["--dp-size", "2"])
    with open(os.path.join(out_dir, f"cli{rank}.txt"), "w") as f:
        f.write(f"{code}\n{buf.getvalue()}")


def test_cli_dp_size_serves_over_ranks_and_prints_on_rank_0(tmp_path, capsys):
    import json
    import socket

    from graphdraft.serving.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_cli_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    code0, out0 = (tmp_path / "cli0.txt").read_text().split("\n", 1)
    code1, out1 = (tmp_path / "cli1.txt").read_text().split("\n", 1)
    assert code0 == code1 == "0" and out1 == ""  # rank 1 prints nothing
    got = json.loads(out0)
    assert main(CLI_ARGS) == 0
    ref = json.loads(capsys.readouterr().out)
    assert got["dp_size"] == 2
    assert [o["token_ids"] for o in got["outputs"]] == [o["token_ids"] for o in ref["outputs"]]
    assert [o["index"] for o in got["outputs"]] == [0, 1, 2]


def test_cli_dp_size_needs_a_launcher(monkeypatch, capsys):
    from graphdraft.serving.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(CLI_ARGS + ["--dp-size", "2"]) == 2
    assert "dp_size" in capsys.readouterr().err
    assert main(["demo", "--dp-size", "2", "--device", "cpu"]) == 2
    assert "--dp-size" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# GPU (`make test-gpu`): forced_eager on real graphs (1 GPU); NCCL ranks (>= 2 GPUs)
# ---------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_forced_eager_runs_eagerly_over_captured_graphs():
    from capture import GraphPool

    x = torch.randn(8, 16, device="cuda")
    w = torch.randn(16, 16, device="cuda")
    cf = CapturedForward("f", lambda bs: x[:bs] @ w, [2, 8], pool=GraphPool())
    cf.capture(progress=False)
    assert cf.captured_sizes == [2, 8]
    ref = (x[:2] @ w).clone()
    with cf.forced_eager():
        assert cf._decide(2) == "lockstep"
        out = cf.run(2)
    assert torch.equal(out, ref) and cf.stats.eager["lockstep"] == 1
    assert cf.stats.total_replays == 0
    assert torch.equal(cf.run(2)[:2], ref) and cf.stats.total_replays == 1
    # sizes agreed after a drop: the restricted set pads alike on every rank
    assert cf.restrict_to([8]) == [8] and cf._decide(2) == 8


def _gpu_worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=120),
                            device_id=torch.device("cuda", rank))
    try:
        dp = DataParallel.from_group()
        dp.cpu_group = dist.new_group(backend="gloo")
        dp.warmup(f"cuda:{rank}")
        target, head = make_models(3, dtype=torch.float32, draft_vocab=40)
        shard_dense_(target, dp)
        shard_dense_(head, dp)
        target, head = target.to(f"cuda:{rank}"), head.to(f"cuda:{rank}")
        cfg = _cfg(dp_size=world, device=f"cuda:{rank}", dtype="float32")
        eng = Engine(target, cfg, head)
        eng.capture_graphs(progress=False)
        dp.decisions = []
        outs = _drive(eng, _joins(rank, world))
        torch.save({"out": outs, "plans": dp.decisions, "graphs": eng.graph_summary(),
                    "captured": eng.cycle_graphs.captured_sizes},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_gpu_nccl_ranks_with_graphs_match_one_gpu(tmp_path):
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs >= 2 GPUs (the multi-GPU data-parallel run is tracked separately)")
    torch.multiprocessing.spawn(_gpu_worker, args=(world, str(tmp_path / "store"), str(tmp_path)),
                                nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert all(r["plans"] == ranks[0]["plans"] for r in ranks)
    assert any(not p.eager for p in ranks[0]["plans"])  # some decode cycles replayed graphs
    assert all(r["captured"] == ranks[0]["captured"] for r in ranks)
    for rank, got in enumerate(ranks):
        target, head = make_models(3, dtype=torch.float32, draft_vocab=40)
        cfg = _cfg(device="cuda:0", dtype="float32", enforce_eager=True)
        eng = Engine(target.to("cuda:0"), cfg, head.to("cuda:0"))
        joins = _joins(rank, world)
        ref = [eng.generate([p], SamplingParams(max_new_tokens=n))[0]
               for k in sorted(joins) for p, n in joins[k]]
        assert got["out"] == ref, f"rank {rank}"
        assert got["graphs"]["spec_cycle"][0] > 0  # replays
