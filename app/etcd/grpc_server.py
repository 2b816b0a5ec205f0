"""etcd's v3 gRPC services on the node's event loop (grpc.aio), each call handed to the
mapping (app/etcd/mapping.py) or the watch streams (app/etcd/watch.py), after the caller's
check and, with a token file, its token's (app/etcd/access.py). Of the Auth service only
Authenticate is served; the rest, and every other call metakv does not serve, answer
UNIMPLEMENTED with a message starting ``metakv:``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TypeVar

import grpc

from app.auth import Access
from app.etcd import access
from app.etcd.access import EtcdAuth, Needed, on_range
from app.etcd.callers import Callers
from app.etcd.errors import EtcdError
from app.etcd.mapping import EtcdMapping
from app.etcd.protos import rpc_pb2, rpc_pb2_grpc
from app.etcd.watch import WatchStream
from app.tls import TlsFiles

logger = logging.getLogger(__name__)
Answer = TypeVar("Answer")
STOP_GRACE_S = 1.0
WATCH_CALL = "/etcdserverpb.Watch/Watch"
KEEP_ALIVE_CALL = "/etcdserverpb.Lease/LeaseKeepAlive"


Needs = Callable[[], Iterable[Needed]]


def _authenticated() -> Iterable[Needed]:
    return access.AUTHENTICATED


class _Calls:
    """What every call goes through before the mapping: the caller's check (``callers``)
    and, with auth on, its token's rights (app/etcd/access.py)."""

    def __init__(self, mapping: EtcdMapping, callers: Callers, auth: EtcdAuth | None) -> None:
        self.mapping = mapping
        self.callers = callers
        self.auth = auth

    def check(self, context: grpc.aio.ServicerContext, name: str, needed: Needs) -> None:
        caller = self.callers.of(context)
        if self.auth is not None:
            self.auth.check(name, caller, access.metadata_tokens(context.invocation_metadata() or ()), needed())

    async def admit(self, context: grpc.aio.ServicerContext, name: str, needed: Needs = _authenticated) -> None:
        try:
            self.check(context, name, needed)
        except EtcdError as exc:
            await context.abort(exc.code, exc.message)

    async def answer(self, context: grpc.aio.ServicerContext, name: str, call: Callable[[], Awaitable[Answer] | Answer],
                     needed: Needs = _authenticated) -> Answer:
        try:
            self.check(context, name, needed)
            answer = call()
            return await answer if inspect.isawaitable(answer) else answer  # type: ignore[return-value]
        except EtcdError as exc:
            await context.abort(exc.code, exc.message)
            raise  # abort raises; this line is for the type checker

    def watch_permitted(self, context: grpc.aio.ServicerContext) -> Callable[[rpc_pb2.WatchCreateRequest], bool]:
        """Whether the stream's token may read what a watch asks for (checked per watch)."""
        def permitted(create: rpc_pb2.WatchCreateRequest) -> bool:
            try:
                self.check(context, WATCH_CALL, lambda: access.watch_needs(create))
            except EtcdError as exc:
                return exc.code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
            return True
        return permitted


class _KV(rpc_pb2_grpc.KVServicer):
    def __init__(self, calls: _Calls) -> None:
        self.calls = calls
        self.mapping = calls.mapping

    async def Range(self, request: rpc_pb2.RangeRequest, context: grpc.aio.ServicerContext) -> rpc_pb2.RangeResponse:
        return await self.calls.answer(context, "/etcdserverpb.KV/Range", lambda: self.mapping.range(request),
                                       lambda: (on_range(Access.READ, request.key, request.range_end),))

    async def Put(self, request: rpc_pb2.PutRequest, context: grpc.aio.ServicerContext) -> rpc_pb2.PutResponse:
        return await self.calls.answer(context, "/etcdserverpb.KV/Put", lambda: self.mapping.put(request),
                                       lambda: (on_range(Access.WRITE, request.key, b""),))

    async def DeleteRange(self, request: rpc_pb2.DeleteRangeRequest,
                          context: grpc.aio.ServicerContext) -> rpc_pb2.DeleteRangeResponse:
        return await self.calls.answer(context, "/etcdserverpb.KV/DeleteRange",
                                       lambda: self.mapping.delete_range(request),
                                       lambda: (on_range(Access.WRITE, request.key, request.range_end),))

    async def Txn(self, request: rpc_pb2.TxnRequest, context: grpc.aio.ServicerContext) -> rpc_pb2.TxnResponse:
        return await self.calls.answer(context, "/etcdserverpb.KV/Txn", lambda: self.mapping.txn(request),
                                       lambda: access.txn_needs(request))

    async def Compact(self, request: rpc_pb2.CompactionRequest,
                      context: grpc.aio.ServicerContext) -> rpc_pb2.CompactionResponse:
        return await self.calls.answer(context, "/etcdserverpb.KV/Compact", lambda: self.mapping.compact(request),
                                       lambda: access.ADMIN)


class _Watch(rpc_pb2_grpc.WatchServicer):
    def __init__(self, calls: _Calls) -> None:
        self.calls = calls
        self.mapping = calls.mapping

    async def Watch(self, request_iterator: AsyncIterator[rpc_pb2.WatchRequest],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[rpc_pb2.WatchResponse]:
        await self.calls.admit(context, WATCH_CALL)
        async with WatchStream(self.mapping, self.calls.watch_permitted(context)) as stream:
            async for response in stream.serve(request_iterator):
                yield response


class _Lease(rpc_pb2_grpc.LeaseServicer):
    def __init__(self, calls: _Calls) -> None:
        self.calls = calls
        self.mapping = calls.mapping

    async def LeaseGrant(self, request: rpc_pb2.LeaseGrantRequest,
                         context: grpc.aio.ServicerContext) -> rpc_pb2.LeaseGrantResponse:
        return await self.calls.answer(context, "/etcdserverpb.Lease/LeaseGrant",
                                       lambda: self.mapping.lease_grant(request), lambda: access.SOME_WRITE)

    async def LeaseRevoke(self, request: rpc_pb2.LeaseRevokeRequest,
                          context: grpc.aio.ServicerContext) -> rpc_pb2.LeaseRevokeResponse:
        return await self.calls.answer(context, "/etcdserverpb.Lease/LeaseRevoke",
                                       lambda: self.mapping.lease_revoke(request), lambda: access.SOME_WRITE)

    async def LeaseTimeToLive(self, request: rpc_pb2.LeaseTimeToLiveRequest,
                              context: grpc.aio.ServicerContext) -> rpc_pb2.LeaseTimeToLiveResponse:
        return await self.calls.answer(context, "/etcdserverpb.Lease/LeaseTimeToLive",
                                       lambda: self.mapping.lease_time_to_live(request), lambda: access.SOME_WRITE)

    async def LeaseLeases(self, request: rpc_pb2.LeaseLeasesRequest,
                          context: grpc.aio.ServicerContext) -> rpc_pb2.LeaseLeasesResponse:
        return await self.calls.answer(context, "/etcdserverpb.Lease/LeaseLeases",
                                       lambda: self.mapping.lease_leases(request), lambda: access.SOME_WRITE)

    async def LeaseKeepAlive(self, request_iterator: AsyncIterator[rpc_pb2.LeaseKeepAliveRequest],
                             context: grpc.aio.ServicerContext) -> AsyncIterator[rpc_pb2.LeaseKeepAliveResponse]:
        """The ids that arrived while the previous keep-alive ran go together as one batch
        (one leadership confirmation), each still answered on its own."""
        await self.calls.admit(context, KEEP_ALIVE_CALL, lambda: access.SOME_WRITE)
        arrived: asyncio.Queue[int | None] = asyncio.Queue()

        async def receive() -> None:
            try:
                async for request in request_iterator:
                    arrived.put_nowait(request.ID)
            finally:
                arrived.put_nowait(None)  # the client closed its side

        receiver = asyncio.ensure_future(receive())
        try:
            ended = False
            while not ended and (first := await arrived.get()) is not None:
                ids = [first]
                while not arrived.empty():
                    more = arrived.get_nowait()
                    if more is None:
                        ended = True
                        break
                    ids.append(more)
                for response in await self.calls.answer(context, KEEP_ALIVE_CALL,
                                                        functools.partial(self.mapping.lease_keep_alive, ids),
                                                        lambda: access.SOME_WRITE):
                    yield response
        finally:
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await receiver


class _Maintenance(rpc_pb2_grpc.MaintenanceServicer):
    def __init__(self, calls: _Calls) -> None:
        self.calls = calls
        self.mapping = calls.mapping

    async def Status(self, request: rpc_pb2.StatusRequest, context: grpc.aio.ServicerContext) -> rpc_pb2.StatusResponse:
        return await self.calls.answer(context, "/etcdserverpb.Maintenance/Status", self.mapping.status)

    async def Alarm(self, request: rpc_pb2.AlarmRequest, context: grpc.aio.ServicerContext) -> rpc_pb2.AlarmResponse:
        # metakv raises no etcd alarms
        return await self.calls.answer(context, "/etcdserverpb.Maintenance/Alarm",
                                       lambda: rpc_pb2.AlarmResponse(header=self.mapping.header()))


class _Cluster(rpc_pb2_grpc.ClusterServicer):
    def __init__(self, calls: _Calls) -> None:
        self.calls = calls
        self.mapping = calls.mapping

    async def MemberList(self, request: rpc_pb2.MemberListRequest,
                         context: grpc.aio.ServicerContext) -> rpc_pb2.MemberListResponse:
        return await self.calls.answer(context, "/etcdserverpb.Cluster/MemberList", self.mapping.member_list)


def _credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """The node's HTTPS certificate and key; a client certificate from the CA when it names one."""
    try:
        chain = (tls.key_file.read_bytes(), tls.cert_file.read_bytes())
        ca = tls.ca_file.read_bytes() if tls.ca_file is not None else None
    except OSError as exc:
        raise OSError(f"--listen-etcd: cannot read the TLS files: {exc}") from None
    return grpc.ssl_server_credentials([chain], root_certificates=ca, require_client_auth=ca is not None)


class _Auth(rpc_pb2_grpc.AuthServicer):
    """Authenticate only: users and roles are the token file's (the rest is UNIMPLEMENTED)."""

    def __init__(self, calls: _Calls) -> None:
        self.calls = calls

    async def Authenticate(self, request: rpc_pb2.AuthenticateRequest,
                           context: grpc.aio.ServicerContext) -> rpc_pb2.AuthenticateResponse:
        def authenticate() -> rpc_pb2.AuthenticateResponse:
            caller = self.calls.callers.of(context)
            return access.authenticate_response(self.calls.mapping, self.calls.auth, request, caller,
                                                "/etcdserverpb.Auth/Authenticate")
        try:
            return authenticate()
        except EtcdError as exc:
            await context.abort(exc.code, exc.message)
            raise


Servicer = TypeVar("Servicer")


def _not_served_answered(servicer: Servicer) -> Servicer:
    """Every call of etcd's service that metakv does not serve (its generated base's
    method) answers UNIMPLEMENTED with metakv's message, not grpc's "Unexpected
    NotImplementedError" (docs/etcd.md, Compatibility)."""
    base = type(servicer).__mro__[1]  # the generated rpc_pb2_grpc servicer
    service = base.__name__.removesuffix("Servicer")
    for name, method in vars(base).items():
        if name.startswith("_") or not callable(method) or getattr(type(servicer), name) is not method:
            continue

        async def not_served(request: object, context: grpc.aio.ServicerContext, name: str = name) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"metakv: {service}.{name} is not served (docs/etcd.md)")
        setattr(servicer, name, not_served)
    return servicer


class EtcdGrpcServer:
    """The etcd gRPC listener of one node: ``start`` binds ``host:port`` (0: any free port,
    see ``port``) or, given ``unix_path``, that unix socket; ``stop`` ends open streams after
    a short grace."""

    def __init__(self, mapping: EtcdMapping, host: str = "", port: int = 0, unix_path: str | None = None,
                 callers: Callers | None = None, tls: TlsFiles | None = None, auth: EtcdAuth | None = None) -> None:
        self.mapping = mapping
        self.tls = tls
        self.calls = _Calls(mapping, callers if callers is not None else Callers(None), auth)
        self.host = host
        self.port = port
        self.unix_path = unix_path
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        server = grpc.aio.server()
        rpc_pb2_grpc.add_KVServicer_to_server(_not_served_answered(_KV(self.calls)), server)
        rpc_pb2_grpc.add_WatchServicer_to_server(_not_served_answered(_Watch(self.calls)), server)
        rpc_pb2_grpc.add_MaintenanceServicer_to_server(_not_served_answered(_Maintenance(self.calls)), server)
        rpc_pb2_grpc.add_ClusterServicer_to_server(_not_served_answered(_Cluster(self.calls)), server)
        rpc_pb2_grpc.add_LeaseServicer_to_server(_not_served_answered(_Lease(self.calls)), server)
        rpc_pb2_grpc.add_AuthServicer_to_server(_not_served_answered(_Auth(self.calls)), server)
        if self.unix_path is not None:
            address = f"unix:{self.unix_path}"
        else:
            address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            bound = server.add_insecure_port(address) if self.tls is None else server.add_secure_port(
                address, _credentials(self.tls))
        except RuntimeError as exc:
            raise OSError(f"--listen-etcd {address}: cannot bind ({exc})") from None
        if not bound:
            raise OSError(f"--listen-etcd {address}: cannot bind")
        if self.unix_path is None:
            self.port = bound
            logger.info("etcd v3 gRPC API on %s:%d", self.host, self.port)
        await server.start()
        self._server = server

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(STOP_GRACE_S)
            self._server = None
