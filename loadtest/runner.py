"""`python -m loadtest run`: one scenario, one target, one results folder.

The folder holds everything a later reader (the report, the PySpark pipeline) needs, and
nothing typed by hand:

    run.json                 scenario, target, users, rate, churn, duration, started, host,
                             seed, endpoints, failover, checks verdict, locust exit code
    locust.json              Locust's --json statistics (per operation, with histograms)
    locust_stats.csv, locust_stats_history.csv, locust_failures.csv, locust_exceptions.csv
    samples.csv              every request: start time, name, milliseconds, ok
    checks.json              what the scenario verified (watch order, CAS counters, ...)
    metrics/before-N.prom, metrics/after-N.prom    each node's /metrics around the run
    locust.log               Locust's own log
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.clusters import (
    CLUSTER_TARGETS,
    LocalCluster,
    cluster_summary,
    fetch_text,
    start_cluster,
)
from loadtest.scenario_names import SCENARIOS
from raft.types import check

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
LOCUST_GRACE_S = 120.0  # beyond --duration: startup, preload, end-of-run checks
STARTED_WAIT_S = 60.0  # how long the failover thread waits for the load to begin


@dataclass(frozen=True)
class RunSpec:
    scenario: str
    # "metakv", "metakv-etcd" (metakv through its etcd gateway), "etcd", or comma-separated
    # URLs of a running cluster
    target: str = "metakv"
    store: str | None = None  # API of a URL target; defaults to metakv
    users: int = 8
    rate: float = 0.0  # task iterations per second over all users; 0 = closed loop
    duration_s: float = 20.0
    churn: float = 0.5
    seed: int = 1
    key_count: int = 1000
    failover_after_s: float | None = None  # SIGKILL the leader this long after load starts
    nodes: int = 3

    def validate(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {self.scenario!r}; one of: {', '.join(SCENARIOS)}")
        if self.users < 1:
            raise ValueError("--users must be at least 1")
        if self.duration_s <= 0:
            raise ValueError("--duration must be positive")
        if not 0.0 <= self.churn <= 1.0:
            raise ValueError("--churn is a share of operations, between 0 and 1")
        if self.rate < 0:
            raise ValueError("--rate must be 0 (closed loop) or positive")
        if self.failover_after_s is not None:
            if self.target not in CLUSTER_TARGETS:
                raise ValueError("--failover-after needs a cluster the runner starts (metakv, metakv-etcd or etcd)")
            if not 0 < self.failover_after_s < self.duration_s:
                raise ValueError("--failover-after must fall inside --duration")
        if self.store not in (None, "metakv", "etcd"):
            raise ValueError("--store is metakv or etcd")

    @property
    def store_kind(self) -> str:
        """The API the load speaks: a metakv-etcd cluster is spoken to as etcd."""
        if self.target in CLUSTER_TARGETS:
            return "etcd" if self.target == "metakv-etcd" else self.target
        return self.store or "metakv"


def default_out_dir(spec: RunSpec, root: Path = Path("results")) -> Path:
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    target = spec.target if spec.target in CLUSTER_TARGETS else f"url-{spec.store_kind}"
    failover = "-failover" if spec.failover_after_s else ""
    return root / f"{stamp}-{spec.scenario}-{target}-c{spec.churn:g}{failover}"


def run(spec: RunSpec, out_dir: Path | None = None, shared_cluster: LocalCluster | None = None) -> Path:
    """Run one scenario and return its results folder. With ``shared_cluster`` (the bench
    reuses one cluster per target for its steady-state runs) that cluster is used and left
    running; otherwise a metakv/etcd target gets a fresh cluster, stopped afterwards."""
    spec.validate()
    if shared_cluster is not None:
        check(shared_cluster.kind == spec.target, "a shared cluster serves runs of its own kind")
        check(spec.failover_after_s is None, "a failover run needs a cluster of its own")
    out = Path(out_dir) if out_dir else default_out_dir(spec)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics").mkdir(exist_ok=True)
    cluster: LocalCluster | None = shared_cluster
    started = dt.datetime.now(dt.UTC)
    try:
        if cluster is not None:
            endpoints = cluster.endpoints
        elif spec.target in CLUSTER_TARGETS:
            cluster = start_cluster(spec.target, spec.nodes)
            endpoints = cluster.endpoints
        else:
            endpoints = [url.strip().rstrip("/") for url in spec.target.split(",") if url.strip()]
            check(len(endpoints) > 0, "a URL target names at least one endpoint")
        metrics_endpoints = cluster.metrics_endpoints if cluster is not None else endpoints
        _save_metrics(metrics_endpoints, out / "metrics", "before")
        started = dt.datetime.now(dt.UTC)
        run_id = f"{out.name}-{uuid.uuid4().hex[:8]}"  # key prefix: runs sharing a cluster never collide
        exit_code, failover = _run_locust(spec, endpoints, out, cluster, run_id)
        _save_metrics(metrics_endpoints, out / "metrics", "after")
        checks = _read_json(out / "checks.json")
        document: dict[str, Any] = {
            "scenario": spec.scenario,
            "target": spec.target,
            "store": spec.store_kind,
            "users": spec.users,
            "rate": spec.rate,
            "churn": spec.churn,
            "duration": spec.duration_s,
            "started": started.isoformat(),
            "host": socket.gethostname(),
            "seed": spec.seed,
            "run_id": run_id,
            "key_count": spec.key_count,
            "endpoints": endpoints,
            "cluster": cluster_summary(cluster) if cluster else None,
            "cluster_shared": shared_cluster is not None,
            "failover": failover,
            "locust_exit_code": exit_code,
            "locust_version": _locust_version(),
            "load_started_at": _read_float(out / "load_started"),
            "checks_ok": bool(checks.get("ok")) if checks else None,
            "locust_exceptions": _count_csv_rows(out / "locust_exceptions.csv"),
        }
        (out / "run.json").write_text(json.dumps(document, indent=2) + "\n")
        return out
    finally:
        if cluster is not None and cluster is not shared_cluster:
            cluster.stop()


def _run_locust(
    spec: RunSpec, endpoints: list[str], out: Path, cluster: LocalCluster | None, run_id: str
) -> tuple[int, dict[str, Any] | None]:
    started_marker = out / "load_started"
    started_marker.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--users", str(spec.users), "--spawn-rate", str(max(spec.users, 1)),
        "--load-seconds", str(spec.duration_s), "--stop-timeout", "0",
        "--host", endpoints[0], "--endpoints", ",".join(endpoints), "--store", spec.store_kind,
        "--churn", str(spec.churn), "--target-rate", str(spec.rate), "--seed", str(spec.seed),
        "--run-id", run_id, "--key-count", str(spec.key_count),
        "--csv", str(out / "locust"), "--csv-full-history", "--json", "--only-summary",
        "--exit-code-on-error", "0", "--loglevel", "WARNING", "--logfile", str(out / "locust.log"),
        "--checks-out", str(out / "checks.json"), "--samples-out", str(out / "samples.csv"),
        "--started-out", str(started_marker),
        SCENARIOS[spec.scenario],
    ]
    environment = dict(os.environ, PYTHONPATH=_pythonpath())
    failover: dict[str, Any] = {}
    with open(out / "locust.json", "wb") as stdout, open(out / "locust.stderr", "wb") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                   env=environment)
        killer = None
        if spec.failover_after_s is not None and cluster is not None:
            killer = threading.Thread(
                target=_kill_leader_later, args=(cluster, started_marker, spec.failover_after_s, failover, process),
                daemon=True,
            )
            killer.start()
        try:
            exit_code = process.wait(timeout=spec.duration_s + LOCUST_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise RuntimeError(f"locust did not finish within {spec.duration_s + LOCUST_GRACE_S:.0f}s; see {out}") from None
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        if killer is not None:
            killer.join(timeout=STARTED_WAIT_S)
    stderr_text = (out / "locust.stderr").read_text(errors="replace")
    if exit_code not in (0, 1) or not (out / "locust.json").stat().st_size:
        raise RuntimeError(f"locust failed (exit {exit_code}): {stderr_text[-2000:]}")
    if spec.failover_after_s is not None and "killed_at" not in failover:
        raise RuntimeError(f"failover requested but no leader was killed: {failover.get('error', 'unknown')}")
    return exit_code, (failover or None)


def _kill_leader_later(
    cluster: LocalCluster, started_marker: Path, after_s: float, result: dict[str, Any],
    process: subprocess.Popen[bytes],
) -> None:
    """Wait for the load to start, then SIGKILL whichever node leads at that moment."""
    deadline = time.monotonic() + STARTED_WAIT_S
    while not started_marker.exists():
        if time.monotonic() > deadline or process.poll() is not None:
            result["error"] = "the load never started"
            return
        time.sleep(0.05)
    time.sleep(after_s)
    leader = cluster.leader()
    if leader is None:
        result["error"] = "no leader found at failover time"
        return
    result["killed_at"] = time.time()
    cluster.kill(leader)
    result.update({"node": leader.node_id, "endpoint": leader.url, "after_s": after_s})


def _save_metrics(endpoints: list[str], directory: Path, label: str) -> None:
    for index, endpoint in enumerate(endpoints, start=1):
        text = fetch_text(endpoint + "/metrics")
        if text is not None:
            (directory / f"{label}-{index}.prom").write_text(text)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _count_csv_rows(path: Path) -> int | None:
    """Rows after the header: Locust lists there the exceptions raised inside tasks."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return None
    return max(0, len(lines) - 1)


def _read_float(path: Path) -> float | None:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _locust_version() -> str:
    from importlib.metadata import version

    return version("locust")


def _pythonpath() -> str:
    """The project root first, so the Locust subprocess imports this checkout's loadtest."""
    root = str(Path(__file__).resolve().parent.parent)
    existing = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + existing if existing else "")
