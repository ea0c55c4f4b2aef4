"""Temporary probe: why does the compiled multi-step skip cudagraphs?"""
import torch
from torch._dynamo.utils import counters
from perf.bench import LLAMA31_8B_HEAD, build_head, build_group, fill_decode_batch, measure_compiled, compiler_from_env
mc = LLAMA31_8B_HEAD.replace(vocab_size=32000, draft_vocab_size=None)
head = build_head(mc, "cuda")
g = build_group(head, 16, 512, (1,), capture=False)
print(measure_compiled(g, fill_decode_batch(g, 1), compiler_from_env({})[0], reps=5))
print("graph_break", dict(counters["graph_break"]))
print("stats", dict(counters["stats"]))
print("inductor", {k: v for k, v in counters["inductor"].items() if "cudagraph" in k})
