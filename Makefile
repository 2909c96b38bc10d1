# Two entry points, both from a fresh clone:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch is pinned here (dev/CI only) so pip takes the CPU wheel that lies on this machine's disk.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test lint bench clean

$(VENV)/.installed: pyproject.toml setup.py asynctron/_native.c asynctron/storage/_pickle_costs.c \
		asynctron/datasets/_blending.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/asynctron demo

test: setup
	$(VENV)/bin/ruff check asynctron tests bench examples
	$(PY) -m pytest -q

# every benchmark into bench/results/, then docs/benchmarks.md from them (bench/report.py)
RESULTS ?= bench/results/all_$(shell hostname)_$(shell date +%Y%m%d)
bench: setup
	$(VENV)/bin/asynctron bench all --results $(RESULTS)
	$(PY) -m bench.report $(RESULTS) --docs docs

clean:
	rm -rf $(VENV) demo-out .pytest_cache
