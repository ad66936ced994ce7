# Two entry points, both idempotent and self-contained on a fresh machine:
#   make demo   -> set up .venv, build mixprec, train the main example
#   make test   -> same set-up, then the whole test suite
#   make test-quick -> same set-up, then the quick single-process tests only (the edit loop)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-stamp
# Pinned: `pip install torch` alone would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: demo test test-matrix test-bench test-e2e test-quick install bench clean gpu-check compat-check cpu-info

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(DEPS): $(BIN)/python Makefile
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH) "scikit-build-core>=0.10" ninja "pytest>=7" numpy
	touch $@

# Always re-run: scikit-build-core rebuilds incrementally in build/ (ninja, ccache when present).
install: $(DEPS)
	$(BIN)/pip install -q --no-build-isolation -e ".[test]"

demo: install
	$(BIN)/python examples/train_transformer.py

# Two pytest-xdist workers, a test file per worker at a time (--dist loadfile: a file's
# module fixtures and warm ranks stay in one worker). Many tests wait on subprocesses,
# timeouts or Gloo; two workers keep both cores busy (15.5 -> 11.7 min here, 2 cores).
# --no-loadscope-reorder keeps tests/conftest.py's order (the longest files first).
# TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: install
	$(PYTEST) -m "not matrix and not bench and not e2e" --durations=30

# Benchmark scripts run live, each report checked as `make test` checks the recorded ones
# (tests/data/); CI (.ci/run) runs it.
test-bench: install
	$(BIN)/python -m pytest -q -m bench tests/test_benchmarks_quick.py tests/test_bench_tp.py --durations=10

# The notebooks and the quickstart's documented commands, run whole (a few minutes); CI runs it.
test-e2e: install
	$(PYTEST) -m e2e --durations=10

# Which CPU this is (vendor, ISA flags, the mixprec kernel copy, the fp16 matmul path): a
# numerical failure can be placed by it. CI prints it first.
cpu-info: install
	$(BIN)/python -m mixprec env

# Every transformers model type under TP=2 and SP=2 (tests/distributed/test_model_matrix.py)
# and torch.compile under TP x SP and inductor under TP (test_tp_compile.py), about 8 min here;
# `make test` runs aot_eager under TP. CI (.ci/run) runs both.
test-matrix: install
	$(BIN)/python -m pytest -q -m matrix tests/distributed/test_model_matrix.py tests/distributed/test_tp_compile.py

# tests/distributed/conftest.py marks every multi-process test `distributed`; `slow` marks the
# single-process ones that run whole examples, notebooks or benchmarks in subprocesses.
test-quick: install
	$(PYTEST) -m "not distributed and not slow and not matrix and not bench and not e2e"

bench: install
	$(BIN)/pip install -q ".[bench]"
	$(BIN)/python benchmarks/run_all.py

# Needs a CUDA device (exits 2 without one); not part of `make test` or CI. Uses the machine's
# own torch (GPU_PYTHON, default python3) offline; builds for the GPU's own arch, runs only the
# `cuda`-marked tests and benchmarks/gpu_check.py (per-tensor verdict against float64 with its
# negative controls, kernels, memory and step time against plain AMP), each phase timed (goal:
# under 6 minutes on one H100/H200); writes GPU_CHECK_REPORT (default gpu-check-report.md).
# Its CPU twin runs in `make test` (tests/test_gpu_check.py); `bash .ci/gpu_check.sh --dry-run`
# shows the commands.
gpu-check:
	bash .ci/gpu_check.sh

# Compile-only check of every csrc .cpp against torch 2.11 and 2.12 (wheel headers, fetched
# once into ~/.cache/mixprec/torch-headers, ~0.5 GB download each) and the venv's torch.
compat-check: $(DEPS)
	bash .ci/torch_headers_check.sh

clean:
	rm -rf build $(VENV)
