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

# The main job: a local cluster (1 prefill + 1 decode worker on the built-in model) under a
# Poisson load test; prints the latency/goodput report and saves JSON + plots in out/demo.
run: $(STAMP)
	$(VENV)/bin/pdcluster bench --launch --dataset-name random --num-prompts 64 \
	  --random-input-len 128 --random-output-len 64 --random-range-ratio 0.5 --random-prefix-len 32 \
	  --request-rate 8 --ignore-eos --goodput ttft:1000 tpot:100 \
	  --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
	  --save-result --result-dir out/demo --result-filename demo.json

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/bench_offline.py

clean:
	rm -rf $(VENV) build *.egg-info
