"""Config validation, page table and allocator, logits processing, batch writing."""

from __future__ import annotations

import contextlib

import pytest
import torch

from graphdraft.config import ModelConfig, RuntimeConfig
from graphdraft.models.logits import LogitsProcessor
from graphdraft.runtime.batch import BatchRow, ForwardContext, ForwardMode, write_batch
from graphdraft.runtime.buffers import InputBuffers
from graphdraft.runtime.kv_cache import KVPool, OutOfPagesError, PageTable


@pytest.mark.parametrize("kw,name", [
    ({"speculative_num_steps": 0}, "speculative_num_steps"),
    ({"page_size": 0}, "page_size"),
    ({"max_running_requests": 0}, "max_running_requests"),
    ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs"),
    ({"cuda_graph_max_bs": 128, "max_running_requests": 64}, "cuda_graph_max_bs"),
    ({"cuda_graph_bs": (4, 2)}, "cuda_graph_bs"),
    ({"cuda_graph_bs": (1, 2, 128)}, "cuda_graph_bs"),
    ({"dtype": "int8"}, "dtype"),
    ({"kernel_backend": "cuda"}, "kernel_backend"),
    ({"device": "tpu"}, "device"),
])
def test_runtime_config_names_bad_field(kw, name):
    with pytest.raises(ValueError, match=name):
        RuntimeConfig(**{"device": "cpu", **kw})


def test_runtime_config_defaults_work():
    cfg = RuntimeConfig(device="cpu")
    assert cfg.spec_num_tokens == cfg.speculative_num_steps + 1
    assert cfg.total_kv_pages == cfg.max_running_requests * cfg.max_pages_per_req + 1
    assert not cfg.use_triton


@pytest.mark.parametrize("kw,name", [
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"head_dim": 7}, "head_dim"),
    ({"draft_vocab_size": 10**9}, "draft_vocab_size"),
])
def test_model_config_names_bad_field(kw, name):
    with pytest.raises(ValueError, match=name):
        ModelConfig(**kw)


def test_aux_layer_defaults():
    assert ModelConfig(num_hidden_layers=32).aux_layer_ids() == (2, 16, 29)
    assert ModelConfig(aux_hidden_state_layer_ids=[1, 5]).num_aux_hidden_states == 2


def test_page_table_alloc_reserve_free_all_or_nothing():
    pt = PageTable(max_reqs=3, max_pages_per_req=4, num_pages=6, page_size=2, device="cpu")
    a, b = pt.alloc_slot(), pt.alloc_slot()
    assert 0 not in (a, b)
    pt.reserve(a, 5)  # 3 pages
    assert pt.capacity(a) == 6 and pt.num_free_pages == 2
    assert pt.req_to_page[a, :3].tolist() == pt.pages_of(a) and 0 not in pt.pages_of(a)
    table_before = pt.req_to_page.clone()
    with pytest.raises(OutOfPagesError):
        pt.reserve(b, 7)  # needs 4 pages, 2 free: nothing changes
    assert pt.num_free_pages == 2 and torch.equal(pt.req_to_page, table_before)
    with pytest.raises(ValueError, match="length"):
        pt.reserve(a, 9)  # beyond the row's 4 pages
    pt.free(a)
    assert pt.num_free_pages == 5 and int(pt.req_to_page[a].abs().sum()) == 0
    with pytest.raises(ValueError, match="slot"):
        pt.free(a)
    assert int(pt.req_to_page[0].abs().sum()) == 0  # the dummy row never changes


def test_page_table_batched_writes_equal_one_by_one():
    """Inside `batched()` the host state changes at once and the device table on exit, equal
    to reserving one by one; a slot freed inside drops its pending writes; nested: the
    outermost writes."""
    def table(batched: bool) -> torch.Tensor:
        pt = PageTable(max_reqs=4, max_pages_per_req=4, num_pages=12, page_size=2, device="cpu")
        a, b, c = pt.alloc_slot(), pt.alloc_slot(), pt.alloc_slot()
        with pt.batched() if batched else contextlib.nullcontext():
            pt.reserve(a, 3)
            with pt.batched() if batched else contextlib.nullcontext():
                pt.reserve(b, 8)
            if batched:
                assert int(pt.req_to_page.abs().sum()) == 0  # not written yet
                assert pt.capacity(b) == 8  # the host state is
            pt.reserve(c, 2)
            pt.free(c)  # its pending write must not land in the freed row
            pt.reserve(a, 6)  # a's second reservation: its next page
        return pt.req_to_page, [pt.pages_of(a), pt.pages_of(b)]

    (one, pages), (batch, pages_b) = table(False), table(True)
    assert torch.equal(one, batch) and pages == pages_b
    assert one[1, :3].tolist() == pages[0] and one[2].tolist() == pages[1]
    assert int(one[3].abs().sum()) == 0 and int(one[0].abs().sum()) == 0


def test_kv_pool_shapes():
    pool = KVPool(2, 5, 4, 2, 8, torch.float32, "cpu")
    assert pool.k[0].shape == (20, 2, 8) and pool.num_slots == 20
    with pytest.raises(ValueError, match="num_pages"):
        KVPool(1, 1, 4, 2, 8, torch.float32, "cpu")


def test_kv_pool_zero_dummy_page_touches_page_zero_only():
    pool = KVPool(2, 3, 4, 2, 8, torch.float32, "cpu")
    for t in (*pool.k, *pool.v):
        t.fill_(7.0)
    pool.zero_dummy_page()
    for t in (*pool.k, *pool.v):
        assert torch.count_nonzero(t[:4]) == 0
        assert torch.all(t[4:] == 7.0)


def test_logits_processor_maps_argmax_and_writes_outputs():
    hidden = torch.randn(5, 8)
    lm_head = torch.randn(11, 8)
    hot = torch.arange(11) * 3
    ids_out, tokens_out = torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int32)
    out = LogitsProcessor(hot)(hidden, lm_head, ids_out=ids_out, tokens_out=tokens_out)
    assert torch.equal(out.next_token_logits, hidden @ lm_head.T)
    assert torch.equal(out.next_token_ids, hot[(hidden @ lm_head.T).argmax(-1)])
    assert torch.equal(ids_out, out.next_token_ids) and torch.equal(tokens_out, ids_out.int())
    plain = LogitsProcessor()(hidden, lm_head)  # no map: draft ids are target ids
    assert torch.equal(plain.next_token_ids, (hidden @ lm_head.T).argmax(-1))


def test_forward_context_modes_and_errors():
    assert ForwardContext(bs=2, num_extends=0, input_num_tokens=8).forward_mode is ForwardMode.DECODE
    assert ForwardContext(bs=2, num_extends=1, input_num_tokens=9).forward_mode is ForwardMode.MIXED
    assert ForwardContext(bs=0, num_extends=0, input_num_tokens=0).forward_mode is ForwardMode.IDLE
    with pytest.raises(ValueError, match="num_extends"):
        ForwardContext(bs=2, num_extends=3, input_num_tokens=9)
    with pytest.raises(ValueError, match="forward_mode"):
        ForwardContext(bs=2, num_extends=0, input_num_tokens=8, forward_mode=ForwardMode.EXTEND)


def test_write_batch_layout_and_slots():
    cfg = RuntimeConfig(device="cpu", page_size=4, max_running_requests=4, max_context_len=32,
                        max_num_batched_tokens=32, cuda_graph_max_bs=4)
    pt = PageTable(4, cfg.max_pages_per_req, cfg.total_kv_pages, 4, "cpu")
    ib = InputBuffers.allocate(cfg)
    a, b = pt.alloc_slot(), pt.alloc_slot()
    pt.reserve(a, 10)
    pt.reserve(b, 10)
    rows = [BatchRow(a, 0, [5, 6, 7], True, [6, 7, -1]), BatchRow(b, 6, [1, 2, 3, 4], False)]
    ctx = write_batch(ib, pt, rows)
    assert (ctx.bs, ctx.num_extends, ctx.input_num_tokens) == (2, 1, 7)
    assert not ctx.all_extends_mid_chunk
    pb = pt.pages_of(b)
    assert ib.out_cache_loc[3:7].tolist() == [pb[p // 4] * 4 + p % 4 for p in range(6, 10)]
    assert ib.positions[:7].tolist() == [0, 1, 2, 6, 7, 8, 9]
    assert ib.seq_lens[:2].tolist() == [3, 10] and ib.shifted_prefill_ids[:3].tolist() == [6, 7, -1]
    with pytest.raises(ValueError, match="rows"):
        write_batch(ib, pt, rows[::-1])  # decode before prefill
    with pytest.raises(ValueError, match="rows"):
        write_batch(ib, pt, [BatchRow(a, 10, [1, 2, 3], False)])  # past its 12 slots
