"""One-off GPU studies kept because they still answer a question the code depends on:
`gemv_sweep` (the GEMV tile tables), `profile_draft` (per-kernel time of one draft call),
`graph_start_probe` (the start gap of a graph launch), `fp32_prefill` (the fp32 prefill on
the 16-row FMA tile against the 128-row one). Each runs as
`python3 -m perf.studies.<name> --out DIR`; none is part of `make perf`."""
