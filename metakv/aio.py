"""``metakv.AsyncClient``: the asyncio client, the same calls as ``metakv.Client`` awaited.

    async with AsyncClient("http://127.0.0.1:8001,http://127.0.0.1:8002") as kv:
        await kv.put("services/db/url", "postgres://db:5432")
        async for event in kv.watch("services/"):
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, Unpack

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
from metakv.txn import TxnBuilder

POOL_SHARD_CONNECTIONS = 8  # connections per httpx pool (see AsyncClient.__init__)


class AsyncTxn(TxnBuilder):
    def __init__(self, client: AsyncClient) -> None:
        super().__init__()
        self._client = client

    async def commit(self) -> TxnResult:
        return await self._client.run(self._client.txn_plan(self.request()))


class AsyncLease(LeaseCore):
    """See ``metakv.Lease``: kept alive by the client's keep-alive task; ``done`` is an
    ``asyncio.Event`` and ``revoke`` a coroutine."""

    def __init__(self, client: AsyncClient, lease_id: int, ttl_s: int, granted_version: int,
                 sent_at: float) -> None:
        super().__init__(lease_id, ttl_s, granted_version, sent_at)
        self.done = asyncio.Event()
        self._client = client

    def notify_lost(self) -> None:
        self.done.set()

    async def revoke(self) -> int | None:
        return await self._client.revoke(self)

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        with raised_unless_failing(exc_type):
            await self.revoke()


class AsyncClient(ClientCore):
    """See ``metakv.Client``; every call is a coroutine and ``watch`` an async iterator."""

    def __init__(self, endpoints: str | Sequence[str], *, transport: httpx.AsyncBaseTransport | None = None,
                 **options: Unpack[ClientOptions]) -> None:
        super().__init__(endpoints, options)
        # Several small pools, not one large one: httpcore's pool rescans every connection
        # for every queued request, so one pool of 64 costs ~10 ms of CPU per request at 64
        # concurrent requests (55 req/s against a local server); pools of 8 took 340/s.
        connections = self.http_settings["limits"].max_connections
        shards = 1 if transport is not None else -(-connections // POOL_SHARD_CONNECTIONS)
        per_shard = -(-connections // shards)
        settings = {**self.http_settings, "limits": httpx.Limits(
            max_connections=per_shard, max_keepalive_connections=per_shard)}
        if transport is None:  # one TLS context for all pools: each loads the trust store (~0.1 s of CPU)
            settings["verify"] = httpx.create_ssl_context()
        self._pools = [httpx.AsyncClient(transport=transport, **settings) for _ in range(shards)]
        self._next_pool = 0
        self._keeper: asyncio.Task[None] | None = None
        self._keeper_wake: asyncio.Event | None = None

    async def aclose(self) -> None:
        """See ``Client.close``."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        for pool in self._pools:
            await pool.aclose()
        self.keepalives.end_all("the client was closed")

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def call(self, request: Request) -> Answer:
        call = self.new_call(request)
        while (delay := call.outcome(await self._attempt(call))) is not None:
            await asyncio.sleep(delay)
        return self.finished(call)

    async def _attempt(self, call: Call) -> httpx.Response | Exception:
        self._next_pool = (self._next_pool + 1) % len(self._pools)
        pool = self._pools[self._next_pool]
        if pool.is_closed:
            raise closed_error()
        try:
            return await pool.request(**call.send_options())
        except CLIENT_ERRORS as exc:
            return exc
        except RuntimeError:  # closed by another task meanwhile
            if pool.is_closed:
                raise closed_error() from None
            raise

    async def run(self, plan: Plan[ResultT]) -> ResultT:
        steps = PlanRun(plan)
        while steps.request is not None:
            try:
                steps.feed(await self.call(steps.request))
            except MetakvError as exc:
                steps.feed(exc)
        return steps.result  # type: ignore[return-value]

    async def get(self, key: str, *, consistency: str = "local", min_version: int | None = None,
                  at_version: int | None = None, wait_ms: int | None = None) -> KeyValue | None:
        return await self.run(self.get_plan(key, consistency, min_version, at_version, wait_ms))

    async def put(self, key: str, value: bytes | str, *, content_type: str | None = None,
                  if_version: int | None = None, lease: int | AsyncLease | None = None) -> PutResult:
        return await self.run(self.put_plan(key, value, content_type, if_version, lease=lease))

    async def create(self, key: str, value: bytes | str, *, content_type: str | None = None,
                     lease: int | AsyncLease | None = None) -> PutResult:
        return await self.run(self.put_plan(key, value, content_type, None, create_only=True, lease=lease))

    async def delete(self, key: str, *, if_version: int | None = None) -> DeleteResult:
        return await self.run(self.delete_plan(key, if_version))

    async def list(self, prefix: str = "", *, limit: int | None = None, keys_only: bool = False,
                   consistency: str = "local", min_version: int | None = None,
                   at_version: int | None = None) -> ListResult:
        return await self.run(self.list_plan(prefix, limit, keys_only, consistency, min_version, at_version))

    def txn(self) -> AsyncTxn:
        return AsyncTxn(self)

    async def cas_loop(self, key: str, update: CasUpdate, *, content_type: str | None = None,
                       max_attempts: int = CAS_MAX_ATTEMPTS) -> PutResult:
        return await self.run(self.cas_plan(key, update, content_type, max_attempts))

    async def lease(self, ttl_s: int, *, lease_id: int | None = None) -> AsyncLease:
        """See ``Client.lease``; kept alive by a task on the running loop."""
        granted_id, ttl, version, sent_at = await self.run(self.grant_plan(ttl_s, lease_id))
        lease = AsyncLease(self, granted_id, ttl, version, sent_at)
        self.keepalives.add(lease)
        if self._keeper is None or self._keeper_wake is None:
            self._keeper_wake = asyncio.Event()
            self._keeper = asyncio.get_running_loop().create_task(self._keep_alive(self._keeper_wake))
        self._keeper_wake.set()
        return lease

    async def revoke(self, lease: int | AsyncLease) -> int | None:
        return await self.run(self.revoke_plan(lease))

    async def lease_info(self, lease: int | AsyncLease, *, keys: bool = False) -> LeaseInfo:
        return await self.run(self.lease_info_plan(lease, keys))

    async def leases(self) -> list[LeaseSummary]:
        return await self.run(self.leases_plan())

    async def keep_alive_once(self, lease: int | AsyncLease) -> int:
        return await self.run(self.keep_alive_once_plan(lease))

    async def _keep_alive(self, wake: asyncio.Event) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self.keepalives.wait_s())
            wake.clear()
            try:
                await self.run(self.keepalives.round_plan())
            except ClientClosed:
                return

    async def status(self) -> dict[str, Any]:
        return parse_status(await self.call(Request("GET", "/v1/status")))

    async def watch(self, prefix: str = "", *, since: int | None = None,
                    poll_timeout_ms: int = DEFAULT_POLL_TIMEOUT_MS) -> AsyncIterator[Event]:
        start = since if since is not None else (await self.list(prefix, limit=1, keys_only=True)).version
        cursor = WatchCursor(prefix, start, poll_timeout_ms)
        while True:
            for event in cursor.accept(await self.call(cursor.request())):
                yield event
