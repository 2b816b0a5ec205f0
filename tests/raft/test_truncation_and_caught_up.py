"""A truncation below the high watermark stops the node (issue 20, defect 6), and
DescribeQuorum's "last caught up" follows Kafka's rule under steady writes."""

from __future__ import annotations

import random

import pytest

from raft.log import MemoryLog, QuorumStateRecord
from raft.messages import NO_EPOCH, Envelope, FetchRequest, FetchResponse, VoteResponse
from raft.node import RaftConfig, RaftNode, Role
from raft.snapshots import MemorySnapshotStore
from raft.types import Batch, ErrorCode, ProtocolInvariantError

VOTERS = frozenset({1, 2, 3})


def _node(persisted: QuorumStateRecord, log: MemoryLog | None = None) -> RaftNode:
    config = RaftConfig(node_id=1, voters=VOTERS, endpoint="http://n1")
    return RaftNode(config, log or MemoryLog(), persisted, random.Random(1), MemorySnapshotStore(), 0)


def _answer(node: RaftNode, now_ms: int, high_watermark: int,
            diverging: tuple[int, int] = (NO_EPOCH, -1)) -> None:
    """Answer the follower's Fetch in flight as its leader (node 2, epoch 3)."""
    [fetch] = [e.message for e in node.take_ready().messages if isinstance(e.message, FetchRequest)]
    node.handle(now_ms, Envelope(2, 1, FetchResponse(
        error=ErrorCode.NONE, epoch=3, leader_id=2, leader_endpoint="", fetch_offset=fetch.fetch_offset,
        high_watermark=high_watermark, log_start_offset=0, dirty_offset=0, tombstone_horizon=0, records=(),
        diverging_epoch=diverging[0], diverging_end_offset=diverging[1], snapshot_id=None,
        fetch_epoch=fetch.last_fetched_epoch)))


def _follower_with_uncommitted_tail() -> tuple[RaftNode, MemoryLog]:
    """Follower of 2 in epoch 3: offset 0 of epoch 1, offsets 1..2 of epoch 3."""
    log = MemoryLog()
    log.append(Batch(0, 1, 0, True, (b"c",)))
    log.append(Batch(1, 3, 0, False, (b"a", b"b")))
    log.flush()
    node = _node(QuorumStateRecord(3, -1, 2), log)
    assert node.role == Role.FOLLOWER
    return node, log


def test_a_truncation_below_the_high_watermark_stops_the_node() -> None:
    node, log = _follower_with_uncommitted_tail()
    _answer(node, 10, high_watermark=3)
    assert node.high_watermark == 3
    # The leader says epoch 1 ends at 1: offsets 1..2 would go, but they are committed.
    with pytest.raises(ProtocolInvariantError, match="below the high watermark 3"):
        _answer(node, 20, high_watermark=3, diverging=(1, 1))
    assert log.end_offset() == 3


def test_a_truncation_at_or_above_the_high_watermark_cuts_the_log() -> None:
    node, log = _follower_with_uncommitted_tail()
    _answer(node, 10, high_watermark=1)
    _answer(node, 20, high_watermark=1, diverging=(1, 1))
    assert log.end_offset() == 1


def _leader() -> RaftNode:
    """Node 1 elected leader of epoch 3 over an empty log (LeaderChange at offset 0)."""
    node = _node(QuorumStateRecord(2, -1, -1))
    node.tick(node.next_deadline_ms())
    node.handle(5_000, Envelope(2, 1, VoteResponse(ErrorCode.NONE, 2, -1, True, True)))
    node.handle(5_001, Envelope(2, 1, VoteResponse(ErrorCode.NONE, 3, -1, True, False)))
    assert (node.role, node.epoch) == (Role.LEADER, 3)
    node.take_ready()
    return node


def test_a_follower_under_steady_writes_is_caught_up_as_of_its_previous_fetch() -> None:
    """Kafka's rule: a Fetch at or past the leader's end as of the replica's previous Fetch
    shows the replica was caught up at that previous Fetch. Every Fetch here asks for what
    the previous answer held, and the leader has appended one more record meanwhile, so
    no Fetch ever reaches the leader's current end."""
    leader = _leader()
    log: MemoryLog = leader._log  # type: ignore[assignment]
    now_ms = 5_010
    fetched_at: list[int] = []
    for _ in range(5):
        fetch_offset = log.end_offset()  # everything the previous answer carried
        leader.propose(now_ms, [b"write"])
        log.flush()
        leader.on_flushed(now_ms)
        assert log.end_offset() > fetch_offset
        leader.handle(now_ms, Envelope(2, 1, FetchRequest(3, 2, fetch_offset, 3, 0, 0, "")))
        leader.take_ready()
        fetched_at.append(now_ms)
        now_ms += 7
    follower = {r.replica_id: r for r in leader.describe_quorum(now_ms).voters}[2]
    assert follower.last_fetch_timestamp_ms == fetched_at[-1]
    assert follower.last_caught_up_timestamp_ms == fetched_at[-2]
    lagging = {r.replica_id: r for r in leader.describe_quorum(now_ms).voters}[3]
    assert lagging.last_caught_up_timestamp_ms == -1  # never fetched


@pytest.mark.parametrize("seed", range(3))
def test_simulated_followers_under_steady_writes_look_caught_up(seed: int) -> None:
    """The same in the simulator: a proposal every 2 ms for a second, three voters, no
    faults. Each follower's last caught up stays within one fetch timeout of now."""
    from tests.sim.cluster import Cluster
    cluster = Cluster(seed=seed, voters=3)
    assert cluster.run_until(lambda: cluster.leader() is not None, 5_000)
    start_ms = cluster.now_ms
    for at_ms in range(start_ms + 2, start_ms + 1_000, 2):
        cluster.at(at_ms, lambda: cluster.propose((b"steady",)))
    cluster.run_for(1_000)
    leader = cluster.leader()
    assert leader is not None and leader.core is not None
    quorum = leader.core.describe_quorum(cluster.now_ms)
    for replica in quorum.voters:
        assert cluster.now_ms - replica.last_caught_up_timestamp_ms <= 200, replica


def test_an_answer_to_a_fetch_from_before_a_truncation_is_ignored() -> None:
    """A Fetch at offset 3 claiming epoch 3 (sent before the truncation) may be answered after
    the log was cut to 1 and refilled to 3 by epoch 4: the same offset, another log. Its
    divergence must not cut the refilled, committed records (found by tests/sim at seed 4162)."""
    node, log = _follower_with_uncommitted_tail()
    [stale] = [e.message for e in node.take_ready().messages if isinstance(e.message, FetchRequest)]
    node.handle(10, Envelope(2, 1, FetchResponse(
        ErrorCode.NONE, 4, 2, "", 3, 1, 0, 0, 0, (), 1, 1, None, fetch_epoch=3)))  # new leader, epoch 4
    assert log.end_offset() == 1
    fetch = [e.message for e in node.take_ready().messages if isinstance(e.message, FetchRequest)][-1]
    assert (fetch.fetch_offset, fetch.last_fetched_epoch) == (1, 1)
    refill = (Batch(1, 4, 0, True, (b"c4",)), Batch(2, 4, 0, False, (b"d",)))
    node.handle(20, Envelope(2, 1, FetchResponse(
        ErrorCode.NONE, 4, 2, "", fetch.fetch_offset, 3, 0, 0, 0, refill, NO_EPOCH, -1, None,
        fetch_epoch=fetch.last_fetched_epoch)))
    log.flush()
    node.on_flushed(21)
    assert (log.end_offset(), log.last_epoch(), node.high_watermark) == (3, 4, 3)
    node.take_ready()
    # The leader answers the stale Fetch (offset 3, epoch 3) with a divergence at epoch 1.
    node.handle(30, Envelope(2, 1, FetchResponse(
        ErrorCode.NONE, 4, 2, "", stale.fetch_offset, 3, 0, 0, 0, (), 1, 1, None,
        fetch_epoch=stale.last_fetched_epoch)))
    assert (log.end_offset(), log.last_epoch()) == (3, 4)
