# Every target sets up first (idempotent: scripts/setup.sh skips what is done).
PY    := .venv/bin/python
EXP   ?= arith-tiny
TRIAL ?= run-$(shell date +%Y%m%d-%H%M%S)

# Python's bytecode cache for the project's own modules (__pycache__/, ignored by git), also where
# the environment turns it off (PYTHONDONTWRITEBYTECODE=1): otherwise every launcher, worker and
# test process compiles the sources again, about 0.25 CPU-s each (site-packages were compiled at
# install). Python reads an empty value as unset.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: setup run test bench
setup:
	@bash scripts/setup.sh

run: setup
	$(PY) -m system.launch exp=$(EXP) trial=$(TRIAL) $(ARGS)

# Two pytest-xdist workers (TEST_WORKERS=0 runs in one process): about half the suite waits on
# processes, sockets and Slurm, so two share the 2 cores CI has. One file, and every Slurm
# test, stays on one worker (tests/conftest.py). The 15 slowest tests are listed at the end.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q --durations=15 tests $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup) $(ARGS)

bench: setup
	$(PY) tests/benchmarks/control_plane.py
	$(PY) tests/benchmarks/reshard.py
	$(PY) tests/benchmarks/rl.py
	$(PY) tests/benchmarks/temperature.py
	$(PY) tests/benchmarks/chaos.py
	$(PY) tests/benchmarks/fuzz.py
	$(PY) tests/benchmarks/scale.py
	$(PY) tests/benchmarks/startup.py
	$(PY) tests/benchmarks/checkpoint_digest.py
	$(PY) tests/benchmarks/rank_start.py

# GPU checks of issue 13: the torch engine on cuda:0, the NCCL reshard benchmark, vLLM weight
# sync with log-prob parity, megatron tp=2 = tp=1, a 30-step SmolLM2 GRPO (scripts/gpu_checks/).
# Exit 0 pass, 1 a check failed, 2 nothing could run (no CUDA). Without `make setup`:
# python3 -m scripts.gpu_checks; the CPU twins: ARGS="--device cpu".
.PHONY: gpu-check
gpu-check: setup
	$(PY) -m scripts.gpu_checks $(ARGS)
