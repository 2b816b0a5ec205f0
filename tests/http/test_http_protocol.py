"""The coalescing uvicorn protocol: a response's header and body writes leave as one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.http_protocol import _CoalescingTransport

pytestmark = pytest.mark.anyio


class RecordingTransport(asyncio.Transport):
    """Records every write the protocol's transport hands on, and the close."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5555)}.get(name, default)


async def test_writes_of_one_loop_turn_leave_as_one_write_in_order() -> None:
    real = RecordingTransport()
    transport = _CoalescingTransport(real, asyncio.get_running_loop())
    transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    transport.write(b"")
    transport.write(b"ok")
    assert real.writes == []  # nothing leaves before the loop turn ends
    await asyncio.sleep(0)
    assert real.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
    transport.write(b"next")
    await asyncio.sleep(0)
    assert real.writes[1:] == [b"next"]
    assert transport.get_extra_info("peername") == ("127.0.0.1", 5555)  # everything else is the real one's


async def test_close_sends_what_is_pending_first_and_nothing_after() -> None:
    real = RecordingTransport()
    transport = _CoalescingTransport(real, asyncio.get_running_loop())
    transport.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    transport.close()
    assert real.writes == [b"HTTP/1.1 400 Bad Request\r\n\r\n"] and real.closed
    transport.write(b"late")
    await asyncio.sleep(0)
    assert real.writes == [b"HTTP/1.1 400 Bad Request\r\n\r\n"]  # a closing transport gets nothing more
