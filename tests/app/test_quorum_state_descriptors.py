"""A quorum-state write that finds no file descriptor (EMFILE) holds the messages after it
and is tried again; the node does not stop (issue 21: a transient EMFILE is never taken for
an fsync failure). Any other write error still stops it."""

from __future__ import annotations

import asyncio
import errno
import time
from pathlib import Path

import pytest

from app.config import HostPort, NodeConfig
from app.quorum_outbox import QuorumStateOutbox
from app.runtime import NodeRuntime
from raft.messages import Envelope, VoteRequest, VoteResponse
from tests.cluster import free_ports

WAIT_S = 10.0


def _envelope(epoch: int) -> Envelope:
    return Envelope(2, 1, VoteRequest(epoch, 2, 0, 0, False))


def test_outbox_holds_messages_until_the_record_is_written() -> None:
    written, sent, failures = [], [], [OSError(errno.EMFILE, "Too many open files")] * 2

    def write(record: object) -> None:
        if failures:
            raise failures.pop()
        written.append(record)

    outbox = QuorumStateOutbox(write, sent.append)  # type: ignore[arg-type]
    assert outbox.perform("r1", [_envelope(1)]) is False  # type: ignore[arg-type]
    assert outbox.perform("r2", [_envelope(2)]) is False and outbox.pending  # type: ignore[arg-type]
    assert sent == [] and written == []
    assert outbox.perform(None, ()) is True and not outbox.pending
    assert written == ["r2"], "the newest record supersedes the one that waited"
    assert [envelope.message.epoch for envelope in sent] == [1, 2]  # type: ignore[union-attr]
    assert outbox.perform(None, [_envelope(3)]) is True and len(sent) == 3  # nothing pending: sent at once


def test_outbox_raises_other_write_errors() -> None:
    def write(record: object) -> None:
        raise OSError(errno.EIO, "I/O error")

    with pytest.raises(OSError):
        QuorumStateOutbox(write, lambda envelope: None).perform("r", [_envelope(1)])  # type: ignore[arg-type]


async def _vote_through_a_shortage(tmp_path: Path) -> None:
    http_port, raft_port, peer2, peer3 = free_ports(4)
    config = NodeConfig(
        node_id=1, data_dir=tmp_path / "n1", listen_http=HostPort("127.0.0.1", http_port),
        listen_raft=HostPort("127.0.0.1", raft_port),
        voters={1: HostPort("127.0.0.1", raft_port), 2: HostPort("127.0.0.1", peer2), 3: HostPort("127.0.0.1", peer3)},
        advertise_http=f"http://127.0.0.1:{http_port}",
    )
    fatal: list[BaseException] = []
    runtime = NodeRuntime(config, seed=1, on_fatal=fatal.append)
    await runtime.start()
    try:
        real_write, shortage = runtime.quorum_state_file.write, [True]

        def write(record: object) -> None:
            if shortage[0]:
                raise OSError(errno.EMFILE, "Too many open files")
            real_write(record)  # type: ignore[arg-type]

        sent: list[Envelope] = []
        real_send = runtime.transport.send
        runtime.quorum_state_file.write = write  # type: ignore[method-assign]
        runtime.transport.send = lambda envelope: (sent.append(envelope), real_send(envelope))  # type: ignore[method-assign]
        runtime._on_message(_envelope(5))  # a candidate of epoch 5 asks node 1 for its vote
        await asyncio.sleep(0.5)
        assert runtime.node.epoch == 5
        assert not any(isinstance(envelope.message, VoteResponse) for envelope in sent), \
            "a vote left before it was durable"
        assert not fatal, fatal
        shortage[0] = False
        deadline = time.monotonic() + WAIT_S
        while not any(isinstance(envelope.message, VoteResponse) for envelope in sent):
            assert time.monotonic() < deadline, "the held vote was never sent"
            await asyncio.sleep(0.02)
        assert runtime.quorum_state_file.read().epoch == 5  # type: ignore[union-attr]
        assert not fatal, fatal
    finally:
        await runtime.stop()


def test_a_node_out_of_descriptors_votes_once_the_vote_is_durable(tmp_path: Path) -> None:
    asyncio.run(_vote_through_a_shortage(tmp_path))
