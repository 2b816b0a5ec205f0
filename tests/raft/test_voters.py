"""Rule 13 (KIP-853): the voter set in the log, directory ids, and the leader's changes.

Most tests drive one leader directly with the messages its peers would send, so each gate
and count is exercised exactly; ``Net`` runs a few whole nodes without faults for the
flows (an added voter, a leader removing itself)."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest

from raft.log import MemoryLog, QuorumStateRecord
from raft.messages import (
    BeginQuorumEpochRequest,
    BeginQuorumEpochResponse,
    Envelope,
    FetchRequest,
    FetchResponse,
    VoteRequest,
    VoteResponse,
)
from raft.node import RaftConfig, RaftNode, Role
from raft.snapshots import MemorySnapshotStore
from raft.types import CONTROL_LEADER_CHANGE, Batch, ErrorCode, SnapshotId, encode_control_record
from raft.voters import Voter, VoterChangeError, VoterSet, bootstrap_batch
from storage.quorum_state import CorruptQuorumStateError, QuorumStateFile, encode_quorum_state
from tests.sim.cluster import sim_config

DIRS = {replica: uuid.UUID(int=replica).hex for replica in range(1, 8)}
NEW_DIR = uuid.UUID(int=99).hex  # a replaced disk


def voter(replica: int, directory: str | None = None) -> Voter:
    return Voter(replica, DIRS[replica] if directory is None else directory, f"raft://{replica}", f"http://{replica}")


def voters(*replicas: int) -> VoterSet:
    return VoterSet(tuple(voter(r) for r in replicas))


def config(node_id: int, initial: VoterSet | None, directory: str | None = None) -> RaftConfig:
    base = sim_config(node_id, frozenset(initial.ids) if initial else frozenset({1, 2, 3}))
    return RaftConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__},
                         "directory_id": DIRS[node_id] if directory is None else directory,
                         "initial_voters": initial})


def messages(node: RaftNode) -> list[Envelope]:
    return node.take_ready().messages


def fetch(node: RaftNode, now_ms: int, src: int, offset: int, last_epoch: int, directory: str | None = None,
          read_nonce: int = 0) -> FetchResponse:
    request = FetchRequest(node.epoch, src, offset, last_epoch, 0, 0, "", read_nonce, 0,
                           DIRS[src] if directory is None else directory)
    node.handle(now_ms, Envelope(src, node.node_id, request))
    answers = [e.message for e in messages(node) if isinstance(e.message, FetchResponse)]
    assert len(answers) <= 1
    return answers[0] if answers else FetchResponse(ErrorCode.NONE, 0, 0, "", 0, 0, 0, 0, 0, (), -1, -1, None)


def flush(node: RaftNode, log: MemoryLog, now_ms: int) -> None:
    log.flush()
    node.on_flushed(now_ms)


def elect(node: RaftNode, log: MemoryLog, peers: list[int], now_ms: int = 10_000) -> None:
    """Win pre-vote and vote with the grants of ``peers``."""
    node.tick(now_ms)
    epoch = node.epoch
    for peer in peers:
        node.handle(now_ms + 1, Envelope(peer, node.node_id, VoteResponse(ErrorCode.NONE, epoch, -1, True, True)))
    for peer in peers:
        node.handle(now_ms + 2, Envelope(peer, node.node_id, VoteResponse(ErrorCode.NONE, epoch + 1, -1, True, False)))
    assert node.role == Role.LEADER
    flush(node, log, now_ms + 3)
    messages(node)


def leader_of(initial: VoterSet, ready: bool = True,
              snapshots: MemorySnapshotStore | None = None) -> tuple[RaftNode, MemoryLog]:
    """Node 1 leads a log formatted with ``initial``; ``ready``: the others fetched its
    LeaderChange record, so an entry of its epoch is committed (offsets 0-1 bootstrap, 2
    LeaderChange)."""
    log = MemoryLog()
    node = RaftNode(config(1, initial), log, None, random.Random(1), snapshots or MemorySnapshotStore(), 0)
    elect(node, log, sorted(initial.ids - {1}))
    assert log.end_offset() == 3
    if ready:
        for peer in sorted(initial.ids - {1}):
            fetch(node, 10_010, peer, 3, 1)
        assert node.high_watermark == 3
    return node, log


# ------------------------------------------------------------------ the set and its codec


def test_a_voter_set_round_trips_and_matches_directories() -> None:
    three = voters(3, 1, 2)
    assert [v.replica_id for v in three.voters] == [1, 2, 3] and three.majority == 2
    assert VoterSet.decode(three.encode()) == three
    assert three.contains(2, DIRS[2]) and not three.contains(2, NEW_DIR) and not three.contains(4, DIRS[4])
    static = VoterSet.static({1, 2, 3})
    assert static.contains(2, NEW_DIR) and static.contains(2, "")  # "" (static) matches any directory
    assert three.with_voter(voter(4)).ids == {1, 2, 3, 4} and three.without(1).ids == {2, 3}
    with pytest.raises(ValueError):
        VoterSet.decode(VoterSet((Voter(1, "not-hex", ""),)).encode())
    with pytest.raises(ValueError):
        VoterSet((voter(1), voter(1)))


def test_formatting_writes_the_initial_set_at_offset_0_and_directories_decide_who_votes() -> None:
    log = MemoryLog()
    node = RaftNode(config(2, voters(1, 2, 3)), log, None, random.Random(1), MemorySnapshotStore(), 0)
    assert log.read(0, 1 << 20)[0] == bootstrap_batch(voters(1, 2, 3))
    assert node.voter_set == voters(1, 2, 3) and node.is_voter
    replaced = RaftNode(config(2, voters(1, 2, 3), NEW_DIR), MemoryLog(), None, random.Random(1),
                        MemorySnapshotStore(), 0)
    assert not replaced.is_voter  # same id, new disk: an observer until added
    replaced.tick(10_000)
    assert replaced.role == Role.UNATTACHED  # it never campaigns
    assert all(not isinstance(e.message, VoteRequest) for e in messages(replaced))


def test_a_static_cluster_changes_nothing_and_refuses_with_kraft_version_0() -> None:
    log = MemoryLog()
    node = RaftNode(sim_config(1, frozenset({1, 2, 3})), log, None, random.Random(1), MemorySnapshotStore(), 0)
    elect(node, log, [2, 3])
    assert log.end_offset() == 1  # only the LeaderChange record: no voters record
    for peer in (2, 3):
        fetch(node, 10_010, peer, 1, 1)
    with pytest.raises(VoterChangeError) as info:
        node.remove_voter(3, "", 10_020)
    assert info.value.code == "kraft-version-0"
    assert node.voter_set == VoterSet.static({1, 2, 3}) and node.pending_voter_change is None


# ------------------------------------------------------------------ the leader's gates


def code_of(call: object) -> str:
    with pytest.raises(VoterChangeError) as info:
        call()  # type: ignore[operator]
    return info.value.code


def test_every_gate_refuses_with_its_code_and_changes_nothing() -> None:
    log = MemoryLog()
    follower = RaftNode(config(2, voters(1, 2, 3)), log, None, random.Random(1), MemorySnapshotStore(), 0)
    assert code_of(lambda: follower.add_voter(voter(4), 0)) == "not-leader"

    node, log = leader_of(voters(1, 2, 3), ready=False)
    assert code_of(lambda: node.add_voter(voter(4), 10_020)) == "leader-not-ready"
    for peer in (2, 3):
        fetch(node, 10_030, peer, 3, 1)
    assert code_of(lambda: node.add_voter(voter(2), 10_040)) == "already-voter"
    assert code_of(lambda: node.add_voter(voter(4), 10_040)) == "not-caught-up"  # never fetched
    fetch(node, 10_050, 4, 1, 0)  # an observer below the high watermark (3)
    assert code_of(lambda: node.add_voter(voter(4), 10_060)) == "not-caught-up"
    fetch(node, 10_070, 4, 3, 1, NEW_DIR)  # caught up, but another directory than the one named
    assert code_of(lambda: node.add_voter(voter(4), 10_080)) == "not-caught-up"
    fetch(node, 10_090, 4, 3, 1)
    assert code_of(lambda: node.add_voter(voter(4), 10_090 + 200)) == "not-caught-up"  # fetch_timeout_ms ago
    assert code_of(lambda: node.remove_voter(5, "", 10_100)) == "unknown-voter"
    assert code_of(lambda: node.remove_voter(3, NEW_DIR, 10_100)) == "unknown-voter"
    assert node.voter_set == voters(1, 2, 3) and log.end_offset() == 3

    offset = node.add_voter(voter(4), 10_100)
    assert offset == 3 and node.pending_voter_change == 3 and node.voter_set == voters(1, 2, 3, 4)
    assert code_of(lambda: node.remove_voter(2, "", 10_110)) == "change-pending"
    assert code_of(lambda: node.add_voter(voter(5), 10_110)) == "change-pending"

    single, _ = leader_of(voters(1))
    assert code_of(lambda: single.remove_voter(1, DIRS[1], 10_200)) == "last-voter"


def test_proposals_waiting_in_the_accumulator_keep_their_offsets_before_a_voters_record() -> None:
    node, log = leader_of(voters(1, 2, 3))
    fetch(node, 10_020, 4, 3, 1)
    first = node.propose(10_030, [b"a"])  # appended, a flush starts
    second = node.propose(10_030, [b"b"])  # waits for that flush
    offset = node.add_voter(voter(4), 10_030)
    assert (first.base_offset, second.base_offset, offset) == (3, 4, 5)
    assert [b.records for b in log.read(3, 1 << 20)][:2] == [(b"a",), (b"b",)]


# ------------------------------------------------------------------ counting with the set in force


def test_the_high_watermark_never_goes_back_when_the_set_grows() -> None:
    node, log = leader_of(voters(1, 2, 3))
    fetch(node, 10_020, 4, 3, 1)  # observer 4 caught up at 3
    proposal = node.propose(10_030, [b"x%d" % i for i in range(5)])
    flush(node, log, 10_031)
    fetch(node, 10_040, 3, proposal.last_offset + 1, 1)  # 3 holds it; 2 lags at 3
    assert node.high_watermark == 8
    # 4 was caught up within fetch_timeout_ms (at 3): the add is allowed; with 2 and 4 at 3,
    # three of four hold only 3 now, yet the high watermark stays.
    node.add_voter(voter(4), 10_050)
    flush(node, log, 10_051)
    assert node.high_watermark == 8
    fetch(node, 10_060, 2, 9, 1)
    assert node.high_watermark == 8
    fetch(node, 10_061, 3, 9, 1)  # 1, 2 and 3 hold the record at 8: three of four, committed
    assert node.high_watermark == 9 and node.pending_voter_change is None


def test_a_removed_voter_is_never_counted() -> None:
    node, log = leader_of(voters(1, 2, 3))
    offset = node.remove_voter(3, DIRS[3], 10_020)
    flush(node, log, 10_021)
    fetch(node, 10_030, 3, offset + 1, 1)  # 3 holds the record, but it is out of the set
    assert node.high_watermark == 3
    fetch(node, 10_040, 2, offset + 1, 1)
    assert node.high_watermark == offset + 1
    node.propose(10_050, [b"y"])
    flush(node, log, 10_051)
    fetch(node, 10_060, 3, offset + 2, 1)  # the removed voter holds it: not committed
    assert node.high_watermark == offset + 1
    token = node.read_index(10_070)  # nor does it confirm reads
    messages(node)
    node.handle(10_080, Envelope(3, 1, FetchRequest(1, 3, offset + 2, 1, 0, 0, "", 10**6, 0, DIRS[3])))
    assert token not in dict(node.take_ready().reads_done)
    node.handle(10_090, Envelope(2, 1, FetchRequest(1, 2, offset + 1, 1, 0, 0, "", 10**6, 0, DIRS[2])))
    assert token in dict(node.take_ready().reads_done)


def test_a_replica_with_another_directory_neither_counts_nor_votes() -> None:
    node, log = leader_of(voters(1, 2, 3))
    node.propose(10_020, [b"z"])
    flush(node, log, 10_021)
    fetch(node, 10_030, 2, 4, 1, NEW_DIR)  # replica 2 on a replaced disk
    assert node.high_watermark == 3
    log2 = MemoryLog()
    other = RaftNode(config(2, voters(1, 2, 3)), log2, None, random.Random(2), MemorySnapshotStore(), 0)
    messages(other)
    other.handle(10_000, Envelope(3, 2, VoteRequest(5, 3, 0, 2, False, DIRS[3], NEW_DIR)))  # meant for another 2
    answer = messages(other)[0].message
    assert isinstance(answer, VoteResponse) and answer.error == ErrorCode.INCONSISTENT_VOTER_SET
    other.handle(10_000, Envelope(1, 2, BeginQuorumEpochRequest(5, 1, "", NEW_DIR)))
    answer = messages(other)[0].message
    assert isinstance(answer, BeginQuorumEpochResponse) and answer.error == ErrorCode.INCONSISTENT_VOTER_SET


def test_a_candidate_counts_the_votes_of_the_set_at_its_log_end() -> None:
    log = MemoryLog()
    log.append(bootstrap_batch(voters(1, 2, 3)))
    # An uncommitted record adding 4 and 5 ... one at a time: first 4, at offset 3.
    log.append(Batch(2, 1, 0, True, (encode_control_record(CONTROL_LEADER_CHANGE, leader_id=1),)))
    log.append(Batch(3, 1, 0, True, (voters(1, 2, 3, 4).encode(),)))
    log.flush()
    node = RaftNode(config(1, None), log, QuorumStateRecord(1, -1, -1), random.Random(1),
                    MemorySnapshotStore(), 0)
    assert node.voter_set == voters(1, 2, 3, 4) and node.voter_set_at(3) == voters(1, 2, 3)
    node.tick(10_000)
    asked = sorted(e.dst for e in messages(node) if isinstance(e.message, VoteRequest))
    assert asked == [2, 3, 4]
    for peer in (2, 5):  # 5 is no voter: its grant does not count; 1 + 2 is not 3 of 4
        node.handle(10_001, Envelope(peer, 1, VoteResponse(ErrorCode.NONE, 1, -1, True, True)))
    assert node.role == Role.PROSPECTIVE
    node.handle(10_002, Envelope(4, 1, VoteResponse(ErrorCode.NONE, 1, -1, True, True)))
    assert node.role == Role.CANDIDATE


def test_a_voter_named_by_the_candidate_votes_before_its_log_holds_its_own_record() -> None:
    log = MemoryLog()
    added = RaftNode(config(4, voters(1, 2, 3)), log, None, random.Random(4), MemorySnapshotStore(), 0)
    assert not added.is_voter  # its log holds only the initial set
    messages(added)
    added.handle(10_000, Envelope(2, 4, VoteRequest(2, 2, 1, 5, False, DIRS[2], DIRS[4])))
    answer = messages(added)[0].message
    assert isinstance(answer, VoteResponse) and answer.vote_granted  # else {1,2,3,4} with 1 down could not elect
    added.handle(10_000, Envelope(3, 4, VoteRequest(3, 3, 1, 5, False, DIRS[3], NEW_DIR)))  # another replica 4
    answer = messages(added)[0].message
    assert isinstance(answer, VoteResponse) and answer.error == ErrorCode.INCONSISTENT_VOTER_SET


def test_truncation_undoes_an_uncommitted_voters_record() -> None:
    log = MemoryLog()
    node = RaftNode(config(2, voters(1, 2, 3)), log, QuorumStateRecord(1, -1, 1), random.Random(1),
                    MemorySnapshotStore(), 0)
    messages(node)
    flush(node, log, 1)
    fetches = [e.message for e in messages(node) if isinstance(e.message, FetchRequest)]
    assert fetches and fetches[-1].fetch_offset == 2 and fetches[-1].replica_directory_id == DIRS[2]
    grow = Batch(2, 1, 5, True, (voters(1, 2, 3, 4).encode(),))
    node.handle(10, Envelope(1, 2, FetchResponse(ErrorCode.NONE, 1, 1, "", 2, 2, 0, 0, 0, (grow,), -1, -1, None,
                                                 fetch_epoch=0)))
    assert node.voter_set == voters(1, 2, 3, 4) and node.pending_voter_change == 2
    flush(node, log, 11)
    messages(node)
    # A new leader (epoch 2) never had that record: its epoch 1 ends at 2.
    node.handle(20, Envelope(3, 2, FetchResponse(ErrorCode.NONE, 2, 3, "", 3, 2, 0, 0, 0, (), 1, 2, None,
                                                 fetch_epoch=1)))
    assert log.end_offset() == 2 and node.voter_set == voters(1, 2, 3) and node.pending_voter_change is None


# ------------------------------------------------------------------ snapshots and restarts


def test_a_snapshot_download_carries_the_set_and_a_restart_keeps_it() -> None:
    snapshots = MemorySnapshotStore()
    node, log = leader_of(voters(1, 2, 3), snapshots=snapshots)
    fetch(node, 10_020, 4, 3, 1)
    offset = node.add_voter(voter(4), 10_030)
    flush(node, log, 10_031)
    fetch(node, 10_040, 2, offset + 1, 1)
    fetch(node, 10_041, 3, offset + 1, 1)
    assert node.high_watermark == offset + 1
    assert node.quorum_state.voters[-1][0] == offset  # committed: persisted before it is applied
    snapshot = SnapshotId(offset + 1, 1)
    snapshots.put(snapshot, b"state")  # the runtime takes a snapshot and drops the log below it
    log.record_snapshot(snapshot)
    log.delete_before(offset + 1)
    restarted = RaftNode(config(1, voters(1, 2, 3)), log, node.quorum_state, random.Random(3), snapshots, 20_000)
    assert restarted.voter_set == voters(1, 2, 3, 4)  # the record is gone from the log, not from the state

    answer = fetch(node, 10_050, 5, 0, 0)  # a new replica far behind: it gets the snapshot and the set
    assert answer.snapshot_id == snapshot
    assert (answer.snapshot_voters_offset, VoterSet.decode(answer.snapshot_voters)) == (offset, voters(1, 2, 3, 4))
    log5 = MemoryLog()
    joiner = RaftNode(config(5, None), log5, QuorumStateRecord(1, -1, 1), random.Random(5),
                      MemorySnapshotStore(), 0)
    assert joiner.voter_set == VoterSet.static({1, 2, 3})  # nothing learned yet
    messages(joiner)
    joiner.handle(10_060, Envelope(1, 5, FetchResponse(
        ErrorCode.NONE, 1, 1, "", 0, offset + 1, offset + 1, 0, 0, (), -1, -1, snapshot, fetch_epoch=0,
        snapshot_voters_offset=offset, snapshot_voters=voters(1, 2, 3, 4).encode())))
    ready = joiner.take_ready()
    assert ready.quorum_state is not None and ready.quorum_state.voters[-1][0] == offset  # before any chunk
    assert any(e.message.__class__.__name__ == "FetchSnapshotRequest" for e in ready.messages)


# ------------------------------------------------------------------ whole nodes


class Net:
    """Nodes exchanging every message at once, flushing at once, ticking every ms."""

    def __init__(self, initial: VoterSet, spares: tuple[int, ...] = ()) -> None:
        self.now_ms = 0
        self.nodes: dict[int, RaftNode] = {}
        self.logs: dict[int, MemoryLog] = {}
        self.down: set[int] = set()
        self.durable: dict[int, QuorumStateRecord] = {}
        self.initial = initial
        for node_id in sorted(initial.ids) + list(spares):
            self.logs[node_id] = MemoryLog()
            self.nodes[node_id] = RaftNode(config(node_id, initial), self.logs[node_id], None,
                                           random.Random(node_id), MemorySnapshotStore(), 0)

    def crash_and_restart(self, node_id: int) -> RaftNode:
        """Power loss (what was flushed survives, with the quorum state), then a restart."""
        self.logs[node_id] = self.logs[node_id].reopen()
        self.nodes[node_id] = RaftNode(config(node_id, self.initial), self.logs[node_id], self.durable.get(node_id),
                                       random.Random(node_id + 100), MemorySnapshotStore(), self.now_ms)
        return self.nodes[node_id]

    def run(self, duration_ms: int) -> None:
        for _ in range(duration_ms):
            self.now_ms += 1
            for node_id, node in self.nodes.items():
                if node_id not in self.down:
                    node.tick(self.now_ms)
            self.settle()

    def settle(self) -> None:
        for _ in range(50):
            moved = False
            for node_id, node in self.nodes.items():
                if node_id in self.down:
                    continue
                ready = node.take_ready()
                if ready.quorum_state is not None:
                    self.durable[node_id] = ready.quorum_state
                if ready.flush:
                    self.logs[node_id].flush()
                    node.on_flushed(self.now_ms)
                    moved = True
                for envelope in ready.messages:
                    if envelope.dst in self.nodes and envelope.dst not in self.down:
                        self.nodes[envelope.dst].handle(self.now_ms, envelope)
                        moved = True
            if not moved:
                return

    def leader(self) -> RaftNode:
        leaders = [n for i, n in self.nodes.items() if n.role == Role.LEADER and i not in self.down]
        assert len(leaders) == 1
        return leaders[0]

    def until(self, predicate: object, limit_ms: int = 3_000) -> None:
        for _ in range(limit_ms):
            if predicate():  # type: ignore[operator]
                return
            self.run(1)
        raise AssertionError("condition not reached")


def test_grow_then_the_leader_removes_itself_and_a_new_leader_of_the_new_set_takes_over() -> None:
    net = Net(voters(1, 2, 3), spares=(4,))
    net.until(lambda: any(n.role == Role.LEADER for n in net.nodes.values()) and net.leader().high_watermark > 2)
    net.run(50)
    leader = net.leader()
    offset = leader.add_voter(voter(4), net.now_ms)
    net.until(lambda: leader.high_watermark > offset)
    net.run(50)
    assert all(n.voter_set == voters(1, 2, 3, 4) for n in net.nodes.values())
    assert net.nodes[4].is_voter and net.nodes[4].role == Role.FOLLOWER
    old_id = leader.node_id
    removal = leader.remove_voter(old_id, "", net.now_ms)
    net.until(lambda: leader.role != Role.LEADER)
    assert leader.role == Role.RESIGNED and not leader.is_voter
    net.until(lambda: any(n.role == Role.LEADER for n in net.nodes.values()))
    successor = net.leader()
    assert successor.node_id != old_id and successor.high_watermark > removal
    net.run(500)
    assert leader.role == Role.FOLLOWER and leader.leader_id == successor.node_id  # an observer now
    quorum = successor.describe_quorum(net.now_ms)
    assert sorted(r.replica_id for r in quorum.voters) == sorted({1, 2, 3, 4} - {old_id})
    assert old_id in [r.replica_id for r in quorum.observers]


def test_the_quorum_state_file_keeps_the_committed_voters_records(tmp_path: Path) -> None:
    record = QuorumStateRecord(3, 1, 1, True, False, ((1, voters(1, 2, 3).encode()), (7, voters(1, 2).encode())))
    QuorumStateFile(tmp_path).write(record)
    assert QuorumStateFile(tmp_path).read() == record
    plain = QuorumStateRecord(3, 1, 1, True, False)
    assert b"voters" not in encode_quorum_state(plain)  # files without voters records stay as they were
    (tmp_path / "quorum-state").write_text('{"epoch": 3, "voted_id": 1, "leader_id": 1, "voters": [[1, 5]]}')
    with pytest.raises(CorruptQuorumStateError):
        QuorumStateFile(tmp_path).read()


def test_a_leader_that_crashes_with_its_own_removal_uncommitted_stands_again_to_commit_it() -> None:
    """{1, 2}: the leader appends its own removal and crashes before anyone fetched it. Its
    log says it is no voter, the other's log needs its vote, which a shorter log never gets:
    without rule 13's exception (Raft dissertation 4.2.2) no leader is ever elected."""
    net = Net(voters(1, 2))
    net.until(lambda: any(n.role == Role.LEADER for n in net.nodes.values()) and net.leader().high_watermark > 2)
    net.run(50)
    leader = net.leader()
    other = net.nodes[3 - leader.node_id]
    removal = leader.remove_voter(leader.node_id, "", net.now_ms)
    net.logs[leader.node_id].flush()
    restarted = net.crash_and_restart(leader.node_id)
    assert not restarted.is_voter and restarted.pending_voter_change == removal
    assert other.voter_set == voters(1, 2)
    net.until(lambda: other.role == Role.LEADER and other.high_watermark > removal, 5_000)
    net.run(300)
    assert all(n.voter_set == voters(other.node_id) for n in net.nodes.values())
    assert restarted.role == Role.FOLLOWER and not restarted.is_voter


def test_a_formatted_voter_whose_log_was_lost_still_knows_it_and_the_leader_asks_again() -> None:
    """Rule 12 with formatting: the format writes two records into the empty log, which must
    not hide the loss; and a Fetch from just past them is taken like one from an empty log."""
    node = RaftNode(config(2, voters(1, 2, 3)), MemoryLog(), QuorumStateRecord(4, -1, 1, True, False),
                    random.Random(2), MemorySnapshotStore(), 0)
    assert node.log_lost and node.quorum_state.log_lost
    leader, log = leader_of(voters(1, 2, 3), ready=False)
    node_3_acks = fetch(leader, 10_020, 3, 3, 1)  # 3 holds the LeaderChange record: committed
    leader.propose(10_030, [b"w"])
    flush(leader, log, 10_031)
    assert leader.high_watermark == 3
    # 2 fetched nothing in this epoch yet; a Fetch it sent at 4 is delayed, its log is lost and
    # formatted again, and its first Fetch now comes from just past the bootstrap batch.
    fresh = fetch(leader, 10_040, 2, 2, 0)
    assert fresh.read_nonce > node_3_acks.read_nonce  # it must echo a new nonce before it counts
    fetch(leader, 10_050, 2, 4, 1)  # the Fetch from before the loss arrives: no acknowledgement
    assert leader.high_watermark == 3
