"""What the sync and the async client share: settings, the cluster they track, the read
session, and every call as a *plan*: a generator that yields the requests to send and
receives their answers (or the client's exception for them), then returns the result. The
two clients only drive plans (``Client._run``, ``AsyncClient._run``), so each call's logic
exists once.

Read-your-writes: the session remembers the highest metadata version it has seen (its
writes' versions, and the ``X-Metadata-Version`` of every answer) and sends it as
``min_version`` with every ``consistency="local"`` read, so no such read, on any node and
after any failover, answers from a state older than one this client already saw or wrote.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Generic, Literal, TypedDict, TypeVar

import httpx

from metakv.errors import Conflict, InvalidRequest, MetakvError
from metakv.leases import (
    KeepAliveSchedule,
    LeaseCore,
    LeaseInfo,
    LeaseSummary,
    grant_request,
    info_request,
    keepalive_one_request,
    lease_id_of,
    parse_grant,
    parse_info,
    parse_revoke,
    parse_ttl,
    revoke_request,
)
from metakv.leases import list_request as lease_list_request
from metakv.leases import parse_list as parse_lease_list
from metakv.protocol import (
    Answer,
    Request,
    delete_request,
    get_request,
    list_request,
    parse_delete,
    parse_get,
    parse_list,
    parse_put,
    parse_txn,
    put_request,
    read_params,
)
from metakv.results import DeleteResult, KeyValue, ListResult, PutResult, TxnResult
from metakv.routing import Call, Endpoints, RetryPolicy, parse_endpoints

Consistency = Literal["local", "leader", "linearizable"]
CONSISTENCIES = ("local", "leader", "linearizable")
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_POLL_TIMEOUT_MS = 30_000  # a watch's long-poll
CAS_MAX_ATTEMPTS = 64
DEFAULT_MAX_CONNECTIONS = 100
LIST_PAGE_LIMIT = 1000  # the API's largest page

ResultT = TypeVar("ResultT")
Plan = Generator[Request, Answer, ResultT]
CasUpdate = Callable[[bytes | None], bytes | str]


class PlanRun(Generic[ResultT]):
    """A plan being driven: ``request`` is the next request to send (None: done, ``result``
    holds what the plan returned); ``feed`` hands it the answer or the client's error."""

    def __init__(self, plan: Plan[ResultT]) -> None:
        self._plan = plan
        self.result: ResultT | None = None
        self.request = self._advance(lambda: next(plan))

    def feed(self, outcome: Answer | MetakvError) -> None:
        plan = self._plan
        self.request = self._advance(
            lambda: plan.throw(outcome) if isinstance(outcome, MetakvError) else plan.send(outcome))

    def _advance(self, step: Callable[[], Request]) -> Request | None:
        try:
            return step()
        except StopIteration as done:
            self.result = done.value
            return None


class ClientOptions(TypedDict, total=False):
    """The keyword options of ``Client`` and ``AsyncClient``."""

    token: str | None  # bearer token (auth on)
    timeout_s: float  # per request
    retry: RetryPolicy  # failover and backoff (metakv/routing.py)
    read_your_writes: bool  # send the session's version as min_version (module docstring)
    max_connections: int  # keep-alive pool size


class ClientCore:
    """Settings, endpoints, the read session and the plans of one client."""

    def __init__(self, endpoints: str | Sequence[str], options: ClientOptions) -> None:
        self.retry = options.get("retry") or RetryPolicy()
        self.timeout_s = options.get("timeout_s", DEFAULT_TIMEOUT_S)
        self.read_your_writes = options.get("read_your_writes", True)
        token = (options.get("token") or "").strip()
        if not (token.isascii() and token.isprintable()) or " " in token:
            raise InvalidRequest("Invalid token", "a bearer token is printable ASCII with no space")
        # Per request, never a client default: only the listed endpoints get it (Endpoints).
        credentials = {"Authorization": f"Bearer {token}"} if token else {}
        self.endpoints = Endpoints(parse_endpoints(endpoints), credentials)
        connections = options.get("max_connections", DEFAULT_MAX_CONNECTIONS)
        # What the httpx client of either kind is built with.
        self.http_settings: dict[str, Any] = {"timeout": self.timeout_s, "limits": httpx.Limits(
            max_connections=connections, max_keepalive_connections=connections)}
        self._seen_version = 0
        self._seen_lock = threading.Lock()
        self.keepalives = KeepAliveSchedule()  # this client's leases (metakv/leases.py)

    def new_call(self, request: Request) -> Call:
        return Call(request, self.endpoints, self.retry)

    def finished(self, call: Call) -> Answer:
        """The answer a call ended with, its version noted by the session."""
        answer = call.answer
        assert answer is not None
        self.observe(answer.metadata_version())
        return answer

    @property
    def seen_version(self) -> int:
        """The highest metadata version this client has seen or written."""
        return self._seen_version

    def observe(self, version: int | None) -> None:
        if version is not None:
            with self._seen_lock:
                self._seen_version = max(self._seen_version, version)

    def read_floor(self, consistency: str, min_version: int | None) -> int | None:
        """The ``min_version`` a read sends: the caller's, else the session's (local reads)."""
        if consistency not in CONSISTENCIES:
            raise InvalidRequest("Invalid consistency", f"{consistency!r}: expected one of {', '.join(CONSISTENCIES)}")
        if min_version is not None:
            return min_version
        if self.read_your_writes and consistency == "local" and self._seen_version > 0:
            return self._seen_version
        return None

    # ------------------------------------------------------------------ plans

    def get_plan(self, key: str, consistency: str, min_version: int | None, at_version: int | None,
                 wait_ms: int | None) -> Plan[KeyValue | None]:
        params = read_params(consistency, self.read_floor(consistency, min_version), wait_ms, at_version)
        return parse_get(key, (yield get_request(key, params)))

    def put_plan(self, key: str, value: bytes | str, content_type: str | None, if_version: int | None,
                 create_only: bool = False, lease: int | LeaseCore | None = None) -> Plan[PutResult]:
        lease_id = None if lease is None else lease_id_of(lease)
        result = parse_put((yield put_request(key, value, content_type, if_version, create_only, lease_id)))
        self.observe(result.version)
        return result

    def delete_plan(self, key: str, if_version: int | None) -> Plan[DeleteResult]:
        result = parse_delete((yield delete_request(key, if_version)))
        self.observe(result.version)
        return result

    def txn_plan(self, request: Request) -> Plan[TxnResult]:
        result = parse_txn((yield request))
        self.observe(result.version)
        return result

    def list_plan(self, prefix: str, limit: int | None, keys_only: bool, consistency: str,
                  min_version: int | None, at_version: int | None) -> Plan[ListResult]:
        """Page after page, every page at the first one's version."""
        params = read_params(consistency, self.read_floor(consistency, min_version), None, at_version)
        items: list[KeyValue] = []
        after: str | None = None
        while True:
            page_limit = LIST_PAGE_LIMIT if limit is None else min(LIST_PAGE_LIMIT, limit - len(items))
            page = parse_list((yield list_request(prefix, page_limit, after, keys_only, params)))
            items.extend(page.items)
            if page.next_key is None or (limit is not None and len(items) >= limit):
                return ListResult(page.version, items, page.next_key)
            after = page.next_key
            params = {**params, "at_version": page.version}

    def cas_plan(self, key: str, update: CasUpdate, content_type: str | None, max_attempts: int) -> Plan[PutResult]:
        """Read, compute ``update(value or None)``, write if unchanged since the read; again
        on a lost race (the retry reads at least the version that won)."""
        lost: Conflict | None = None
        for _ in range(max_attempts):
            # After a lost race, read at least the winner's version (0, a delete: the session's).
            floor = lost.current_version if lost and lost.current_version > 0 else None
            current = yield from self.get_plan(key, "local", floor, None, None)
            version = current.mod_version if current is not None else 0
            new_value = update(current.value if current is not None else None)
            kept_type = content_type or (current.content_type if current is not None else None)
            try:
                return (yield from self.put_plan(key, new_value, kept_type or None, version))
            except Conflict as exc:
                lost = exc
        raise Conflict("Precondition failed", f"cas_loop on {key!r} lost the race {max_attempts} times in a row",
                       current_version=lost.current_version if lost else 0, problem=lost.problem if lost else None)

    # ------------------------------------------------------------------ leases

    def grant_plan(self, ttl_s: int, lease_id: int | None) -> Plan[tuple[int, int, int, float]]:
        """``(id, ttl_s, version, sent_at)``: ``sent_at`` starts the holder's own deadline."""
        sent_at = time.monotonic()
        granted_id, ttl, version = parse_grant((yield grant_request(ttl_s, lease_id)))
        self.observe(version)
        return granted_id, ttl, version, sent_at

    def revoke_plan(self, lease: int | LeaseCore) -> Plan[int | None]:
        """End the lease (locally first: nothing more is done under it), then on the cluster."""
        if isinstance(lease, LeaseCore):
            self.keepalives.remove(lease.id)
            lease.end("revoked by its holder")
        deleted_keys = parse_revoke((yield revoke_request(lease.id if isinstance(lease, LeaseCore)
                                                          else lease_id_of(lease))))
        return deleted_keys

    def lease_info_plan(self, lease: int | LeaseCore, keys: bool) -> Plan[LeaseInfo]:
        lease_id = lease.id if isinstance(lease, LeaseCore) else lease_id_of(lease)
        return parse_info((yield info_request(lease_id, keys)))

    def leases_plan(self) -> Plan[list[LeaseSummary]]:
        return parse_lease_list((yield lease_list_request()))

    def keep_alive_once_plan(self, lease: int | LeaseCore) -> Plan[int]:
        return parse_ttl((yield keepalive_one_request(lease_id_of(lease))))
