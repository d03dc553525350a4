# Two commands do all set-up from a fresh clone:  make run   |   make test
# PYTHON: the newest interpreter >= 3.11 found (3.12+ gets JAX 0.12, 3.11 gets JAX 0.10.2); override with PYTHON=...
PYTHON ?= $(shell for p in python3.13 python3.12 python3; do $$p -c 'import sys; assert sys.version_info >= (3, 11)' >/dev/null 2>&1 && echo $$p && break; done)
VENV ?= .venv
BIN := $(VENV)/bin
DATA_DIR ?= $(firstword $(wildcard $(JDP_DATA_DIR) ../shared/data/fashion-mnist))
RUN_ARGS ?= --cpu-devices 2 --out runs/main $(if $(DATA_DIR),--data-dir $(DATA_DIR))

.PHONY: run test install clean

$(BIN)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "make: no Python >= 3.11 found; pass PYTHON=/path/to/python3.11+" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/jdp train $(RUN_ARGS)

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
