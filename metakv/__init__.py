"""metakv's Python client: ``Client`` (sync) and ``AsyncClient`` (asyncio), on httpx.

Leader tracking, failover with backoff, read-your-writes sessions, resumable watches and
typed errors; docs/client.md is the reference.
"""

from metakv.aio import AsyncClient, AsyncLease, AsyncTxn
from metakv.client import Client, Lease, Txn
from metakv.errors import (
    ClientClosed,
    Compacted,
    Conflict,
    Forbidden,
    Indeterminate,
    InvalidRequest,
    LeaseLost,
    LeaseNotFound,
    MetakvError,
    ServerError,
    Unauthorized,
    Unavailable,
    VersionNotReached,
)
from metakv.leases import LeaseInfo, LeaseSummary
from metakv.results import DeleteResult, Event, KeyValue, ListResult, PutResult, TxnResult
from metakv.routing import RetryPolicy
from metakv.snapshots import SnapshotSaved

__all__ = [
    "AsyncClient", "AsyncLease", "AsyncTxn", "Client", "ClientClosed", "Compacted", "Conflict", "DeleteResult",
    "Event", "Forbidden", "Indeterminate", "InvalidRequest", "KeyValue", "Lease", "LeaseInfo", "LeaseLost",
    "LeaseNotFound", "LeaseSummary", "ListResult", "MetakvError", "PutResult", "RetryPolicy", "ServerError",
    "SnapshotSaved", "Txn", "TxnResult", "Unauthorized", "Unavailable", "VersionNotReached",
]
