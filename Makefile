# The two paths a newcomer takes: `make demo` (set up, build, run, verify) and `make test`.
PYTHON ?= python3
AOTFUSE = $(PYTHON) -m aotfuse
# The README's test command; .ci/run runs the same line.
PYTEST = $(PYTHON) -m pytest -q -ra --durations=10

.PHONY: setup demo test test-fast gpu clean

# torch first, pinned: 2.13.0 takes the local CPU wheel; a bare `torch` pulls GBs of CUDA packages.
setup:
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[test]'

demo: setup
	$(AOTFUSE) build
	$(AOTFUSE) run artifacts/demo.aotf --device cpu
	$(AOTFUSE) verify aotfuse.examples.gpt:demo artifacts/demo.aotf --device cpu

# Every CPU tier, end-to-end included; GPU tests skip themselves without CUDA.
test:
	$(PYTEST) tests

# Quick loop while editing: no slow tests, stop at the first failure.
test-fast:
	$(PYTEST) -x -m 'not slow' tests

# The GPU tier (runtime vs eager, benchmarks) on a CUDA machine.
gpu:
	bash scripts/gpu_tier.sh

clean:
	rm -rf artifacts/*.aotf .aotfuse_cache .pytest_cache
