"""What RaftNode's role handlers share: the node's fields, its outputs and its queries.

raft/leader.py and raft/follower.py hold the handlers that belong to one role; RaftNode
(raft/node.py) combines them and is the one owner of transitions and persistence. The
transitions a handler may ask for are declared here and implemented only there.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from raft.log import QuorumStateRecord, RaftLog
from raft.messages import NO_LEADER, Envelope, Message
from raft.roles import FollowerState, LeaderState, Role, RoleState
from raft.snapshots import SnapshotStore
from raft.types import Batch
from raft.voters import Voter, VoterHistory, VoterSet, voters_records

if TYPE_CHECKING:
    from raft.node import RaftConfig, Ready


class NodeBase:
    """Fields and helpers of one node; set up by ``RaftNode.__init__``."""

    config: RaftConfig
    _id: int
    # The set in force (raft/voters.py): the latest voters record below the log end, else
    # the static configuration; _voters and _majority are its ids and majority, cached.
    _history: VoterHistory
    _voter_set: VoterSet
    _voters: frozenset[int]
    _majority: int
    _is_voter: bool
    _persisted: QuorumStateRecord
    _log: RaftLog
    _rng: random.Random
    _snapshots: SnapshotStore
    _ready: Ready
    _flush_requested: bool
    _last_fetched_ms: int  # last successful Fetch answer (start time before any)
    _shutting_down: bool
    _state: RoleState
    high_watermark: int
    dirty_offset: int
    tombstone_horizon: int
    dirty_offset_known: bool
    snapshot_wanted_offset: int
    _leader_high_watermark: tuple[int, int]  # (epoch, high watermark) of the last accepted answer
    peer_endpoints: dict[int, str]

    # ------------------------------------------------------------------ queries

    @property
    def node_id(self) -> int:
        return self._id

    @property
    def is_voter(self) -> bool:
        """(node id, directory id) is in the set in force (a directory "" matches any)."""
        return self._is_voter

    @property
    def voter_set(self) -> VoterSet:
        """The set in force: the latest voters record in the log (uncommitted included),
        else the snapshot's, else the static configuration's."""
        return self._voter_set

    def voter_set_at(self, offset: int) -> VoterSet:
        """The set in force for a log ending at ``offset`` (an election or commit there)."""
        return self._history.at(offset)

    @property
    def role(self) -> Role:
        return self._state.role

    @property
    def epoch(self) -> int:
        return self._state.epoch

    @property
    def leader_id(self) -> int:
        state = self._state
        if isinstance(state, LeaderState):
            return self._id
        if isinstance(state, FollowerState):
            return state.leader_id
        return NO_LEADER

    @property
    def leader_endpoint(self) -> str:
        state = self._state
        if isinstance(state, LeaderState):
            return self.config.endpoint
        if isinstance(state, FollowerState):
            return state.leader_endpoint
        return ""

    # ------------------------------------------------------------------ outputs

    def _send(self, dst: int, message: Message) -> None:
        self._ready.messages.append(Envelope(self._id, dst, message))

    def _request_flush(self) -> None:
        if not self._flush_requested:
            self._flush_requested = True
            self._ready.flush = True

    def _fetch_request_timeout_ms(self) -> int:
        """When to give up on an unanswered Fetch and send it again: well inside the fetch
        timeout, so one lost message does not start an election."""
        config = self.config
        return min(config.request_timeout_ms, config.fetch_max_wait_ms + config.fetch_timeout_ms // 4)

    def _check_quorum_ms(self) -> int:
        return self.config.fetch_timeout_ms * 3 // 2

    def _observe_response_epoch(self, now_ms: int, src: int, epoch: int, leader_id: int) -> bool:
        """Rule 1 for a response; False when it is dropped (not from a voter, or a bad or
        older epoch)."""
        if not self._may_lead(src) or epoch < 0:
            return False
        return self._observe_epoch(now_ms, epoch, leader_id, src=src)

    def _may_lead(self, replica_id: int) -> bool:
        """Can ``replica_id`` speak for a leader? Statically only a voter. With voters records
        (rule 13) any replica: a voter just added may lead before this log holds its record;
        only voters of the set in force win elections. So for an observer, which never votes:
        one that joined with an empty log knows only the voters of when it started, and the
        set may have changed since (a new voter leads it then)."""
        return replica_id in self._voters or ((self._history.dynamic or not self.is_voter) and replica_id >= 0)

    def _stands(self) -> bool:
        """May this node start elections (rule 13)? A voter may; so may a replica removed by
        the latest voters record while that record is not known to be committed: it may be
        needed to commit it (its own vote does not count). Raft's dissertation, 4.2.2."""
        if self._is_voter:
            return True
        latest = self._history.latest_offset()
        if latest < 0 or latest < self.high_watermark:
            return False
        previous = self._history.entry_at(latest)
        return previous is not None and previous[1].contains(self._id, self.config.directory_id)

    def _refresh_voters(self) -> None:
        """The log end passed or lost a voters record: take the set in force again."""
        voters = self._history.at(self._log.end_offset())
        self._voter_set = voters
        self._voters = voters.ids
        self._majority = voters.majority
        self._is_voter = voters.contains(self._id, self.config.directory_id)

    def _add_voters_records(self, batch: Batch) -> None:
        """An appended batch: record its voters records (a data batch holds none)."""
        if batch.control:
            found = voters_records(batch)
            for offset, voters in found:
                self._history.add(offset, voters)
            if found:
                self._refresh_voters()

    # ------------------------------------------------------------------ transitions
    # Implemented only by RaftNode (raft/node.py); declared for the type checker, so a
    # handler here can name them without this class defining a body of its own.

    if TYPE_CHECKING:

        def _observe_epoch(
            self, now_ms: int, epoch: int, leader_id: int, leader_endpoint: str = "", src: int = NO_LEADER
        ) -> bool: ...

        def _become_unattached(self, now_ms: int, epoch: int, voted_id: int = -1,
                               delay_ms: int | None = None) -> None: ...

        def _become_prospective(self, now_ms: int) -> None: ...

        def _become_resigned(self, now_ms: int, leader: LeaderState) -> None: ...

        def _persist_voters(self, committed: dict[int, bytes]) -> None: ...

        # Implemented by LeaderHandlers (raft/leader.py), called by MembershipHandlers.
        def _leader_add_voter(self, now_ms: int, state: LeaderState, voter: Voter) -> int: ...

        def _leader_remove_voter(self, now_ms: int, state: LeaderState, replica_id: int,
                                 directory_id: str) -> int: ...
