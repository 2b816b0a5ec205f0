"""The protocol mutations ``make mutants`` plants (tests/mutants/run.py), one rule broken each.

Every entry replaces ``old`` (which must occur exactly once in ``path``) by ``new``: a small,
valid edit that breaks the rule quoted in ``rule``. Rule numbers refer to raft/roles.py's
numbered rules unless the rule names another document (docs/compaction.md's rules, the cleaner's
rules at the top of storage/cleaner.py). A mutant the simulators let through is a hole in the
simulators, not in the catalogue: never weaken a mutant to make it caught. Keep ``old`` short
but unique, so that unrelated edits to the file leave it applicable
(tests/mutants/test_mutants_quick.py checks that every entry applies and compiles).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # occurs exactly once in path
    new: str
    rule: str  # the rule the edit breaks, quoted or paraphrased with its number


NODE = "raft/node.py"
NODE_BASE = "raft/node_base.py"
LEADER = "raft/leader.py"
FOLLOWER = "raft/follower.py"
CLEANER = "storage/cleaner.py"
POLICY = "storage/compaction_policy.py"
CLEANING_RUN = "storage/cleaning_run.py"
MEMORY_LOG = "raft/log.py"

MUTANTS: tuple[Mutant, ...] = (
    # ------------------------------------------------------------------ rule 1: epochs
    Mutant("rule1_accepts_older_epoch", NODE,
           "        if epoch < state.epoch:\n            return False",
           "        if epoch < state.epoch - 1:\n            return False",
           "rule 1: epochs only grow; a message from an older epoch is fenced, never acted on"),
    # ------------------------------------------------------------------ rule 2: unattached
    Mutant("rule2_unattached_voter_never_campaigns", NODE,
           "if stands and now_ms >= state.election_deadline_ms:\n                self._campaign(now_ms, state)",
           "if stands and now_ms >= state.election_deadline_ms:\n"
           "                state.election_deadline_ms = now_ms + self._random_election_timeout_ms()",
           "rule 2: an unattached voter whose election timer fires goes Prospective"),
    Mutant("rule2_observer_never_probes", NODE,
           "                self._observer_probe(now_ms, state)",
           "                state.probe_deadline_ms = now_ms + self.config.retry_backoff_ms",
           "rule 2: an unattached observer probes a random voter with a Fetch to learn the leader"),
    # ------------------------------------------------------------------ rule 3: pre-vote
    Mutant("rule3_prevote_moves_receiver_epoch", NODE,
           "        if request.epoch - 1 > self.epoch:\n"
           "            self._observe_epoch(now_ms, request.epoch - 1, NO_LEADER)",
           "        if request.epoch > self.epoch:\n"
           "            self._observe_epoch(now_ms, request.epoch, NO_LEADER)",
           "rule 3: a pre-vote never changes the receiver's epoch (only e - 1 is learned from it)"),
    Mutant("rule3_follower_grants_prevote", NODE,
           "and now_ms - state.fetched_ms < self.config.fetch_timeout_ms",
           "and now_ms - state.fetched_ms < 0",
           "rule 3: followers that fetched from their leader within fetch_timeout_ms refuse pre-votes"),
    Mutant("rule3_leader_grants_prevote", NODE,
           "recent_leader = isinstance(state, LeaderState) or (",
           "recent_leader = isinstance(state, ResignedState) or (",
           "rule 3: leaders refuse all pre-votes, the resigned grant them. The leader half cannot show: "
           "a leader's answer names it, so the asker follows it, grant or not; a resigned leader that "
           "refuses leaves its successor without a majority when a voter is down (rule 11's handover)"),
    Mutant("rule3_prevote_ignores_log", NODE,
           "not self._persisted.log_lost\n                   and self._log_ok(request))",
           "not self._persisted.log_lost)",
           "rule 3 (with rule 5): a pre-vote is granted only to a log at least as up to date"),
    Mutant("rule3_candidate_without_prevote_majority", NODE,
           "if (len(state.granted & self._voters) >= self._majority and not self._shutting_down",
           "if (len(state.granted & self._voters) >= self._majority - 1 and not self._shutting_down",
           "rule 3: a majority of pre-vote grants (never fewer) -> Candidate"),
    # ------------------------------------------------------------------ rule 4: candidate
    Mutant("rule4_candidate_claims_current_epoch", NODE,
           "epoch, self._id, log.last_epoch(), log.end_offset(), pre_vote,",
           "epoch, self._id, log.last_epoch() if pre_vote else epoch - 1, log.end_offset(), pre_vote,",
           "rule 4: a candidate asks for real votes with its own log's (last epoch, end offset)"),
    Mutant("rule4_leader_without_vote_majority", NODE,
           "            (state.granted if response.vote_granted else state.rejected).add(src)\n"
           "            if len(state.granted & self._voters) >= self._majority:",
           "            (state.granted if response.vote_granted else state.rejected).add(src)\n"
           "            if len(state.granted & self._voters) >= self._majority - 1:",
           "rule 4: a majority of votes (never fewer) -> Leader"),
    # ------------------------------------------------------------------ rule 5: votes
    Mutant("rule5_second_vote_in_epoch", NODE,
           "and persisted.voted_id in (-1, request.candidate_id)",
           "and persisted.voted_id is not None",
           "rule 5: a voter grants at most one vote per epoch"),
    Mutant("rule5_vote_not_persisted", NODE,
           "            self._persist(state.epoch, request.candidate_id, NO_LEADER)\n",
           "",
           "rule 5: a vote is persisted before the response is sent"),
    Mutant("rule5_vote_ignores_log", NODE,
           "            and self._log_ok(request)\n",
           "            and True\n",
           "rule 5: a vote goes only to a candidate whose log is at least as up to date"),
    Mutant("rule5_log_compared_offset_first", NODE,
           "(request.last_offset_epoch, request.last_offset) >= (log.last_epoch(), log.end_offset())",
           "(request.last_offset, request.last_offset_epoch) >= (log.end_offset(), log.last_epoch())",
           "rule 5: logs are compared by (last epoch, end offset) lexicographically, epoch first"),
    # ------------------------------------------------------------------ rule 6: high watermark
    Mutant("rule6_hw_counts_unflushed_leader", LEADER,
           "offsets = [self._log.flushed_offset()]",
           "offsets = [self._log.end_offset()]",
           "rule 6: the high watermark counts the leader's own offset only once flushed"),
    Mutant("rule6_hw_commits_old_epoch", LEADER,
           "if candidate > state.epoch_start_offset and candidate > self.high_watermark:",
           "if candidate > self.high_watermark:",
           "rule 6: the high watermark moves only once it passes epoch_start_offset"),
    Mutant("rule6_hw_moves_back", LEADER,
           "if candidate > state.epoch_start_offset and candidate > self.high_watermark:",
           "if candidate > state.epoch_start_offset and candidate != self.high_watermark:",
           "rule 6: the high watermark never moves back"),
    Mutant("rule6_hw_without_majority", LEADER,
           "candidate = offsets[self._majority - 1]",
           "candidate = offsets[self._majority - 2]",
           "rule 6: the high watermark is the largest offset a majority of voters hold durably"),
    # ------------------------------------------------------------------ rule 6: check-quorum
    Mutant("check_quorum_off", NODE_BASE,
           "return self.config.fetch_timeout_ms * 3 // 2",
           "return 1 << 40",
           "rule 6 check-quorum: without Fetches from a majority for 1.5 x fetch_timeout_ms the leader resigns"),
    Mutant("check_quorum_one_fetch", LEADER,
           "return times[others_needed - 1]",
           "return times[0]",
           "rule 6 check-quorum: Fetches from a majority of voters (not any one) keep the leader"),
    # ------------------------------------------------------------------ read index
    Mutant("read_index_stale_fetch_confirms", LEADER,
           "if request.read_nonce >= read.nonce:",
           "if request.read_nonce >= 0:",
           "read index (PendingRead): only a Fetch echoing the read's nonce, sent after the call, confirms it"),
    Mutant("read_index_without_quorum", LEADER,
           "if len(r.confirmed & state.voters.keys()) + self._is_voter >= self._majority]",
           "if len(r.confirmed & state.voters.keys()) + self._is_voter + 1 >= self._majority]",
           "read index: a majority of voters (the leader counts) must confirm the leader"),
    Mutant("read_index_before_epoch_commit", LEADER,
           "if not state.reads or self.high_watermark <= state.epoch_start_offset:",
           "if not state.reads:",
           "read index: a read completes only once the leader committed an entry of its epoch"),
    # ------------------------------------------------------------------ rule 7: follower
    Mutant("rule7_follower_hw_past_log_end", FOLLOWER,
           "self.high_watermark = max(self.high_watermark, min(log.end_offset(), response.high_watermark))",
           "self.high_watermark = max(self.high_watermark, response.high_watermark)",
           "rule 7: follower high watermark = max(old, min(local end, leader's))"),
    Mutant("rule7_follower_acks_unflushed", FOLLOWER,
           "        if log.flushed_offset() < log.end_offset():\n            state.phase = FetchPhase.WAIT_FLUSH",
           "        if log.flushed_offset() < log.end_offset():\n            self._request_flush()\n"
           "        if False:\n            state.phase = FetchPhase.WAIT_FLUSH",
           "rule 7: a follower fetches (acknowledges) only what it has flushed"),
    Mutant("rule7_truncate_past_own_epoch_end", FOLLOWER,
           "offset = min(end_offset, response.diverging_end_offset)",
           "offset = response.diverging_end_offset",
           "rule 7: a diverging epoch truncates the log back to where it agrees with the leader"),
    Mutant("rule7_never_truncates", FOLLOWER,
           "        log.truncate_to(offset)",
           "        pass",
           "rule 7: a diverging epoch in the response truncates the log"),
    Mutant("rule7_fetch_timer_reset_by_own_fetch", FOLLOWER,
           "        state.fetch_offset_in_flight = log.end_offset()\n        state.fetch_sent_ms = now_ms",
           "        state.fetch_offset_in_flight = log.end_offset()\n        state.fetch_sent_ms = state.last_contact_ms = now_ms",
           "rule 7: no successful Fetch response for fetch_timeout_ms -> Prospective (voters)"),
    Mutant("stale_fetch_acknowledges_lost_log", LEADER,
           "if progress is not None and acknowledges:",
           "if progress is not None:",
           "rule 7: a Fetch a voter sent before its log was lost (arriving after one from its new "
           "log) acknowledges nothing"),
    Mutant("rule7_ack_never_falls", LEADER,
           "progress.end_offset = request.fetch_offset",
           "progress.end_offset = max(progress.end_offset, request.fetch_offset)",
           "rules 6-7: a follower acknowledges an offset only by fetching from it (its latest Fetch counts)"),
    # ------------------------------------------------------------------ rule 8: resigned
    Mutant("rule8_follows_resigned_leader", NODE,
           "        if (epoch, leader_id) == self._resigned_leader:\n            leader_id = NO_LEADER",
           "        if False:\n            leader_id = NO_LEADER",
           "rule 8: after EndQuorumEpoch a node ignores word that the resigned node leads that epoch"),
    # ------------------------------------------------------------------ rule 9: observers
    Mutant("rule9_observer_counts_toward_hw", LEADER,
           "offsets.extend(max(p.end_offset, 0) for p in state.voters.values())",
           "offsets.extend(max(p.end_offset, 0) for p in [*state.voters.values(), *state.observers.values()])",
           "rule 9: observers never count toward the high watermark"),
    Mutant("rule9_observer_campaigns", NODE,
           "if stands and now_ms >= state.election_deadline_ms:",
           "if now_ms >= state.election_deadline_ms:",
           "rule 9: observers are only ever Unattached or Follower, never campaign"),
    # ------------------------------------------------------------------ rule 10: restart
    Mutant("rule10_restart_forgets_vote", NODE,
           "self._persisted = persisted or QuorumStateRecord(0, -1, -1)",
           "self._persisted = QuorumStateRecord(persisted.epoch, -1, persisted.leader_id) if persisted "
           "else QuorumStateRecord(0, -1, -1)",
           "rule 10: a restart resumes from the persisted quorum state (epoch, vote, leader)"),
    # ------------------------------------------------------------------ rule 11: shutdown
    Mutant("rule11_shutdown_prevote_becomes_vote", NODE,
           "if (len(state.granted & self._voters) >= self._majority and not self._shutting_down\n"
           "                and not self._persisted.log_lost):",
           "if (len(state.granted & self._voters) >= self._majority\n"
           "                and not self._persisted.log_lost):",
           "rule 11: a prospective round running when shutdown began never turns into a vote"),
    # ------------------------------------------------------------------ copy rules (cleaned prefix)
    Mutant("copy_only_at_offset_gaps", FOLLOWER,
           "        copies = any(batch.next_offset > end and batch.base_offset < response.cleaned_end",
           "        copies = bool(response.records) and response.records[0].base_offset > end and any(\n"
           "            batch.base_offset < response.cleaned_end",
           "copy rule (issue 20, defect 2): every batch below the leader's cleaned end the log lacked "
           "is a copy, gap or not"),
    Mutant("copy_gaps_refused", FOLLOWER,
           "            log.allow_gaps_below(response.cleaned_end)",
           "            pass",
           "copy rule: offsets may jump inside the leader's cleaned prefix"),
    Mutant("copy_target_is_copy_end", FOLLOWER,
           "        if copies and response.cleaned_end > log.cleaned_end():\n"
           "            log.allow_gaps_below(response.cleaned_end)",
           "        copied_end = max([end] + [b.next_offset for b in response.records\n"
           "                                  if b.next_offset <= response.cleaned_end])\n"
           "        if copies and copied_end > log.cleaned_end():\n"
           "            log.allow_gaps_below(copied_end)",
           "copy rule (docs/compaction.md rule 4): a partial copy counts as cleaned up to the leader's "
           "cleaned end, not to where the copy stops"),
    Mutant("unequal_retention_followed", FOLLOWER,
           "        if response.tombstone_retention_records != self.config.tombstone_retention_records:",
           "        if False:",
           "compaction rule 3 (issue 20, defect 3): no replica follows a leader with another "
           "tombstone retention"),
    Mutant("copy_states_taken_real", NODE,
           "                and applied_version >= min(self.dirty_offset, log.cleaned_end()))",
           "                )",
           "docs/compaction.md rule 7: no state inside a copied cleaned prefix is a real version"),
    Mutant("real_state_before_dirty_known", NODE,
           "return (self.dirty_offset_known and log.end_offset() >= self.dirty_offset",
           "return (log.end_offset() >= self.dirty_offset",
           "docs/compaction.md rule 7: a state is real only once a leader's dirty offset was learned in this run"),
    # ------------------------------------------------------------------ re-bootstrap rules
    Mutant("rebootstrap_off", LEADER,
           "        if not 0 < request.fetch_offset < unsafe_below:",
           "        if True:",
           "docs/compaction.md rule 5: a fetcher below the dropped tombstones gets a snapshot, not records"),
    Mutant("rebootstrap_off_by_one", LEADER,
           "        if not 0 < request.fetch_offset < unsafe_below:",
           "        if not 0 < request.fetch_offset < unsafe_below - 1:",
           "docs/compaction.md rule 5: every fetch offset below tombstone_unsafe_below re-bootstraps"),
    Mutant("rebootstrap_ignores_retention_window", LEADER,
           "retained_from = max(0, self._log.cleaned_end() - self.config.tombstone_retention_records)",
           "retained_from = max(0, self._log.cleaned_end() - 2 * self.config.tombstone_retention_records)",
           "docs/compaction.md rule 5: tombstones may be gone below cleaned end - tombstone_retention_records"),
    Mutant("rebootstrap_stale_snapshot", LEADER,
           "if snapshot_id is None or snapshot_id.end_offset < unsafe_below:",
           "if snapshot_id is None:",
           "docs/compaction.md rule 5: only a snapshot at or above the unsafe offset may replace the state"),
    Mutant("rebootstrap_snapshot_never_taken", POLICY,
           "    if 0 < wanted_offset <= applied_version and snapshot_end < wanted_offset:\n        due = True",
           "    if False:\n        due = True",
           "docs/compaction.md: the leader snapshots when a fetcher must re-bootstrap above the horizon"),
    # ------------------------------------------------------------------ cleaner
    Mutant("cleaner_drops_tombstone_at_bound", CLEANER,
           "if offset < tombstone_horizon:",
           "if offset <= tombstone_horizon:",
           "cleaner rule 3: a tombstone is dropped only below the tombstone horizon given"),
    Mutant("cleaner_ignores_retention", POLICY,
           "return min(tombstone_horizon, max(0, clean_end - tombstone_retention_records))",
           "return min(tombstone_horizon, clean_end)",
           "cleaner rule 3: tombstones are kept tombstone_retention_records below the cleaned end"),
    Mutant("cleaner_drops_leader_changes", CLEANER,
           "                control_records[base + index] = record",
           "                pass",
           "cleaner rule 4: control records (leader changes) are kept verbatim"),
    Mutant("snapshot_epoch_ends_at_snapshot", MEMORY_LOG,
           "            best = (self._snapshot_id.epoch, self._snapshot_id.end_offset)\n            found = True",
           "            best = (self._snapshot_id.epoch, self._snapshot_id.end_offset)\n            found = False",
           "cleaner rule 4 (epoch lookups stay right on a cleaned log): a snapshot's epoch ends where "
           "the next epoch held starts, also when cleaning left no record of its own epoch"),
    Mutant("cleaner_loses_range_end", CLEANER,
           "    if clean_end - 1 not in records_out:\n        records_out[clean_end - 1] = EMPTY_COMMAND",
           "    if False:\n        records_out[clean_end - 1] = EMPTY_COMMAND",
           "cleaner rule 5: the record at clean_end - 1 always survives"),
    # ------------------------------------------------------------------ fixed in session 10 (issue 20)
    Mutant("check_quorum_ignores_fetch_snapshot", LEADER,
           "            return\n        self._leader_heard_from(now_ms, state, src, request.replica_id, request.replica_directory_id)\n"
           "        try:",
           "            return\n        try:",
           "rule 6: check-quorum counts a FetchSnapshot as a sign of life, as Kafka does"),
    Mutant("diverging_end_one_too_low", LEADER,
           "diverging=(epoch, end_offset)",
           "diverging=(epoch, max(0, end_offset - 1))",
           "rule 7: a follower truncates to the leader's end of that epoch, never below its high watermark"),
    Mutant("lost_log_votes", NODE,
           "            and not persisted.log_lost  # rule 12\n",
           "",
           "rule 12: a voter whose log was lost grants no vote until it has caught up"),
    Mutant("truncated_to_empty_taken_for_lost", NODE,
           "        elif not persisted.log_lost and self._log.end_offset() == 0:",
           "        elif False:",
           "rule 12: a log truncated to empty while running is no sign of a lost disk"),
    Mutant("dirty_offset_past_voters", LEADER,
           "self.dirty_offset = max(self.dirty_offset, min(self.high_watermark, lowest))",
           "self.dirty_offset = max(self.dirty_offset, self.high_watermark)",
           "dirty offset = min(high watermark, every voter's offset): the horizon never trails it"),
    Mutant("clean_past_durable_state", CLEANING_RUN,
           "dirty = min(dirty, state.sync())",
           "dirty = min(dirty, dirty)",
           "docs/compaction.md rule 9: a replica cleans only below the version its state holds durably"),
    # ------------------------------------------------------------------ fixed in session 11 (issue 20)
    Mutant("stale_fetch_answer_taken", FOLLOWER,
           "\n                or state.fetch_epoch_in_flight != response.fetch_epoch):",
           "):",
           "rule 7: only the answer to the Fetch in flight (its offset and last epoch) moves the log "
           "(found by make sim SEEDS=100000 at seed 4162)"),
    Mutant("recovery_keeps_state_behind_cleaning", POLICY,
           "if applied_version >= max(log_start, cleaner_end):",
           "if applied_version >= log_start:",
           "docs/compaction.md rule 9: a state is never replayed through a prefix its own cleaner compacted"),
    # ------------------------------------------------------------------ rule 13: dynamic voters (issue 22)
    # Caught only in the seeds that change the voter set (tests/sim/membership.py, 20 %).
    Mutant("voters_no_own_epoch_gate", LEADER,
           "        if self.high_watermark <= state.epoch_start_offset:\n            raise VoterChangeError(",
           "        if False:\n            raise VoterChangeError(",
           "rule 13: the leader changes voters only after an entry of its epoch is committed "
           "(tests/sim/split_change.py runs the schedule it exists for)"),
    Mutant("voters_two_changes_in_flight", LEADER,
           "        if pending >= self.high_watermark:",
           "        if False:",
           "rule 13: one voter change at a time, never while a voters record is uncommitted"),
    Mutant("voters_removed_still_counted", LEADER,
           "for replica_id in [r for r in state.voters if r not in others]:",
           "for replica_id in []:",
           "rule 13: a removed voter no longer counts (high watermark, check-quorum, reads)"),
    Mutant("voters_truncation_keeps_record", FOLLOWER,
           "                self._history.truncate(offset)\n",
           "",
           "rule 13: a truncation below a voters record undoes the change"),
    Mutant("rule12_lost_log_of_current_voters_only", NODE,
           "if persisted.log_acknowledged and self._log_empty_at_start:",
           "if persisted.log_acknowledged and self._log_empty_at_start and self.is_voter:",
           "rule 12: a voter added by a record its lost log no longer holds grants no votes"),
    Mutant("rule12_observer_acks_untracked", NODE,
           "if not self.is_voter and not self._history.dynamic:",
           "if not self.is_voter:",
           "rule 12: an observer being added may be counted before its log names it"),
)

# make test's subset (tests/mutants/test_mutants_quick.py): mutants the current simulators
# catch within the first few seeds, spread over the raft and the compaction simulator.
QUICK: frozenset[str] = frozenset({
    "rule5_second_vote_in_epoch",  # sim seed 2: two leaders in one epoch
    "rule6_hw_counts_unflushed_leader",  # sim seed 0: offset below the HW not durable on a majority
    "rule7_follower_hw_past_log_end",  # sim seed 1: high watermark past the log end
    "rule7_follower_acks_unflushed",  # sim seed 1: offset below the HW not durable on a majority
    "read_index_before_epoch_commit",  # sim seed 36: stale read
    "rebootstrap_off",  # compaction seed 2: a deleted key reappeared
    "clean_past_durable_state",  # compaction seed 3: state behind its own cleaned prefix
    "rule3_follower_grants_prevote",  # sim seed 1: a rejoining follower raised the epoch
    "check_quorum_off",  # sim seed 1: a leader without a quorum still leads
    "check_quorum_one_fetch",  # sim seed 5: a leader without a quorum still leads
    "rule8_follows_resigned_leader",  # sim seed 14: a node follows a leader that resigned
    "rule3_leader_grants_prevote",  # sim seed 5: no successor of a leader shutting down
    "rule5_vote_ignores_log",  # sim seed 1: a new leader lacks a committed record
    "stale_fetch_answer_taken",  # sim seed 4: truncation below the high watermark
    "rule6_hw_commits_old_epoch",  # sim seed 1: figure 8, a committed record about to be cut
    "rule7_ack_never_falls",  # sim seed 2: offset below the HW not durable on a majority (lost disk)
    "read_index_stale_fetch_confirms",  # sim seed 20: stale read from a deposed leader
    "copy_target_is_copy_end",  # compaction seed 0: a copied cleaned log replays to another state
    "real_state_before_dirty_known",  # compaction seed 0: exposed before it heard a leader
    "voters_two_changes_in_flight",  # sim seed 37: two uncommitted voters records in a log
    "voters_truncation_keeps_record",  # sim seed 37: a log end's set is not its latest voters record
})
