"""Rule 12: a voter whose log was lost neither votes nor stands until it has caught up.

The scenario of issue 20: a write committed on {1, 2}; 2's log wiped (quorum-state kept);
1 down. 2 must not elect 3, which lacks the write.
"""

from __future__ import annotations

import random

from raft.log import MemoryLog, QuorumStateRecord
from raft.messages import NO_EPOCH, Envelope, FetchRequest, FetchResponse, VoteRequest, VoteResponse
from raft.node import RaftNode, Role
from raft.snapshots import MemorySnapshotStore
from raft.types import CONTROL_LEADER_CHANGE, Batch, ErrorCode, encode_control_record
from tests.sim.cluster import Cluster, sim_config

VOTERS = frozenset({1, 2, 3})


def _node(persisted: QuorumStateRecord, log: MemoryLog | None = None) -> RaftNode:
    return RaftNode(sim_config(2, VOTERS), log or MemoryLog(), persisted, random.Random(2), MemorySnapshotStore(), 0)


def _answer(node: RaftNode, src: int, request: VoteRequest) -> VoteResponse:
    node.take_ready()
    node.handle(1, Envelope(src, 2, request))
    answers = [e.message for e in node.take_ready().messages if isinstance(e.message, VoteResponse)]
    assert len(answers) == 1
    return answers[0]


def test_a_voter_restarted_with_an_empty_log_after_acknowledging_is_lost_and_persists_it() -> None:
    node = _node(QuorumStateRecord(3, -1, -1, log_acknowledged=True))
    assert node.log_lost
    assert node.take_ready().quorum_state == QuorumStateRecord(3, -1, -1, True, True)
    # A voter that never acknowledged anything is just a new voter.
    fresh = _node(QuorumStateRecord(3, -1, -1))
    assert not fresh.log_lost and fresh.take_ready().quorum_state is None


def test_a_lost_voter_grants_neither_pre_votes_nor_votes() -> None:
    for pre_vote in (True, False):
        request = VoteRequest(4, 3, 0, 0, pre_vote)
        assert _answer(_node(QuorumStateRecord(3, -1, -1)), 3, request).vote_granted  # the control
        lost = _node(QuorumStateRecord(3, -1, -1, log_acknowledged=True))
        answer = _answer(lost, 3, request)
        assert not answer.vote_granted and answer.error == ErrorCode.NONE
        assert lost.quorum_state.voted_id == -1


def test_a_lost_voter_never_becomes_a_candidate() -> None:
    node = _node(QuorumStateRecord(3, -1, -1, log_acknowledged=True))
    node.tick(10_000)  # election timer: a pre-vote round, only to find the leader
    assert node.role == Role.PROSPECTIVE
    for voter in (1, 3):
        node.handle(10_001, Envelope(voter, 2, VoteResponse(ErrorCode.NONE, 3, -1, True, True)))
    assert node.role == Role.PROSPECTIVE and node.epoch == 3 and node.quorum_state.voted_id == -1


def _leader_log() -> list[Batch]:
    """Epoch 1 data at 0..4, epoch 2's LeaderChange at 5, epoch 2 data at 6..9."""
    change = encode_control_record(CONTROL_LEADER_CHANGE, leader_id=1, epoch=2, voters=sorted(VOTERS))
    return [Batch(0, 1, 0, False, tuple(b"a%d" % i for i in range(5))), Batch(5, 2, 0, True, (change,)),
            Batch(6, 2, 0, False, tuple(b"b%d" % i for i in range(4)))]


def _fetch_answer(node: RaftNode, fetch_offset: int, batches: list[Batch], high_watermark: int,
                  now_ms: int) -> int:
    """Answer the node's Fetch at ``fetch_offset`` with ``batches`` and flush; returns the
    offset of its next Fetch."""
    node.handle(now_ms, Envelope(1, 2, FetchResponse(
        ErrorCode.NONE, 2, 1, "", fetch_offset, high_watermark, 0, 0, 0, tuple(batches), NO_EPOCH, -1, None, 0,
        fetch_epoch=node._log.last_epoch())))  # type: ignore[attr-defined]
    sent = node.take_ready().messages
    node._log.flush()  # type: ignore[attr-defined]
    node.on_flushed(now_ms)
    sent += node.take_ready().messages
    return [e.message for e in sent if isinstance(e.message, FetchRequest)][-1].fetch_offset


def test_a_lost_voter_clears_only_once_it_holds_a_leader_high_watermark_past_the_leaders_epoch_start() -> None:
    batches = _leader_log()
    node = _node(QuorumStateRecord(2, -1, 1, log_acknowledged=True))
    assert node.role == Role.FOLLOWER and node.log_lost
    node.take_ready()
    offset = _fetch_answer(node, 0, batches[:1], 10, 1)  # holds 0..4 of a high watermark 10
    assert offset == 5 and node.log_lost
    _fetch_answer(node, offset, batches[1:], 10, 2)  # holds 0..9: caught up
    assert not node.log_lost and not node.quorum_state.log_lost

    # A new leader's high watermark may be stale (not yet past its epoch start at 5): holding
    # up to it proves nothing, records committed by the last leader may lie above it.
    node = _node(QuorumStateRecord(2, -1, 1, log_acknowledged=True))
    node.take_ready()
    offset = _fetch_answer(node, 0, batches, 5, 1)
    assert offset == 10 and node.log_lost
    _fetch_answer(node, offset, [], 6, 2)
    assert not node.log_lost


def test_the_first_acknowledgement_persists_log_acknowledged_before_it_is_sent() -> None:
    node = _node(QuorumStateRecord(2, -1, 1))
    fetch = [e.message for e in node.take_ready().messages if isinstance(e.message, FetchRequest)][0]
    node.handle(1, Envelope(1, 2, FetchResponse(
        ErrorCode.NONE, 2, 1, "", fetch.fetch_offset, 0, 0, 0, 0, tuple(_leader_log()[:1]), NO_EPOCH, -1, None, 0,
        fetch_epoch=fetch.last_fetched_epoch)))
    assert node.take_ready().quorum_state is None  # appended, not flushed: nothing acknowledged yet
    node._log.flush()  # type: ignore[attr-defined]
    node.on_flushed(2)
    ready = node.take_ready()
    acks = [e.message for e in ready.messages if isinstance(e.message, FetchRequest)]
    assert acks and acks[0].fetch_offset == 5
    assert ready.quorum_state == QuorumStateRecord(2, -1, 1, log_acknowledged=True)  # written before the send


def test_a_write_committed_on_two_voters_survives_one_of_them_losing_its_log() -> None:
    cluster = Cluster(seed=11, voters=3)
    assert cluster.run_until(lambda: cluster.leader() is not None, 5_000)
    leader = cluster.leader()
    assert leader is not None and leader.core is not None
    holder, lagging = sorted(VOTERS - {leader.node_id})
    cluster.partition({lagging}, VOTERS - {lagging})
    proposal = cluster.propose((b"the write",))
    assert proposal is not None
    assert cluster.run_until(lambda: cluster.is_committed(proposal), 2_000)

    cluster.lose_disk(holder)  # its log is gone, its quorum-state kept
    cluster.crash(leader.node_id)
    cluster.heal()
    cluster.restart(holder)
    cluster.run_for(2_000)  # the invariants would stop here if the lagging voter were elected
    assert cluster.leader() is None
    lost = cluster.nodes[holder].core
    assert lost is not None and lost.log_lost

    cluster.restart(leader.node_id)
    assert cluster.run_until(lambda: cluster.leader() is not None and not lost.log_lost, 5_000)
    assert cluster.nodes[holder].durable_state is not None and not cluster.nodes[holder].durable_state.log_lost
    cluster.check_replicas_agree()
