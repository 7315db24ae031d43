# Two commands do all the set-up: `make demo` and `make test`. Each installs what it needs, idempotently.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo lint test test-loaded test-vllm bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/intellect-node demo

# ruff over the whole tree, mypy (strict) over the pure packages (their list is [tool.mypy] in
# pyproject.toml); either failing fails `make test` before a test runs. RUFF_PATHS, not LINT: make
# predefines that.
RUFF_PATHS ?= intellect_node tests bench scripts
lint: setup
	$(VENV)/bin/ruff check $(RUFF_PATHS)
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q tests

# The same suite beside two CPU-bound processes (started and ended by PID in the script), as on a busy
# 2-core machine.
test-loaded: setup
	@PY=$(PY) bash scripts/test-loaded.sh

# vLLM lives in its own environment (it pins its own torch); not part of `make test`.
test-vllm:
	@bash scripts/setup-vllm.sh
	.venv-vllm/bin/python -m pytest -q tests/inference/vllm

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache
