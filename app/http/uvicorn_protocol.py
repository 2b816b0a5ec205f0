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
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from app.http.problems import PROBLEM_MEDIA_TYPE, problem_body


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


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """``uvicorn.Config(http=CoalescingHttpToolsProtocol)``: httptools with coalesced writes."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The real transport keeps calling pause_writing/resume_writing on this protocol.
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]

    def send_400_response(self, msg: str) -> None:
        """The parser refused the request: a 400 problem document, then the connection closes
        (the parser cannot resynchronise on the stream), as uvicorn does with plain text.

        uvicorn calls this only inside its ``except httptools.HttpParserError`` of
        ``data_received``, so the exception being handled says what was wrong. llhttp refuses
        a request target with raw bytes above 0x7f (``prefix=é`` unencoded) before any
        callback sees the URL, so it cannot be percent-encoded here and accepted: the detail
        tells the client to percent-encode it."""
        error = sys.exc_info()[1]
        if isinstance(error, httptools.HttpParserInvalidURLError) or isinstance(
                getattr(error, "__context__", None), httptools.HttpParserInvalidURLError):
            body = problem_body(400, "invalid-request-target", "Invalid request target",
                                "the request target (path and query) is not a valid URL: percent-encode "
                                "non-ASCII bytes (UTF-8, as %C3%A9), spaces and control characters")
        else:
            body = problem_body(400, "bad-request", "Bad request",
                                f"the request is not valid HTTP/1.1 ({error or msg})")
        content = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend([b"content-type: ", PROBLEM_MEDIA_TYPE.encode(), b"\r\n",
                        b"content-length: ", str(len(body)).encode("ascii"), b"\r\n",
                        b"connection: close\r\n\r\n", body])
        self.transport.write(b"".join(content))
        self.transport.close()
