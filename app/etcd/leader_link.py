"""Where an etcd call's writes and linearizable reads go: this node when it leads, else the
leader over metakv's public HTTP API (the metakv client). etcd clients never follow a
redirect, so a follower does it for them and a client on any member keeps working across
a leader change.

A follower's linearizable read asks the leader for a linearizable version (a one-key
listing) and waits until it has applied that version itself, then reads locally (Raft's
ReadIndex): the read rules stay in one place, the local read path.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

import httpx

from app.etcd.errors import (
    LEADER_FAIL,
    LEASE_EXISTS,
    LEASE_NOT_FOUND,
    LEASE_TTL_TOO_LARGE,
    NO_LEADER,
    PERMISSION_DENIED,
    TIMEOUT,
    EtcdError,
    etcd_error,
    from_service_error,
)
from app.etcd.forwarding import forwarding
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
    ServiceError,
    VersionWaitTimeoutError,
)
from metakv import AsyncClient
from metakv.core import Plan
from metakv.errors import Forbidden, Indeterminate, LeaseNotFound, MetakvError, Unauthorized
from metakv.leases import (
    grant_request,
    info_request,
    keepalive_request,
    parse_grant,
    parse_info,
    parse_keepalive,
    revoke_request,
)
from metakv.results import TxnResult
from metakv.routing import RetryPolicy

READ_WAIT_MS = 5000  # how long a read waits for this node to apply the version it needs
FORWARD_TIMEOUT_S = 5.0
# A forwarded call gives up on a leader that stopped answering this soon: the etcd client
# then retries (UNAVAILABLE), and the retry goes to whichever leader this node knows by then.
FORWARD_DEADLINE_S = 2.0
Answered = TypeVar("Answered")


class LeaderLink:
    """Runs writes (as service txns) and linearizable-read barriers for the etcd mapping."""

    def __init__(self, service: KVService) -> None:
        self.service = service
        self._clients: dict[str, AsyncClient] = {}
        # HTTPS to the leader (set by app/etcd/serve.py): trusts the cluster's CA, presents this node's certificate
        self.https: ssl.SSLContext | None = None

    def _client(self, leader_url: str) -> AsyncClient:
        secret = forwarding().secret  # the caller's token, with auth on (app/etcd/access.py)
        client = self._clients.get(f"{leader_url} {secret}")
        if client is None:
            client = self._clients[f"{leader_url} {secret}"] = AsyncClient(
                leader_url, timeout_s=FORWARD_TIMEOUT_S, retry=RetryPolicy(deadline_s=FORWARD_DEADLINE_S),
                read_your_writes=False, token=secret,
                transport=None if self.https is None else httpx.AsyncHTTPTransport(verify=self.https))
        return client

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

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
            listing = await self._client(leader_url).list(forwarding().read_prefix, limit=1, keys_only=True,
                                                          consistency="linearizable")
        except MetakvError as exc:
            raise _forward_error(exc) from exc
        return listing.version

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
        builder = self._client(leader_url).txn()
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
                return await self._client(exc.leader_url).run(plan())
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
