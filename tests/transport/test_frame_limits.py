"""Frame and queue bounds of the raft transport: the frame limit follows max_batch_bytes
(audit item 7: a batch above 16 MiB used to stall replication), queues are bounded in bytes
as well as frames (item 6), and frames are decoded within msgpack length limits."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import msgpack

from app.transport import (
    FRAME_LENGTH,
    RaftTransport,
    TransportConfig,
    frame_limit_for,
    transport_config_for,
)
from raft.messages import Envelope, FetchRequest, FetchResponse
from raft.types import Batch, ErrorCode
from tests.cluster import Cluster
from tests.transport.test_transport import Node, free_port, run, wait_until

MIB = 1024 * 1024


def response_with(record_bytes: int) -> FetchResponse:
    batch = Batch(0, 1, 0, False, (b"r" * record_bytes,))
    return FetchResponse(ErrorCode.NONE, 1, 2, "", 0, 1, 0, 0, 0, (batch,), -1, 0, None)


def test_the_frame_limit_follows_max_batch_bytes() -> None:
    assert frame_limit_for(8 * MIB) == 16 * MIB + MIB  # the default batch: twice it, plus the fields
    assert frame_limit_for(1 * MIB) == 16 * MIB  # never below what the transport always took
    assert frame_limit_for(24 * MIB) > 2 * 24 * MIB
    assert transport_config_for(24 * MIB).max_queue_bytes >= 2 * frame_limit_for(24 * MIB)


@contextlib.asynccontextmanager
async def client_and_server(config: TransportConfig | None = None, respond: bool = False) -> AsyncIterator[tuple[Node, Node]]:
    """Node 2 listening, node 1 dialling it; both stopped afterwards."""
    server = Node(2, {}, config=config, respond=respond)
    await server.transport.start()
    client = Node(1, {2: ("127.0.0.1", server.transport.port)}, config=config)
    await client.transport.start()
    try:
        yield client, server
    finally:
        for node in (client, server):
            await node.transport.stop()


def test_a_fetch_response_above_16_mib_arrives_with_the_limit_of_its_batch_size() -> None:
    async def scenario() -> None:
        async with client_and_server(transport_config_for(24 * MIB)) as (client, server):
            client.transport.send(Envelope(1, 2, response_with(20 * MIB)))
            await wait_until(lambda: len(server.messages(FetchResponse)) == 1, "the 20 MiB response")
            assert server.transport.stats.connections_closed_bad_frame == 0
    run(scenario)


def test_a_peer_that_cannot_take_frames_holds_a_bounded_number_of_bytes() -> None:
    async def scenario() -> None:
        config = TransportConfig(max_queue_bytes=MIB)
        transport = RaftTransport(1, "c1", b"s", "127.0.0.1", 0, {2: ("127.0.0.1", free_port())},
                                  lambda envelope: None, config)
        await transport.start()
        try:
            for _ in range(10):  # 300 KiB each; nobody listens on the peer's port
                transport.send(Envelope(1, 2, response_with(300 * 1024)))
            assert transport.stats.frames_dropped == 7  # three fit in 1 MiB
        finally:
            await transport.stop()
    run(scenario)


def send_raw(node: Node, payload: bytes) -> Callable[[], None]:
    def send() -> None:
        node.transport._outbound[2].writer.write(FRAME_LENGTH.pack(len(payload)) + payload)
    return send


def test_frames_beyond_msgpack_limits_close_the_connection_only() -> None:
    async def scenario() -> None:
        async with client_and_server(respond=True) as (client, server):
            client.transport.send(Envelope(1, 2, FetchRequest(1, 1, 0, 0, 0, 500, "")))
            await wait_until(lambda: len(client.messages(FetchResponse)) == 1, "first response")
            bad_bodies = [
                msgpack.packb([7, {"a": 1}]),  # a map inside a message
                msgpack.packb([7, "x" * (128 * 1024)]),  # a string longer than any id or URL
                msgpack.packb([7, msgpack.ExtType(1, b"x")]),  # an extension type
            ]
            used: list[object] = []  # the server closed each: the client may not have seen it yet
            for closed, body in enumerate(bad_bodies, 1):
                await wait_until(lambda: (connection := client.transport._outbound.get(2)) is not None
                                 and not connection.closed and connection not in used, "a new connection")
                used.append(client.transport._outbound[2])
                send_raw(client, msgpack.packb([0, 99, body], use_bin_type=True))()
                await wait_until(lambda c=closed: server.transport.stats.connections_closed_bad_frame == c, "a close")
            client.transport.send(Envelope(1, 2, FetchRequest(1, 1, 5, 0, 0, 500, "")))
            await wait_until(lambda: len(client.messages(FetchResponse)) == 2, "served after reconnecting")
    run(scenario)


def test_a_cluster_with_batches_above_16_mib_replicates_them(cluster_factory: Callable[..., Cluster]) -> None:
    """Audit item 7 with real processes: a 17 MiB value (max_batch_bytes 24 MiB) used to
    stall, the follower closing the connection on every FetchResponse, the write timing out."""
    cluster = cluster_factory(voters=2, settings={"max_batch_bytes": 24 * MIB, "max_value_bytes": 20 * MIB})
    leader = cluster.wait_for_leader()
    value = bytes(range(256)) * (17 * MIB // 256)
    assert cluster.put("big", value, timeout_s=30).status_code == 200
    follower = next(node for node in cluster.voters if node.node_id != leader.node_id)
    read = cluster.client().get(f"{follower.url}/v1/kv/big", params={"consistency": "local"}, timeout=30)
    assert read.status_code == 200 and read.content == value
