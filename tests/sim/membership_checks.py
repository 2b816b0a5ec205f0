"""Invariants of dynamic voters (KIP-853), checked on every performed Ready of the seeds that
change the voter set (tests/sim/membership.py). A replica is a (node id, directory id)
pair: a node whose disk was replaced is a new replica, and only the one named in a set is
that set's member.

- One change at a time: no log holds more than one voters record that is not committed.
- Consecutive committed voters records differ by exactly one replica.
- Elections: a new leader's set in force at its log end is at most one change from the
  committed set (else two majorities need not intersect: two sets drawn
  by two leaders, each one change from the last committed one), and the votes granted to
  it in its epoch by members of that set are a majority of it. A replica outside the set
  (removed, or a replaced disk's new replica) never counts, the new leader included (a
  replica whose removal is not committed may still be needed to lead: Raft thesis 4.2.2).
- Commits: when the high watermark rises, a majority of the committing leader's set in
  force durably holds it (a replica outside the set never counts; a replaced disk counts
  for what it held when it was replaced). Afterwards no majority of that set may be
  formed of live members lacking it (the static seeds check a plain majority instead).
- Check-quorum counts the leader's set in force (``voters_counted``).
The high watermark never decreasing and every committed record being the same everywhere
are the cluster's own checks (tests/sim/cluster.py), which keep running.
"""

from __future__ import annotations

from raft.log import MemoryLog
from raft.messages import VoteResponse
from raft.node import Ready, Role
from raft.types import CONTROL_VOTERS, decode_control_record
from raft.voters import VoterSet
from tests.sim.cluster import Cluster, InvariantViolation, SimNode


class MembershipChecks:
    """The checks above for one cluster; a broken one raises ``InvariantViolation``."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        # (candidate, epoch) -> the replicas that granted it their vote in that epoch.
        self.grants: dict[tuple[int, int], set[tuple[int, str]]] = {}
        self.commit_set: VoterSet | None = None  # the committing leader's set in force at the last commit
        self.committed_set: VoterSet | None = None  # the latest committed voters record's
        self.tails: dict[int, tuple[int, int, int]] = {}  # node -> (start, end, max HW) at its last tail scan
        # Node -> the voters records its log holds, (offset, epoch, record) by offset, as of
        # ``tails``: kept by reading only what was appended since.
        self.logged: dict[int, list[tuple[int, int, bytes]]] = {}
        self.scanned: dict[int, int] = {}  # node -> the log end when ``logged`` was last brought up to date
        self.log_seen: dict[int, tuple[MemoryLog, int, int]] = {}  # node -> (log, start, end) then
        # Caches: these run after every event. A set in force is the same object until it changes.
        self.decoded: dict[bytes, VoterSet] = {}
        self.current_of: dict[int, tuple[VoterSet, int, list[tuple[int, str]], frozenset[int]]] = {}
        cluster.ready_checks.append(self.check)
        cluster.holders_check = self.check_holders
        cluster.voters_counted = self.voters_counted

    def current(self, voter_set: VoterSet) -> list[tuple[int, str]]:
        """The members whose replica still runs (not replaced since)."""
        return self._current(voter_set)[2]

    def _current(self, voter_set: VoterSet) -> tuple[VoterSet, int, list[tuple[int, str]], frozenset[int]]:
        replaced = len(self.cluster.vanished)
        cached = self.current_of.get(id(voter_set))
        if cached is not None and cached[0] is voter_set and cached[1] == replaced:
            return cached
        nodes = self.cluster.nodes
        found = [(v.replica_id, v.directory_id) for v in voter_set.voters
                 if v.replica_id in nodes and v.directory_id in ("", nodes[v.replica_id].directory_id)]
        entry = self.current_of[id(voter_set)] = (voter_set, replaced, found, frozenset(n for n, _ in found))
        return entry

    def decode(self, record: bytes) -> VoterSet:
        voter_set = self.decoded.get(record)
        if voter_set is None:
            voter_set = self.decoded[record] = VoterSet.decode(record)
        return voter_set

    def voters_counted(self, leader: SimNode) -> tuple[frozenset[int], int]:
        assert leader.core is not None
        voter_set = leader.core.voter_set
        return self._current(voter_set)[3], voter_set.majority

    # ------------------------------------------------------------------ per Ready

    def check(self, node: SimNode, ready: Ready) -> None:
        core = node.core
        if core is None:
            return
        for envelope in ready.messages:
            message = envelope.message
            if isinstance(message, VoteResponse) and message.vote_granted and not message.pre_vote:
                self.grants.setdefault((envelope.dst, message.epoch), set()).add((node.node_id, node.directory_id))
        if ready.role_changed and core.role == Role.LEADER:
            self._check_election(node)
        if core.high_watermark > self.cluster.max_high_watermark:
            self._check_commit(node, core.high_watermark)
        tail = (node.log.start_offset(), node.log.end_offset(), max(self.cluster.max_high_watermark, core.high_watermark))
        before = self.tails.get(node.node_id)
        if before != tail:
            self.tails[node.node_id] = tail
            logged = self._follow_log(node)
            self._check_set_in_force(node, logged)
            self._check_one_uncommitted(node, logged, tail[2])

    def _check_election(self, node: SimNode) -> None:
        core = node.core
        assert core is not None
        voter_set = core.voter_set
        now = self.cluster.now_ms
        committed = self.committed_set
        if committed is not None and len(_members(committed) ^ _members(voter_set)) > 1:
            raise InvariantViolation(f"t={now} node {node.node_id} leads epoch {core.epoch} under {_text(voter_set)}, "
                                     f"more than one change from the committed set {_text(committed)}")
        votes = self.grants.pop((node.node_id, core.epoch), set()) | {(node.node_id, node.directory_id)}
        counted = sorted(vote for vote in votes if voter_set.contains(*vote))
        if len(counted) < voter_set.majority:
            raise InvariantViolation(f"t={now} node {node.node_id} leads epoch {core.epoch} with votes of "
                                     f"{[n for n, _ in counted]} only, no majority of its set in force "
                                     f"{_text(voter_set)} (granted by {sorted(n for n, _ in votes)})")

    def _check_commit(self, node: SimNode, target: int) -> None:
        """``node`` raises the highest high watermark to ``target``: a majority of its set in
        force holds it; the voters records it commits follow one another one change at a time."""
        core = node.core
        assert core is not None
        voter_set = core.voter_set
        holders = [n for n, d in self.current(voter_set) if self.cluster.held_durably(n, target)]
        holders += [n for n, d in _members(voter_set) if self.cluster.vanished.get((n, d), -1) >= target]
        if len(holders) < voter_set.majority:
            raise InvariantViolation(f"t={self.cluster.now_ms} node {node.node_id} committed up to {target} held "
                                     f"durably by {sorted(holders)} only, no majority of its set in force "
                                     f"{_text(voter_set)}")
        self.commit_set = voter_set
        for offset, _, record in _voters_records(node, self.cluster.max_high_watermark, target):
            committed = self.decode(record)
            previous = self.committed_set
            if previous is not None:  # else the first record, written when the log was formatted
                if len(_members(previous) ^ _members(committed)) != 1:
                    raise InvariantViolation(f"t={self.cluster.now_ms} voters record at {offset} changes "
                                             f"{_text(previous)} to {_text(committed)}: not exactly one replica")
                self.cluster.stats["voter_changes_committed"] += 1
            self.committed_set = committed
            self.cluster.former_voters |= committed.ids
            self.cluster.voter_ids = frozenset(committed.ids)
            self.cluster.majority = committed.majority

    def _follow_log(self, node: SimNode) -> list[tuple[int, int, bytes]]:
        """The voters records the node's log holds now: those held before that are still
        there (a truncation, a crash or a snapshot drops some), and any appended since."""
        log = node.log
        start, end = log.start_offset(), log.end_offset()
        logged = self.logged.setdefault(node.node_id, [])
        seen = self.log_seen.get(node.node_id)
        self.log_seen[node.node_id] = (log, start, end)
        if seen is not None and seen[0] is log and seen[1] == start and seen[2] <= end:  # only appended since
            logged.extend(_voters_records(node, seen[2], end))
            self.scanned[node.node_id] = end
            return logged
        scanned = min(self.scanned.get(node.node_id, 0), end)
        while logged and not (start <= logged[-1][0] < end and _holds(node, logged[-1])):
            scanned = min(scanned, logged.pop()[0])  # the log was cut below it, or is another log now
        while logged and logged[0][0] < start:
            logged.pop(0)
        logged.extend(_voters_records(node, max(scanned, start), end))
        self.scanned[node.node_id] = end
        return logged

    def _check_set_in_force(self, node: SimNode, logged: list[tuple[int, int, bytes]]) -> None:
        """The node's set in force, and the one it would use for a decision at its log end,
        are that of the latest voters record its log holds (appending one changes the set at
        once, truncating it undoes the change)."""
        core = node.core
        if not logged or core is None:
            return  # a snapshot covers the latest record: its set is the snapshot's
        offset, _, record = logged[-1]
        expected = _members(self.decode(record))
        end = node.log.end_offset()
        for what, found in (("set in force", core.voter_set), (f"set at its log end {end}", core.voter_set_at(end))):
            if _members(found) != expected:
                raise InvariantViolation(f"t={self.cluster.now_ms} node {node.node_id}'s {what} {_text(found)} is "
                                         f"not that of the latest voters record in its log (offset {offset}: "
                                         f"{_text(self.decode(record))})")

    def _check_one_uncommitted(self, node: SimNode, logged: list[tuple[int, int, bytes]], committed_end: int) -> None:
        """At most one voters record past what is committed (or differing from it) in the log."""
        committed = self.cluster.committed
        uncommitted = [offset for offset, epoch, record in logged if offset >= node.checked_offset and (
            offset >= committed_end or committed.get(offset, (epoch, True, record)) != (epoch, True, record))]
        if len(uncommitted) > 1:
            raise InvariantViolation(f"t={self.cluster.now_ms} node {node.node_id} holds voters records at "
                                     f"{uncommitted}, more than one not committed")

    # ------------------------------------------------------------------ after every event

    def check_holders(self, target: int) -> None:
        """No majority of the set in force at the last commit may be formed of live members
        lacking ``target`` (a replaced disk's old replica can never vote again)."""
        voter_set = self.commit_set
        if voter_set is None:
            return
        lacking = [n for n, _ in self.current(voter_set) if not self.cluster.held_durably(n, target)]
        if len(lacking) >= voter_set.majority:
            raise InvariantViolation(f"t={self.cluster.now_ms} voters {lacking}, a majority of the set in force "
                                     f"{_text(voter_set)}, lack offset {target - 1} below the high watermark")


def _members(voter_set: VoterSet) -> set[tuple[int, str]]:
    return {(voter.replica_id, voter.directory_id) for voter in voter_set.voters}


def _text(voter_set: VoterSet) -> str:
    return "{" + ", ".join(f"{v.replica_id}:{v.directory_id[:6]}" for v in voter_set.voters) + "}"


def _holds(node: SimNode, entry: tuple[int, int, bytes]) -> bool:
    """The node's log still holds this voters record (same offset, epoch and bytes)."""
    offset, epoch, record = entry
    for batch in node.log.read(offset, 1):
        return (batch.base_offset <= offset < batch.next_offset and batch.epoch == epoch
                and batch.records[offset - batch.base_offset] == record)
    return False


def _voters_records(node: SimNode, start: int, end: int) -> list[tuple[int, int, bytes]]:
    """(offset, epoch, record) of every voters record the node's log holds in [start, end)."""
    found: list[tuple[int, int, bytes]] = []
    log = node.log
    start = max(start, log.start_offset())
    if start >= end:
        return found
    for batch in log.read(start, 1 << 30):
        if batch.base_offset >= end:
            break
        if not batch.control:
            continue
        for index, record in enumerate(batch.records):
            offset = batch.base_offset + index
            if start <= offset < end and decode_control_record(record).get("type") == CONTROL_VOTERS:
                found.append((offset, batch.epoch, record))
    return found
