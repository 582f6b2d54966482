# The two commands of the README. Each creates .venv on first use and installs
# the project into it, so a fresh clone needs nothing but python3 (>= 3.11).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check

.PHONY: demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Installs are stamped: a rerun installs again only when pyproject.toml changed
# (the install is editable, so source edits need none).
$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(PIP) -e '.[embedded]'
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(PIP) -e '.[embedded,dev]'
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/infer-worker demo

# ci_tools.sh installs the outside tools some tests run (promtool, prometheus,
# kcat; torch into the venv) under CI=true only, and only when missing: a no-op
# on a developer's machine.
test: $(VENV)/.installed-test
	bash scripts/ci_tools.sh $(BIN)/python
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest

bench: $(VENV)/.installed-demo
	$(BIN)/infer-worker bench --repeat 20

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
