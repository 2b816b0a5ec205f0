"""The simulator with compaction: every replica cleans its MemoryLog to the dirty offset and
tombstone horizon it learned, at seeded times; leaders take snapshots (periodically and when
a fetcher must re-bootstrap); every node applies to a pure key-value model of the state
machine (tests/sim/compaction_state.py, over storage.evaluator: the evaluator apply uses).

Each seed draws a plan: 50-500 keys (most writes on a few hot ones), multi-op transactions
(compares, several ops per record, failure branches, a delete riding with a put: the records
a cleaning shrinks without leaving an offset gap), in a third of the seeds every record also
writing a key of its own (cleaned logs then have no offset gap at all), several records per
proposal, a small ``max_batch_bytes``, a tombstone retention of 1-40 records, and an
observer that is away while tombstones are dropped: in half the seeds the delete of a key it
holds lands exactly at (or one offset below) the leader's re-bootstrap bound
min(tombstone horizon, cleaned end - retention) when it returns (compaction_faults.py),
otherwise it returns lagging just around that bound, or wiped; later it is away once more
(wiped, or crashed and back around the bound). A replica copying the cleaned log from 0
restarts gracefully inside the copy in some seeds, or its leader (cleaned just before)
crashes inside the copy, so that the copy goes on from a leader cleaned less; in half a replica loses power right after
a cleaning (on a log from 0 with state.db restored from an older copy); in some a voter starts late with an
empty log and copies the cleaned log from 0, with another retention than the others in half
of those (the core must refuse to follow a leader announcing another one, rule 3).

Invariants, on top of tests/sim/cluster.py's:

- cleaned ranges are identical (same digest) on every replica that cleaned [log start, end)
  for one log start and end (logs that start at a snapshot clean too; unequal retentions
  would break it, so nodes must refuse to follow a leader with another one);
- every state a replica exposes as real (docs/compaction.md rule 7, ``RaftNode.is_real_state``,
  the rule the runtime's readiness uses), at every version it passes through, equals the
  state the committed records up to that version produce: no two replicas expose different
  states at one version, and no deleted key reappears (checked after every applied batch);
- a restarted replica exposes no state before it heard a leader (a Fetch answer) or led
  since the restart (rule 7);
- epoch lookups stay right on cleaned and copied logs: ``end_offset_for_epoch`` of every
  committed epoch ends it where the committed history starts the next (rule 2; divergence
  checks rely on it);
- a cleaned log from 0 replayed from the empty state produces the committed state at its
  cleaned end: at the end of the run, and whenever a copy of a leader's cleaned prefix
  moved that end and the log holds it; no restart reaches a state the runtime refuses.

The state machine's durability is modelled as the runtime has it (SQLite with relaxed sync):
a crash keeps the state as of its last sync (taken before every cleaning, which cleans only
below it, and at random applied batches), or, in a quarter of restarts, loses it entirely
where the runtime could rebuild it (a log from offset 0, or one not cleaned past its start);
a graceful restart keeps it whole; a restart then reloads a snapshot if the log starts
above the state, as the runtime does. What a replica cleans to, the cleaning itself, when a
leader snapshots for a re-bootstrap and how a restart recovers its state are the runtime's
own code (storage.compaction_policy, storage.cleaning_run), run without a clock or a throttle.

Run: ``python -m tests.sim.compaction --seeds N [--seed S]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from raft.log import MemoryLog
from raft.messages import Envelope, FetchResponse
from raft.node import Proposal, Ready, Role
from raft.snapshots import MemorySnapshotStore
from raft.types import Batch, ErrorCode, SnapshotId
from storage import compaction_policy as policy
from storage.cleaning_run import run_cleaning
from storage.commands import (
    Command,
    Compare,
    CompareKind,
    Op,
    OpKind,
    encode_command,
)
from storage.state_types import Entry
from tests.sim.cluster import Cluster, InvariantViolation, NetworkFaults, SimNode
from tests.sim.compaction_faults import (
    CopyHandover,
    MidCopyRestart,
    TombstoneAtBound,
    restart_after_cleaning,
)
from tests.sim.compaction_state import CommittedHistory, ModelState, decode, rows_difference

RUN_MS = 6_000  # simulated
CATCH_UP_MS = 10_000  # after the plan, every replica catches up within this
HOT_KEYS = 8  # most writes go to a few keys, so deletes meet live keys among hundreds
SYNCED_KEPT = 4  # older synced states a replica keeps around (copies of state.db to restore)

@dataclass(frozen=True, slots=True)
class Plan:
    """What one seed exercises (drawn from the seed before anything runs)."""

    keys: tuple[str, ...]
    retention: int  # tombstone_retention_records of every node but a mismatched late voter
    max_batch_bytes: int
    late_voter: int | None  # starts with an empty log at late_start_ms
    late_start_ms: int
    late_retention: int  # that voter's retention (equal to ``retention`` unless mismatched)
    lag_delta: int  # the observer returns this far above (+) or below (-) the re-bootstrap bound
    bound_case: str  # "at", "below": the observer's first absence is TombstoneAtBound; "": another
    gap_free: bool  # every record also writes a key of its own: cleanings leave no offset gap
    again_fresh: bool  # the observer's second absence wipes its data (else a crash, back around the bound)
    copy_restart: bool  # a replica copying the cleaned log from 0 restarts inside the copy
    copy_handover: bool  # ... or its leader crashes inside the copy (instead of the restart)
    restart_after_cleaning_ms: int  # a replica loses power right after a cleaning then (0: never)
    restart_on_snapshot_log: bool  # ... one whose log starts at a snapshot (waited for)


def draw_plan(seed: int, voters: int) -> Plan:
    rng = random.Random(seed ^ 0x91A7)
    keys = tuple(f"k{index}" for index in range(rng.randrange(50, 501)))
    retention = rng.choice((1, 2, 3, 5, 8, 13, 21, 40))
    late_voter = rng.randrange(1, voters + 1) if rng.random() < 0.3 else None
    late_retention = retention
    if late_voter is not None and rng.random() < 0.5:
        late_retention = retention + rng.choice((-1, 1)) * rng.randrange(1, 20)
        late_retention = late_retention if late_retention >= 0 else retention + 7
    plan = Plan(keys, retention, int(400 * 10 ** rng.random()), late_voter, rng.randrange(800, 2500), late_retention,
                rng.randrange(-4, 5), rng.choice(("at", "below", "", "")), rng.random() < 0.35, rng.random() < 0.5,
                rng.random() < 0.6, False,
                rng.randrange(1500, 5000) if rng.random() < 0.5 else 0, rng.random() < 0.5)
    return dataclasses.replace(plan, copy_handover=rng.random() < 0.3)  # drawn last: the rest as before


@dataclass
class _Model:
    """One node's state machine: applied version and key -> entry."""

    incarnation: int
    applied: int = 0
    state: ModelState = field(default_factory=ModelState)
    exposed: int = -1  # the last version checked as real
    durable: tuple[int, ModelState] | None = None  # (version, state) as of the last sync
    synced: list[tuple[int, ModelState]] = field(default_factory=list)  # the last few syncs, oldest first


@dataclass
class CompactionRun:
    seed: int
    events: int
    stats: dict[str, int]


class CompactionSim:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed ^ 0x5EED)
        self.disk_rng = random.Random(seed ^ 0xD15C)  # syncs and state losses, apart from the plan
        self.plan = plan = draw_plan(seed, voters=3)
        self.hot = plan.keys[:HOT_KEYS]
        faults = NetworkFaults(drop_probability=0.03, duplicate_probability=0.02, delay_min_ms=1, delay_max_ms=8)
        self.cluster = Cluster(seed, voters=3, observers=1, faults=faults,
                               config_overrides={"tombstone_retention_records": plan.retention,
                                                 "max_batch_bytes": plan.max_batch_bytes,
                                                 # snapshots of hundreds of keys, in a few chunks
                                                 "snapshot_chunk_bytes": 4096})
        if plan.late_voter is not None:  # down from the start: its log stays empty until it starts
            self.cluster.crash(plan.late_voter)
            late = self.cluster.nodes[plan.late_voter]
            late.config = dataclasses.replace(late.config, tombstone_retention_records=plan.late_retention)
        self.models: dict[int, _Model] = {}
        self.digests: dict[tuple[int, int], tuple[int, str]] = {}  # (start, clean_end) -> (node, digest)
        self.history = CommittedHistory()
        # Versions exposed before the oracle learned they were committed: (node, state) each.
        self.pending_checks: dict[int, tuple[int, ModelState]] = {}
        # node -> (log start, cleaned end, epoch starts below its HW) when its epochs were checked
        self.epochs_checked: dict[int, tuple[int, int, int]] = {}
        # The plans' controls (tests/sim/compaction_faults.py): no proposals, proposals that
        # stop at an offset, voters cleaning only when a plan says, restarts keeping the state.
        self.proposals_held = False
        self.boundary: int | None = None
        self.voter_cleaning_held = False
        self.last_proposal: Proposal | None = None
        self.kept_states: set[int] = set()  # restarted gracefully: state.db as it was
        self.restored: dict[int, tuple[int, ModelState]] = {}  # node -> an older copy of state.db
        self.unique_keys = 0
        # node -> the incarnation in which it last heard a leader (a Fetch answer) or led:
        # docs/compaction.md rule 7, a restarted replica exposes nothing before that.
        self.heard_leader: dict[int, int] = {}
        # node -> the cleaned end its log was last replayed at (or cleaned to by clean()):
        # a copy of a leader's cleaned prefix is checked as soon as the log holds it.
        self.replayed_at: dict[int, int] = {}
        self.cluster.delivery_observers.append(self._note_fetch_answer)
        self.cluster.after_ready = self._after_ready
        for node in self.cluster.nodes.values():  # nodes started before the hook existed
            self._after_ready(node, Ready())

    # ------------------------------------------------------------------ the state model

    def _model(self, node: SimNode) -> _Model:
        model = self.models.get(node.node_id)
        if model is None or model.incarnation != node.incarnation:
            previous, model = model, _Model(node.incarnation)  # a restart
            log = node.log
            start, cleaned = log.start_offset(), log.cleaner_end()  # what the runtime checks
            rebuildable = start == 0 or cleaned <= start
            restored = self.restored.pop(node.node_id, None)
            kept = node.node_id in self.kept_states
            self.kept_states.discard(node.node_id)
            if previous is not None:
                model.synced = previous.synced
            if restored is not None:
                model.applied, model.state = restored[0], restored[1].copy()
                model.durable = restored
            elif previous is not None and previous.durable is not None and not (
                    not kept and rebuildable and self.disk_rng.random() < 0.25):
                model.applied, model.state = previous.durable[0], previous.durable[1].copy()
                model.durable = previous.durable
            self._recover(node, model)
            self.models[node.node_id] = model
        return model

    def _recover(self, node: SimNode, model: _Model) -> None:
        """The runtime's _recover_state, through the same policy (storage.compaction_policy)."""
        log = node.log
        start, cleaned = log.start_offset(), log.cleaner_end()
        step = policy.recovery_step(model.applied, start, log.end_offset(), cleaned)
        if step is policy.Recovery.START_OVER:  # the leader will send its whole cleaned log from 0
            model.applied, model.state = 0, ModelState()
            self.cluster.stats["sim_restarts_from_empty_log"] += 1
        if step is not policy.Recovery.LOAD_SNAPSHOT:
            return
        snapshot_id = policy.newest_snapshot(log.latest_snapshot_id(), node.snapshots.latest_id())
        if snapshot_id is not None and policy.snapshot_helps(snapshot_id, model.applied, start):
            self._load(model, snapshot_id, node)
        step = policy.recovery_step(model.applied, start, log.end_offset(), cleaned, snapshot_loaded=True)
        if step is policy.Recovery.BELOW_LOG_START:
            raise InvariantViolation(f"node {node.node_id}: log starts at {start} without a snapshot "
                                     f"reaching it (state at version {model.applied})")
        if step is policy.Recovery.REFUSE:
            raise InvariantViolation(
                f"t={self.cluster.now_ms} node {node.node_id}: state at version {model.applied} is "
                f"behind the cleaned prefix [{start}, {cleaned}); the runtime would refuse to start")
        if step is policy.Recovery.REBUILD_FROM_0:
            model.applied, model.state = 0, ModelState()
            self.cluster.stats["sim_rebuilds_from_0"] += 1

    def _clean_bound(self, model: _Model) -> int:
        """StateMachine.sync as a cleaning calls it: it cleans only below what it returns."""
        return self._sync(model)

    def _sync(self, model: _Model) -> int:
        """StateMachine.sync: the applied state becomes what a crash keeps."""
        model.durable = (model.applied, model.state.copy())
        model.synced.append(model.durable)
        del model.synced[:-SYNCED_KEPT]
        return model.applied

    def _load(self, model: _Model, snapshot_id: SnapshotId, node: SimNode) -> None:
        applied, state = pickle.loads(node.snapshots.get(snapshot_id))
        if applied != snapshot_id.end_offset:
            raise InvariantViolation(f"snapshot {snapshot_id} holds version {applied}")
        model.applied, model.state = applied, ModelState(dict(state))

    def _note_fetch_answer(self, node: SimNode, envelope: Envelope) -> None:
        message = envelope.message
        if isinstance(message, FetchResponse) and message.error == ErrorCode.NONE:
            self.heard_leader[node.node_id] = node.incarnation

    def _after_ready(self, node: SimNode, ready: Ready) -> None:
        core = node.core
        if core is None:
            return
        if core.role == Role.LEADER:
            self.heard_leader[node.node_id] = node.incarnation
        model = self._model(node)
        if ready.snapshot_to_install is not None:
            self._load(model, ready.snapshot_to_install, node)
            self.cluster.stats["sim_snapshot_installs"] += 1
        self._apply(node, model, core.high_watermark)
        if core.role == Role.LEADER:
            self._maybe_snapshot(node, model)
        self._check_exposed(node, model)
        self._check_epochs(node)
        cleaned_end = node.log.cleaned_end()
        if self.replayed_at.get(node.node_id) != cleaned_end and node.log.end_offset() >= cleaned_end:
            self.replayed_at[node.node_id] = cleaned_end
            self.cluster.stats["sim_copies_replayed"] += 1
            self._check_cleaned_replay(node)

    def _maybe_snapshot(self, node: SimNode, model: _Model) -> None:
        """The runtime's Maintenance.maybe_snapshot, through the same policy, for the
        snapshot the core asks for (periodic ones are the plan's); a refused one is asked
        for again later."""
        core = node.core
        if core is None or model.applied == 0 or not core.is_real_state(model.applied):
            return  # (no snapshot of a state that is no version: rule 9)
        newest = node.log.latest_snapshot_id()
        snapshot_end = newest.end_offset if newest is not None else 0
        wanted = core.snapshot_wanted_offset
        due = policy.snapshot_due(model.applied, snapshot_end, wanted, every_records=0)
        if policy.wanted_snapshot_exists(wanted, snapshot_end):
            core.snapshot_wanted_offset = 0
        if due and self._snapshot(node) and policy.wanted_snapshot_exists(core.snapshot_wanted_offset, model.applied):
            core.snapshot_wanted_offset = 0

    def _apply(self, node: SimNode, model: _Model, high_watermark: int) -> None:
        log = node.log
        while model.applied < high_watermark:
            found = log.read(model.applied, 1)  # the batch holding the next version
            if not found or found[0].base_offset >= high_watermark:
                break
            batch = found[0]
            if not batch.control:
                state, base = model.state, batch.base_offset
                for offset in range(max(model.applied, base), min(high_watermark, batch.next_offset)):
                    state.apply(offset, batch.records[offset - base])
            model.applied = max(model.applied, min(high_watermark, batch.next_offset))
            if self.disk_rng.random() < 0.02:  # a checkpoint or an OS writeback
                self._sync(model)
            # The runtime applies in bounded steps (and serves reads between them): every
            # state this replica passes through must be real whenever the gate says so.
            self._check_exposed(node, model)

    def _snapshot(self, node: SimNode) -> bool:
        model = self._model(node)
        end = model.applied
        if end <= node.log.start_offset() or end == 0:
            return False
        if node.core is None or not node.core.is_real_state(end):
            return False  # Maintenance.maybe_snapshot: no snapshot of a state that is no version
        epoch = 0
        for batch in node.log.batches():
            if batch.base_offset > end - 1:
                break
            epoch = batch.epoch
        if epoch == 0 and node.log.latest_snapshot_id() is not None:
            epoch = node.log.latest_snapshot_id().epoch  # type: ignore[union-attr]
        snapshot_id = SnapshotId(end, epoch)
        node.snapshots.put(snapshot_id, pickle.dumps((end, model.state.entries)))
        node.log.record_snapshot(snapshot_id)
        self.cluster.stats["sim_snapshots"] += 1
        return True

    # ------------------------------------------------------------------ invariants

    def _advance_reference(self) -> None:
        self.history.advance(self.cluster.committed)

    def _check_exposed(self, node: SimNode, model: _Model) -> None:
        core = node.core
        if core is None:
            return
        real = core.is_real_state(model.applied)  # the rule the runtime's readiness uses
        if not real or model.applied == model.exposed:
            return
        if self.heard_leader.get(node.node_id) != node.incarnation:
            raise InvariantViolation(f"t={self.cluster.now_ms} node {node.node_id} exposes version {model.applied} "
                                     "before it heard a leader since its restart (docs/compaction.md rule 7)")
        model.exposed = model.applied
        self.cluster.stats["sim_real_versions_checked"] += 1
        self._advance_reference()
        self._compare_pending()
        history = self.history
        if model.applied <= history.version:
            self._compare_with_history(node.node_id, model.applied, model.state)
            return
        # Committed on this replica before the oracle recorded it (the leader's own Ready):
        # compared as soon as it is.
        first = self.pending_checks.setdefault(model.applied, (node.node_id, model.state.copy()))
        if first[1].digest != model.state.digest:
            raise InvariantViolation(f"t={self.cluster.now_ms} nodes {first[0]} and {node.node_id} expose "
                                     f"different states at version {model.applied}")

    def _compare_pending(self) -> None:
        """Compare the states exposed ahead of the oracle, once it has their versions."""
        for version in [v for v in self.pending_checks if v <= self.history.version]:
            holder, state = self.pending_checks.pop(version)
            self._compare_with_history(holder, version, state)

    def _compare_with_history(self, node_id: int, version: int, state: ModelState) -> None:
        if state.digest != self.history.digests[version]:
            raise InvariantViolation(
                f"t={self.cluster.now_ms} node {node_id} exposes at version {version} a state no committed "
                f"history produces" + rows_difference(state.rows(), self.history.rows_at(version)))

    def _check_epochs(self, node: SimNode) -> None:
        """Epoch lookups stay right on cleaned and copied logs (docs/compaction.md rule 2):
        for every epoch boundary of the committed history inside this replica's committed
        log, ``end_offset_for_epoch`` of the epoch before it answers that boundary, as
        divergence checks and votes rely on. Checked when the cleaned range, the log start
        or the epochs below the high watermark change."""
        core, log = node.core, node.log
        if core is None:
            return
        self._advance_reference()
        starts = self.history.epoch_starts
        high_watermark = min(core.high_watermark, self.history.version)
        below = sum(1 for offset, _epoch in starts if offset < high_watermark)
        key = (log.start_offset(), log.cleaned_end(), below)
        if self.epochs_checked.get(node.node_id) == key:
            return
        self.epochs_checked[node.node_id] = key
        for (_, epoch), (boundary, _) in zip(starts, starts[1:below], strict=False):
            if boundary <= log.start_offset():
                continue
            found = log.end_offset_for_epoch(epoch)
            if found != (epoch, boundary):
                raise InvariantViolation(
                    f"t={self.cluster.now_ms} node {node.node_id}: its log says epoch {epoch} ends at "
                    f"{found[1]} (largest epoch held {found[0]}); the committed history starts the next epoch "
                    f"at {boundary} (cleaned end {log.cleaned_end()}, log start {log.start_offset()})")

    def _check_cleaned_replay(self, node: SimNode) -> None:
        """A cleaned log from 0 holds the whole state: replayed from the empty state up to its
        cleaned end, it produces the committed state at that end. (A log that starts at a
        snapshot does not: its cleanings drop tombstones of keys the snapshot holds, rule 9.)"""
        log = node.log
        end = log.cleaned_end()
        self._advance_reference()
        if log.start_offset() > 0 or end == 0 or end > self.history.version or log.end_offset() < end:
            return  # (a copy that stopped inside a leader's cleaned prefix holds no real state yet)
        state = ModelState()
        for batch in log.read(0, 1 << 30):
            if batch.next_offset > end:
                break
            if not batch.control:
                for index, record in enumerate(batch.records):
                    state.apply(batch.base_offset + index, record)
        if state.digest != self.history.digests[end]:
            raise InvariantViolation(
                f"node {node.node_id}: its cleaned log replayed from 0 to {end} "
                f"is not the committed state at {end}" + rows_difference(state.rows(), self.history.rows_at(end)))

    def history_record_is(self, offset: int, key: str) -> bool:
        """Whether the committed record at ``offset`` names ``key`` only (a plan's victim)."""
        entry = self.cluster.committed.get(offset)
        return entry is not None and not entry[1] and decode(entry[2])[1] == (key,)

    # ------------------------------------------------------------------ the plan

    def clean(self, node_id: int, up_to: int | None = None) -> None:
        """Clean one replica's log from its start offset (0, or a snapshot's end) to the
        dirty offset it learned (``up_to``: no further, as min_compaction_lag_ms would
        hold it back); a log that starts at a snapshot takes its base state from the
        committed history (the real runtime asks its state machine)."""
        node = self.cluster.nodes[node_id]
        core = node.core
        if core is None or (up_to is None and self.voter_cleaning_held and node_id in self.cluster.voter_ids):
            return
        model = self._model(node)
        log = node.log
        target = policy.clean_target_offset(core.dirty_offset, model.applied, log.flushed_offset())
        # The runtime's Maintenance.clean and clean_blocking: what it cleans to, and the
        # same run (an admin compaction's: no dirty ratio, no lag), without a throttle or
        # a clock.
        run = run_cleaning(
            _CleanableMemoryLog(log), _ModelBase(self, model),
            target if up_to is None else min(target, up_to), core.tombstone_horizon,
            force=True, aged_end=None, min_dirty_ratio=0.0,
            tombstone_retention_records=node.config.tombstone_retention_records,
            new_pause=lambda: _no_pause, clock=_no_clock)
        if run.base_state_error is not None:
            raise InvariantViolation(f"t={self.cluster.now_ms} node {node_id}: {run.report['reason']}")
        result = run.result
        if result is None or run.digest is None:
            return
        start, _, digest = run.digest
        self.cluster.compacted_below = max(self.cluster.compacted_below, result.clean_end)
        first = self.digests.setdefault((start, result.clean_end), (node_id, digest))
        if first[1] != digest:
            raise InvariantViolation(f"t={self.cluster.now_ms} nodes {first[0]} and {node_id} cleaned "
                                     f"[{start}, {result.clean_end}) to different bytes")
        self.cluster.stats["sim_cleanings"] += 1
        self.replayed_at[node_id] = log.cleaned_end()  # (compared with the other replicas' bytes above)
        if start > 0:
            self.cluster.stats["sim_cleanings_from_snapshot"] += 1
        self.cluster.stats["sim_tombstones_dropped"] += result.tombstones_dropped
        self._check_epochs(node)

    def _committed_state_at(self, keys: Sequence[str], version: int) -> dict[str, Entry | None]:
        self._advance_reference()
        if version > self.history.version:
            raise InvariantViolation(f"cleaner asked for version {version}, committed only {self.history.version}")
        return self.history.entries_at(keys, version)

    def _key(self) -> str:
        return self.rng.choice(self.hot if self.rng.random() < 0.6 else self.plan.keys)

    def _op(self) -> Op:
        roll = self.rng.random()
        if roll < 0.45:
            return Op(OpKind.PUT, self._key(), b"v%d" % self.rng.randrange(20))
        return Op(OpKind.DELETE if roll < 0.9 else OpKind.GET, self._key())

    def _compare(self) -> Compare:
        rng, key = self.rng, self._key()
        roll = rng.random()
        if roll < 0.5:
            return Compare(key, CompareKind.EXISTS, rng.random() < 0.5)
        if roll < 0.8:
            return Compare(key, CompareKind.VALUE, b"v%d" % rng.randrange(20))
        return Compare(key, CompareKind.MOD_VERSION, rng.choice((0, rng.randrange(1, 2 + self.history.version))))

    def _command(self) -> Command:
        command = self._workload_command()
        if not self.plan.gap_free:
            return command
        # A key written once, by this record only: the record outlives every cleaning (only
        # its superseded ops go), so a cleaned log has no offset gap and a copy of it must be
        # told apart from history without one (docs/compaction.md rule 5).
        own = Op(OpKind.PUT, f"u{self.unique_keys}", b"")
        self.unique_keys += 1
        return Command(command.compare, (*command.success, own), (*command.failure, own))

    def _workload_command(self) -> Command:
        rng = self.rng
        roll = rng.random()
        if roll < 0.25:
            return Command((), (Op(OpKind.DELETE, self._key()),))
        if roll < 0.5:
            return Command((), (Op(OpKind.PUT, self._key(), b"v%d" % rng.randrange(20)),))
        if roll < 0.65:  # a delete riding with a put: its record outlives the delete in a cleaning
            return Command((), (Op(OpKind.DELETE, self._key()), Op(OpKind.PUT, self._key(), b"t%d" % rng.randrange(9))))
        return Command(tuple(self._compare() for _ in range(rng.randrange(3))),
                       tuple(self._op() for _ in range(rng.randrange(1, 5))),
                       tuple(self._op() for _ in range(rng.randrange(3))))

    def propose(self) -> None:
        count = 1 if self.rng.random() < 0.7 else self.rng.randrange(2, 4)
        records = tuple(encode_command(self._command()) for _ in range(count))
        if self.proposals_held:
            return
        if self.boundary is not None:  # a plan wants a batch to end exactly there
            leader = self.cluster.leader()
            if leader is None or leader.core is None:
                return
            last = self.last_proposal
            next_offset = leader.log.end_offset()
            if last is not None and last.epoch == leader.core.epoch:
                next_offset = max(next_offset, last.last_offset + 1)
            records = records[:max(0, self.boundary - next_offset)]
            if not records:
                return  # held until the leader's log reaches the boundary
        self.propose_records(records)

    def propose_records(self, records: tuple[bytes, ...]) -> Proposal | None:
        proposal = self.cluster.propose(records)
        if proposal is not None:
            self.last_proposal = proposal
        return proposal

    def graceful_restart(self, node_id: int, down_ms: int) -> None:
        """Stop a replica as SIGTERM does (log flushed, state.db closed with everything
        applied) and start it again ``down_ms`` later."""
        node = self.cluster.nodes[node_id]
        if node.core is None:
            return
        self._sync(self._model(node))
        self.kept_states.add(node_id)
        self.cluster.shutdown(node_id)
        self.cluster.at(self.cluster.now_ms + down_ms, lambda: self.cluster.restart(node_id))

    def run(self) -> CompactionRun:
        cluster, rng = self.cluster, self.rng
        observer = max(cluster.nodes)
        for at_ms in range(20, RUN_MS, 5):
            cluster.at(at_ms, self.propose)
        for node_id in cluster.nodes:
            for _ in range(12):
                cluster.at(rng.randrange(200, RUN_MS), lambda n=node_id: self.clean(n))
        for _ in range(3):
            at_ms = rng.randrange(200, RUN_MS)
            cluster.at(at_ms, lambda: [self._snapshot(n) for n in cluster.nodes.values()
                                       if n.core is not None and n.core.role == Role.LEADER])
        # The observer is cut off (or down) for a long stretch while tombstones are dropped,
        # or (lag mode) until it lags just around the re-bootstrap bound.
        down_ms = rng.randrange(500, 2000)
        up_ms = down_ms + rng.randrange(1500, 3000)
        roll = rng.random()
        lag_mode = rng.random() < 0.6
        plan = self.plan

        def again(at_ms: int) -> None:
            """... and is away once more after it returned: wiped (it copies the cleaned log
            from 0), or crashed (its log may start at a snapshot now) and returning around
            the bound again."""
            back_ms = at_ms + rng.randrange(50, 300)
            if plan.again_fresh:
                cluster.at(at_ms, lambda: self._wipe(observer))
                cluster.at(back_ms, lambda: cluster.restart(observer))
                self._restart_mid_copy(observer, back_ms)
                return
            cluster.at(at_ms, lambda: cluster.crash(observer))
            self._return_at(observer, at_ms + 20, back_ms, lambda: cluster.restart(observer), lag_mode=True)

        if plan.bound_case:  # it misses a delete that lands exactly at the re-bootstrap bound
            scenario = TombstoneAtBound(self, observer, plan.bound_case == "below", down_ms + 2500,
                                        then=lambda: again(cluster.now_ms + rng.randrange(300, 1500)))
            cluster.at(down_ms, scenario.start)
        elif roll < 0.4:
            cluster.at(down_ms, lambda: cluster.partition({observer}, set(cluster.voter_ids)))
            self._return_at(observer, down_ms + 20, up_ms, cluster.heal, lag_mode)
        elif roll < 0.6:  # a fresh observer: its data is gone, it reads the cleaned log from 0
            cluster.at(down_ms, lambda: self._wipe(observer))
            cluster.at(up_ms, lambda: cluster.restart(observer))
            self._restart_mid_copy(observer, up_ms)
        else:
            cluster.at(down_ms, lambda: cluster.crash(observer))
            self._return_at(observer, down_ms + 20, up_ms, lambda: cluster.restart(observer), lag_mode)
        if not plan.bound_case:
            again(up_ms + rng.randrange(300, 1500))
        if plan.restart_after_cleaning_ms:  # power lost right after a cleaning
            cluster.at(plan.restart_after_cleaning_ms,
                       lambda: self._restart_after_cleaning(plan.restart_on_snapshot_log))
        if plan.late_voter is not None:
            # A voter with an empty log copies the cleaned log from 0, then the leader
            # crashes so that it may lead (and answer fetchers from that copy).
            late_ms = plan.late_start_ms
            cluster.at(late_ms, lambda v=plan.late_voter: cluster.restart(v))
            self._restart_mid_copy(plan.late_voter, late_ms)
            handover_ms = late_ms + rng.randrange(300, 900)
            cluster.at(handover_ms, self._crash_leader)
            cluster.at(handover_ms + rng.randrange(150, 400), lambda: [cluster.restart(v) for v in cluster.voter_ids])
        if rng.random() < 0.5:
            # The whole quorum restarts while the observer is away, one voter staying down
            # past the observer's return: the new leader has not heard every voter of its
            # epoch when the observer fetches from far below its cleaned end.
            cold_ms = rng.randrange(down_ms, up_ms - 400)
            voters = sorted(cluster.voter_ids)
            rng.shuffle(voters)
            for voter in voters:
                cluster.at(cold_ms, lambda v=voter: cluster.crash(v))
            for voter in voters[:-1]:
                cluster.at(cold_ms + rng.randrange(100, 300), lambda v=voter: cluster.restart(v))
            cluster.at(up_ms + rng.randrange(500, 1500), lambda v=voters[-1]: cluster.restart(v))
        for _ in range(2):  # voters crash and come back too
            victim = rng.choice(sorted(cluster.voter_ids))
            at_ms = rng.randrange(300, RUN_MS - 600)
            cluster.at(at_ms, lambda v=victim: cluster.crash(v))
            cluster.at(at_ms + rng.randrange(100, 500), lambda v=victim: cluster.restart(v))
        cluster.run_for(RUN_MS + 1_000)
        for node in cluster.nodes.values():  # the end: everyone caught up and cleaned once more
            self.clean(node.node_id)
        # A copy in small Fetch responses takes a while: liveness is catching up in time.
        if not cluster.run_until(lambda: self._lagging() is None, CATCH_UP_MS):
            raise InvariantViolation(f"seed {self.seed}: {self._lagging()} after {CATCH_UP_MS} ms")
        self._advance_reference()
        self._compare_pending()
        for node in cluster.nodes.values():
            if node.core is not None:
                self._check_cleaned_replay(node)
        cluster.stats["sim_nodes_refusing_a_leader"] = sum(
            1 for node in cluster.nodes.values() if node.core is not None and node.core.refused_leader_reason)
        return CompactionRun(self.seed, cluster.events_processed, dict(cluster.stats))

    def _restart_after_cleaning(self, on_snapshot_log: bool) -> None:
        """Power lost right after a cleaning of a live replica; ``on_snapshot_log``: of one
        whose log starts at a snapshot (there a state behind the cleaned prefix cannot be
        rebuilt), waited for until the plan's end."""
        cluster, rng = self.cluster, self.rng
        live = sorted(node_id for node_id, node in cluster.nodes.items() if node.core is not None
                      and (not on_snapshot_log or node.log.start_offset() > 0))
        if live:
            restart_after_cleaning(self, rng.choice(live), rng.randrange(20, 200))
        elif cluster.now_ms < RUN_MS:
            cluster.at(cluster.now_ms + 20, lambda: self._restart_after_cleaning(on_snapshot_log))

    def _restart_mid_copy(self, node_id: int, from_ms: int) -> None:
        """In some seeds a replica copying the cleaned log from 0 restarts gracefully halfway,
        in others its leader crashes halfway (the copy goes on from another leader)."""
        if self.plan.copy_handover:
            handover = CopyHandover(self, node_id, from_ms + 2000)
            self.cluster.at(from_ms + 1, handover.watch)
        elif self.plan.copy_restart:
            watch = MidCopyRestart(self, node_id, self.rng.randrange(1, 30), from_ms + 2000)
            self.cluster.at(from_ms + 1, watch.watch)

    def _crash_leader(self) -> None:
        leader = self.cluster.leader()
        if leader is not None:
            self.cluster.crash(leader.node_id)

    def _return_at(self, node_id: int, from_ms: int, until_ms: int, come_back: Callable[[], None],
                   lag_mode: bool) -> None:
        """Bring a cut-off fetcher back at ``until_ms``, or (lag mode) as soon as its log end
        is within ``plan.lag_delta`` of the leader's re-bootstrap bound as its next cleaning
        will set it: every voter cleans, then it returns and fetches right around the bound."""
        cluster = self.cluster
        if not lag_mode:
            cluster.at(until_ms, come_back)
            return

        def poll() -> None:
            leader = cluster.leader()
            fetcher_end = cluster.nodes[node_id].log.end_offset()
            if cluster.now_ms < until_ms and (leader is None or leader.core is None or fetcher_end
                                              > leader.core.dirty_offset - self.plan.retention + self.plan.lag_delta):
                cluster.at(cluster.now_ms + 2, poll)
                return
            for voter in sorted(cluster.voter_ids):
                self.clean(voter)
            if leader is not None and leader.core is not None:
                below = fetcher_end < leader.core.tombstone_unsafe_below()
                self.cluster.stats["sim_lagged_below_bound" if below else "sim_lagged_within_retention"] += 1
            come_back()

        cluster.at(from_ms, poll)

    def _wipe(self, node_id: int) -> None:
        self.cluster.crash(node_id)
        node = self.cluster.nodes[node_id]
        node.log, node.snapshots, node.durable_state = MemoryLog(), MemorySnapshotStore(), None
        node.highest_epoch_persisted = 0  # a new observer: it may learn an older epoch first
        self.models.pop(node_id, None)
        node.checked_offset = node.last_high_watermark = node.last_end_offset = 0

    def _lagging(self) -> str | None:
        """Liveness: after the faults, every replica applies the leader's state; else who lags."""
        leader = self.cluster.leader()
        if leader is None or leader.core is None:
            return "no leader"
        target = self._model(leader).applied
        for node in self.cluster.nodes.values():
            if node.config.tombstone_retention_records != self.plan.retention:
                continue  # refuses to follow (rule 3): it may never catch up
            if node.core is None or self._model(node).applied < target:
                return f"node {node.node_id} at version {self._model(node).applied}, leader at {target}"
        return None


class _CleanableMemoryLog:
    """A MemoryLog as storage.cleaning_run reads it (SegmentLog's iteration and size)."""

    def __init__(self, log: MemoryLog) -> None:
        self._log = log

    def start_offset(self) -> int:
        return self._log.start_offset()

    def cleaned_end(self) -> int:
        return self._log.cleaned_end()

    def iter_batches(self, from_offset: int | None = None) -> Iterator[Batch]:
        start = self._log.start_offset() if from_offset is None else from_offset
        return (batch for batch in self._log.batches() if batch.next_offset > start)

    def size_bytes(self) -> int:
        return sum(batch.size_bytes() for batch in self._log.batches())

    def replace_prefix(self, batches: Sequence[Batch], clean_end: int) -> None:
        self._log.replace_prefix(batches, clean_end)


class _ModelBase:
    """A node's state model as a cleaning asks it: sync (the durable version) and, for a log
    that starts at a snapshot, the state at a version (from the committed history)."""

    def __init__(self, sim: CompactionSim, model: _Model) -> None:
        self._sim, self._model = sim, model
        self.entries_at = sim._committed_state_at

    def sync(self) -> int:
        return self._sim._clean_bound(self._model)


def _no_pause() -> None:
    """The simulator cleans without a throttle."""


def _no_clock() -> float:
    return 0.0  # the simulator has no clock: reported durations are 0


def run_compaction_seed(seed: int) -> CompactionRun:
    try:
        return CompactionSim(seed).run()
    except InvariantViolation as exc:
        raise InvariantViolation(f"{exc} (replay: python -m tests.sim.compaction --seed {seed})") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.compaction", description=__doc__)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    totals: dict[str, int] = {}
    for seed in range(args.seed, args.seed + args.seeds):
        try:
            run = run_compaction_seed(seed)
        except InvariantViolation as exc:
            print(f"FAIL seed {seed}: {exc}", file=sys.stderr)
            return 1
        for name, value in run.stats.items():
            totals[name] = totals.get(name, 0) + value
    print(f"{args.seeds} compaction seeds ok in {time.perf_counter() - started:.1f} s")
    print("exercised: " + ", ".join(f"{k}={v}" for k, v in sorted(totals.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
