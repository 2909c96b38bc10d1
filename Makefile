# Two entry points, both from a fresh clone:  `make demo`  and  `make test` (CI adds `make test-oldest`).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch is pinned here (dev/CI only) so pip takes the CPU wheel that lies on this machine's disk.
TORCH_PIN ?= torch==2.13.0
# The oldest torch pyproject.toml admits, for `make test-oldest`: PyPI's (CUDA) wheel, run on the
# CPU, in a venv of its own. Keep it equal to the floor of `torch>=` in pyproject.toml.
TORCH_OLDEST ?= torch==2.9.0
VENV_OLDEST  := .venv-oldest
# pytest-xdist workers: many slow tests wait on child processes, servers and store deadlines,
# so a third worker overlaps those waits with the other two's CPU work (596 s -> 551 s here;
# a fourth only adds contention: 569 s, and a 2 s store deadline missed).
# worksteal: each worker starts on its share of the slow test files, heaviest first
# (tests/conftest.py orders them), and a worker that runs out takes half of another's queue,
# so all end within a test of each other ('load' left one idle for ~120 s)
TEST_WORKERS ?= 3
TEST_DIST    ?= --dist worksteal
PY_OLDEST    := $(VENV_OLDEST)/bin/python
# Azurite (the Azure Blob tests' and `asynctron bench azure`'s server,
# asynctron/testing/azurite.py), from npm into an ignored folder: `make test`, `make bench` and
# `make setup` install it, `make demo` does not (the demo uses no store); skipped where there is
# no npm (those tests then skip)
AZURITE_VERSION ?= 3.37.0
AZURITE_DIR     := .tools/azurite

.PHONY: setup venv azurite demo test test-oldest lint bench clean

# Installed by uv (from PyPI, into the venv): the same versions as pip (pip freeze compared),
# 80 s here where pip took 92 s. Bytecode compiled at install, as pip does: where
# PYTHONDONTWRITEBYTECODE is set (this machine), every process would otherwise compile torch
# again at import. pip's find-links (where this machine keeps wheels, torch's CPU build among
# them) are passed on to it
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))

$(VENV)/.installed: pyproject.toml setup.py asynctron/_native.c asynctron/storage/_pickle_costs.c \
		asynctron/datasets/formats/_blending.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) \
		$(foreach links,$(FIND_LINKS),--find-links $(links)) $(TORCH_PIN) -e '.[test,bench]'
	touch $@

$(AZURITE_DIR)/.installed-$(AZURITE_VERSION):
	npm install --prefix $(AZURITE_DIR) --no-audit --no-fund --save-exact azurite@$(AZURITE_VERSION)
	touch $@

venv: $(VENV)/.installed

azurite: $(if $(shell command -v npm),$(AZURITE_DIR)/.installed-$(AZURITE_VERSION))

# everything the tests and benchmarks use
setup: venv azurite

# uv, as for $(VENV): torch's CUDA wheel and the nvidia-* wheels it needs (4.4 GB, from PyPI)
# come down in parallel, ~60 s here where pip took ~150 s, and from uv's cache (~/.cache/uv, a
# few seconds) where this machine fetched them before; torch named with the package, so the
# extras never lift it
$(VENV_OLDEST)/.installed: pyproject.toml setup.py asynctron/_native.c \
		asynctron/storage/_pickle_costs.c asynctron/datasets/formats/_blending.c
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(PY_OLDEST) -m pip install -q --upgrade pip uv
	$(VENV_OLDEST)/bin/uv pip install -q --compile-bytecode --python $(PY_OLDEST) \
		$(TORCH_OLDEST) -e '.[test,bench]'
	touch $@

# the venv only: the demo trains on local ranks and saves to local directories
demo: venv
	$(VENV)/bin/asynctron demo

test: setup
	$(VENV)/bin/ruff check asynctron tests bench examples
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(TEST_DIST) --durations=15

# the fast tests on the oldest torch the library declares (the slow ones run on TORCH_PIN); the
# object-store suite on S3 alone: Azure's and GCS's runs add their HTTP clients, not torch code
test-oldest: $(VENV_OLDEST)/.installed
	$(PY_OLDEST) -c 'import torch; print("torch", torch.__version__)'
	$(PY_OLDEST) -m pytest -q -n $(TEST_WORKERS) $(TEST_DIST) -m 'not slow' -k 'not azure and not gcs'

# every benchmark into bench/results/, then docs/benchmarks.md from them (bench/report.py)
RESULTS ?= bench/results/all_$(shell hostname)_$(shell date +%Y%m%d)
bench: setup
	$(VENV)/bin/asynctron bench all --results $(RESULTS)
	$(PY) -m bench.report $(RESULTS) --docs docs

clean:
	rm -rf $(VENV) $(VENV_OLDEST) demo-out .pytest_cache .tools
