# Two commands set up a fresh machine: `make demo` and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-mcore-0.19 install bench clean

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/python -m megatron_bitdet.trace.native  # build the native op tracer now, not in the first traced run
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/bitdet prove --recipe recipes/nemotron_h_tiny.yaml --out runs/demo

# -rs lists every skip with its reason; the last lines count the Megatron-LM tests that ran (tests/conftest.py)
test: $(STAMP)
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider tests

# The megatron-core 0.19.2 leg (CI runs it after `make test`): a venv built by the test harness (Python 3.11 shims,
# test-only: read tests/harness/megatron_core_0_19_venv.sh) and Megatron-LM core_v0.19.0's entry points; every
# test file but those conftest.MEGATRON_CORE_FREE lists (they never run megatron-core's code).
V19 ?= .venv-mcore-0.19
MEGATRON_LM_019_PATH ?= $(abspath ../shared/megatron-lm-0.19)

$(V19)/.installed: pyproject.toml setup.py tests/harness/megatron_core_0_19_venv.sh
	MEGATRON_LM_019_PATH=$(MEGATRON_LM_019_PATH) tests/harness/megatron_core_0_19_venv.sh $(abspath $(V19))
	$(V19)/bin/python -m megatron_bitdet.trace.native
	touch $@

test-mcore-0.19: $(V19)/.installed
	MEGATRON_LM_PATH=$(MEGATRON_LM_019_PATH) $(V19)/bin/python -m pytest -q -rs -p no:cacheprovider --megatron-core-leg tests

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# The wheels benchmarks/gpu_check.py needs on a bare Python 3.12 GPU machine with torch (no index there), into
# gpu-kit/ (ignored), sized and resolved offline before it says so; the install line: gpu_check.py's docstring.
.PHONY: gpu-kit
gpu-kit: $(STAMP)
	$(BIN)/python benchmarks/gpu_kit.py --out gpu-kit

clean:
	rm -rf runs build *.egg-info
