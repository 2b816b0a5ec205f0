"""Arbitrary (well-typed but out-of-range) messages never raise out of the core, and a
message the core rejects as invalid never changes what it persists."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raft.log import MemoryLog, QuorumStateRecord
from raft.messages import (
    BeginQuorumEpochRequest,
    BeginQuorumEpochResponse,
    DescribeQuorumRequest,
    EndQuorumEpochRequest,
    EndQuorumEpochResponse,
    Envelope,
    FetchRequest,
    FetchResponse,
    FetchSnapshotRequest,
    FetchSnapshotResponse,
    VoteRequest,
    VoteResponse,
)
from raft.node import RaftConfig, RaftNode
from raft.snapshots import MemorySnapshotStore
from raft.types import Batch, ErrorCode, SnapshotId

ints = st.integers(-3, 12)
ids = st.integers(-1, 5)
errors = st.sampled_from(list(ErrorCode))
snapshot_ids = st.builds(SnapshotId, ints, ints)
batches = st.builds(Batch, ints, ints, ints, st.booleans(),
                    st.lists(st.binary(max_size=4), max_size=3).map(tuple))
messages = st.one_of(
    st.builds(VoteRequest, ints, ids, ints, ints, st.booleans()),
    st.builds(VoteResponse, errors, ints, ids, st.booleans(), st.booleans()),
    st.builds(BeginQuorumEpochRequest, ints, ids, st.text(max_size=3)),
    st.builds(BeginQuorumEpochResponse, errors, ints, ids),
    st.builds(EndQuorumEpochRequest, ints, ids, st.lists(ids, max_size=4).map(tuple)),
    st.builds(EndQuorumEpochResponse, errors, ints, ids),
    st.builds(FetchRequest, ints, ids, ints, ints, ints, ints, st.text(max_size=3), ints),
    st.builds(FetchResponse, errors, ints, ids, st.text(max_size=3), ints, ints, ints, ints, ints,
              st.lists(batches, max_size=3).map(tuple), ints, ints, st.none() | snapshot_ids, ints),
    st.builds(FetchSnapshotRequest, ints, ids, snapshot_ids, ints, ints),
    st.builds(FetchSnapshotResponse, errors, ints, ids, snapshot_ids, ints, ints, st.binary(max_size=8)),
    st.builds(DescribeQuorumRequest),
)


def _nodes() -> list[tuple[RaftNode, MemoryLog]]:
    """A leader, a follower and an unattached voter, each with a small log."""
    built = []
    for persisted in (QuorumStateRecord(3, 1, 1), QuorumStateRecord(3, -1, 2), QuorumStateRecord(3, 2, -1)):
        log = MemoryLog()
        log.append(Batch(0, 1, 0, True, (b"c",)))
        log.append(Batch(1, 3, 0, False, (b"a", b"b")))
        log.flush()
        config = RaftConfig(node_id=1, voters=frozenset({1, 2, 3}), endpoint="http://n1")
        node = RaftNode(config, log, persisted, random.Random(0), MemorySnapshotStore(), 0)
        if persisted.leader_id == 1:  # restarted as Resigned: make it lead epoch 4 for real
            node.tick(node.next_deadline_ms())
            node.handle(4_000, Envelope(2, 1, VoteResponse(ErrorCode.NONE, 3, -1, True, True)))
            node.handle(4_001, Envelope(2, 1, VoteResponse(ErrorCode.NONE, 4, -1, True, False)))
        node.take_ready()
        built.append((node, log))
    return built


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 5), messages), min_size=1, max_size=8))
def test_arbitrary_messages_never_raise(inputs: list[tuple[int, object]]) -> None:
    for node, log in _nodes():
        now_ms = 5_000
        for src, message in inputs:
            before = node.quorum_state
            node.handle(now_ms, Envelope(src, 1, message))  # type: ignore[arg-type]
            ready = node.take_ready()
            if ready.quorum_state is not None:
                assert ready.quorum_state.epoch >= before.epoch
            invalid = [e for e in ready.messages
                       if getattr(e.message, "error", None) == ErrorCode.INVALID_REQUEST]
            if invalid:
                assert ready.quorum_state is None
            assert 0 <= node.high_watermark <= log.end_offset()
            now_ms += 7
            node.tick(now_ms)
            node.take_ready()
