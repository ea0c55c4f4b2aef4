"""One-off studies (GPU unless said) kept because they still answer a question the code depends on:
`gemv_sweep` (the GEMV tile tables), `profile_draft` (per-kernel time of one draft call),
`graph_start_probe` (the start gap of a graph launch), `fp32_prefill` (the fp32 prefill on
the 16-row FMA tile against the 128-row one), `verify_gemm` / `verify_kernels` (the verify
forward's GEMMs and kernels), `mid_m_gemm` (the 8B projections at 64-1024 rows: cuBLAS,
cuBLASLt and the `kernels/gemm.py` tiles; the source of `KernelConfig.gemm_routes`),
`real_accept` (the SmolLM2 head's accept per draft depth and its draft-vocabulary misses, a
count valid on the CPU). Each runs as
`python3 -m perf.studies.<name> --out DIR`; none is part of `make perf`."""
