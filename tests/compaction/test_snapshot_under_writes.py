"""Snapshots are taken off the event loop (VACUUM INTO on the runtime's snapshot thread)
while writes keep committing: every snapshot holds exactly the version it is named for.

A real single-voter ``metakv serve`` process; a background writer creates a new key per
write and records each acknowledged version, so a snapshot at version V must hold every
acknowledged key written at or below V and none written above it.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
from pathlib import Path

from raft.types import SnapshotId
from storage.snapshot_store import extract_database, snapshot_file_name
from storage.state_schema import read_database_meta
from tests.cluster import Cluster, SteadyWriter

FAST = {"election_timeout_ms": 500, "fetch_timeout_ms": 1000, "fetch_max_wait_ms": 200,
        "cleaner_interval_ms": 0, "snapshot_every_records": 0}
WAIT_S = 60.0


def _rows(database_path: Path) -> dict[str, int]:
    uri = f"file:{urllib.parse.quote(str(database_path))}?mode=ro&immutable=1"
    connection = sqlite3.connect(uri, uri=True)
    try:
        return dict(connection.execute("SELECT key, mod_version FROM entries").fetchall())
    finally:
        connection.close()


def test_snapshots_taken_during_writes_hold_exactly_their_version(tmp_path: Path) -> None:
    with Cluster(tmp_path, voters=1, settings=FAST) as cluster:
        node = cluster.wait_for_leader()
        for index in range(200):  # some bulk, so a copy takes a while
            assert cluster.put(f"bulk/{index}", bytes([65 + index % 26]) * 4096).status_code in (200, 201)
        taken: list[SnapshotId] = []
        with SteadyWriter(cluster, "during") as writer:
            writer.wait_for_acks(10, WAIT_S)
            for _ in range(4):
                response = cluster.client().post(f"{node.url}/v1/admin/snapshot", timeout=30.0)
                assert response.status_code == 200, response.text
                snapshot = response.json()["snapshot_id"]
                taken.append(SnapshotId(snapshot["end_offset"], snapshot["epoch"]))
                writer.wait_for_acks(writer.ack_count() + 5, WAIT_S)
        acked = dict(writer.acked)
        assert not writer.errors, writer.errors
        status = cluster.status(node)
        assert status is not None and status["snapshot_id"]["end_offset"] == max(s.end_offset for s in taken)

        snapshot_dir = node.data_dir / "snapshots"
        checked = 0
        for snapshot_id in taken:
            path = snapshot_dir / snapshot_file_name(snapshot_id)
            if not path.exists():  # an older one the store's retention already removed
                continue
            database = tmp_path / f"copy-{snapshot_id.end_offset}.db"
            extract_database(str(path), str(database))
            meta = read_database_meta(str(database))
            assert (meta.applied_version, meta.applied_epoch) == (snapshot_id.end_offset, snapshot_id.epoch)
            rows = _rows(database)
            for key, (_value, version) in acked.items():
                if version <= snapshot_id.end_offset:
                    assert rows.get(key) == version, (key, version, snapshot_id)
                else:
                    assert key not in rows, (key, version, snapshot_id)
            assert sum(key.startswith("bulk/") for key in rows) == 200
            checked += 1
        assert checked >= 1
        # Writes went on between the snapshots: they are at different versions.
        assert len({s.end_offset for s in taken}) > 1
