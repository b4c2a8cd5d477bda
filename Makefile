# radixserve — set-up, tests, lint, serve.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 30000
HOST ?= 127.0.0.1

.PHONY: setup venv model test test-fast lint format serve clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The CPU torch wheel lies on disk; installing it first keeps pip from pulling a CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

model: venv
	$(BIN)/python -m radixserve.model_loader.default_model

setup: venv model

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not real_model" tests

lint: venv
	$(BIN)/ruff check radixserve tests
	$(BIN)/ruff format --check radixserve tests

format: venv
	$(BIN)/ruff format radixserve tests
	$(BIN)/ruff check --fix radixserve tests

serve: setup
	$(BIN)/python -m radixserve serve --host $(HOST) --port $(PORT)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
