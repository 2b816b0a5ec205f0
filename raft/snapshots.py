"""Snapshots as the core sees them: read a local snapshot in chunks, receive one in chunks.

storage/snapshot_store.py implements ``SnapshotStore`` on disk; the simulator has an
in-memory twin. The snapshot's bytes are opaque to the core.
"""

from __future__ import annotations

from typing import Protocol

from raft.types import SnapshotId


class SnapshotNotFoundError(LookupError):
    """The named snapshot does not exist (any more)."""


class CorruptSnapshotError(ValueError):
    """A downloaded snapshot failed verification (bad CRC, wrong size, wrong id)."""


class SnapshotStore(Protocol):
    def latest_id(self) -> SnapshotId | None:
        """The newest complete snapshot, or None."""

    def size_bytes(self, snapshot_id: SnapshotId) -> int:
        """Total size; raises SnapshotNotFoundError."""

    def read_chunk(self, snapshot_id: SnapshotId, position: int, max_bytes: int) -> bytes:
        """Bytes at ``position``; raises SnapshotNotFoundError, or ValueError past the end."""

    def begin_download(self, snapshot_id: SnapshotId, size_bytes: int) -> None:
        """Start (or restart, discarding any partial copy) receiving ``snapshot_id``."""

    def write_chunk(self, snapshot_id: SnapshotId, position: int, data: bytes) -> None:
        """Append a chunk; ``position`` must equal the bytes received so far, else ValueError."""

    def finish_download(self, snapshot_id: SnapshotId) -> None:
        """Verify and publish the downloaded snapshot; raises CorruptSnapshotError and
        discards the partial copy when it does not verify."""


class MemorySnapshotStore:
    """An in-memory ``SnapshotStore`` for the simulator and unit tests.

    ``put`` publishes a snapshot as if the state machine had written one; downloads are
    verified by size only (the bytes are opaque here).
    """

    def __init__(self, max_snapshots: int = 4) -> None:
        self._max_snapshots = max_snapshots  # older complete snapshots are dropped beyond this
        self._complete: dict[SnapshotId, bytes] = {}
        self._partial: dict[SnapshotId, tuple[int, bytearray]] = {}

    def put(self, snapshot_id: SnapshotId, data: bytes) -> None:
        self._complete[snapshot_id] = bytes(data)
        while len(self._complete) > self._max_snapshots:
            del self._complete[min(self._complete, key=lambda s: (s.end_offset, s.epoch))]

    def get(self, snapshot_id: SnapshotId) -> bytes:
        try:
            return self._complete[snapshot_id]
        except KeyError as exc:
            raise SnapshotNotFoundError(str(snapshot_id)) from exc

    def latest_id(self) -> SnapshotId | None:
        if not self._complete:
            return None
        return max(self._complete, key=lambda s: (s.end_offset, s.epoch))

    def size_bytes(self, snapshot_id: SnapshotId) -> int:
        return len(self.get(snapshot_id))

    def read_chunk(self, snapshot_id: SnapshotId, position: int, max_bytes: int) -> bytes:
        data = self.get(snapshot_id)
        if position < 0 or position > len(data):
            raise ValueError(f"position {position} outside snapshot of {len(data)} bytes")
        return data[position : position + max_bytes]

    def begin_download(self, snapshot_id: SnapshotId, size_bytes: int) -> None:
        self._partial[snapshot_id] = (size_bytes, bytearray())

    def write_chunk(self, snapshot_id: SnapshotId, position: int, data: bytes) -> None:
        if snapshot_id not in self._partial:
            raise ValueError(f"no download of {snapshot_id} in progress")
        size_bytes, received = self._partial[snapshot_id]
        if position != len(received) or position + len(data) > size_bytes:
            raise ValueError(f"chunk at {position} does not follow {len(received)} bytes received")
        received.extend(data)

    def finish_download(self, snapshot_id: SnapshotId) -> None:
        partial = self._partial.pop(snapshot_id, None)
        if partial is None or len(partial[1]) != partial[0]:
            raise CorruptSnapshotError(f"download of {snapshot_id} incomplete")
        self.put(snapshot_id, bytes(partial[1]))
