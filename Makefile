# The two commands of the README. Each creates .venv on first use and installs
# the project into it, so a fresh clone needs nothing but python3 (>= 3.11).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check

.PHONY: demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

demo: $(BIN)/python
	$(PIP) -e '.[embedded]'
	$(BIN)/infer-worker demo

test: $(BIN)/python
	$(PIP) -e '.[embedded,dev]'
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest

bench: $(BIN)/python
	$(PIP) -e '.[embedded]'
	$(BIN)/infer-worker bench --repeat 20

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
