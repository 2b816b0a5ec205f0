"""Check-quorum (rule 6 of raft/roles.py): what counts as a voter's sign of life."""

from __future__ import annotations

import pytest

from raft.messages import Envelope, FetchSnapshotRequest, FetchSnapshotResponse
from raft.node import Role
from raft.types import ErrorCode, SnapshotId
from tests.sim.cluster import Cluster, SimNode

SNAPSHOT_BYTES = 20_000
CHUNK_BYTES = 64


def _leader_with_a_snapshot() -> tuple[SimNode, SnapshotId, int]:
    """A three-voter leader whose committed log was replaced by a 20 KB snapshot."""
    cluster = Cluster(seed=1, voters=3)
    assert cluster.run_until(lambda: cluster.leader() is not None, 5_000)
    proposal = cluster.propose((b"a", b"b"))
    assert proposal is not None
    leader = cluster.leader()
    assert leader is not None and leader.core is not None
    assert cluster.run_until(lambda: leader.core.high_watermark == leader.log.flushed_offset()  # type: ignore[union-attr]
                             == leader.log.end_offset() > proposal.last_offset, 2_000)
    snapshot_id = SnapshotId(leader.log.end_offset(), leader.log.last_epoch())
    leader.snapshots.put(snapshot_id, b"s" * SNAPSHOT_BYTES)
    leader.log.reset_to_snapshot(snapshot_id)
    return leader, snapshot_id, cluster.now_ms


@pytest.mark.parametrize("downloading", [True, False])
def test_a_voter_downloading_a_snapshot_keeps_the_leader_in_office(downloading: bool) -> None:
    """One voter is down, the other downloads a snapshot for longer than the check-quorum
    period (1.5 x fetch_timeout_ms) and sends no Fetch meanwhile. Its FetchSnapshots are
    signs of life, as in Kafka: the leader stays. Counting only Fetches, it resigned, the
    download restarted in the next epoch, and so on forever (found by the simulator's
    liveness check with a minority down for good, seed 49). Without the download the leader
    does resign: the test really runs past check-quorum."""
    leader, snapshot_id, now_ms = _leader_with_a_snapshot()
    core = leader.core
    assert core is not None
    downloader = min(core.config.voters - {leader.node_id})
    check_quorum_ms = core.config.fetch_timeout_ms * 3 // 2
    position, started_ms = 0, now_ms
    while now_ms < started_ms + 4 * check_quorum_ms:
        now_ms += 10
        if downloading:
            core.handle(now_ms, Envelope(downloader, leader.node_id, FetchSnapshotRequest(
                core.epoch, downloader, snapshot_id, position, CHUNK_BYTES)))
            answers = [e.message for e in core.take_ready().messages if isinstance(e.message, FetchSnapshotResponse)]
            assert answers and answers[-1].error == ErrorCode.NONE
            position = (position + len(answers[-1].chunk)) % SNAPSHOT_BYTES
        core.tick(now_ms)
        core.take_ready()
    assert (core.role == Role.LEADER) == downloading, core.role
