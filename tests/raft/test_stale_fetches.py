"""Rule 7 and stale Fetch traffic, found by the simulator (tests/sim):

- seed 1772 (5 voters): a Fetch a voter sent before its disk was lost arrived after its
  first Fetch from its empty log; the leader took it as an acknowledgement and committed
  an offset only two of five voters held."""

from __future__ import annotations

import random

from raft.log import MemoryLog
from raft.messages import Envelope, FetchRequest, FetchResponse, VoteResponse
from raft.node import RaftNode, Role
from raft.snapshots import MemorySnapshotStore
from raft.types import ErrorCode
from tests.sim.cluster import sim_config

VOTERS = frozenset({1, 2, 3})


def _leader() -> RaftNode:
    """Node 1 leads epoch 1 with records 0..10 flushed (0 is its LeaderChange record)."""
    log = MemoryLog()
    node = RaftNode(sim_config(1, VOTERS), log, None, random.Random(1), MemorySnapshotStore(), 0)
    node.tick(10_000)
    node.handle(10_001, Envelope(2, 1, VoteResponse(ErrorCode.NONE, 0, -1, True, True)))
    node.handle(10_002, Envelope(2, 1, VoteResponse(ErrorCode.NONE, 1, -1, True, False)))
    assert node.role == Role.LEADER and node.epoch == 1
    for first in (1, 6):
        node.propose(10_003, [b"r%d" % offset for offset in range(first, first + 5)])
    for _ in range(2):  # the first flush lets the pending batches in, the second covers them
        log.flush()
        node.on_flushed(10_004)
    assert log.flushed_offset() == 11
    node.take_ready()
    return node


def _fetch(node: RaftNode, now_ms: int, offset: int, last_epoch: int, read_nonce: int = 0) -> FetchResponse:
    node.handle(now_ms, Envelope(2, 1, FetchRequest(1, 2, offset, last_epoch, 0, 0, "", read_nonce)))
    answers = [e.message for e in node.take_ready().messages if isinstance(e.message, FetchResponse)]
    assert len(answers) == 1
    return answers[0]


def test_a_fetch_sent_before_the_log_was_lost_does_not_count() -> None:
    leader = _leader()
    _fetch(leader, 10_010, 6, 1)  # voter 2 holds 0..5
    assert leader.high_watermark == 6
    # Voter 2 sends a Fetch at 11 (it holds 0..10), which is delayed; then it loses its log
    # and fetches from its empty log.
    answer = _fetch(leader, 10_020, 0, 0)
    # The delayed Fetch arrives: 2 no longer holds 6..10, only the leader does.
    _fetch(leader, 10_021, 11, 1)
    assert leader.high_watermark == 6
    # Fetches sent after 2 heard from the leader again count: it holds what it fetched since.
    _fetch(leader, 10_030, 11, 1, answer.read_nonce)
    assert leader.high_watermark == 11

