"""Connection caps of the raft port, with real sockets on loopback: connections still in the
handshake are capped, and a peer holds one authenticated connection (a new one replaces it)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os

import msgpack
import pytest

from app.transport import FRAME_LENGTH, PROTOCOL_VERSION, TransportConfig
from raft.messages import Envelope, FetchRequest, FetchResponse, encode_message
from tests.transport.test_transport import SECRET, WAIT_S, Node, fetch, run, wait_until

CLUSTER = "c1"


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """True once the server closed (EOF or reset); False if it is still open after WAIT_S."""
    try:
        while await asyncio.wait_for(reader.read(65536), WAIT_S):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def test_connections_past_the_handshake_cap_are_closed_at_once_and_peers_still_connect(
        caplog: pytest.LogCaptureFixture) -> None:
    """3,000 raw connections took a node from 24 to 265 descriptors for the handshake
    timeout. Past the cap a new one is closed at once (counted, one log line), the ones
    within it wait for the timeout, and a real peer connects once they are gone."""
    cap = 4
    config = TransportConfig(max_handshaking_connections=cap, handshake_timeout_ms=1000)

    async def scenario() -> None:
        server = Node(2, {}, config=config, respond=True)
        await server.transport.start()
        silent = [await asyncio.open_connection("127.0.0.1", server.transport.port) for _ in range(cap)]
        client = Node(1, {2: ("127.0.0.1", server.transport.port)})
        try:
            await asyncio.sleep(0.2)  # the listener accepts in order: the extra ones come after these
            extra = [await asyncio.open_connection("127.0.0.1", server.transport.port) for _ in range(3)]
            for reader, _ in extra:
                assert await closed_by_server(reader)
            assert server.transport.stats.connections_over_handshake_cap == 3
            for reader, _ in silent:  # closed by the handshake timeout, not by the cap
                assert await closed_by_server(reader)
            assert server.transport.stats.connections_refused == cap
            await client.transport.start()
            client.transport.send(Envelope(1, 2, fetch(7)))
            await wait_until(lambda: client.messages(FetchResponse), "the real peer's answer")
            for _, writer in [*silent, *extra]:
                writer.close()
        finally:
            await client.transport.stop()
            await server.transport.stop()

    with caplog.at_level(logging.WARNING, logger="metakv.transport"):
        run(scenario)
    cap_lines = [r.getMessage() for r in caplog.records if "connections already in the handshake" in r.getMessage()]
    assert len(cap_lines) == 1, cap_lines  # rate-limited: one line for the three


def mac(role: bytes, first_nonce: bytes, second_nonce: bytes, prover_id: int, verifier_id: int) -> bytes:
    """The handshake MAC as app/transport.py's docstring specifies it (written out again here,
    so the test checks the wire format, not the code against itself)."""
    material = b"|".join([role, CLUSTER.encode(), first_nonce, second_nonce,
                          str(prover_id).encode(), str(verifier_id).encode()])
    return hmac.new(SECRET, material, hashlib.sha256).digest()


async def read_value(reader: asyncio.StreamReader) -> list[object]:
    header = await asyncio.wait_for(reader.readexactly(FRAME_LENGTH.size), WAIT_S)
    return msgpack.unpackb(await reader.readexactly(FRAME_LENGTH.unpack(header)[0]), raw=False)


def write_value(writer: asyncio.StreamWriter, value: list[object]) -> None:
    payload = msgpack.packb(value, use_bin_type=True)
    writer.write(FRAME_LENGTH.pack(len(payload)) + payload)


async def authenticated(port: int, client_id: int, server_id: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection that completed the handshake as ``client_id``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    client_nonce = os.urandom(16)
    write_value(writer, ["hello", PROTOCOL_VERSION, CLUSTER, client_id, client_nonce])
    _, _, _, server_nonce = await read_value(reader)
    write_value(writer, ["proof", mac(b"C", server_nonce, client_nonce, client_id, server_id)])
    welcome = await read_value(reader)
    assert welcome[0] == "welcome", welcome
    return reader, writer


def test_a_new_authenticated_connection_of_a_peer_replaces_its_older_one() -> None:
    """Each authenticated connection has its own response queue (up to max_queue_bytes), so
    one allowed peer that never reads could hold N of them. A peer's new connection now
    closes its older one; the new one is served."""
    async def scenario() -> None:
        server = Node(2, {}, respond=True)
        await server.transport.start()
        port = server.transport.port
        try:
            older_reader, older_writer = await authenticated(port, 1, 2)
            newer_reader, newer_writer = await authenticated(port, 1, 2)
            assert await closed_by_server(older_reader)
            assert server.transport.stats.connections_replaced == 1
            write_value(newer_writer, [0, 5, encode_message(fetch(9))])
            kind, correlation_id, body = await read_value(newer_reader)
            assert (kind, correlation_id) == (1, 5) and body
            assert isinstance(server.received[-1].message, FetchRequest)
            for writer in (older_writer, newer_writer):
                writer.close()
        finally:
            await server.transport.stop()

    run(scenario)


def test_peers_reconnecting_after_a_restart_still_talk() -> None:
    """The replacement must not break reconnects: a peer that restarts dials again and its
    new connection (replacing the dead one) carries requests both ways."""
    async def scenario() -> None:
        server = Node(2, {}, respond=True)
        await server.transport.start()
        address = {2: ("127.0.0.1", server.transport.port)}
        for round_ in range(3):
            client = Node(1, address)
            await client.transport.start()
            try:
                client.transport.send(Envelope(1, 2, fetch(round_)))
                await wait_until(lambda: client.messages(FetchResponse), f"the answer of round {round_}")  # noqa: B023
            finally:
                await client.transport.stop()
        await server.transport.stop()

    run(scenario)
