# Quick start: `make demo` sets up and generates with the default model; `make test` sets up and runs the CPU suite.
PYTHON ?= python3
MODEL ?= default
DRAFT ?=
PROMPT ?= Write a short poem about the sea.

.PHONY: setup demo test test-all lint gpu-check

setup:
	$(PYTHON) -m pip install -q -e '.[dev]'

# The embedded default model (jetserve/assets) on a chat prompt, on the CPU; DRAFT=default speculates with its draft.
# MODEL=DIR runs another checkpoint.
demo: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PYTHON) -m jetserve.cli generate --model $(MODEL) $(if $(DRAFT),--draft $(DRAFT),) --chat \
		--prompt "$(PROMPT)" --max-tokens 96 --json

test: setup
	$(PYTHON) -m pytest

test-all: setup
	$(PYTHON) -m pytest -m 'not gpu'

lint: setup
	ruff check jetserve tests bench && ruff format --check jetserve tests bench
