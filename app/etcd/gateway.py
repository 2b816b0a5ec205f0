"""etcd's v3 JSON gateway (grpc-gateway's mapping of the same calls onto HTTP/1.1 POSTs with
JSON bodies, bytes as base64, field names as in the .proto) over the same mapping as the
gRPC server, so HTTP etcd clients (etcd3gw, the Locust etcd adapter) work too.

It serves the connections the etcd port's front (app/etcd/front.py) hands it, beside gRPC on
one port as etcd does, or, with --listen-etcd-gateway, a port of its own.
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import json
import socket
import ssl
import string
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable
from typing import Any

import grpc
import uvicorn
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.auth import Access
from app.etcd.access import (
    ADMIN,
    AUTHENTICATED,
    SOME_WRITE,
    EtcdAuth,
    Needed,
    authenticate_response,
    on_range,
    txn_needs,
    watch_needs,
)
from app.etcd.errors import EtcdError, unimplemented
from app.etcd.front import Caller
from app.etcd.mapping import ETCD_API_VERSION, EtcdMapping
from app.etcd.protos import rpc_pb2
from app.etcd.watch import WatchStream
from app.http.client_certs import ClientCertHttpToolsProtocol, client_cert_names

# grpc-gateway's HTTP status for each gRPC code (runtime.HTTPStatusFromCode)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.UNAUTHENTICATED: 401,
}
STOP_TIMEOUT_S = 2.0
BASE64_ALPHABET = frozenset(string.ascii_letters + string.digits + "+/=")
LISTEN_BACKLOG = 1024


def _json(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _error(exc: EtcdError) -> JSONResponse:
    code = exc.code.value[0]
    return JSONResponse({"error": exc.message, "code": code, "message": exc.message},
                        status_code=HTTP_STATUS.get(exc.code, 500))


def _base64_error(text: str) -> str | None:
    """Go's error for ``text`` as standard, padded base64 (what etcd's gateway takes), or
    None: protobuf's parser drops what is not base64 and would store what is left."""
    for index, char in enumerate(text):
        if char not in BASE64_ALPHABET:
            return f"illegal base64 data at input byte {index}"
    try:
        binascii.a2b_base64(text, strict_mode=True)
    except binascii.Error:
        pass
    else:
        if len(text) % 4 == 0:
            return None
    return f"illegal base64 data at input byte {len(text) - (len(text) % 4 or 4)}"  # its last quantum


def _check_base64(descriptor: Descriptor, data: Any) -> None:
    """Every bytes field of ``data`` (the JSON of a ``descriptor`` message, nested ones
    too) is base64, as etcd's gateway requires."""
    if not isinstance(data, dict):
        return  # not an object: ParseDict says so
    for name, value in data.items():
        field = descriptor.fields_by_name.get(name) or descriptor.fields_by_camelcase_name.get(name)
        if field is None:
            continue  # ignored, as etcd's gateway ignores unknown fields
        values = value if isinstance(value, list) else [value]
        for item in values:
            if field.type == FieldDescriptor.TYPE_BYTES and isinstance(item, str):
                error = _base64_error(item)
                if error is not None:
                    raise EtcdError(grpc.StatusCode.INVALID_ARGUMENT, error)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                _check_base64(field.message_type, item)


async def _body(request: Request, message: Message) -> Message:
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
        _check_base64(message.DESCRIPTOR, data)
        json_format.ParseDict(data, message, ignore_unknown_fields=True)
    except (ValueError, json_format.ParseError) as exc:
        raise EtcdError(grpc.StatusCode.INVALID_ARGUMENT, f"metakv: the body is not the call's JSON: {exc}") from None
    return message


GatewayNeeds = Callable[[Any], Iterable[Needed]]


def _authenticated(_request: Any) -> Iterable[Needed]:
    return AUTHENTICATED


def _caller(request: Request) -> Caller:
    client = request.scope.get("client")
    return Caller(tuple(client) if client else None, client_cert_names(request.scope))


def _check(auth: EtcdAuth | None, request: Request, needed: Iterable[Needed] | None = None) -> None:
    """With auth on: the Authorization header's token (etcd's gateway passes it on as the
    call's token), or the client certificate's, must grant what the call needs."""
    if auth is None:
        return
    auth.check(request.url.path, _caller(request), request.headers.getlist("authorization"),
               AUTHENTICATED if needed is None else needed, method="POST")


def gateway_app(mapping: EtcdMapping, auth: EtcdAuth | None = None) -> Starlette:
    def unary(request_type: type[Message], call: Callable[[Any], Awaitable[Message] | Message],
              needed: GatewayNeeds = _authenticated) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                body = await _body(request, request_type())
                if auth is not None:
                    _check(auth, request, needed(body))
                answer = call(body)
                if asyncio.iscoroutine(answer):
                    answer = await answer
                return JSONResponse(_json(answer))  # type: ignore[arg-type]
            except EtcdError as exc:
                return _error(exc)
        return endpoint

    async def watch(request: Request) -> Response:
        """One watch per request (as etcd's gateway): the create request in the body, the
        responses as JSON lines {"result": ...} until the client goes."""
        try:
            body = await _body(request, rpc_pb2.WatchRequest())
            _check(auth, request, watch_needs(body.create_request))  # type: ignore[attr-defined]
        except EtcdError as exc:
            return _error(exc)

        async def requests() -> AsyncIterator[rpc_pb2.WatchRequest]:
            yield body  # type: ignore[misc]
            await asyncio.Event().wait()  # the stream stays open until the client closes it

        async def lines() -> AsyncIterator[bytes]:
            async with WatchStream(mapping) as stream:
                async for response in stream.serve(requests()):
                    yield json.dumps({"result": _json(response)}).encode() + b"\n"
        return StreamingResponse(lines(), media_type="application/json")

    async def keep_alive(request: Request) -> Response:
        """grpc-gateway's stream of one request: the body's keep-alive, answered {"result": ...}."""
        try:
            body = await _body(request, rpc_pb2.LeaseKeepAliveRequest())
            _check(auth, request, SOME_WRITE)
            [answer] = await mapping.lease_keep_alive([body.ID])  # type: ignore[attr-defined]
        except EtcdError as exc:
            return _error(exc)
        return JSONResponse({"result": _json(answer)})

    async def version(request: Request) -> Response:
        """etcd's /version: clients such as etcd3gw pick the API path from it."""
        return JSONResponse({"etcdserver": ETCD_API_VERSION, "etcdcluster": ETCD_API_VERSION})

    async def authenticate(request: Request) -> Response:
        try:
            body = await _body(request, rpc_pb2.AuthenticateRequest())
            answer = authenticate_response(mapping, auth, body, _caller(request),  # type: ignore[arg-type]
                                           request.url.path, method="POST")
            return JSONResponse(_json(answer))
        except EtcdError as exc:
            return _error(exc)

    async def not_implemented(request: Request) -> Response:
        return _error(unimplemented(f"{request.url.path} is not served (docs/etcd.md)"))

    def on_key(access: Access) -> GatewayNeeds:
        return lambda body: (on_range(access, body.key, getattr(body, "range_end", b"")),)

    routes = [
        Route("/v3/kv/range", unary(rpc_pb2.RangeRequest, mapping.range, on_key(Access.READ)), methods=["POST"]),
        Route("/v3/kv/put", unary(rpc_pb2.PutRequest, mapping.put, on_key(Access.WRITE)), methods=["POST"]),
        Route("/v3/kv/deleterange", unary(rpc_pb2.DeleteRangeRequest, mapping.delete_range, on_key(Access.WRITE)),
              methods=["POST"]),
        Route("/v3/kv/txn", unary(rpc_pb2.TxnRequest, mapping.txn, txn_needs), methods=["POST"]),
        Route("/v3/kv/compaction", unary(rpc_pb2.CompactionRequest, mapping.compact, lambda _body: ADMIN),
              methods=["POST"]),
        Route("/v3/maintenance/status", unary(rpc_pb2.StatusRequest, lambda _request: mapping.status()),
              methods=["POST"]),
        Route("/v3/cluster/member/list", unary(rpc_pb2.MemberListRequest, lambda _request: mapping.member_list()),
              methods=["POST"]),
        Route("/v3/watch", watch, methods=["POST"]),
        Route("/v3/auth/authenticate", authenticate, methods=["POST"]),
        Route("/v3/lease/grant", unary(rpc_pb2.LeaseGrantRequest, mapping.lease_grant, lambda _body: SOME_WRITE),
              methods=["POST"]),
        Route("/v3/lease/keepalive", keep_alive, methods=["POST"]),
        # etcd's gateway serves the /v3/kv/lease/ spellings too (older clients use them)
        *(Route(f"{base}/{name}", unary(request_type, call, lambda _body: SOME_WRITE), methods=["POST"])
          for base in ("/v3/lease", "/v3/kv/lease")
          for name, request_type, call in (("revoke", rpc_pb2.LeaseRevokeRequest, mapping.lease_revoke),
                                           ("timetolive", rpc_pb2.LeaseTimeToLiveRequest,
                                            mapping.lease_time_to_live),
                                           ("leases", rpc_pb2.LeaseLeasesRequest, mapping.lease_leases))),
        Route("/version", version, methods=["GET"]),
        Route("/v3/{rest:path}", not_implemented, methods=["POST", "GET"]),
    ]
    return Starlette(routes=routes)


class _GatewayServer(uvicorn.Server):
    """uvicorn serving the sockets it is given, if any, and the connections handed to
    ``create_protocol``; no signal handling of its own (the node's handlers stay)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.bound: list[socket.socket] = []

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    def create_protocol(self) -> asyncio.Protocol:
        return self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.servers = [await loop.create_server(self.create_protocol, sock=sock, ssl=self.config.ssl,
                                                 backlog=LISTEN_BACKLOG) for sock in self.bound]
        self.started = True


class EtcdGateway:
    """The gateway's HTTP server on the node's event loop: on ``host:port`` when given (the
    separate gateway port), else only for the connections the front hands ``protocol()``."""

    def __init__(self, mapping: EtcdMapping, host: str | None = None, port: int = 0,
                 ssl_context: ssl.SSLContext | None = None, auth: EtcdAuth | None = None) -> None:
        self.host = host
        self.port = port
        self._server = _GatewayServer(uvicorn.Config(
            gateway_app(mapping, auth), loop="none", lifespan="off", access_log=False, http=ClientCertHttpToolsProtocol,
            log_level="warning", timeout_graceful_shutdown=1, server_header=False,
            ssl_context_factory=None if ssl_context is None else lambda _config, _default: ssl_context))
        self._task: asyncio.Task[None] | None = None

    def protocol(self) -> asyncio.Protocol:
        """A new HTTP/1.1 connection's protocol (the front calls ``connection_made``)."""
        return self._server.create_protocol()

    async def start(self) -> None:
        """Bind here (uvicorn exits the process on a failed bind), then serve."""
        if self.host is not None:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.host, self.port))
                sock.listen(LISTEN_BACKLOG)
            except OSError as exc:
                sock.close()
                raise OSError(f"--listen-etcd-gateway {self.host}:{self.port}: {exc.strerror}") from exc
            self.port = sock.getsockname()[1]
            self._server.bound = [sock]
        self._task = asyncio.ensure_future(self._server.serve())
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0)

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await asyncio.wait_for(self._task, STOP_TIMEOUT_S * 5)
            self._task = None
