"""One port for etcd's gRPC API and its JSON gateway, as etcd serves both on :2379 (cmux).

Each accepted connection is sniffed: over TLS the ALPN protocol decides (``h2`` = gRPC,
``http/1.1`` = gateway, chosen whenever the client offers it); otherwise its first bytes do (HTTP/2's client preface ``PRI *
HTTP/2.0`` = gRPC, anything else = the gateway's HTTP/1.1). A gateway connection is handed to
the gateway's HTTP protocol in this process, so it costs nothing extra. grpcio cannot adopt a
socket, so a gRPC connection is relayed, byte for byte with flow control, to the gRPC server
listening on a unix socket only this user can reach; the relay records which client each of
its connections there carries (``callers``), so the gRPC side knows the real client (address
and TLS certificate) and refuses calls that did not come through this front.

Bytes that are neither reach the gateway's HTTP parser, which answers 400 and closes that
connection only; a connection that sends too little to decide is closed after a timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

from app.tls import certificate_names

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# The server's preference order (OpenSSL picks the first of these the client offers): gRPC
# clients offer h2 alone, curl and browsers h2 and http/1.1 and mean the gateway.
ALPN_PROTOCOLS = ["http/1.1", "h2"]
SNIFF_TIMEOUT_S = 10.0  # as the HTTP API's header timeout: a silent connection goes then
LISTEN_BACKLOG = 1024

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a relayed gRPC connection comes from: the client's address and the names of its
    verified TLS certificate (none over plain TCP or without a client certificate)."""

    address: tuple[str, int] | None
    cert_names: tuple[str, ...] = ()


def grpc_peer(abstract_name: str) -> str:
    """How grpc's ``context.peer()`` names a unix connection from the abstract ``name``."""
    return f"unix-abstract:{abstract_name}"


class _Relay(asyncio.Protocol):
    """One side of a relayed connection: what it receives is written to the other side, and
    a side that cannot write fast enough pauses the other's reading."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.other: asyncio.Transport | None = None
        self.on_lost: Callable[[], None] | None = None
        self.early = b""  # what arrived before the other side was joined (gRPC's SETTINGS)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def join(self, other: asyncio.Transport) -> None:
        self.other = other
        if self.early:
            other.write(self.early)
            self.early = b""

    def data_received(self, data: bytes) -> None:
        if self.other is not None:
            self.other.write(data)
        else:
            self.early += data

    def pause_writing(self) -> None:
        if self.other is not None:
            self.other.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None:
            self.other.resume_reading()

    def eof_received(self) -> bool:
        if self.other is not None and self.other.can_write_eof():
            self.other.write_eof()
            return True  # half-close: the other direction may still carry answers
        if self.other is not None:
            self.other.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None:
            self.other.close()
        if self.on_lost is not None:
            self.on_lost()


class _Sniffer(asyncio.Protocol):
    """A new connection until it is known to be gRPC or HTTP/1.1."""

    def __init__(self, front: EtcdFront) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.buffered = b""
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        ssl_object = transport.get_extra_info("ssl_object")
        alpn = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        if alpn == "h2":
            self._to_grpc()
        elif alpn == "http/1.1":
            self._to_gateway()
        else:
            self.timer = asyncio.get_running_loop().call_later(SNIFF_TIMEOUT_S, transport.close)

    def data_received(self, data: bytes) -> None:
        self.buffered += data
        if self.buffered.startswith(HTTP2_PREFACE):
            self._to_grpc()
        elif not HTTP2_PREFACE.startswith(self.buffered):
            self._to_gateway()

    def eof_received(self) -> bool:
        return False  # nothing decided yet: close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _to_gateway(self) -> None:
        self._stop_timer()
        assert self.transport is not None
        protocol = self.front.gateway_protocol()
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        if self.buffered:
            protocol.data_received(self.buffered)

    def _to_grpc(self) -> None:
        self._stop_timer()
        assert self.transport is not None
        self.transport.pause_reading()  # until the connection to the gRPC server is there
        self.front.relay(self.transport, self.buffered, self)


class EtcdFront:
    """The etcd port: accepts, sniffs, and hands each connection to the gRPC server on the
    unix socket ``grpc_path`` or to ``gateway_protocol`` (an HTTP/1.1 protocol factory)."""

    def __init__(self, host: str, port: int, grpc_path: str, gateway_protocol: Callable[[], asyncio.Protocol],
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.host = host
        self.port = port
        self.grpc_path = grpc_path
        self.gateway_protocol = gateway_protocol
        self.ssl_context = ssl_context
        self.callers: dict[str, Caller] = {}  # grpc peer of a relayed connection -> its client
        self._server: asyncio.AbstractServer | None = None
        self._relays: set[asyncio.Task[None]] = set()
        self._numbers = itertools.count(1)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(lambda: _Sniffer(self), self.host, self.port,
                                                    ssl=self.ssl_context, backlog=LISTEN_BACKLOG, reuse_address=True)
        except OSError as exc:
            raise OSError(f"--listen-etcd {self.host}:{self.port}: {exc.strerror or exc}") from exc
        sockets = self._server.sockets
        self.port = sockets[0].getsockname()[1] if sockets else self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._relays):
            task.cancel()

    def relay(self, client: asyncio.Transport, first_bytes: bytes, sniffer: _Sniffer) -> None:
        task = asyncio.ensure_future(self._relay(client, first_bytes, sniffer))
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)

    async def _relay(self, client: asyncio.Transport, first_bytes: bytes, sniffer: _Sniffer) -> None:
        loop = asyncio.get_running_loop()
        # Bound to a name of its own, so the gRPC server's context.peer() tells the relayed
        # connections apart (a unix socket: private, and no TCP stack on the way).
        name = f"metakv-etcd-{os.getpid()}-{id(self):x}-{next(self._numbers)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.bind(b"\0" + name.encode())
            await loop.sock_connect(sock, self.grpc_path)
            back, back_side = await loop.create_unix_connection(_Relay, sock=sock)
        except OSError as exc:
            sock.close()
            log.warning("etcd port: cannot reach the gRPC server on %s: %s", self.grpc_path, exc)
            client.close()
            return
        except asyncio.CancelledError:  # the front stops
            sock.close()
            client.close()
            raise
        if sniffer.closed:  # the client left while we connected
            back.close()
            return
        peer = grpc_peer(name)
        ssl_object = client.get_extra_info("ssl_object")
        self.callers[peer] = Caller(client.get_extra_info("peername"),
                                    tuple(certificate_names(ssl_object.getpeercert())) if ssl_object else ())
        client_side = _Relay()
        client_side.transport, client_side.other = client, back
        back_side.join(client)
        back_side.on_lost = lambda: self.callers.pop(peer, None)
        client.set_protocol(client_side)
        if first_bytes:
            back.write(first_bytes)
        client.resume_reading()
