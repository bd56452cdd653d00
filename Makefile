# Two commands on a fresh machine with python3: `make run` serves, `make test` tests. Both install first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check

.PHONY: run test install install-test lint clean

run: $(VENV)/.installed
	$(BIN)/switchyard serve

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(BIN)/python:
	@$(PYTHON) -m venv $(VENV) || { echo "python3 could not make a virtual environment: on Debian, apt-get install python3-venv"; exit 1; }

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install -q -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(PIP) install -q -e '.[test]'
	@touch $@ $(VENV)/.installed

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
