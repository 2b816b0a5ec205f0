"""``metakv snapshot restore FILE --data-dir DIR``: a new single-node data directory from a
snapshot file (``metakv snapshot save``), like ``etcdutl snapshot restore``.

Only storage's own code touches the formats: the file is checked and installed the way a
node installs a snapshot it downloaded from its leader (``SnapshotStore`` verifies size,
trailer, CRC and the id recorded inside), the log is reset to start at the snapshot
(``SegmentLog.reset_to_snapshot``) and the state loaded from it (``StateMachine``). The
directory holds no quorum-state and no identity: ``serve`` starts it as a fresh node of
whatever cluster it is given, in the snapshot's epoch, at the snapshot's version.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from raft.snapshots import CorruptSnapshotError
from raft.types import SnapshotId
from storage.segment_log import SegmentLog
from storage.snapshot_store import COPY_CHUNK_BYTES, SnapshotStore, extract_database
from storage.state_machine import StateMachine
from storage.state_schema import NotAStateDatabaseError, read_database_meta


class RestoreError(Exception):
    """The file or the target directory cannot be used: one line saying why."""


def snapshot_id_of(path: Path) -> SnapshotId:
    """The id recorded inside a snapshot file (its CRC checked on the way)."""
    with tempfile.TemporaryDirectory(prefix="metakv-restore-") as scratch:
        database = os.path.join(scratch, "state.db")
        try:
            extract_database(str(path), database)
            meta = read_database_meta(database)
        except (CorruptSnapshotError, NotAStateDatabaseError) as exc:
            raise RestoreError(f"{path}: not a metakv snapshot ({exc})") from None
    if meta.applied_version <= 0:
        raise RestoreError(f"{path}: the snapshot holds no applied version")
    return SnapshotId(meta.applied_version, meta.applied_epoch)


def restore_snapshot(path: Path, data_dir: Path) -> SnapshotId:
    """Build ``data_dir`` (absent or empty) from the snapshot file at ``path``; on any
    failure nothing is left in it."""
    if not path.is_file():
        raise RestoreError(f"{path}: {'not a file' if path.exists() else 'no such file'}")
    try:
        if data_dir.exists() and (not data_dir.is_dir() or any(data_dir.iterdir())):
            raise RestoreError(f"--data-dir {data_dir} exists and is not empty: restore into a new directory")
        snapshot_id = snapshot_id_of(path)
        created = not data_dir.exists()
        try:
            _install(path, data_dir, snapshot_id)
        except BaseException:
            _remove_contents(data_dir, remove_dir=created)
            raise
    except OSError as exc:  # a directory that cannot be made, a file that cannot be read: one line
        raise RestoreError(f"{exc.filename or data_dir}: {exc.strerror or exc}") from None
    return snapshot_id


def _install(path: Path, data_dir: Path, snapshot_id: SnapshotId) -> None:
    store = SnapshotStore(str(data_dir / "snapshots"))
    os.makedirs(store.snapshot_dir, exist_ok=True)
    size_bytes = path.stat().st_size
    store.begin_download(snapshot_id, size_bytes)
    with open(path, "rb") as source:
        position = 0
        while chunk := source.read(COPY_CHUNK_BYTES):
            store.write_chunk(snapshot_id, position, chunk)
            position += len(chunk)
    try:
        store.finish_download(snapshot_id)
    except CorruptSnapshotError as exc:
        raise RestoreError(f"{path}: {exc}") from None
    with SegmentLog(data_dir / "log") as log:
        log.reset_to_snapshot(snapshot_id)
    state = StateMachine(str(data_dir / "state.db"))
    try:
        state.load_snapshot(store.path_for(snapshot_id))
    finally:
        state.close()


def _remove_contents(data_dir: Path, remove_dir: bool) -> None:
    if not data_dir.is_dir():
        return
    if remove_dir:
        shutil.rmtree(data_dir, ignore_errors=True)
        return
    for child in data_dir.iterdir():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
