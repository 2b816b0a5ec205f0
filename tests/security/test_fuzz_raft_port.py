"""Fuzzing the raft port (hypothesis): random bytes and mutated valid frames, in the
handshake and after it. The connection handler never lets an exception out, nothing but
well-formed messages from the authenticated node reaches the core, and against a real node
nothing it persisted changes (its quorum state file, its epoch and log) while it keeps serving."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket
from collections.abc import Callable
from pathlib import Path

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.transport import (
    FRAME_LENGTH,
    KIND_REQUEST,
    PROTOCOL_VERSION,
    PeerSecurity,
    RaftTransport,
    TransportConfig,
)
from loadtest.local_cluster import Cluster
from raft.messages import Envelope, FetchRequest, Message, VoteRequest, encode_message

CLUSTER = "fuzz"
SECRET = b"fuzz-secret"
CLIENT_ID = 4  # an allowed observer of the node under test (voter 1)


def frame(value: object) -> bytes:
    payload = msgpack.packb(value, use_bin_type=True)
    return FRAME_LENGTH.pack(len(payload)) + payload


def hello(nonce: bytes = b"n" * 16, node_id: int = CLIENT_ID) -> bytes:
    return frame(["hello", PROTOCOL_VERSION, CLUSTER, node_id, nonce])


def data_frames() -> list[bytes]:
    messages: list[Message] = [FetchRequest(1, CLIENT_ID, 0, 0, 0, 0, "http://x"),
                               VoteRequest(1, CLIENT_ID, 0, 0, True)]
    return [frame([KIND_REQUEST, index, encode_message(message)]) for index, message in enumerate(messages)]


def mutated(valid: bytes) -> st.SearchStrategy[bytes]:
    """``valid`` with bytes flipped, cut, or inserted."""
    def apply(edits: list[tuple[int, int, int]]) -> bytes:
        data = bytearray(valid)
        for kind, position, value in edits:
            position %= max(1, len(data))
            if kind == 0 and data:
                data[position] = value
            elif kind == 1:
                del data[position:]
            else:
                data[position:position] = bytes([value])
        return bytes(data)
    return st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10_000), st.integers(0, 255)),
                    min_size=1, max_size=4).map(apply)


class MemoryWriter:
    """What the handler writes, kept; the rest of StreamWriter that the handler uses."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        return None

    async def wait_closed(self) -> None:
        return None

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("198.51.100.7", 4242) if name == "peername" else default


def node_under_test(received: list[Envelope]) -> RaftTransport:
    return RaftTransport(1, CLUSTER, SECRET, "127.0.0.1", 0, {}, received.append,
                         TransportConfig(handshake_timeout_ms=200, max_frame_bytes=64 * 1024),
                         PeerSecurity(allowed_observers=frozenset({CLIENT_ID})), frozenset({1, 2, 3}))


def proof_for(challenge: bytes, client_nonce: bytes) -> bytes:
    """The client's proof for the challenge the handler wrote (the MAC in app/transport.py's docstring)."""
    (length,) = FRAME_LENGTH.unpack(challenge[:4])
    _, cluster_id, server_id, server_nonce = msgpack.unpackb(challenge[4:4 + length])
    material = b"|".join([b"C", cluster_id.encode(), server_nonce, client_nonce,
                          str(CLIENT_ID).encode(), str(server_id).encode()])
    return frame(["proof", hmac.new(SECRET, material, hashlib.sha256).digest()])


async def serve_in_memory(transport: RaftTransport, before_proof: bytes | None, after: bytes) -> MemoryWriter:
    """Run the connection handler on in-memory streams: ``before_proof`` as the whole input
    (None: a valid hello and proof, then ``after``)."""
    reader, writer = asyncio.StreamReader(), MemoryWriter()
    handler = asyncio.ensure_future(transport._accept(reader, writer))  # type: ignore[arg-type]
    if before_proof is not None:
        reader.feed_data(before_proof)
    else:
        reader.feed_data(hello())
        for _ in range(100):
            if writer.data:
                break
            await asyncio.sleep(0)
        reader.feed_data(proof_for(bytes(writer.data), b"n" * 16) + after)
    reader.feed_eof()
    await asyncio.wait_for(handler, 5)  # raises whatever the handler let out
    return writer


def run(scenario: Callable[[], object]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.one_of(st.binary(max_size=300), mutated(hello())))
def test_a_fuzzed_handshake_never_raises_and_never_authenticates(data: bytes) -> None:
    received: list[Envelope] = []
    transport = node_under_test(received)

    async def scenario() -> None:
        await serve_in_memory(transport, data, b"")

    run(scenario)
    assert received == [] and transport.stats.handshakes_completed == 0


@FUZZ
@given(st.lists(st.one_of(st.binary(max_size=200), *(mutated(valid) for valid in data_frames())), max_size=4))
def test_fuzzed_frames_after_the_handshake_never_raise_and_only_messages_get_through(frames: list[bytes]) -> None:
    received: list[Envelope] = []
    transport = node_under_test(received)

    async def scenario() -> None:
        await serve_in_memory(transport, None, b"".join(frames))

    run(scenario)
    assert transport.stats.handshakes_completed == 1
    for envelope in received:
        assert envelope.src == CLIENT_ID and isinstance(envelope.message, (FetchRequest, VoteRequest))
        assert envelope.message.replica_id == CLIENT_ID if isinstance(envelope.message, FetchRequest) \
            else envelope.message.candidate_id == CLIENT_ID


def test_fuzzing_a_real_node_changes_nothing_it_persisted(tmp_path: Path) -> None:
    """A real node (one voter): a few hundred connections of fuzzed handshakes and frames, then
    its quorum state file, epoch and log end are what they were and it still takes a write."""
    with Cluster(tmp_path / "fuzzed", voters=1, cluster_secret=SECRET.decode(), cluster_id=CLUSTER,
                 settings={"allowed_observers": CLIENT_ID}) as cluster:
        node = cluster.wait_for_leader()
        assert cluster.put("before", b"1").status_code == 200
        before = cluster.status(node)
        state_files = {path: path.read_bytes() for path in node.data_dir.glob("quorum*")}
        assert state_files
        samples: list[bytes] = []

        @settings(max_examples=200, deadline=None, database=None)
        @given(st.one_of(st.binary(max_size=300), mutated(hello(os.urandom(16), 1)),
                         mutated(hello() + data_frames()[0])))
        def collect(data: bytes) -> None:
            samples.append(data)

        collect()
        for data in samples:
            with socket.create_connection(node.raft_address, timeout=5) as connection:
                connection.sendall(data)
                connection.shutdown(socket.SHUT_WR)
                connection.settimeout(5)
                while connection.recv(4096):
                    pass
        after = cluster.status(node)
        assert {path: path.read_bytes() for path in node.data_dir.glob("quorum*")} == state_files
        assert (after["epoch"], after["applied_version"]) == (before["epoch"], before["applied_version"])
        assert cluster.put("after", b"2").status_code == 200
