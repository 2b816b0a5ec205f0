"""The seam between the HTTP routes (app/http.py) and the node runtime (app/runtime.py).

Routes parse HTTP, call a ``KVService``, and map its results and exceptions to statuses;
they hold no protocol logic. The runtime implements ``KVService``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from storage.commands import Command

Consistency = Literal["local", "leader", "linearizable"]


class ServiceError(Exception):
    """Base of the errors a route maps to a problem document."""


class NotLeaderError(ServiceError):
    """This node is not the leader; ``leader_url`` is the leader's advertised HTTP URL (307),
    or None when no leader is known (503 with Retry-After)."""

    def __init__(self, leader_url: str | None, leader_id: int = -1) -> None:
        super().__init__("not the leader")
        self.leader_url = leader_url
        self.leader_id = leader_id


class WriteRejectedError(ServiceError):
    """The write surely did not happen (accumulator full, shutting down, lost leadership
    before appending): 503."""


class WriteTooLargeError(WriteRejectedError):
    """The write encodes to more than one log batch may hold (max_batch_bytes): 413, since
    retrying can never succeed (a 503 told clients to retry forever)."""


class SnapshotStorageError(ServiceError):
    """A snapshot failed on the disk: 507 when it is full (only freeing space cures it), else
    503 with Retry-After (the error may pass). ``str()`` is the detail."""

    def __init__(self, detail: str, disk_full: bool) -> None:
        super().__init__(detail)
        self.disk_full = disk_full


class IndeterminateError(ServiceError):
    """The write's outcome is unknown (leadership lost mid-flight, timeout): 504 with
    "indeterminate": true."""


class NotReadyError(ServiceError):
    """This replica is catching up (below the last dirty offset it learned, or installing a
    snapshot) and cannot serve consistent reads: 503."""


class VersionWaitTimeoutError(ServiceError):
    """min_version was not reached within wait_ms: 504 with ``current_version``."""

    def __init__(self, current_version: int) -> None:
        super().__init__(f"still at version {current_version}")
        self.current_version = current_version


@dataclass(frozen=True, slots=True)
class NodeHeaders:
    """The headers every KV response carries."""

    metadata_version: int
    node_id: int
    leader_id: int  # -1 when unknown
    epoch: int
    last_contact_ms: int

    def as_raw(self) -> list[tuple[bytes, bytes]]:
        """As ASGI response headers (lower-case names): what the HTTP edge appends."""
        return [
            (b"x-metadata-version", str(self.metadata_version).encode()),
            (b"x-node-id", str(self.node_id).encode()),
            (b"x-raft-leader", b"" if self.leader_id < 0 else str(self.leader_id).encode()),
            (b"x-raft-epoch", str(self.epoch).encode()),
            (b"x-last-contact-ms", str(self.last_contact_ms).encode()),
        ]


class KVService(Protocol):
    """What the HTTP layer needs from a node. ``state`` is the storage.state_machine
    StateMachine used for reads (get, list, changes) after ``wait_readable`` returned."""

    node_id: int
    state: Any  # storage.state_machine.StateMachine

    def headers(self) -> NodeHeaders: ...

    async def propose(self, command: Command) -> Any:
        """Replicate and apply ``command``; return its storage.state_machine.ApplyResult.
        Raises NotLeaderError, WriteRejectedError or IndeterminateError."""

    async def wait_readable(self, consistency: Consistency, min_version: int | None, wait_ms: int) -> None:
        """Return once this node may answer a read at the requested consistency.
        Raises NotLeaderError (leader/linearizable on a non-leader), NotReadyError,
        VersionWaitTimeoutError."""

    async def wait_for_change(self, since_version: int, timeout_ms: int) -> int:
        """Wait until the applied version exceeds ``since_version`` or the timeout passes;
        return the applied version (watch long-polls loop on this and state.changes)."""

    def is_ready(self) -> bool:
        """True when this node can serve consistent reads (/readyz)."""

    def status(self) -> dict[str, Any]:
        """GET /v1/status: id, role, epoch, leader, log start/end, high watermark, applied
        version, dirty offset, tombstone horizon, snapshot id, ready; the runtime adds the
        compaction fields of docs/compaction.md (cleaned_end, prefix_digest, ...)."""

    def quorum(self) -> dict[str, Any]:
        """GET /v1/quorum (leader only, else NotLeaderError)."""

    async def take_snapshot(self) -> dict[str, Any]:
        """POST /v1/admin/snapshot: returns {"snapshot_id": {"end_offset", "epoch"}}."""

    async def compact(self) -> dict[str, Any]:
        """POST /v1/admin/compact (leader only, else NotLeaderError): clean the log now up to
        the announced dirty offset; returns the cleaning report (docs/compaction.md)."""

    async def resign(self) -> dict[str, Any]:
        """POST /v1/admin/resign (leader only, else NotLeaderError)."""
