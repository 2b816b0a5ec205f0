"""Unit tests of the raft core driven directly or through a fault-free simulated cluster."""

from __future__ import annotations

import random

import pytest

from raft.log import MemoryLog, QuorumStateRecord
from raft.messages import (
    BeginQuorumEpochRequest,
    Envelope,
    FetchRequest,
    FetchResponse,
    VoteRequest,
    VoteResponse,
)
from raft.node import NotLeaderError, ProposalRejectedError, RaftConfig, RaftNode, Role
from raft.snapshots import MemorySnapshotStore
from raft.types import Batch, ErrorCode, decode_control_record
from tests.sim.cluster import Cluster


def elected(cluster: Cluster) -> int:
    assert cluster.run_until(lambda: cluster.leader() is not None, 5_000)
    leader = cluster.leader()
    assert leader is not None
    return leader.node_id


@pytest.mark.parametrize("voters", [1, 3, 5])
def test_election_then_propose_commits_on_every_replica(voters: int) -> None:
    cluster = Cluster(seed=7, voters=voters, observers=1)
    leader_id = elected(cluster)
    proposal = cluster.propose((b"x", b"y", b"z"))
    assert proposal is not None
    assert proposal.last_offset == proposal.base_offset + 2
    assert cluster.run_until(lambda: all(
        n.core is not None and n.core.high_watermark > proposal.last_offset for n in cluster.nodes.values()
    ), 5_000)
    for node in cluster.nodes.values():
        assert node.core is not None
        assert node.core.leader_id == leader_id
        assert node.core.epoch == cluster.nodes[leader_id].core.epoch  # type: ignore[union-attr]
        records = [r for b in node.log.read(0, 1 << 20) if not b.control for r in b.records]
        assert records == [b"x", b"y", b"z"]
    # The leader's own epoch starts with a LeaderChange control record.
    first = cluster.nodes[leader_id].log.read(0, 1 << 20)[0]
    assert first.control and decode_control_record(first.records[0])["leader_id"] == leader_id


def test_observer_never_votes_nor_counts() -> None:
    cluster = Cluster(seed=3, voters=3, observers=2)
    elected(cluster)
    cluster.run_for(2_000)
    for node_id in (4, 5):
        core = cluster.nodes[node_id].core
        assert core is not None and not core.is_voter
        assert core.role == Role.FOLLOWER
    leader = cluster.leader()
    assert leader is not None and leader.core is not None
    quorum = leader.core.describe_quorum(cluster.now_ms)
    assert [r.replica_id for r in quorum.voters] == [leader.node_id] + sorted({1, 2, 3} - {leader.node_id})
    assert [r.replica_id for r in quorum.observers] == [4, 5]


def test_high_watermark_needs_a_majority_of_flushed_offsets() -> None:
    cluster = Cluster(seed=11, voters=3)
    leader_id = elected(cluster)
    followers = sorted(cluster.voter_ids - {leader_id})
    cluster.run_for(500)
    leader = cluster.nodes[leader_id].core
    assert leader is not None
    before = leader.high_watermark
    cluster.partition({leader_id}, set(followers))  # nobody can acknowledge
    proposal = cluster.propose((b"lonely",))
    assert proposal is not None
    cluster.run_for(30)  # well inside the fetch timeout: no election
    assert leader.high_watermark == before  # flushed locally, but not on a majority
    cluster.heal()
    assert cluster.run_until(lambda: cluster.is_committed(proposal), 5_000)


def test_propose_on_a_follower_names_the_leader() -> None:
    cluster = Cluster(seed=5, voters=3)
    leader_id = elected(cluster)
    cluster.run_for(300)
    follower = cluster.nodes[min(cluster.voter_ids - {leader_id})].core
    assert follower is not None
    with pytest.raises(NotLeaderError) as info:
        follower.propose(cluster.now_ms, [b"a"])
    assert info.value.leader_id == leader_id
    assert info.value.leader_endpoint == f"http://node{leader_id}"
    with pytest.raises(NotLeaderError):
        follower.read_index(cluster.now_ms)


def test_group_commit_and_bounded_accumulator() -> None:
    cluster = Cluster(seed=2, voters=1, config_overrides={"max_pending_records": 5})
    elected(cluster)
    cluster.run_for(50)
    core = cluster.nodes[1].core
    assert core is not None
    first = core.propose(cluster.now_ms, [b"a"])  # appended at once, a flush starts
    second = core.propose(cluster.now_ms, [b"b", b"c"])  # flush in flight: accumulates
    third = core.propose(cluster.now_ms, [b"d"])
    assert (second.base_offset, second.last_offset) == (first.last_offset + 1, first.last_offset + 2)
    assert third.base_offset == second.last_offset + 1
    with pytest.raises(ProposalRejectedError):
        core.propose(cluster.now_ms, [b"1", b"2", b"3", b"4", b"5"])
    cluster.after_input(cluster.nodes[1])
    assert cluster.run_until(lambda: core.high_watermark > third.last_offset, 1_000)
    data = [b for b in cluster.nodes[1].log.read(0, 1 << 20) if not b.control]
    assert [b.records for b in data] == [(b"a",), (b"b", b"c", b"d")]  # one batch for the two waiting


def test_proposal_larger_than_a_batch_is_rejected() -> None:
    cluster = Cluster(seed=2, voters=1, config_overrides={"max_batch_bytes": 200})
    elected(cluster)
    core = cluster.nodes[1].core
    assert core is not None
    with pytest.raises(ProposalRejectedError, match="max_batch_bytes"):
        core.propose(cluster.now_ms, [b"x" * 300])


def test_read_index_completes_after_quorum_confirms() -> None:
    cluster = Cluster(seed=9, voters=3)
    leader_id = elected(cluster)
    proposal = cluster.propose((b"v",))
    assert proposal is not None
    assert cluster.run_until(lambda: cluster.is_committed(proposal), 5_000)
    node = cluster.nodes[leader_id]
    assert node.core is not None
    token = node.core.read_index(cluster.now_ms)
    cluster.after_input(node)
    assert cluster.run_until(lambda: any(t == token for _, t, _ in cluster.reads_done), 2_000)
    offset = next(o for _, t, o in cluster.reads_done if t == token)
    assert offset > proposal.last_offset


def test_read_index_fails_without_a_quorum() -> None:
    cluster = Cluster(seed=4, voters=3)
    leader_id = elected(cluster)
    cluster.run_for(300)
    node = cluster.nodes[leader_id]
    assert node.core is not None
    cluster.partition({leader_id}, cluster.voter_ids - {leader_id})
    token = node.core.read_index(cluster.now_ms)
    failed: list[int] = []
    original = node.core.take_ready

    def spy():  # type: ignore[no-untyped-def]
        ready = original()
        failed.extend(ready.reads_failed)
        return ready

    node.core.take_ready = spy  # type: ignore[method-assign]
    cluster.after_input(node)
    assert cluster.run_until(lambda: token in failed, 2_000)  # check-quorum resigns the leader
    assert not any(t == token for _, t, _ in cluster.reads_done)


def test_a_leader_that_steps_down_counts_its_last_contact_from_then() -> None:
    """X-Last-Contact-Ms on a partitioned leader that resigned: time since it stopped being
    leader (it was in contact with the leader, itself, until then), not since the last
    Fetch answer it received as a follower before it was elected."""
    cluster = Cluster(seed=4, voters=3)
    leader_id = elected(cluster)
    cluster.run_for(5_000)  # a long leadership: its follower days are long past
    node = cluster.nodes[leader_id]
    assert node.core is not None and node.core.last_contact_ms(cluster.now_ms) == 0
    cluster.partition({leader_id}, cluster.voter_ids - {leader_id})
    assert cluster.run_until(lambda: node.core is not None and node.core.role != Role.LEADER, 5_000)
    stepped_down_ms = cluster.now_ms
    cluster.run_for(100)
    assert node.core.last_contact_ms(cluster.now_ms) <= cluster.now_ms - stepped_down_ms


def _node(voters: frozenset[int], node_id: int = 1, log: MemoryLog | None = None,
          persisted: QuorumStateRecord | None = None, tombstone_retention_records: int = 0) -> RaftNode:
    config = RaftConfig(node_id=node_id, voters=voters, endpoint=f"http://n{node_id}",
                        tombstone_retention_records=tombstone_retention_records)
    return RaftNode(config, log or MemoryLog(), persisted, random.Random(1), MemorySnapshotStore(), 0)


def test_restart_rules() -> None:
    voters = frozenset({1, 2, 3})
    assert _node(voters, persisted=QuorumStateRecord(4, 1, 1)).role == Role.RESIGNED
    log = MemoryLog()
    log.append(Batch(0, 6, 0, False, (b"a",)))
    node = _node(voters, log=log, persisted=QuorumStateRecord(4, 2, 2))
    assert (node.role, node.epoch) == (Role.UNATTACHED, 6)
    assert node.take_ready().quorum_state == QuorumStateRecord(6, -1, -1)
    follower = _node(voters, persisted=QuorumStateRecord(4, -1, 2))
    assert (follower.role, follower.leader_id) == (Role.FOLLOWER, 2)
    assert isinstance(follower.take_ready().messages[0].message, FetchRequest)


def test_vote_granted_once_per_epoch_and_only_to_an_up_to_date_log() -> None:
    voters = frozenset({1, 2, 3})
    log = MemoryLog()
    log.append(Batch(0, 2, 0, False, (b"a", b"b")))
    node = _node(voters, log=log, persisted=QuorumStateRecord(2, -1, -1))
    node.take_ready()
    node.handle(10, Envelope(2, 1, VoteRequest(3, 2, 2, 1, False)))  # shorter log
    ready = node.take_ready()
    assert ready.messages[0].message == VoteResponse(ErrorCode.NONE, 3, -1, False, False)
    node.handle(11, Envelope(3, 1, VoteRequest(3, 3, 2, 2, False)))
    ready = node.take_ready()
    assert ready.quorum_state == QuorumStateRecord(3, 3, -1)
    assert ready.messages[0].message.vote_granted  # type: ignore[union-attr]
    node.handle(12, Envelope(2, 1, VoteRequest(3, 2, 2, 5, False)))  # already voted for 3
    assert not node.take_ready().messages[0].message.vote_granted  # type: ignore[union-attr]


def test_follower_refuses_pre_vote_while_its_leader_is_alive() -> None:
    voters = frozenset({1, 2, 3})
    node = _node(voters, persisted=QuorumStateRecord(1, -1, 2))
    node.take_ready()
    node.handle(5, Envelope(2, 1, FetchResponse(ErrorCode.NONE, 1, 2, "http://n2", 0, 0, 0, 0, 0, (), -1, -1, None,
                                                          fetch_epoch=0)))
    node.take_ready()
    node.handle(10, Envelope(3, 1, VoteRequest(2, 3, 0, 0, True)))
    ready = node.take_ready()
    assert not ready.messages[0].message.vote_granted  # type: ignore[union-attr]
    assert ready.quorum_state is None and node.epoch == 1


@pytest.mark.parametrize("message", [
    FetchRequest(1, 2, -5, 0, 0, 10, ""),
    FetchRequest(1, 2, 0, 9, 0, 10, ""),  # last fetched epoch above the epoch
    VoteRequest(-1, 2, 0, 0, False),
    VoteRequest(9, 2, 10, 0, False),
    VoteRequest(9, 7, 0, 0, False),  # not a voter
    BeginQuorumEpochRequest(9, 7, ""),  # not a voter
    FetchResponse(ErrorCode.NONE, 1, 2, "", -1, -3, 0, 0, 0, (), -1, -1, None),
])
def test_bad_input_is_answered_or_dropped_and_changes_nothing(message: object) -> None:
    node = _node(frozenset({1, 2, 3}), persisted=QuorumStateRecord(1, -1, -1))
    node.take_ready()
    src = 7 if isinstance(message, (BeginQuorumEpochRequest,)) or getattr(message, "candidate_id", 0) == 7 else 2
    node.handle(5, Envelope(src, 1, message))  # type: ignore[arg-type]
    ready = node.take_ready()
    assert ready.quorum_state is None
    assert node.epoch == 1 and node.role == Role.UNATTACHED
    for envelope in ready.messages:
        assert getattr(envelope.message, "error", ErrorCode.NONE) != ErrorCode.NONE


def _leader_of_three(tombstone_retention_records: int = 0) -> tuple[RaftNode, MemoryLog]:
    """Node 1 elected by node 2's (pre-)votes, its LeaderChange record flushed and acked."""
    log = MemoryLog()
    node = _node(frozenset({1, 2, 3}), log=log, tombstone_retention_records=tombstone_retention_records)
    node.tick(node.next_deadline_ms())
    assert node.role == Role.PROSPECTIVE
    node.handle(2_000, Envelope(2, 1, VoteResponse(ErrorCode.NONE, 0, -1, True, True)))
    assert node.role == Role.CANDIDATE
    node.handle(2_001, Envelope(2, 1, VoteResponse(ErrorCode.NONE, 1, -1, True, False)))
    assert node.role == Role.LEADER
    log.flush()
    node.on_flushed(2_002)
    node.handle(2_003, Envelope(2, 1, FetchRequest(1, 2, 1, 1, 0, 0, "")))
    assert node.high_watermark == 1
    node.take_ready()
    return node, log


def test_read_index_ignores_a_fetch_sent_before_the_call() -> None:
    node, _ = _leader_of_three()
    token = node.read_index(2_010)
    ready = node.take_ready()
    assert ready.reads_done == []
    # A delayed or duplicated Fetch from before the call echoes an older nonce: no confirmation.
    node.handle(2_011, Envelope(2, 1, FetchRequest(1, 2, 1, 1, 1, 0, "", 0)))
    ready = node.take_ready()
    assert ready.reads_done == []
    answer = ready.messages[0].message
    assert isinstance(answer, FetchResponse) and answer.read_nonce == 1
    node.handle(2_012, Envelope(2, 1, FetchRequest(1, 2, 1, 1, 1, 0, "", answer.read_nonce)))
    assert node.take_ready().reads_done == [(token, 1)]


def test_leader_computes_dirty_offset_and_tombstone_horizon() -> None:
    node, log = _leader_of_three()
    proposal = node.propose(2_020, [b"a", b"b"])
    log.flush()
    node.on_flushed(2_021)
    node.handle(2_022, Envelope(2, 1, FetchRequest(1, 2, 3, 1, 1, 0, "")))
    assert node.high_watermark == proposal.last_offset + 1
    assert node.dirty_offset == 0 and node.tombstone_horizon == 0  # voter 3 not heard from yet
    node.handle(2_023, Envelope(3, 1, FetchRequest(1, 3, 1, 1, 1, 0, "")))
    ready = node.take_ready()
    assert (node.dirty_offset, node.tombstone_horizon) == (1, 1)  # min over voters: voter 3 at 1
    answers = [e.message for e in ready.messages if isinstance(e.message, FetchResponse)]
    assert answers and answers[-1].dirty_offset == 1 and answers[-1].tombstone_horizon == 1


def test_a_single_voter_learns_its_dirty_offset_without_any_fetcher() -> None:
    """The dirty offset used to move only when the leader answered a fetch, so a one-node
    cluster (nobody fetches) never cleaned its log."""
    cluster = Cluster(seed=5, voters=1)
    leader_id = elected(cluster)
    proposal = cluster.propose((b"a", b"b", b"c"))
    assert proposal is not None
    core = cluster.nodes[leader_id].core
    assert core is not None
    assert cluster.run_until(lambda: core.high_watermark > proposal.last_offset, 2_000)
    assert core.dirty_offset == core.tombstone_horizon == core.high_watermark == proposal.last_offset + 1


@pytest.mark.parametrize("retention", [0, 4])
def test_rebootstrap_rule_spares_fetchers_inside_the_tombstone_retention(retention: int) -> None:
    """docs/compaction.md rule 5 with tombstone_retention_records: the cleaners drop
    tombstones only below min(horizon, cleaned end - retention), so a fetcher at or above that bound continues
    incrementally; one below it (past zero) is sent a snapshot (none exists yet: the leader
    answers SNAPSHOT_NOT_FOUND and asks the runtime for one)."""
    node, log = _leader_of_three(tombstone_retention_records=retention)
    node.propose(2_020, [b"r%d" % index for index in range(10)])
    log.flush()
    node.on_flushed(2_021)
    for voter in (2, 3):
        node.handle(2_022, Envelope(voter, 1, FetchRequest(1, voter, 11, 1, 1, 0, "")))
    assert (node.high_watermark, node.dirty_offset, node.tombstone_horizon) == (11, 11, 11)
    log.replace_prefix(log.batches(), 11)  # cleaned below 11 (content unchanged)
    node.take_ready()
    bound = 11 - retention
    for fetch_offset in (1, bound - 1, bound):
        node.handle(2_030, Envelope(9, 1, FetchRequest(1, 9, fetch_offset, 1, 1, 0, "")))
        answer = node.take_ready().messages[-1].message
        assert isinstance(answer, FetchResponse)
        if fetch_offset < bound:
            assert answer.error == ErrorCode.SNAPSHOT_NOT_FOUND, fetch_offset
            assert node.snapshot_wanted_offset == bound
        else:
            assert answer.error == ErrorCode.NONE and answer.snapshot_id is None, fetch_offset
            assert fetch_offset == 11 or answer.records[0].next_offset > fetch_offset


def test_a_restarted_leader_still_sends_stale_fetchers_a_snapshot_before_hearing_every_voter() -> None:
    """The tombstone horizon lives in memory, so a restarted voter starts without it. Its log
    still holds the prefix it cleaned, tombstones dropped below (at most) its cleaned end;
    elected with one voter still down, it must not serve that prefix to a fetcher from
    below it as if nothing was dropped (the fetcher would keep the deleted keys forever)."""
    node, log = _leader_of_three()
    node.propose(2_020, [b"r%d" % index for index in range(10)])
    log.flush()
    node.on_flushed(2_021)
    for voter in (2, 3):
        node.handle(2_022, Envelope(voter, 1, FetchRequest(1, voter, 11, 1, 1, 0, "")))
    log.replace_prefix(log.batches(), 11)
    restarted_log = log.reopen()
    restarted = _node(frozenset({1, 2, 3}), log=restarted_log, persisted=QuorumStateRecord(1, 1, 1))
    now = 10_000
    while restarted.role != Role.PROSPECTIVE:
        now = max(now, restarted.next_deadline_ms())
        restarted.tick(now)
    restarted.handle(now + 1, Envelope(2, 1, VoteResponse(ErrorCode.NONE, 1, -1, True, True)))
    restarted.handle(now + 2, Envelope(2, 1, VoteResponse(ErrorCode.NONE, 2, -1, True, False)))
    assert restarted.role == Role.LEADER  # voter 3 is down: never heard from in this epoch
    restarted.take_ready()
    for fetch_offset in (1, 10):
        restarted.handle(now + 3, Envelope(9, 1, FetchRequest(2, 9, fetch_offset, 1, 1, 0, "")))
        answer = restarted.take_ready().messages[-1].message
        assert isinstance(answer, FetchResponse)
        assert answer.error == ErrorCode.SNAPSHOT_NOT_FOUND and not answer.records, (fetch_offset, answer)
    assert restarted.snapshot_wanted_offset == 11


def test_high_watermark_waits_for_an_entry_of_the_leaders_own_epoch() -> None:
    """Raft's figure-8 rule: a majority holding only older-epoch entries commits nothing."""
    log = MemoryLog()
    log.append(Batch(0, 1, 0, True, (b"leader-change",)))
    log.append(Batch(1, 1, 0, False, (b"a", b"b", b"c")))  # offsets 1..3, epoch 1, uncommitted
    log.flush()
    node = _node(frozenset({1, 2, 3}), log=log, persisted=QuorumStateRecord(2, -1, -1))
    node.tick(node.next_deadline_ms())
    node.handle(5_000, Envelope(2, 1, VoteResponse(ErrorCode.NONE, 2, -1, True, True)))
    node.handle(5_001, Envelope(2, 1, VoteResponse(ErrorCode.NONE, 3, -1, True, False)))
    assert (node.role, node.epoch) == (Role.LEADER, 3)
    log.flush()  # the LeaderChange record of epoch 3 is at offset 4
    node.on_flushed(5_002)
    # Voter 2 holds offsets 0..3 (epoch 1) and fetches from 4: a majority holds 0..3 ...
    node.handle(5_003, Envelope(2, 1, FetchRequest(3, 2, 4, 1, 0, 0, "")))
    assert node.high_watermark == 0  # ... but nothing of epoch 3 is on a majority yet
    node.handle(5_004, Envelope(2, 1, FetchRequest(3, 2, 5, 3, 0, 0, "")))
    assert node.high_watermark == 5


@pytest.mark.parametrize("seed", range(10))
def test_followers_of_an_idle_leader_time_out_apart_and_elect_one_leader(seed: int) -> None:
    """An idle leader answers both parked fetches at the same moment, so when it dies both
    followers would time out together and split the vote (granting each other's pre-vote,
    both become candidates). Each FollowerState draws its own fetch timeout in
    [fetch_timeout_ms, fetch_timeout_ms + election_timeout_ms]: when the two draws are a
    few message hops apart, the first round wins; when they are not, the split costs one
    candidate round."""
    from tests.sim.cluster import NetworkFaults
    cluster = Cluster(seed=seed, voters=3, faults=NetworkFaults(delay_min_ms=1, delay_max_ms=1,
                                                                 flush_min_ms=1, flush_max_ms=1))
    old_leader = elected(cluster)
    old_epoch = cluster.nodes[old_leader].core.epoch  # type: ignore[union-attr]
    cluster.run_for(1_000)  # idle: fetches parked and answered together
    followers = [cluster.nodes[n].core._state for n in sorted(cluster.voter_ids - {old_leader})]  # type: ignore[union-attr]
    assert followers[0].last_contact_ms == followers[1].last_contact_ms  # in step
    timeouts = [f.fetch_timeout_ms for f in followers]  # type: ignore[union-attr]
    assert all(200 <= t <= 200 + 100 for t in timeouts)
    crashed_ms = cluster.now_ms
    cluster.crash(old_leader)
    assert cluster.run_until(lambda: cluster.leader() is not None, 5_000)
    new_leader = cluster.leader()
    assert new_leader is not None and new_leader.core is not None
    if abs(timeouts[0] - timeouts[1]) >= 3:  # pre-vote, answer and vote take 3 hops of 1 ms
        assert new_leader.core.epoch == old_epoch + 1  # one election: nobody split the vote
        # fetch timeout 200 ms + jitter, at most one park of 50 ms before it, a few hops
        assert cluster.now_ms - crashed_ms <= 200 + 100 + 50 + 30
    else:  # one split round: a candidate timeout (at most 200 ms) more
        assert new_leader.core.epoch <= old_epoch + 2
        assert cluster.now_ms - crashed_ms <= 200 + 100 + 50 + 200 + 30


def test_a_lower_id_cut_off_from_the_rest_does_not_block_the_election() -> None:
    """Five voters, 4 and 5 down, the link between 1 and 3 cut: only 2 reaches a majority
    (1, 2, 3). Node 1 hears only 2 (a grant, never a rejection); had it refused 2's equal-log
    pre-vote in every round, nobody would ever be elected (a review found exactly that)."""
    for seed in range(3):
        cluster = Cluster(seed=seed, voters=5)
        cluster.crash(4)
        cluster.crash(5)
        cluster.partition({1}, {3})
        assert cluster.run_until(lambda c=cluster: c.leader() is not None, 30_000), f"seed {seed}: no leader"
        assert cluster.leader().node_id == 2  # type: ignore[union-attr]


def _prospective(node_id: int, leader_id: int = 1) -> RaftNode:
    """A voter of {1, 2, 3} in epoch 1 with an empty log that just started its pre-vote
    round: after its fetch timeout on ``leader_id``, or (-1) with no leader known."""
    node = _node(frozenset({1, 2, 3}), node_id=node_id, persisted=QuorumStateRecord(1, -1, leader_id))
    while node.role != Role.PROSPECTIVE:
        node.tick(node.next_deadline_ms())
    assert node.leader_id in (leader_id, -1)
    node.take_ready()
    return node


def _pre_vote_answer(node: RaftNode, src: int, last_offset: int = 0) -> bool:
    node.handle(node.next_deadline_ms() - 1, Envelope(src, node.node_id, VoteRequest(2, src, 0, last_offset, True)))
    [envelope] = node.take_ready().messages
    return envelope.message.vote_granted  # type: ignore[union-attr]


def test_prospectives_grant_equal_logs_whatever_their_ids() -> None:
    """No tie-break by node id (it re-armed every round and could stall an election for
    seconds when the lower id could not win): the jittered fetch timeout separates rounds."""
    assert _pre_vote_answer(_prospective(2), src=3)  # equal log, higher id
    assert _pre_vote_answer(_prospective(2), src=1)  # equal log, lower id
    assert _pre_vote_answer(_prospective(2, leader_id=-1), src=3)
