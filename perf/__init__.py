"""graphdraft's performance harness: eager vs CUDA-graph replay vs torch.compile draft time.

`perf.bench` holds the pure helpers (case building, decode-batch filling, CUDA-event
timing, HBM-floor arithmetic), `perf/test_draft_perf.py` the pytest-benchmark suite
(`make perf`), and `perf.report` turns its JSON into one markdown table.
"""
