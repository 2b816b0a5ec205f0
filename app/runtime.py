"""The node runtime: one asyncio loop that drives the pure raft core with real time and I/O.

The core (raft/) decides, the runtime performs: every input (a raft message, a proposal, a
timer expiry, a finished flush) goes into the core, and the core's ``Ready`` is performed in
the order raft/__init__.py states (persist, send, flush, install a snapshot, apply, reads).
Inputs are coalesced: many messages or proposals arriving in one loop iteration share one
``take_ready`` (the core accumulates its outputs), which is what lets group commit work.
Snapshots and cleaning: ``NodeRuntime.maintenance`` (app/runtime_maintenance.py); reads:
app/node_reads.py; watches: app/watch_hub.py, which apply feeds.
Over 800 lines: the loop's inputs and Ready steps share one state; what need not is split off.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from prometheus_client import CollectorRegistry, Counter, Histogram

from app.auth import AuthTokens
from app.config import NodeConfig
from app.leases import LeaderHooks, LeaseManager, NodeLeases, min_ttl_s
from app.node_reads import NodeReads
from app.node_writes import NodeWrites
from app.peer_setup import raft_transport_for
from app.quorum_outbox import QuorumStateOutbox
from app.runtime_maintenance import Maintenance
from app.runtime_metrics import LoopLagProbe, StateCollector
from app.runtime_voters import (
    add_voter_fields,
    initial_voters_for,
    learn_voter_addresses,
    raft_endpoint,
    refuse_standalone_on_static_log,
    refused,
    resolve_voter,
    voter_set_view,
)
from app.service import (
    ApplyResult,
    CompactReport,
    Consistency,
    IndeterminateError,
    NewVoter,
    NodeHeaders,
    NodeStatus,
    NotLeaderError,
    NotReadyError,
    QuorumView,
    ReplicaView,
    ResignReport,
    SnapshotReport,
    SnapshotStorageError,
    VersionWaitTimeoutError,
    VoterChangeIndeterminateError,
    VoterSetView,
    WriteRejectedError,
    WriteTooLargeError,
)
from app.storage_quota import StorageQuota, state_db_bytes
from app.watch_hub import WatchHub
from raft.messages import Envelope
from raft.node import NotLeaderError as RaftNotLeaderError
from raft.node import ProposalRejectedError, RaftConfig, RaftNode, Role
from raft.types import (
    BATCH_OVERHEAD_BYTES,
    RECORD_OVERHEAD_BYTES,
    Batch,
    ProtocolInvariantError,
    SnapshotId,
)
from raft.voters import VoterChangeError, VoterSet
from storage.commands import Command, encode_command
from storage.compaction_policy import (
    Recovery,
    newest_snapshot,
    recovery_step,
    snapshot_helps,
    trim_batches,
)
from storage.data_dir import (
    DataDirError,
    DataDirLock,
    check_identity,
    make_private_data_dir,
    refetch_from_leader,
)
from storage.descriptors import FlushDeferredError
from storage.quorum_state import QuorumStateFile
from storage.segment_log import SegmentLog
from storage.snapshot_store import SnapshotStore
from storage.state_machine import (
    StateDatabaseError,
    StateMachine,
)

logger = logging.getLogger("metakv.runtime")

# Bounds on the work one loop turn may do, so a catching-up replica keeps answering HTTP.
APPLY_MAX_READS_PER_TURN = 8
APPLY_READ_BYTES = 1024 * 1024  # per log read while applying; whole batches may exceed it
FLUSH_RETRY_DELAY_S = 0.1  # a flush that found no file descriptor is tried again this much later
MAX_TIMER_DELAY_S = 3600.0  # the core answers 'never' with a huge deadline; re-check hourly
LATENCY_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05,
                     0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def monotonic_ms() -> int:
    return int(time.monotonic() * 1000)


@dataclass(slots=True)
class _PendingWrite:
    """A proposal waiting to be applied: it succeeded iff the batch applied at ``offset``
    carries ``epoch`` (the leader's epoch when it appended it)."""

    epoch: int
    future: asyncio.Future[Any]
    started_s: float


class NodeRuntime(NodeReads, NodeWrites, NodeLeases):
    """Implements app.service.KVService for one node (its reads: app/node_reads.py, its
    writes: app/node_writes.py); see the module docstring."""

    def __init__(self, config: NodeConfig, *, seed: int | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.config = config
        self.node_id = config.node_id
        self.max_value_bytes = config.max_value_bytes  # read by app.http.create_app
        self.max_lease_ttl_s = config.max_lease_ttl_s
        # Read by app.http.create_app (None: auth off); SIGHUP reloads it (app/cli.py).
        self.auth_tokens = AuthTokens(config.auth_policy) if config.auth_policy is not None else None
        self.data_dir = Path(config.data_dir)
        self.directory_id = ""  # identity.json's, read at start (KIP-853: which replica this is)
        self._known_voters: VoterSet | None = None  # the set whose addresses the transport has
        # Raft endpoints of every voter any set named (and --voters): a voter added back needs its own.
        self._raft_endpoints = {node_id: str(address) for node_id, address in config.voters.items()}
        self.snapshots_dir = self.data_dir / "snapshots"
        self._seed = seed if seed is not None else int.from_bytes(os.urandom(8), "big")
        self._on_fatal = on_fatal or _exit_on_fatal
        self.metrics = CollectorRegistry()  # the HTTP layer registers its request metrics here
        self._commit_latency = Histogram(
            "metakv_commit_latency_seconds", "Proposal to applied-and-acknowledged time on the leader",
            registry=self.metrics, buckets=LATENCY_BUCKETS_S)
        self._fsync_latency = Histogram(
            "metakv_fsync_latency_seconds", "Duration of one log flush (fsync)",
            registry=self.metrics, buckets=LATENCY_BUCKETS_S)
        self._flush_deferrals = Counter(
            "metakv_flush_deferrals", "Log flushes retried because no file descriptor was left",
            registry=self.metrics)
        self._quorum_state_deferrals = Counter(
            "metakv_quorum_state_deferrals", "Quorum-state writes retried because no file descriptor was left "
            "(the messages after them wait)", registry=self.metrics)
        self._apply_latency = Histogram(
            "metakv_apply_latency_seconds", "Duration of one state machine apply call (one SQLite transaction)",
            registry=self.metrics, buckets=LATENCY_BUCKETS_S)
        self.metrics.register(StateCollector(self, monotonic_ms))
        self.quota = StorageQuota(config.quota_bytes, lambda: self.log.size_bytes() + state_db_bytes(self.data_dir),
                                  self.metrics)
        self._loop_lag = LoopLagProbe(self.metrics, LATENCY_BUCKETS_S)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drive_scheduled = False
        self._refusal_logged = ""  # the core's refused_leader_reason, logged once each
        self._timer: asyncio.TimerHandle | None = None
        self._timer_deadline_ms: int | None = None
        self._flush_task: asyncio.Future[None] | None = None  # the flush in the flush thread
        # One flush at a time, on its own thread (the core never asks for two at once).
        self._flush_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"flush-{config.node_id}")
        self._flush_wanted = False
        self._flush_deferred = False  # the last flush found no file descriptor (logged once)
        self._quorum_state_deferred = False  # a retry of the quorum-state write is scheduled
        self._pending: dict[int, _PendingWrite] = {}  # base offset -> waiting proposal
        self._reads: dict[int, asyncio.Future[int]] = {}  # read_index token -> future(offset)
        self._applied_changed = asyncio.Event()
        self._applied_version = 0
        self.watch_hub = WatchHub(self.changes, 0)  # fed by _apply_committed
        commit_timeout_s = config.commit_timeout_ms / 1000
        self.leases = LeaseManager(lambda: self.state, LeaderHooks(
            self.propose, self._leading_epoch, lambda: self._read_index(time.monotonic() + commit_timeout_s),
            lambda version: self._wait_consistent(version, time.monotonic())),
            max_ttl_s=config.max_lease_ttl_s, min_ttl_s=min_ttl_s(config.election_timeout_ms), metrics=self.metrics)
        self._installing_snapshot = False
        self._started = False
        self._closing = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open storage, recover the state machine, start the transport and the timer."""
        self._loop = asyncio.get_running_loop()
        self._applied_changed = asyncio.Event()
        make_private_data_dir(self.data_dir)
        # Before anything is opened: log recovery may cut a tail and delete files.
        self._data_dir_lock = DataDirLock(self.data_dir)
        try:
            self.directory_id = check_identity(self.data_dir, self.config.cluster_id, self.node_id)
            (self.data_dir / "log").mkdir(exist_ok=True)
            self.snapshots_dir.mkdir(parents=True, exist_ok=True)
            self.log = SegmentLog(self.data_dir / "log", segment_bytes=self.config.segment_bytes)
            self.quorum_state_file = QuorumStateFile(self.data_dir)
            persisted = self.quorum_state_file.read()
            self.snapshots = SnapshotStore(self.snapshots_dir)
            self.snapshots.remove_stale_files()  # temp and partial files of a crashed copy or download
            self.state = StateMachine(str(self.data_dir / "state.db"))
            self._recover_state()
            self.watch_hub.reset(self._applied_version)
            cfg = self.config
            self.node = RaftNode(
                RaftConfig(
                    node_id=cfg.node_id,
                    voters=frozenset(cfg.voters),
                    endpoint=cfg.advertise_http,
                    election_timeout_ms=cfg.election_timeout_ms,
                    fetch_timeout_ms=cfg.fetch_timeout_ms,
                    election_backoff_max_ms=cfg.election_backoff_max_ms,
                    fetch_max_wait_ms=cfg.fetch_max_wait_ms,
                    request_timeout_ms=cfg.request_timeout_ms,
                    append_linger_ms=cfg.append_linger_ms,
                    max_batch_bytes=cfg.max_batch_bytes,
                    max_pending_records=cfg.max_pending_records,
                    tombstone_retention_records=cfg.tombstone_retention_records,
                    directory_id=self.directory_id,
                    initial_voters=initial_voters_for(cfg, self.directory_id),
                ),
                self.log, persisted, random.Random(self._seed), self.snapshots, monotonic_ms(),
            )
            self._check_log_lost()
            refuse_standalone_on_static_log(cfg, self.node.voter_set)
            # Snapshots and cleaning (docs/compaction.md), on threads of their own.
            self.maintenance = Maintenance(
                cfg, runtime=self, node=self.node, log=self.log, state=self.state, snapshots=self.snapshots,
                snapshots_dir=self.snapshots_dir, loop=asyncio.get_running_loop(), fatal=self._fatal, wake_waiters=self._wake_waiters)
            # (The core's constructor reads the log, or formats an empty one: either way its end is recovery's.)
            self.maintenance.arrival_marks.restarted(max(self._applied_version, self.log.end_offset()), time.monotonic())
            self.transport = raft_transport_for(cfg, self._on_message)
            self._outbox = QuorumStateOutbox(lambda record: self.quorum_state_file.write(record),
                                             lambda envelope: self.transport.send(envelope))
            await self.transport.start()
            try:
                await self.maintenance.recover()
            except BaseException:
                await self.transport.stop()
                raise
        except BaseException:
            self._close_storage()  # and the lock: a later start in this process may take it
            raise
        self._started = True
        self.leases.start()
        self._loop_lag.start(asyncio.get_running_loop())
        self.maintenance.schedule_cleaner()
        self._drive()
        logger.info("node %d started: log [%d, %d), applied version %d, epoch %d, raft port %d",
                    self.node_id, self.log.start_offset(), self.log.end_offset(),
                    self._applied_version, self.node.epoch, self.transport.port)

    def _recover_state(self) -> None:
        """Bring the state machine to a version the log can continue from.

        SQLite runs with relaxed sync, so it may be behind the log (replay catches up) or,
        after a crash, hold committed records the log's unflushed tail lost (harmless: they
        are committed, the leader re-sends identical records, and every tombstone at and
        above the offset it fetches from). If the log's prefix was replaced by a snapshot
        the state machine has not reached, load that snapshot.

        A state must never be replayed through a prefix this replica's own cleaner compacted
        from a version below that prefix's end (docs/compaction.md rule 9): the deletes
        whose tombstones it dropped would be missed and deleted keys come back. Such a state
        (state.db lost, or restored from a copy) is replaced by a snapshot that reaches past
        the prefix, else rebuilt from offset 0 on a log that starts there, else startup is
        refused. An empty log from 0 with a state above 0 starts over from 0 too: the leader
        answers a fetch from 0 with its whole cleaned log, tombstones dropped anywhere."""
        self._applied_version = self.state.applied_version
        log = self.log
        start, cleaner_end = log.start_offset(), log.cleaner_end()
        if self._applied_version > log.end_offset() and set(self.config.voters) == {self.node_id}:
            # The records past the log's end were committed and applied, and no other voter
            # holds them to send again: this node would append other records at their offsets
            # (its observers and its own state would disagree). Their loss must not be silent.
            raise StateDatabaseError(
                f"{self.state.db_path}: state at version {self._applied_version} but the log ends at "
                f"{log.end_offset()}: the log lost records this node had committed and applied (a "
                f"corrupt tail was cut, or the log was repaired), and it is the only voter. To go on "
                f"without them, move state.db away: the node rebuilds it from the log")
        step = recovery_step(self._applied_version, start, log.end_offset(), cleaner_end)
        if step is Recovery.START_OVER:
            logger.warning("node %d: the log is empty but the state is at version %d: starting "
                           "over from offset 0", self.node_id, self._applied_version)
            self._rebuild_from_0()
        if step is not Recovery.LOAD_SNAPSHOT:
            return
        snapshot_id = newest_snapshot(log.latest_snapshot_id(), self.snapshots.latest_id())
        if snapshot_id is not None and snapshot_helps(snapshot_id, self._applied_version, start):
            self.state.load_snapshot(str(self.snapshots.path_for(snapshot_id)))
            self._applied_version = self.state.applied_version
        step = recovery_step(self._applied_version, start, log.end_offset(), cleaner_end, snapshot_loaded=True)
        if step is Recovery.BELOW_LOG_START:
            raise ProtocolInvariantError(
                f"state at version {self._applied_version} but the log starts at {start} "
                f"and no snapshot reaches it")
        if step is Recovery.REFUSE:
            raise StateDatabaseError(
                f"{self.state.db_path}: state at version {self._applied_version} is behind the log's "
                f"cleaned prefix [{start}, {cleaner_end}), which cannot rebuild it; restore state.db, "
                f"or, {refetch_from_leader(self.data_dir)}")
        if step is Recovery.REBUILD_FROM_0:
            logger.warning("node %d: state at version %d is behind the log's cleaned prefix [0, %d): "
                           "rebuilding it from offset 0", self.node_id, self._applied_version, cleaner_end)
            self._rebuild_from_0()

    def _check_log_lost(self) -> None:
        """Rule 12 of raft/roles.py: the core found this voter's log lost (empty, though its
        quorum-state says it acknowledged records). Say so; a lone voter cannot recover."""
        if not self.node.log_lost:
            return
        if set(self.config.voters) == {self.node_id}:
            raise DataDirError(
                f"{self.data_dir}: the log is empty, but quorum-state says this node acknowledged records: "
                f"its log was lost, and as the only voter no other node holds the committed records to send "
                f"again. Restore the data directory from a backup (to start over empty instead, losing every "
                f"write, move quorum-state away too)")
        logger.warning("node %d: the log is empty, but quorum-state says this node acknowledged records: its "
                       "log was lost. It fetches everything from the leader and neither votes nor stands for "
                       "election until it has caught up", self.node_id)

    def _rebuild_from_0(self) -> None:
        self.state.clear()
        self._applied_version = 0

    async def begin_shutdown(self) -> None:
        """First half of a graceful stop, while HTTP still serves: refuse new writes and, on a
        leader, resign (EndQuorumEpoch) and wait (bounded) until a successor is known, so
        clients are redirected instead of waiting out an election timeout."""
        if self._closing or not self._started:
            return
        self._closing = True
        self._wake_waiters()
        self.watch_hub.close()
        was_leader = self.node.role == Role.LEADER
        if was_leader:
            logger.info("node %d resigning leadership of epoch %d before shutdown", self.node_id, self.node.epoch)
        # Every role, not only a leader: from here on the core never starts a (pre-)vote, so a
        # node on its way out cannot bump the epoch or win an election it would abandon.
        self.node.begin_shutdown(monotonic_ms())
        self._drive()
        if was_leader and self.config.peers:  # a lone voter has nobody to hand over to
            await self._wait_for_successor(self.config.shutdown_grace_ms)

    async def stop(self) -> None:
        """Graceful shutdown: ``begin_shutdown``, then waiting proposals fail, the transport
        closes, the log is flushed and storage closed."""
        if self._closed or not self._started:
            return
        await self.begin_shutdown()
        await self.leases.stop()
        self._fail_pending(IndeterminateError("node shut down before the write committed"),
                           include_committed=False)
        self._fail_reads()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop_lag.stop()
        await self.maintenance.stop()
        await self.transport.stop()
        while self._flush_task is not None:
            await asyncio.shield(self._flush_task)
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(self._flush_executor, self.log.flush)
        self._flush_executor.shutdown(wait=True)
        self.maintenance.close()
        self._close_storage()
        logger.info("node %d stopped", self.node_id)

    async def _wait_for_successor(self, timeout_ms: int) -> None:
        deadline_s = time.monotonic() + timeout_ms / 1000
        while time.monotonic() < deadline_s:
            if self.node.leader_id not in (-1, self.node_id):
                logger.info("node %d handed leadership to node %d", self.node_id, self.node.leader_id)
                return
            await self._wait_applied_change(deadline_s - time.monotonic())

    def _close_storage(self) -> None:
        for name in ("log", "state", "_data_dir_lock"):  # the lock last: nothing is open then
            close = getattr(getattr(self, name, None), "close", None)
            if close is not None:
                close()

    # ------------------------------------------------------------------ driving the core

    def _on_message(self, envelope: Envelope) -> None:
        if self._closed:
            return
        try:
            self.node.handle(monotonic_ms(), envelope)
        except Exception as exc:  # the core raises only on broken invariants: fail-stop
            self._fatal(exc)
            return
        self._kick()

    def _kick(self) -> None:
        """Schedule one ``_drive`` for everything that happened in this loop iteration."""
        if not self._drive_scheduled and self._loop is not None and not self._closed:
            self._drive_scheduled = True
            self._loop.call_soon(self._drive)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_deadline_ms = None
        if self._closed:
            return
        try:
            self.node.tick(monotonic_ms())
        except Exception as exc:
            self._fatal(exc)
            return
        self._drive()

    def _drive(self) -> None:
        """Take the core's Ready and perform it in the safe order (module docstring)."""
        self._drive_scheduled = False
        if self._closed:
            return
        try:
            ready = self.node.take_ready()
            # The quorum state fsyncs before any send; without a descriptor both wait.
            if not self._outbox.perform(ready.quorum_state, ready.messages):
                self._defer_quorum_state()
            if ready.flush:
                self._flush_wanted = True
                self._maybe_start_flush()
            if ready.snapshot_to_install is not None:
                # The core already reset the log to start at the snapshot's end: load the
                # snapshot before applying anything above it (raft/__init__.py).
                self._install_snapshot(ready.snapshot_to_install)
            if ready.high_watermark > self._applied_version:
                self._apply_committed(ready.high_watermark)
            self._complete_reads(ready.reads_done, ready.reads_failed)
            if ready.role_changed:
                self._on_role_changed()
            if self.node.voter_set is not self._known_voters:  # a voters record: dial new voters
                self._known_voters = self.node.voter_set
                learn_voter_addresses(self.transport, self._known_voters, self._raft_endpoints)
            self.maintenance.maybe_snapshot()
            if self.node.refused_leader_reason != self._refusal_logged:
                self._refusal_logged = self.node.refused_leader_reason
                logger.error("node %d: %s", self.node_id, self._refusal_logged)
        except Exception as exc:
            self._fatal(exc)
            return
        self._schedule_timer()

    def _schedule_timer(self) -> None:
        """Arm the timer for the core's next deadline. An armed timer that fires no later is
        kept: deadlines mostly move later (every fetch answered pushes the follower's fetch
        timeout on), and re-arming for each took ~10 % of a follower's loop time (py-spy,
        one writer). Firing early is harmless: ``tick`` acts only on what is due, and the
        ``_drive`` after it arms the timer for the deadline then current."""
        deadline_ms = self.node.next_deadline_ms()
        if self._loop is None:
            return
        if self._timer is not None:
            if self._timer_deadline_ms is not None and self._timer_deadline_ms <= deadline_ms:
                return
            self._timer.cancel()
        delay_s = min(MAX_TIMER_DELAY_S, max(0, deadline_ms - monotonic_ms()) / 1000)
        self._timer = self._loop.call_later(delay_s, self._on_timer)
        self._timer_deadline_ms = deadline_ms

    def _maybe_start_flush(self) -> None:
        """Hand one fsync to the flush thread now, not on a later loop turn: the disk works
        while this turn goes on (sending, applying), which is most of the commit latency."""
        if self._flush_task is None and self._flush_wanted and not self._closed and self._loop is not None:
            self._flush_wanted = False
            loop = self._loop
            self._flush_task = loop.create_future()  # resolved when the flush was handled
            started_s = time.perf_counter()
            flushing = self._flush_executor.submit(self.log.flush)
            flushing.add_done_callback(
                lambda done: loop.call_soon_threadsafe(self._on_flush_done, done, started_s))

    def _on_flush_done(self, flushing: concurrent.futures.Future[None], started_s: float) -> None:
        """The flush thread finished: tell the core (its own offset now counts toward the high
        watermark; a follower may acknowledge it by fetching), then drive and flush again."""
        handled, self._flush_task = self._flush_task, None
        try:
            self._after_flush(flushing, started_s)
        finally:
            if handled is not None and not handled.done():
                handled.set_result(None)

    def _after_flush(self, flushing: concurrent.futures.Future[None], started_s: float) -> None:
        error = flushing.exception()
        if isinstance(error, FlushDeferredError):  # out of descriptors: nothing lost, retry soon
            self._defer_flush(error)
            return
        if error is not None:  # a failed fsync cannot be retried safely: fail-stop
            self._fatal(error)
            return
        self._fsync_latency.observe(time.perf_counter() - started_s)
        if self._flush_deferred:
            self._flush_deferred = False
            logger.warning("node %d: the log flushes again", self.node_id)
        if self._closed:
            return
        try:
            self.node.on_flushed(monotonic_ms())
        except Exception as exc:
            self._fatal(exc)
            return
        self._drive()
        self._maybe_start_flush()

    def _defer_quorum_state(self) -> None:
        if not self._quorum_state_deferred:
            logger.warning("node %d: no file descriptor left to write the quorum state; its messages wait, "
                           "retrying every %.1fs", self.node_id, FLUSH_RETRY_DELAY_S)
            self._quorum_state_deferred = True
            if self._loop is not None and not self._closed:
                self._loop.call_later(FLUSH_RETRY_DELAY_S, self._retry_quorum_state)
        self._quorum_state_deferrals.inc()

    def _retry_quorum_state(self) -> None:
        self._quorum_state_deferred = False
        if self._closed:
            return
        try:
            if self._outbox.perform(None, ()):
                logger.warning("node %d: the quorum state is written again", self.node_id)
            else:
                self._defer_quorum_state()
        except Exception as exc:
            self._fatal(exc)

    def _defer_flush(self, error: FlushDeferredError) -> None:
        if not self._flush_deferred:  # once per shortage, not at every retry
            logger.warning("node %d: %s every %.1fs", self.node_id, error, FLUSH_RETRY_DELAY_S)
        self._flush_deferred = True
        self._flush_deferrals.inc()
        self._flush_wanted = True
        if self._loop is not None and not self._closed:
            self._loop.call_later(FLUSH_RETRY_DELAY_S, self._maybe_start_flush)

    def _apply_committed(self, high_watermark: int) -> None:
        """Apply batches below the high watermark in order; complete the proposals they hold.

        The batches this process appended (proposed here, or fetched) come back from the
        log's in-memory tail (storage/tail_cache.py), not from disk; older ones, and all
        after a restart or when apply lags past the cache's bound, are read from disk."""
        for _ in range(APPLY_MAX_READS_PER_TURN):
            if self._applied_version >= high_watermark or self._installing_snapshot:
                return
            batches = trim_batches(self.log.read(self._applied_version, APPLY_READ_BYTES),
                            self._applied_version, high_watermark)
            if not batches:
                return
            started_s = time.perf_counter()
            results = self.state.apply(batches)
            self._apply_latency.observe(time.perf_counter() - started_s)
            self._applied_version = self.state.applied_version
            self.log.applied_below(self._applied_version)  # let go of their in-memory copies
            self.maintenance.arrival_marks.applied(self._applied_version, time.monotonic())
            self._complete_writes(batches, results)
            self.watch_hub.publish(self._applied_version, results)
            self._wake_waiters()
        self._kick()  # more to apply: continue next turn, after other callbacks ran

    def _complete_writes(self, batches: list[Batch], results: Iterable[Any]) -> None:
        if not self._pending:
            return
        by_offset = {result.offset: result for result in results}
        now_s = time.perf_counter()
        for batch in batches:
            for offset in range(batch.base_offset, batch.next_offset):
                pending = self._pending.pop(offset, None)
                if pending is None or pending.future.done():
                    continue
                result = by_offset.get(offset)
                if batch.epoch == pending.epoch and result is not None:
                    pending.future.set_result(result)
                    self._commit_latency.observe(now_s - pending.started_s)
                else:  # another leader's record took this offset: ours was truncated
                    pending.future.set_exception(IndeterminateError(f"offset {offset} was overwritten"))

    def _complete_reads(self, done: Iterable[tuple[int, int]], failed: Iterable[int]) -> None:
        for token, offset in done:
            future = self._reads.pop(token, None)
            if future is not None and not future.done():
                future.set_result(offset)
        for token in failed:
            future = self._reads.pop(token, None)
            if future is not None and not future.done():
                future.set_exception(self._not_leader())

    def _on_role_changed(self) -> None:
        node = self.node
        logger.info("node %d: role %s, epoch %d, leader %d", self.node_id, node.role.name, node.epoch, node.leader_id)
        if node.role != Role.LEADER and self._pending:
            # Everything committed was applied in step 4 of this Ready; what is left may or
            # may not be committed by the next leader.
            self._fail_pending(IndeterminateError("leadership changed before the write committed"),
                               include_committed=False)
        if node.role != Role.LEADER:
            self._fail_reads()
        self._wake_waiters()  # also those that watch the role (graceful stop)

    def _install_snapshot(self, snapshot_id: SnapshotId) -> None:
        """Replace the state by a downloaded snapshot; reads answer 503 meanwhile."""
        logger.info("node %d installing snapshot %s", self.node_id, snapshot_id)
        self._installing_snapshot = True
        try:
            self.state.load_snapshot(str(self.snapshots.path_for(snapshot_id)))
            self._applied_version = self.state.applied_version
        finally:
            self._installing_snapshot = False
            self.watch_hub.reset(self._applied_version)  # its changes were not published
        self.node.on_snapshot_installed(monotonic_ms(), snapshot_id)
        self._fail_pending(IndeterminateError("replaced by a snapshot"), include_committed=False)
        self._wake_waiters()
        self._kick()

    def _wake_waiters(self) -> None:
        """Wake everything waiting for the applied version or the role to change."""
        self._applied_changed.set()
        self._applied_changed = asyncio.Event()

    def _fail_pending(self, error: Exception, include_committed: bool) -> None:
        for offset in list(self._pending):
            if not include_committed and offset < self._applied_version:
                continue
            pending = self._pending.pop(offset)
            if not pending.future.done():
                pending.future.set_exception(error)

    def _fail_reads(self) -> None:
        reads, self._reads = self._reads, {}
        for future in reads.values():
            if not future.done():
                future.set_exception(self._not_leader())

    def _fatal(self, exc: BaseException) -> None:
        logger.critical("node %d: fatal error, stopping: %r", self.node_id, exc, exc_info=exc)
        self._closed = True
        self._loop_lag.stop()
        self._on_fatal(exc)

    # ------------------------------------------------------------------ KVService

    @property
    def started(self) -> bool:
        """True once start() has recovered storage and the core runs."""
        return self._started

    # What the maintenance reads of this runtime (app.runtime_maintenance.MaintainedRuntime).

    @property
    def closing(self) -> bool:
        """begin_shutdown ran: writes, snapshots and cleanings are refused."""
        return self._closing

    @property
    def closed(self) -> bool:
        """Stopped, or stopped by a fatal error."""
        return self._closed

    @property
    def installing_snapshot(self) -> bool:
        return self._installing_snapshot

    def headers(self) -> NodeHeaders:
        node = self.node
        return NodeHeaders(self._applied_version, self.node_id, node.leader_id, node.epoch,
                           node.last_contact_ms(monotonic_ms()))

    @property
    def applied_version(self) -> int:
        return self._applied_version

    def _leader_url(self) -> str | None:
        node = self.node
        if node.leader_id < 0:
            return None
        return node.leader_endpoint or node.peer_endpoints.get(node.leader_id) or None

    def _not_leader(self) -> NotLeaderError:
        return NotLeaderError(self._leader_url(), self.node.leader_id)

    async def propose(self, command: Command) -> ApplyResult:
        if self._closing or not self._started:
            raise WriteRejectedError("node is shutting down")
        if self.node.role == Role.LEADER:  # the leader decides on its own size; followers redirect
            self.quota.check(command)
        record = encode_command(command)
        batch_bytes = len(record) + RECORD_OVERHEAD_BYTES + BATCH_OVERHEAD_BYTES
        if batch_bytes > self.config.max_batch_bytes:
            raise WriteTooLargeError(
                f"the write needs a log batch of {batch_bytes} bytes; one batch holds at most "
                f"max_batch_bytes={self.config.max_batch_bytes}")
        try:
            proposal = self.node.propose(monotonic_ms(), [record])
        except RaftNotLeaderError:
            raise self._not_leader() from None
        except ProposalRejectedError as exc:
            raise WriteRejectedError(str(exc)) from None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending[proposal.base_offset] = _PendingWrite(proposal.epoch, future, time.perf_counter())
        # One timer handle per write (cheaper than wait_for + shield on the hot path).
        expiry = loop.call_later(self.config.commit_timeout_ms / 1000, self._expire_write, proposal.base_offset, future)
        self._kick()
        try:
            return await future
        finally:
            expiry.cancel()

    def _expire_write(self, offset: int, future: asyncio.Future[Any]) -> None:
        pending = self._pending.get(offset)
        if pending is not None and pending.future is future:
            del self._pending[offset]
        if not future.done():
            future.set_exception(IndeterminateError(f"not committed within {self.config.commit_timeout_ms} ms"))

    async def wait_readable(self, consistency: Consistency, min_version: int | None, wait_ms: int) -> None:
        """``wait_ms`` bounds only the wait for ``min_version`` (docs/api.md). What the
        consistency level itself needs (the leader's quorum round, applying up to the high
        watermark) is bounded by ``commit_timeout_ms`` like a write, and failing it is a 503:
        with ``wait_ms=0`` a linearizable read used to answer 504 "version not reached"
        though no version was asked for."""
        now_s = time.monotonic()
        if consistency == "leader":
            self._require_leader()
            await self._wait_consistent(self.node.high_watermark, now_s)
        elif consistency == "linearizable":
            await self._wait_consistent(await self._read_index(now_s + self.config.commit_timeout_ms / 1000), now_s)
        elif not self.is_ready():
            raise NotReadyError("this replica is catching up")
        if min_version is not None:
            await self._wait_applied(min_version, now_s + wait_ms / 1000)
        if consistency == "local" and not self.is_ready():
            raise NotReadyError("this replica is catching up")

    async def _wait_consistent(self, version: int, started_s: float) -> None:
        try:
            await self._wait_applied(version, started_s + self.config.commit_timeout_ms / 1000)
        except VersionWaitTimeoutError:
            raise NotReadyError(f"the leader did not apply its high watermark {version} within "
                                f"{self.config.commit_timeout_ms} ms") from None

    def _leading_epoch(self) -> int | None:
        """The epoch this node leads (app/leases.py), None when it does not."""
        return self.node.epoch if self.node.role == Role.LEADER and not self._closing else None

    def _require_leader(self) -> None:
        if self.node.role != Role.LEADER or self._closing:
            raise self._not_leader()

    async def _read_index(self, deadline_s: float) -> int:
        """Ask the core to confirm leadership with a quorum round; return the offset the
        state must reach to answer linearizably."""
        self._require_leader()
        try:
            token = self.node.read_index(monotonic_ms())
        except RaftNotLeaderError:
            raise self._not_leader() from None
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._reads[token] = future
        self._kick()
        try:
            return await asyncio.wait_for(future, max(0.0, deadline_s - time.monotonic()))
        except TimeoutError:
            self._reads.pop(token, None)
            raise NotReadyError(f"a quorum did not confirm this leader within {self.config.commit_timeout_ms} ms") from None

    async def _wait_applied(self, version: int, deadline_s: float) -> None:
        while self._applied_version < version:
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                raise VersionWaitTimeoutError(self._applied_version)
            await self._wait_applied_change(remaining_s)

    async def _wait_applied_change(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._applied_changed.wait(), max(0.0, timeout_s))
        except TimeoutError:
            pass

    def is_ready(self) -> bool:
        """docs/compaction.md rule 7 (``RaftNode.is_real_state``), and not while this
        runtime starts, stops or loads a snapshot."""
        return (self._started and not self._closing and not self._installing_snapshot
                and self.node.is_real_state(self._applied_version))

    def status(self) -> NodeStatus:
        node = self.node
        snapshot_id = self.snapshots.latest_id()
        maintenance = self.maintenance
        prefix_digest = maintenance.prefix_digest
        return {
            "node_id": self.node_id,
            "role": node.role.name.lower(),
            "voter": node.is_voter,
            "epoch": node.epoch,
            "leader_id": node.leader_id,
            "leader_url": self._leader_url(),
            "log_start_offset": self.log.start_offset(),
            "log_end_offset": self.log.end_offset(),
            "flushed_offset": self.log.flushed_offset(),
            "high_watermark": node.high_watermark,
            "applied_version": self._applied_version,
            "dirty_offset": node.dirty_offset,
            "tombstone_horizon": node.tombstone_horizon,
            "cleaned_end": self.log.cleaned_end(),
            "prefix_digest": {"start_offset": prefix_digest[0], "end_offset": prefix_digest[1],
                              "sha256": prefix_digest[2]},
            "oldest_version": self.state.oldest_version,
            "log_size_bytes": self.log.size_bytes(),
            "last_clean": maintenance.last_clean,
            "tombstones_dropped_total": maintenance.tombstones_dropped_total,
            "snapshot_id": None if snapshot_id is None else
            {"end_offset": snapshot_id.end_offset, "epoch": snapshot_id.epoch},
            "last_contact_ms": node.last_contact_ms(monotonic_ms()),
            "ready": self.is_ready(),
            "advertise_http": self.config.advertise_http,
            # what etcd's MemberList on any member lists for this one (docs/etcd.md)
            "etcd_client_url": None if self.config.listen_etcd is None else
            f"{'https' if self.config.http_tls else 'http'}://{self.config.listen_etcd}",
            "directory_id": self.directory_id,
            "raft_endpoint": raft_endpoint(self.config),
            "voter_set": voter_set_view(node),
        }

    def quorum(self) -> QuorumView:
        self._require_leader()
        now_ms = monotonic_ms()
        wall_ms = int(time.time() * 1000)
        described = self.node.describe_quorum(now_ms)

        def replica(state: Any, observer: bool) -> ReplicaView:
            def wall(monotonic: int) -> int | None:
                return None if monotonic <= 0 else wall_ms - (now_ms - monotonic)
            return add_voter_fields({
                "node_id": state.replica_id,
                "endpoint": state.endpoint or self.node.peer_endpoints.get(state.replica_id, ""),
                "log_end_offset": state.log_end_offset,
                "lag": max(0, described.high_watermark - state.log_end_offset),
                "last_fetch_timestamp_ms": wall(state.last_fetch_timestamp_ms),
                "last_caught_up_timestamp_ms": wall(state.last_caught_up_timestamp_ms),
            }, state, observer, described.high_watermark, now_ms, self.config.fetch_timeout_ms)

        return {
            "epoch": described.epoch,
            "leader_id": described.leader_id,
            "high_watermark": described.high_watermark,
            "voters": [replica(state, False) for state in described.voters],
            "observers": [replica(state, True) for state in described.observers],
            "voter_set": voter_set_view(self.node),
        }

    async def take_snapshot(self) -> SnapshotReport:
        """POST /v1/admin/snapshot (app.runtime_maintenance.Maintenance.take_snapshot)."""
        return await self.maintenance.take_snapshot()

    def open_snapshot(self, end_offset: int, epoch: int) -> BinaryIO:
        """POST /v1/admin/snapshot/download: a snapshot's file, open for reading."""
        try:
            return open(self.snapshots.path_for(SnapshotId(end_offset, epoch)), "rb")
        except FileNotFoundError:  # retention removed it already
            raise SnapshotStorageError(f"snapshot {end_offset}-{epoch} is gone; retry", disk_full=False) from None

    async def compact(self) -> CompactReport:
        """POST /v1/admin/compact: the leader cleans its log now, up to the dirty offset it
        announces (followers clean to the same offset on their own schedule)."""
        self._require_leader()
        return await self.maintenance.clean(force=True)

    async def add_voter(self, voter: NewVoter) -> VoterSetView:
        """POST /v1/admin/voters (app/runtime_voters.py): add an observer that caught up;
        answers the set once the voters record is committed."""
        self._require_leader()
        now_ms = monotonic_ms()
        resolved = resolve_voter(voter, self.node.voter_set, self.node.describe_quorum(now_ms).observers,
                                 self._raft_endpoints)
        expected = self.node.voter_set.with_voter(resolved)
        return await self._voters_committed(expected, lambda: self.node.add_voter(resolved, now_ms))

    async def remove_voter(self, node_id: int, directory_id: str | None = None) -> VoterSetView:
        """DELETE /v1/admin/voters/{id}: remove a voter (this node too: it resigns once that
        is committed)."""
        self._require_leader()
        expected = self.node.voter_set.without(node_id)
        return await self._voters_committed(
            expected, lambda: self.node.remove_voter(node_id, directory_id or "", monotonic_ms()))

    async def _voters_committed(self, expected: VoterSet, append: Callable[[], int]) -> VoterSetView:
        try:
            offset = append()
        except VoterChangeError as exc:
            if exc.code == "not-leader":
                raise self._not_leader() from None
            raise refused(exc) from None
        self._kick()
        try:
            await self._wait_applied(offset + 1, time.monotonic() + self.config.commit_timeout_ms / 1000)
        except VersionWaitTimeoutError:
            raise VoterChangeIndeterminateError(
                f"the voters record at {offset} was not committed within {self.config.commit_timeout_ms} ms; "
                "look at the voter set (GET /v1/quorum) before retrying") from None
        if self.node.voter_set_at(offset + 1) != expected:
            raise VoterChangeIndeterminateError(
                f"the voters record at {offset} was replaced by another leader's; look at the voter set "
                "(GET /v1/quorum) before retrying")
        return voter_set_view(self.node)

    async def resign(self) -> ResignReport:
        self._require_leader()
        epoch = self.node.epoch
        self.node.resign(monotonic_ms())
        self._kick()
        return {"resigned": True, "epoch": epoch}


def _exit_on_fatal(exc: BaseException) -> None:
    """Fail-stop: a broken invariant or a failed fsync leaves nothing safe to do but exit;
    whatever was acknowledged is durable on a majority."""
    logging.shutdown()
    os._exit(70)
