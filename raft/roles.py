"""The six roles of a metakv node, one class each; each holds only its own data.

Rules and theory of operation (KRaft: KIP-595, KIP-996 pre-vote, KIP-630 snapshots)
====================================================================================

A node is always in exactly one role, for one epoch. Every transition lives in
``RaftNode._become_*`` (raft/node.py, section "Transitions"); nothing else assigns
``RaftNode._state``, and each of them checks its move against ``TRANSITIONS`` below (a
move not in the table is a broken invariant). The persisted quorum state (epoch, voted
id, leader id) changes only inside those methods, and only in the ways listed here; its two
log flags (rule 12) change only in ``_restart`` and ``_track_log_loss``.

1. Epochs only grow. Any valid message carrying a higher epoch moves a node to that epoch:
   to Follower when the message names the leader, otherwise to Unattached. The new epoch
   is persisted (``Ready.quorum_state``) before anything of that Ready is sent.
2. Unattached (no known leader in this epoch; may have voted). A voter whose election
   timer fires goes Prospective; an observer instead probes a random voter with a Fetch
   to learn the leader.
3. Prospective (KIP-996): asks every voter for a *pre-vote* for epoch + 1. Pre-votes are
   never persisted, by either side, and never change the receiver's epoch. A majority
   of grants → Candidate. Learning of a leader of the current epoch → Follower (hearsay
   about the leader it timed out on does not count; that leader's own answer does).
   Timer → Follower of the leader it lost, if it knew one (fetch again: that leader may
   be fine), else a new pre-vote round. Followers that fetched successfully from their
   leader within fetch_timeout_ms refuse pre-votes; leaders refuse all. A node that is
   cut off therefore cannot bump the epoch and depose a healthy leader when it comes
   back. Any other voter grants a pre-vote to a log at least as up to date, whatever the
   ids (no tie-break: rule 7's jitter keeps followers of one leader from running their
   rounds together). A pre-vote for epoch e does tell the receiver that the sender is in
   epoch e - 1 already; rule 1 applies to that epoch.
4. Candidate: persists epoch + 1 and a vote for itself, then asks for real votes. A
   majority → Leader. Timer → Prospective (a new pre-vote round, same epoch).
5. Votes: a voter grants at most one vote per epoch (persisted before the response is
   sent), never while it knows a leader of that epoch, and only to a candidate whose log
   is at least as up to date: (last epoch, end offset) compared lexicographically.
6. Leader: appends a LeaderChange control record at ``epoch_start_offset``, sends
   BeginQuorumEpoch to every voter until that voter fetches in this epoch. The high
   watermark is the largest offset a majority of voters hold *durably* (the leader's own
   offset counts only once flushed); it moves only once it passes epoch_start_offset (an
   entry of the leader's own epoch is committed) and never moves back. Without a Fetch or
   FetchSnapshot from a majority for 1.5 × fetch_timeout_ms the leader resigns (check-quorum).
7. Follower: fetches from the leader; acknowledges an offset only by fetching from it,
   and fetches only what it has flushed; a voter fetching from an empty log or below its
   last acknowledgement may have lost its log, so the leader counts its Fetches again only
   once they echo a read nonce raised then (a Fetch sent before the loss may still be on its
   way). No successful Fetch response for its fetch
   timeout (fetch_timeout_ms plus a random share of election_timeout_ms, drawn when it
   starts following, so an idle leader's followers do not time out together and split
   the vote) → Prospective (voters) or Unattached (observers). A diverging epoch
   in the response truncates the log; a cut below the high watermark would drop
   committed records and is a broken invariant (``check``), never ignored; a snapshot id
   starts a FetchSnapshot download. Only the answer to the Fetch in flight counts (it
   echoes fetch offset and last fetched epoch). High watermark = max(old, min(local end,
   leader's)).
8. Resigned: a leader that shut down gracefully, lost check-quorum, or restarted as
   leader. It serves nothing, re-sends EndQuorumEpoch (successors ordered by replicated
   offset, best first) until acknowledged, and after an election timeout goes
   Prospective. A Follower receiving EndQuorumEpoch from its leader goes Unattached and
   starts its election after a delay that grows with its place in the successor list.
   From then on it ignores word that the resigned node leads that epoch (a peer that has
   not yet seen the resignation still says so; following it would only wait out a fetch
   timeout).
9. Observers (not in the voter set) are only ever Unattached or Follower, never vote and
   never count toward the high watermark.
10. Restart: persisted leader id == self → Resigned; persisted epoch below the log's last
    epoch → Unattached at the log's epoch; a known leader → Follower; else Unattached.
11. Shutdown (``begin_shutdown``): a node that is going away never starts a pre-vote or
    a vote. A leader resigns (rule 8), a candidate abandons its election (Unattached, its
    vote kept), a prospective node's round never turns into a vote; every later election
    timer only re-arms, and a voter whose fetches time out goes Unattached. It still
    grants votes and follows a new leader, so the successor it named can win.
12. A lost log. A voter's vote and the majorities counted
    for the high watermark rely on it still holding what it acknowledged. The quorum state
    records ``log_acknowledged`` before the first Ready in which a voter's flushed log is
    past 0 as Follower or Leader (before its first acknowledgement leaves); with voters
    records an observer's too (a leader counts it once it appended the record adding it,
    before the observer's log holds that record). A restart
    with that flag and an empty log persists ``log_lost``: such a replica grants no votes
    and no pre-votes, and never becomes a Candidate (it still runs pre-vote rounds, only
    to learn the leader). It clears the flag as a Follower whose flushed log reaches a
    high watermark its leader sent, once that covers a record of the leader's epoch:
    that leader held every record committed before its election, and its high watermark
    covers those committed since. Its Fetches count like any voter's: it holds what it
    acknowledges, and no leader can be elected without a voter holding each committed
    record, since the lost voter votes for nobody.
13. Voters (KIP-853; raft/voters.py). The set in force at a log end is the latest voters
    record below it (uncommitted included), else the latest committed one persisted in the
    quorum state (its prefix replaced by a snapshot), else the static configuration
    (kraft.version 0: no changes). Appending a record changes the set at once, a truncation
    below it undoes it. A replica counts, votes and is asked only while (id, directory id)
    is in the set (directory "" of a static set matches any): the same id with another
    directory (a replaced disk) is an observer until added. Every count (majority, high
    watermark, check-quorum, read confirmation, compaction offsets, votes at the
    candidate's log end) uses the set in force; the high watermark still never goes back.
    The leader changes one voter at a time: only after an entry of its epoch is committed,
    never while a voters record is uncommitted, and adds only an observer that fetched at
    its high watermark within fetch_timeout_ms. A leader outside the set (its removal
    pending) leads without counting itself and resigns once the removal is committed. With
    voters records any replica may speak for a leader (a voter just added may lead before
    this log holds its record), and a replica votes when the candidate names its (id,
    directory id), even before its log holds the record adding it. Voters of the set in
    force stand for election; so does a replica the latest voters record removed while that
    record is not known to be committed (its vote does not count): else a leader that
    crashed with its own removal uncommitted could leave no electable majority (Raft
    dissertation 4.2.2).

The transition table is ``TRANSITIONS`` right below (after ``Role``): every (from, to) pair
with the rule that allows it and its trigger.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from raft.messages import FetchRequest
from raft.types import BATCH_OVERHEAD_BYTES, SnapshotId


class Role(enum.Enum):
    UNATTACHED = "unattached"
    PROSPECTIVE = "prospective"
    CANDIDATE = "candidate"
    LEADER = "leader"
    FOLLOWER = "follower"
    RESIGNED = "resigned"


@dataclass(frozen=True, slots=True)
class Transition:
    """One allowed move between roles; ``higher_epoch_only``: only when the epoch rises."""

    from_role: Role
    to_role: Role
    rule: int
    trigger: str
    higher_epoch_only: bool = False


# Every move a node may make. A same-epoch move must be listed; any role may also move to
# Unattached or Follower when a message shows a higher epoch (rule 1).
TRANSITIONS: frozenset[Transition] = frozenset({
    Transition(Role.UNATTACHED, Role.PROSPECTIVE, 2, "election timer (voters)"),
    Transition(Role.UNATTACHED, Role.FOLLOWER, 2, "BeginQuorumEpoch / Fetch response naming a leader of this epoch"),
    Transition(Role.UNATTACHED, Role.UNATTACHED, 5, "vote granted (the election timer restarts)"),
    Transition(Role.PROSPECTIVE, Role.CANDIDATE, 3, "majority of pre-votes"),
    Transition(Role.PROSPECTIVE, Role.FOLLOWER, 3, "leader of this epoch discovered, or timer with a leader known"),
    Transition(Role.PROSPECTIVE, Role.PROSPECTIVE, 3, "election timer, no leader known (new round)"),
    Transition(Role.PROSPECTIVE, Role.UNATTACHED, 5, "vote granted to another candidate (ends its own round)"),
    Transition(Role.CANDIDATE, Role.LEADER, 4, "majority of votes"),
    Transition(Role.CANDIDATE, Role.PROSPECTIVE, 4, "election timer"),
    Transition(Role.CANDIDATE, Role.FOLLOWER, 4, "leader of this epoch discovered"),
    Transition(Role.CANDIDATE, Role.UNATTACHED, 11, "begin_shutdown abandons the election"),
    Transition(Role.LEADER, Role.RESIGNED, 8, "resign(), begin_shutdown() or check-quorum failure"),
    Transition(Role.FOLLOWER, Role.PROSPECTIVE, 7, "fetch timeout (voters)"),
    Transition(Role.FOLLOWER, Role.UNATTACHED, 7, "fetch timeout (observers; voters shutting down, rule 11)"),
    Transition(Role.FOLLOWER, Role.UNATTACHED, 8, "EndQuorumEpoch from its leader"),
    Transition(Role.RESIGNED, Role.PROSPECTIVE, 8, "election timer (never while shutting down, rule 11)"),
    Transition(Role.RESIGNED, Role.UNATTACHED, 13, "election timer after its own removal committed (observer now)"),
}) | frozenset(
    Transition(role, to_role, 1, "a valid message shows a higher epoch", higher_epoch_only=True)
    for role in Role for to_role in (Role.UNATTACHED, Role.FOLLOWER)
)

_ALLOWED_ANY_EPOCH = frozenset((t.from_role, t.to_role) for t in TRANSITIONS if not t.higher_epoch_only)
_ALLOWED_HIGHER_EPOCH = frozenset((t.from_role, t.to_role) for t in TRANSITIONS)


def transition_allowed(from_role: Role, to_role: Role, epoch_rises: bool) -> bool:
    """Is the move from ``from_role`` to ``to_role`` in ``TRANSITIONS``?"""
    allowed = _ALLOWED_HIGHER_EPOCH if epoch_rises else _ALLOWED_ANY_EPOCH
    return (from_role, to_role) in allowed


@dataclass(slots=True)
class UnattachedState:
    """No leader known in ``epoch``; ``voted_id`` is the vote cast in it (-1: none)."""

    epoch: int
    voted_id: int
    election_deadline_ms: int
    probe_deadline_ms: int = 0  # observers: when to ask a random voter for the leader
    role: Role = Role.UNATTACHED


@dataclass(slots=True)
class ProspectiveState:
    """Collecting pre-votes for epoch + 1; nothing of this is persisted."""

    epoch: int
    voted_id: int
    leader_id: int  # the leader we lost contact with (-1 none); kept, not persisted anew
    election_deadline_ms: int
    granted: set[int] = field(default_factory=set)
    rejected: set[int] = field(default_factory=set)
    role: Role = Role.PROSPECTIVE


@dataclass(slots=True)
class CandidateState:
    """Persisted epoch and a vote for itself; collecting real votes."""

    epoch: int
    election_deadline_ms: int
    granted: set[int] = field(default_factory=set)
    rejected: set[int] = field(default_factory=set)
    role: Role = Role.CANDIDATE


@dataclass(slots=True)
class ReplicaProgress:
    """What the leader knows of one replica in its epoch (end_offset -1: not fetched yet)."""

    replica_id: int
    endpoint: str = ""
    directory_id: str = ""  # as its latest Fetch named it (rule 13)
    end_offset: int = -1
    last_fetch_ms: int = -1
    last_caught_up_ms: int = -1
    last_heard_ms: int = -1  # latest Fetch or FetchSnapshot in this epoch: check-quorum's sign of life
    # The leader's log end and the time at this replica's previous Fetch: a Fetch reaching
    # that end shows the replica was caught up then (Kafka's rule for last caught up).
    previous_fetch_leader_end: int = -1
    previous_fetch_ms: int = -1
    # Its log may have been reset (rule 7): only a Fetch echoing this read nonce acknowledges.
    ack_nonce: int = 0


@dataclass(slots=True)
class ParkedFetch:
    """An idle Fetch the leader holds until new data, a high-watermark move, or its deadline."""

    src: int
    request: FetchRequest
    deadline_ms: int


@dataclass(slots=True)
class PendingRead:
    """A read_index call waiting for a majority of voters to confirm this leader.

    The call raises the leader's read nonce to ``nonce``; every Fetch answer carries the
    current nonce and followers echo the latest one they got. A Fetch echoing ``nonce``
    or more was sent after the follower heard from this leader after the call, so it
    confirms leadership at a time after the call; a delayed or duplicated older Fetch
    cannot.
    """

    token: int
    nonce: int
    confirmed: set[int] = field(default_factory=set)  # voters that echoed the nonce


@dataclass(slots=True)
class PendingBatch:
    """Accumulated proposals waiting to become one log batch (group commit)."""

    records: list[bytes] = field(default_factory=list)
    size_bytes: int = BATCH_OVERHEAD_BYTES


@dataclass(slots=True)
class LeaderState:
    epoch: int
    epoch_start_offset: int
    elected_ms: int
    voters: dict[int, ReplicaProgress]  # every voter except the leader itself
    observers: dict[int, ReplicaProgress] = field(default_factory=dict)
    parked: dict[int, ParkedFetch] = field(default_factory=dict)  # by transport src
    begin_quorum_pending: set[int] = field(default_factory=set)
    begin_quorum_next_ms: int = 0
    reads: dict[int, PendingRead] = field(default_factory=dict)
    read_nonce: int = 0  # raised by each read_index call, sent in every Fetch answer
    pending_batches: list[PendingBatch] = field(default_factory=list)
    pending_records: int = 0
    linger_deadline_ms: int = -1
    role: Role = Role.LEADER


class FetchPhase(enum.Enum):
    IDLE = "idle"  # send the next Fetch as soon as the log is flushed
    IN_FLIGHT = "in_flight"  # one Fetch out, waiting for its response
    WAIT_FLUSH = "wait_flush"  # appended records; the next Fetch waits for the flush
    BACKOFF = "backoff"  # an error answer; retry at next_fetch_ms
    SNAPSHOT = "snapshot"  # downloading a snapshot chunk by chunk


@dataclass(slots=True)
class FollowerState:
    epoch: int
    leader_id: int
    leader_endpoint: str
    voted_id: int
    last_contact_ms: int  # fetch-timeout base: when we started following, or last fetched
    fetch_timeout_ms: int  # fetch_timeout_ms plus this state's random jitter (rule 7)
    fetched_ms: int = -1  # last successful Fetch response from the leader (-1: none yet)
    phase: FetchPhase = FetchPhase.IDLE
    fetch_offset_in_flight: int = -1
    fetch_epoch_in_flight: int = -1  # the in-flight Fetch's last_fetched_epoch
    fetch_sent_ms: int = 0
    next_fetch_ms: int = 0
    read_nonce: int = 0  # latest read nonce the leader sent us, echoed in each Fetch
    snapshot_id: SnapshotId | None = None
    snapshot_position: int = 0
    snapshot_size: int = -1
    role: Role = Role.FOLLOWER


@dataclass(slots=True)
class ResignedState:
    epoch: int
    election_deadline_ms: int
    preferred_successors: tuple[int, ...]
    end_quorum_pending: set[int] = field(default_factory=set)
    end_quorum_next_ms: int = 0
    role: Role = Role.RESIGNED


RoleState = (
    UnattachedState | ProspectiveState | CandidateState | LeaderState | FollowerState | ResignedState
)

