"""Saving a snapshot through the API (``POST /v1/admin/snapshot/download``): the file as the
node keeps it, checked for completeness against its announced size."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

from metakv.errors import ServerError, Unavailable
from metakv.protocol import Request, header_int

SNAPSHOT_DOWNLOAD_PATH = "/v1/admin/snapshot/download"


@dataclass(frozen=True, slots=True)
class SnapshotSaved:
    """A snapshot written to a file: the metadata version it holds, its epoch, its size."""

    version: int
    epoch: int
    size_bytes: int


def snapshot_request() -> Request:
    # Taking a snapshot changes no data: sending it again is harmless.
    return Request("POST", SNAPSHOT_DOWNLOAD_PATH, safe_to_resend=True)


class SnapshotWriter:
    """Writes one answer's body into ``destination`` from its start (an earlier, broken
    attempt's bytes are cut off), then checks it got all of it."""

    def __init__(self, headers: Mapping[str, str], destination: BinaryIO) -> None:
        version = header_int(headers, "x-snapshot-version")
        epoch = header_int(headers, "x-snapshot-epoch")
        size_bytes = header_int(headers, "content-length")
        if version is None or epoch is None or size_bytes is None:
            raise ServerError("Malformed answer", "a snapshot download without X-Snapshot-Version, "
                              "X-Snapshot-Epoch or Content-Length")
        self.saved = SnapshotSaved(version, epoch, size_bytes)
        self._destination = destination
        self._written_bytes = 0
        destination.seek(0)
        destination.truncate()

    def write(self, chunk: bytes) -> None:
        self._destination.write(chunk)
        self._written_bytes += len(chunk)

    def finish(self) -> SnapshotSaved:
        if self._written_bytes != self.saved.size_bytes:
            raise Unavailable("Snapshot incomplete", f"received {self._written_bytes} of "
                              f"{self.saved.size_bytes} bytes")
        self._destination.flush()
        return self.saved
