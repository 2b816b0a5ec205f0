"""The leader's side of RaftNode: fetch handling, replica progress, group commit, reads.

Rules 6 and 9 of raft/roles.py. The leader's per-replica progress, parked fetches and
pending reads live in ``LeaderState`` and are touched only here (and dropped by
``_leader_step_down`` when the node leaves the role); RaftNode (raft/node.py) owns the
transitions.
"""

from __future__ import annotations

from raft.messages import (
    ANONYMOUS_REPLICA,
    NO_EPOCH,
    NO_LEADER,
    BeginQuorumEpochRequest,
    DescribeQuorumResponse,
    FetchRequest,
    FetchResponse,
    FetchSnapshotRequest,
    FetchSnapshotResponse,
    ReplicaState,
)
from raft.node_base import NodeBase
from raft.roles import LeaderState, ParkedFetch, PendingBatch, PendingRead, ReplicaProgress
from raft.snapshots import SnapshotNotFoundError
from raft.types import Batch, ErrorCode, SnapshotId
from raft.voters import BOOTSTRAP_RECORDS, Voter, VoterChangeError, VoterSet, is_directory_id


class LeaderHandlers(NodeBase):
    """Mixin of RaftNode: what a node does while it leads (LeaderState)."""

    # ------------------------------------------------------------------ queries

    def describe_quorum(self, now_ms: int) -> DescribeQuorumResponse:
        state = self._state
        if not isinstance(state, LeaderState):
            return DescribeQuorumResponse(
                ErrorCode.NOT_LEADER_OR_FOLLOWER, self.epoch, self.leader_id, self.high_watermark, (), ()
            )
        me = [ReplicaState(self._id, self.config.endpoint, self._log.end_offset(), now_ms, now_ms,
                            self.config.directory_id)]
        voters = [_replica_state(p) for p in sorted(state.voters.values(), key=lambda p: p.replica_id)]
        observers = [_replica_state(p) for p in sorted(state.observers.values(), key=lambda p: p.replica_id)]
        if self._is_voter:  # a leader whose removal is not committed yet still leads (rule 13)
            voters = me + voters
        else:
            observers = sorted(me + observers, key=lambda r: r.replica_id)
        return DescribeQuorumResponse(
            ErrorCode.NONE, state.epoch, self._id, self.high_watermark, tuple(voters), tuple(observers)
        )

    def tombstone_unsafe_below(self) -> int:
        """A fetcher with 0 < fetch offset < this may have missed a dropped tombstone: the
        leader sends it a snapshot. Every cleaning drops tombstones only below the tombstone
        horizon and its cleaned end minus tombstone_retention_records (docs/compaction.md);
        both only rise, so this bound covers every cleaning that went into this log. A
        fetcher inside the retention window still finds its tombstones and continues."""
        retained_from = max(0, self._log.cleaned_end() - self.config.tombstone_retention_records)
        return min(self.tombstone_horizon, retained_from)

    def _leader_deadline_ms(self, state: LeaderState) -> int:
        """Check-quorum, BeginQuorumEpoch retries, parked fetches and the linger time."""
        deadline = state.elected_ms + self._check_quorum_ms()
        if self._last_quorum_fetch_ms(state) >= 0:
            deadline = max(deadline, self._last_quorum_fetch_ms(state) + self._check_quorum_ms())
        if state.begin_quorum_pending:
            deadline = min(deadline, state.begin_quorum_next_ms)
        for parked in state.parked.values():
            deadline = min(deadline, parked.deadline_ms)
        if state.pending_batches and state.linger_deadline_ms >= 0 and not self._flush_requested:
            deadline = min(deadline, state.linger_deadline_ms)
        return deadline

    # ------------------------------------------------------------------ inputs

    def _leader_accumulate(
        self, now_ms: int, state: LeaderState, records: list[bytes] | tuple[bytes, ...], size_bytes: int
    ) -> int:
        """Group commit: add a checked proposal to the pending batches; returns its base offset."""
        base_offset = self._log.end_offset() + state.pending_records
        if not state.pending_batches or state.pending_batches[-1].size_bytes + size_bytes > self.config.max_batch_bytes:
            state.pending_batches.append(PendingBatch())
        pending = state.pending_batches[-1]
        pending.records.extend(records)
        pending.size_bytes += size_bytes
        if state.pending_records == 0:
            state.linger_deadline_ms = now_ms + self.config.append_linger_ms
        state.pending_records += len(records)
        self._leader_drain(now_ms, state)
        return base_offset

    def _leader_add_read(self, now_ms: int, state: LeaderState, token: int) -> None:
        """A read_index call: raise the read nonce; the read waits for voters to echo it."""
        state.read_nonce += 1
        state.reads[token] = PendingRead(token, state.read_nonce)
        # Answer parked fetches now, so followers fetch again (and confirm) quickly.
        self._leader_wake_parked(now_ms, state)
        self._leader_complete_reads(state)

    def _leader_tick(self, now_ms: int, state: LeaderState) -> None:
        if state.pending_batches:
            self._leader_drain(now_ms, state)
        expired = [p for p in state.parked.values() if p.deadline_ms <= now_ms]
        for parked in expired:
            del state.parked[parked.src]
            self._leader_answer_fetch(parked.src, parked.request, state)
        if state.begin_quorum_pending and now_ms >= state.begin_quorum_next_ms:
            self._send_begin_quorum(now_ms, state)
        if not self._sole_voter() and now_ms >= state.elected_ms + self._check_quorum_ms():
            if now_ms - self._last_quorum_fetch_ms(state) >= self._check_quorum_ms():
                self._become_resigned(now_ms, state)

    def _last_quorum_fetch_ms(self, state: LeaderState) -> int:
        """The latest time by which a majority of voters (the leader counts) had sent a Fetch
        or a FetchSnapshot in this epoch (Kafka counts both: a voter downloading a snapshot
        follows this leader, and a download may outlast the check-quorum period)."""
        if self._sole_voter():
            return 1 << 62
        times = sorted((p.last_heard_ms for p in state.voters.values()), reverse=True)
        others_needed = self._majority - (1 if self._is_voter else 0)
        return times[others_needed - 1]

    def _sole_voter(self) -> bool:
        return self._is_voter and len(self._voters) == 1

    def _leader_heard_from(self, now_ms: int, state: LeaderState, src: int, replica_id: int,
                           directory_id: str) -> None:
        """A valid Fetch or FetchSnapshot of this epoch from a voter: check-quorum's sign of life."""
        progress = self._voter_progress(state, src, replica_id, directory_id)
        if progress is not None:
            progress.last_heard_ms = now_ms

    def _voter_progress(self, state: LeaderState, src: int, replica_id: int,
                        directory_id: str) -> ReplicaProgress | None:
        """The progress of a voter of the set in force sending as itself, by (id, directory
        id) (rule 13: the same id with another directory is an observer)."""
        progress = state.voters.get(replica_id)
        if progress is None or replica_id != src or not self._voter_set.contains(replica_id, directory_id):
            return None
        return progress

    def _leader_drain(self, now_ms: int, state: LeaderState) -> None:
        """Group commit: turn accumulated proposals into log batches.

        Full batches go to the log at once; the last, partial one waits while a flush is
        in flight (it will join the next flush) or while the linger time runs.
        """
        if not state.pending_batches:
            return
        log = self._log
        appended = False
        while state.pending_batches:
            pending = state.pending_batches[0]
            is_last = len(state.pending_batches) == 1
            if is_last and (self._flush_requested or now_ms < state.linger_deadline_ms):
                break
            state.pending_batches.pop(0)
            log.append(Batch(log.end_offset(), state.epoch, now_ms, False, tuple(pending.records)))
            state.pending_records -= len(pending.records)
            appended = True
        if appended:
            self._request_flush()
            self._leader_wake_parked(now_ms, state)
        if not state.pending_batches:
            state.linger_deadline_ms = -1

    def _leader_step_down(self, now_ms: int, state: LeaderState) -> None:
        """Leaving the leader role: fail pending reads, answer parked fetches at once."""
        # A leader was in contact with the leader (itself) until now: X-Last-Contact-Ms
        # counts from here, not from the last Fetch answer it got as a follower.
        self._last_fetched_ms = now_ms
        self._ready.reads_failed.extend(state.reads)
        state.reads.clear()
        for parked in state.parked.values():  # tell waiting fetchers at once
            self._send(parked.src, self._error_fetch_response(
                parked.request, ErrorCode.NOT_LEADER_OR_FOLLOWER, leader_id=NO_LEADER))
        state.parked.clear()

    # ------------------------------------------------------------------ fetch

    def _on_fetch(self, now_ms: int, src: int, request: FetchRequest) -> None:
        if (request.fetch_offset < 0 or request.epoch < 0 or request.last_fetched_epoch < 0
                or request.last_fetched_epoch > request.epoch or request.max_wait_ms < 0
                or request.high_watermark < 0 or request.read_nonce < 0
                or (request.replica_id != ANONYMOUS_REPLICA and request.replica_id != src)):
            self._send(src, self._error_fetch_response(request, ErrorCode.INVALID_REQUEST))
            return
        state = self._state
        if request.epoch < state.epoch:
            self._send(src, self._error_fetch_response(request, ErrorCode.FENCED_LEADER_EPOCH))
            return
        if request.epoch > state.epoch:
            self._send(src, self._error_fetch_response(request, ErrorCode.UNKNOWN_LEADER_EPOCH))
            return
        if not isinstance(state, LeaderState):
            self._send(src, self._error_fetch_response(request, ErrorCode.NOT_LEADER_OR_FOLLOWER))
            return
        self._leader_on_fetch(now_ms, src, request, state)

    def _leader_on_fetch(self, now_ms: int, src: int, request: FetchRequest, state: LeaderState) -> None:
        log = self._log
        if request.replica_endpoint and request.replica_id != ANONYMOUS_REPLICA:
            if request.replica_id in self._voters or len(self.peer_endpoints) < len(self._voters) + self.config.max_observers:
                self.peer_endpoints[request.replica_id] = request.replica_endpoint
        state.parked.pop(src, None)
        self._leader_heard_from(now_ms, state, src, request.replica_id, request.replica_directory_id)
        acknowledges = self._leader_takes_ack(state, src, request)
        if request.fetch_offset < log.start_offset():
            self._send(src, self._fetch_response(request, state, snapshot_id=log.latest_snapshot_id()))
            return
        unsafe_below = self.tombstone_unsafe_below()
        if not 0 < request.fetch_offset < unsafe_below:
            unsafe_below = 0
        if request.fetch_offset < request.cleaned_end and log.cleaned_end() < request.cleaned_end:
            # docs/compaction.md rule 5: the fetcher holds part of a copy of a prefix cleaned
            # to request.cleaned_end; ours is cleaned less, so our records below that end
            # would be evaluated on a state missing the ops that copy left out.
            unsafe_below = max(unsafe_below, request.cleaned_end)
        if unsafe_below > 0:
            # docs/compaction.md rule 5: tombstones at or above this fetcher's offset may
            # have been dropped from our cleaned prefix; it may hold keys whose deletes it
            # will never see. Only a snapshot at or above that point may replace its state.
            snapshot_id = log.latest_snapshot_id()
            if snapshot_id is None or snapshot_id.end_offset < unsafe_below:
                self.snapshot_wanted_offset = max(self.snapshot_wanted_offset, unsafe_below)
                self._send(src, self._error_fetch_response(request, ErrorCode.SNAPSHOT_NOT_FOUND))
            else:
                self._send(src, self._fetch_response(request, state, snapshot_id=snapshot_id))
            return
        if request.fetch_offset > 0 or request.last_fetched_epoch > 0:
            epoch, end_offset = log.end_offset_for_epoch(request.last_fetched_epoch)
            if epoch != request.last_fetched_epoch or end_offset < request.fetch_offset:
                if end_offset < log.start_offset() and log.latest_snapshot_id() is not None:
                    # The divergence lies in the prefix we replaced by a snapshot.
                    self._send(src, self._fetch_response(request, state, snapshot_id=log.latest_snapshot_id()))
                else:
                    self._send(src, self._fetch_response(request, state, diverging=(epoch, end_offset)))
                return
        # The fetch position is consistent with our log: the fetcher holds (durably) every
        # offset below fetch_offset.
        progress = self._leader_progress(state, request)
        if progress is not None and acknowledges:
            progress.end_offset = request.fetch_offset
            progress.last_fetch_ms = now_ms
            _record_caught_up(progress, request.fetch_offset, log.end_offset(), now_ms)
            if request.replica_endpoint:
                progress.endpoint = request.replica_endpoint
            progress.directory_id = request.replica_directory_id
        is_voter = self._voter_progress(state, src, request.replica_id, request.replica_directory_id) is not None
        if is_voter:
            state.begin_quorum_pending.discard(src)
            for read in state.reads.values():
                if request.read_nonce >= read.nonce:
                    read.confirmed.add(src)
            self._leader_update_high_watermark(now_ms, state)
            self._leader_complete_reads(state)
        if self._leader_should_park(request, state, src if is_voter else None):
            wait_ms = min(request.max_wait_ms, self.config.fetch_max_wait_ms)
            state.parked[src] = ParkedFetch(src, request, now_ms + wait_ms)
            return
        self._leader_answer_fetch(src, request, state)

    def _leader_takes_ack(self, state: LeaderState, src: int, request: FetchRequest) -> bool:
        """May this Fetch acknowledge its offset? Rule 7: a voter fetching from an empty log,
        or below what it acknowledged, may have lost its log (a lost disk), and a Fetch it
        sent before, still on its way, must not acknowledge records it no longer holds. So
        the leader raises the read nonce and takes its later Fetches as acknowledgements
        only once they echo it (sent after it heard from this leader since). A lower
        acknowledgement is always taken: a restarted voter echoes no nonce yet."""
        progress = self._voter_progress(state, src, request.replica_id, request.replica_directory_id)
        if progress is None:
            return True
        falls = request.fetch_offset < progress.end_offset
        acknowledges = falls or request.read_nonce >= progress.ack_nonce
        # A formatted log (rule 13) is never empty: its first batch is the bootstrap one.
        empty_at = BOOTSTRAP_RECORDS if self._history.dynamic else 0
        if falls or request.fetch_offset <= empty_at:
            state.read_nonce += 1
            progress.ack_nonce = state.read_nonce
        return acknowledges

    def _leader_progress(self, state: LeaderState, request: FetchRequest) -> ReplicaProgress | None:
        replica_id = request.replica_id
        if replica_id in state.voters and self._voter_set.contains(replica_id, request.replica_directory_id):
            return state.voters[replica_id]
        if replica_id == ANONYMOUS_REPLICA or replica_id == self._id:
            return None
        progress = state.observers.get(replica_id)
        if progress is None and len(state.observers) < self.config.max_observers:
            progress = ReplicaProgress(replica_id)
            state.observers[replica_id] = progress
        return progress

    def _leader_should_park(self, request: FetchRequest, state: LeaderState, voter: int | None) -> bool:
        if request.max_wait_ms <= 0 or request.fetch_offset < self._log.end_offset():
            return False
        if len(state.parked) >= len(self._voters) + self.config.max_observers:
            return False  # the parking lot is full: answer at once (bound: voters + max_observers)
        if request.high_watermark < self.high_watermark:
            return False
        if voter is not None and request.read_nonce < state.read_nonce and state.reads:
            return False  # it must learn the read nonce now, to confirm the pending reads
        if voter is not None and request.read_nonce < state.voters[voter].ack_nonce:
            return False  # it must learn the read nonce now, to acknowledge again
        return True

    def _leader_answer_fetch(self, src: int, request: FetchRequest, state: LeaderState) -> None:
        records = tuple(self._log.read(request.fetch_offset, self.config.max_batch_bytes))
        self._send(src, self._fetch_response(request, state, records=records))

    def _fetch_response(
        self,
        request: FetchRequest,
        state: LeaderState,
        records: tuple[Batch, ...] = (),
        diverging: tuple[int, int] | None = None,
        snapshot_id: SnapshotId | None = None,
    ) -> FetchResponse:
        self._leader_update_compaction_offsets(state)
        diverging_epoch, diverging_end = diverging if diverging is not None else (NO_EPOCH, -1)
        voters_entry = self._history.entry_at(snapshot_id.end_offset) if snapshot_id is not None else None
        voters_offset, voters = (-1, b"") if voters_entry is None else (voters_entry[0], voters_entry[1].encode())
        return FetchResponse(
            ErrorCode.NONE, state.epoch, self._id, self.config.endpoint, request.fetch_offset,
            self.high_watermark, self._log.start_offset(), self.dirty_offset, self.tombstone_horizon,
            records, diverging_epoch, diverging_end, snapshot_id, state.read_nonce,
            self._log.cleaned_end(), self.config.tombstone_retention_records, request.last_fetched_epoch,
            voters_offset, voters,
        )

    def _error_fetch_response(
        self, request: FetchRequest, error: ErrorCode, leader_id: int | None = None
    ) -> FetchResponse:
        if leader_id is None:
            leader_id = self.leader_id
        endpoint = self.peer_endpoints.get(leader_id, "") if leader_id != self._id else self.config.endpoint
        return FetchResponse(
            error, self.epoch, leader_id, endpoint, request.fetch_offset,
            self.high_watermark, self._log.start_offset(), self.dirty_offset, self.tombstone_horizon,
            (), NO_EPOCH, -1, None, 0, self._log.cleaned_end(), self.config.tombstone_retention_records,
            request.last_fetched_epoch,
        )

    def _leader_wake_parked(self, now_ms: int, state: LeaderState) -> None:
        if not state.parked:
            return
        parked = list(state.parked.values())
        state.parked.clear()
        # Parked fetchers usually wait at the same offset (the log end): read it once.
        records_at: dict[int, tuple[Batch, ...]] = {}
        for fetch in parked:
            offset = fetch.request.fetch_offset
            records = records_at.get(offset)
            if records is None:
                records = records_at[offset] = tuple(self._log.read(offset, self.config.max_batch_bytes))
            self._send(fetch.src, self._fetch_response(fetch.request, state, records=records))

    # ------------------------------------------------------------------ commit, compaction offsets, reads

    def _leader_update_high_watermark(self, now_ms: int, state: LeaderState) -> None:
        """Rule 6: majority of durable offsets, only past the epoch start, never back."""
        # A leader outside the set in force (its removal pending) does not count itself.
        offsets = [self._log.flushed_offset()] if self._is_voter else []
        offsets.extend(max(p.end_offset, 0) for p in state.voters.values())
        offsets.sort(reverse=True)
        candidate = offsets[self._majority - 1]
        if candidate > state.epoch_start_offset and candidate > self.high_watermark:
            self.high_watermark = candidate
            self._leader_wake_parked(now_ms, state)
            self._leader_complete_reads(state)
            # Also here, not only when answering a fetch: a single voter (no fetchers) must
            # still learn how far its own log may be cleaned.
            self._leader_update_compaction_offsets(state)

    def _leader_update_compaction_offsets(self, state: LeaderState) -> None:
        """Dirty offset: min(HW, every voter's offset); tombstone horizon: min of voters'."""
        lowest = self._log.flushed_offset()
        for progress in state.voters.values():
            if progress.end_offset < 0:
                return  # a voter not heard from yet in this epoch: keep the old values
            lowest = min(lowest, progress.end_offset)
        self.tombstone_horizon = max(self.tombstone_horizon, lowest)
        self.dirty_offset = max(self.dirty_offset, min(self.high_watermark, lowest))

    def _leader_complete_reads(self, state: LeaderState) -> None:
        if not state.reads or self.high_watermark <= state.epoch_start_offset:
            return
        done = [t for t, r in state.reads.items()
                if len(r.confirmed & state.voters.keys()) + self._is_voter >= self._majority]
        for token in done:
            del state.reads[token]
            self._ready.reads_done.append((token, self.high_watermark))

    # ------------------------------------------------------------------ voter changes (rule 13)

    def _leader_add_voter(self, now_ms: int, state: LeaderState, voter: Voter) -> int:
        if not is_directory_id(voter.directory_id) or voter.replica_id < 0:
            raise ValueError(f"a voter needs an id >= 0 and a 32-hex-digit directory id, not {voter!r}")
        self._leader_check_change(state)
        if voter.replica_id in self._voters:
            raise VoterChangeError("already-voter", f"replica {voter.replica_id} is a voter already")
        progress = state.observers.get(voter.replica_id)
        fetch_timeout_ms = self.config.fetch_timeout_ms
        caught_up = (
            progress is not None and progress.directory_id == voter.directory_id
            and 0 <= progress.last_fetch_ms and now_ms - progress.last_fetch_ms < fetch_timeout_ms
            and (progress.end_offset >= self.high_watermark
                 or (progress.last_caught_up_ms >= 0 and now_ms - progress.last_caught_up_ms < fetch_timeout_ms)))
        if not caught_up:
            raise VoterChangeError(
                "not-caught-up", f"replica {voter.replica_id} (directory {voter.directory_id}) is not an observer "
                f"that fetched at the high watermark {self.high_watermark} within the last {fetch_timeout_ms} ms")
        return self._leader_append_voters(now_ms, state, self._voter_set.with_voter(voter))

    def _leader_remove_voter(self, now_ms: int, state: LeaderState, replica_id: int, directory_id: str) -> int:
        self._leader_check_change(state)
        voter = self._voter_set.get(replica_id)
        if voter is None or directory_id not in ("", voter.directory_id):
            raise VoterChangeError(
                "unknown-voter", f"no voter {replica_id}{f' with directory {directory_id}' if directory_id else ''}")
        if len(self._voters) == 1:
            raise VoterChangeError("last-voter", f"replica {replica_id} is the last voter")
        return self._leader_append_voters(now_ms, state, self._voter_set.without(replica_id))

    def _leader_check_change(self, state: LeaderState) -> None:
        """KIP-853's gates shared by every change: voters records exist, an entry of this
        leader's epoch is committed, and no voters record is uncommitted."""
        if not self._history.dynamic:
            raise VoterChangeError(
                "kraft-version-0", "the voter set is static (--voters): the log holds no voters record; "
                "a cluster formatted with initial voters can change its voters")
        if self.high_watermark <= state.epoch_start_offset:
            raise VoterChangeError("leader-not-ready", f"leader of epoch {state.epoch} has not committed an "
                                   "entry of its epoch yet")
        pending = self._history.latest_offset()
        if pending >= self.high_watermark:
            raise VoterChangeError("change-pending", f"the voters record at {pending} is not committed yet")

    def _leader_append_voters(self, now_ms: int, state: LeaderState, voters: VoterSet) -> int:
        """Append the voters record; the set is in force at once. Accumulated proposals were
        given their offsets already, so they go to the log first."""
        log = self._log
        while state.pending_batches:
            pending = state.pending_batches.pop(0)
            log.append(Batch(log.end_offset(), state.epoch, now_ms, False, tuple(pending.records)))
            state.pending_records -= len(pending.records)
        state.linger_deadline_ms = -1
        offset = log.end_offset()
        log.append(Batch(offset, state.epoch, now_ms, True, (voters.encode(),)))
        self._history.add(offset, voters)
        self._refresh_voters()
        self._leader_sync_voters(state)
        self._request_flush()
        self._leader_wake_parked(now_ms, state)
        self._leader_update_high_watermark(now_ms, state)
        return offset

    def _leader_sync_voters(self, state: LeaderState) -> None:
        """The set in force changed: removed voters' progress moves to the observers, added
        voters take theirs (a replica that was not heard yet starts unknown)."""
        others = self._voters - {self._id}
        for replica_id in [r for r in state.voters if r not in others]:
            progress = state.voters.pop(replica_id)
            state.begin_quorum_pending.discard(replica_id)
            state.observers[replica_id] = progress
            for read in state.reads.values():
                read.confirmed.discard(replica_id)
        for replica_id in sorted(others - state.voters.keys()):
            progress = state.observers.pop(replica_id, None)
            if progress is None or not self._voter_set.contains(replica_id, progress.directory_id):
                if progress is not None:
                    state.observers[replica_id] = progress
                progress = ReplicaProgress(replica_id, self.peer_endpoints.get(replica_id, ""))
            # Observers' Fetches were no sign of life for check-quorum; from now on they are.
            progress.last_heard_ms = max(progress.last_heard_ms, progress.last_fetch_ms)
            state.voters[replica_id] = progress

    # ------------------------------------------------------------------ quorum epoch, snapshots

    def _send_begin_quorum(self, now_ms: int, state: LeaderState) -> None:
        for voter in sorted(state.begin_quorum_pending):
            self._send(voter, BeginQuorumEpochRequest(
                state.epoch, self._id, self.config.endpoint, self._voter_set.directory_of(voter)))
        state.begin_quorum_next_ms = now_ms + self.config.request_timeout_ms

    def _on_fetch_snapshot(self, now_ms: int, src: int, request: FetchSnapshotRequest) -> None:
        state = self._state
        snapshot_id = request.snapshot_id

        def answer(error: ErrorCode, size: int = 0, chunk: bytes = b"") -> None:
            self._send(src, FetchSnapshotResponse(error, self.epoch, self.leader_id, snapshot_id, size, request.position, chunk))

        if (request.position < 0 or request.max_bytes <= 0 or request.epoch < 0
                or snapshot_id.end_offset < 0 or snapshot_id.epoch < 0):
            answer(ErrorCode.INVALID_REQUEST)
            return
        if request.epoch < state.epoch:
            answer(ErrorCode.FENCED_LEADER_EPOCH)
            return
        if request.epoch > state.epoch:
            answer(ErrorCode.UNKNOWN_LEADER_EPOCH)
            return
        if not isinstance(state, LeaderState):
            answer(ErrorCode.NOT_LEADER_OR_FOLLOWER)
            return
        self._leader_heard_from(now_ms, state, src, request.replica_id, request.replica_directory_id)
        try:
            size = self._snapshots.size_bytes(snapshot_id)
            if request.position > size:
                answer(ErrorCode.POSITION_OUT_OF_RANGE, size)
                return
            max_bytes = min(request.max_bytes, self.config.snapshot_chunk_bytes)
            chunk = self._snapshots.read_chunk(snapshot_id, request.position, max_bytes) if request.position < size else b""
        except (SnapshotNotFoundError, OSError):  # gone, or unreadable: the fetcher retries
            answer(ErrorCode.SNAPSHOT_NOT_FOUND)
            return
        except ValueError:
            answer(ErrorCode.POSITION_OUT_OF_RANGE)
            return
        answer(ErrorCode.NONE, size, chunk)


def _record_caught_up(progress: ReplicaProgress, fetch_offset: int, leader_end: int, now_ms: int) -> None:
    """Kafka's rule for DescribeQuorum's "last caught up": a Fetch at the leader's end is
    caught up now; one at or past the leader's end as of the replica's previous Fetch was
    caught up at that previous Fetch. Under steady writes the end moves between fetches, so
    the first rule alone would never hold for a healthy follower."""
    if fetch_offset >= leader_end:
        progress.last_caught_up_ms = now_ms
    elif 0 <= progress.previous_fetch_leader_end <= fetch_offset:
        progress.last_caught_up_ms = max(progress.last_caught_up_ms, progress.previous_fetch_ms)
    progress.previous_fetch_leader_end = leader_end
    progress.previous_fetch_ms = now_ms


def _replica_state(progress: ReplicaProgress) -> ReplicaState:
    return ReplicaState(
        progress.replica_id, progress.endpoint, max(progress.end_offset, 0),
        progress.last_fetch_ms, progress.last_caught_up_ms, progress.directory_id,
    )
