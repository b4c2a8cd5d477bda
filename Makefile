# radixserve — set-up, tests, lint, serve.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 30000
HOST ?= 127.0.0.1

.PHONY: setup venv model browser mooncake test test-fast lint format serve router pd clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# CPU torch first, so the project's own install never pulls a CUDA build (PyPI's Linux wheel
# bundles CUDA, several GB): a wheel on this machine's own package source (pip's find-links)
# if there is one, else PyTorch's CPU index (TORCH_INDEX; empty: pip's default).
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@if [ -z "$(TORCH_INDEX)" ] || $(BIN)/pip download -q --no-deps --no-index \
			-d $(VENV)/.torch-probe '$(TORCH)' >/dev/null 2>&1; then \
		$(BIN)/pip install -q '$(TORCH)'; \
	else \
		echo "installing the CPU build of $(TORCH) from $(TORCH_INDEX)"; \
		$(BIN)/pip install -q '$(TORCH)' --index-url $(TORCH_INDEX) \
			--extra-index-url https://pypi.org/simple; \
	fi
	rm -rf $(VENV)/.torch-probe
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

model: venv
	$(BIN)/python -m radixserve.model_loader.default_model

setup: venv model

# Debian's chromium for the dashboard's headless-browser test (tests/entrypoints/
# test_dashboard.py drives /usr/bin/chromium through playwright; never `playwright install`,
# which downloads a browser build). Needs root, or sudo for a user.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null

# Debian's libibverbs1, which Mooncake's transfer engine (a dev extra; the `pd` extra for
# users) loads even over TCP; without it P/D disaggregation runs with the fake backend only.
mooncake:
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null

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

# Two servers (ports ROUTER_WORKER_PORTS) behind SGLang's router on PORT until Ctrl-C;
# ROUTER_POLICY: cache_aware (default), round_robin, ...; SERVER_ARGS: extra serve flags.
ROUTER_POLICY ?= cache_aware
ROUTER_WORKER_PORTS ?= 30001 30002
router: setup
	ROUTER_HOST=$(HOST) ROUTER_PORT=$(PORT) WORKER_PORTS="$(ROUTER_WORKER_PORTS)" \
		POLICY=$(ROUTER_POLICY) PY=$(BIN)/python scripts/router.sh

# A prefill server and a decode server behind SGLang's router in PD mode (same ports as
# `make router`: the first prefills, the second decodes); TRANSFER_BACKEND mooncake or fake.
TRANSFER_BACKEND ?= mooncake
pd: setup
	ROUTER_HOST=$(HOST) ROUTER_PORT=$(PORT) WORKER_PORTS="$(ROUTER_WORKER_PORTS)" PD=1 \
		TRANSFER_BACKEND=$(TRANSFER_BACKEND) PY=$(BIN)/python scripts/router.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
