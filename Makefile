# Every target sets up first (idempotent: scripts/setup.sh skips what is done).
PY    := .venv/bin/python
EXP   ?= arith-tiny
TRIAL ?= run-$(shell date +%Y%m%d-%H%M%S)

.PHONY: setup run test bench
setup:
	@bash scripts/setup.sh

run: setup
	$(PY) -m system.launch exp=$(EXP) trial=$(TRIAL) $(ARGS)

test: setup
	$(PY) -m pytest -q tests $(ARGS)

bench: setup
	$(PY) tests/benchmarks/control_plane.py
	$(PY) tests/benchmarks/reshard.py
	$(PY) tests/benchmarks/rl.py
	$(PY) tests/benchmarks/chaos.py
	$(PY) tests/benchmarks/fuzz.py
	$(PY) tests/benchmarks/scale.py

# GPU checks of the torch engine on cuda:0 (exit 2: no CUDA device here)
.PHONY: gpu-check
gpu-check: setup
	$(PY) scripts/gpu_check.py $(ARGS)
