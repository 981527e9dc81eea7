# `make test` and `make bench` work on a fresh machine: they create .venv and install what they need.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-min bench lint clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# A CPU-only machine must not pull a multi-GB CUDA build: take torch 2.13.0 (CPU wheel) unless a torch is already importable.
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "torch==2.13.0"
	$(VPY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q

# The suite against the oldest transformers, accelerate and peft that pyproject.toml allows,
# in its own environment (.venv-min), so that the declared floors stay true.
MIN_VENV ?= .venv-min
test-min:
	test -x $(MIN_VENV)/bin/python || $(PY) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q --upgrade pip
	$(MIN_VENV)/bin/python -c "import torch" 2>/dev/null || $(MIN_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(MIN_VENV)/bin/python -m pip install -q -e ".[dev]" -c .ci/min-versions.txt
	$(MIN_VENV)/bin/python -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/gss bench tinymem

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(MIN_VENV) build *.egg-info src/*.egg-info
