"""The coalescing uvicorn protocol: a response's header and body writes leave as one, and a
request the parser refuses is answered with a problem document."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.http import create_app
from app.http.uvicorn_protocol import CoalescingHttpToolsProtocol
from app.http.uvicorn_protocol import CoalescingTransport as _CoalescingTransport
from storage.commands import put
from tests.http.conftest import TEST_SETTINGS
from tests.http.served import serve_in_thread
from tests.http.service_double import InProcessService

SOCKET_TIMEOUT_S = 30

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


@pytest.fixture
def served_url(tmp_path: Path) -> Iterator[str]:
    """The app over uvicorn with the protocol ``metakv serve`` runs, with keys under "é"."""
    node = InProcessService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"))
    node.apply_now(put("é/1", b"x"))
    node.apply_now(put("e/1", b"y"))
    try:
        with serve_in_thread(create_app(node, TEST_SETTINGS), http=CoalescingHttpToolsProtocol) as url:
            yield url
    finally:
        node.close()


def raw_exchange(base_url: str, request: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """Send raw request bytes (as curl sends an unencoded URL); status line, headers, body
    of the answer, read until the server closes the connection."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S) as connection:
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in header_lines)}
    return status_line.encode(), headers, body


def assert_parser_problem(answer: tuple[bytes, dict[str, str], bytes], slug: str) -> dict[str, Any]:
    status_line, headers, body = answer
    assert status_line == b"HTTP/1.1 400 Bad Request"
    assert headers["content-type"] == "application/problem+json"
    assert int(headers["content-length"]) == len(body)
    assert headers["connection"] == "close"
    document = json.loads(body)
    assert document["type"] == f"urn:metakv:problem:{slug}" and document["status"] == 400
    assert document["title"] and document["detail"]
    return document


# Raw bytes above 0x7f are refused by llhttp itself; http://a:b/ passes llhttp and fails
# httptools.parse_url in uvicorn's callback.
@pytest.mark.parametrize("target", [b"/v1/kv?prefix=\xc3\xa9", b"/v1/kv/\xc3\xa9/1", b"/v1/kv?prefix=\xff",
                                    b"http://a:b/v1/status"])
def test_raw_non_ascii_in_the_request_target_is_a_400_problem_document(served_url: str, target: bytes) -> None:
    answer = raw_exchange(served_url, b"GET " + target + b" HTTP/1.1\r\nHost: node1\r\n\r\n")
    document = assert_parser_problem(answer, "invalid-request-target")
    assert "percent-encode" in document["detail"]
    # Percent-encoded, the same request is served.
    _status, _headers, body = raw_exchange(
        served_url, b"GET /v1/kv?prefix=%C3%A9 HTTP/1.1\r\nHost: node1\r\nConnection: close\r\n\r\n")
    assert [item["key"] for item in json.loads(body)["items"]] == ["é/1"]


def test_a_malformed_request_is_a_400_problem_document(served_url: str) -> None:
    answer = raw_exchange(served_url, b"GET /v1/status HTTP/1.1\r\nHost node1\r\n\r\n")
    assert_parser_problem(answer, "bad-request")
