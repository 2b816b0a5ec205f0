"""What a client sees from a healthy 3-voter + 1-observer cluster of real processes.

One cluster serves every test of this module (none of them breaks it), each test under its
own key prefix.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cluster import Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root: Path = tmp_path_factory.mktemp("kv-cluster")
    with Cluster(root, voters=3, observers=1) as running:
        try:
            leader = running.wait_for_leader()
            for node in running.nodes.values():
                running.wait_ready(node)
            # A voter that missed the first BeginQuorumEpoch learns the leader on its resend;
            # until then it rightly answers writes with 503, so wait for every node to know.
            running.wait_until(
                lambda: all((running.status(node) or {}).get("leader_id") == leader.node_id
                            for node in running.nodes.values()),
                what="every node knows the leader")
            yield running
        finally:
            print(running.logs())


def follower_of(cluster: Cluster) -> tuple:
    leader = cluster.wait_for_leader()
    follower = next(node for node in cluster.voters if node.node_id != leader.node_id)
    return leader, follower


def test_write_to_follower_redirects_to_leader_and_following_succeeds(cluster: Cluster) -> None:
    leader, follower = follower_of(cluster)
    client = cluster.client()
    response = client.put(f"{follower.url}/v1/kv/redirect/a?x=1", content=b"v1")
    assert response.status_code == 307
    assert response.headers["location"] == f"{leader.url}/v1/kv/redirect/a?x=1"
    assert response.headers["x-raft-leader"] == str(leader.node_id)
    followed = client.put(f"{follower.url}/v1/kv/redirect/a", content=b"v1", follow_redirects=True)
    assert followed.status_code == 200
    body = followed.json()
    assert body["key"] == "redirect/a"
    assert body["created"] is True
    assert body["version"] > 0


def test_observer_redirects_writes_and_serves_reads(cluster: Cluster) -> None:
    leader = cluster.wait_for_leader()
    observer = cluster.observers[0]
    client = cluster.client()
    response = client.put(f"{observer.url}/v1/kv/observer/a", content=b"o")
    assert response.status_code == 307
    assert response.headers["location"].startswith(leader.url)
    version = client.put(response.headers["location"], content=b"o").json()["version"]
    read = client.get(f"{observer.url}/v1/kv/observer/a", params={"min_version": version})
    assert read.status_code == 200
    assert read.content == b"o"


def test_write_version_is_visible_on_every_node_with_min_version(cluster: Cluster) -> None:
    response = cluster.put("visible/k", b"hello")
    assert response.status_code == 200
    version = response.json()["version"]
    for node in cluster.nodes.values():
        read = cluster.client().get(f"{node.url}/v1/kv/visible/k", params={"min_version": version})
        assert read.status_code == 200, (node.node_id, read.text)
        assert read.content == b"hello"
        assert int(read.headers["x-metadata-version"]) >= version
        assert read.headers["etag"] == f'"{version}"'
        assert read.headers["x-node-id"] == str(node.node_id)


def test_compare_and_set_conflict_is_412_with_current_version(cluster: Cluster) -> None:
    first = cluster.put("cas/k", b"1").json()["version"]
    second = cluster.put("cas/k", b"2", headers={"If-Match": f'"{first}"'})
    assert second.status_code == 200
    stale = cluster.put("cas/k", b"3", headers={"If-Match": f'"{first}"'})
    assert stale.status_code == 412
    assert stale.headers["content-type"].startswith("application/problem+json")
    assert stale.json()["current_version"] == second.json()["version"]
    leader = cluster.wait_for_leader()
    assert cluster.client().get(f"{leader.url}/v1/kv/cas/k", params={"consistency": "leader"}).content == b"2"


def test_create_only_on_existing_key_is_412(cluster: Cluster) -> None:
    created = cluster.put("create-only/k", b"1", headers={"If-None-Match": "*"})
    assert created.status_code == 200
    assert created.json()["created"] is True
    again = cluster.put("create-only/k", b"2", headers={"If-None-Match": "*"})
    assert again.status_code == 412
    assert again.json()["current_version"] == created.json()["version"]


def test_txn_applies_all_or_nothing(cluster: Cluster) -> None:
    leader = cluster.wait_for_leader()
    client = cluster.client()
    base = cluster.put("txn/guard", b"g").json()["version"]
    failing = client.post(f"{leader.url}/v1/txn", json={
        "compare": [{"key": "txn/guard", "mod_version": base + 1000}],
        "success": [{"op": "put", "key": "txn/a", "value": "A"}, {"op": "put", "key": "txn/b", "value": "B"}],
        "failure": [{"op": "get", "key": "txn/guard"}],
    })
    assert failing.status_code == 200, failing.text
    assert failing.json()["succeeded"] is False
    for key in ("txn/a", "txn/b"):
        assert client.get(f"{leader.url}/v1/kv/{key}", params={"consistency": "leader"}).status_code == 404
    passing = client.post(f"{leader.url}/v1/txn", json={
        "compare": [{"key": "txn/guard", "mod_version": base}],
        "success": [{"op": "put", "key": "txn/a", "value": "A"}, {"op": "put", "key": "txn/b", "value": "B"},
                    {"op": "delete", "key": "txn/guard"}],
    })
    assert passing.status_code == 200, passing.text
    body = passing.json()
    assert body["succeeded"] is True
    reads = {key: client.get(f"{leader.url}/v1/kv/{key}", params={"consistency": "leader"})
             for key in ("txn/a", "txn/b", "txn/guard")}
    assert reads["txn/a"].content == b"A" and reads["txn/b"].content == b"B"
    assert reads["txn/a"].headers["etag"] == reads["txn/b"].headers["etag"] == f'"{body["version"]}"'
    assert reads["txn/guard"].status_code == 404


def test_list_is_consistent_at_one_version_under_concurrent_writes(cluster: Cluster) -> None:
    text = {"Content-Type": "text/plain"}  # listed as strings, not base64
    for i in range(10):
        cluster.put(f"list/k{i:02d}", b"0", headers=text)
    stop = threading.Event()

    def churn() -> None:
        with httpx.Client(timeout=10.0) as client:
            leader = cluster.wait_for_leader()
            round_number = 1
            while not stop.is_set():
                for i in range(10):
                    client.put(f"{leader.url}/v1/kv/list/k{i:02d}", content=str(round_number).encode(),
                               headers=text, follow_redirects=True)
                round_number += 1

    writer = threading.Thread(target=churn, daemon=True)
    writer.start()
    try:
        follower = follower_of(cluster)[1]
        client = cluster.client()
        for _ in range(5):
            listing = client.get(f"{follower.url}/v1/kv", params={"prefix": "list/"})
            assert listing.status_code == 200
            body = listing.json()
            version = body["version"]
            assert [item["key"] for item in body["items"]] == [f"list/k{i:02d}" for i in range(10)]
            for item in body["items"]:
                assert item["mod_version"] <= version
                at_version = client.get(f"{follower.url}/v1/kv/{item['key']}", params={"at_version": version})
                assert at_version.status_code == 200
                assert at_version.text == item["value"]
                assert at_version.headers["etag"] == f'"{item["mod_version"]}"'
    finally:
        stop.set()
        writer.join(timeout=30)


def _write_changes(cluster: Cluster, prefix: str, count: int, changes: list[tuple[str, str, int]]) -> None:
    """``count`` writes to the leader under ``prefix`` (four keys in turn, every fifth a
    delete), each followed by a write outside it; every change is appended to ``changes``
    as (type, key, version) once acknowledged."""
    noise_key = prefix.rstrip("/") + "-other/x"
    with httpx.Client(timeout=10.0) as client:
        leader = cluster.wait_for_leader()
        for i in range(count):
            key = f"{prefix}k{i % 4}"
            if i % 5 == 4:
                response = client.delete(f"{leader.url}/v1/kv/{key}", follow_redirects=True)
                if response.json().get("deleted", True):
                    changes.append(("delete", key, response.json()["version"]))
            else:
                response = client.put(f"{leader.url}/v1/kv/{key}", content=str(i).encode(),
                                      follow_redirects=True)
                changes.append(("put", key, response.json()["version"]))
            client.put(f"{leader.url}/v1/kv/{noise_key}", content=b"noise", follow_redirects=True)


def test_watch_delivers_every_change_in_order_across_reconnects(cluster: Cluster) -> None:
    start_version = cluster.put("watch-other/x", b"-").json()["version"]
    expected: list[tuple[str, str, int]] = []
    done = threading.Event()

    def writes() -> None:
        _write_changes(cluster, "watch/", 30, expected)
        done.set()

    writer = threading.Thread(target=writes, daemon=True)
    writer.start()
    seen: list[tuple[str, str, int]] = []
    cursor = start_version
    nodes = list(cluster.nodes.values())
    polls = 0
    deadline = time.monotonic() + 60
    # Each poll is a fresh request to the next node in turn: a reconnect from since=cursor.
    while time.monotonic() < deadline and not (done.is_set() and len(seen) >= len(expected)):
        node = nodes[polls % len(nodes)]
        polls += 1
        response = httpx.get(f"{node.url}/v1/watch",
                             params={"prefix": "watch/", "since": cursor, "timeout_ms": 500}, timeout=10.0)
        assert response.status_code == 200, response.text
        body = response.json()
        for event in body["events"]:
            seen.append((event["type"], event["key"], event["mod_version"]))
        cursor = max(cursor, body["version"])  # a lagging node may answer below the cursor
    writer.join(timeout=30)
    assert seen == sorted(expected, key=lambda change: change[2])
    assert any(change[0] == "delete" for change in seen)


def _sse_changes(url: str, prefix: str, since: int, until: threading.Event, expected: list[int]) -> list[tuple[str, str, int]]:
    """An SSE client of ``url``: every event it gets, reconnecting with Last-Event-ID when
    a stream ends, until ``until`` is set and it has at least ``expected[0]`` events."""
    seen: list[tuple[str, str, int]] = []
    last_id = str(since)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (until.is_set() and len(seen) >= expected[0]):
        with httpx.stream("GET", f"{url}/v1/watch", params={"prefix": prefix, "timeout_ms": 2000}, timeout=10.0,
                          headers={"accept": "text/event-stream", "last-event-id": last_id}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("id: "):
                    last_id = line[4:]
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    assert "type" in event, event  # not an error document
                    seen.append((event["type"], event["key"], event["mod_version"]))
                if until.is_set() and len(seen) >= expected[0]:
                    break
    return seen


def test_sse_watches_on_every_node_get_each_change_as_it_applies_it(cluster: Cluster) -> None:
    """A watch is fed by its node's apply: the streams open on the followers and the
    observer see every committed change under their prefix once, in commit order."""
    start_version = cluster.put("sse-other/x", b"-").json()["version"]
    committed: list[tuple[str, str, int]] = []
    written = threading.Event()
    count = [1 << 30]  # how many events each stream must see: known once the writes are done
    results: dict[int, list[tuple[str, str, int]]] = {}

    def stream(node_id: int, url: str) -> None:
        results[node_id] = _sse_changes(url, "sse/", start_version, written, count)

    streams = [threading.Thread(target=stream, args=(node.node_id, node.url), daemon=True)
               for node in cluster.nodes.values()]
    for thread in streams:
        thread.start()
    _write_changes(cluster, "sse/", 40, committed)
    count[0] = len(committed)
    written.set()
    for thread in streams:
        thread.join(timeout=90)
    assert set(results) == set(cluster.nodes)
    for node_id, seen in results.items():
        assert seen == committed, node_id


def test_random_bytes_on_raft_port_close_that_connection_only(cluster: Cluster) -> None:
    leader, follower = follower_of(cluster)
    with socket.create_connection(follower.raft_address, timeout=10) as sock:
        sock.sendall(bytes(range(256)) * 64)
        closed = False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if sock.recv(65536) == b"":
                    closed = True
                    break
            except ConnectionResetError:
                closed = True
                break
            except TimeoutError:
                break
        assert closed, "the node kept a connection that sent garbage open"
    assert cluster.client().get(f"{follower.url}/healthz").status_code == 200
    version = cluster.put("garbage/after", b"still-works").json()["version"]
    read = cluster.client().get(f"{follower.url}/v1/kv/garbage/after", params={"min_version": version})
    assert read.status_code == 200
    assert read.content == b"still-works"
    assert cluster.wait_for_leader().node_id == leader.node_id


def test_linearizable_and_leader_reads_are_served_by_the_leader_only(cluster: Cluster) -> None:
    leader, follower = follower_of(cluster)
    version = cluster.put("linear/k", b"v").json()["version"]
    client = cluster.client()
    for consistency in ("linearizable", "leader"):
        on_leader = client.get(f"{leader.url}/v1/kv/linear/k", params={"consistency": consistency})
        assert on_leader.status_code == 200 and on_leader.content == b"v"
        assert int(on_leader.headers["x-metadata-version"]) >= version
        on_follower = client.get(f"{follower.url}/v1/kv/linear/k", params={"consistency": consistency})
        assert on_follower.status_code == 307
        assert on_follower.headers["location"].startswith(leader.url)
        # wait_ms bounds only a min_version wait: the quorum round itself is not cut short
        # by it (a linearizable read with wait_ms=0 was a 504 "version not reached").
        immediate = client.get(f"{leader.url}/v1/kv/linear/k", params={"consistency": consistency, "wait_ms": 0})
        assert immediate.status_code == 200 and immediate.content == b"v", immediate.text


def test_admin_snapshot_is_taken_at_the_applied_version(cluster: Cluster) -> None:
    leader, follower = follower_of(cluster)
    version = cluster.put("snapshot/k", b"v").json()["version"]
    client = cluster.client()
    client.get(f"{follower.url}/v1/kv/snapshot/k", params={"min_version": version})
    response = client.post(f"{follower.url}/v1/admin/snapshot")
    assert response.status_code == 200, response.text
    snapshot = response.json()["snapshot_id"]
    assert snapshot["end_offset"] >= version
    status = cluster.status(follower)
    assert status is not None and status["snapshot_id"]["end_offset"] == snapshot["end_offset"]


def test_metrics_expose_role_progress_latencies_and_replica_lag(cluster: Cluster) -> None:
    leader, follower = follower_of(cluster)
    cluster.put("metrics/k", b"v")
    text = cluster.client().get(f"{leader.url}/metrics").text
    assert 'metakv_role{role="leader"} 1.0' in text
    for name in ("metakv_epoch", "metakv_high_watermark", "metakv_applied_version",
                 "metakv_commit_latency_seconds_count", "metakv_fsync_latency_seconds_count",
                 "metakv_apply_latency_seconds_count", "metakv_event_loop_lag_seconds_count"):
        assert re.search(rf"^{name} [1-9]", text, re.MULTILINE), name
    for node in cluster.nodes.values():
        if node.node_id != leader.node_id:
            assert re.search(rf'^metakv_fetch_lag_records{{[^}}]*replica_id="{node.node_id}"', text, re.MULTILINE)
    follower_text = cluster.client().get(f"{follower.url}/metrics").text
    assert 'metakv_role{role="follower"} 1.0' in follower_text
    assert not re.search(r"^metakv_fetch_lag_records{", follower_text, re.MULTILINE)
