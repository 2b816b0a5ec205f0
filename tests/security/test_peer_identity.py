"""The raft port's handshake and identity rules, between real sockets on loopback (audit
items 1, 5 and the forged sender of a Fetch), and peer mutual TLS refusing certificates
from another CA, expired ones, none, and one naming another node."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable

import msgpack
import pytest

from app.config import DEFAULT_CLUSTER_SECRET
from app.tls import ReloadableContexts
from app.transport import (
    FRAME_LENGTH,
    PROTOCOL_VERSION,
    PeerSecurity,
    RaftTransport,
    TransportConfig,
)
from raft.messages import Envelope, FetchRequest, FetchResponse, Message, VoteRequest
from raft.types import Batch, ErrorCode
from tests.security.certs_fixture import CertSet
from tests.transport.test_transport import run, wait_until

WAIT_S = 10.0  # for a raw socket's answer
CLUSTER = "c1"
SECRET = DEFAULT_CLUSTER_SECRET.encode()
LOG = (Batch(0, 1, 0, False, (b"secret-key=secret-value",)),)


class Peer:
    """A transport answering every Fetch with the whole log, and what it received."""

    def __init__(self, node_id: int, peers: dict[int, tuple[str, int]], **kwargs: object) -> None:
        self.received: list[Envelope] = []
        self.transport = RaftTransport(node_id, CLUSTER, SECRET, "127.0.0.1", 0, peers, self._on_message,
                                       **kwargs)  # type: ignore[arg-type]

    def _on_message(self, envelope: Envelope) -> None:
        self.received.append(envelope)
        if isinstance(envelope.message, FetchRequest):
            self.transport.send(Envelope(self.transport.node_id, envelope.src, FetchResponse(
                ErrorCode.NONE, 1, self.transport.node_id, "", 0, 1, 0, 0, 0, LOG, -1, 0, None)))

    def of_type(self, kind: type) -> list[object]:
        return [envelope.message for envelope in self.received if isinstance(envelope.message, kind)]


async def one_answered_one_refused(node: Peer, member: Peer, stranger: Peer) -> None:
    """Both fetch from ``node`` (started): ``member`` is answered; ``stranger`` is refused at
    the handshake and gets nothing. Stops all three."""
    for peer in (member, stranger):
        await peer.transport.start()
    try:
        for peer in (stranger, member):
            peer_id = peer.transport.node_id
            peer.transport.send(Envelope(peer_id, node.transport.node_id, FetchRequest(1, peer_id, 0, 0, 0, 0, "")))
        await wait_until(lambda: member.of_type(FetchResponse), "the member's answer")
        await wait_until(lambda: node.transport.stats.connections_refused >= 1, "the refusal")
        await asyncio.sleep(0.3)
        assert stranger.received == []
        assert {envelope.src for envelope in node.received} == {member.transport.node_id}
    finally:
        for peer in (stranger, member, node):
            await peer.transport.stop()


def voter_node(**security: object) -> Peer:
    """Voter 1 of the voters {1, 2, 3}, letting observer 4 connect."""
    return Peer(1, {}, voters=frozenset({1, 2, 3}),
                security=PeerSecurity(allowed_observers=frozenset({4}), **security))  # type: ignore[arg-type]


def test_a_made_up_observer_with_the_default_secret_gets_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Audit item 1: an observer id nobody configured, holding the public default secret,
    sent one Fetch and received the whole log. Now it is refused at the handshake, logged."""
    async def scenario() -> None:
        node = voter_node()
        await node.transport.start()
        address = {1: ("127.0.0.1", node.transport.port)}
        await one_answered_one_refused(node, member=Peer(4, address), stranger=Peer(99, address))

    with caplog.at_level(logging.WARNING, logger="metakv.transport"):
        run(scenario)
    assert "node 99 is neither a voter nor an allowed observer" in caplog.text


def read_frame(data: bytes) -> list[object]:
    (length,) = FRAME_LENGTH.unpack(data[:4])
    return msgpack.unpackb(data[4:4 + length], raw=False)


def test_the_server_proves_nothing_before_the_client_has(caplog: pytest.LogCaptureFixture) -> None:
    """Audit item 5: the server answered a hello with an HMAC of the secret, so anyone could
    collect one and guess a weak secret offline. Now the first answer holds no MAC at all
    (nothing of HMAC-SHA256's 32 bytes), and a wrong proof gets a refusal, never a MAC."""
    async def scenario() -> None:
        node = voter_node()
        await node.transport.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", node.transport.port)
            hello = msgpack.packb(["hello", PROTOCOL_VERSION, CLUSTER, 2, os.urandom(16)], use_bin_type=True)
            writer.write(FRAME_LENGTH.pack(len(hello)) + hello)
            header = await asyncio.wait_for(reader.readexactly(4), WAIT_S)
            challenge = read_frame(header + await reader.readexactly(FRAME_LENGTH.unpack(header)[0]))
            assert not [item for item in challenge if isinstance(item, bytes) and len(item) >= 32], challenge
            proof = msgpack.packb(["proof", os.urandom(32)], use_bin_type=True)
            writer.write(FRAME_LENGTH.pack(len(proof)) + proof)
            rest = await asyncio.wait_for(reader.read(), WAIT_S)  # until the server closes
            answer = read_frame(rest)
            assert answer[0] == "refused" and "does not know the cluster secret" in str(answer[1])
            assert len(rest) == 4 + FRAME_LENGTH.unpack(rest[:4])[0]  # nothing after the refusal
            writer.close()
        finally:
            await node.transport.stop()
    run(scenario)


def cut_off_then_served(peer_id: int, bad: list[Message], closes: Callable[[RaftTransport], bool],
                        good: Message) -> list[Envelope]:
    """Peer ``peer_id`` sends ``bad`` to voter 1 until ``closes(voter's transport)``, then,
    reconnected, ``good``, which is answered; returns what the voter received."""
    node = voter_node()

    async def scenario() -> None:
        await node.transport.start()
        peer = Peer(peer_id, {1: ("127.0.0.1", node.transport.port)})
        await peer.transport.start()
        try:
            for message in bad:
                peer.transport.send(Envelope(peer_id, 1, message))
            await wait_until(lambda: closes(node.transport), "the connection closed")
            peer.transport.send(Envelope(peer_id, 1, good))
            await wait_until(lambda: peer.of_type(FetchResponse), "the good message answered")
        finally:
            await peer.transport.stop()
            await node.transport.stop()

    run(scenario)
    return node.received


def test_a_message_naming_another_sender_closes_the_connection(caplog: pytest.LogCaptureFixture) -> None:
    """A voter's Fetch counts towards the high watermark only over that voter's own
    connection: voter 3 claiming to be voter 2 is cut off, and the claim never arrives."""
    with caplog.at_level(logging.WARNING, logger="metakv.transport"):
        received = cut_off_then_served(
            3, [FetchRequest(1, 2, 0, 0, 0, 0, ""), VoteRequest(2, 2, 0, 0, False)],
            lambda transport: transport.stats.connections_closed_wrong_sender >= 1, FetchRequest(1, 3, 0, 0, 0, 0, ""))
    assert [(e.src, e.message.replica_id) for e in received] == [(3, 3)]  # type: ignore[attr-defined]
    assert "FetchRequest.replica_id = 2 on the connection of node 3" in caplog.text


def test_an_advertised_endpoint_that_is_not_an_http_url_closes_the_connection(
        caplog: pytest.LogCaptureFixture) -> None:
    """Clients are redirected to the URL a node advertises and `metakv status` asks it: an
    observer reporting anything but an http(s) URL is cut off before the core stores it."""
    with caplog.at_level(logging.WARNING, logger="metakv.transport"):
        received = cut_off_then_served(
            4, [FetchRequest(1, 4, 0, 0, 0, 0, "javascript:alert(1)")],
            lambda transport: transport.stats.connections_closed_bad_frame >= 1,
            FetchRequest(1, 4, 0, 0, 0, 0, "https://observer.example:8004"))
    assert [e.message.replica_endpoint for e in received] == ["https://observer.example:8004"]  # type: ignore[attr-defined]
    assert "FetchRequest.replica_endpoint: expected an http:// or https:// URL" in caplog.text


def tls(certs: CertSet, node_id: int, kind: str = "") -> ReloadableContexts:
    return ReloadableContexts(certs.node(node_id, kind))


@pytest.mark.parametrize(("who", "reason"), [
    ("other-ca", "the certificate was refused: unable to get local issuer certificate"),
    ("expired", "the certificate was refused: certificate has expired"),
    ("no-certificate", "TLS: the peer sent no certificate"),
    ("wrong-node", "its certificate names node 3"),
])
def test_peer_tls_refuses_what_the_cluster_ca_did_not_issue_to_that_node(
        certs: CertSet, who: str, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        node = voter_node(tls=tls(certs, 1))
        await node.transport.start()
        address = {1: ("127.0.0.1", node.transport.port)}
        member = Peer(2, address, security=PeerSecurity(tls=tls(certs, 2)))
        if who == "no-certificate":
            # TLS towards the node, trusting its CA, but presenting no certificate.
            bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            bare.check_hostname = False
            bare.load_verify_locations(certs.ca)
            contexts = tls(certs, 4)
            contexts.client = bare
            stranger = Peer(4, address, security=PeerSecurity(tls=contexts))
        elif who == "wrong-node":
            stranger = Peer(4, address, security=PeerSecurity(tls=tls(certs, 3)))  # node 3's certificate
        else:
            stranger = Peer(4, address, security=PeerSecurity(tls=tls(certs, 4, who)))
        await one_answered_one_refused(node, member, stranger)

    with caplog.at_level(logging.WARNING, logger="metakv.transport"):
        run(scenario)
    refusals = [r.getMessage() for r in caplog.records if "node 1: refused raft connection" in r.getMessage()]
    assert refusals and reason in refusals[0], caplog.text


def test_a_real_node_refuses_a_made_up_observer_holding_the_default_secret(
        cluster_factory: Callable[..., object]) -> None:
    """Audit item 1 against a `metakv serve` process on the built-in secret: a write, then an
    intruder claiming observer id 99 fetches from offset 0. It used to get the whole log."""
    cluster = cluster_factory(voters=1, cluster_secret=DEFAULT_CLUSTER_SECRET)
    leader = cluster.wait_for_leader()  # type: ignore[attr-defined]
    assert cluster.put("private/k", b"v").status_code == 200  # type: ignore[attr-defined]
    received: list[Envelope] = []

    async def scenario() -> None:
        intruder = RaftTransport(99, cluster.cluster_id, SECRET, "127.0.0.1", 0,  # type: ignore[attr-defined]
                                 {leader.node_id: leader.raft_address}, received.append)
        await intruder.start()
        try:
            for _ in range(20):  # a Fetch now and then for 2 s: any answer would arrive
                intruder.send(Envelope(99, leader.node_id, FetchRequest(1, 99, 0, 0, 0, 0, "")))
                await asyncio.sleep(0.1)
        finally:
            await intruder.stop()

    run(scenario)
    assert received == []
    assert "node 99 is neither a voter nor an allowed observer" in leader.log_tail()
    assert cluster.put("private/k2", b"v").status_code == 200  # type: ignore[attr-defined]


def test_a_node_without_peer_tls_dialling_a_tls_node_is_told_why(
        certs: CertSet, caplog: pytest.LogCaptureFixture) -> None:
    """A node started without --peer-tls-* reads the TLS node's greeting as a frame length
    ("frame of 1414288129 bytes exceeds max_frame_bytes"); its operator is told what to set."""
    async def scenario() -> None:
        node = voter_node(tls=tls(certs, 1))
        await node.transport.start()
        address = {1: ("127.0.0.1", node.transport.port)}
        await one_answered_one_refused(node, Peer(2, address, security=PeerSecurity(tls=tls(certs, 2))),
                                       Peer(4, address))

    with caplog.at_level(logging.WARNING, logger="metakv.transport"):
        run(scenario)
    failures = [r.getMessage() for r in caplog.records if "node 4: handshake with peer 1" in r.getMessage()]
    assert failures and "the peer uses peer TLS and this node does not: give it --peer-tls-cert-file" \
        in failures[0], caplog.text


def test_a_refusal_reason_sent_by_a_peer_cannot_forge_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """Whatever listens where a node dials (a peer's port while it is down) chooses the reason
    of its ``["refused", reason]``; the node logs it on its own line, control characters escaped."""
    forged = "bye\n2026-01-01 00:00:00,000 node1 WARNING metakv.audit: audit: forged"

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        payload = msgpack.packb(["refused", forged], use_bin_type=True)
        writer.write(FRAME_LENGTH.pack(len(payload)) + payload)
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(refuse, "127.0.0.1", 0)
        dialler = Peer(2, {1: ("127.0.0.1", server.sockets[0].getsockname()[1])})
        await dialler.transport.start()
        try:
            await wait_until(lambda: dialler.transport.stats.connections_refused >= 1, "the refusal")
        finally:
            await dialler.transport.stop()
            server.close()

    with caplog.at_level(logging.WARNING, logger="metakv.transport"):
        run(scenario)
    lines = [r.getMessage() for r in caplog.records if "the peer refused the handshake" in r.getMessage()]
    assert lines and "\n" not in lines[0] and "bye\\n2026-01-01" in lines[0], caplog.text


def test_a_node_with_peer_tls_dialling_one_without_is_told_why(
        certs: CertSet, caplog: pytest.LogCaptureFixture) -> None:
    """The plain node waits for a hello, the TLS node for the TLS greeting: both used to log
    only "no handshake within 2000 ms"."""
    async def scenario() -> None:
        plain = Peer(1, {}, config=TransportConfig(handshake_timeout_ms=300))
        await plain.transport.start()
        dialler = Peer(2, {1: ("127.0.0.1", plain.transport.port)}, security=PeerSecurity(tls=tls(certs, 2)),
                       config=TransportConfig(handshake_timeout_ms=300))
        await dialler.transport.start()
        try:
            await wait_until(lambda: dialler.transport.stats.connections_refused >= 1, "the failed handshake")
        finally:
            for peer in (dialler, plain):
                await peer.transport.stop()

    with caplog.at_level(logging.WARNING, logger="metakv.transport"):
        run(scenario)
    failures = [r.getMessage() for r in caplog.records if "node 2: handshake with peer 1" in r.getMessage()]
    assert failures and "no TLS greeting within 300 ms: the peer has no peer TLS" in failures[0], caplog.text
