# Two entry points on a fresh machine: `make demo` (the main job on the embedded pair) and `make test`.
# Both create or refresh .venv when the requirements files or pyproject.toml changed, then run. `make test` also
# installs a CPU Triton server into .tritonserver/ (`make tritonserver`), which the real-server tests start.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PY := $(VENV)/bin/python
TRITON_STAMP := .tritonserver/.installed

.PHONY: demo test lint bench tritonserver

$(STAMP): requirements-ci.txt requirements-ci-nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements-ci.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-ci-nodeps.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(TRITON_STAMP): .ci/install_tritonserver.sh $(STAMP)
	bash .ci/install_tritonserver.sh $(PY)

tritonserver: $(TRITON_STAMP)

demo: $(STAMP)
	$(VENV)/bin/dflash-trt demo --overwrite

lint: $(STAMP)
	$(VENV)/bin/ruff check dflash_trt tests perf convert
	$(VENV)/bin/ruff format --check dflash_trt tests perf convert
	$(PY) -m mypy

# Tests comparing two numeric implementations: run again on the AVX2 kernel set, whose fp32 rounding differs
# from AVX-512's (the default where the CPU has it), so neither kernel set's ties decide the outcome.
NUMERICS_TESTS := tests/test_emulation.py tests/test_emulation_moe.py tests/test_divergence.py tests/test_verify_replay.py \
	tests/test_sampler_support.py tests/test_emulation_ranks.py tests/test_emulation_precision.py \
	tests/test_emulation_dflash2.py tests/test_parity_speculators.py tests/test_fp8_context_attention.py \
	tests/test_greedy_fast_path.py tests/test_tiny_widen.py

test: $(STAMP) $(TRITON_STAMP) lint
	$(PY) -m pytest -q
	ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q $(NUMERICS_TESTS)

bench: $(STAMP)
	$(PY) perf/bench_all.py
