"""What a Fetch answer says about the leader's compaction: where its cleaned prefix ends
(a fetcher copies everything below it it did not have as cleaned prefix) and its
tombstone_retention_records (a fetcher with another value refuses to follow it).
docs/compaction.md rules 3 and 5."""

from __future__ import annotations

import random

from raft.log import MemoryLog, QuorumStateRecord
from raft.messages import Envelope, FetchRequest, FetchResponse, decode_message, encode_message
from raft.node import RaftConfig, RaftNode, Role
from raft.snapshots import MemorySnapshotStore
from raft.types import Batch, ErrorCode
from storage.commands import Command, Op, OpKind, encode_command

EPOCH = 4
LEADER = 1


def _follower(log: MemoryLog, retention: int = 3) -> RaftNode:
    """Node 2 following node 1 in EPOCH; its first Fetch (at its log end) is in flight."""
    config = RaftConfig(node_id=2, voters=frozenset({1, 2, 3}), endpoint="http://n2",
                        tombstone_retention_records=retention)
    node = RaftNode(config, log, QuorumStateRecord(EPOCH, -1, LEADER), random.Random(1), MemorySnapshotStore(), 0)
    assert node.role == Role.FOLLOWER
    node.take_ready()
    return node


def _answer(fetch_offset: int, records: tuple[Batch, ...], *, cleaned_end: int, dirty_offset: int,
            retention: int = 3) -> Envelope:
    return Envelope(LEADER, 2, FetchResponse(
        ErrorCode.NONE, EPOCH, LEADER, "http://n1", fetch_offset, dirty_offset, 0, dirty_offset, dirty_offset,
        records, -1, -1, None, 0, cleaned_end, retention, EPOCH))


def _record(*ops: Op) -> bytes:
    return encode_command(Command((), ops))


def _log_until(end: int) -> MemoryLog:
    log = MemoryLog()
    for offset in range(end):
        log.append(Batch(offset, EPOCH, 0, False, (_record(Op(OpKind.PUT, "x", b"old")),)))
    log.flush()
    return log


def test_fetch_response_carries_the_cleaned_end_and_the_retention() -> None:
    response = FetchResponse(ErrorCode.NONE, 3, 1, "http://x", 10, 9, 0, 4, 2,
                             (Batch(10, 3, 1, False, (b"r",)),), -1, 0, None, 7, 8, 250)
    decoded = decode_message(encode_message(response))
    assert decoded == response
    assert isinstance(decoded, FetchResponse) and (decoded.cleaned_end, decoded.tombstone_retention_records) == (8, 250)


def test_a_gap_free_copy_below_the_leaders_cleaned_end_is_cleaned_prefix() -> None:
    """[DELETE x, PUT a], [PUT x] cleans to [PUT a], [PUT x]: no offset is missing, yet the
    state after the first record (x still at its old value here) is no real version. Before
    the fix the follower took it for history and exposed x there (the compaction
    simulator's real-state invariant); now everything it copies below the leader's cleaned end is cleaned prefix."""
    log = _log_until(10)
    node = _follower(log)
    cleaned = (Batch(10, EPOCH, 0, False, (_record(Op(OpKind.PUT, "a", b"1")),)),
               Batch(11, EPOCH, 0, False, (_record(Op(OpKind.PUT, "x", b"new")),)))
    node.handle(1, _answer(10, cleaned, cleaned_end=12, dirty_offset=12))
    assert log.end_offset() == 12 and log.cleaned_end() == 12
    assert not node.is_real_state(11)  # the state between the two records
    assert node.is_real_state(12)


def test_a_copy_spanning_several_answers_stays_cleaned_prefix_up_to_the_cleaned_end() -> None:
    log = _log_until(10)
    node = _follower(log)
    first = (Batch(10, EPOCH, 0, False, (_record(Op(OpKind.PUT, "a", b"1")),)),)
    node.handle(1, _answer(10, first, cleaned_end=13, dirty_offset=14))
    # Cleaned relative to 13, not to 11 where the copy stopped (a record in [10, 11) is gone
    # when one in [11, 13) supersedes it): the copy counts as cleaned prefix up to 13.
    assert log.end_offset() == 11 and log.cleaned_end() == 13
    log.flush()
    node.on_flushed(2)  # the next Fetch (from 11) goes once its offset is durable
    node.take_ready()
    rest = (Batch(11, EPOCH, 0, False, (_record(Op(OpKind.PUT, "b", b"1")),)),
            Batch(12, EPOCH, 0, False, (_record(Op(OpKind.PUT, "x", b"new")),)),
            Batch(13, EPOCH, 0, False, (_record(Op(OpKind.PUT, "c", b"1")),)))  # above: history
    node.handle(3, _answer(11, rest, cleaned_end=13, dirty_offset=14))
    assert log.end_offset() == 14 and log.cleaned_end() == 13
    assert not node.is_real_state(12) and node.is_real_state(13) and node.is_real_state(14)


def test_batches_above_the_leaders_cleaned_end_are_history() -> None:
    log = _log_until(10)
    node = _follower(log)
    records = (Batch(10, EPOCH, 0, False, (_record(Op(OpKind.PUT, "a", b"1")),)),)
    node.handle(1, _answer(10, records, cleaned_end=8, dirty_offset=11))
    assert log.end_offset() == 11 and log.cleaned_end() == 0
    assert node.is_real_state(11)


def test_a_follower_refuses_a_leader_with_another_tombstone_retention() -> None:
    """A leader whose cleaners keep fewer tombstones may have dropped some this node's
    re-bootstrap bound would count on once it leads: learn nothing, back off, say why."""
    log = _log_until(10)
    node = _follower(log, retention=3)
    records = (Batch(10, EPOCH, 0, False, (_record(Op(OpKind.PUT, "a", b"1")),)),)
    node.handle(1, _answer(10, records, cleaned_end=0, dirty_offset=11, retention=5))
    assert log.end_offset() == 10 and node.dirty_offset == 0 and not node.is_real_state(10)
    assert node.role == Role.FOLLOWER
    assert "tombstone_retention_records=5" in node.refused_leader_reason
    assert "with 3" in node.refused_leader_reason
    node.tick(node.next_deadline_ms())  # asks again after the backoff; an equal leader is followed
    fetch = [e.message for e in node.take_ready().messages if isinstance(e.message, FetchRequest)]
    assert fetch and fetch[-1].fetch_offset == 10
    node.handle(node.next_deadline_ms(), _answer(10, records, cleaned_end=0, dirty_offset=11, retention=3))
    assert log.end_offset() == 11 and node.dirty_offset == 11


def test_the_leader_announces_its_cleaned_end_and_retention() -> None:
    config = RaftConfig(node_id=1, voters=frozenset({1}), endpoint="http://n1", tombstone_retention_records=6)
    log = MemoryLog()
    node = RaftNode(config, log, None, random.Random(1), MemorySnapshotStore(), 0)
    node.tick(node.next_deadline_ms())
    while node.role != Role.LEADER:
        node.tick(node.next_deadline_ms())
    node.propose(5_000, [b"a", b"b", b"c"])
    log.flush()
    node.on_flushed(5_001)
    log.replace_prefix(log.read(0, 1 << 20)[:1], log.read(0, 1 << 20)[0].next_offset)
    node.take_ready()
    node.handle(5_002, Envelope(9, 1, FetchRequest(node.epoch, 9, 0, 0, 0, 0, "")))
    answer = node.take_ready().messages[-1].message
    assert isinstance(answer, FetchResponse) and answer.error == ErrorCode.NONE
    assert (answer.cleaned_end, answer.tombstone_retention_records) == (log.cleaned_end(), 6)
    assert answer.cleaned_end > 0


def test_a_partial_copy_takes_nothing_below_its_cleaned_end_from_a_leader_cleaned_less() -> None:
    """The copy [10, 11) was cleaned relative to 13: records of keys superseded in [11, 13)
    are gone. Raw records from a leader cleaned only to 8 would be evaluated on a state
    missing them (a deleted key back, a PUT's create_version wrong: compaction sim seed
    5163), so the follower appends nothing there and names its cleaned end in its Fetch."""
    log = _log_until(10)
    node = _follower(log)
    node.handle(1, _answer(10, (Batch(10, EPOCH, 0, False, (_record(Op(OpKind.PUT, "a", b"1")),)),),
                           cleaned_end=13, dirty_offset=14))
    log.flush()
    node.on_flushed(2)
    fetch = [e.message for e in node.take_ready().messages if isinstance(e.message, FetchRequest)]
    assert fetch and (fetch[-1].fetch_offset, fetch[-1].cleaned_end) == (11, 13)
    raw = (Batch(11, EPOCH, 0, False, (_record(Op(OpKind.PUT, "x", b"raw")),)),)
    node.handle(3, _answer(11, raw, cleaned_end=8, dirty_offset=14))
    assert log.end_offset() == 11 and log.cleaned_end() == 13


def test_the_leader_sends_a_snapshot_to_a_partial_copy_cleaned_further_than_its_log() -> None:
    """A fetcher inside a copy cleaned to 40 (its Fetch says so) fetching from a leader
    cleaned less gets no records below 40: a snapshot at or above 40 (asked for here)."""
    config = RaftConfig(node_id=1, voters=frozenset({1}), endpoint="http://n1", tombstone_retention_records=6)
    log = MemoryLog()
    node = RaftNode(config, log, None, random.Random(1), MemorySnapshotStore(), 0)
    while node.role != Role.LEADER:
        node.tick(node.next_deadline_ms())
    node.propose(5_000, [b"r%d" % i for i in range(60)])
    log.flush()
    node.on_flushed(5_001)
    node.take_ready()
    assert log.cleaned_end() == 0
    node.handle(5_002, Envelope(9, 1, FetchRequest(node.epoch, 9, 20, node.epoch, 0, 0, "", 0, 40)))
    answer = node.take_ready().messages[-1].message
    assert isinstance(answer, FetchResponse) and answer.error == ErrorCode.SNAPSHOT_NOT_FOUND
    assert node.snapshot_wanted_offset == 40
    node.handle(5_003, Envelope(9, 1, FetchRequest(node.epoch, 9, 40, node.epoch, 0, 0, "", 0, 40)))
    answer = node.take_ready().messages[-1].message
    assert isinstance(answer, FetchResponse) and answer.error == ErrorCode.NONE and answer.records
