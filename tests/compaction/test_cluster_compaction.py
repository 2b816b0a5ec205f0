"""Compaction with real ``metakv serve`` processes (tests/cluster.py).

- The KIP-595 scenario: an observer that was down while a tombstone was dropped must
  re-bootstrap from a snapshot, never serve the deleted key, and answer 503 until consistent;
  then, under churn, it cleans its log from the snapshot on and keeps it bounded.
- Churn over a fixed key set: cleaned replicas keep the log within a small factor of the live
  data; a replica that never cleans grows with the history. Cleaned prefixes are identical.
- A crash before and after the cleaner's swap recovers to a valid log whose cleaned prefix is
  byte-identical (digest) to the other replicas'.
- POST /v1/admin/compact on a follower answers 307 to the leader.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import time
from pathlib import Path
from typing import Any

import httpx

from tests.cluster import Cluster, Node

FAST = {"election_timeout_ms": 500, "fetch_timeout_ms": 1000, "fetch_max_wait_ms": 200, "min_compaction_lag_ms": 0}
WAIT_S = 60.0


def _status(cluster: Cluster, node: Node) -> dict[str, Any]:
    status = cluster.status(node, timeout_s=5.0)
    assert status is not None, f"node {node.node_id} does not answer /v1/status"
    return status


def _write(cluster: Cluster, method: str, key: str, value: bytes = b"") -> int:
    """One write through the leader (redirects followed, retried while leadership moves);
    returns the version it produced."""
    deadline = time.monotonic() + WAIT_S
    while True:
        leader = cluster.wait_for_leader()
        try:
            response = cluster.client().request(method, f"{leader.url}/v1/kv/{key}", content=value,
                                                follow_redirects=True, timeout=10.0)
        except httpx.HTTPError:
            response = None
        if response is not None and response.status_code in (200, 201, 204):
            return int(response.headers["X-Metadata-Version"])
        if response is not None and method == "DELETE" and response.status_code == 404:
            return int(response.headers["X-Metadata-Version"])
        assert time.monotonic() < deadline, f"{method} {key}: {response and response.status_code}"
        time.sleep(0.1)


def _write_until(cluster: Cluster, version: int, key_count: int, tag: str) -> int:
    """Overwrite keys f0..f{key_count-1} until the log reaches ``version``."""
    current = 0
    index = 0
    while current < version:
        current = _write(cluster, "PUT", f"f{index % key_count}", f"{tag}-{index}".encode())
        index += 1
    return current


def _compact(cluster: Cluster) -> dict[str, Any]:
    leader = cluster.wait_for_leader()
    response = cluster.client().post(f"{leader.url}/v1/admin/compact", timeout=30.0)
    assert response.status_code == 200, response.text
    return response.json()


def test_kip595_observer_rebootstraps_and_never_serves_the_deleted_key(tmp_path: Path) -> None:
    # Tombstones stay 250 offsets below the cleaned end, so an observer some records behind
    # the voters (observers do not hold the horizon back) continues without a snapshot.
    settings = {**FAST, "cleaner_interval_ms": 200, "cleaner_min_dirty_ratio": 0, "snapshot_every_records": 0,
                "tombstone_retention_records": 250}
    with Cluster(tmp_path, voters=3, observers=1, settings=settings) as cluster:
        observer = cluster.observers[0]
        cluster.wait_for_leader()
        _write_until(cluster, 199, 20, "a")
        victim_version = _write(cluster, "PUT", "victim", b"alive")
        assert 190 <= victim_version <= 210
        stop_at = _write_until(cluster, 300, 20, "b")
        cluster.wait_until(lambda: _status(cluster, observer)["applied_version"] >= stop_at,
                           WAIT_S, "observer applied ~300")
        assert cluster.client().get(f"{observer.url}/v1/kv/victim").content == b"alive"
        observer.stop()

        _write_until(cluster, 399, 20, "c")
        tombstone_version = _write(cluster, "DELETE", "victim")
        assert 390 <= tombstone_version <= 410
        _write_until(cluster, 760, 20, "d")

        def cleaned_past_700() -> bool:  # on every voter: whichever leads later has cleaned
            _compact(cluster)  # (700: the tombstone must lie 250 records below the cleaned end)
            statuses = [_status(cluster, voter) for voter in cluster.voters]
            return all(s["cleaned_end"] > 700 and s["dirty_offset"] > 700 for s in statuses)
        cluster.wait_until(cleaned_past_700, WAIT_S, "voters cleaned past 700")
        leader = cluster.wait_for_leader()
        for voter in cluster.voters:  # the tombstone is physically gone everywhere
            status = _status(cluster, voter)
            assert status["last_clean"]["tombstone_horizon_used"] > tombstone_version
            assert status["tombstones_dropped_total"] >= 1
        assert cluster.client().get(f"{leader.url}/v1/kv/victim").status_code == 404

        # Keep every voter from answering, so the restarted observer cannot learn the dirty
        # offset: it must not serve its (stale, pre-delete) state meanwhile.
        paused = cluster.voters
        for voter in paused:
            voter.pause()
        try:
            observer.start()
            cluster.wait_until(lambda: _answers(cluster, observer), WAIT_S, "observer HTTP up")
            read = cluster.client().get(f"{observer.url}/v1/kv/victim", timeout=5.0)
            assert read.status_code == 503, read.text
            assert "catching up" in read.json()["detail"]
            assert cluster.client().get(f"{observer.url}/readyz", timeout=5.0).status_code == 503
        finally:
            for voter in paused:
                voter.resume()

        seen: list[int] = []

        def consistent() -> bool:
            read = cluster.client().get(f"{observer.url}/v1/kv/victim", timeout=5.0)
            seen.append(read.status_code)
            assert read.status_code in (404, 503), f"observer served the deleted key: {read.status_code} {read.text}"
            return read.status_code == 404
        cluster.wait_until(consistent, WAIT_S, "observer consistent")
        status = _status(cluster, observer)
        assert status["ready"] is True
        assert status["log_start_offset"] > tombstone_version, "the observer did not re-bootstrap from a snapshot"
        assert status["snapshot_id"]["end_offset"] >= status["log_start_offset"]
        leader = cluster.wait_for_leader()
        version = _status(cluster, leader)["applied_version"]
        for index in range(20):
            expected = cluster.client().get(f"{leader.url}/v1/kv/f{index}").content
            got = cluster.client().get(f"{observer.url}/v1/kv/f{index}?min_version={version}&wait_ms=10000")
            assert got.content == expected

        # The re-bootstrapped observer's log starts at the snapshot: it cleans from there, so
        # churn leaves its log bounded by the live data (it used to grow without bound).
        log_start = status["log_start_offset"]
        keys, value_bytes, writes = 10, 1024, 600
        _churn(cluster, writes, keys, value_bytes)
        last_version = _status(cluster, cluster.wait_for_leader())["applied_version"]

        def observer_cleaned_to_the_end() -> bool:
            _compact(cluster)
            observed = _status(cluster, observer)
            return observed["cleaned_end"] >= last_version and observed["applied_version"] >= last_version
        cluster.wait_until(observer_cleaned_to_the_end, WAIT_S, "observer cleaned from its snapshot to the end")
        status = _status(cluster, observer)
        assert status["log_start_offset"] >= log_start > 0
        # It kept its log across most of the churn (not a fresh snapshot at the end) ...
        assert status["log_end_offset"] - status["log_start_offset"] >= writes // 2, status
        assert status["last_clean"]["log_start_offset"] == status["log_start_offset"]
        assert status["prefix_digest"]["start_offset"] == status["log_start_offset"]
        assert status["prefix_digest"]["end_offset"] == status["cleaned_end"]
        # ... and that log stays within a small factor of the live data, where the records
        # it holds would take at least 20 times as much uncleaned.
        live_bytes = keys * (value_bytes + 4) + 20 * 16  # the churned keys and f0..f19
        assert (writes // 2) * (6 / 7) * value_bytes >= 20 * live_bytes
        assert status["log_size_bytes"] <= 3 * live_bytes, (status["log_size_bytes"], live_bytes)
        for index in range(keys):
            expected = cluster.client().get(
                f"{cluster.wait_for_leader().url}/v1/kv/k{index}?min_version={last_version}&wait_ms=10000",
                follow_redirects=True)
            got = cluster.client().get(f"{observer.url}/v1/kv/k{index}?min_version={last_version}&wait_ms=10000")
            assert (got.status_code, got.content) == (expected.status_code, expected.content)


def _answers(cluster: Cluster, node: Node) -> bool:
    try:
        cluster.client().get(f"{node.url}/healthz", timeout=2.0)
    except httpx.HTTPError:
        return False
    return True


def _churn(cluster: Cluster, writes: int, keys: int, value_bytes: int) -> None:
    """create/update/delete over a fixed key set, from 4 client threads."""
    def worker(worker_id: int) -> None:
        for index in range(worker_id, writes, 4):
            key = f"k{index % keys}"
            if index % 7 == 6:
                _write(cluster, "DELETE", key)
            else:
                _write(cluster, "PUT", key, bytes([65 + index % 26]) * value_bytes)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(worker, worker_id) for worker_id in range(4)]:
            future.result()


def test_churn_log_stays_bounded_with_cleaning_and_grows_without(tmp_path: Path) -> None:
    keys, value_bytes, writes = 30, 1024, 1200
    settings = {**FAST, "cleaner_interval_ms": 300, "cleaner_min_dirty_ratio": 0, "snapshot_every_records": 0}
    cluster = Cluster(tmp_path, voters=3, observers=1, settings=settings)
    never_cleans = cluster.nodes[3]
    never_cleans.command += ["--cleaner-interval-ms", "0"]
    fresh = cluster.observers[0]
    with cluster:
        fresh.kill()  # joins only after the churn, with an empty data directory
        shutil.rmtree(fresh.data_dir, ignore_errors=True)
        cluster.wait_for_leader()
        _churn(cluster, writes, keys, value_bytes)
        live_bytes = keys * (value_bytes + 4)
        cleaners = [node for node in cluster.voters if node is not never_cleans]

        def all_cleaned_alike() -> bool:
            if cluster.wait_for_leader() in cleaners:
                _compact(cluster)
            statuses = [_status(cluster, node) for node in cleaners]
            ends = {s["cleaned_end"] for s in statuses}
            return (len(ends) == 1 and statuses[0]["cleaned_end"] >= writes
                    and len({s["prefix_digest"]["sha256"] for s in statuses}) == 1
                    and all(s["prefix_digest"]["end_offset"] == s["cleaned_end"] for s in statuses))
        cluster.wait_until(all_cleaned_alike, WAIT_S, "cleaned replicas at one cleaned end with one digest")
        # A fresh observer reads the cleaned log from offset 0 (offsets jump there): from a
        # leader that cleaned, so hand leadership away from the replica that never cleans.
        def cleaner_leads() -> bool:
            current = cluster.wait_for_leader()
            if current is never_cleans:
                cluster.client().post(f"{current.url}/v1/admin/resign")
                time.sleep(0.5)
                return False
            return True
        cluster.wait_until(cleaner_leads, WAIT_S, "a cleaning replica leads")
        fresh.start()
        cluster.wait_ready(fresh, WAIT_S)
        fresh_status = _status(cluster, fresh)
        assert fresh_status["log_start_offset"] == 0 and fresh_status["cleaned_end"] > 0
        sizes = {node.node_id: _status(cluster, node)["log_size_bytes"] for node in cluster.voters}
        raw = sizes[never_cleans.node_id]
        for node in cleaners:
            assert sizes[node.node_id] <= 3 * live_bytes, (sizes, live_bytes)
        assert raw >= 20 * live_bytes, (sizes, live_bytes)
        # Same answers everywhere, cleaned or not.
        for index in range(keys):
            expected = cluster.client().get(f"{cluster.wait_for_leader().url}/v1/kv/k{index}?consistency=linearizable",
                                            follow_redirects=True)
            for node in cluster.nodes.values():
                got = cluster.client().get(f"{node.url}/v1/kv/k{index}?min_version="
                                           f"{expected.headers['X-Metadata-Version']}&wait_ms=10000")
                assert (got.status_code, got.content) == (expected.status_code, expected.content)
        # History below the dirty offset is gone: 410 with the oldest retained version.
        status = _status(cluster, cleaners[0])
        gone = cluster.client().get(f"{cleaners[0].url}/v1/kv/k1?at_version=1")
        assert gone.status_code == 410 and gone.json()["oldest_version"] == status["oldest_version"] > 1


def test_crash_before_and_after_swap_recovers_to_identical_prefix_and_compact_redirects(tmp_path: Path) -> None:
    settings = {**FAST, "cleaner_interval_ms": 300, "cleaner_min_dirty_ratio": 0, "snapshot_every_records": 0}
    cluster = Cluster(tmp_path, voters=3, settings=settings)
    with cluster:
        leader = cluster.wait_for_leader()
        followers = [node for node in cluster.voters if node is not leader]

        # Bad input: compact on a non-leader is a redirect to the leader.
        redirect = cluster.client().post(f"{followers[0].url}/v1/admin/compact")
        assert redirect.status_code == 307
        assert redirect.headers["Location"].startswith(leader.url)

        for victim, failpoint in ((followers[0], "segment.before_swap=crash"),
                                  (followers[1], "segment.after_swap=crash")):
            victim.kill()
            victim.env["METAKV_FAILPOINTS"] = failpoint
            victim.start()
            index = 0
            while victim.running():  # it crashes at its first cleaning; the others keep a quorum
                _write(cluster, "PUT", f"c{index % 15}", f"{failpoint}-{index}".encode())
                index += 1
                assert index < 5000, f"node {victim.node_id} never hit {failpoint}"
            assert victim.process is not None and victim.process.wait() == 86
            del victim.env["METAKV_FAILPOINTS"]
            victim.start()
            cluster.wait_ready(victim, WAIT_S)

        _write_until(cluster, _status(cluster, leader)["log_end_offset"] + 50, 15, "final")

        def identical() -> bool:
            _compact(cluster)
            statuses = [_status(cluster, node) for node in cluster.voters]
            return (len({s["cleaned_end"] for s in statuses}) == 1 and statuses[0]["cleaned_end"] > 0
                    and len({(s["prefix_digest"]["end_offset"], s["prefix_digest"]["sha256"]) for s in statuses}) == 1
                    and statuses[0]["prefix_digest"]["end_offset"] == statuses[0]["cleaned_end"])
        cluster.wait_until(identical, WAIT_S, "identical cleaned prefixes after the crashes")
        version = _status(cluster, leader)["applied_version"]
        for index in range(15):
            expected = cluster.client().get(f"{leader.url}/v1/kv/c{index}?min_version={version}&wait_ms=10000")
            for node in followers:
                got = cluster.client().get(f"{node.url}/v1/kv/c{index}?min_version={version}&wait_ms=10000")
                assert (got.status_code, got.content) == (expected.status_code, expected.content)
