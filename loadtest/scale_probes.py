"""What the scale benchmark reads off the servers besides request latency: memory and disk per
node, a metakv follower's apply figures from its /metrics, and the timed maintenance events
of a metakv node (cold restart, cleaning, snapshot take, snapshot install).

Each figure comes from what the node itself exposes or from the outside (the wall time of
a request, the time until a node serves a read); where the node reports nothing, the
figure says how it was taken instead.
"""

from __future__ import annotations

import datetime
import re
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.local_cluster import Node

PROBE_TIMEOUT_S = 5.0
POLL_S = 0.02
# Generous: a node at 1 M keys loads its key index before it answers, and the machine is shared.
READY_TIMEOUT_S = 600.0
ADMIN_TIMEOUT_S = 900.0
# A metakv node's log line (app/cli.py's format): "2026-11-22 07:43:12,345 node4 INFO ...".
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def rss_bytes(pid: int | None) -> int | None:
    """Resident memory of a live process (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def disk_bytes(*paths: Path) -> int:
    """Bytes the files under ``paths`` occupy on disk (allocated blocks, as du counts)."""
    total = 0
    for path in paths:
        candidates = [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file()) if path.exists() else []
        for file in candidates:
            try:
                total += file.stat().st_blocks * 512
            except OSError:
                continue
    return total


def metakv_node_sizes(node: Node) -> dict[str, Any]:
    data = node.data_dir
    return {
        "rss_bytes": rss_bytes(node.pid if node.running() else None),
        "state_db_bytes": disk_bytes(*(data / name for name in ("state.db", "state.db-wal", "state.db-shm"))),
        "log_bytes": disk_bytes(data / "log"),
        "snapshots_bytes": disk_bytes(data / "snapshots"),
    }


def etcd_member_sizes(node: Node) -> dict[str, Any]:
    status = post_json(node.url + "/v3/maintenance/status", {})
    return {
        "rss_bytes": rss_bytes(node.pid if node.running() else None),
        "member_dir_bytes": disk_bytes(node.data_dir / "member"),
        "db_size_bytes": int(status["dbSize"]) if status and "dbSize" in status else None,
        "revision": int(status["header"]["revision"]) if status else None,
    }


def post_json(url: str, document: dict[str, Any], timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any] | None:
    try:
        response = httpx.post(url, json=document, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def get_json(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any] | None:
    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def scrape(url: str) -> dict[str, float]:
    """A node's Prometheus samples without labels, by name (``/metrics``)."""
    response = httpx.get(url + "/metrics", timeout=PROBE_TIMEOUT_S)
    response.raise_for_status()
    samples: dict[str, float] = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, number = line.partition(" ")
            samples[name] = float(number)
    return samples


def apply_figures(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, Any]:
    """A follower's apply work between two scrapes: ``metakv_applied_version`` counts records
    (one per log offset), ``metakv_apply_latency_seconds`` times every apply call (one SQLite
    transaction). Records per second of apply time is the rate apply could sustain."""
    records = after["metakv_applied_version"] - before["metakv_applied_version"]
    calls = after["metakv_apply_latency_seconds_count"] - before["metakv_apply_latency_seconds_count"]
    busy_s = after["metakv_apply_latency_seconds_sum"] - before["metakv_apply_latency_seconds_sum"]
    return {
        "records": int(records),
        "apply_calls": int(calls),
        "apply_busy_s": round(busy_s, 3),
        "records_per_s": round(records / wall_s, 1) if wall_s > 0 else None,
        "records_per_apply_s": round(records / busy_s, 1) if busy_s > 0 else None,
        "apply_us_per_record": round(busy_s * 1e6 / records, 2) if records > 0 else None,
    }


def loop_lag_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """How late a node's event loop ran its probe timer between two scrapes
    (``metakv_event_loop_lag_seconds``, sampled every 50 ms): the mean is what anything
    arriving at a random moment waited before the loop thread got to it."""
    name = "metakv_event_loop_lag_seconds"
    if f"{name}_count" not in after or f"{name}_count" not in before:
        return {"samples": 0, "mean_ms": None}
    samples = after[f"{name}_count"] - before[f"{name}_count"]
    lag_s = after[f"{name}_sum"] - before[f"{name}_sum"]
    return {"samples": int(samples), "mean_ms": round(lag_s * 1000 / samples, 3) if samples > 0 else None}


def applied_version(node: Node) -> int:
    status = get_json(node.url + "/v1/status")
    if status is None:
        raise RuntimeError(f"node {node.node_id} does not answer /v1/status")
    return int(status["applied_version"])


def wait_serves(node: Node, key: str, version: int, timeout_s: float = READY_TIMEOUT_S) -> float:
    """Poll until ``node`` answers a local read of ``key`` at ``version`` or later with 200;
    the time.monotonic() when it did."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=PROBE_TIMEOUT_S) as client:
        while time.monotonic() < deadline:
            if not node.running():
                raise RuntimeError(f"node {node.node_id} exited:\n{node.log_tail()}")
            try:
                response = client.get(f"{node.url}/v1/kv/{key}", params={"min_version": version, "wait_ms": 100})
                if response.status_code == 200:
                    return time.monotonic()
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
    raise RuntimeError(f"node {node.node_id} did not serve {key} at version {version} within {timeout_s:.0f} s")


def cold_restart(follower: Node, leader: Node, key: str) -> dict[str, Any]:
    """SIGKILL a follower, start it again; seconds until it serves a read at the version the
    leader had applied (no writes run meanwhile)."""
    version = applied_version(leader)
    follower.kill()
    started = time.monotonic()
    follower.start()
    served = wait_serves(follower, key, version)
    return {"node_id": follower.node_id, "version": version, "seconds": round(served - started, 3)}


def compact(leader: Node) -> dict[str, Any]:
    """POST /v1/admin/compact on the leader: clean the log now (history is pruned with it)."""
    started = time.monotonic()
    response = httpx.post(leader.url + "/v1/admin/compact", timeout=ADMIN_TIMEOUT_S)
    seconds = time.monotonic() - started
    response.raise_for_status()
    report = response.json()
    return {"seconds": round(seconds, 3), "cleaned": report.get("cleaned"),
            "records_in": report.get("records_in"), "records_out": report.get("records_out"),
            "node_duration_ms": report.get("duration_ms")}


def snapshot_take(leader: Node) -> dict[str, Any]:
    """POST /v1/admin/snapshot on the leader; it answers once the snapshot exists. The node
    reports no duration: the figure is the request's wall time (it joins a periodic
    snapshot already running, if that one reaches far enough)."""
    started = time.monotonic()
    response = httpx.post(leader.url + "/v1/admin/snapshot", timeout=ADMIN_TIMEOUT_S)
    seconds = time.monotonic() - started
    response.raise_for_status()
    snapshot_id = response.json()["snapshot_id"]
    files = sorted((leader.data_dir / "snapshots").glob("*"), key=lambda path: path.stat().st_mtime)
    return {"seconds": round(seconds, 3), "snapshot_id": snapshot_id,
            "snapshot_bytes": disk_bytes(files[-1]) if files else None}


def bootstrap_observer(observer: Node, leader: Node, key: str) -> None:
    """Start the observer once so that its log holds records (a fetcher at offset 0 would read
    the cleaned log, not a snapshot), then SIGKILL it: it stays behind from then on."""
    observer.start()
    wait_serves(observer, key, applied_version(leader))
    observer.kill()


def snapshot_install(observer: Node, leader: Node, key: str) -> dict[str, Any]:
    """Start the observer, which is behind the leader's cleaned end, so the leader sends it a
    snapshot (docs/compaction.md rule 5); then SIGKILL it again. The node logs when it starts
    installing ("installing snapshot") but not when it is done: download is from its start to
    that line, install from that line to its first read at the leader's version (nothing is
    written meanwhile, so nothing is left to apply after the snapshot)."""
    version = applied_version(leader)
    log_offset = observer.log_path.stat().st_size if observer.log_path.exists() else 0
    started_wall, started = time.time(), time.monotonic()
    observer.start()
    try:
        served = wait_serves(observer, key, version)
    finally:
        observer.kill()
    with open(observer.log_path, "rb") as log:
        log.seek(log_offset)
        lines = log.read().decode(errors="replace").splitlines()
    installing = [line for line in lines if "installing snapshot" in line]
    result: dict[str, Any] = {"version": version, "rebootstrap_s": round(served - started, 3)}
    match = LOG_TIME.match(installing[0]) if installing else None
    if match is None:
        result.update(download_s=None, install_s=None,
                      note="the observer caught up without installing a snapshot (none was sent)")
        return result
    logged = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    download_s = logged - started_wall
    result.update(download_s=round(download_s, 3), install_s=round(served - started - download_s, 3))
    return result


def history_retained(node: Node) -> dict[str, Any]:
    """How many versions of history a metakv node holds (applied - oldest readable)."""
    status = get_json(node.url + "/v1/status") or {}
    applied, oldest = status.get("applied_version"), status.get("oldest_version")
    return {"applied_version": applied, "oldest_version": oldest,
            "versions": applied - oldest if applied is not None and oldest is not None else None,
            "cleaned_end": status.get("cleaned_end")}
