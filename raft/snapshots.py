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
