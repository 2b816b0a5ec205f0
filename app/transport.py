"""The raft transport: one TCP listener per node, length-prefixed msgpack frames.

Wire format. Every frame is ``u32 length`` (big-endian) followed by ``length`` bytes of
msgpack. With peer TLS (``PeerSecurity.tls``) the server first sends ``TLS_GREETING`` and
both ends complete a mutual TLS handshake: both ends present a certificate from the cluster's CA naming their node id
(app/tls.py); a peer without one is refused there. Then, TLS or not, a handshake proves both
ends know the cluster secret, without sending it; the client proves first, so a client that
does not know the secret learns nothing it could guess the secret from offline:

    client -> server  ["hello", PROTOCOL_VERSION, cluster_id, client_node_id, client_nonce]
    server -> client  ["challenge", cluster_id, server_node_id, server_nonce]
    client -> server  ["proof", client_mac]
    server -> client  ["welcome", server_mac]       (or at any step: ["refused", reason])

    client_mac = HMAC-SHA256(secret, b"C" | cluster_id | server_nonce | client_nonce | client_id | server_id)
    server_mac = HMAC-SHA256(secret, b"S" | cluster_id | client_nonce | server_nonce | server_id | client_id)

Identity. The node id a connection speaks for is fixed by the handshake: with TLS it must be
the id the certificate names; both MACs cover both ids, so the id cannot be changed on the
way. Only the voters and the allowed observers (``PeerSecurity.allowed_observers``) may
connect, and a message naming another sender than the connection's node id (a FetchRequest's
replica_id, a VoteRequest's candidate_id, ...) closes the connection, as does an advertised
URL (``ENDPOINT_FIELD``) that is not an http(s) URL. Without TLS anyone
holding the secret can claim any allowed id: the shared secret is for loopback clusters, and
a node listening elsewhere refuses to start with the default secret (app/config.py).

A peer with another cluster id, a wrong MAC, an id it may not use, an oversized or malformed
frame is logged and its connection closed; nothing else is affected. Refusals during the handshake are logged
with their reason (a silent peer: "no handshake within N ms") at most once per remote host
per ``refusal_log_interval_ms``; the next line counts the ones held back. After the handshake every frame is
``[kind, correlation_id, message_bytes]`` with kind 0 = request, 1 = response and
``message_bytes`` encoded by ``raft.messages.encode_message``.

Routing. The core's messages are one-way; the transport pairs them like Kafka does:
a request travels on this node's outbound connection to its destination, and many may be
in flight at once (pipelined, each with its own correlation id). A response travels back
on the connection its request arrived on, echoing the request's correlation id; when that
connection is gone it falls back to the outbound connection. Frames of either kind are
accepted on any authenticated connection: the core validates every message itself.

Nothing here blocks the caller: ``send`` queues into a per-peer queue bounded in frames and
in bytes and drops (counting the drop) when the queue is full or the peer is unreachable;
raft retries. Frames are decoded with msgpack's length limits (arrays, maps, strings, bins).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import logging
import os
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

from app.config import ConfigError, parse_url
from app.http.log_text import loggable
from app.tls import ReloadableContexts, describe_tls_failure, node_id_of
from raft.messages import (
    BeginQuorumEpochRequest,
    BeginQuorumEpochResponse,
    DescribeQuorumRequest,
    DescribeQuorumResponse,
    EndQuorumEpochRequest,
    EndQuorumEpochResponse,
    Envelope,
    FetchRequest,
    FetchResponse,
    FetchSnapshotRequest,
    FetchSnapshotResponse,
    Message,
    MessageDecodeError,
    VoteRequest,
    VoteResponse,
    decode_message,
    encode_message,
)

log = logging.getLogger("metakv.transport")

PROTOCOL_VERSION = 2  # 2: the client proves first
FRAME_LENGTH = struct.Struct(">I")
NONCE_BYTES = 16
KIND_REQUEST = 0
KIND_RESPONSE = 1

# The request type each response answers, for routing a response back to its request.
REQUEST_OF_RESPONSE: dict[type, type] = {
    VoteResponse: VoteRequest,
    BeginQuorumEpochResponse: BeginQuorumEpochRequest,
    EndQuorumEpochResponse: EndQuorumEpochRequest,
    FetchResponse: FetchRequest,
    FetchSnapshotResponse: FetchSnapshotRequest,
    DescribeQuorumResponse: DescribeQuorumRequest,
}
REQUEST_TYPES = frozenset(REQUEST_OF_RESPONSE.values())

# The field of each request naming its sender: it must be the connection's node id.
SENDER_FIELD: dict[type, str] = {
    VoteRequest: "candidate_id",
    BeginQuorumEpochRequest: "leader_id",
    EndQuorumEpochRequest: "leader_id",
    FetchRequest: "replica_id",
    FetchSnapshotRequest: "replica_id",
}
# The field of each message carrying the sender's advertised HTTP URL: clients are redirected
# there and `metakv status` asks it, so anything but an http(s) URL closes the connection.
ENDPOINT_FIELD: dict[type, str] = {
    FetchRequest: "replica_endpoint",
    BeginQuorumEpochRequest: "leader_endpoint",
    FetchResponse: "leader_endpoint",
}
HANDSHAKE_FRAME_MAX_BYTES = 4096
TLS_GREETING = b"TLS\x01"  # with peer TLS the server's first bytes: the client starts TLS on them
# msgpack limit on a raft message's strings (cluster ids, URLs; never keys or values).
MESSAGE_MAX_STR_BYTES = 64 * 1024
FRAME_OVERHEAD_BYTES = 1024 * 1024  # beyond the records of a batch: endpoints, headers
MIN_FRAME_LIMIT_BYTES = 16 * 1024 * 1024
MIN_QUEUE_BYTES = 64 * 1024 * 1024


class HandshakeError(Exception):
    """The peer failed the handshake (other cluster, wrong secret, malformed hello)."""


class FrameError(Exception):
    """A frame that is oversized or not of the expected shape."""


class WrongSenderError(Exception):
    """A message naming another sender than the node its connection authenticated as."""


@dataclass(frozen=True, slots=True)
class TransportConfig:
    max_frame_bytes: int = MIN_FRAME_LIMIT_BYTES  # frame_limit_for(max_batch_bytes) in a node
    max_queue_frames: int = 1024  # per outbound peer; beyond it new frames are dropped
    # Per queue (a peer's outbound queue, a connection's responses): a peer that stops
    # reading holds at most this much of our memory. Always room for two largest frames.
    max_queue_bytes: int = MIN_QUEUE_BYTES
    max_pending_responses: int = 64  # remembered (connection, correlation id) per peer and request type
    handshake_timeout_ms: int = 2000
    # Inbound connections still in the (TLS and secret) handshake; past it a new connection
    # is closed at once, so raw connections cannot take every descriptor for the timeout.
    max_handshaking_connections: int = 64
    connect_timeout_ms: int = 2000
    reconnect_backoff_min_ms: int = 50
    reconnect_backoff_max_ms: int = 1000
    # Refused-connection warnings: at most one line per remote host per interval (the next
    # line counts the ones held back), remembering at most refusal_log_max_hosts hosts.
    refusal_log_interval_ms: int = 10_000
    refusal_log_max_hosts: int = 1024


@dataclass
class TransportStats:
    frames_sent: int = 0
    frames_received: int = 0
    frames_dropped: int = 0
    connections_refused: int = 0
    refusal_warnings_suppressed: int = 0
    connections_closed_bad_frame: int = 0
    connections_closed_wrong_sender: int = 0
    handshakes_completed: int = 0
    connections_over_handshake_cap: int = 0  # closed at accept: max_handshaking_connections reached
    connections_replaced: int = 0  # an older inbound connection of a peer closed for its new one


def frame_limit_for(max_batch_bytes: int) -> int:
    """The frame limit a node with this max_batch_bytes needs: a FetchResponse carries up to
    max_batch_bytes of batches (one batch more when the first alone is larger), plus its
    fields. Never below the 16 MiB the transport always accepted."""
    return max(MIN_FRAME_LIMIT_BYTES, 2 * max_batch_bytes + FRAME_OVERHEAD_BYTES)


def transport_config_for(max_batch_bytes: int) -> TransportConfig:
    max_frame_bytes = frame_limit_for(max_batch_bytes)
    return TransportConfig(max_frame_bytes=max_frame_bytes,
                           max_queue_bytes=max(MIN_QUEUE_BYTES, 2 * max_frame_bytes))


@dataclass(frozen=True)
class PeerSecurity:
    """Who may connect and how they prove it. ``tls`` None: the secret handshake only (a
    loopback cluster). ``allowed_observers`` None: any id may connect (the transport alone,
    in tests); a node always passes its allow-list (app/config.py)."""

    tls: ReloadableContexts | None = None
    allowed_observers: frozenset[int] | None = None


def _mac(secret: bytes, role: bytes, cluster_id: str, first_nonce: bytes, second_nonce: bytes,
         prover_id: int, verifier_id: int) -> bytes:
    material = b"|".join([role, cluster_id.encode(), first_nonce, second_nonce,
                          str(prover_id).encode(), str(verifier_id).encode()])
    return hmac.new(secret, material, hashlib.sha256).digest()


async def _read_frame(reader: asyncio.StreamReader, max_frame_bytes: int) -> bytes:
    header = await reader.readexactly(FRAME_LENGTH.size)
    (length,) = FRAME_LENGTH.unpack(header)
    if length > max_frame_bytes:
        if header == TLS_GREETING:  # what a node without peer TLS reads from one with it
            raise FrameError("the peer uses peer TLS and this node does not: give it --peer-tls-cert-file, "
                             "--peer-tls-key-file and --peer-tls-ca-file")
        raise FrameError(f"frame of {length} bytes exceeds max_frame_bytes={max_frame_bytes}")
    return await reader.readexactly(length)


def _frame(payload: bytes) -> bytes:
    return FRAME_LENGTH.pack(len(payload)) + payload


def _unpack_list(data: bytes, what: str, max_items: int, max_bin_bytes: int) -> list[object]:
    """A msgpack list of at most ``max_items`` plain items: no maps, no extension types,
    strings and bins bounded, so a frame cannot make the decoder build more than it holds."""
    try:
        value = msgpack.unpackb(data, raw=False, max_array_len=max_items, max_map_len=0, max_ext_len=0,
                                max_str_len=MESSAGE_MAX_STR_BYTES, max_bin_len=max_bin_bytes)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise FrameError(f"{what}: {_decode_failure(exc)}") from exc
    if type(value) is not list:
        raise FrameError(f"{what}: expected a list")
    return value


def check_message_limits(body: bytes) -> None:
    """Decode once with msgpack's length limits before raft's own decoder (which sets none):
    no maps, no extension types, strings of at most MESSAGE_MAX_STR_BYTES, arrays and bins
    no longer than the body itself."""
    try:
        msgpack.unpackb(body, raw=False, max_array_len=len(body), max_map_len=0, max_ext_len=0,
                        max_str_len=MESSAGE_MAX_STR_BYTES, max_bin_len=len(body))
    except Exception as exc:  # ValueError for a limit, others for garbage
        raise FrameError(f"message body: {_decode_failure(exc)}") from exc


def _decode_failure(exc: Exception) -> str:
    """msgpack's limit errors say which limit ("5 exceeds max_array_len(3)"); garbage is garbage."""
    return f"over a msgpack limit: {exc}" if "exceeds max_" in str(exc) else "not msgpack"


def describe_refusal(exc: BaseException, handshake_timeout_ms: int) -> str:
    """Why a handshake failed, never empty: ``str(TimeoutError())`` is ``""``."""
    tls_failure = describe_tls_failure(exc)
    if tls_failure is not None:
        return tls_failure
    if isinstance(exc, TimeoutError):
        return f"no handshake within {handshake_timeout_ms} ms"
    if isinstance(exc, asyncio.IncompleteReadError):
        return (f"peer closed the connection during the handshake ({len(exc.partial)} of "
                f"{exc.expected} bytes of a frame received)")
    if isinstance(exc, OSError):
        return f"socket error during the handshake: {exc.strerror or exc!r}"
    return str(exc) or repr(exc)


class RefusalLogLimiter:
    """Decides which refused-connection warnings get a log line.

    Anyone who can reach the raft port can open connections; one warning line each would let
    a scanner or a misconfigured peer flood the log. At most one line per remote host per
    ``interval_s``; the next line says how many were held back. Hosts are remembered in an
    LRU of at most ``max_hosts`` entries (the named bound), so a spray from many addresses
    cannot grow memory; a forgotten host simply logs again.
    """

    def __init__(self, interval_s: float, max_hosts: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.max_hosts = max_hosts
        self.clock = clock
        # host -> (time of its last logged line, refusals held back since)
        self._hosts: collections.OrderedDict[str, tuple[float, int]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._hosts)

    def admit(self, host: str) -> int | None:
        """None: hold this line back; else log it, with this many held back since the last one."""
        now = self.clock()
        last = self._hosts.get(host)
        if last is not None and now - last[0] < self.interval_s:
            self._hosts[host] = (last[0], last[1] + 1)
            self._hosts.move_to_end(host)
            return None
        self._hosts[host] = (now, 0)
        self._hosts.move_to_end(host)
        while len(self._hosts) > self.max_hosts:
            self._hosts.popitem(last=False)
        return last[1] if last is not None else 0


@dataclass(eq=False)
class _Connection:
    """One authenticated connection, inbound or outbound."""

    peer_id: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    queue: asyncio.Queue[bytes] = field(default_factory=lambda: asyncio.Queue())
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)  # set on enqueue and on close
    closed: bool = False
    queued_bytes: int = 0
    checked_endpoint: str = ""  # the last advertised URL found valid (checked once, not per fetch)
    awaiting_tls_greeting: bool = False  # a timeout now means the peer has no peer TLS

    def enqueue(self, frame: bytes, max_frames: int, max_bytes: int) -> bool:
        if self.closed or self.queue.qsize() >= max_frames or self.queued_bytes + len(frame) > max_bytes:
            return False
        self.queue.put_nowait(frame)
        self.queued_bytes += len(frame)
        self.wakeup.set()
        return True

    def take_all(self) -> list[bytes]:
        """Every queued frame, oldest first, emptying the queue."""
        frames: list[bytes] = []
        while not self.queue.empty():
            frames.append(self.queue.get_nowait())
        self.queued_bytes = 0
        return frames

    def mark_closed(self) -> None:
        self.closed = True
        self.wakeup.set()


class RaftTransport:
    """Carries ``Envelope``s between nodes. ``on_message`` is called on the event loop for
    every message received from an authenticated peer."""

    def __init__(
        self,
        node_id: int,
        cluster_id: str,
        secret: bytes,
        listen_host: str,
        listen_port: int,
        peers: dict[int, tuple[str, int]],
        on_message: Callable[[Envelope], None],
        config: TransportConfig | None = None,
        security: PeerSecurity | None = None,
        voters: frozenset[int] | None = None,
    ) -> None:
        """``voters``: every voter id (default: this node and ``peers``); with
        ``security.allowed_observers`` they are the ids that may connect."""
        self.node_id = node_id
        self.cluster_id = cluster_id
        self._secret = secret
        self._listen = (listen_host, listen_port)
        self._peers = dict(peers)
        self.security = security or PeerSecurity()
        self._voters = voters if voters is not None else frozenset(peers) | {node_id}
        self._on_message = on_message
        self.config = config or TransportConfig()
        self.stats = TransportStats()
        self._server: asyncio.AbstractServer | None = None
        self._outbound: dict[int, _Connection] = {}
        self._outbound_tasks: dict[int, asyncio.Task[None]] = {}
        self._outbound_queues: dict[int, collections.deque[bytes]] = {}
        self._outbound_bytes: dict[int, int] = {}
        self._outbound_wakeups: dict[int, asyncio.Event] = {}
        self._inbound: dict[int, _Connection] = {}  # the one authenticated inbound connection per peer
        self._handshaking = 0  # inbound connections accepted and not yet authenticated or refused
        self._pending_responses: dict[tuple[int, type], collections.deque[tuple[_Connection, int]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_correlation_id = 1
        self._random = random.Random(os.urandom(8))
        self._stopping = False
        self._refusal_log = RefusalLogLimiter(self.config.refusal_log_interval_ms / 1000,
                                              self.config.refusal_log_max_hosts)

    @property
    def port(self) -> int:
        """The bound listening port (useful when listen_port was 0)."""
        if self._server is None or not self._server.sockets:
            return self._listen[1]
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self._listen[0], self._listen[1])
        for peer_id in self._peers:
            if peer_id != self.node_id:
                self._start_outbound(peer_id)

    async def stop(self) -> None:
        self._stopping = True
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks) + list(self._outbound_tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def add_peer(self, peer_id: int, host: str, port: int) -> None:
        """A voter learned from the log (KIP-853): dial it, and let it connect, like a
        configured one."""
        if peer_id != self.node_id and self._peers.get(peer_id) != (host, port):
            self._peers[peer_id] = (host, port)
            self._voters = self._voters | {peer_id}

    # -- sending ------------------------------------------------------------

    def send(self, envelope: Envelope) -> None:
        """Queue ``envelope`` for its destination; never blocks, drops when it cannot send."""
        message = envelope.message
        if type(message) in REQUEST_TYPES:
            self._send_request(envelope.dst, message)
        else:
            self._send_response(envelope.dst, message)

    def _send_request(self, dst: int, message: Message) -> None:
        correlation_id = self._next_correlation_id
        self._next_correlation_id += 1
        frame = _frame(msgpack.packb([KIND_REQUEST, correlation_id, encode_message(message)], use_bin_type=True))
        self._enqueue_outbound(dst, frame)

    def _send_response(self, dst: int, message: Message) -> None:
        pending = self._pending_responses.get((dst, REQUEST_OF_RESPONSE[type(message)]))
        while pending:
            connection, correlation_id = pending.popleft()
            if connection.closed:
                continue
            frame = _frame(msgpack.packb([KIND_RESPONSE, correlation_id, encode_message(message)], use_bin_type=True))
            if connection.enqueue(frame, self.config.max_queue_frames, self.config.max_queue_bytes):
                self.stats.frames_sent += 1
            else:
                self.stats.frames_dropped += 1
            return
        # The request's connection is gone: fall back to our own connection to the peer.
        frame = _frame(msgpack.packb([KIND_RESPONSE, 0, encode_message(message)], use_bin_type=True))
        self._enqueue_outbound(dst, frame)

    def _enqueue_outbound(self, dst: int, frame: bytes) -> None:
        if dst not in self._peers or dst == self.node_id:
            self.stats.frames_dropped += 1
            return
        queue = self._outbound_queues.setdefault(dst, collections.deque())
        queued_bytes = self._outbound_bytes.get(dst, 0)
        if len(queue) >= self.config.max_queue_frames or queued_bytes + len(frame) > self.config.max_queue_bytes:
            self.stats.frames_dropped += 1
            return
        queue.append(frame)
        self._outbound_bytes[dst] = queued_bytes + len(frame)
        self._outbound_wakeups.setdefault(dst, asyncio.Event()).set()
        task = self._outbound_tasks.get(dst)
        if (task is None or task.done()) and not self._stopping:
            self._start_outbound(dst)

    # -- outbound connections ---------------------------------------------

    def _start_outbound(self, peer_id: int) -> None:
        self._outbound_queues.setdefault(peer_id, collections.deque())
        self._outbound_wakeups.setdefault(peer_id, asyncio.Event())
        self._outbound_tasks[peer_id] = asyncio.get_running_loop().create_task(self._run_outbound(peer_id))

    async def _run_outbound(self, peer_id: int) -> None:
        backoff_ms = self.config.reconnect_backoff_min_ms
        while not self._stopping:
            host, port = self._peers[peer_id]
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), self.config.connect_timeout_ms / 1000
                )
            except (TimeoutError, OSError):
                await self._sleep_backoff(peer_id, backoff_ms)
                backoff_ms = min(backoff_ms * 2, self.config.reconnect_backoff_max_ms)
                continue
            connection = _Connection(peer_id, reader, writer, wakeup=self._outbound_wakeups[peer_id])
            try:
                await asyncio.wait_for(self._client_tls_and_handshake(connection),
                                       self.config.handshake_timeout_ms / 1000)
            except (TimeoutError, HandshakeError, FrameError, OSError, RuntimeError, asyncio.IncompleteReadError) as exc:
                if isinstance(exc, TimeoutError) and connection.awaiting_tls_greeting:
                    exc = HandshakeError(f"no TLS greeting within {self.config.handshake_timeout_ms} ms: the peer has "
                                         "no peer TLS (--peer-tls-*) or is not a metakv raft port")
                self.stats.connections_refused += 1
                self._warn_refusal(f"peer {peer_id}", f"handshake with peer {peer_id} at {host}:{port} failed", exc)
                await self._close(connection)
                await self._sleep_backoff(peer_id, backoff_ms)
                backoff_ms = min(backoff_ms * 2, self.config.reconnect_backoff_max_ms)
                continue
            backoff_ms = self.config.reconnect_backoff_min_ms
            self._outbound[peer_id] = connection
            reader_task = asyncio.get_running_loop().create_task(self._read_loop(connection))
            try:
                await self._drain_outbound(peer_id, connection)
            except (OSError, RuntimeError) as exc:
                # uvloop raises RuntimeError, not OSError, when writing to a connection a
                # reset already closed; either way: drop this connection and reconnect.
                log.info("node %d: connection to peer %d lost: %r", self.node_id, peer_id, exc)
            finally:
                reader_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader_task
                self._outbound.pop(peer_id, None)
                await self._close(connection)

    async def _sleep_backoff(self, peer_id: int, backoff_ms: int) -> None:
        jittered_ms = backoff_ms * (0.5 + self._random.random() / 2)
        await asyncio.sleep(jittered_ms / 1000)
        # Frames queued while the peer was unreachable are stale for raft; keep only a few.
        queue = self._outbound_queues[peer_id]
        while len(queue) > self.config.max_queue_frames // 4:
            self._outbound_bytes[peer_id] -= len(queue.popleft())
            self.stats.frames_dropped += 1

    async def _drain_outbound(self, peer_id: int, connection: _Connection) -> None:
        """Everything queued for the peer goes out in one socket write per wake-up: the
        frames one loop turn produced (a Ready's messages, responses routed onto this
        connection) share a syscall. The connection's wakeup is the peer's queue wakeup,
        so one Event wait covers both queues and the close."""
        queue = self._outbound_queues[peer_id]
        wakeup = connection.wakeup
        while not connection.closed:
            # Responses routed onto this connection and our own requests share the socket.
            frames = connection.take_all()
            self.stats.frames_sent += len(queue)
            frames.extend(queue)
            queue.clear()
            self._outbound_bytes[peer_id] = 0
            if frames:
                connection.writer.write(b"".join(frames))
                await connection.writer.drain()
            wakeup.clear()
            if queue or not connection.queue.empty() or connection.closed:
                continue
            await wakeup.wait()

    async def _client_tls_and_handshake(self, connection: _Connection) -> None:
        tls = self.security.tls
        if tls is not None:
            connection.awaiting_tls_greeting = True
            greeting = await connection.reader.readexactly(len(TLS_GREETING))
            connection.awaiting_tls_greeting = False
            if greeting != TLS_GREETING:
                raise HandshakeError("the peer does not speak TLS on its raft port")
            await connection.writer.start_tls(tls.client)
            certified = node_id_of(connection.writer.get_extra_info("peercert"))
            if certified != connection.peer_id:
                raise HandshakeError(f"the peer's certificate names node {certified}, not {connection.peer_id}")
        await self._client_handshake(connection)

    async def _read_handshake_frame(self, connection: _Connection, what: str, items: int) -> list[object]:
        frame = await _read_frame(connection.reader, HANDSHAKE_FRAME_MAX_BYTES)
        value = _unpack_list(frame, what, items, HANDSHAKE_FRAME_MAX_BYTES)
        if len(value) == 2 and value[0] == "refused" and type(value[1]) is str:
            # The reason is the peer's text (whoever listens where we dial): it cannot start a line.
            raise HandshakeError(f"the peer refused the handshake: {loggable(value[1][:200])}")
        if len(value) != items or value[0] != what:
            raise HandshakeError(f"malformed {what}")
        return value

    async def _write_handshake_frame(self, connection: _Connection, value: list[object]) -> None:
        connection.writer.write(_frame(msgpack.packb(value, use_bin_type=True)))
        await connection.writer.drain()

    async def _client_handshake(self, connection: _Connection) -> None:
        client_nonce = os.urandom(NONCE_BYTES)
        await self._write_handshake_frame(
            connection, ["hello", PROTOCOL_VERSION, self.cluster_id, self.node_id, client_nonce])
        _, cluster_id, server_id, server_nonce = await self._read_handshake_frame(connection, "challenge", 4)
        if cluster_id != self.cluster_id:
            raise HandshakeError(f"peer belongs to cluster {cluster_id!r}, not {self.cluster_id!r}")
        if server_id != connection.peer_id:
            raise HandshakeError(f"peer answered as node {server_id!r}, expected {connection.peer_id}")
        if type(server_nonce) is not bytes or len(server_nonce) != NONCE_BYTES:
            raise HandshakeError("malformed challenge")
        proof = _mac(self._secret, b"C", self.cluster_id, server_nonce, client_nonce, self.node_id, server_id)
        await self._write_handshake_frame(connection, ["proof", proof])
        _, server_mac = await self._read_handshake_frame(connection, "welcome", 2)
        expected = _mac(self._secret, b"S", self.cluster_id, client_nonce, server_nonce, server_id, self.node_id)
        if type(server_mac) is not bytes or not hmac.compare_digest(expected, server_mac):
            raise HandshakeError("peer does not know the cluster secret")
        self.stats.handshakes_completed += 1

    # -- inbound connections ------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        peer = writer.get_extra_info("peername")
        connection = _Connection(-1, reader, writer)
        try:
            if self._handshaking >= self.config.max_handshaking_connections:
                self.stats.connections_over_handshake_cap += 1
                self._warn_refusal("handshake cap", f"closed raft connection from {peer} at once", HandshakeError(
                    f"{self._handshaking} connections already in the handshake (max_handshaking_connections)"))
                writer.transport.abort()  # nothing to say: it has not even sent a hello
                return
            await self._serve_inbound(connection, peer)
        except asyncio.CancelledError:
            pass  # stop(): asyncio's stream callback would log a cancelled handler as an error
        finally:
            await self._close(connection)
            if self._inbound.get(connection.peer_id) is connection:
                del self._inbound[connection.peer_id]
            if task is not None:
                self._tasks.discard(task)

    async def _serve_inbound(self, connection: _Connection, peer: object) -> None:
        try:
            self._handshaking += 1
            try:
                await asyncio.wait_for(self._server_tls_and_handshake(connection),
                                       self.config.handshake_timeout_ms / 1000)
            except (TimeoutError, HandshakeError, FrameError, asyncio.IncompleteReadError, OSError,
                    RuntimeError) as exc:
                if isinstance(exc, HandshakeError):  # tell the other side why (its operator reads its log)
                    with contextlib.suppress(Exception):
                        connection.writer.write(_frame(msgpack.packb(["refused", str(exc)], use_bin_type=True)))
                self.stats.connections_refused += 1
                host = peer[0] if isinstance(peer, tuple) and peer else str(peer)
                self._warn_refusal(str(host), f"refused raft connection from {peer}", exc)
                return
            finally:
                self._handshaking -= 1
            self._replace_inbound(connection)
            writer_task = asyncio.get_running_loop().create_task(self._write_loop(connection))
            try:
                await self._read_loop(connection)
            finally:
                writer_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await writer_task
        finally:
            connection.mark_closed()

    def _replace_inbound(self, connection: _Connection) -> None:
        """One authenticated inbound connection per peer: a peer dials us on one outbound
        connection and dials again only once it lost that one, so an older connection is dead
        or a duplicate (each holding a response queue of up to max_queue_bytes): close it."""
        older = self._inbound.get(connection.peer_id)
        self._inbound[connection.peer_id] = connection
        if older is None or older.closed:
            return
        self.stats.connections_replaced += 1
        held_back = self._refusal_log.admit(f"node {connection.peer_id} replaced")  # two nodes with one id: a loop
        if held_back is not None:
            log.info("node %d: node %d connected again: closing its older raft connection (%d more since the "
                     "previous line)", self.node_id, connection.peer_id, held_back)
        older.mark_closed()
        older.writer.transport.abort()  # not close(): a peer that stopped reading would keep its buffer

    def _warn_refusal(self, source: str, what: str, exc: BaseException) -> None:
        """Rate-limited per ``source``: a remote host for inbound refusals, the peer for
        outbound handshakes (so peers on one host do not hide each other's failures)."""
        held_back = self._refusal_log.admit(source)
        if held_back is None:
            self.stats.refusal_warnings_suppressed += 1
            return
        reason = describe_refusal(exc, self.config.handshake_timeout_ms)
        suffix = f" ({held_back} more from {source} not logged since the previous line)" if held_back else ""
        log.warning("node %d: %s: %s%s", self.node_id, what, reason, suffix)

    async def _server_tls_and_handshake(self, connection: _Connection) -> None:
        certified: int | None = None
        tls = self.security.tls
        if tls is not None:
            # TLS per connection, not on the listener: each handshake uses the contexts in
            # force (a SIGHUP reload), the handshake timeout covers TLS too, and a failed
            # one is logged here with its reason. The client starts TLS only on our greeting,
            # so no byte of its ClientHello can land in the plain stream's buffer.
            connection.writer.write(TLS_GREETING)
            await connection.writer.start_tls(tls.server)
            certified = node_id_of(connection.writer.get_extra_info("peercert"))
            if certified is None:
                raise HandshakeError("the peer's certificate names no node id (CN or DNS name node-<id>)")
        await self._server_handshake(connection, certified)

    def _may_connect(self, client_id: int) -> str:
        """Why node ``client_id`` may not connect to this node, or "" when it may."""
        if client_id == self.node_id:
            return f"node {client_id} is this node"
        allowed = self.security.allowed_observers
        if allowed is None or client_id in self._voters or client_id in allowed:
            return ""
        return f"node {client_id} is neither a voter nor an allowed observer (--allowed-observers)"

    async def _server_handshake(self, connection: _Connection, certified: int | None) -> None:
        hello = await self._read_handshake_frame(connection, "hello", 5)
        _, version, cluster_id, client_id, client_nonce = hello
        if version != PROTOCOL_VERSION:
            raise HandshakeError(f"protocol version {version!r}, this node speaks {PROTOCOL_VERSION}")
        if cluster_id != self.cluster_id:
            raise HandshakeError(f"peer belongs to cluster {cluster_id!r}, not {self.cluster_id!r}")
        if type(client_id) is not int or type(client_nonce) is not bytes or len(client_nonce) != NONCE_BYTES:
            raise HandshakeError("malformed hello")
        if certified is not None and client_id != certified:
            raise HandshakeError(f"peer claims node {client_id} but its certificate names node {certified}")
        refusal = self._may_connect(client_id)
        if refusal:
            raise HandshakeError(refusal)
        server_nonce = os.urandom(NONCE_BYTES)
        await self._write_handshake_frame(connection, ["challenge", self.cluster_id, self.node_id, server_nonce])
        _, proof = await self._read_handshake_frame(connection, "proof", 2)
        expected = _mac(self._secret, b"C", self.cluster_id, server_nonce, client_nonce, client_id, self.node_id)
        if type(proof) is not bytes or not hmac.compare_digest(expected, proof):
            raise HandshakeError(f"node {client_id} does not know the cluster secret")
        server_mac = _mac(self._secret, b"S", self.cluster_id, client_nonce, server_nonce, self.node_id, client_id)
        await self._write_handshake_frame(connection, ["welcome", server_mac])
        connection.peer_id = client_id
        self.stats.handshakes_completed += 1

    async def _write_loop(self, connection: _Connection) -> None:
        try:
            while not connection.closed:
                first = await connection.queue.get()
                connection.queued_bytes -= len(first)
                frames = [first, *connection.take_all()]
                connection.writer.write(b"".join(frames))  # one syscall for a loop turn's frames
                await connection.writer.drain()
        except (OSError, RuntimeError) as exc:  # RuntimeError: uvloop, after a reset
            log.info("node %d: connection from node %d lost: %r", self.node_id, connection.peer_id, exc)
            connection.mark_closed()
            connection.writer.close()

    async def _read_loop(self, connection: _Connection) -> None:
        """Read frames until the peer closes or misbehaves; a bad frame closes this connection only."""
        try:
            while True:
                payload = await _read_frame(connection.reader, self.config.max_frame_bytes)
                self._deliver(connection, payload)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except (FrameError, MessageDecodeError) as exc:
            self.stats.connections_closed_bad_frame += 1
            log.warning("node %d: closing raft connection from node %d: %s", self.node_id, connection.peer_id, exc)
        except WrongSenderError as exc:
            self.stats.connections_closed_wrong_sender += 1
            self._warn_refusal(f"node {connection.peer_id}", f"closing raft connection from node {connection.peer_id}",
                               exc)
        finally:
            connection.mark_closed()

    def _deliver(self, connection: _Connection, payload: bytes) -> None:
        frame = _unpack_list(payload, "frame", 3, self.config.max_frame_bytes)
        if len(frame) != 3 or frame[0] not in (KIND_REQUEST, KIND_RESPONSE) or type(frame[1]) is not int:
            raise FrameError("malformed frame")
        if type(frame[2]) is not bytes:
            raise FrameError("malformed frame body")
        check_message_limits(frame[2])
        message = decode_message(frame[2])
        kind_matches = (type(message) in REQUEST_TYPES) == (frame[0] == KIND_REQUEST)
        if not kind_matches:
            raise FrameError(f"{type(message).__name__} sent with the wrong frame kind")
        sender_field = SENDER_FIELD.get(type(message))
        if sender_field is not None and getattr(message, sender_field) != connection.peer_id:
            raise WrongSenderError(f"{type(message).__name__}.{sender_field} = {getattr(message, sender_field)} "
                                   f"on the connection of node {connection.peer_id}")
        endpoint_field = ENDPOINT_FIELD.get(type(message))
        if endpoint_field is not None:
            endpoint = getattr(message, endpoint_field)
            if endpoint and endpoint != connection.checked_endpoint:
                try:
                    parse_url(f"{type(message).__name__}.{endpoint_field}", endpoint)
                except ConfigError as exc:
                    raise FrameError(str(exc)) from None
                connection.checked_endpoint = endpoint
        if frame[0] == KIND_REQUEST:
            pending = self._pending_responses.setdefault(
                (connection.peer_id, type(message)), collections.deque(maxlen=self.config.max_pending_responses)
            )
            pending.append((connection, frame[1]))
        self.stats.frames_received += 1
        try:
            self._on_message(Envelope(connection.peer_id, self.node_id, message))
        except Exception:  # a bug in the consumer must not take the connection down silently
            log.exception("node %d: handling %s from node %d failed", self.node_id, type(message).__name__, connection.peer_id)

    async def _close(self, connection: _Connection) -> None:
        connection.mark_closed()
        with contextlib.suppress(Exception):
            connection.writer.close()
            await asyncio.wait_for(connection.writer.wait_closed(), 1.0)
