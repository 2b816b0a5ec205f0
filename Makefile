# metakv: `make run` starts a local cluster, `make test` runs every test CI runs.
# Every target creates .venv and installs what it needs: `run` only Python packages (pip);
# the targets that drive Java, etcd or wrk also install those Debian packages (apt-get, as root).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE_STAMP := $(VENV)/.installed-base
STAMP := $(VENV)/.installed
SEEDS ?= 100000

.PHONY: run test lint sim clean venv system system-java system-etcd system-wrk system-chromium

# The package and its runtime dependencies: all `make run` needs.
$(BASE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(BASE_STAMP)

# Everything the tests, benchmarks and pipeline import (pytest, ruff, PySpark, Locust, ...).
$(STAMP): pyproject.toml $(BASE_STAMP)
	$(PY) -m pip install -q -e '.[dev,spark,load]'
	touch $(STAMP)

venv: $(STAMP)

# apt_install(commands, packages): install the Debian packages when one of the commands is
# missing; only root can, so anyone else is told what to install.
define apt_install
	@for command in $(1); do command -v $$command >/dev/null 2>&1 || missing=1; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) >/dev/null; \
		else \
			echo "need $(1): run as root or apt-get install $(2)" >&2; exit 1; \
		fi; \
	fi
endef

# A Java runtime for PySpark (pipeline/), etcd for the side-by-side load tests, wrk as the
# HTTP benchmark's load generator, chromium for the dashboard's browser tests (tests/ui:
# playwright drives Debian's build, since its own browser download cannot work everywhere).
system-java:
	$(call apt_install,java,default-jre-headless)
system-etcd:
	$(call apt_install,etcd etcdctl,etcd-server etcd-client)
system-wrk:
	$(call apt_install,wrk,wrk)
system-chromium:
	$(call apt_install,chromium,chromium)
system: system-java system-etcd system-wrk system-chromium

run: $(BASE_STAMP)
	$(VENV)/bin/metakv cluster up

lint: $(STAMP)
	$(VENV)/bin/ruff check raft storage app pipeline loadtest tests

# The tests use etcd (tests/loadtest), Java (tests/pipeline), wrk (tests/loadtest) and
# chromium (tests/ui).
test: $(STAMP) system lint
	$(PY) -m pytest -q --durations=25 tests

# etcd's API with clients from PyPI across a leader SIGKILL (docs/etcd.md, Proof): aetcd over
# gRPC and etcd3gw over the gateway, etcdctl against a node's etcd port with TLS and a token
# file, and a Locust scenario through metakv's gateway (~45 s; make test runs the etcdctl
# comparison and the rest).
.PHONY: test-etcd
test-etcd: $(STAMP) system-etcd
	$(PY) -m pytest -q tests/etcd/failover_clients.py tests/etcd/port_security_node.py tests/loadtest/etcd_api_target.py tests/etcd

# Put and range throughput, 64 clients: metakv's etcd gateway vs its HTTP API vs etcd (docs/etcd.md).
.PHONY: bench-etcd-api
bench-etcd-api: $(STAMP) system-etcd system-wrk
	$(PY) -m loadtest.bench_etcd_api --duration-s 5 --rounds 2 --out results/bench_etcd_api.json

# The Locust scenarios through metakv's HTTP API, metakv's etcd gateway and etcd side by side,
# one report with ratios to etcd (docs/benchmarks.md); results/bench-etcd-locust/report/.
.PHONY: bench-etcd-locust
bench-etcd-locust: $(STAMP) system-etcd
	$(PY) -m loadtest bench --targets metakv,metakv-etcd,etcd --duration 10 --out results/bench-etcd-locust

# What the one etcd port's relay costs gRPC: puts and ranges, 64 clients, vs gRPC on its own port and etcd.
.PHONY: bench-etcd-grpc
bench-etcd-grpc: $(STAMP) system-etcd
	$(PY) -m loadtest.bench_etcd_grpc --duration-s 5 --rounds 4 --out results/bench_etcd_grpc.json

# Dynamic voters with real processes (docs/http.md, Voters): 1 -> 3 -> 5 voters and back to 3
# under chaos clients, a dead voter's disk replaced, a change while one is pending; the history
# checked for linearizability; cluster up --dynamic (~30 s; make test runs test_voters_processes.py).
.PHONY: test-voters
test-voters: $(STAMP)
	$(PY) -m pytest -q -s tests/app/voters_proof.py

# Storage crash test at length: 2000 SIGKILLs at random points (make test runs 100).
.PHONY: test-storage-crash bench-storage
test-storage-crash: $(STAMP)
	METAKV_CRASH_ITERATIONS=2000 $(PY) -m pytest -q --timeout=7200 tests/storage/test_crash.py

# Lease determinism at length: 500 random logs of grants, attaches and racing revokes (make test runs 12).
.PHONY: test-leases-soak
test-leases-soak: $(STAMP)
	LEASE_DETERMINISM_EXAMPLES=500 $(PY) -m pytest -q tests/leases/test_lease_determinism.py

bench-storage: $(STAMP)
	$(PY) -m loadtest.bench_storage

# The standard metakv vs etcd load comparison (docs/loadtest.md); report under results/bench-*/report/.
.PHONY: bench
BENCH_ARGS ?=
bench: $(STAMP) system-etcd
	$(PY) -m loadtest bench $(BENCH_ARGS)

.PHONY: bench-http
bench-http: $(STAMP) system-etcd system-wrk
	$(PY) -m loadtest.bench_http --etcd --profile-dir results/profile

# What TLS costs: writes/s and 1-client p50, TLS on vs off, metakv and etcd (same certificates).
.PHONY: bench-tls
bench-tls: $(STAMP) system-etcd system-wrk
	$(PY) -m loadtest.bench_tls --duration-s 8 --rounds 3 --out results/bench_tls.json

# metakv and etcd grown side by side to 10k, 100k and 1 M keys (the 1 M stage takes tens of minutes; STAGES=10000,100000
# to choose); results/bench_scale.json and .png.
.PHONY: bench-scale
STAGES ?= 10000,100000,1000000
bench-scale: $(STAMP) system-etcd system-wrk
	$(PY) -m loadtest.bench_scale --stages $(STAGES)

# The Python client's cost: per request against raw httpx, writes/s at 64 AsyncClient tasks
# against wrk (the HTTP benchmark's generator); results/bench_client.json.
.PHONY: bench-client
bench-client: $(STAMP) system-wrk
	$(PY) -m loadtest.bench_client --out results/bench_client.json

# Leases at scale against etcd in the same run: 10,000 leases kept alive by one generator
# (etcd through its gRPC keep-alive stream), the leader's CPU per keep-alive, expiry latency;
# then 1,000 against etcd's JSON gateway (one lease per request). docs/benchmarks.md.
.PHONY: bench-leases
bench-leases: $(STAMP) system-etcd
	$(PY) -m loadtest.bench_leases --leases 10000 --keyed 1000 --stores metakv,etcd-grpc --out results/bench_leases.json
	$(PY) -m loadtest.bench_leases --leases 1000 --keyed 200 --stores metakv,etcd --out results/bench_leases_gateway.json

# Watch fan-out against etcd in the same run: 100 watchers on distinct prefixes + 10 on a hot one.
.PHONY: bench-watch
bench-watch: $(STAMP) system-etcd
	$(PY) -m loadtest.bench_watch --distinct 100 --hot 10 --rate 200 --writers 32 --duration-s 10 --etcd --json results/bench_watch.json

# The dashboard's cost to the node it watches: 20 open cluster views against none (docs/benchmarks.md).
.PHONY: bench-ui
bench-ui: $(STAMP) system-chromium
	$(PY) -m loadtest.bench_ui --tabs 20 --duration-s 20 --json results/bench_ui.json

# Chaos: real processes, faults through proxies, a checked history. Results in results/chaos-SEED.
SEED ?= 1
DURATION ?= 300
.PHONY: chaos
chaos: $(STAMP)
	$(PY) -m tests.chaos.harness --seed $(SEED) --duration-s $(DURATION) --results results/chaos-$(SEED)

# Lock fencing at length (tests/leases_client/fencing.py): 5 holder processes, 20 rounds each,
# 4 faults: a leader SIGKILL with a holder SIGSTOPped while it holds the lock, then the leader
# isolated through the chaos proxy (make test runs 3 holders x 1 round, 1 kill, no proxy);
# before it, the tests kept out of make test for time: elections across a failover, and
# `metakv lock`/`elect` on a lost lease and signals (tests/leases_client/long_*.py).
.PHONY: chaos-locks
chaos-locks: $(STAMP)
	$(PY) -m pytest -q tests/leases_client/long_election.py tests/leases_client/long_cli.py
	$(PY) -m tests.leases_client.fencing --holders 5 --rounds 20 --faults 4 --partitions

sim: $(STAMP)
	$(PY) -m tests.sim.run --seeds $(SEEDS)

.PHONY: bench-pipeline
bench-pipeline: $(STAMP) system-java
	$(PY) -m loadtest.bench_pipeline --records $(or $(RECORDS),10000000)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

# Compaction: more simulator seeds than make test runs, and the benchmark (docs/compaction.md).
.PHONY: sim-compaction bench-compaction
sim-compaction: $(STAMP)
	$(PY) -m tests.sim.compaction --seeds 100

bench-compaction: $(STAMP)
	$(PY) -m loadtest.bench_compaction

# Mutation testing (tests/mutants): every catalogued protocol mutation must make a simulator
# fail; exits 1 if one survives. make test runs a quick subset (tests/mutants/test_mutants_quick.py).
.PHONY: mutants
MUTANT_ARGS ?=
mutants: $(STAMP)
	$(PY) -m tests.mutants.run $(MUTANT_ARGS)

# The issue's abuse at full scale against one node (docs/security.md): 5,000 idle connections,
# 1,000 SSE watchers that never read, 1,000 slowloris clients, a 1 GiB Content-Length, nested
# JSON; an ordinary GET must keep working and RSS stay bounded. make test runs small versions.
.PHONY: abuse
abuse: $(STAMP)
	$(PY) -m tests.security.abuse_run --out results/abuse.json
