# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates the virtual environment it needs (.venv): torch first, pinned, then the project.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0

.PHONY: demo test lint docs bench bench-peers fuzz clean

$(VENV)/.ready: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,demo,dev,docs]'
	touch $@

demo: $(VENV)/.ready
	$(PY) demos/smoke_plume.py

lint: $(VENV)/.ready
	$(PY) -m ruff check phi_torch_jit tests demos benchmarks
	$(PY) -m ruff format --check phi_torch_jit tests demos benchmarks
	$(PY) -m mypy

docs: $(VENV)/.ready
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

test: lint docs
	$(PY) -m pytest

bench: $(VENV)/.ready
	$(PY) benchmarks/bench_demo.py
	$(PY) benchmarks/bench_guards.py
	$(PY) benchmarks/bench_memory.py

bench-peers: $(VENV)/.ready
	$(PY) benchmarks/bench_peers.py

fuzz: $(VENV)/.ready
	HYPOTHESIS_PROFILE=long $(PY) -m pytest tests/test_properties.py -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
