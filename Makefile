# `make run`: set up and run the main job.  `make test`: set up and run the tests.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test bench clean

# torch goes first, on its own line: the local CPU wheel (anything else pulls CUDA builds).
# The C++ paged-attention kernel is built here rather than inside the first run; without a
# compiler the engine falls back to the torch backend and says so.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -c "from workers import cpu_kernels; cpu_kernels.load()"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pdcluster demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/bench_offline.py

clean:
	rm -rf $(VENV) build *.egg-info
