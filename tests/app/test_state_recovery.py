"""A node whose state.db lost its tail re-applies the missing records from its log at startup.

SQLite runs with relaxed sync (docs/state-machine.md): a power loss may take back commits
the log already holds. This replaces a stopped node's state.db by an older copy of itself
(what such a loss leaves behind) and checks the restarted node serves every write.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable

from storage.state_schema import read_database_meta
from tests.cluster import Cluster


def _copy_stopped_state(node_dir, copy_name: str) -> None:
    for suffix in ("-wal", "-shm"):
        assert not (node_dir / f"state.db{suffix}").exists(), "a graceful stop leaves no WAL behind"
    shutil.copy(node_dir / "state.db", node_dir.parent / copy_name)


def test_restart_with_an_older_state_db_replays_the_log(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(voters=1)
    node = cluster.wait_for_leader()
    for index in range(10):
        assert cluster.put(f"early/{index}", b"early-%d" % index).status_code == 200
    node.stop()
    _copy_stopped_state(node.data_dir, "stale-state.db")

    node.start()
    cluster.wait_for_leader()
    last_version = 0
    for index in range(10):
        response = cluster.put(f"late/{index}", b"late-%d" % index)
        assert response.status_code == 200
        last_version = response.json()["version"]
    overwrite = cluster.put("early/0", b"rewritten")
    assert overwrite.status_code == 200
    last_version = overwrite.json()["version"]
    node.stop()

    # The tail SQLite lost: state.db goes back to the copy taken before the late writes.
    stale = node.data_dir.parent / "stale-state.db"
    assert read_database_meta(str(stale)).applied_version < last_version - 10
    shutil.copy(stale, node.data_dir / "state.db")
    node.start()
    cluster.wait_for_leader()
    client = cluster.client()
    expected = {f"early/{index}": b"early-%d" % index for index in range(1, 10)}
    expected |= {f"late/{index}": b"late-%d" % index for index in range(10)}
    expected["early/0"] = b"rewritten"
    for key, value in expected.items():
        read = client.get(f"{node.url}/v1/kv/{key}", params={"min_version": last_version}, timeout=30.0)
        assert read.status_code == 200, (key, read.status_code, read.text)
        assert read.content == value, key
        assert int(read.headers["x-metadata-version"]) >= last_version


def test_a_state_db_older_than_the_cleaned_log_is_rebuilt_from_offset_0(
        cluster_factory: Callable[..., Cluster]) -> None:
    """state.db restored from a copy older than the log's cleaned prefix: the deletes in
    between lost their tombstones to the cleaner, so replaying from the copy's version would
    bring the deleted keys back. The node rebuilds its state from offset 0 instead."""
    cluster = cluster_factory(voters=1)
    node = cluster.wait_for_leader()
    for index in range(10):
        assert cluster.put(f"doomed/{index}", b"alive").status_code == 200
    node.stop()
    _copy_stopped_state(node.data_dir, "before-deletes.db")

    node.start()
    cluster.wait_for_leader()
    client = cluster.client()
    last_version = 0
    for index in range(5):
        response = client.delete(f"{node.url}/v1/kv/doomed/{index}", timeout=30.0)
        assert response.status_code == 200, response.text
        last_version = int(response.headers["x-metadata-version"])
    report = client.post(f"{node.url}/v1/admin/compact", timeout=30.0).json()
    assert report["cleaned"] and report["tombstones_dropped"] >= 5, report
    node.stop()

    shutil.copy(node.data_dir.parent / "before-deletes.db", node.data_dir / "state.db")
    node.start()
    cluster.wait_for_leader()
    for index in range(10):
        read = client.get(f"{node.url}/v1/kv/doomed/{index}", params={"min_version": last_version}, timeout=30.0)
        assert read.status_code == (404 if index < 5 else 200), (index, read.status_code, read.text)
    assert "rebuilding it from offset 0" in node.log_tail()
