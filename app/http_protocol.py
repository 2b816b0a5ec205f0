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
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _CoalescingTransport:
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
        super().connection_made(_CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
