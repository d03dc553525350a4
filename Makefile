# Two commands do all set-up from a fresh clone:  make run   |   make test   (make test-all: every tier)
# PYTHON: the newest interpreter that runs, 3.13 > 3.12 > 3.11, on PATH or under pyenv (3.12+ gets JAX 0.12,
# 3.11 gets JAX 0.10.2); override with PYTHON=/path/to/python.
PYENV_ROOT ?= $(shell pyenv root 2>/dev/null || echo $(HOME)/.pyenv)
CANDIDATES := python3.13 $(wildcard $(PYENV_ROOT)/versions/3.13*/bin/python3) \
              python3.12 $(wildcard $(PYENV_ROOT)/versions/3.12*/bin/python3) \
              python3.11 $(wildcard $(PYENV_ROOT)/versions/3.11*/bin/python3) python3
PYTHON ?= $(shell for p in $(CANDIDATES); do $$p -c 'import sys; assert sys.version_info >= (3, 11)' >/dev/null 2>&1 && echo $$p && break; done)
VENV ?= .venv
BIN := $(VENV)/bin
DATA_DIR ?= $(firstword $(wildcard $(JDP_DATA_DIR) ../shared/data/fashion-mnist))
RUN_ARGS ?= --cpu-devices 2 --out runs/main $(if $(DATA_DIR),--data-dir $(DATA_DIR))
PYTEST_ARGS ?=
TEST_WORKERS ?= -n 2  # the fast tier on 2 pytest-xdist workers; TEST_WORKERS= runs it in one process
# The fast tier compiles far more than it runs: LLVM's cheapest code generation makes it ~15% faster. Rounding
# may differ in the last bits from optimized code (tests compare runs of one process, never with it);
# `make test-all` (CI) runs every test on the code users run.
FAST_TIER_XLA_FLAGS ?= --xla_backend_optimization_level=0
# pip installs without byte-compiling (26 s instead of 59 s); the tests' first import writes the bytecode of what
# they use. Where $PYTHONDONTWRITEBYTECODE is set, every process would compile jax & co. again (both workers, each
# `jdp` process a test starts: ~20 s of a fresh clone's tier): the tests write it into .venv and the checkout.
WRITE_BYTECODE := PYTHONDONTWRITEBYTECODE=

.PHONY: run test test-all install clean

$(BIN)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "make: no Python >= 3.11 found; pass PYTHON=/path/to/python3.11+" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -e '.[test]'  # bytecode is compiled on first import, for the modules used
	touch $@

install: $(BIN)/.installed
	@$(BIN)/python -c 'import sys, jax; print(f"make: using {sys.executable} (Python {sys.version.split()[0]}, from $(PYTHON)) with JAX {jax.__version__}")'

run: install
	$(BIN)/jdp train $(RUN_ARGS)

test: install  # the fast tier: minutes
	XLA_FLAGS="$(FAST_TIER_XLA_FLAGS) $$XLA_FLAGS" $(WRITE_BYTECODE) $(BIN)/python -m pytest -q -m "not slow" $(TEST_WORKERS) $(PYTEST_ARGS)

test-all: install  # every test: multi-process jobs, kill-and-resume, long loops, ResNet-18, experiments
	$(WRITE_BYTECODE) $(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs
