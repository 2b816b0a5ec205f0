"""The follower's side of RaftNode: fetching, appending, truncation on divergence, and
snapshot download (rule 7 of raft/roles.py; observers too, rules 2 and 9).

The fetch state lives in ``FollowerState`` and is touched only here; RaftNode
(raft/node.py) owns the transitions.
"""

from __future__ import annotations

from raft.messages import (
    NO_EPOCH,
    FetchRequest,
    FetchResponse,
    FetchSnapshotRequest,
    FetchSnapshotResponse,
)
from raft.node_base import NodeBase
from raft.roles import FetchPhase, FollowerState, UnattachedState
from raft.snapshots import CorruptSnapshotError, SnapshotNotFoundError
from raft.types import Batch, ErrorCode, SnapshotId, check
from raft.voters import VoterSet


class FollowerHandlers(NodeBase):
    """Mixin of RaftNode: what a node does while it follows (FollowerState)."""

    # Why this node last refused a leader's answer ("" when it never did): the runtime logs
    # it. A class default, so RaftNode's constructor need not know it.
    refused_leader_reason: str = ""

    def _follower_deadline_ms(self, state: FollowerState) -> int:
        """The fetch timeout, and the retry of an unanswered or refused Fetch."""
        deadline = state.last_contact_ms + state.fetch_timeout_ms
        if state.phase in (FetchPhase.IN_FLIGHT, FetchPhase.SNAPSHOT):
            deadline = min(deadline, state.fetch_sent_ms + self._fetch_request_timeout_ms())
        elif state.phase == FetchPhase.BACKOFF:
            deadline = min(deadline, state.next_fetch_ms)
        return deadline

    def _follower_on_flushed(self, now_ms: int, state: FollowerState) -> None:
        """A Fetch that waited for this flush may go now (its fetch offset is the ack)."""
        if state.phase == FetchPhase.WAIT_FLUSH:
            state.phase = FetchPhase.IDLE
            self._follower_fetch_if_ready(now_ms, state)

    def _follower_tick(self, now_ms: int, state: FollowerState) -> None:
        if now_ms - state.last_contact_ms >= state.fetch_timeout_ms:
            if not self._stands():
                self._become_unattached(now_ms, state.epoch, state.voted_id, 0)
            elif self._shutting_down:  # rule 11: no leader known any more, and no campaign
                self._become_unattached(now_ms, state.epoch, state.voted_id)
            else:
                self._become_prospective(now_ms)
            return
        if state.phase in (FetchPhase.IN_FLIGHT, FetchPhase.SNAPSHOT):
            if now_ms - state.fetch_sent_ms >= self._fetch_request_timeout_ms():
                if state.phase == FetchPhase.SNAPSHOT:
                    self._follower_send_snapshot_fetch(now_ms, state)
                else:
                    state.phase = FetchPhase.IDLE
                    self._follower_fetch_if_ready(now_ms, state)
        elif state.phase == FetchPhase.BACKOFF and now_ms >= state.next_fetch_ms:
            state.phase = FetchPhase.IDLE
            self._follower_fetch_if_ready(now_ms, state)

    def _follower_fetch_if_ready(self, now_ms: int, state: FollowerState) -> None:
        """Send the next Fetch, but only for flushed data: the fetch offset is the ack."""
        if state.phase != FetchPhase.IDLE:
            return
        log = self._log
        if log.flushed_offset() < log.end_offset():
            state.phase = FetchPhase.WAIT_FLUSH
            self._request_flush()
            return
        self._send_fetch(now_ms, state.leader_id, state.epoch)
        state.phase = FetchPhase.IN_FLIGHT
        state.fetch_offset_in_flight = log.end_offset()
        state.fetch_sent_ms = now_ms
        state.fetch_epoch_in_flight = log.last_epoch()

    def _send_fetch(self, now_ms: int, dst: int, epoch: int) -> None:
        log = self._log
        state = self._state
        read_nonce = state.read_nonce if isinstance(state, FollowerState) and state.leader_id == dst else 0
        self._send(dst, FetchRequest(
            epoch, self._id, log.end_offset(), log.last_epoch(), self.high_watermark,
            self.config.fetch_max_wait_ms, self.config.endpoint, read_nonce, log.cleaned_end(),
            self.config.directory_id,
        ))

    def _observer_probe(self, now_ms: int, state: UnattachedState) -> None:
        """Rule 2: an observer asks a random voter who leads."""
        voters = sorted(self._voters - {self._id})  # rule 13: its id may be a voter's with another directory
        if voters:
            self._send_fetch(now_ms, voters[self._rng.randrange(len(voters))], state.epoch)
        state.probe_deadline_ms = now_ms + self.config.retry_backoff_ms + self._rng.randrange(
            self.config.retry_backoff_ms + 1)

    # ------------------------------------------------------------------ fetch responses

    def _on_fetch_response(self, now_ms: int, src: int, response: FetchResponse) -> None:
        if (not self._may_lead(src) or response.epoch < 0 or response.high_watermark < 0
                or response.log_start_offset < 0 or response.fetch_offset < 0 or response.read_nonce < 0):
            return
        if response.error != ErrorCode.NONE:
            self._observe_epoch(now_ms, response.epoch, response.leader_id, response.leader_endpoint, src)
            state = self._state
            if (isinstance(state, FollowerState) and state.leader_id == src and state.phase == FetchPhase.IN_FLIGHT
                    and state.fetch_offset_in_flight == response.fetch_offset):
                self._follower_backoff(now_ms, state)
            return
        if response.leader_id != src:
            return
        if not self._observe_epoch(now_ms, response.epoch, response.leader_id, response.leader_endpoint, src):
            return
        state = self._state
        if not isinstance(state, FollowerState) or state.leader_id != src or state.epoch != response.epoch:
            return
        if (state.phase != FetchPhase.IN_FLIGHT or state.fetch_offset_in_flight != response.fetch_offset
                or state.fetch_epoch_in_flight != response.fetch_epoch):
            return  # stale or duplicated answer: (offset, epoch) name the log the request came from
        if response.tombstone_retention_records != self.config.tombstone_retention_records:
            self._follower_refuse(now_ms, state, response)
            return
        self._leader_high_watermark = (response.epoch, response.high_watermark)  # rule 12
        state.last_contact_ms = now_ms
        state.fetched_ms = now_ms
        self._last_fetched_ms = now_ms
        state.read_nonce = max(state.read_nonce, response.read_nonce)
        state.phase = FetchPhase.IDLE
        if response.leader_endpoint:
            state.leader_endpoint = response.leader_endpoint
            self.peer_endpoints[src] = response.leader_endpoint
        self.dirty_offset = max(self.dirty_offset, response.dirty_offset)
        self.tombstone_horizon = max(self.tombstone_horizon, response.tombstone_horizon)
        self.dirty_offset_known = True
        if response.snapshot_id is not None:
            self._follower_note_snapshot_voters(response)
            self._follower_start_snapshot(now_ms, state, response.snapshot_id)
            return
        if response.diverging_epoch != NO_EPOCH:
            self._follower_truncate(response)
        else:
            self._follower_append(response)
        self._follower_fetch_if_ready(now_ms, state)

    def _follower_backoff(self, now_ms: int, state: FollowerState) -> None:
        """Fetch again after retry_backoff_ms."""
        state.phase = FetchPhase.BACKOFF
        state.next_fetch_ms = now_ms + self.config.retry_backoff_ms

    def _follower_refuse(self, now_ms: int, state: FollowerState, response: FetchResponse) -> None:
        """Follow no leader with another tombstone_retention_records (docs/compaction.md rule
        3): its cleaned prefix may lack tombstones this node's re-bootstrap bound would count
        on when it leads, and cleaned ranges would differ. Learn nothing from the answer; the
        leader is alive (no campaign), so keep asking after a backoff."""
        state.last_contact_ms = now_ms
        self._follower_backoff(now_ms, state)
        self.refused_leader_reason = (
            f"leader {response.leader_id} (epoch {response.epoch}) runs with tombstone_retention_records="
            f"{response.tombstone_retention_records}, this node with {self.config.tombstone_retention_records}: "
            f"not following it (the setting must be equal on every node)")

    def _follower_truncate(self, response: FetchResponse) -> None:
        """Rule 7: cut the log back to where it agrees with the leader. The leader holds
        every committed record, so a cut below the high watermark would mean committed
        records differ: a broken invariant that stops the node, never a silent no-op."""
        log = self._log
        if response.diverging_epoch < 0 or response.diverging_end_offset < 0:
            return
        epoch, end_offset = log.end_offset_for_epoch(response.diverging_epoch)
        offset = min(end_offset, response.diverging_end_offset)
        check(offset >= self.high_watermark,
              f"leader {response.leader_id} (epoch {response.epoch}) asks to truncate to {offset}, "
              f"below the high watermark {self.high_watermark}")
        if offset < log.end_offset():
            log.truncate_to(offset)
            if self._history.latest_offset() >= offset:  # rule 13: truncation undoes a voters record
                self._history.truncate(offset)
                self._refresh_voters()

    def _follower_append(self, response: FetchResponse) -> None:
        log = self._log
        # Every batch below the leader's cleaned end that this log did not have is a copy of
        # its cleaned prefix: offsets may jump there, and records lack superseded ops even
        # where none is missing ([DELETE x, PUT a], [PUT x] cleans to [PUT a], [PUT x]). So it
        # counts as cleaned prefix, and no state inside it is taken for a real version
        # (is_real_state); an offset gap alone missed the gap-free copies (found by the
        # compaction simulator with multi-op transactions; tests/sim/test_compaction_sim.py).
        #
        # Those batches were cleaned relative to the leader's cleaned end C, not to where this
        # copy stops: a record at e < C is gone when a later one in [e, C) supersedes it. So
        # the copy counts as cleaned up to C (recorded durably before the first such batch is
        # appended), not up to where it stops; no state below C is real, and the rest of
        # [end, C) may only come from a log cleaned at least to C. A leader cleaned less
        # (raw records there would be evaluated on a state missing the superseded ops) sends
        # a snapshot at or above C instead: the Fetch request names this log's cleaned end.
        end = log.end_offset()
        if end < log.cleaned_end() and response.cleaned_end < log.cleaned_end():
            return  # the leader should have sent a snapshot (an older leader's answer): ask again
        copies = any(batch.next_offset > end and batch.base_offset < response.cleaned_end
                     for batch in response.records)
        if copies and response.cleaned_end > log.cleaned_end():
            log.allow_gaps_below(response.cleaned_end)
        for batch in response.records:
            end = log.end_offset()
            if batch.next_offset <= end:
                continue
            if ((batch.base_offset > end and batch.next_offset > log.cleaned_end())
                    or batch.epoch > response.epoch or batch.epoch < log.last_epoch()):
                break  # a gap outside a cleaned prefix or an epoch out of order: fetch again
            if batch.base_offset < end:
                batch = Batch(end, batch.epoch, batch.timestamp_ms, batch.control, batch.records[end - batch.base_offset:])
            log.append(batch)
            self._add_voters_records(batch)
        self.high_watermark = max(self.high_watermark, min(log.end_offset(), response.high_watermark))

    # ------------------------------------------------------------------ snapshot download

    def _follower_start_snapshot(self, now_ms: int, state: FollowerState, snapshot_id: SnapshotId) -> None:
        if snapshot_id.end_offset < self.high_watermark or snapshot_id.end_offset <= self._log.start_offset():
            self._follower_backoff(now_ms, state)
            return
        state.snapshot_id = snapshot_id
        state.snapshot_position = 0
        state.snapshot_size = -1
        self._follower_send_snapshot_fetch(now_ms, state)

    def _follower_send_snapshot_fetch(self, now_ms: int, state: FollowerState) -> None:
        check(state.snapshot_id is not None, "snapshot fetch without a snapshot id")
        if state.snapshot_id is None:
            return
        state.phase = FetchPhase.SNAPSHOT
        state.fetch_sent_ms = now_ms
        self._send(state.leader_id, FetchSnapshotRequest(
            state.epoch, self._id, state.snapshot_id, state.snapshot_position, self.config.snapshot_chunk_bytes,
            self.config.directory_id,
        ))

    def _on_fetch_snapshot_response(self, now_ms: int, src: int, response: FetchSnapshotResponse) -> None:
        if not self._observe_response_epoch(now_ms, src, response.epoch, response.leader_id):
            return
        state = self._state
        if (not isinstance(state, FollowerState) or state.phase != FetchPhase.SNAPSHOT or state.leader_id != src
                or response.snapshot_id != state.snapshot_id or response.position != state.snapshot_position):
            return
        state.last_contact_ms = state.fetched_ms = self._last_fetched_ms = now_ms
        snapshot_id = state.snapshot_id
        if response.error != ErrorCode.NONE or response.size < 0 or response.position + len(response.chunk) > response.size:
            self._follower_abandon_snapshot(now_ms, state)
            return
        try:
            if response.position == 0:
                self._snapshots.begin_download(snapshot_id, response.size)
                state.snapshot_size = response.size
            if response.size != state.snapshot_size:
                self._follower_abandon_snapshot(now_ms, state)
                return
            if response.chunk:
                self._snapshots.write_chunk(snapshot_id, response.position, response.chunk)
            state.snapshot_position = response.position + len(response.chunk)
            if state.snapshot_position < response.size:
                self._follower_send_snapshot_fetch(now_ms, state)
                return
            self._snapshots.finish_download(snapshot_id)
        except (CorruptSnapshotError, ValueError, SnapshotNotFoundError, OSError):  # start over later
            self._follower_abandon_snapshot(now_ms, state)
            return
        self._log.reset_to_snapshot(snapshot_id)
        self._follower_voters_after_snapshot()
        self.high_watermark = max(self.high_watermark, snapshot_id.end_offset)
        self._ready.snapshot_to_install = snapshot_id
        state.snapshot_id = None
        state.phase = FetchPhase.IDLE
        self._follower_fetch_if_ready(now_ms, state)

    def _follower_note_snapshot_voters(self, response: FetchResponse) -> None:
        """Rule 13: the leader names the latest voters record below the snapshot's end. It is
        committed; persisting it now (this Ready's quorum state is written before the first
        FetchSnapshot leaves) means a restart after the log was reset still knows the set."""
        if response.snapshot_voters_offset < 0 or not response.snapshot_voters:
            return
        if response.snapshot_id is None or response.snapshot_voters_offset >= response.snapshot_id.end_offset:
            return
        try:
            VoterSet.decode(response.snapshot_voters)
        except ValueError:
            return
        committed = dict(self._persisted.voters)
        committed[response.snapshot_voters_offset] = response.snapshot_voters
        self._persist_voters(committed)

    def _follower_voters_after_snapshot(self) -> None:
        """The log now starts at a snapshot: the set in force comes from the committed voters
        records persisted (the leader's for this snapshot among them), else the static set."""
        self._history.truncate(0)
        for offset, record in self._persisted.voters:
            self._history.add(offset, VoterSet.decode(record))
        self._refresh_voters()

    def _follower_abandon_snapshot(self, now_ms: int, state: FollowerState) -> None:
        state.snapshot_id = None
        self._follower_backoff(now_ms, state)
