"""A truncation below the high watermark stops the node (issue 20, defect 6)."""

from __future__ import annotations

import random

import pytest

from raft.log import MemoryLog, QuorumStateRecord
from raft.messages import NO_EPOCH, Envelope, FetchRequest, FetchResponse
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
        diverging_epoch=diverging[0], diverging_end_offset=diverging[1], snapshot_id=None)))


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
