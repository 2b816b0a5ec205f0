"""The raft transport between real sockets on loopback: delivery, pipelining, response
routing, authentication, and bad bytes closing one connection only."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable

import pytest

from app.transport import FRAME_LENGTH, RaftTransport, RefusalLogLimiter, TransportConfig
from raft.messages import Envelope, FetchRequest, FetchResponse, VoteRequest
from raft.types import ErrorCode

SECRET = b"test-secret"
WAIT_S = 10.0


def fetch(offset: int) -> FetchRequest:
    return FetchRequest(1, 1, offset, 0, 0, 500, "")


def fetch_response(offset: int) -> FetchResponse:
    return FetchResponse(ErrorCode.NONE, 1, 2, "http://b", offset, 0, 0, 0, 0, (), -1, 0, None)


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Node:
    """A transport plus the envelopes it received; ``respond`` answers fetches automatically."""

    def __init__(self, node_id: int, peers: dict[int, tuple[str, int]], *, cluster_id: str = "c1",
                 secret: bytes = SECRET, port: int = 0, respond: bool = False,
                 config: TransportConfig | None = None) -> None:
        self.received: list[Envelope] = []
        self.respond = respond
        self.transport = RaftTransport(node_id, cluster_id, secret, "127.0.0.1", port, peers,
                                       self._on_message, config)

    def _on_message(self, envelope: Envelope) -> None:
        self.received.append(envelope)
        if self.respond and isinstance(envelope.message, FetchRequest):
            self.transport.send(Envelope(self.transport.node_id, envelope.src,
                                         fetch_response(envelope.message.fetch_offset)))

    def messages(self, kind: type) -> list:
        return [e.message for e in self.received if isinstance(e.message, kind)]


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_pipelined_requests_and_responses_arrive_in_order() -> None:
    async def scenario() -> None:
        server = Node(2, {}, respond=True)
        await server.transport.start()
        client = Node(1, {2: ("127.0.0.1", server.transport.port)})
        await client.transport.start()
        try:
            for offset in range(200):
                client.transport.send(Envelope(1, 2, fetch(offset)))
            await wait_until(lambda: len(client.messages(FetchResponse)) == 200, "200 responses")
            assert [m.fetch_offset for m in client.messages(FetchResponse)] == list(range(200))
            assert all(e.src == 2 and e.dst == 1 for e in client.received)
            # The server knew no address for node 1: responses went back on the inbound connection.
            assert all(e.src == 1 for e in server.received)
        finally:
            await client.transport.stop()
            await server.transport.stop()
    run(scenario)


def test_wrong_secret_or_cluster_is_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        server = Node(2, {})
        await server.transport.start()
        intruders = [
            Node(1, {2: ("127.0.0.1", server.transport.port)}, secret=b"wrong"),
            Node(3, {2: ("127.0.0.1", server.transport.port)}, cluster_id="other"),
        ]
        try:
            for intruder in intruders:
                await intruder.transport.start()
                intruder.transport.send(Envelope(intruder.transport.node_id, 2, VoteRequest(1, 1, 0, 0, True)))
            await wait_until(lambda: server.transport.stats.connections_refused >= 2, "two refusals")
            await asyncio.sleep(0.2)
            assert server.received == []
        finally:
            for intruder in intruders:
                await intruder.transport.stop()
            await server.transport.stop()

    with caplog.at_level(logging.WARNING, logger="metakv.transport"):
        run(scenario)
    text = caplog.text
    assert "does not know the cluster secret" in text or "cluster secret" in text
    assert "belongs to cluster 'other'" in text


def test_garbage_and_oversized_frames_close_only_that_connection() -> None:
    async def scenario() -> None:
        config = TransportConfig(max_frame_bytes=64 * 1024)
        server = Node(2, {}, respond=True, config=config)
        await server.transport.start()
        client = Node(1, {2: ("127.0.0.1", server.transport.port)}, config=config)
        await client.transport.start()
        try:
            client.transport.send(Envelope(1, 2, fetch(1)))
            await wait_until(lambda: len(client.messages(FetchResponse)) == 1, "first response")

            # Random bytes from a stranger: that socket is closed, the node keeps serving.
            for _ in range(5):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.transport.port)
                writer.write(os.urandom(256))
                await writer.drain()
                assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # closed by the server
                writer.close()

            # An authenticated peer sending an oversized frame loses only its own connection.
            outbound = client.transport._outbound[2]
            outbound.writer.write(FRAME_LENGTH.pack(10 * 1024 * 1024))
            await outbound.writer.drain()
            await wait_until(lambda: server.transport.stats.connections_closed_bad_frame == 1, "bad frame close")

            # ...and an authenticated peer sending a non-message frame likewise.
            await wait_until(lambda: 2 in client.transport._outbound and not client.transport._outbound[2].closed,
                             "reconnect")
            client.transport._outbound[2].writer.write(FRAME_LENGTH.pack(3) + b"\x93\x00\x01")
            await wait_until(lambda: server.transport.stats.connections_closed_bad_frame == 2, "second close")

            client.transport.send(Envelope(1, 2, fetch(2)))
            await wait_until(lambda: 2 in [m.fetch_offset for m in client.messages(FetchResponse)], "after reconnect")
            assert server.transport.stats.connections_refused >= 5
        finally:
            await client.transport.stop()
            await server.transport.stop()
    run(scenario)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_reconnects_after_the_peer_restarts() -> None:
    async def scenario() -> None:
        port = free_port()
        server = Node(2, {}, port=port, respond=True)
        await server.transport.start()
        client = Node(1, {2: ("127.0.0.1", port)})
        await client.transport.start()
        try:
            client.transport.send(Envelope(1, 2, fetch(1)))
            await wait_until(lambda: len(client.messages(FetchResponse)) == 1, "first response")
            await server.transport.stop()
            client.transport.send(Envelope(1, 2, fetch(2)))  # may be lost: the peer is down
            server = Node(2, {}, port=port, respond=True)
            await server.transport.start()

            async def resend_until_answered() -> None:
                offset = 3
                while 3 > max(m.fetch_offset for m in client.messages(FetchResponse)):
                    client.transport.send(Envelope(1, 2, fetch(offset)))
                    await asyncio.sleep(0.1)
            await asyncio.wait_for(resend_until_answered(), WAIT_S)
        finally:
            await client.transport.stop()
            await server.transport.stop()
    run(scenario)


def test_messages_to_unknown_peers_are_dropped_not_raised() -> None:
    async def scenario() -> None:
        node = Node(1, {})
        await node.transport.start()
        try:
            node.transport.send(Envelope(1, 9, fetch(1)))
            node.transport.send(Envelope(1, 9, fetch_response(1)))
            assert node.transport.stats.frames_dropped == 2
        finally:
            await node.transport.stop()
    run(scenario)


def test_a_write_failing_after_a_reset_reconnects_instead_of_going_silent() -> None:
    """Under uvloop a write to a connection that a TCP reset closed raises RuntimeError, not
    OSError. The chaos harness (seed 7) found that this killed the outbound task for good;
    the transport must drop that connection and reconnect."""
    async def scenario() -> None:
        server = Node(2, {}, respond=True)
        await server.transport.start()
        client = Node(1, {2: ("127.0.0.1", server.transport.port)})
        await client.transport.start()
        try:
            client.transport.send(Envelope(1, 2, fetch(1)))
            await wait_until(lambda: len(client.messages(FetchResponse)) == 1, "first response")
            broken = client.transport._outbound[2]

            def write_after_reset(_data: bytes) -> None:
                raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")
            broken.writer.write = write_after_reset  # type: ignore[method-assign]

            async def resend_until_answered() -> None:
                offset = 2
                while max(m.fetch_offset for m in client.messages(FetchResponse)) < 2:
                    client.transport.send(Envelope(1, 2, fetch(offset)))
                    offset += 1
                    await asyncio.sleep(0.05)
            await asyncio.wait_for(resend_until_answered(), WAIT_S)
            assert client.transport._outbound[2] is not broken
        finally:
            await client.transport.stop()
            await server.transport.stop()
    run(scenario)



def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "refused raft connection" in r.getMessage()]


async def refused_connection(port: int, data: bytes) -> None:
    """Connect, send ``data``, wait until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if data:
        writer.write(data)
        await writer.drain()
    try:
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
    finally:
        writer.close()


def refusal_lines_of(caplog: pytest.LogCaptureFixture, config: TransportConfig,
                     body: Callable[[Node], Awaitable[None]]) -> list[str]:
    """Start node 2's transport with ``config``, run ``body`` against it, stop it; return
    the refusal warnings it logged."""
    async def scenario() -> None:
        server = Node(2, {}, config=config)
        await server.transport.start()
        try:
            await body(server)
        finally:
            await server.transport.stop()

    with caplog.at_level(logging.WARNING, logger="metakv.transport"):
        run(scenario)
    return refusal_lines(caplog)


def test_every_refusal_names_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    async def body(server: Node) -> None:
        await refused_connection(server.transport.port, b"")  # says nothing
        reader, writer = await asyncio.open_connection("127.0.0.1", server.transport.port)
        writer.write(FRAME_LENGTH.pack(100) + b"\x01\x02")  # then hangs up inside the frame
        writer.close()
        await wait_until(lambda: server.transport.stats.connections_refused == 2, "two refusals")
        await refused_connection(server.transport.port, FRAME_LENGTH.pack(3) + b"\x93\x00\x01")

    config = TransportConfig(handshake_timeout_ms=100, refusal_log_interval_ms=0)  # log every one
    lines = refusal_lines_of(caplog, config, body)
    assert len(lines) == 3
    assert all(line.startswith("node 2: refused raft connection from ('127.0.0.1', ") for line in lines)
    assert lines[0].endswith(": no handshake within 100 ms")
    assert lines[1].endswith(": peer closed the connection during the handshake (2 of 100 bytes of a frame received)")
    assert lines[2].endswith(": hello: not msgpack")


def test_refusal_warnings_are_limited_per_host_and_count_what_was_held_back(
        caplog: pytest.LogCaptureFixture) -> None:
    async def body(server: Node) -> None:
        for _ in range(50):
            await refused_connection(server.transport.port, FRAME_LENGTH.pack(3) + b"\x93\x00\x01")
        await wait_until(lambda: server.transport.stats.connections_refused == 50, "50 refusals")
        assert len(refusal_lines(caplog)) == 1
        assert server.transport.stats.refusal_warnings_suppressed == 49
        # The interval passes (the limiter's clock moves on): the next refusal logs again.
        limiter = server.transport._refusal_log
        later = limiter.clock() + 61
        limiter.clock = lambda: later
        await refused_connection(server.transport.port, b"\x00\x00\x00\x01\xc1")
        await wait_until(lambda: server.transport.stats.connections_refused == 51, "51 refusals")

    lines = refusal_lines_of(caplog, TransportConfig(refusal_log_interval_ms=60_000), body)
    assert len(lines) == 2
    assert lines[0].endswith(": hello: not msgpack")
    assert lines[1].endswith(": hello: not msgpack (49 more from 127.0.0.1 not logged since the previous line)")


def test_the_refusal_limiter_remembers_a_bounded_number_of_hosts() -> None:
    now = [0.0]
    limiter = RefusalLogLimiter(interval_s=10, max_hosts=3, clock=lambda: now[0])
    assert [limiter.admit(f"10.0.0.{n}") for n in range(5)] == [0, 0, 0, 0, 0]
    assert len(limiter) == 3  # the two oldest hosts were forgotten
    assert limiter.admit("10.0.0.4") is None and limiter.admit("10.0.0.4") is None
    assert limiter.admit("10.0.0.0") == 0  # forgotten, so it logs again at once
    now[0] = 10.0
    assert limiter.admit("10.0.0.4") == 2
