"""RaftNode: metakv's consensus core as a pure state machine (driving contract: raft/__init__.py).

The rules and the transition table are at the top of raft/roles.py; every transition is a
``_become_*`` method in the "Transitions" section below, checked against that table. Inputs
are messages, ticks, proposals, read requests and flush completions, each with the current
time in integer milliseconds; the output of every input is collected into one ``Ready``.
The leader's and the follower's handlers live in raft/leader.py and raft/follower.py;
RaftNode combines them and alone changes roles and the persisted quorum state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from raft.follower import FollowerHandlers
from raft.leader import LeaderHandlers
from raft.log import QuorumStateRecord, RaftLog
from raft.membership import MembershipHandlers
from raft.messages import (
    NO_LEADER,
    BeginQuorumEpochRequest,
    BeginQuorumEpochResponse,
    DescribeQuorumRequest,
    DescribeQuorumResponse,
    EndQuorumEpochRequest,
    EndQuorumEpochResponse,
    Envelope,
    FetchRequest,
    FetchResponse,
    FetchSnapshotRequest,
    FetchSnapshotResponse,
    Message,
    VoteRequest,
    VoteResponse,
)
from raft.roles import (
    CandidateState,
    FollowerState,
    LeaderState,
    ProspectiveState,
    ReplicaProgress,
    ResignedState,
    Role,
    RoleState,
    UnattachedState,
    transition_allowed,
)
from raft.snapshots import SnapshotStore
from raft.types import (
    BATCH_OVERHEAD_BYTES,
    CONTROL_LEADER_CHANGE,
    RECORD_OVERHEAD_BYTES,
    Batch,
    ErrorCode,
    SnapshotId,
    check,
    encode_control_record,
)
from raft.voters import (
    Voter,
    VoterChangeError,
    VoterHistory,
    VoterSet,
    bootstrap_batch,
)

__all__ = [
    "NotLeaderError",
    "Proposal",
    "ProposalRejectedError",
    "RaftConfig",
    "RaftNode",
    "Ready",
    "Role",
    "Voter",
    "VoterChangeError",
    "VoterSet",
]


@dataclass(frozen=True, slots=True)
class RaftConfig:
    node_id: int
    voters: frozenset[int]
    endpoint: str = ""
    election_timeout_ms: int = 1000
    fetch_timeout_ms: int = 2000
    election_backoff_max_ms: int = 1000
    fetch_max_wait_ms: int = 500
    request_timeout_ms: int = 2000
    append_linger_ms: int = 0
    max_batch_bytes: int = 8 * 1024 * 1024
    max_pending_records: int = 10_000
    # Additions (backward compatible, all defaulted):
    retry_backoff_ms: int = 100  # wait after an error answer before fetching again
    max_pending_reads: int = 10_000  # read_index calls waiting for confirmation
    max_observers: int = 256  # observers the leader tracks for describe_quorum
    snapshot_chunk_bytes: int = 1024 * 1024  # per FetchSnapshot response
    # The cleaners keep tombstones this many offsets below their cleaned end (equal on every
    # node); the re-bootstrap rule needs it to know below which offset they may be gone.
    tombstone_retention_records: int = 0
    # KIP-853 (rule 13): this node's data directory id (identity.json; "" when it has none),
    # and the set a new (empty) log is formatted with: a voters record at offset 0. Without
    # it, and until the log holds a voters record, ``voters`` is the set (no changes).
    directory_id: str = ""
    initial_voters: VoterSet | None = None


@dataclass(frozen=True, slots=True)
class Proposal:
    """Where a proposal's records went: offsets base_offset..last_offset of ``epoch``.

    Record at offset o produces metadata version o + 1 once committed.
    """

    epoch: int
    base_offset: int
    last_offset: int


class NotLeaderError(Exception):
    """Raised by propose/read_index on a node that is not the leader."""

    def __init__(self, leader_id: int, leader_endpoint: str) -> None:
        super().__init__(f"not the leader; leader is {leader_id} at {leader_endpoint or 'unknown'}")
        self.leader_id = leader_id
        self.leader_endpoint = leader_endpoint


class ProposalRejectedError(Exception):
    """The proposal cannot be accepted now (accumulator full, or too large)."""


@dataclass(slots=True)
class Ready:
    """The caller's work after one or more inputs, in the order raft/__init__.py gives."""

    quorum_state: QuorumStateRecord | None = None
    messages: list[Envelope] = field(default_factory=list)
    flush: bool = False
    high_watermark: int = 0
    reads_done: list[tuple[int, int]] = field(default_factory=list)
    reads_failed: list[int] = field(default_factory=list)
    role_changed: bool = False
    snapshot_to_install: SnapshotId | None = None


class RaftNode(LeaderHandlers, FollowerHandlers, MembershipHandlers):
    """One metakv replica's consensus state; see the module docstring and raft/roles.py."""

    def __init__(
        self,
        config: RaftConfig,
        log: RaftLog,
        persisted: QuorumStateRecord | None,
        rng: random.Random,
        snapshots: SnapshotStore,
        now_ms: int,
    ) -> None:
        check(config.election_timeout_ms > 0 and config.fetch_timeout_ms > 0, "timeouts must be positive")
        check(config.max_pending_records > 0 and config.max_batch_bytes > 0, "bounds must be positive")
        self.config = config
        self._id = config.node_id
        self._log = log
        self._rng = rng
        self._snapshots = snapshots
        self._ready = Ready()
        self._flush_requested = False
        self._read_token = 0
        self._last_fetched_ms = now_ms  # last successful Fetch answer (start time before any)
        self.high_watermark = log.start_offset()
        # Both live in memory and only rise. Every cleaning of this log used a dirty offset and
        # horizon at or above the end it cleaned to (the horizon never trails the dirty
        # offset), so after a restart the cleaned end is a safe lower bound for both: a
        # restarted leader that has not heard every voter yet still sends a fetcher from
        # below its cleaned prefix a snapshot (it used to start from 0 and serve it records).
        self.dirty_offset = log.cleaned_end()
        self.tombstone_horizon = log.cleaned_end()
        # True once a leader's dirty offset was learned in this run (a Fetch answer), or
        # while leading: before that this replica cannot know whether its state is real.
        self.dirty_offset_known = False
        # Leader: a fetcher needed a snapshot at or above this offset and none exists; the
        # runtime takes one (then resets this to 0).
        self.snapshot_wanted_offset = 0
        self.peer_endpoints: dict[int, str] = {}
        # Rule 11: set by begin_shutdown; from then on this node never starts a (pre-)vote.
        self._shutting_down = False
        # (epoch, leader) of the last EndQuorumEpoch received: that leader gave up that epoch,
        # so word that it leads it (a peer that has not seen the resignation yet) is stale.
        self._resigned_leader: tuple[int, int] = (-1, NO_LEADER)
        self._persisted = persisted or QuorumStateRecord(0, -1, -1)
        # Rule 12 looks at the log as found, before a format below writes to it.
        self._log_empty_at_start = log.end_offset() == 0
        if config.initial_voters is not None and self._log_empty_at_start and log.latest_snapshot_id() is None:
            log.append(bootstrap_batch(config.initial_voters))
            self._request_flush()
        self._history = VoterHistory(VoterSet.static(config.voters))
        self._load_voters()
        # Rule 12: (epoch, high watermark) of the last Fetch answer accepted from a leader.
        self._leader_high_watermark: tuple[int, int] = (-1, 0)
        self._state: RoleState
        self._restart(now_ms)
        self._ready.high_watermark = self.high_watermark

    # ------------------------------------------------------------------ queries

    @property
    def quorum_state(self) -> QuorumStateRecord:
        """The quorum state as last handed out for persisting."""
        return self._persisted

    @property
    def log_lost(self) -> bool:
        """Rule 12: this voter's log was lost and it has not caught up yet (no votes)."""
        return self._persisted.log_lost

    def last_contact_ms(self, now_ms: int) -> int:
        """Milliseconds since the leader last answered a Fetch (0 on the leader)."""
        state = self._state
        if isinstance(state, LeaderState):
            return 0
        if isinstance(state, FollowerState) and state.fetched_ms >= 0:
            return max(0, now_ms - state.fetched_ms)
        return max(0, now_ms - self._last_fetched_ms)

    def is_real_state(self, applied_version: int) -> bool:
        """The consistency rule (docs/compaction.md rule 7): is a state applied to
        ``applied_version`` over this log a real version (one the committed history
        produces)? Only once a leader's dirty offset was learned in this run (before that,
        this replica cannot know what was cleaned while it was down), the log reached it,
        the state covers the log's start (the log is reset to a downloaded snapshot before
        the state loads it), and the state is not inside a copied cleaned prefix (states
        there are not real versions)."""
        log = self._log
        return (self.dirty_offset_known and log.end_offset() >= self.dirty_offset
                and applied_version >= log.start_offset()
                and applied_version >= min(self.dirty_offset, log.cleaned_end()))

    def next_deadline_ms(self) -> int:
        """The latest time by which ``tick`` must be called."""
        state = self._state
        if isinstance(state, UnattachedState):
            if self._stands():
                return state.election_deadline_ms
            return state.probe_deadline_ms
        if isinstance(state, (ProspectiveState, CandidateState)):
            return state.election_deadline_ms
        if isinstance(state, ResignedState):
            if state.end_quorum_pending:
                return min(state.election_deadline_ms, state.end_quorum_next_ms)
            return state.election_deadline_ms
        if isinstance(state, FollowerState):
            return self._follower_deadline_ms(state)
        return self._leader_deadline_ms(state)

    # ------------------------------------------------------------------ inputs

    def take_ready(self) -> Ready:
        self._track_voters()
        self._track_log_loss()
        ready = self._ready
        ready.high_watermark = self.high_watermark
        self._ready = Ready(high_watermark=self.high_watermark)
        return ready

    def tick(self, now_ms: int) -> None:
        state = self._state
        if isinstance(state, UnattachedState):
            stands = self._stands()
            if stands and now_ms >= state.election_deadline_ms:
                self._campaign(now_ms, state)
            elif not stands and now_ms >= state.probe_deadline_ms:
                self._observer_probe(now_ms, state)
        elif isinstance(state, ProspectiveState):
            if now_ms >= state.election_deadline_ms:
                if state.leader_id != NO_LEADER:  # lost the pre-vote: try the old leader again
                    self._become_follower(now_ms, state.epoch, state.leader_id, "")
                else:
                    self._campaign(now_ms, state)
        elif isinstance(state, CandidateState):
            if now_ms >= state.election_deadline_ms:
                self._campaign(now_ms, state)
        elif isinstance(state, ResignedState):
            if now_ms >= state.election_deadline_ms:
                self._campaign(now_ms, state)
            elif state.end_quorum_pending and now_ms >= state.end_quorum_next_ms:
                self._send_end_quorum(now_ms, state)
        elif isinstance(state, FollowerState):
            self._follower_tick(now_ms, state)
        else:
            self._leader_tick(now_ms, state)
            self._resign_if_removed(now_ms)

    def handle(self, now_ms: int, envelope: Envelope) -> None:
        """A message arrived. Malformed or out-of-range input is answered or dropped."""
        if envelope.dst != self._id or envelope.src == self._id:
            return
        message = envelope.message
        handler = _HANDLERS.get(type(message))
        if handler is None:
            return
        handler(self, now_ms, envelope.src, message)
        self._resign_if_removed(now_ms)

    def propose(self, now_ms: int, records: list[bytes] | tuple[bytes, ...]) -> Proposal:
        state = self._state
        if not isinstance(state, LeaderState):
            raise NotLeaderError(self.leader_id, self.leader_endpoint)
        if not records:
            raise ProposalRejectedError("a proposal needs at least one record")
        for record in records:
            if type(record) is not bytes:
                raise ProposalRejectedError("records must be bytes")
        size_bytes = sum(len(r) + RECORD_OVERHEAD_BYTES for r in records)
        if size_bytes + BATCH_OVERHEAD_BYTES > self.config.max_batch_bytes:
            raise ProposalRejectedError(
                f"proposal of {size_bytes} bytes exceeds max_batch_bytes={self.config.max_batch_bytes}"
            )
        if state.pending_records + len(records) > self.config.max_pending_records:
            raise ProposalRejectedError(
                f"accumulator full: {state.pending_records} records pending "
                f"(max_pending_records={self.config.max_pending_records})"
            )
        base_offset = self._leader_accumulate(now_ms, state, records, size_bytes)
        return Proposal(state.epoch, base_offset, base_offset + len(records) - 1)

    def on_flushed(self, now_ms: int) -> None:
        self._flush_requested = False
        log = self._log
        state = self._state
        if isinstance(state, LeaderState):
            self._leader_drain(now_ms, state)
            self._leader_update_high_watermark(now_ms, state)
            self._resign_if_removed(now_ms)
        elif isinstance(state, FollowerState):
            self._follower_on_flushed(now_ms, state)
        if log.flushed_offset() < log.end_offset():
            self._request_flush()

    def read_index(self, now_ms: int) -> int:
        state = self._state
        if not isinstance(state, LeaderState):
            raise NotLeaderError(self.leader_id, self.leader_endpoint)
        if len(state.reads) >= self.config.max_pending_reads:
            raise ProposalRejectedError(
                f"too many pending reads (max_pending_reads={self.config.max_pending_reads})"
            )
        self._read_token += 1
        token = self._read_token
        self._leader_add_read(now_ms, state, token)
        return token

    def resign(self, now_ms: int) -> None:
        """A leader steps down (admin resign): hand over with EndQuorumEpoch. It may lead
        again later; a node that is going away calls ``begin_shutdown`` instead."""
        state = self._state
        if isinstance(state, LeaderState):
            self._become_resigned(now_ms, state)

    def begin_shutdown(self, now_ms: int) -> None:
        """Rule 11, graceful shutdown: a leader resigns (EndQuorumEpoch), and from now on
        this node never starts a pre-vote or vote of its own. It still answers votes, so
        the successor it named can win; its timers only re-arm until the process exits."""
        self._shutting_down = True
        state = self._state
        if isinstance(state, LeaderState):
            self._become_resigned(now_ms, state)
        elif isinstance(state, CandidateState):  # abandon the running election (keeps its vote)
            self._become_unattached(now_ms, state.epoch, self._id)

    def on_snapshot_installed(self, now_ms: int, snapshot_id: SnapshotId) -> None:
        """The runtime loaded ``snapshot_id``; nothing in the core waits on it."""
        self.high_watermark = max(self.high_watermark, min(snapshot_id.end_offset, self._log.end_offset()))

    # ------------------------------------------------------------------ outputs

    def _persist(self, epoch: int, voted_id: int, leader_id: int) -> None:
        record = replace(self._persisted, epoch=epoch, voted_id=voted_id, leader_id=leader_id)
        check(epoch >= self._persisted.epoch, f"persisted epoch would go back {self._persisted.epoch} -> {epoch}")
        if record != self._persisted:
            self._persisted = record
            self._ready.quorum_state = record

    def _random_election_timeout_ms(self) -> int:
        timeout_ms = self.config.election_timeout_ms
        return timeout_ms + self._rng.randrange(timeout_ms)

    def _random_fetch_timeout_ms(self) -> int:
        """Rule 7: fetch_timeout_ms plus a random share of one election timeout. An idle
        leader answers its followers' parked fetches together: without the jitter their
        fetch timeouts would expire together and their pre-vote rounds split the vote."""
        timeout_ms = self.config.fetch_timeout_ms
        return timeout_ms + self._rng.randrange(self.config.election_timeout_ms + 1)

    # ------------------------------------------------------------------ transitions
    # The only places that assign self._state. Each says which rule of roles.py it follows
    # and checks its move against roles.TRANSITIONS (_restart picks the first role).

    def _restart(self, now_ms: int) -> None:
        """Rule 10: choose the starting role from the persisted state and the log."""
        persisted = self._persisted
        # Any replica that acknowledged a log as a voter: one the log added may find its
        # re-formatted log's set (or its quorum state's committed records) without itself.
        if persisted.log_acknowledged and self._log_empty_at_start:
            self._persist_log_flags(log_lost=True)  # rule 12: persisted before any message
        persisted = self._persisted
        log_epoch = self._log.last_epoch()
        if persisted.epoch < log_epoch:
            self._state = UnattachedState(log_epoch, -1, now_ms + self._random_election_timeout_ms(), now_ms)
            self._persist(log_epoch, -1, -1)
        elif persisted.leader_id == self._id and self.is_voter:
            self._state = ResignedState(
                persisted.epoch, now_ms + self._random_election_timeout_ms(), (), set(), now_ms
            )
        elif persisted.leader_id != NO_LEADER and persisted.leader_id != self._id:
            self._state = FollowerState(
                persisted.epoch, persisted.leader_id, self.peer_endpoints.get(persisted.leader_id, ""),
                persisted.voted_id, now_ms, self._random_fetch_timeout_ms(),
            )
            self._follower_fetch_if_ready(now_ms, self._state)
        else:
            self._state = UnattachedState(
                persisted.epoch, persisted.voted_id, now_ms + self._random_election_timeout_ms(), now_ms
            )

    def _check_transition(self, to_role: Role, epoch: int) -> None:
        """A move that raft/roles.py's TRANSITIONS does not list is a broken invariant."""
        old = self._state
        check(transition_allowed(old.role, to_role, epoch > old.epoch),
              f"transition {old.role.value} -> {to_role.value} (epoch {old.epoch} -> {epoch}) "
              "is not in raft/roles.py TRANSITIONS")

    def _leave_role(self, now_ms: int) -> None:
        """Drop what only the old role held; tell the runtime the role changed."""
        state = self._state
        if isinstance(state, LeaderState):
            self._leader_step_down(now_ms, state)
        self._ready.role_changed = True

    def _become_unattached(self, now_ms: int, epoch: int, voted_id: int = -1, delay_ms: int | None = None) -> None:
        """Rules 1, 2, 8: no leader known in ``epoch``."""
        self._check_transition(Role.UNATTACHED, epoch)
        self._leave_role(now_ms)
        if epoch > self._persisted.epoch:
            self._persist(epoch, voted_id, NO_LEADER)
        wait_ms = self._random_election_timeout_ms() if delay_ms is None else delay_ms
        self._state = UnattachedState(epoch, voted_id, now_ms + wait_ms, now_ms)

    def _become_follower(self, now_ms: int, epoch: int, leader_id: int, leader_endpoint: str) -> None:
        """Rules 1, 3, 4, 7: a leader of ``epoch`` is known."""
        self._check_transition(Role.FOLLOWER, epoch)
        check(leader_id != self._id, "cannot follow itself")
        voted_id = self._persisted.voted_id if epoch == self._persisted.epoch else -1
        self._leave_role(now_ms)
        self._persist(epoch, voted_id, leader_id)
        if leader_endpoint:
            self.peer_endpoints[leader_id] = leader_endpoint
        endpoint = leader_endpoint or self.peer_endpoints.get(leader_id, "")
        state = FollowerState(epoch, leader_id, endpoint, voted_id, now_ms, self._random_fetch_timeout_ms())
        self._state = state
        self._follower_fetch_if_ready(now_ms, state)

    def _campaign(self, now_ms: int, state: UnattachedState | ProspectiveState | CandidateState | ResignedState) -> None:
        """An election timer fired: start a pre-vote round (rule 3), unless this node is
        shutting down (rule 11): then it stays in its role and only re-arms the timer, so
        ``next_deadline_ms`` never lies in the past."""
        if self._shutting_down:
            state.election_deadline_ms = now_ms + self._random_election_timeout_ms()
            return
        if not self._stands():  # rule 13: a leader whose removal committed is an observer now
            self._become_unattached(now_ms, state.epoch, self._persisted.voted_id, 0)
            return
        self._become_prospective(now_ms)

    def _become_prospective(self, now_ms: int) -> None:
        """Rule 3: pre-vote for epoch + 1; persists nothing."""
        check(self._stands(), "observers never campaign")
        check(not self._shutting_down, "a node shutting down never campaigns")
        old = self._state
        self._check_transition(Role.PROSPECTIVE, old.epoch)
        leader_id = old.leader_id if isinstance(old, FollowerState) else NO_LEADER
        if not isinstance(old, ProspectiveState):
            self._leave_role(now_ms)
        state = ProspectiveState(
            old.epoch, self._persisted.voted_id, leader_id, now_ms + self._random_election_timeout_ms()
        )
        if self._is_voter:  # a node standing only to commit its own removal has no vote (rule 13)
            state.granted.add(self._id)
        self._state = state
        self._request_votes(state.epoch + 1, True)
        self._prospective_maybe_done(now_ms, state)

    def _become_candidate(self, now_ms: int) -> None:
        """Rule 4: persist epoch + 1 and a vote for itself, ask for votes."""
        epoch = self._state.epoch + 1
        check(not self._persisted.log_lost, "a voter whose log was lost never stands (rule 12)")
        self._check_transition(Role.CANDIDATE, epoch)
        self._leave_role(now_ms)
        self._persist(epoch, self._id, NO_LEADER)
        state = CandidateState(epoch, now_ms + self._random_election_timeout_ms())
        if self._is_voter:  # a node standing only to commit its own removal has no vote (rule 13)
            state.granted.add(self._id)
        self._state = state
        self._request_votes(epoch, False)
        if len(state.granted & self._voters) >= self._majority:
            self._become_leader(now_ms)

    def _request_votes(self, epoch: int, pre_vote: bool) -> None:
        """Ask every other voter of the set in force at this log's end (rules 3, 4, 13)."""
        log = self._log
        for voter in self._voter_set.voters:
            if voter.replica_id != self._id:
                self._send(voter.replica_id, VoteRequest(
                    epoch, self._id, log.last_epoch(), log.end_offset(), pre_vote,
                    self.config.directory_id, voter.directory_id))

    def _become_leader(self, now_ms: int) -> None:
        """Rule 6: append LeaderChange, announce with BeginQuorumEpoch."""
        epoch = self._state.epoch
        self._check_transition(Role.LEADER, epoch)
        self._leave_role(now_ms)
        self._persist(epoch, self._id, self._id)
        log = self._log
        start = log.end_offset()
        others = {v: ReplicaProgress(v, self.peer_endpoints.get(v, "")) for v in self._voters if v != self._id}
        state = LeaderState(epoch, start, now_ms, others)
        state.begin_quorum_pending = set(others)
        self.dirty_offset_known = True
        self._state = state
        record = encode_control_record(CONTROL_LEADER_CHANGE, leader_id=self._id, epoch=epoch, voters=sorted(self._voters))
        log.append(Batch(start, epoch, now_ms, True, (record,)))
        self._request_flush()
        self._send_begin_quorum(now_ms, state)
        self._leader_update_high_watermark(now_ms, state)

    def _become_resigned(self, now_ms: int, leader: LeaderState) -> None:
        """Rule 8: stop serving; EndQuorumEpoch with successors ordered by replicated offset."""
        self._check_transition(Role.RESIGNED, leader.epoch)
        successors = tuple(
            p.replica_id for p in sorted(leader.voters.values(), key=lambda p: (-p.end_offset, p.replica_id))
        )
        self._leave_role(now_ms)
        state = ResignedState(
            leader.epoch, now_ms + self._random_election_timeout_ms(), successors, set(successors), now_ms
        )
        self._state = state
        self._send_end_quorum(now_ms, state)

    # ------------------------------------------------------------------ epochs

    def _observe_epoch(
        self, now_ms: int, epoch: int, leader_id: int, leader_endpoint: str = "", src: int = NO_LEADER
    ) -> bool:
        """Rule 1 for any message: move to a higher epoch, or learn this epoch's leader.

        Returns False when the message is from an older epoch (the caller answers FENCED).
        """
        state = self._state
        if leader_id != NO_LEADER and (not self._may_lead(leader_id) or leader_id == self._id):
            leader_id = NO_LEADER  # only voters lead (rule 13); never "learn" that we lead
        if (epoch, leader_id) == self._resigned_leader:
            leader_id = NO_LEADER  # it resigned this epoch: following it again would only time out
        if epoch < state.epoch:
            return False
        if epoch > state.epoch:
            if leader_id != NO_LEADER:
                self._become_follower(now_ms, epoch, leader_id, leader_endpoint)
            else:
                self._become_unattached(now_ms, epoch)
            return True
        if isinstance(state, ProspectiveState) and leader_id == state.leader_id and src != leader_id:
            return True  # hearsay about the leader we timed out on: only it can bring us back
        if leader_id != NO_LEADER and isinstance(state, (UnattachedState, ProspectiveState, CandidateState)):
            self._become_follower(now_ms, epoch, leader_id, leader_endpoint)
        return True

    # ------------------------------------------------------------------ votes

    def _on_vote_request(self, now_ms: int, src: int, request: VoteRequest) -> None:
        if (request.candidate_id != src or request.epoch < 0 or request.last_offset < 0
                or request.last_offset_epoch < 0 or request.last_offset_epoch > request.epoch
                or (request.pre_vote and request.last_offset_epoch >= request.epoch)):
            self._send(src, VoteResponse(ErrorCode.INVALID_REQUEST, self.epoch, self.leader_id, False, request.pre_vote))
            return
        if not self._may_vote_for(request):
            self._send(src, VoteResponse(ErrorCode.INCONSISTENT_VOTER_SET, self.epoch, self.leader_id, False, request.pre_vote))
            return
        if request.pre_vote:
            self._on_pre_vote(now_ms, src, request)
            return
        if request.epoch < self.epoch:
            self._send(src, VoteResponse(ErrorCode.FENCED_LEADER_EPOCH, self.epoch, self.leader_id, False, False))
            return
        if request.epoch > self.epoch:
            self._become_unattached(now_ms, request.epoch)
        state = self._state
        persisted = self._persisted
        granted = (
            isinstance(state, (UnattachedState, ProspectiveState))
            and persisted.epoch == state.epoch
            and persisted.voted_id in (-1, request.candidate_id)
            and persisted.leader_id == NO_LEADER
            and not persisted.log_lost  # rule 12
            and self._log_ok(request)
        )
        if granted:
            self._persist(state.epoch, request.candidate_id, NO_LEADER)
            # A vote resets the election timer (and ends a pre-vote round of our own).
            self._become_unattached(now_ms, state.epoch, request.candidate_id)
        self._send(src, VoteResponse(ErrorCode.NONE, self.epoch, self.leader_id, granted, False))

    def _on_pre_vote(self, now_ms: int, src: int, request: VoteRequest) -> None:
        """Rule 3: a pre-vote for epoch e never moves this node to e.

        It does say the sender already is in epoch e - 1 (persisted, so sanctioned by an
        earlier pre-vote majority); rule 1 applies to that epoch like to any other, or a
        node whose vote requests were lost could never rejoin a leader of a lower epoch.
        """
        if request.epoch - 1 > self.epoch:
            self._observe_epoch(now_ms, request.epoch - 1, NO_LEADER)
        state = self._state
        recent_leader = isinstance(state, LeaderState) or (
            isinstance(state, FollowerState) and state.fetched_ms >= 0
            and now_ms - state.fetched_ms < self.config.fetch_timeout_ms
        )
        granted = (request.epoch > self.epoch and not recent_leader and not self._persisted.log_lost
                   and self._log_ok(request))
        self._send(src, VoteResponse(ErrorCode.NONE, self.epoch, self.leader_id, granted, True))

    def _log_ok(self, request: VoteRequest) -> bool:
        log = self._log
        return (request.last_offset_epoch, request.last_offset) >= (log.last_epoch(), log.end_offset())

    def _on_vote_response(self, now_ms: int, src: int, response: VoteResponse) -> None:
        if not self._observe_response_epoch(now_ms, src, response.epoch, response.leader_id):
            return
        state = self._state
        if response.error != ErrorCode.NONE:
            return
        if isinstance(state, ProspectiveState) and response.pre_vote and response.epoch <= state.epoch:
            (state.granted if response.vote_granted else state.rejected).add(src)
            self._prospective_maybe_done(now_ms, state)
        elif isinstance(state, CandidateState) and not response.pre_vote and response.epoch == state.epoch:
            (state.granted if response.vote_granted else state.rejected).add(src)
            if len(state.granted & self._voters) >= self._majority:
                self._become_leader(now_ms)

    def _prospective_maybe_done(self, now_ms: int, state: ProspectiveState) -> None:
        # Rule 11: a pre-vote round that was running when shutdown began never becomes a vote.
        # Rule 12: a voter whose log was lost asks only to learn the leader; it never stands.
        if (len(state.granted & self._voters) >= self._majority and not self._shutting_down
                and not self._persisted.log_lost):
            self._become_candidate(now_ms)

    # ------------------------------------------------------------------ a lost log (rule 12)

    def _persist_log_flags(self, log_acknowledged: bool | None = None, log_lost: bool | None = None) -> None:
        persisted = self._persisted
        record = replace(
            persisted,
            log_acknowledged=persisted.log_acknowledged if log_acknowledged is None else log_acknowledged,
            log_lost=persisted.log_lost if log_lost is None else log_lost,
        )
        if record != persisted:
            self._persisted = record
            self._ready.quorum_state = record

    def _track_log_loss(self) -> None:
        """Rule 12, before a Ready is handed out (its quorum state is written before its
        messages): note the first acknowledgement, and the end of a lost log's catch-up.
        With voters records an observer's Fetch counts too: a leader that appended the record
        adding it counts its fetch offset before its own log holds that record."""
        if not self.is_voter and not self._history.dynamic:
            return
        persisted = self._persisted
        if not persisted.log_acknowledged:
            # A follower's next Fetch acknowledges its flushed log; a leader counts it.
            if self._log.flushed_offset() > 0 and isinstance(self._state, (LeaderState, FollowerState)):
                self._persist_log_flags(log_acknowledged=True)
        elif persisted.log_lost and self._caught_up_after_loss():
            self._persist_log_flags(log_lost=False)
        elif not persisted.log_lost and self._log.end_offset() == 0:
            # Truncated to empty: a truncation never removes a committed record this log
            # held, so no acknowledgement of it counted; an empty log after a restart now
            # is no sign of a lost disk.
            self._persist_log_flags(log_acknowledged=False)

    def _caught_up_after_loss(self) -> bool:
        """Does this log durably hold everything ever committed? It does once it holds a
        leader's high watermark that covers a record of that leader's epoch: that leader
        held every record committed before its election, and its high watermark covers
        every record committed since."""
        state = self._state
        epoch, leader_high_watermark = self._leader_high_watermark
        if not isinstance(state, FollowerState) or state.epoch != epoch:
            return False
        log = self._log
        epoch_start = log.end_offset_for_epoch(epoch - 1)[1]
        return log.last_epoch() == epoch and epoch_start < leader_high_watermark <= log.flushed_offset()

    # ------------------------------------------------------------------ quorum epoch

    def _on_begin_quorum(self, now_ms: int, src: int, request: BeginQuorumEpochRequest) -> None:
        if request.leader_id != src or request.epoch < 0:
            self._send(src, BeginQuorumEpochResponse(ErrorCode.INVALID_REQUEST, self.epoch, self.leader_id))
            return
        if not self._may_lead(src) or request.voter_directory_id not in ("", self.config.directory_id):
            self._send(src, BeginQuorumEpochResponse(ErrorCode.INCONSISTENT_VOTER_SET, self.epoch, self.leader_id))
            return
        if not self._observe_epoch(now_ms, request.epoch, request.leader_id, request.leader_endpoint, src):
            self._send(src, BeginQuorumEpochResponse(ErrorCode.FENCED_LEADER_EPOCH, self.epoch, self.leader_id))
            return
        state = self._state
        if isinstance(state, FollowerState) and state.leader_id == src and request.leader_endpoint:
            state.leader_endpoint = request.leader_endpoint
            self.peer_endpoints[src] = request.leader_endpoint
        self._send(src, BeginQuorumEpochResponse(ErrorCode.NONE, self.epoch, self.leader_id))

    def _on_begin_quorum_response(self, now_ms: int, src: int, response: BeginQuorumEpochResponse) -> None:
        if self._may_lead(src) and response.epoch >= 0:
            self._observe_epoch(now_ms, response.epoch, response.leader_id, src=src)

    def _on_end_quorum(self, now_ms: int, src: int, request: EndQuorumEpochRequest) -> None:
        if request.leader_id != src or request.epoch < 0:
            self._send(src, EndQuorumEpochResponse(ErrorCode.INVALID_REQUEST, self.epoch, self.leader_id))
            return
        if not self._may_lead(src):
            self._send(src, EndQuorumEpochResponse(ErrorCode.INCONSISTENT_VOTER_SET, self.epoch, self.leader_id))
            return
        if request.epoch < self.epoch:
            self._send(src, EndQuorumEpochResponse(ErrorCode.FENCED_LEADER_EPOCH, self.epoch, self.leader_id))
            return
        self._resigned_leader = (request.epoch, src)
        if request.epoch > self.epoch:
            self._become_unattached(now_ms, request.epoch)
        state = self._state
        if isinstance(state, FollowerState) and state.leader_id == src:
            if self._stands():
                self._become_unattached(now_ms, state.epoch, state.voted_id, self._successor_delay_ms(request))
            else:
                self._become_unattached(now_ms, state.epoch, state.voted_id, self.config.retry_backoff_ms)
        self._send(src, EndQuorumEpochResponse(ErrorCode.NONE, self.epoch, self.leader_id))

    def _successor_delay_ms(self, request: EndQuorumEpochRequest) -> int:
        """Rule 8: the best successor campaigns at once, the others back off in order."""
        successors = request.preferred_successors
        if self._id not in successors:
            return self._random_election_timeout_ms()
        position = successors.index(self._id)
        if position == 0:
            return 0
        step_ms = self.config.election_backoff_max_ms // max(1, len(successors))
        return min(self.config.election_backoff_max_ms, position * step_ms + self._rng.randrange(step_ms + 1))

    def _on_end_quorum_response(self, now_ms: int, src: int, response: EndQuorumEpochResponse) -> None:
        if not self._may_lead(src) or response.epoch < 0:
            return
        state = self._state
        if isinstance(state, ResignedState) and response.epoch == state.epoch:
            state.end_quorum_pending.discard(src)
            return
        self._observe_epoch(now_ms, response.epoch, response.leader_id, src=src)

    def _send_end_quorum(self, now_ms: int, state: ResignedState) -> None:
        request = EndQuorumEpochRequest(state.epoch, self._id, state.preferred_successors)
        for voter in sorted(state.end_quorum_pending):
            self._send(voter, request)
        state.end_quorum_next_ms = now_ms + self.config.request_timeout_ms

    # ------------------------------------------------------------------ describe

    def _on_describe_quorum(self, now_ms: int, src: int, request: DescribeQuorumRequest) -> None:
        self._send(src, self.describe_quorum(now_ms))

    def _ignore(self, now_ms: int, src: int, message: Message) -> None:
        """Responses this core never asked for (DescribeQuorumResponse)."""


_HANDLERS = {
    VoteRequest: RaftNode._on_vote_request,
    VoteResponse: RaftNode._on_vote_response,
    BeginQuorumEpochRequest: RaftNode._on_begin_quorum,
    BeginQuorumEpochResponse: RaftNode._on_begin_quorum_response,
    EndQuorumEpochRequest: RaftNode._on_end_quorum,
    EndQuorumEpochResponse: RaftNode._on_end_quorum_response,
    FetchRequest: RaftNode._on_fetch,
    FetchResponse: RaftNode._on_fetch_response,
    FetchSnapshotRequest: RaftNode._on_fetch_snapshot,
    FetchSnapshotResponse: RaftNode._on_fetch_snapshot_response,
    DescribeQuorumRequest: RaftNode._on_describe_quorum,
    DescribeQuorumResponse: RaftNode._ignore,
}
