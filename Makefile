# Two commands on a fresh machine with python3: `make run` serves, `make test` tests. Both install first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check

.PHONY: run test gpu-check install install-test lint clean

run: $(VENV)/.installed
	$(BIN)/switchyard serve

test: lint
	$(BIN)/python -m pytest

# ruff (pyflakes, pycodestyle, import order, bugbear) over the repository, mypy over the service's packages:
# configured in pyproject.toml. `make test` runs it first.
lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/mypy

# Every GPU test and the GPU side of the benchmarks, one report (loadtests/gpu_check.py; skips with reasons
# where there is no device). Install the gpu extra first for cuVS / cuDF: $(PIP) install -e '.[gpu]'
gpu-check: $(VENV)/.installed-test
	$(BIN)/python loadtests/gpu_check.py $(ARGS)

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(BIN)/python:
	@$(PYTHON) -m venv $(VENV) || { echo "python3 could not make a virtual environment: on Debian, apt-get install python3-venv"; exit 1; }

$(VENV)/.installed: pyproject.toml client/pyproject.toml | $(BIN)/python
	$(PIP) install -q -e ./client -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml client/pyproject.toml | $(BIN)/python
	$(PIP) install -q -e ./client -e '.[test]'
	@touch $@ $(VENV)/.installed

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
