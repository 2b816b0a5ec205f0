# metakv: `make run` starts a local cluster, `make test` runs every test CI runs.
# Both create .venv and install what they need on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SEEDS ?= 100000

.PHONY: run test lint sim clean venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/metakv cluster up

lint: $(STAMP)
	$(VENV)/bin/ruff check raft storage app pipeline loadtest tests

test: $(STAMP)
	$(PY) -m pytest -q tests

sim: $(STAMP)
	$(PY) -m tests.sim.run --seeds $(SEEDS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
