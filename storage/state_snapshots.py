"""Snapshots of the state database: create one at an applied version, load one.

A snapshot is a consistent copy (VACUUM INTO, on a read connection, so apply is not
blocked) whose ``key_heads`` is completed before it is published, so every snapshot is
self-contained; it is named by the version and epoch read from the copy itself and
published through SnapshotStore (storage/snapshot_store.py). Loading one replaces every
row and the meta row in one transaction, then rebuilds the key index.
"""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
from collections.abc import Callable

import sqlalchemy as sa

from raft.snapshots import CorruptSnapshotError
from raft.types import SnapshotId
from storage.snapshot_store import SnapshotStore, extract_database
from storage.state_database import StateDatabase
from storage.state_schema import (
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    NotAStateDatabaseError,
    complete_key_heads,
    history,
    key_heads,
    meta,
    read_database_meta,
    upgrade_schema,
    write_transaction,
)
from storage.state_types import SnapshotRejectedError


class StateSnapshots(StateDatabase):
    """create_snapshot and load_snapshot."""

    def create_snapshot(self, snapshot_dir: str | SnapshotStore, epoch: int | None = None,
                        accept: Callable[[SnapshotId], bool] | None = None) -> SnapshotId:
        """Copy the state at one applied version into ``snapshot_dir`` and publish it.

        The copy (VACUUM INTO) runs on a read connection, so apply is not blocked; the id is
        read from the copy itself, so it names exactly the version the copy holds. Pass the
        runtime's ``SnapshotStore`` instead of a directory to use its retention setting.
        ``accept`` sees the id before anything is published (retention may delete older
        snapshots then); a copy it refuses is thrown away (SnapshotRejectedError).
        """
        store = snapshot_dir if isinstance(snapshot_dir, SnapshotStore) else SnapshotStore(snapshot_dir)
        temp_path = store.new_temp_path()
        try:
            self._reader().exec_driver_sql("VACUUM INTO ?", (temp_path,))
            copy = sqlite3.connect(temp_path, isolation_level=None)
            try:
                complete_key_heads(copy)  # the heads apply had not written yet
            finally:
                copy.close()
            copy_meta = read_database_meta(temp_path)
            if copy_meta.applied_version == 0:
                raise ValueError("nothing applied yet: no snapshot of version 0")
            if epoch is not None and epoch != copy_meta.applied_epoch:
                raise ValueError(
                    f"snapshot at version {copy_meta.applied_version} has epoch "
                    f"{copy_meta.applied_epoch}, not {epoch}")
            snapshot_id = SnapshotId(copy_meta.applied_version, copy_meta.applied_epoch)
            if accept is not None and not accept(snapshot_id):
                raise SnapshotRejectedError(f"the state at version {snapshot_id.end_offset} is not a real version")
            store.publish_database(temp_path, snapshot_id)
            return snapshot_id
        finally:
            if os.path.exists(temp_path):
                os.unlink(temp_path)

    def load_snapshot(self, path: str) -> None:
        """Replace every row and the meta row by the snapshot's, in one transaction."""
        temp_path = f"{self.db_path}.snapshot-load.tmp"
        extract_database(path, temp_path)
        try:
            try:
                snapshot_meta = read_database_meta(temp_path)
            except NotAStateDatabaseError as exc:
                raise CorruptSnapshotError(f"{path}: {exc}") from exc
            if snapshot_meta.schema_version not in READABLE_SCHEMA_VERSIONS:
                raise CorruptSnapshotError(
                    f"{path}: schema version {snapshot_meta.schema_version}, this code reads {SCHEMA_VERSION}")
            if snapshot_meta.schema_version != SCHEMA_VERSION:  # from a peer not yet upgraded
                copy = sqlite3.connect(temp_path, isolation_level=None)
                try:
                    with write_transaction(copy):
                        upgrade_schema(copy, snapshot_meta.schema_version)
                finally:
                    copy.close()
            with self._write_lock:
                if self._closed:
                    raise RuntimeError("state machine is closed")
                with self._publish_lock:
                    self._replace_from(temp_path)
                    self._heads_version = self._writer_cursor.execute(
                        "SELECT heads_version FROM meta WHERE id = 1").fetchone()[0]
                    self._applied_version = snapshot_meta.applied_version
                    self._applied_epoch = snapshot_meta.applied_epoch
                    self._oldest_version = snapshot_meta.oldest_version
                    self._build_index()
                self._durable_version = 0  # a power loss may still take the load back
        finally:
            for suffix in ("", "-wal", "-shm", "-journal"):
                if os.path.exists(temp_path + suffix):
                    os.unlink(temp_path + suffix)

    def _replace_from(self, database_path: str) -> None:
        connection = self._writer
        uri = f"file:{urllib.parse.quote(database_path)}?mode=ro&immutable=1"
        connection.exec_driver_sql("ATTACH DATABASE ? AS snap", (uri,))
        try:
            snap = sa.MetaData(schema="snap")
            with self._write_transaction():
                for table in (key_heads, history, meta):
                    source = table.to_metadata(snap)
                    connection.execute(table.delete())
                    connection.execute(table.insert().from_select(
                        [column.name for column in table.columns], sa.select(source)))
        finally:
            connection.exec_driver_sql("DETACH DATABASE snap")
