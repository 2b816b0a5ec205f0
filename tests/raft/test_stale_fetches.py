"""Rule 7 and stale Fetch traffic, both found by the simulator (tests/sim):

- seed 1772 (5 voters): a Fetch a voter sent before its disk was lost arrived after its
  first Fetch from its empty log; the leader took it as an acknowledgement and committed
  an offset only two of five voters held.
- seed 1336 (3 voters): a duplicated Fetch's diverging answer reached a follower after it
  had truncated, appended the leader's records and fetched again from the same offset; it
  truncated those records, which it had acknowledged, and the leader committed an offset
  only it held."""

from __future__ import annotations

import random

from raft.log import MemoryLog, QuorumStateRecord
from raft.messages import NO_EPOCH, Envelope, FetchRequest, FetchResponse, VoteResponse
from raft.node import RaftNode, Role
from raft.snapshots import MemorySnapshotStore
from raft.types import CONTROL_LEADER_CHANGE, Batch, ErrorCode, encode_control_record
from tests.sim.cluster import sim_config

VOTERS = frozenset({1, 2, 3})


def _leader(voters: frozenset[int]) -> RaftNode:
    """Node 1 leads epoch 1 with records 0..10 flushed (0 is its LeaderChange record)."""
    log = MemoryLog()
    node = RaftNode(sim_config(1, voters), log, None, random.Random(1), MemorySnapshotStore(), 0)
    node.tick(10_000)
    for voter in (2, 3):
        node.handle(10_001, Envelope(voter, 1, VoteResponse(ErrorCode.NONE, 0, -1, True, True)))
    for voter in (2, 3):
        node.handle(10_002, Envelope(voter, 1, VoteResponse(ErrorCode.NONE, 1, -1, True, False)))
    assert node.role == Role.LEADER and node.epoch == 1
    for first in (1, 6):
        node.propose(10_003, [b"r%d" % offset for offset in range(first, first + 5)])
    for _ in range(2):  # the first flush lets the pending batches in, the second covers them
        log.flush()
        node.on_flushed(10_004)
    assert log.flushed_offset() == 11
    node.take_ready()
    return node


def _fetch(node: RaftNode, now_ms: int, src: int, offset: int, last_epoch: int, read_nonce: int = 0) -> FetchResponse:
    node.handle(now_ms, Envelope(src, 1, FetchRequest(1, src, offset, last_epoch, 0, 0, "", read_nonce)))
    answers = [e.message for e in node.take_ready().messages if isinstance(e.message, FetchResponse)]
    assert len(answers) == 1
    return answers[0]


def test_a_fetch_sent_before_the_log_was_lost_does_not_count() -> None:
    leader = _leader(frozenset({1, 2, 3, 4, 5}))
    first = _fetch(leader, 10_005, 2, 0, 0)  # voter 2 starts empty; it learns a read nonce
    _fetch(leader, 10_010, 2, 11, 1, first.read_nonce)  # and holds 0..10
    _fetch(leader, 10_011, 3, 6, 1)  # voter 3 holds 0..5
    assert leader.high_watermark == 6
    # Voter 2 sends another Fetch at 11, which is delayed; then it loses its log and,
    # restarted, fetches from its empty log (it echoes no nonce yet): it holds nothing now.
    answer = _fetch(leader, 10_020, 2, 0, 0)
    _fetch(leader, 10_021, 3, 11, 1)
    assert leader.high_watermark == 6  # 6..10 are on voters 1 and 3 only
    # The delayed Fetch arrives: it acknowledges nothing.
    _fetch(leader, 10_022, 2, 11, 1, first.read_nonce)
    assert leader.high_watermark == 6
    # Fetches sent after 2 heard from the leader again count: it holds what it fetched since.
    _fetch(leader, 10_030, 2, 11, 1, answer.read_nonce)
    assert leader.high_watermark == 11


def _answer(fetch_offset: int, fetch_epoch: int, records: tuple[Batch, ...] = (),
            diverging: tuple[int, int] = (NO_EPOCH, -1)) -> Envelope:
    return Envelope(1, 2, FetchResponse(ErrorCode.NONE, 5, 1, "", fetch_offset, 0, 0, 0, 0, records,
                                        diverging[0], diverging[1], None, 0, 0, 0, fetch_epoch))


def _fetches(node: RaftNode) -> list[FetchRequest]:
    return [e.message for e in node.take_ready().messages if isinstance(e.message, FetchRequest)]


def test_a_diverging_answer_to_an_older_duplicate_fetch_cuts_nothing() -> None:
    log = MemoryLog()
    log.append(Batch(0, 3, 0, False, tuple(b"r%d" % i for i in range(150))))
    log.flush()
    follower = RaftNode(sim_config(2, VOTERS), log, QuorumStateRecord(5, -1, 1), random.Random(2),
                        MemorySnapshotStore(), 0)
    assert [(f.fetch_offset, f.last_fetched_epoch) for f in _fetches(follower)] == [(150, 3)]
    stale = _answer(150, 3, diverging=(3, 148))  # the leader's epoch 3 ends at 148
    follower.handle(1, stale)
    assert log.end_offset() == 148
    assert [(f.fetch_offset, f.last_fetched_epoch) for f in _fetches(follower)] == [(148, 3)]
    leader_change = encode_control_record(CONTROL_LEADER_CHANGE, leader_id=1, epoch=5, voters=sorted(VOTERS))
    follower.handle(2, _answer(148, 3, (Batch(148, 5, 2, True, (leader_change,)), Batch(149, 5, 2, False, (b"x",)))))
    log.flush()
    follower.on_flushed(3)
    assert [(f.fetch_offset, f.last_fetched_epoch) for f in _fetches(follower)] == [(150, 5)]  # acknowledges 148..149
    follower.handle(4, stale)  # a duplicate of the first answer, late
    assert log.end_offset() == 150 and log.last_epoch() == 5
