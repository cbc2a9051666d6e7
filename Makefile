# Quick start: `make demo` sets up and generates with the default model; `make test` sets up and runs the CPU suite.
PYTHON ?= python3
MODEL ?= checkpoints/tiny
PROMPT ?= The quick brown fox

.PHONY: setup demo test test-all lint gpu-check

setup:
	$(PYTHON) -m pip install -q -e '.[dev]'

$(MODEL)/config.json:
	$(PYTHON) -m jetserve.cli make-checkpoint --config tiny --seed 0 --out $(MODEL)

demo: setup $(MODEL)/config.json
	$(PYTHON) -m jetserve.cli generate --model $(MODEL) --prompt "$(PROMPT)" --max-tokens 32 --json

test: setup
	$(PYTHON) -m pytest

test-all: setup
	$(PYTHON) -m pytest -m 'not gpu'

lint: setup
	ruff check jetserve tests bench && ruff format --check jetserve tests bench
