# megatron-peakflat: `make demo` runs the main job on its defaults; `make test` sets up and runs the CPU tests.
# PYTHON may be any Python >= 3.12 (megatron-core 0.19 needs it); by default the first one found.
PYTHON ?= $(shell for p in python3.12 python3.13 python3.14 python3 python; do \
	  command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo $$p; break; }; \
	done)
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.14.1
MCORE_SPEC ?= megatron-core==0.19.2
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: one per core, at most 8 (0 runs the tests in this process, one by one).
# worksteal: a worker that runs dry takes queued tests from another, since a few tests take 1-2 minutes and most
# under a second
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 8 ] && n=8; echo $$n)

.PHONY: setup demo test gpu-test bench plan clean help

help:
	@echo "make demo      - short Megatron-Core MoE training without and with peakflat, plus the peak table"
	@echo "make test      - set up $(VENV) and run the CPU test suite"
	@echo "make gpu-test  - run tests/gpu (needs CUDA)"
	@echo "make bench     - run the benchmarks in bench/ (needs CUDA)"
	@echo "make plan      - peak planner for gpt-oss-120b at 1M context on 16 GPUs"

$(VENV)/.stamp: setup.py pyproject.toml Makefile $(wildcard csrc/*)
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found; pass PYTHON=/path/to/python3.12 (megatron-core 0.19 needs >= 3.12)"; exit 1; }
	@echo "== setting up $(VENV) with $(PYTHON) ($$($(PYTHON) --version))"
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	@# pyyaml: megatron-core 0.18's megatron.training imports it without declaring it
	$(PY) -m pip install -q "$(MCORE_SPEC)" numpy packaging pyyaml pytest "pytest-xdist>=3.2" pybind11 ninja matplotlib psutil
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	@touch $@

setup: $(VENV)/.stamp

demo: setup
	$(PY) -m megatron_peakflat.demo

test: setup
	$(PY) -m pytest tests -n $(TEST_JOBS) --dist worksteal $(PYTEST_ARGS)

gpu-test: setup
	$(PY) -m pytest tests/gpu -v $(PYTEST_ARGS)

bench: setup
	for b in dispatch vocab sco optimizer tile planner; do $(PY) bench/$$b.py || exit 1; done

plan: setup
	$(PY) -m megatron_peakflat.plan --preset gpt-oss-120b --seq-len 1048576 --gpus 16

clean:
	rm -rf $(VENV) build *.egg-info megatron_peakflat/_C*.so
