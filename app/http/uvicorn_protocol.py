"""uvicorn's httptools protocol, with one socket write per response instead of two.

Why: uvicorn writes a response's status line and headers, then its body, with two
``transport.write`` calls; uvloop sends each at once, so every small response costs two
``send`` syscalls (on loopback each also runs the receiver's TCP input path) while holding
the GIL. py-spy with ``--gil`` put those two writes at ~25 % of the leader's GIL time at 64
writers (docs/http.md). Here the protocol's transport collects what one loop turn writes on
a connection and hands it to the real transport as one buffer at the end of that turn (one
``call_soon``), so headers and body leave together.

Everything else is uvicorn's: parsing, keep-alive, flow control (the real transport still
pauses and resumes the protocol), timeouts. ``close`` sends what is pending first.

One more difference: a request the parser refuses before the app sees it (raw non-ASCII
bytes or a space in the request target, a malformed request line or header) is answered
with an RFC 9457 problem document, like every other error of the API, instead of uvicorn's
``text/plain`` "Invalid HTTP request received.".

And two limits a slowloris client meets before the app (and auth) can run, since both need
complete headers (docs/security.md "Connection limits"): a request whose headers pass
``max_header_bytes`` is answered 431 and closed (httptools would buffer a header of any
size), and a connection whose request headers are not complete ``header_timeout_s`` after it
opened (or after the request's first byte) is answered 408 and closed. A third bounds a
client that stops reading (an SSE watcher): a connection whose send buffer stays above the
high-water mark (writes paused) for ``write_stall_timeout_s`` is aborted, so the response's
writer, waiting on the paused transport, ends with the connection instead of holding a
watch and its buffers for the stream's lifetime. Last, connections are capped per client
address and per node: one past a cap is answered 503 ``too-many-connections`` at once and
closed, so idle connections cannot take every descriptor.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httptools
from prometheus_client import Counter
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from app.http.collectors import PerRegistry
from app.http.problems import PROBLEM_MEDIA_TYPE, RETRY_AFTER_SECONDS, problem_body
from app.http.settings import (
    DEFAULT_HEADER_TIMEOUT_MS,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_WRITE_STALL_TIMEOUT_MS,
)


class CoalescingTransport:
    """A write-deferring front of an asyncio transport: writes of one loop turn become one."""

    __slots__ = ("_transport", "_loop", "_pending", "_flush_scheduled")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []  # bounded by what one loop turn writes on a connection
        self._flush_scheduled = False

    def write(self, data: bytes) -> None:
        if not data:
            return
        self._pending.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._pending:
            return
        data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()  # a response written just before the close still goes out first
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


# connections_closed_counter(registry): metakv_http_connections_closed_total{reason}
connections_closed_counter = PerRegistry(lambda registry: Counter(
    "metakv_http_connections_closed", "HTTP connections the node closed for a limit, by reason",
    ("reason",), registry=registry))


class ClientConnections:
    """Open connections by client address (one table per server, shared by its protocols)."""

    __slots__ = ("by_address",)

    def __init__(self) -> None:
        self.by_address: dict[str, int] = {}  # addresses with open connections only

    def add(self, address: str) -> int:
        count = self.by_address.get(address, 0) + 1
        self.by_address[address] = count
        return count

    def remove(self, address: str) -> None:
        count = self.by_address.get(address, 0) - 1
        if count > 0:
            self.by_address[address] = count
        else:
            self.by_address.pop(address, None)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The bounds every connection of one server meets (the module docstring says which)."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # request line and headers
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_MS / 1000
    write_stall_timeout_s: float = DEFAULT_WRITE_STALL_TIMEOUT_MS / 1000
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # per node
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT  # per client address
    clients: ClientConnections = field(default_factory=ClientConnections)
    closed: Counter | None = None  # connections_closed_counter, when metrics are kept

    def count_closed(self, reason: str) -> None:
        if self.closed is not None:
            self.closed.labels(reason).inc()


class HeaderTooLargeError(Exception):
    """Raised from a parser callback once the parsed request line and headers pass the cap
    (httptools turns it into an HttpParserCallbackError, and uvicorn into send_400_response)."""


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """``uvicorn.Config(http=CoalescingHttpToolsProtocol)``: httptools with coalesced writes.
    ``with_limits`` makes a subclass with other connection limits (uvicorn builds the protocol
    itself, so the limits travel as a class attribute)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    _header_timer: asyncio.TimerHandle | None = None
    _stall_timer: asyncio.TimerHandle | None = None
    _counted_address: str | None = None
    _header_bytes = 0  # bytes received while a request's headers were incomplete
    _parsed_header_bytes = 0  # the current request's line and headers as parsed

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[CoalescingHttpToolsProtocol]:
        return type(cls.__name__, (cls,), {"limits": limits})

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The real transport keeps calling pause_writing/resume_writing on this protocol.
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
        if self.client is not None:
            self._counted_address = self.client[0]
            from_client = self.limits.clients.add(self._counted_address)
            if from_client > self.limits.max_connections_per_client:
                self._refuse_connection("client", f"this client address holds its maximum of "
                                        f"{self.limits.max_connections_per_client} connections to this node")
                return
        if len(self.connections) > self.limits.max_connections:
            self._refuse_connection("node", f"this node holds its maximum of {self.limits.max_connections} connections")
            return
        self._await_headers()

    def _refuse_connection(self, cap: str, detail: str) -> None:
        """Answered before any request is read (a client sends its request anyway, and reads
        this as the answer), then closed."""
        self.limits.count_closed(f"connections_per_{cap}")
        self._answer_and_close(503, problem_body(
            503, "too-many-connections", "Too many connections", f"{detail}; retry later"),
            [(b"retry-after", str(RETRY_AFTER_SECONDS).encode())])

    def _await_headers(self) -> None:
        """Start the header clock (a new connection, or a new request's first byte)."""
        if self._header_timer is None:
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _stop_header_clock(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is None or self.transport.is_closing():
            return
        # Headers still incomplete: all of this chunk counts (at most one read's worth more
        # than the headers themselves when a previous request's body shared the chunk).
        self._header_bytes += len(data)
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse_header_bytes()

    def _refuse_header_bytes(self) -> None:
        self._stop_header_clock()
        self.limits.count_closed("header_bytes")
        self._answer_and_close(431, problem_body(
            431, "header-too-large", "Request header fields too large",
            f"the request line and headers exceed {self.limits.max_header_bytes} bytes"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._parsed_header_bytes = 0
        self._await_headers()

    # Headers that arrive complete in one read never meet the count in data_received (the
    # parser finishes them first), so the parsed sizes are counted too.
    def on_url(self, url: bytes) -> None:
        self._count_parsed_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_parsed_header_bytes(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count_parsed_header_bytes(self, size: int) -> None:
        self._parsed_header_bytes += size
        if self._parsed_header_bytes > self.limits.max_header_bytes:
            raise HeaderTooLargeError

    def on_headers_complete(self) -> None:
        self._stop_header_clock()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_clock()
        self._stop_stall_clock()
        if self._counted_address is not None:
            self.limits.clients.remove(self._counted_address)
            self._counted_address = None
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.limits.write_stall_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        self._stop_stall_clock()
        super().resume_writing()

    def _stop_stall_clock(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _write_stalled(self) -> None:
        """The client read nothing for the whole timeout: drop what is queued and the
        connection (connection_lost then wakes the writer, which sees a disconnect)."""
        self._stall_timer = None
        if not self.transport.is_closing():
            self.limits.count_closed("write_stall")
        self.transport.abort()

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        self.limits.count_closed("header_timeout")
        self._answer_and_close(408, problem_body(
            408, "header-timeout", "Request timeout",
            f"the request headers were not complete within {self.limits.header_timeout_s:g} s"))

    def send_400_response(self, msg: str) -> None:
        """The parser refused the request: a 400 problem document, then the connection closes
        (the parser cannot resynchronise on the stream), as uvicorn does with plain text.

        uvicorn calls this only inside its ``except httptools.HttpParserError`` of
        ``data_received``, so the exception being handled says what was wrong. llhttp refuses
        a request target with raw bytes above 0x7f (``prefix=é`` unencoded) before any
        callback sees the URL, so it cannot be percent-encoded here and accepted: the detail
        tells the client to percent-encode it."""
        error = sys.exc_info()[1]
        if isinstance(getattr(error, "__context__", None), HeaderTooLargeError):
            self._refuse_header_bytes()
            return
        if isinstance(error, httptools.HttpParserInvalidURLError) or isinstance(
                getattr(error, "__context__", None), httptools.HttpParserInvalidURLError):
            body = problem_body(400, "invalid-request-target", "Invalid request target",
                                "the request target (path and query) is not a valid URL: percent-encode "
                                "non-ASCII bytes (UTF-8, as %C3%A9), spaces and control characters")
        else:
            body = problem_body(400, "bad-request", "Bad request",
                                f"the request is not valid HTTP/1.1 ({error or msg})")
        self._stop_header_clock()
        self._answer_and_close(400, body)

    def _answer_and_close(self, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """A problem document written straight to the transport, then close; only a close while
        a pipelined earlier request's response is still being written (no interleaving)."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()
            return
        content = [STATUS_LINE[status]]
        for name, value in [*self.server_state.default_headers, *headers]:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend([b"content-type: ", PROBLEM_MEDIA_TYPE.encode(), b"\r\n",
                        b"content-length: ", str(len(body)).encode("ascii"), b"\r\n",
                        b"connection: close\r\n\r\n", body])
        self.transport.write(b"".join(content))
        self.transport.close()
