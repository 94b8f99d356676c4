# Two commands set up a fresh machine: `make demo` and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install bench clean

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

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf runs build *.egg-info
