# Two entry points on a fresh machine: `make demo` (the main job on the embedded pair) and `make test`.
# Both create or refresh .venv when the requirements files or pyproject.toml changed, then run. `make test` also
# installs a CPU Triton server into .tritonserver/ (`make tritonserver`), which the real-server tests start.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PY := $(VENV)/bin/python
TRITON_STAMP := .tritonserver/.installed

.PHONY: demo test test-fast lint bench tritonserver

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
NUMERICS_TESTS := tests/emulation/test_emulation.py tests/emulation/test_emulation_moe.py tests/golden/test_divergence.py \
	tests/engine/test_verify_replay.py tests/engine/test_sampler_support.py tests/emulation/test_emulation_ranks.py \
	tests/emulation/test_emulation_precision.py tests/emulation/test_emulation_dflash2.py \
	tests/golden/test_parity_speculators.py tests/quant/test_fp8_context_attention.py tests/engine/test_greedy_fast_path.py \
	tests/models/test_tiny_widen.py tests/emulation/test_emulation_tree.py tests/emulation/test_emulation_routes.py \
	tests/emulation/test_fp8_context_rows.py

# The fast tier for a local loop (`make test-fast`, under a minute on a quiet 2-core machine): every subject's unit and
# contract tests, without the real Triton server, the subprocesses and the long end-to-end runs; `make test` runs all.
# tests/README.md says which subject lives where.
FAST_TESTS := tests/architecture/test_function_length.py tests/architecture/test_layers.py tests/bench/test_bench_driver.py \
	tests/checkpoint/test_checkpoint_config.py tests/checkpoint/test_checkpoint_hostile_files.py \
	tests/checkpoint/test_hf_reader.py tests/checkpoint/test_integrity.py tests/checkpoint/test_rank_writer.py \
	tests/cli/test_chat_prompts.py tests/conversion/test_calibration_prompts.py tests/conversion/test_convert.py \
	tests/conversion/test_convert_bytes.py tests/conversion/test_convert_streaming.py \
	tests/engine/test_engine_plan.py tests/engine/test_sampler_support.py tests/engine/test_sampling_rules.py \
	tests/engine/test_trtllm_api.py tests/engine/test_verify_replay.py tests/executors/test_executors_emulated.py \
	tests/golden/test_divergence.py tests/golden/test_kv_injection.py tests/golden/test_loop_rules.py \
	tests/models/test_spec.py tests/planning/test_capacity.py tests/planning/test_comm.py \
	tests/planning/test_draft_schedule.py tests/planning/test_fitting.py tests/planning/test_node_planner.py \
	tests/planning/test_pareto.py tests/planning/test_perf_model.py tests/planning/test_profiles.py \
	tests/quant/test_fp8_context_attention.py tests/quant/test_quant_formats.py \
	tests/quant/test_quant_prequantized.py tests/serve/test_serve_cli.py tests/serve/test_serve_detokenizer.py \
	tests/serve/test_serve_observability.py tests/triton_repository/test_triton_client.py \
	tests/triton_repository/test_triton_cpu_repo.py tests/triton_repository/test_triton_emulated_llm.py \
	tests/triton_repository/test_triton_launch.py tests/triton_repository/test_triton_processing.py \
	tests/triton_repository/test_triton_python_models.py tests/triton_repository/test_triton_sampling.py

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(FAST_TESTS)

test: $(STAMP) $(TRITON_STAMP) lint
	$(PY) -m pytest -q
	ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q $(NUMERICS_TESTS)

bench: $(STAMP)
	$(PY) perf/bench_all.py
