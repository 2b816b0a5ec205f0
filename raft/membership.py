"""The voter set's side of RaftNode (raft/roles.py rule 13, KIP-853): finding the set at a
restart, keeping committed voters records in the quorum state, who may be voted for, and a
leader leaving after its own removal. The set itself and its history: raft/voters.py; the
leader's changes: raft/leader.py; RaftNode (raft/node.py) owns the transitions.
"""

from __future__ import annotations

from dataclasses import replace

from raft.messages import VoteRequest
from raft.node_base import NodeBase
from raft.roles import LeaderState
from raft.types import check
from raft.voters import Voter, VoterChangeError, VoterSet, voters_records

# Batches of this many bytes at most per read when a restart looks for voters records.
_VOTERS_SCAN_BYTES = 4 * 1024 * 1024


class MembershipHandlers(NodeBase):
    """Mixin of RaftNode: the voter set in force across restarts, snapshots and votes."""

    def add_voter(self, voter: Voter, now_ms: int) -> int:
        """Rule 13, leader only: append a voters record adding ``voter`` (an observer that
        has caught up) and return its offset; the change is done once the high watermark
        passes it. Refusals raise ``VoterChangeError``."""
        return self._leader_add_voter(now_ms, self._voter_change_leader(), voter)

    def remove_voter(self, replica_id: int, directory_id: str, now_ms: int) -> int:
        """Rule 13, leader only: append a voters record without ``replica_id`` (directory ""
        matches any) and return its offset. A leader that removes itself resigns once the
        record is committed."""
        return self._leader_remove_voter(now_ms, self._voter_change_leader(), replica_id, directory_id)

    def _voter_change_leader(self) -> LeaderState:
        state = self._state
        if not isinstance(state, LeaderState):
            raise VoterChangeError("not-leader", f"not the leader; leader is {self.leader_id}")
        return state

    @property
    def pending_voter_change(self) -> int | None:
        """The offset of an uncommitted voters record (at most one: rule 13), or None."""
        latest = self._history.latest_offset()
        return latest if latest >= self.high_watermark else None

    def _load_voters(self) -> None:
        """At construction: the voters records of the log, and the committed ones from the
        quorum state (a prefix replaced by a snapshot may have held the latest one)."""
        log = self._log
        offset, end = log.start_offset(), log.end_offset()
        if not self._may_hold_voters_records():
            offset = end
        while offset < end:
            batches = log.read(offset, _VOTERS_SCAN_BYTES)
            if not batches:
                break
            for batch in batches:
                if batch.control:
                    for record_offset, voters in voters_records(batch):
                        self._history.add(record_offset, voters)
            offset = batches[-1].next_offset
        for record_offset, record in self._persisted.voters:
            try:
                self._history.add(record_offset, VoterSet.decode(record))
            except ValueError as exc:
                check(False, f"quorum state holds a bad voters record at {record_offset}: {exc}")
        self._refresh_voters()

    def _may_hold_voters_records(self) -> bool:
        """Is a scan for voters records worth it? A formatted log starts with them at offset
        0, and a log whose prefix was replaced by a snapshot had its committed ones persisted
        first; any other log is a static cluster's, whose whole-log scan would cost a
        restart up to 2.4 times the log's own recovery (100 k single-record batches)."""
        if self._persisted.voters or self.config.initial_voters is not None:
            return True
        log = self._log
        first = log.read(0, 1) if log.start_offset() == 0 else []
        return bool(first) and bool(voters_records(first[0]))

    def _track_voters(self) -> None:
        """Before a Ready is handed out: note newly committed voters records in the quorum
        state (written before they are applied, so before a snapshot can replace them)."""
        history = self._history
        if not history.dynamic:
            return
        entry = history.entry_at(self.high_watermark)
        persisted = self._persisted
        if entry is not None and (not persisted.voters or persisted.voters[-1][0] < entry[0]):
            committed = {offset: record for offset, record in persisted.voters}
            for offset, voters in history.entries():
                if offset < self.high_watermark:
                    committed[offset] = voters.encode()
            self._persist_voters(committed)

    def _resign_if_removed(self, now_ms: int) -> None:
        """After an input that may move a leader's high watermark: a leader whose own
        removal is committed resigns (then it is an observer)."""
        state = self._state
        if isinstance(state, LeaderState) and not self._is_voter and self.pending_voter_change is None:
            self._become_resigned(now_ms, state)

    def _persist_voters(self, committed: dict[int, bytes]) -> None:
        """Persist these committed voters records, without those superseded below the log
        start (no log end at or above the start needs them)."""
        offsets = sorted(committed)
        start = self._log.start_offset()
        kept = [o for i, o in enumerate(offsets) if i + 1 == len(offsets) or offsets[i + 1] >= start]
        record = replace(self._persisted, voters=tuple((o, committed[o]) for o in kept))
        if record != self._persisted:
            self._persisted = record
            self._ready.quorum_state = record

    def _may_vote_for(self, request: VoteRequest) -> bool:
        """Statically: the candidate and this node are voters. With voters records (rule 13,
        as Kafka): the candidate named this replica by (id, directory id), whatever this
        log's set says; a voter just added may not hold its own record yet and must vote, or
        no majority of the new set forms. The candidate counts only votes of its set."""
        if not self._history.dynamic:
            return request.candidate_id in self._voters and self._is_voter
        named = request.voter_directory_id
        return named == self.config.directory_id or (named == "" and self._is_voter)
