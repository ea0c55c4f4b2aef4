"""The candidate GEMM of `perf/studies/verify_gemm.py` against torch, under the Triton
interpreter: ragged rows, columns and K (clamped reads, masked stores, the K tail), grouped
program order, fp32 in IEEE precision and bf16, so a GPU run of the study times a correct
kernel."""

from __future__ import annotations

import pytest
import torch

from perf.studies.verify_gemm import GemmConfig, configs, gemm, gemm_swiglu, sweep


@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (37, 70, 96), (64, 128, 80), (130, 50, 33)])
@pytest.mark.parametrize("group", [1, 3])
def test_gemm_equals_torch(m, n, k, group):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    cfg = GemmConfig(block_m=32, block_n=32, block_k=32, group_m=group)
    torch.testing.assert_close(gemm(x, w, cfg), x @ w.T, rtol=1e-5, atol=1e-4)
    xb, wb = x.bfloat16(), w.bfloat16()
    got = gemm(xb, wb, cfg)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), xb.float() @ wb.float().T, rtol=2e-2, atol=5e-2)


def test_gemm_writes_into_a_strided_out_and_rejects_bad_shapes():
    x, w = torch.randn(5, 32), torch.randn(16, 32)
    big = torch.full((5, 40), 7.0)
    gemm(x, w, GemmConfig(32, 32, 32, 1), out=big[:, 4:20])
    torch.testing.assert_close(big[:, 4:20], x @ w.T, rtol=1e-5, atol=1e-4)
    assert (big[:, :4] == 7).all() and (big[:, 20:] == 7).all()
    with pytest.raises(ValueError, match="x, w"):
        gemm(x, torch.randn(16, 31))


def test_configs_fit_the_rows():
    assert all(c.block_m == 64 for c in configs(64))
    assert {c.block_m for c in configs(256)} == {64, 128}


@pytest.mark.parametrize("m,i,k", [(3, 40, 64), (70, 32, 48)])
def test_gemm_swiglu_equals_linear_then_silu_mul(m, i, k):
    g = torch.Generator().manual_seed(m + i + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(2 * i, k, generator=g)
    y = x @ w.T
    ref = torch.nn.functional.silu(y[:, :i]) * y[:, i:]
    got = gemm_swiglu(x, w, GemmConfig(32, 32, 32, 2))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"\[2I, K\]"):
        gemm_swiglu(x, w[1:])


def test_sweep_records_errors_and_picks_the_fastest_correct_config(monkeypatch):
    x, w = torch.randn(8, 32), torch.randn(16, 32)
    ref = x @ w.T
    good = GemmConfig(32, 32, 32, 1)

    def run(i, cfg):
        if cfg.block_n == 64:
            raise RuntimeError("out of resources")
        return gemm(x, w, cfg) + (1.0 if cfg.group_m == 8 else 0.0)  # group 8: wrong

    import perf.timing

    times = iter([5.0, 3.0])
    monkeypatch.setattr(perf.timing, "graph_time_us", lambda fn, calls: next(times))
    recs, best, cut = sweep(run, ref, [good, GemmConfig(32, 64, 32, 1),
                                       GemmConfig(32, 32, 32, 8)], 2, float("inf"))
    assert not cut and "error" in recs[1] and recs[2]["rel_err"] > 1e-2
    assert best["config"]["group_m"] == 1 and best["us"] == 5.0


def test_mid_m_sweep_candidates_and_a_row_on_cpu(monkeypatch, capsys):
    """`perf.studies.mid_m_gemm`: the tiles fit the rows and shared memory, the splits stay
    within 2.5 programs per SM; one (projection, M) row on CPU (tiny shape, the timer
    replaced) checks every candidate against F.linear, records the fractions and prints the
    best."""
    import perf.timing
    from perf.studies import mid_m_gemm as mm

    for m in (128, 256, 512, 1024):
        for n, k in mm.shapes_8b().values():
            cs = mm.candidates(m, n, k)
            assert cs and any(c.split == 1 for c in cs)
            for c in cs:
                assert c.num_stages * (c.block_m + c.block_n) * c.block_k * 2 <= 200 << 10
                tiles = -(-m // c.block_m) * -(-n // c.block_n)
                assert c.split == 1 or tiles * c.split <= 2.5 * mm.SMS
                assert not c.swap_ab or c.block_m >= min(m, 128)
    assert any(c.split > 1 for c in mm.candidates(256, 4096, 4096))  # o_proj: too few tiles

    from graphdraft.kernels.gemm import GemmConfig

    monkeypatch.setattr(mm, "candidates", lambda m, n, k: [GemmConfig(16, 16, 16, 1, True, 4, 2),
                                                           GemmConfig(16, 16, 16, 2, False, 4, 2)])
    def fake_time(fn, calls):  # cuBLAS variants 10 us, the split-1 tile 8, the split-2 tile 9
        cfg = next((d for d in fn.__defaults__ or () if isinstance(d, GemmConfig)), None)
        return 10.0 if cfg is None else 8.0 if cfg.split == 1 else 9.0

    monkeypatch.setattr(perf.timing, "graph_time_us", fake_time)
    ws = [torch.randn(24, 64) for _ in range(2)]
    row = mm.shape_row("o", 24, 64, 20, ws, bw=1e12, rate=1e15, deadline=float("inf"))
    v = row["variants"]
    assert v["cublas"]["us"] == 10.0 and v["cublas"]["rel_err"] == 0
    gem = {k: r for k, r in v.items() if k.startswith("gemm[")}
    assert len(gem) == 2 and all(r["rel_err"] < 1e-5 for r in gem.values())
    assert row["floor_us"] == pytest.approx(24 * 64 * 4 / 1e12 * 1e6)
    best, rec = mm.best_gemm(row)
    assert rec["us"] == 8.0 and "s1" in best
    assert rec["bw"] == pytest.approx(24 * 64 * 4 / 8e-6 / 1e12)
    mm.print_row(row)
    assert "0.80x cuBLAS" in capsys.readouterr().out


def test_winners_pick_routes_under_the_margin():
    """`mid_m_gemm.winners`: per (row bucket, N, K) the fastest correct tile or cuBLASLt,
    only under 0.97x plain cuBLAS; wrong or failed candidates never win."""
    from graphdraft.kernels.gemm import CUBLASLT, GemmConfig
    from perf.studies.mid_m_gemm import winners

    cfg = GemmConfig(128, 64, 128, 2, True, 4, 3, True)

    def row(m, n, cublas, lt, tile, tile_err=1e-4):
        return {"m": m, "n": n, "k": 4096, "variants": {
            "cublas": {"us": cublas, "rel_err": 0.0}, "cublas_lt_bias": {"us": lt, "rel_err": 0.0},
            "gemm[a]": {"us": tile, "rel_err": tile_err, "config": cfg.__dict__},
            "gemm[b]": {"error": "out of resources"}}}

    rows = [row(256, 4096, 17.5, 17.4, 15.0), row(128, 4096, 50.8, 44.3, 52.9),
            row(512, 4096, 24.7, 24.6, 24.5), row(64, 6144, 20.0, 30.0, 1.0, tile_err=0.5),
            row(2048, 4096, 10.0, 1.0, 1.0)]
    assert winners(rows, "H") == ((("H", 128, 4096, 4096), CUBLASLT),
                                  (("H", 256, 4096, 4096), (128, 64, 128, 2, True, 4, 3, True)))
