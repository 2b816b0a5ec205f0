"""Where an etcd call's writes and linearizable reads go: this node when it leads, else the
leader over metakv's public HTTP API (the metakv client). etcd clients never follow a
redirect, so a follower does it for them and a client on any member keeps working across
a leader change.

A follower's linearizable read asks the leader for a linearizable version (a one-key
listing) and waits until it has applied that version itself, then reads locally (Raft's
ReadIndex): the read rules stay in one place, the local read path.

The forwarding client for a leader is built once, in a worker thread: building one loads a
TLS trust store per connection pool, seconds of CPU on a loaded machine, and a node whose
event loop stalls that long drops its leader (etcd clients then read "no leader").
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import httpx

from app.etcd.errors import (
    LEADER_FAIL,
    LEASE_EXISTS,
    LEASE_NOT_FOUND,
    LEASE_TTL_TOO_LARGE,
    NO_LEADER,
    NO_SPACE,
    PERMISSION_DENIED,
    TIMEOUT,
    TOO_LARGE,
    EtcdError,
    etcd_error,
    from_service_error,
    invalid,
)
from app.etcd.forwarding import forwarding
from app.http.settings import TXN_MAX_OPS
from app.service import (
    ApplyResult,
    Compare,
    CompareKind,
    Entry,
    KVService,
    LeaseGrant,
    LeaseInfo,
    LeaseKeepAlive,
    LeaseRevoke,
    NotLeaderError,
    Op,
    OpKind,
    OpResult,
    QuorumView,
    ServiceError,
    VersionWaitTimeoutError,
)
from metakv import AsyncClient
from metakv.core import Plan
from metakv.errors import (
    Forbidden,
    Indeterminate,
    InvalidRequest,
    LeaseNotFound,
    MetakvError,
    Unauthorized,
)
from metakv.leases import (
    grant_request,
    info_request,
    keepalive_request,
    parse_grant,
    parse_info,
    parse_keepalive,
    revoke_request,
)
from metakv.protocol import Request
from metakv.results import TxnResult
from metakv.routing import RetryPolicy

READ_WAIT_MS = 5000  # how long a read waits for this node to apply the version it needs
FORWARD_TIMEOUT_S = 5.0
# A forwarded call gives up on a leader that stopped answering this soon: the etcd client
# then retries (UNAVAILABLE), and the retry goes to whichever leader this node knows by then.
FORWARD_DEADLINE_S = 2.0
MEMBER_STATUS_TIMEOUT_S = 2.0  # a member that does not tell its status this soon is listed without URLs
Answered = TypeVar("Answered")


class LeaderLink:
    """Runs writes (as service txns) and linearizable-read barriers for the etcd mapping."""

    def __init__(self, service: KVService) -> None:
        self.service = service
        self._clients: dict[str, asyncio.Future[AsyncClient]] = {}  # "leader URL secret" -> its client, once built
        self._status_probe: asyncio.Future[httpx.AsyncClient] | None = None  # for members' /v1/status
        # HTTPS to the leader (set by app/etcd/serve.py): trusts the cluster's CA, presents this node's certificate
        self.https: ssl.SSLContext | None = None

    async def _client(self, leader_url: str) -> AsyncClient:
        """The client forwarding to ``leader_url`` with the caller's token: built once
        (concurrent calls wait for the same build), off the event loop (module docstring)."""
        secret = forwarding().secret  # the caller's token, with auth on (app/etcd/access.py)
        cache_key = f"{leader_url} {secret}"
        built = self._clients.get(cache_key)
        if built is None:
            transport = None if self.https is None else httpx.AsyncHTTPTransport(verify=self.https)
            built = self._clients[cache_key] = asyncio.ensure_future(asyncio.to_thread(
                AsyncClient, leader_url, timeout_s=FORWARD_TIMEOUT_S, retry=RetryPolicy(deadline_s=FORWARD_DEADLINE_S),
                read_your_writes=False, token=secret, transport=transport))
        try:
            return await asyncio.shield(built)
        except Exception:
            if self._clients.get(cache_key) is built:
                del self._clients[cache_key]  # the next call builds again
            raise

    async def close(self) -> None:
        builds, self._clients = list(self._clients.values()), {}
        for client in await asyncio.gather(*builds, return_exceptions=True):
            if isinstance(client, AsyncClient):
                await client.aclose()
        probe, self._status_probe = self._status_probe, None
        if probe is not None:
            with contextlib.suppress(Exception):  # a probe client that failed to build has nothing to close
                await (await probe).aclose()

    async def barrier(self, serializable: bool) -> None:
        """Return once a read of this node's state is as fresh as asked: ``serializable``
        any applied state (etcd's member-local read), else linearizable."""
        try:
            if serializable:
                await self.service.wait_readable("local", None, READ_WAIT_MS)
                return
            try:
                await self.service.wait_readable("linearizable", None, READ_WAIT_MS)
                return
            except NotLeaderError as exc:
                if exc.leader_url is None:
                    raise etcd_error(NO_LEADER) from exc
                version = await self._leader_version(exc.leader_url)
            await self.service.wait_readable("local", version, READ_WAIT_MS)
        except VersionWaitTimeoutError as exc:  # this node did not catch up in time
            raise etcd_error(TIMEOUT) from exc
        except ServiceError as exc:
            raise from_service_error(exc) from exc

    async def _leader_version(self, leader_url: str) -> int:
        try:
            client = await self._client(leader_url)
            listing = await client.list(forwarding().read_prefix, limit=1, keys_only=True, consistency="linearizable")
        except MetakvError as exc:
            raise _forward_error(exc) from exc
        return listing.version

    async def quorum(self) -> QuorumView:
        """The leader's view of the voters and observers, each with its advertised HTTP URL."""
        try:
            return self.service.quorum()
        except NotLeaderError as exc:
            if exc.leader_url is None:
                raise etcd_error(NO_LEADER) from exc
            client = await self._client(exc.leader_url)
            try:
                return (await client.call(Request("GET", "/v1/quorum", target_leader=True))).json()
            except MetakvError as forwarded:
                raise _forward_error(forwarded) from forwarded
        except ServiceError as exc:
            raise from_service_error(exc) from exc

    async def member_status(self, url: str) -> dict[str, Any] | None:
        """The /v1/status of the member whose advertised HTTP URL is ``url``; None when it
        does not answer. One plain HTTP client for all members, built off the loop."""
        if self._status_probe is None:
            self._status_probe = asyncio.ensure_future(asyncio.to_thread(
                httpx.AsyncClient, timeout=MEMBER_STATUS_TIMEOUT_S, verify=self.https or True))
        secret = forwarding().secret  # with auth on, /v1/status needs a token
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        try:
            probe = await asyncio.shield(self._status_probe)
            answer = await probe.get(url.rstrip("/") + "/v1/status", headers=headers)
            status = answer.json()
        except (httpx.HTTPError, ValueError):
            return None
        return status if answer.status_code == 200 and isinstance(status, dict) else None

    async def txn(self, compares: tuple[Compare, ...], success: tuple[Op, ...],
                  failure: tuple[Op, ...] = ()) -> ApplyResult:
        """The write, applied by the leader (this node, or forwarded to it)."""
        try:
            return await self.service.txn(compares, success, failure)
        except NotLeaderError as exc:
            if exc.leader_url is None:
                raise etcd_error(NO_LEADER) from exc
            return await self._forward(exc.leader_url, compares, success, failure)
        except ServiceError as exc:
            raise from_service_error(exc) from exc

    async def _forward(self, leader_url: str, compares: tuple[Compare, ...], success: tuple[Op, ...],
                       failure: tuple[Op, ...]) -> ApplyResult:
        if max(len(compares), len(success), len(failure)) > TXN_MAX_OPS:  # the HTTP API's bound
            raise invalid(f"a follower forwards a txn of at most {TXN_MAX_OPS} metakv ops and compares to the "
                          "leader (a put with prev_kv takes 2 ops, a deleted key with prev_kv 2, each key the "
                          "txn's decision reads 1 compare); the leader itself takes it")
        builder = (await self._client(leader_url)).txn()
        for compare in compares:
            if compare.kind == CompareKind.MOD_VERSION:
                builder.when_version(compare.key, int(compare.target))
            elif compare.kind == CompareKind.EXISTS:
                builder.when_exists(compare.key, bool(compare.target))
            else:
                builder.when_value(compare.key, bytes(compare.target))  # type: ignore[arg-type]
        for branch, put, delete, get in ((success, builder.then_put, builder.then_delete, builder.then_get),
                                         (failure, builder.else_put, builder.else_delete, builder.else_get)):
            for op in branch:
                if op.kind == OpKind.PUT:
                    put(op.key, op.value, op.content_type, lease=op.lease or None)
                elif op.kind == OpKind.DELETE:
                    delete(op.key)
                else:
                    get(op.key)
        try:
            answer = await builder.commit()
        except MetakvError as exc:
            raise _forward_error(exc) from exc
        return _apply_result(answer, success if answer.succeeded else failure)

    # ---- leases: the leader's calls (docs/leases.md), forwarded like writes ----------

    async def _lease_call(self, local: Callable[[], Awaitable[Answered]],
                          plan: Callable[[], Plan[Answered]]) -> Answered:
        try:
            return await local()
        except NotLeaderError as exc:
            if exc.leader_url is None:
                raise etcd_error(NO_LEADER) from exc
            try:
                return await (await self._client(exc.leader_url)).run(plan())
            except MetakvError as forwarded:
                raise _forward_error(forwarded) from forwarded
        except ServiceError as exc:
            raise from_service_error(exc) from exc

    async def grant_lease(self, ttl_s: int, lease_id: int | None) -> LeaseGrant:
        def plan() -> Plan[LeaseGrant]:
            return LeaseGrant(*parse_grant((yield grant_request(ttl_s, lease_id))))
        return await self._lease_call(lambda: self.service.grant_lease(ttl_s, lease_id), plan)

    async def keep_alive_leases(self, lease_ids: list[int]) -> LeaseKeepAlive:
        def plan() -> Plan[LeaseKeepAlive]:
            kept, not_found = parse_keepalive((yield keepalive_request(lease_ids, FORWARD_DEADLINE_S)))
            return LeaseKeepAlive(sorted(kept.items()), sorted(not_found))
        return await self._lease_call(lambda: self.service.keep_alive_leases(lease_ids), plan)

    async def revoke_lease(self, lease_id: int) -> LeaseRevoke:
        def plan() -> Plan[LeaseRevoke]:
            # The client counts a 404 as a revoke done (safe to resend); etcd says not found.
            answer = yield replace(revoke_request(lease_id), ok_statuses=frozenset({200}))
            body = answer.json()
            return LeaseRevoke(lease_id, int(body["version"]), int(body["deleted_keys"]))
        return await self._lease_call(lambda: self.service.revoke_lease(lease_id), plan)

    async def lease_info(self, lease_id: int, with_keys: bool) -> LeaseInfo:
        def plan() -> Plan[LeaseInfo]:
            info = parse_info((yield info_request(lease_id, with_keys)))
            return LeaseInfo(info.id, info.ttl_s, info.remaining_s, info.granted_version, info.keys)
        return await self._lease_call(lambda: self.service.lease_info(lease_id, with_keys), plan)


def _forward_error(exc: MetakvError) -> EtcdError:
    """etcd's answer for what the leader's HTTP API answered a forwarded call."""
    if isinstance(exc, Indeterminate):
        return etcd_error(LEADER_FAIL)
    if isinstance(exc, LeaseNotFound):
        return etcd_error(LEASE_NOT_FOUND)
    if exc.slug == "lease-exists" or exc.status == 409:
        return etcd_error(LEASE_EXISTS)
    if exc.slug == "invalid-ttl":
        return etcd_error(LEASE_TTL_TOO_LARGE)
    if isinstance(exc, Unauthorized | Forbidden):  # the leader's token rules (app/etcd/access.py)
        return etcd_error(PERMISSION_DENIED)
    if exc.slug == "quota-exceeded":
        return etcd_error(NO_SPACE)
    if exc.status == 413:  # a value, key or body over the leader's bounds
        return etcd_error(TOO_LARGE)
    if isinstance(exc, InvalidRequest):  # a refusal, not an absent leader: retrying cannot help
        return invalid(f"the leader refused the forwarded call: {exc}")
    return etcd_error(NO_LEADER)


def _apply_result(answer: TxnResult, ops: tuple[Op, ...]) -> ApplyResult:
    """The leader's HTTP answer as the ApplyResult the local service would have given."""
    results: list[OpResult] = []
    for op, result in zip(ops, answer.results, strict=True):
        entry = None
        if op.kind == OpKind.GET and result.get("found"):
            kv = result["kv"]
            entry = Entry(kv.key, kv.value, kv.content_type, kv.mod_version, kv.create_version,
                          int(result.get("key_version", 1)), kv.lease)
        results.append(OpResult(op.kind, op.key, bool(result.get("created", False)),
                                bool(result.get("deleted", False)), entry))
    failed = tuple((item["key"], int(item["current_version"])) for item in answer.failed_compares)
    return ApplyResult(answer.version - 1, answer.version, answer.succeeded, tuple(results), failed)
