"""``metakv.Client``: the synchronous client (httpx, one keep-alive pool per client).

    with Client("http://127.0.0.1:8001,http://127.0.0.1:8002") as kv:
        written = kv.put("services/db/url", "postgres://db:5432")
        kv.get("services/db/url").text
        for event in kv.watch("services/", since=written.version):
            ...

Thread-safe: one client may serve many threads. docs/client.md is the reference; the calls'
logic is in metakv/core.py (plans), routing and retries in metakv/routing.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO, Unpack

import httpx

from metakv.core import (
    CAS_MAX_ATTEMPTS,
    DEFAULT_POLL_TIMEOUT_MS,
    CasUpdate,
    ClientCore,
    ClientOptions,
    Plan,
    PlanRun,
    ResultT,
)
from metakv.errors import ClientClosed, MetakvError, raised_unless_failing
from metakv.leases import LeaseCore, LeaseInfo, LeaseSummary
from metakv.protocol import Answer, Request, WatchCursor, parse_status
from metakv.results import DeleteResult, Event, KeyValue, ListResult, PutResult, TxnResult
from metakv.routing import CLIENT_ERRORS, Call, closed_error
from metakv.snapshots import SnapshotSaved, SnapshotWriter, snapshot_request
from metakv.txn import TxnBuilder


class Txn(TxnBuilder):
    def __init__(self, client: Client) -> None:
        super().__init__()
        self._client = client

    def commit(self) -> TxnResult:
        """Send it; never re-sent after an unknown outcome (``Indeterminate``)."""
        return self._client.run(self._client.txn_plan(self.request()))


class Lease(LeaseCore):
    """A lease the client keeps alive in its keep-alive thread until ``revoke`` (or the end
    of its ``with`` block). ``done`` is set when it ends; see ``metakv.leases.LeaseCore``."""

    def __init__(self, client: Client, lease_id: int, ttl_s: int, granted_version: int, sent_at: float) -> None:
        super().__init__(lease_id, ttl_s, granted_version, sent_at)
        self.done = threading.Event()
        self._client = client

    def notify_lost(self) -> None:
        self.done.set()

    def revoke(self) -> int | None:
        """Revoke it: every key attached goes in one version. The number of keys deleted
        (None: the cluster no longer knew the lease)."""
        return self._client.revoke(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        with raised_unless_failing(exc_type):
            self.revoke()


class Client(ClientCore):
    """A metakv cluster: ``endpoints`` is a comma-separated string or a list of node URLs;
    ``options`` are ``metakv.core.ClientOptions``. ``transport`` replaces httpx's (tests)."""

    def __init__(self, endpoints: str | Sequence[str], *, transport: httpx.BaseTransport | None = None,
                 **options: Unpack[ClientOptions]) -> None:
        super().__init__(endpoints, options)
        self._http = httpx.Client(transport=transport, **self.http_settings)
        self._keeper: threading.Thread | None = None
        self._keeper_wake = threading.Event()
        self._closing = threading.Event()
        self._keeper_guard = threading.Lock()

    def close(self) -> None:
        """Close the connections; leases still held end for this client (and expire on the
        cluster after their TTL: closing does not revoke them)."""
        self._closing.set()
        self._keeper_wake.set()
        self._http.close()
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join(timeout=self.timeout_s)
        self.keepalives.end_all("the client was closed")

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ driving

    def call(self, request: Request) -> Answer:
        """Send ``request`` with leader tracking, failover and backoff (metakv/routing.py)."""
        call = self.new_call(request)
        while (delay := call.outcome(self._attempt(call))) is not None:
            time.sleep(delay)
        return self.finished(call)

    def _attempt(self, call: Call) -> httpx.Response | Exception:
        if self._http.is_closed:
            raise closed_error()
        try:
            return self._http.request(**call.send_options())
        except CLIENT_ERRORS as exc:
            return exc
        except RuntimeError:  # closed by another thread meanwhile
            if self._http.is_closed:
                raise closed_error() from None
            raise

    def run(self, plan: Plan[ResultT]) -> ResultT:
        """Drive a plan of metakv/core.py: send each request it yields, hand back the answer."""
        steps = PlanRun(plan)
        while steps.request is not None:
            try:
                steps.feed(self.call(steps.request))
            except MetakvError as exc:
                steps.feed(exc)
        return steps.result  # type: ignore[return-value]

    # ------------------------------------------------------------------ keys

    def get(self, key: str, *, consistency: str = "local", min_version: int | None = None,
            at_version: int | None = None, wait_ms: int | None = None) -> KeyValue | None:
        """The key, or None when it does not exist. ``consistency="local"`` reads the node
        reads go to, at least at the session's version (read-your-writes)."""
        return self.run(self.get_plan(key, consistency, min_version, at_version, wait_ms))

    def put(self, key: str, value: bytes | str, *, content_type: str | None = None,
            if_version: int | None = None, lease: int | Lease | None = None) -> PutResult:
        """Set the key. ``if_version``: only if its mod_version is that (0: missing), else
        ``Conflict``. Without a condition (or with 0) an unknown outcome raises
        ``Indeterminate``; with ``if_version >= 1`` the client re-sends it, since it can
        apply at most once. ``lease``: attach the key to it (deleted when it ends; a lost
        ``Lease`` raises ``LeaseLost``, a lease the cluster does not know ``LeaseNotFound``)."""
        return self.run(self.put_plan(key, value, content_type, if_version, lease=lease))

    def create(self, key: str, value: bytes | str, *, content_type: str | None = None,
               lease: int | Lease | None = None) -> PutResult:
        """Set the key only if it does not exist, else ``Conflict``; an unknown outcome
        raises ``Indeterminate`` (never re-sent: a delete in between would let it apply twice)."""
        return self.run(self.put_plan(key, value, content_type, None, create_only=True, lease=lease))

    def delete(self, key: str, *, if_version: int | None = None) -> DeleteResult:
        return self.run(self.delete_plan(key, if_version))

    def list(self, prefix: str = "", *, limit: int | None = None, keys_only: bool = False,
             consistency: str = "local", min_version: int | None = None,
             at_version: int | None = None) -> ListResult:
        """Every key under ``prefix`` (at most ``limit``), all at one version."""
        return self.run(self.list_plan(prefix, limit, keys_only, consistency, min_version, at_version))

    def txn(self) -> Txn:
        return Txn(self)

    def cas_loop(self, key: str, update: CasUpdate, *, content_type: str | None = None,
                 max_attempts: int = CAS_MAX_ATTEMPTS) -> PutResult:
        """Read the key, write ``update(value or None)`` if it did not change meanwhile; on a
        lost race, again (at most ``max_attempts`` times, then ``Conflict``)."""
        return self.run(self.cas_plan(key, update, content_type, max_attempts))

    # ------------------------------------------------------------------ leases

    def lease(self, ttl_s: int, *, lease_id: int | None = None) -> Lease:
        """Grant a lease of ``ttl_s`` seconds (the cluster may raise it to its minimum: see
        ``ttl_s``) and keep it alive in the background until revoked or lost."""
        granted_id, ttl, version, sent_at = self.run(self.grant_plan(ttl_s, lease_id))
        lease = Lease(self, granted_id, ttl, version, sent_at)
        self.keepalives.add(lease)
        self._start_keeper()
        return lease

    def revoke(self, lease: int | Lease) -> int | None:
        """Revoke a lease (a ``Lease`` or an id): see ``Lease.revoke``."""
        return self.run(self.revoke_plan(lease))

    def lease_info(self, lease: int | Lease, *, keys: bool = False) -> LeaseInfo:
        """The lease's TTL and time left (the leader's), and its keys with ``keys=True``;
        ``LeaseNotFound`` when the cluster does not know it."""
        return self.run(self.lease_info_plan(lease, keys))

    def leases(self) -> list[LeaseSummary]:
        """Every live lease of the cluster."""
        return self.run(self.leases_plan())

    def keep_alive_once(self, lease: int | Lease) -> int:
        """One keep-alive of a lease by id (this client need not hold it): its TTL, restarted."""
        return self.run(self.keep_alive_once_plan(lease))

    def _start_keeper(self) -> None:
        with self._keeper_guard:
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._keep_alive, name="metakv-keepalive", daemon=True)
                self._keeper.start()
        self._keeper_wake.set()

    def _keep_alive(self) -> None:
        while not self._closing.is_set():
            self._keeper_wake.wait(self.keepalives.wait_s())
            self._keeper_wake.clear()
            if self._closing.is_set():
                return
            try:
                self.run(self.keepalives.round_plan())
            except ClientClosed:
                return

    # ------------------------------------------------------------------ watch

    def watch(self, prefix: str = "", *, since: int | None = None,
              poll_timeout_ms: int = DEFAULT_POLL_TIMEOUT_MS) -> Iterator[Event]:
        """Every change under ``prefix`` after ``since`` (default: now), in version order,
        each exactly once, across reconnects and failovers; raises ``Compacted`` when
        ``since`` fell below the oldest retained version (re-list, then watch again)."""
        start = since if since is not None else self.list(prefix, limit=1, keys_only=True).version
        cursor = WatchCursor(prefix, start, poll_timeout_ms)
        while True:
            yield from cursor.accept(self.call(cursor.request()))

    # ------------------------------------------------------------------ admin

    def status(self) -> dict[str, Any]:
        """``GET /v1/status`` of the node reads go to."""
        return parse_status(self.call(Request("GET", "/v1/status")))

    def save_snapshot(self, destination: BinaryIO) -> SnapshotSaved:
        """Take a snapshot on the node reads go to and stream its file into ``destination``."""
        call = self.new_call(snapshot_request())
        while True:
            if self._http.is_closed:
                raise closed_error()
            try:
                with self._http.stream("POST", call.url) as response:
                    if response.status_code == 200:
                        writer = SnapshotWriter(response.headers, destination)
                        for chunk in response.iter_bytes():
                            writer.write(chunk)
                        return writer.finish()
                    delay = call.answered(Answer(response.status_code, response.headers, response.read()))
            except CLIENT_ERRORS as exc:
                delay = call.failed(exc)
            time.sleep(delay or 0)
