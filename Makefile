# metakv: `make run` starts a local cluster, `make test` runs every test CI runs.
# Both create .venv and install what they need (pip, and apt-get for system packages).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SYSTEM_STAMP := $(VENV)/.system-installed
SEEDS ?= 100000

.PHONY: run test lint sim clean venv system bench-pipeline

# System packages: a Java runtime for PySpark, etcd for side-by-side load tests, wrk as the
# benchmarks' HTTP load generator.
$(SYSTEM_STAMP):
	@mkdir -p $(VENV)
	@if ! command -v java >/dev/null 2>&1 || ! command -v etcd >/dev/null 2>&1 || ! command -v wrk >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq default-jre-headless etcd-server wrk >/dev/null; \
		else \
			echo "need java, etcd and wrk: run as root or apt-get install default-jre-headless etcd-server wrk" >&2; exit 1; \
		fi; \
	fi
	touch $(SYSTEM_STAMP)

$(STAMP): pyproject.toml $(SYSTEM_STAMP)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,spark,load]'
	touch $(STAMP)

venv: $(STAMP)
system: $(SYSTEM_STAMP)

run: $(STAMP)
	$(VENV)/bin/metakv cluster up

lint: $(STAMP)
	$(VENV)/bin/ruff check raft storage app pipeline loadtest tests

test: $(STAMP)
	$(PY) -m pytest -q tests

# Storage crash test at length: 2000 SIGKILLs at random points (make test runs 100).
.PHONY: test-storage-crash bench-storage
test-storage-crash: $(STAMP)
	METAKV_CRASH_ITERATIONS=2000 $(PY) -m pytest -q --timeout=7200 tests/storage/test_crash.py

bench-storage: $(STAMP)
	$(PY) -m loadtest.bench_storage

# The standard metakv vs etcd load comparison (docs/loadtest.md); report under results/bench-*/report/.
.PHONY: bench
BENCH_ARGS ?=
bench: $(STAMP)
	$(PY) -m loadtest bench $(BENCH_ARGS)

.PHONY: bench-http
bench-http: $(STAMP)
	$(PY) -m loadtest.bench_http --etcd --profile-dir results/profile

# Chaos: real processes, faults through proxies, a checked history. Results in results/chaos-SEED.
SEED ?= 1
DURATION ?= 300
.PHONY: chaos
chaos: $(STAMP)
	$(PY) -m tests.chaos.harness --seed $(SEED) --duration-s $(DURATION) --results results/chaos-$(SEED)

sim: $(STAMP)
	$(PY) -m tests.sim.run --seeds $(SEEDS)

bench-pipeline: $(STAMP)
	$(PY) -m loadtest.bench_pipeline --records $(or $(RECORDS),10000000)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

# Compaction: more simulator seeds than make test runs, and the benchmark (docs/compaction.md).
.PHONY: sim-compaction bench-compaction
sim-compaction: $(STAMP)
	$(PY) -m tests.sim.compaction --seeds 100

bench-compaction: $(STAMP)
	$(PY) -m loadtest.bench_compaction
