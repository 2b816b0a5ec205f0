"""The simulator with compaction: every replica cleans its MemoryLog to the dirty offset and
tombstone horizon it learned, at seeded times; leaders take snapshots (periodically and when
a fetcher must re-bootstrap); every node applies to a pure key-value model of the state
machine (storage.evaluator.evaluate_commands, the evaluator the real one uses).

Invariants, on top of tests/sim/cluster.py's (checked after every event):

- cleaned ranges are identical (same digest) on every replica that cleaned [log start, end)
  for one log start and end (logs that start at a snapshot clean too);
- a state a replica exposes as real (docs/compaction.md rule 7, ``RaftNode.is_real_state``,
  the rule the runtime's readiness uses) equals the state every committed
  record up to that version produces, so no two replicas expose different states at one
  version, and a key deleted at a committed version never reappears later.

The state machine's durability is modelled as the runtime has it (SQLite with relaxed sync):
a crash keeps the state as of its last sync (taken before every cleaning, which cleans only
below it, and at random applied batches), or, in a quarter of restarts, loses it entirely
where the runtime could rebuild it (a log from offset 0, or one not cleaned past its start);
a restart then reloads a snapshot if the log starts above the state, as the runtime does.
What a replica cleans to, the cleaning itself, when a leader snapshots for a re-bootstrap and
how a restart recovers its state are the runtime's own code (storage.compaction_policy,
storage.cleaning_run), run without a clock or a throttle.

Run: ``python -m tests.sim.compaction --seeds N [--seed S]``.
"""

from __future__ import annotations

import argparse
import pickle
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from raft.log import MemoryLog
from raft.node import Ready, Role
from raft.snapshots import MemorySnapshotStore
from raft.types import Batch, SnapshotId
from storage import compaction_policy as policy
from storage.cleaning_run import run_cleaning
from storage.commands import (
    DEFAULT_CONTENT_TYPE,
    Command,
    CommandDecodeError,
    Compare,
    CompareKind,
    Op,
    OpKind,
    decode_command,
    encode_command,
)
from storage.evaluator import evaluate_commands
from storage.state_types import Entry
from tests.sim.cluster import Cluster, InvariantViolation, NetworkFaults, SimNode

KEYS = tuple(f"k{index}" for index in range(6))
RUN_MS = 6_000  # simulated
TOMBSTONE_RETENTION_RECORDS = 3

State = dict[str, Entry | None]


def _frozen(state: State) -> tuple[tuple[str, bytes, int, int], ...]:
    return tuple(sorted((k, e.value, e.mod_version, e.create_version) for k, e in state.items() if e is not None))


@dataclass
class _Model:
    """One node's state machine: applied version and key -> entry."""

    incarnation: int
    applied: int = 0
    state: State = field(default_factory=lambda: dict.fromkeys(KEYS))
    exposed: int = -1  # the last version checked as real
    durable: tuple[int, State] | None = None  # (version, state) as of the last sync


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
        faults = NetworkFaults(drop_probability=0.03, duplicate_probability=0.02, delay_min_ms=1, delay_max_ms=8)
        self.cluster = Cluster(seed, voters=3, observers=1, faults=faults,
                               config_overrides={"tombstone_retention_records": TOMBSTONE_RETENTION_RECORDS})
        self.models: dict[int, _Model] = {}
        self.digests: dict[tuple[int, int], tuple[int, str]] = {}  # (start, clean_end) -> (node, digest)
        self.reference: list[tuple[tuple[str, bytes, int, int], ...]] = [()]  # version -> state
        self._reference_state: State = dict.fromkeys(KEYS)
        self.pending_checks: dict[int, tuple[int, tuple[tuple[str, bytes, int, int], ...]]] = {}
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
            if previous is not None and previous.durable is not None and not (
                    rebuildable and self.disk_rng.random() < 0.25):
                model.applied, model.state = previous.durable[0], dict(previous.durable[1])
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
            model.applied, model.state = 0, dict.fromkeys(KEYS)
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
            model.applied, model.state = 0, dict.fromkeys(KEYS)
            self.cluster.stats["sim_rebuilds_from_0"] += 1

    def _clean_bound(self, model: _Model) -> int:
        """StateMachine.sync as a cleaning calls it: it cleans only below what it returns."""
        return self._sync(model)

    def _sync(self, model: _Model) -> int:
        """StateMachine.sync: the applied state becomes what a crash keeps."""
        model.durable = (model.applied, dict(model.state))
        return model.applied

    def _load(self, model: _Model, snapshot_id: SnapshotId, node: SimNode) -> None:
        applied, state = pickle.loads(node.snapshots.get(snapshot_id))
        if applied != snapshot_id.end_offset:
            raise InvariantViolation(f"snapshot {snapshot_id} holds version {applied}")
        model.applied, model.state = applied, dict(state)

    def _after_ready(self, node: SimNode, ready: Ready) -> None:
        core = node.core
        if core is None:
            return
        model = self._model(node)
        if ready.snapshot_to_install is not None:
            self._load(model, ready.snapshot_to_install, node)
            self.cluster.stats["sim_snapshot_installs"] += 1
        self._apply(node, model, core.high_watermark)
        if core.role == Role.LEADER:
            self._maybe_snapshot(node, model)
        self._check_exposed(node, model)

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
        if model.applied >= high_watermark:
            return
        for batch in node.log.read(model.applied, 1 << 30):
            if batch.base_offset >= high_watermark:
                break
            for index, record in enumerate(batch.records):
                offset = batch.base_offset + index
                if offset < model.applied or offset >= high_watermark or batch.control:
                    continue
                command: Command | str
                try:
                    command = decode_command(record)
                except CommandDecodeError as exc:
                    command = str(exc)
                evaluate_commands([(offset, command)], model.state)
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
        node.snapshots.put(snapshot_id, pickle.dumps((end, dict(model.state))))
        node.log.record_snapshot(snapshot_id)
        self.cluster.stats["sim_snapshots"] += 1
        return True

    # ------------------------------------------------------------------ invariants

    def _advance_reference(self) -> None:
        committed = self.cluster.committed
        while len(self.reference) - 1 in committed:
            offset = len(self.reference) - 1
            _epoch, control, record = committed[offset]
            if not control:
                evaluate_commands([(offset, decode_command(record))], self._reference_state)
            self.reference.append(_frozen(self._reference_state))

    def _check_exposed(self, node: SimNode, model: _Model) -> None:
        core = node.core
        if core is None:
            return
        real = core.is_real_state(model.applied)  # the rule the runtime's readiness uses
        if not real or model.applied == model.exposed:
            return
        model.exposed = model.applied
        self.cluster.stats["sim_real_versions_checked"] += 1
        self.pending_checks.setdefault(model.applied, (node.node_id, _frozen(model.state)))
        first_node, first_state = self.pending_checks[model.applied]
        if first_state != _frozen(model.state):
            raise InvariantViolation(f"t={self.cluster.now_ms} nodes {first_node} and {node.node_id} expose "
                                     f"different states at version {model.applied}")
        self._advance_reference()
        for version in [v for v in self.pending_checks if v < len(self.reference)]:
            holder, state = self.pending_checks.pop(version)
            expected = self.reference[version]
            if state != expected:
                present = {k for k, *_ in state} - {k for k, *_ in expected}
                raise InvariantViolation(
                    f"t={self.cluster.now_ms} node {holder} exposes at version {version} a state no committed "
                    f"history produces" + (f"; deleted keys reappeared: {sorted(present)}" if present else ""))

    # ------------------------------------------------------------------ the plan

    def clean(self, node_id: int) -> None:
        """Clean one replica's log from its start offset (0, or a snapshot's end) to the
        dirty offset it learned; a log that starts at a snapshot takes its base state from
        the committed history (the real runtime asks its state machine)."""
        node = self.cluster.nodes[node_id]
        core = node.core
        if core is None:
            return
        model = self._model(node)
        log = node.log
        # The runtime's Maintenance.clean and clean_blocking: what it cleans to, and the
        # same run (an admin compaction's: no dirty ratio, no lag), without a throttle or
        # a clock.
        run = run_cleaning(
            _CleanableMemoryLog(log), _ModelBase(self, model),
            policy.clean_target_offset(core.dirty_offset, model.applied, log.flushed_offset()), core.tombstone_horizon,
            force=True, aged_end=None, min_dirty_ratio=0.0, tombstone_retention_records=TOMBSTONE_RETENTION_RECORDS,
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
        if start > 0:
            self.cluster.stats["sim_cleanings_from_snapshot"] += 1
        self.cluster.stats["sim_tombstones_dropped"] += result.tombstones_dropped

    def _committed_state_at(self, keys: Sequence[str], version: int) -> dict[str, Entry | None]:
        self._advance_reference()
        if version >= len(self.reference):
            raise InvariantViolation(f"cleaner asked for version {version}, committed only {len(self.reference) - 1}")
        rows = {key: Entry(key, value, DEFAULT_CONTENT_TYPE, mod_version, create_version)
                for key, value, mod_version, create_version in self.reference[version]}
        return {key: rows.get(key) for key in keys}

    def propose(self) -> None:
        rng = self.rng
        key = rng.choice(KEYS)
        roll = rng.random()
        if roll < 0.35:
            command = Command((), (Op(OpKind.DELETE, key),))
        elif roll < 0.5:  # create only if absent, else delete another key (a txn)
            command = Command((Compare(key, CompareKind.EXISTS, False),),
                              (Op(OpKind.PUT, key, b"new"),), (Op(OpKind.DELETE, rng.choice(KEYS)),))
        else:
            command = Command((), (Op(OpKind.PUT, key, b"v%d" % rng.randrange(1000)),))
        self.cluster.propose((encode_command(command),))

    def run(self) -> CompactionRun:
        cluster, rng = self.cluster, self.rng
        observer = max(cluster.nodes)
        for at_ms in range(20, RUN_MS, 4):
            cluster.at(at_ms, self.propose)
        for node_id in cluster.nodes:
            for _ in range(12):
                cluster.at(rng.randrange(200, RUN_MS), lambda n=node_id: self.clean(n))
        for _ in range(3):
            at_ms = rng.randrange(200, RUN_MS)
            cluster.at(at_ms, lambda: [self._snapshot(n) for n in cluster.nodes.values()
                                       if n.core is not None and n.core.role == Role.LEADER])
        # The observer is cut off (or down) for a long stretch while tombstones are dropped.
        down_ms = rng.randrange(500, 2000)
        up_ms = down_ms + rng.randrange(1500, 3000)
        roll = rng.random()
        if roll < 0.4:
            cluster.at(down_ms, lambda: cluster.partition({observer}, set(cluster.voter_ids)))
            cluster.at(up_ms, cluster.heal)
        elif roll < 0.6:  # a fresh observer: its data is gone, it reads the cleaned log from 0
            cluster.at(down_ms, lambda: self._wipe(observer))
            cluster.at(up_ms, lambda: cluster.restart(observer))
        else:
            cluster.at(down_ms, lambda: cluster.crash(observer))
            cluster.at(up_ms, lambda: cluster.restart(observer))
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
        cluster.run_for(RUN_MS + 2_000)
        for node in cluster.nodes.values():  # the end: everyone caught up and cleaned once more
            self.clean(node.node_id)
        cluster.run_for(1_000)
        self._check_caught_up()
        return CompactionRun(self.seed, cluster.events_processed, dict(cluster.stats))

    def _wipe(self, node_id: int) -> None:
        self.cluster.crash(node_id)
        node = self.cluster.nodes[node_id]
        node.log, node.snapshots, node.durable_state = MemoryLog(), MemorySnapshotStore(), None
        self.models.pop(node_id, None)
        node.checked_offset = node.last_high_watermark = node.last_end_offset = 0

    def _check_caught_up(self) -> None:
        """Liveness: after the faults, every replica applied the leader's state."""
        leader = self.cluster.leader()
        if leader is None or leader.core is None:
            raise InvariantViolation(f"seed {self.seed}: no leader at the end")
        target = self._model(leader).applied
        for node in self.cluster.nodes.values():
            model = self._model(node)
            if node.core is None or model.applied < target:
                raise InvariantViolation(f"seed {self.seed}: node {node.node_id} at version {model.applied}, "
                                         f"leader at {target}")


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
