"""Snapshots on disk: the files the state machine writes and loads, and chunked transfer.

A snapshot file is ``<snapshot_dir>/<end_offset:020d>-<epoch:010d>.snapshot``: a SQLite state
database (made with VACUUM INTO) followed by a 20-byte trailer ``struct ">8sIQ"``: the magic
``b"MKVSNAP1"``, the CRC32C of the database bytes, and their length. Why a trailer and not a
header: the database can be written first and checksummed as it is streamed, and the file is
only given its final name (rename after fsync) once the trailer is in place, so a file with a
final name is always complete. A downloaded copy is published only after its size, trailer,
CRC and the id recorded inside the database all match the id it was requested as.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from typing import BinaryIO

import crc32c

from raft.snapshots import CorruptSnapshotError, SnapshotNotFoundError
from raft.types import SnapshotId, check
from storage.durable_files import fsync_directory
from storage.state_schema import NotAStateDatabaseError, read_database_meta

logger = logging.getLogger(__name__)

TRAILER = struct.Struct(">8sIQ")
TRAILER_MAGIC = b"MKVSNAP1"
TRAILER_BYTES = TRAILER.size
COPY_CHUNK_BYTES = 1024 * 1024
DEFAULT_KEEP_SNAPSHOTS = 3
SNAPSHOT_SUFFIX = ".snapshot"
PARTIAL_SUFFIX = ".partial"
TEMP_SUFFIX = ".tmp"
SNAPSHOT_NAME = re.compile(r"^(\d{20})-(\d{10})\.snapshot$")


def snapshot_file_name(snapshot_id: SnapshotId) -> str:
    check(snapshot_id.end_offset >= 0 and snapshot_id.epoch >= 0, "negative snapshot id")
    return f"{snapshot_id.end_offset:020d}-{snapshot_id.epoch:010d}{SNAPSHOT_SUFFIX}"


def parse_snapshot_file_name(name: str) -> SnapshotId | None:
    match = SNAPSHOT_NAME.match(name)
    if match is None:
        return None
    return SnapshotId(int(match.group(1)), int(match.group(2)))


def _read_trailer(path: str, file_size: int, handle: BinaryIO) -> tuple[int, int]:
    """(crc, db length) from the trailer; raises CorruptSnapshotError naming the offset."""
    if file_size < TRAILER_BYTES:
        raise CorruptSnapshotError(
            f"{path}: {file_size} bytes, shorter than the {TRAILER_BYTES}-byte trailer")
    trailer_offset = file_size - TRAILER_BYTES
    handle.seek(trailer_offset)
    magic, crc, db_length = TRAILER.unpack(handle.read(TRAILER_BYTES))
    if magic != TRAILER_MAGIC:
        raise CorruptSnapshotError(f"{path}: bad trailer magic {magic!r} at byte offset {trailer_offset}")
    if db_length != trailer_offset:
        raise CorruptSnapshotError(
            f"{path}: trailer at byte offset {trailer_offset} says the database is {db_length} bytes")
    return crc, db_length


def _copy_checked(path: str, destination: str | None) -> int:
    """Stream the database bytes of a snapshot file (to ``destination`` if given) and check
    them against the trailer. Returns the database length; on any failure no destination
    file is left behind."""
    try:
        with open(path, "rb") as source:
            crc_expected, db_length = _read_trailer(path, os.fstat(source.fileno()).st_size, source)
            source.seek(0)
            crc = 0
            remaining = db_length
            with (open(destination, "wb") if destination is not None else nullcontext()) as target:
                while remaining:
                    chunk = source.read(min(COPY_CHUNK_BYTES, remaining))
                    if not chunk:
                        raise CorruptSnapshotError(
                            f"{path}: ends at byte offset {db_length - remaining} while reading")
                    crc = crc32c.crc32c(chunk, crc)
                    if target is not None:
                        target.write(chunk)
                    remaining -= len(chunk)
        if crc != crc_expected:
            raise CorruptSnapshotError(
                f"{path}: CRC32C of bytes 0..{db_length} is {crc:#010x}, trailer says {crc_expected:#010x}")
    except BaseException:
        if destination is not None and os.path.exists(destination):
            os.unlink(destination)
        raise
    return db_length


def verify_snapshot_file(path: str) -> int:
    """Check a snapshot file's trailer and CRC; return the database length in bytes."""
    return _copy_checked(path, None)


def extract_database(path: str, destination: str) -> int:
    """Copy a snapshot's database bytes to ``destination`` (a plain SQLite file), verifying the
    CRC on the way; raises CorruptSnapshotError (leaving no destination file) when it fails."""
    return _copy_checked(path, destination)


@dataclass(slots=True)
class _Download:
    snapshot_id: SnapshotId
    size_bytes: int
    received_bytes: int
    path: str


class SnapshotStore:
    """``raft.snapshots.SnapshotStore`` on disk, plus publishing local snapshots.

    At most one download is in progress (``begin_download`` of another id discards the
    previous partial copy): a replica installs one snapshot at a time.
    """

    def __init__(self, snapshot_dir: str, *, keep_snapshots: int = DEFAULT_KEEP_SNAPSHOTS) -> None:
        check(keep_snapshots >= 1, "keep_snapshots must be >= 1")
        self.snapshot_dir = os.path.abspath(snapshot_dir)
        self.keep_snapshots = keep_snapshots
        self._lock = threading.Lock()
        self._download: _Download | None = None
        os.makedirs(self.snapshot_dir, exist_ok=True)

    # ---- local snapshots -----------------------------------------------------------

    def path_for(self, snapshot_id: SnapshotId) -> str:
        return os.path.join(self.snapshot_dir, snapshot_file_name(snapshot_id))

    def list_ids(self) -> list[SnapshotId]:
        """Complete snapshots, oldest first."""
        found = (parse_snapshot_file_name(name) for name in os.listdir(self.snapshot_dir))
        return sorted((snapshot_id for snapshot_id in found if snapshot_id is not None),
                      key=lambda snapshot_id: (snapshot_id.end_offset, snapshot_id.epoch))

    def latest_id(self) -> SnapshotId | None:
        ids = self.list_ids()
        return ids[-1] if ids else None

    def size_bytes(self, snapshot_id: SnapshotId) -> int:
        try:
            return os.path.getsize(self.path_for(snapshot_id))
        except FileNotFoundError as exc:
            raise SnapshotNotFoundError(f"no snapshot {snapshot_id}") from exc

    def read_chunk(self, snapshot_id: SnapshotId, position: int, max_bytes: int) -> bytes:
        if position < 0 or max_bytes <= 0:
            raise ValueError(f"bad chunk request: position {position}, max_bytes {max_bytes}")
        try:
            with open(self.path_for(snapshot_id), "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                if position > size:
                    raise ValueError(f"position {position} is past the end ({size} bytes) of {snapshot_id}")
                handle.seek(position)
                return handle.read(max_bytes)
        except FileNotFoundError as exc:
            raise SnapshotNotFoundError(f"no snapshot {snapshot_id}") from exc

    def new_temp_path(self) -> str:
        """A fresh file name in the snapshot directory for a database being built."""
        return os.path.join(self.snapshot_dir, f"{uuid.uuid4().hex}{TEMP_SUFFIX}")

    def publish_database(self, database_path: str, snapshot_id: SnapshotId) -> str:
        """Turn a database file in the snapshot directory into the snapshot ``snapshot_id``:
        append the trailer, fsync, rename into place, fsync the directory, drop old ones."""
        check(os.path.dirname(os.path.abspath(database_path)) == self.snapshot_dir,
              "publish_database needs a file inside the snapshot directory (rename is atomic only there)")
        crc = 0
        with open(database_path, "r+b") as handle:
            while chunk := handle.read(COPY_CHUNK_BYTES):
                crc = crc32c.crc32c(chunk, crc)
            db_length = handle.tell()
            handle.write(TRAILER.pack(TRAILER_MAGIC, crc, db_length))
            handle.flush()
            os.fsync(handle.fileno())
        final_path = self.path_for(snapshot_id)
        os.replace(database_path, final_path)
        fsync_directory(self.snapshot_dir)
        logger.info("published snapshot %s (%d bytes)", final_path, db_length + TRAILER_BYTES)
        self._retain(snapshot_id)
        return final_path

    def remove_stale_files(self) -> None:
        """Remove temp and partial files a crash left behind (call at startup only)."""
        with self._lock:
            for name in os.listdir(self.snapshot_dir):
                if name.endswith((TEMP_SUFFIX, PARTIAL_SUFFIX)):
                    os.unlink(os.path.join(self.snapshot_dir, name))

    def _retain(self, keep_id: SnapshotId) -> None:
        with self._lock:
            ids = self.list_ids()
            for snapshot_id in ids[:-self.keep_snapshots]:
                if snapshot_id != keep_id:
                    os.unlink(self.path_for(snapshot_id))
                    logger.info("deleted old snapshot %s", snapshot_id)
            fsync_directory(self.snapshot_dir)

    # ---- downloads -----------------------------------------------------------------

    def begin_download(self, snapshot_id: SnapshotId, size_bytes: int) -> None:
        if size_bytes < 0:
            raise ValueError("negative snapshot size")
        with self._lock:
            self._discard_download()
            path = os.path.join(self.snapshot_dir, snapshot_file_name(snapshot_id) + PARTIAL_SUFFIX)
            with open(path, "wb"):
                pass
            self._download = _Download(snapshot_id, size_bytes, 0, path)

    def write_chunk(self, snapshot_id: SnapshotId, position: int, data: bytes) -> None:
        with self._lock:
            download = self._current_download(snapshot_id)
            if position != download.received_bytes:
                raise ValueError(
                    f"chunk at position {position}, expected {download.received_bytes} for {snapshot_id}")
            if download.received_bytes + len(data) > download.size_bytes:
                self._discard_download()
                raise CorruptSnapshotError(
                    f"snapshot {snapshot_id}: chunk ends at {position + len(data)}, "
                    f"past the announced size {download.size_bytes}")
            with open(download.path, "ab") as handle:
                handle.write(data)
            download.received_bytes += len(data)

    def finish_download(self, snapshot_id: SnapshotId) -> None:
        with self._lock:
            download = self._current_download(snapshot_id)
            try:
                self._verify_download(download)
            except CorruptSnapshotError:
                self._discard_download()
                raise
            self._download = None
            final_path = self.path_for(snapshot_id)
            os.replace(download.path, final_path)
            fsync_directory(self.snapshot_dir)
            logger.info("downloaded snapshot %s (%d bytes)", final_path, download.size_bytes)
        self._retain(snapshot_id)

    def _current_download(self, snapshot_id: SnapshotId) -> _Download:
        download = self._download
        if download is None or download.snapshot_id != snapshot_id:
            raise ValueError(f"no download of {snapshot_id} in progress")
        return download

    def _discard_download(self) -> None:
        if self._download is not None:
            if os.path.exists(self._download.path):
                os.unlink(self._download.path)
            self._download = None

    @staticmethod
    def _verify_download(download: _Download) -> None:
        """Size, trailer, CRC, and the id recorded in the database itself. To open the
        database, the trailer is cut off, the meta row read, and the trailer put back."""
        path = download.path
        if download.received_bytes != download.size_bytes:
            raise CorruptSnapshotError(
                f"{path}: received {download.received_bytes} bytes of {download.size_bytes}")
        db_length = verify_snapshot_file(path)
        with open(path, "rb") as handle:
            handle.seek(db_length)
            trailer = handle.read(TRAILER_BYTES)
        os.truncate(path, db_length)
        try:
            recorded = read_database_meta(path)
        except NotAStateDatabaseError as exc:
            raise CorruptSnapshotError(str(exc)) from exc
        with open(path, "ab") as handle:
            handle.write(trailer)
            handle.flush()
            os.fsync(handle.fileno())
        if (recorded.applied_version, recorded.applied_epoch) != (
                download.snapshot_id.end_offset, download.snapshot_id.epoch):
            raise CorruptSnapshotError(
                f"{path}: holds version {recorded.applied_version} epoch {recorded.applied_epoch}, "
                f"not {download.snapshot_id}")
