"""The seam between a node's front ends (app/http/) and the node runtime (app/runtime.py).

Every front end talks to a node only through ``KVService`` and imports only this module:
writes (``put``, ``delete``, ``txn``), reads, watches, the cluster views and the admin actions
are typed calls with typed results, and every failure a client must see is a ``ServiceError``
that says what happened. Nothing here knows about HTTP: statuses, headers and problem
documents are the front end's mapping (for HTTP, app/http/problems.py, and only there).
The runtime implements ``KVService``; tests/http/service_double.py is its in-process twin.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Literal, NotRequired, Protocol, TypedDict

from storage.cleaning_run import CleaningReport
from storage.commands import DEFAULT_CONTENT_TYPE, Compare, CompareKind, Op, OpKind, is_internal_key
from storage.state_machine import ApplyResult, Entry, Event, OpResult

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from app.auth import AuthTokens

# The state machine's result records are the service's too (re-exported, not copied: the
# write path builds them once per record). Front ends import them from here.
__all__ = [
    "ApplyResult", "ChangePage", "ChangeWatch", "CompactReport", "Consistency", "Entry", "Event", "HistoryCompactedError",
    "IndeterminateError", "KVService", "KeyRead", "LeaseExistsError", "LeaseGrant", "MAX_LEASE_ID", "LeaseInfo", "LeaseKeepAlive",
    "LeaseList", "LeaseNotFoundError", "LeaseRevoke", "LeaseTtlError", "ListPage", "NodeHeaders", "NodeStatus",
    "NotLeaderError",
    "NotReadyError", "OpResult", "QuorumView", "ReplicaView", "ResignReport", "ServiceError", "SnapshotReport",
    "SnapshotStorageError", "VersionWaitTimeoutError", "WriteRejectedError", "WriteTooLargeError",
    "NewVoter", "VoterChangeIndeterminateError", "VoterChangeRefusedError", "VoterSetView", "VoterView",
]
# The conditions and operations a front end builds for a write are the log's own value types
# (re-exported, like the result records): the service adds no second spelling of them.
__all__ += ["DEFAULT_CONTENT_TYPE", "Compare", "CompareKind", "Op", "OpKind", "is_internal_key"]

Consistency = Literal["local", "leader", "linearizable"]


class ServiceError(Exception):
    """Base of the failures a client must be told about; each front end maps them to its
    own answers."""


class NotLeaderError(ServiceError):
    """This node is not the leader; ``leader_url`` is the leader's advertised HTTP URL, or
    None when no leader is known (one may be elected soon: retry later)."""

    def __init__(self, leader_url: str | None, leader_id: int = -1) -> None:
        super().__init__("not the leader")
        self.leader_url = leader_url
        self.leader_id = leader_id


class WriteRejectedError(ServiceError):
    """The write surely did not happen (accumulator full, shutting down, lost leadership
    before appending); retrying it may succeed."""


class WriteTooLargeError(WriteRejectedError):
    """The write encodes to more than one log batch may hold (max_batch_bytes): it surely
    did not happen, and unlike its base class, retrying it can never succeed."""


class QuotaExceededError(ServiceError):
    """The leader's storage is past ``--quota-bytes``: the write surely did not happen, and
    writes that add data are refused until deletes and cleaning bring it back under."""


class SnapshotStorageError(ServiceError):
    """A snapshot failed on the disk and nothing was published: ``disk_full`` when the disk
    is full (only freeing space cures it), else an I/O error that may pass, so a retry may
    succeed. ``str()`` is the detail."""

    def __init__(self, detail: str, disk_full: bool) -> None:
        super().__init__(detail)
        self.disk_full = disk_full


class IndeterminateError(ServiceError):
    """The write's outcome is unknown (leadership lost mid-flight, timeout): it may or may
    not have happened."""


class NotReadyError(ServiceError):
    """This replica is catching up (below the last dirty offset it learned, or installing a
    snapshot) and cannot serve consistent reads yet."""


class VersionWaitTimeoutError(ServiceError):
    """min_version was not reached within wait_ms, or a read asked for a version this node
    has not applied; ``current_version`` is the version it has applied."""

    def __init__(self, current_version: int) -> None:
        super().__init__(f"still at version {current_version}")
        self.current_version = current_version


class HistoryCompactedError(ServiceError):
    """A read or watch asked for a version below the oldest retained one, ``oldest_version``
    (the client re-lists, then watches from the list's version)."""

    def __init__(self, requested_version: int, oldest_version: int) -> None:
        super().__init__(f"version {requested_version} is compacted; the oldest available is {oldest_version}")
        self.requested_version = requested_version
        self.oldest_version = oldest_version


class VoterChangeRefusedError(ServiceError):
    """The leader refused a voter change (nothing changed); ``code`` says why: one of
    change-pending, already-voter, kraft-version-0, not-caught-up, unknown-voter,
    last-voter, leader-not-ready (retry soon), raft-endpoint-unknown (docs/http.md, Voters)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class VoterChangeIndeterminateError(ServiceError):
    """The voters record was appended but not seen committed in time (or a new leader's log
    replaced it): the change may or may not take effect; look at the set, then retry."""


@dataclass(frozen=True, slots=True)
class NewVoter:
    """A replica to add as a voter; None: what the leader knows of it (its Fetches name its
    directory id and HTTP URL; a raft endpoint only a voters record or --voters named)."""

    node_id: int
    directory_id: str | None = None
    raft_endpoint: str | None = None
    http_url: str | None = None


# Lease ids are 1..MAX_LEASE_ID: the largest integer every JSON parser reads exactly.
MAX_LEASE_ID = 2**53 - 1
# Given a lease's attached keys, raises if the caller may not act on them (auth's check).
KeysCheck = Callable[[list[str]], None]


class LeaseNotFoundError(ServiceError):
    """The lease does not exist (never granted, revoked or expired); for a write that named
    it, decided when the write applied, so the write did not happen."""

    def __init__(self, lease_id: int) -> None:
        super().__init__(f"lease {lease_id} does not exist (never granted, revoked or expired)")
        self.lease_id = lease_id


class LeaseExistsError(ServiceError):
    """A grant named a lease id that is taken; nothing was granted."""


class LeaseTtlError(ServiceError):
    """A grant's TTL is not positive or above the node's maximum; nothing was granted."""


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    id: int
    ttl_s: int  # the TTL granted (a TTL below the minimum is raised to it)
    version: int


@dataclass(frozen=True, slots=True)
class LeaseKeepAlive:
    kept: list[tuple[int, int]]  # (id, ttl_s) of each lease whose countdown restarted
    not_found: list[int]  # ids of leases that do not exist (or are expiring)


@dataclass(frozen=True, slots=True)
class LeaseRevoke:
    id: int
    version: int  # the version that deleted the lease and its keys
    deleted_keys: int


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    id: int
    ttl_s: int
    remaining_s: float  # until the leader ends it without a keep-alive
    granted_version: int
    keys: list[str] | None  # the attached keys, when asked for


@dataclass(frozen=True, slots=True)
class LeaseList:
    version: int
    leases: list[tuple[int, int]]  # (id, ttl_s), by id


@dataclass(frozen=True, slots=True)
class NodeHeaders:
    """What every KV answer tells about the node that gave it (the front end renders it)."""

    metadata_version: int
    node_id: int
    leader_id: int  # -1 when unknown
    epoch: int
    last_contact_ms: int


@dataclass(frozen=True, slots=True)
class KeyRead:
    """One key as of ``version`` (``entry`` None: absent at that version)."""

    version: int
    entry: Entry | None


@dataclass(frozen=True, slots=True)
class ListPage:
    """Entries in key order, all as of ``version``; ``next_key`` continues the listing."""

    version: int
    entries: list[Entry]
    next_key: str | None


@dataclass(frozen=True, slots=True)
class ChangePage:
    """Changes newer than the version asked for, in (version, seq) order; ``version`` is the
    version to ask from next without a gap."""

    version: int
    events: list[Event]


class ChangeWatch(Protocol):
    """A watch of one prefix from one version (``KVService.watch``); close it when done."""

    @property
    def stopped(self) -> bool:
        """The node stopped serving watches (shutting down): ``next`` no longer waits."""
        ...

    async def next(self, deadline_s: float) -> ChangePage:
        """The changes after those answered so far (up to about the watch's limit, all of
        the last version's), waiting for one until ``deadline_s`` (time.monotonic()); with
        none, the version every change under the prefix is known up to. Raises
        HistoryCompactedError when the watch fell behind and the history horizon passed
        what it answered."""
        ...

    def close(self) -> None: ...


class SnapshotIdView(TypedDict):
    end_offset: int
    epoch: int


class PrefixDigestView(TypedDict):
    start_offset: int
    end_offset: int
    sha256: str


class VoterView(TypedDict):
    """One voter of a voters record (KIP-853)."""

    node_id: int
    directory_id: str  # "" in a static (--voters) set
    raft_endpoint: str
    http_url: str


class PendingVoterChange(TypedDict):
    offset: int  # the uncommitted voters record
    action: Literal["add", "remove"]
    node_id: int


class VoterSetView(TypedDict):
    """The set in force on a node: kraft_version 0 is a static --voters set (no changes), 1 a
    set from voters records; ``pending_change`` an uncommitted record, if any."""

    kraft_version: int
    voters: list[VoterView]
    pending_change: PendingVoterChange | None


class NodeStatus(TypedDict):
    """What this node reports of itself; the runtime adds the compaction fields of
    docs/compaction.md."""

    node_id: int
    role: str
    voter: bool
    epoch: int
    leader_id: int
    leader_url: str | None
    log_start_offset: int
    log_end_offset: int
    flushed_offset: int
    high_watermark: int
    applied_version: int
    dirty_offset: int
    tombstone_horizon: int
    snapshot_id: SnapshotIdView | None
    last_contact_ms: int
    ready: bool
    advertise_http: str | None
    etcd_client_url: NotRequired[str | None]  # its etcd v3 API, when it serves one
    cleaned_end: NotRequired[int]
    prefix_digest: NotRequired[PrefixDigestView]
    oldest_version: NotRequired[int]
    log_size_bytes: NotRequired[int]
    last_clean: NotRequired[CompactReport | None]
    tombstones_dropped_total: NotRequired[int]
    directory_id: NotRequired[str]  # this data directory's (identity.json)
    raft_endpoint: NotRequired[str]  # HOST:PORT, as a voters record names this node
    voter_set: NotRequired[VoterSetView]  # the set in force in this node's log


class ReplicaView(TypedDict):
    node_id: int
    endpoint: str
    log_end_offset: int
    lag: int
    last_fetch_timestamp_ms: int | None  # wall clock, ms since the epoch
    last_caught_up_timestamp_ms: int | None
    directory_id: NotRequired[str]  # as its Fetches name it ("" before its first)
    caught_up: NotRequired[bool]  # observers: the leader would add it as a voter now


class QuorumView(TypedDict):
    """The leader's view of every voter and observer."""

    epoch: int
    leader_id: int
    high_watermark: int
    voters: list[ReplicaView]
    observers: list[ReplicaView]
    voter_set: NotRequired[VoterSetView]


class SnapshotReport(TypedDict):
    snapshot_id: SnapshotIdView


class ResignReport(TypedDict):
    resigned: bool
    epoch: int


CompactReport = CleaningReport  # the cleaner's own report (docs/compaction.md), re-exported


class KVService(Protocol):
    """What a front end needs from a node.

    Reads (``get``, ``list``, ``changes``) answer from this node's applied state as it is
    now: call ``wait_readable`` first for the consistency the client asked for."""

    node_id: int
    max_value_bytes: int  # the node's configured bound on one value
    max_lease_ttl_s: int  # the longest lease TTL a grant may ask for
    metrics: CollectorRegistry  # front ends register their request metrics here
    auth_tokens: AuthTokens | None  # the token policy in force; None: auth is off
    # Leader only, else NotLeaderError: clean the log now up to the announced dirty offset.
    # None on a node that does not compact (a front end then offers no compaction).
    compact: Callable[[], Awaitable[CompactReport]] | None

    def headers(self) -> NodeHeaders: ...

    # Writes: replicated, then applied; each answers its ApplyResult (``succeeded`` False when
    # a compare failed, with ``failed_compares``). Each raises NotLeaderError,
    # WriteRejectedError (WriteTooLargeError) or IndeterminateError; a put or txn whose put
    # names a lease that does not exist when it applies raises LeaseNotFoundError.
    async def put(self, key: str, value: bytes, content_type: str = DEFAULT_CONTENT_TYPE,
                  compares: tuple[Compare, ...] = (), lease: int = 0) -> ApplyResult:
        """Set ``key`` if every compare holds; ``lease``: attach it to that lease (0: none,
        and detached from any lease it had)."""
        ...

    async def delete(self, key: str, compares: tuple[Compare, ...] = ()) -> ApplyResult:
        """Delete ``key`` (a tombstone) if every compare holds."""
        ...

    async def txn(self, compares: tuple[Compare, ...], success: tuple[Op, ...],
                  failure: tuple[Op, ...] = ()) -> ApplyResult:
        """Apply ``success`` if every compare holds, else ``failure``, atomically."""
        ...

    async def wait_readable(self, consistency: Consistency, min_version: int | None, wait_ms: int) -> None:
        """Return once this node may answer a read at the requested consistency.
        Raises NotLeaderError (leader/linearizable on a non-leader), NotReadyError,
        VersionWaitTimeoutError."""
        ...

    def get(self, key: str, at_version: int | None = None) -> KeyRead:
        """The key now, or as of ``at_version``. Raises HistoryCompactedError,
        VersionWaitTimeoutError (``at_version`` not applied here)."""
        ...

    def list(self, prefix: str, *, after: str | None = None, limit: int = 100,
             at_version: int | None = None, max_bytes: int | None = None) -> ListPage:
        """Up to ``limit`` entries under ``prefix`` after ``after``, ending early after the
        entry whose values reach ``max_bytes`` (``next_key`` continues); errors as ``get``."""
        ...

    def changes(self, prefix: str, since: int, limit: int, max_bytes: int | None = None) -> ChangePage:
        """Up to about ``limit`` changes under ``prefix`` newer than ``since``, fewer once
        their values reach ``max_bytes`` (all of the last version's). Raises
        HistoryCompactedError."""
        ...

    def watch(self, prefix: str, since: int, limit: int, max_bytes: int | None = None) -> ChangeWatch:
        """A watch of the changes under ``prefix`` newer than ``since``, about ``limit`` (and
        ``max_bytes`` of values) per answer, fed by apply (it reads history only to catch
        up). Raises HistoryCompactedError at once for a ``since`` below the horizon."""
        ...

    def is_ready(self) -> bool:
        """True when this node can serve consistent reads (/readyz)."""
        ...

    # Leases (docs/leases.md). Grant, keep-alive, revoke and info are the leader's (others
    # raise NotLeaderError); each may raise WriteRejectedError or IndeterminateError.
    async def grant_lease(self, ttl_s: int, lease_id: int | None = None) -> LeaseGrant:
        """A new lease (``lease_id`` None: an id is chosen). Raises LeaseTtlError,
        LeaseExistsError."""
        ...

    async def keep_alive_leases(self, lease_ids: list[int]) -> LeaseKeepAlive:
        """Restart each lease's countdown from its TTL: one leadership confirmation for all."""
        ...

    async def revoke_lease(self, lease_id: int, authorize: KeysCheck | None = None) -> LeaseRevoke:
        """Delete the lease and every key attached to it in one record. Raises
        LeaseNotFoundError; ``authorize`` sees exactly the keys deleted, first (it raises to refuse)."""
        ...

    async def lease_info(self, lease_id: int, with_keys: bool = False, authorize: KeysCheck | None = None) -> LeaseInfo:
        """Raises LeaseNotFoundError; ``authorize`` sees the keys shown, first (it raises to refuse)."""
        ...

    def list_leases(self) -> LeaseList:
        """Every lease in this node's applied state."""
        ...

    def status(self) -> NodeStatus: ...

    def quorum(self) -> QuorumView:
        """Leader only, else NotLeaderError."""
        ...

    async def take_snapshot(self) -> SnapshotReport: ...

    def open_snapshot(self, end_offset: int, epoch: int) -> BinaryIO:
        """The file of a snapshot ``take_snapshot`` reported, open for reading. Raises
        SnapshotStorageError when it is gone (retention removed it: take another)."""
        ...

    async def resign(self) -> ResignReport:
        """Leader only, else NotLeaderError."""
        ...

    # Voter changes (KIP-853), leader only, else NotLeaderError: each answers the new set
    # once its voters record is committed; VoterChangeRefusedError (nothing changed) or
    # VoterChangeIndeterminateError.
    async def add_voter(self, voter: NewVoter) -> VoterSetView:
        """Add an observer that has caught up."""
        ...

    async def remove_voter(self, node_id: int, directory_id: str | None = None) -> VoterSetView:
        """Remove a voter (``directory_id``: only while it is that replica); the leader too."""
        ...
