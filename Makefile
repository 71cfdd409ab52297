# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates the virtual environments it needs: torch first, pinned, then the project.
#
# .venv                 torch $(DEMO_TORCH) with every extra: demos, lint, docs, benchmarks, and
#                       the corpus of real-library programs (tests/corpus runs fully there)
# .venv-torch<version>  one per other tested torch: tests and demos
#
# The tested torch releases are the files requirements/torch-<version>.txt, each pinning one;
# pip reads them (tools/install_torch.sh), and an install that fails stops with the reason.
# `make test` first creates every environment, then runs ruff, mypy and the docs build once
# (in .venv) and the test suite once per torch in TORCH_VERSIONS.
# One version only: `make test TORCH_VERSIONS=2.13.0`.
# torch 2.11 and 2.15 from the registry are CUDA builds (about 5 GB each installed); they run
# on the CPU.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_TORCH := 2.13.0
TORCH_VERSIONS ?= $(sort $(patsubst requirements/torch-%.txt,%,$(wildcard requirements/torch-*.txt)))

# The environment that tests a torch version: .venv for the demo's torch, else its own.
venv_of = $(if $(filter $(DEMO_TORCH),$(1)),$(VENV),$(VENV)-torch$(1))

.PHONY: demo test envs test-no-torchscript test-cuda lint docs bench bench-peers bench-phiflow bench-phiflow-gradient bench-warm-start bench-inner-grad bench-during-compile fuzz clean
.SECONDEXPANSION:

$(VENV)/.ready: pyproject.toml Makefile requirements/torch-$(DEMO_TORCH).txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	tools/install_torch.sh $(PY) $(DEMO_TORCH)
	$(PY) -m pip install -q -e '.[test,demo,dev,docs,corpus]' -r requirements/torch-$(DEMO_TORCH).txt
	touch $@

$(VENV)-torch%/.ready: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)-torch$*
	$(VENV)-torch$*/bin/python -m pip install -q --upgrade pip
	tools/install_torch.sh $(VENV)-torch$*/bin/python $*
	$(VENV)-torch$*/bin/python -m pip install -q -e '.[test,demo]' -r requirements/torch-$*.txt
	touch $@

# A fixed hash seed: PhiML orders some dimensions by string hashes, so the captured graph, and
# inductor's cache keys, would differ between two runs (no warm start; docs/engines.md).
demo: $(VENV)/.ready
	PYTHONHASHSEED=0 $(PY) demos/smoke_plume.py

# The shared suite and the device tests on CUDA (a GPU machine; not part of `make test`):
# tensors the tests create are made on CUDA (tests/conftest.py, PHI_TORCH_JIT_TEST_DEVICE).
test-cuda: $(VENV)/.ready
	PHI_TORCH_JIT_TEST_DEVICE=cuda $(PY) -m pytest -m "all_engines or devices or cuda" -q -p no:cacheprovider

lint: $(VENV)/.ready
	$(PY) -m ruff check phi_torch_jit tests demos benchmarks
	$(PY) -m ruff format --check phi_torch_jit tests demos benchmarks
	$(PY) -m mypy

docs: $(VENV)/.ready
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Every environment first, the newest torch first: a torch that cannot be installed stops
# `make test` in minutes, before any suite runs.
reverse = $(if $(1),$(call reverse,$(wordlist 2,$(words $(1)),$(1))) $(firstword $(1)))
envs: $(VENV)/.ready $(foreach v,$(call reverse,$(TORCH_VERSIONS)),$(call venv_of,$(v))/.ready)

test: envs lint docs $(addprefix pytest-torch,$(TORCH_VERSIONS)) test-no-torchscript

# Each suite runs in PYTEST_WORKERS processes (pytest-xdist; this machine has two cores). The
# demo's torch runs the shared suite (@pytest.mark.all_engines) with every engine; the other
# torch releases and the run without TorchScript run it with the default engine only
# (tests/conftest.py, PHI_TORCH_JIT_TEST_ENGINES): four full runs did not fit in CI's time.
PYTEST_WORKERS ?= 2
PYTEST_ARGS = -n $(PYTEST_WORKERS)
DEFAULT_ENGINE_ONLY := PHI_TORCH_JIT_TEST_ENGINES=auto-on-caller:aot_eager

# The whole suite (the shared suite with the default engine) with torch.jit.trace/script/
# trace_module removed for the session, as in a torch without TorchScript (tests marked
# uses_torchscript or torchscript_bodies skipped):
# PyTorch plans to drop TorchScript. In `make test` itself, a fixture makes them raise in
# every test that does not name engine "torchscript" (tests/conftest.py).
test-no-torchscript: $(VENV)/.ready
	@echo "== test suite without TorchScript (torch $(DEMO_TORCH)) =="
	PHI_TORCH_JIT_TEST_NO_TORCHSCRIPT=1 $(DEFAULT_ENGINE_ONLY) $(PY) -m pytest -q $(PYTEST_ARGS)

pytest-torch%: $$(call venv_of,$$*)/.ready
	@echo "== test suite on torch $* =="
	$(if $(filter $(DEMO_TORCH),$*),,$(DEFAULT_ENGINE_ONLY)) $(call venv_of,$*)/bin/python -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.ready
	$(PY) benchmarks/bench_demo.py
	$(PY) benchmarks/bench_guards.py
	$(PY) benchmarks/bench_memory.py

# `make bench-peers BENCH_TORCH=2.15.0` runs the peer comparison on another tested torch.
BENCH_TORCH ?= $(DEMO_TORCH)
bench-peers: $$(call venv_of,$$(BENCH_TORCH))/.ready
	$(call venv_of,$(BENCH_TORCH))/bin/python benchmarks/bench_peers.py

# Engines "compile" and "auto" in a second process with inductor's cache warm (docs/engines.md).
bench-warm-start: $$(call venv_of,$$(BENCH_TORCH))/.ready
	$(call venv_of,$(BENCH_TORCH))/bin/python benchmarks/bench_warm_start.py

# Steps served while the default engine's background compile runs, against eager (engines.md).
bench-during-compile: $$(call venv_of,$$(BENCH_TORCH))/.ready
	$(call venv_of,$(BENCH_TORCH))/bin/python benchmarks/bench_during_compile.py

# Training steps with autograd.grad inside (forces, PINN, Hamiltonian; docs/benchmarks.md).
bench-inner-grad: $$(call venv_of,$$(BENCH_TORCH))/.ready
	$(call venv_of,$(BENCH_TORCH))/bin/python benchmarks/bench_inner_grad.py

# PhiFlow steps: eager, PhiML's own jit, install(), ptj.jit (docs/phiflow.md).
bench-phiflow: $$(call venv_of,$$(BENCH_TORCH))/.ready
	$(call venv_of,$(BENCH_TORCH))/bin/python benchmarks/bench_phiflow.py

# PhiFlow's backward: a gradient step through two smoke steps (docs/phiflow.md).
bench-phiflow-gradient: $$(call venv_of,$$(BENCH_TORCH))/.ready
	$(call venv_of,$(BENCH_TORCH))/bin/python benchmarks/bench_phiflow_gradient.py

fuzz: $(VENV)/.ready
	HYPOTHESIS_PROFILE=long $(PY) -m pytest tests/test_properties.py -p no:cacheprovider

clean:
	rm -rf $(VENV) $(VENV)-torch* .pytest_cache .mypy_cache .ruff_cache build *.egg-info
