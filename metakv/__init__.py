"""metakv's Python client: ``Client`` (sync) and ``AsyncClient`` (asyncio), on httpx.

Leader tracking, failover with backoff, read-your-writes sessions, resumable watches and
typed errors; docs/client.md is the reference.
"""

from metakv.aio import AsyncClient, AsyncTxn
from metakv.client import Client, Txn
from metakv.errors import (
    ClientClosed,
    Compacted,
    Conflict,
    Forbidden,
    Indeterminate,
    InvalidRequest,
    MetakvError,
    ServerError,
    Unauthorized,
    Unavailable,
    VersionNotReached,
)
from metakv.results import DeleteResult, Event, KeyValue, ListResult, PutResult, TxnResult
from metakv.routing import RetryPolicy
from metakv.snapshots import SnapshotSaved

__all__ = [
    "AsyncClient", "AsyncTxn", "Client", "ClientClosed", "Compacted", "Conflict", "DeleteResult", "Event", "Forbidden",
    "Indeterminate", "InvalidRequest", "KeyValue", "ListResult", "MetakvError", "PutResult", "RetryPolicy",
    "ServerError", "SnapshotSaved", "Txn", "TxnResult", "Unauthorized", "Unavailable", "VersionNotReached",
]
