"""The node's maintenance: snapshots (on request, periodic, for a re-bootstrapping fetcher)
and cleaning its log, run on their own threads under the policy of
storage/compaction_policy.py and storage/cleaning_run.py.

An object app.runtime.NodeRuntime owns (``NodeRuntime.maintenance``), built with the
storage and core it works on; what it asks of the runtime is ``MaintainedRuntime``.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from sqlalchemy.exc import DBAPIError

from app.config import NodeConfig
from app.service import (
    CompactReport,
    NotReadyError,
    SnapshotReport,
    SnapshotStorageError,
    WriteRejectedError,
)
from raft.node import RaftNode
from raft.types import SnapshotId
from storage.cleaner import prefix_digest
from storage.cleaning_run import (
    CLEANER_BUSY_SHARE,
    CLEANER_SLICE_S,
    PRUNE_STEP_VERSIONS,
    Throttle,
    prune_history,
    read_prefix_digest,
    run_cleaning,
)
from storage.compaction_policy import (
    ArrivalMarks,
    clean_target_offset,
    snapshot_due,
    wanted_snapshot_exists,
)
from storage.segment_log import LogWriteError, SegmentLog
from storage.snapshot_store import SnapshotStore
from storage.state_machine import SnapshotRejectedError, StateMachine

logger = logging.getLogger("metakv.runtime")


class MaintainedRuntime(Protocol):
    """What maintenance reads of the runtime that owns it."""

    @property
    def applied_version(self) -> int: ...

    @property
    def closing(self) -> bool:
        """A stop began: start nothing new."""
        ...

    @property
    def closed(self) -> bool:
        """Stopped, or failed: storage is closed or about to be."""
        ...

    @property
    def installing_snapshot(self) -> bool: ...


class Maintenance:
    """Snapshots and cleaning for one node (POST /v1/admin/snapshot and /compact, the
    periodic triggers). Built by NodeRuntime.start once the storage and the core exist; runs
    on the runtime's loop, its copies and cleanings on executors of its own."""

    def __init__(self, config: NodeConfig, *, runtime: MaintainedRuntime, node: RaftNode, log: SegmentLog,
                 state: StateMachine, snapshots: SnapshotStore, snapshots_dir: Path, loop: asyncio.AbstractEventLoop,
                 fatal: Callable[[BaseException], None], wake_waiters: Callable[[], None]) -> None:
        self.config = config
        self.node_id = config.node_id
        self._runtime = runtime
        self.node = node
        self.log = log
        self.state = state
        self.snapshots = snapshots
        self.snapshots_dir = snapshots_dir  # named in a failed snapshot's message
        self._loop = loop
        self._fatal = fatal  # fail-stop the node
        self._wake_waiters = wake_waiters  # the cleaned history changed what reads may see
        # Compaction (docs/compaction.md): one cleaning at a time, on its own thread.
        self._clean_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"cleaner-{config.node_id}")
        self._clean_task: asyncio.Task[CompactReport] | None = None
        # When versions were applied here, on time.monotonic() (min_compaction_lag_ms).
        self.arrival_marks = ArrivalMarks(config.min_compaction_lag_ms)
        self._cleaner_timer: asyncio.TimerHandle | None = None
        # (log start, end offset, sha256) of the cleaned range [log start, end offset)
        self.prefix_digest: tuple[int, int, str] = (0, 0, prefix_digest([], 0))
        self.last_clean: CompactReport | None = None
        self.tombstones_dropped_total = 0  # by this process's cleanings
        self._snapshot_end = 0  # end offset of the newest local snapshot
        # Snapshots (VACUUM INTO) run one at a time on their own thread.
        self._snapshot_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-{config.node_id}")
        self._snapshot_task: asyncio.Task[SnapshotId] | None = None

    async def recover(self) -> None:
        """At start: the newest local snapshot, and the digest of the log's cleaned prefix."""
        latest = self.snapshots.latest_id()
        self._snapshot_end = latest.end_offset if latest is not None else 0
        self.prefix_digest = await self._loop.run_in_executor(self._clean_executor, read_prefix_digest, self.log)

    async def stop(self) -> None:
        """Start no more cleanings; wait for the running cleaning and snapshot."""
        if self._cleaner_timer is not None:
            self._cleaner_timer.cancel()
            self._cleaner_timer = None
        if self._clean_task is not None:
            await asyncio.gather(self._clean_task, return_exceptions=True)
        if self._snapshot_task is not None:
            await asyncio.gather(self._snapshot_task, return_exceptions=True)

    def close(self) -> None:
        """After stop(): end the cleaner and snapshot threads."""
        self._clean_executor.shutdown(wait=True)
        self._snapshot_executor.shutdown(wait=True)

    # ------------------------------------------------------------------ snapshots

    @property
    def snapshot_running(self) -> bool:
        return self._snapshot_task is not None

    async def take_snapshot(self) -> SnapshotReport:
        """Snapshot the applied state now: a snapshot at or above the version applied when
        the request arrived (joining one already running if it reaches that far)."""
        if self._runtime.closing:
            raise WriteRejectedError("node is shutting down")
        wanted = self._runtime.applied_version
        if wanted == 0:
            raise NotReadyError("nothing applied yet: there is no state to snapshot")
        if not self.node.is_real_state(wanted):
            raise NotReadyError("this replica is catching up: its state is not a real version yet")
        while True:
            try:
                snapshot_id = await asyncio.shield(self.start_snapshot())
            except SnapshotRejectedError as exc:
                raise NotReadyError(f"this replica is catching up: {exc}") from None
            except (OSError, sqlite3.Error, DBAPIError, LogWriteError) as exc:
                error = _snapshot_storage_error(exc, self.snapshots_dir)
                if error is None:
                    raise
                logger.warning("node %d: snapshot failed: %s", self.node_id, error)
                if isinstance(exc, LogWriteError):  # recording it failed: fail-stop, as in the background
                    self._fatal(exc)
                raise error from exc
            if snapshot_id.end_offset >= wanted or self._runtime.closing:
                break
        return {"snapshot_id": {"end_offset": snapshot_id.end_offset, "epoch": snapshot_id.epoch}}

    def start_snapshot(self) -> asyncio.Task[SnapshotId]:
        """One snapshot at a time, on its own thread: VACUUM INTO copies the database inside
        one SQLite read transaction of that thread's connection, so apply (the loop's
        writer) continues, the copy holds exactly one applied version, and the id is read
        from the copy itself (StateMachine.create_snapshot)."""
        if self._snapshot_task is None:
            # Checked again on the copy: apply may have moved into a copied cleaned prefix
            # between the loop's check and the copy. (Whatever makes a version unreal is
            # recorded before that version is applied, so before the copy reads it.)
            copy = asyncio.get_running_loop().run_in_executor(
                self._snapshot_executor, functools.partial(
                    self.state.create_snapshot, self.snapshots,
                    accept=lambda snapshot_id: self.node.is_real_state(snapshot_id.end_offset)))
            self._snapshot_task = asyncio.ensure_future(self._finish_snapshot(copy))
        return self._snapshot_task

    async def _finish_snapshot(self, copy: asyncio.Future[SnapshotId]) -> SnapshotId:
        """Back on the loop: tell the log (so the core can offer the snapshot to fetchers)."""
        try:
            snapshot_id = await copy
            if not self._runtime.closed and snapshot_id.end_offset >= self.log.start_offset():
                self.log.record_snapshot(snapshot_id)
        finally:
            self._snapshot_task = None
        self._snapshot_end = max(self._snapshot_end, snapshot_id.end_offset)
        if wanted_snapshot_exists(self.node.snapshot_wanted_offset, self._snapshot_end):
            self.node.snapshot_wanted_offset = 0
        logger.info("node %d took snapshot %s", self.node_id, snapshot_id)
        return snapshot_id

    def maybe_snapshot(self) -> None:
        """Periodic snapshots (snapshot_every_records), and the one the core asks for when a
        fetcher must re-bootstrap above the tombstone horizon and no snapshot reaches it.
        Started in the background; a failure is logged and retried at the next due point."""
        runtime = self._runtime
        applied = runtime.applied_version
        if (runtime.installing_snapshot or runtime.closing or applied == 0
                or self._snapshot_task is not None or not self.node.is_real_state(applied)):
            return  # (a state inside a cleaned prefix is no version to hand anyone: rule 9)
        wanted = self.node.snapshot_wanted_offset
        due = snapshot_due(applied, self._snapshot_end, wanted, self.config.snapshot_every_records)
        if wanted_snapshot_exists(wanted, self._snapshot_end):
            self.node.snapshot_wanted_offset = 0
        if due:
            self.start_snapshot().add_done_callback(self._on_background_snapshot_done)

    def _on_background_snapshot_done(self, task: asyncio.Task[SnapshotId]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        if self.log.failed():  # recording the snapshot failed to write: fail-stop
            self._fatal(exc)
            return
        if isinstance(exc, SnapshotRejectedError):  # taken again once the state is real
            logger.info("node %d: snapshot not taken: %s", self.node_id, exc)
            return
        applied = self._runtime.applied_version
        logger.error("node %d: snapshot at version %d failed: %s", self.node_id, applied, exc)
        self._snapshot_end = max(self._snapshot_end, applied)  # retry at the next due point

    # ------------------------------------------------------------------ compaction

    def schedule_cleaner(self) -> None:
        interval_ms = self.config.cleaner_interval_ms
        if interval_ms <= 0 or self._runtime.closing:
            return
        self._cleaner_timer = self._loop.call_later(interval_ms / 1000, self._on_cleaner_timer)

    def _on_cleaner_timer(self) -> None:
        self._cleaner_timer = None
        if self._runtime.closing or self._runtime.closed:
            return
        task = asyncio.ensure_future(self.clean(force=False))
        task.add_done_callback(lambda _: self.schedule_cleaner())

    def clean_target(self) -> tuple[int, int]:
        """(dirty offset, tombstone horizon) to clean with now: the announced values, never
        past what this replica applied and flushed."""
        node = self.node
        return clean_target_offset(node.dirty_offset, self._runtime.applied_version, self.log.flushed_offset()), \
            node.tombstone_horizon

    async def clean(self, force: bool) -> CompactReport:
        """One cleaning to clean_target(): ``force`` (an admin compaction) ignores
        cleaner_min_dirty_ratio and min_compaction_lag_ms; joins one already running."""
        if self._clean_task is not None:  # one at a time: join the running one
            return await asyncio.shield(self._clean_task)
        dirty, horizon = self.clean_target()
        aged_end = (None if force or self.config.min_compaction_lag_ms == 0
                    else self.arrival_marks.aged_end(time.monotonic()))
        self._clean_task = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
            self._clean_executor, functools.partial(self.clean_blocking, dirty, horizon, force, aged_end=aged_end)))
        try:
            report = await asyncio.shield(self._clean_task)
        except Exception as exc:
            if self.log.failed():  # a failed write: the log refuses writes, fail-stop
                self._fatal(exc)
            raise
        finally:
            self._clean_task = None
        if report.get("cleaned"):
            # History stays readable from this replica's cleaned end: the next cleaning may
            # ask the state machine for the state there (a log that starts at a snapshot).
            await asyncio.get_running_loop().run_in_executor(
                self._clean_executor, self._prune_history_blocking, report["cleaned_end"])
            self._wake_waiters()
        return report

    def _prune_history_blocking(self, below_version: int) -> None:
        """Runs on the cleaner thread: prune the history below ``below_version`` in short
        throttled steps, so an apply on the loop waits for the write lock at most one step."""
        prune_history(self.state, below_version, step_versions=PRUNE_STEP_VERSIONS,
                      pause=Throttle(CLEANER_BUSY_SHARE, CLEANER_SLICE_S).pause, stopping=lambda: self._runtime.closing)

    def clean_blocking(self, dirty: int, horizon: int, force: bool, aged_end: int | None = None) -> CompactReport:
        """Runs on the cleaner thread: one throttled cleaning of this node's log
        (storage.cleaning_run.run_cleaning); answers its report."""
        config = self.config
        run = run_cleaning(self.log, self.state, dirty, horizon, force=force, aged_end=aged_end,
                           min_dirty_ratio=config.cleaner_min_dirty_ratio,
                           tombstone_retention_records=config.tombstone_retention_records,
                           new_pause=lambda: Throttle(CLEANER_BUSY_SHARE, CLEANER_SLICE_S).pause,
                           clock=time.perf_counter)
        result, report = run.result, run.report
        if result is None or run.digest is None:
            return report
        self.prefix_digest = run.digest
        self.tombstones_dropped_total += result.tombstones_dropped
        self.last_clean = report
        logger.info("node %d cleaned log [%d, %d): %d -> %d records, %d tombstones dropped, evaluated from %d",
                    self.node_id, run.digest[0], result.clean_end, result.records_in, result.records_out,
                    result.tombstones_dropped, result.evaluated_from)
        return report


def _snapshot_storage_error(exc: BaseException, snapshots_dir: Path) -> SnapshotStorageError | None:
    """A snapshot that failed on the disk, as POST /v1/admin/snapshot reports it (never the
    500 fallback): disk full (ENOSPC, EDQUOT, SQLite's "database or disk is full"), or any
    other I/O error. None for an error that is not about storage.

    Nothing half-written is left published: StateMachine.create_snapshot removes its temp
    copy whatever fails, and SnapshotStore.publish_database renames a file into place only
    after its trailer is written and fsynced.
    """
    cause: BaseException = exc
    if isinstance(cause, LogWriteError) and cause.__cause__ is not None:
        cause = cause.__cause__  # the log could not record the snapshot
    if isinstance(cause, DBAPIError) and cause.orig is not None:
        cause = cause.orig
    if isinstance(cause, OSError):
        full = cause.errno in (errno.ENOSPC, errno.EDQUOT)
        text = (cause.strerror or repr(cause)) + (f": {cause.filename}" if cause.filename else "")
    elif isinstance(cause, sqlite3.OperationalError):
        full = getattr(cause, "sqlite_errorname", "") == "SQLITE_FULL" or "disk is full" in str(cause)
        text = str(cause)
    else:
        return None
    if full:
        return SnapshotStorageError(f"the snapshot failed, the disk holding {snapshots_dir} is full ({text}); "
                                    "free space and retry", disk_full=True)
    return SnapshotStorageError(f"the snapshot failed on an I/O error ({text}); retry", disk_full=False)
