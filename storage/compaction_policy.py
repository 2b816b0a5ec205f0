"""What a replica cleans, when it snapshots and how it recovers its state: pure decisions.

Why a module of its own: the node runtime (app/runtime.py) and the compaction simulator
(tests/sim/compaction.py) must decide these the same way, and the simulator is pure (no
clock, no I/O, no asyncio). So nothing here reads a clock or touches a file: times and
offsets come in as arguments; storage/cleaning_run.py performs a cleaning over a log and a
state machine, and the runtime does the rest of the I/O. The rules are docs/compaction.md's.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from raft.types import Batch, SnapshotId

# min_compaction_lag_ms is measured on this replica's own clock, from when each version was
# applied here (batch timestamps are the leader's monotonic clock, meaningless on another
# host): marks (version end, monotonic seconds) at most one per ARRIVAL_MARK_MIN_INTERVAL_S,
# or per lag / ARRIVAL_MARKS_PER_LAG when that is longer, so ARRIVAL_MARKS_MAX bounds them.
ARRIVAL_MARK_MIN_INTERVAL_S = 0.01
ARRIVAL_MARKS_PER_LAG = 4_000
ARRIVAL_MARKS_MAX = 8_000

# ---------------------------------------------------------------------- cleaning


def clean_target_offset(dirty_offset: int, applied_version: int, flushed_offset: int) -> int:
    """How far a replica may clean now: the dirty offset it learned, never past what it has
    applied (apply must not read a prefix that changes underneath it) nor flushed."""
    return min(dirty_offset, applied_version, flushed_offset)


def tombstone_bound(tombstone_horizon: int, clean_end: int, tombstone_retention_records: int) -> int:
    """Tombstones are dropped only below this (rule 3): the same on every replica cleaning to
    ``clean_end``, since the horizon never trails the dirty offset."""
    return min(tombstone_horizon, max(0, clean_end - tombstone_retention_records))


@dataclass(frozen=True, slots=True)
class PrefixSelection:
    """The batches a cleaning reads: every batch from the log start that ends at or below
    ``dirty_offset`` (lowered to where the records too young to clean begin)."""

    batches: list[Batch]
    dirty_offset: int
    prefix_bytes: int  # of all the batches selected
    dirty_bytes: int  # of those at or above the cleaned end before this cleaning


def select_prefix(batches: Iterable[Batch], cleaned_before: int, dirty_offset: int, aged_end: int | None,
                  pause: Callable[[], None]) -> PrefixSelection:
    """Take ``batches`` (the log from its start, in order) while they end at or below
    ``dirty_offset``. Records applied here less than min_compaction_lag_ms ago (past
    ``aged_end``; None: no lag, or an admin compaction) stay as they are: their history stays
    readable that long (the history horizon follows the cleaned end), so a watch or a paged
    list can resume from a version for at least the lag, not only until the next cleaning.
    Stops reading at the first batch it does not take; ``pause`` runs before each batch."""
    selected: list[Batch] = []
    prefix_bytes = dirty_bytes = 0
    for batch in batches:
        pause()
        if batch.next_offset > dirty_offset:
            break
        if aged_end is not None and batch.base_offset >= cleaned_before and batch.next_offset > aged_end:
            dirty_offset = batch.base_offset
            break
        selected.append(batch)
        size = batch.size_bytes()
        prefix_bytes += size
        if batch.base_offset >= cleaned_before:
            dirty_bytes += size
    return PrefixSelection(selected, dirty_offset, prefix_bytes, dirty_bytes)


class ArrivalMarks:
    """When versions were applied on this replica, to find what is older than
    min_compaction_lag_ms: (end version, monotonic seconds when every version below it had
    been applied here), thinned to a bounded number of marks. Times are passed in."""

    __slots__ = ("marks", "_pending", "_interval_s", "_lag_s")

    def __init__(self, min_compaction_lag_ms: int) -> None:
        self.marks: collections.deque[tuple[int, float]] = collections.deque(maxlen=ARRIVAL_MARKS_MAX)
        self._pending: tuple[int, float] | None = None
        self._interval_s = max(ARRIVAL_MARK_MIN_INTERVAL_S, min_compaction_lag_ms / 1000 / ARRIVAL_MARKS_PER_LAG)
        self._lag_s = min_compaction_lag_ms / 1000

    def restarted(self, version: int, now_s: float) -> None:
        """Everything below ``version`` counts as arriving now: after a restart the lag holds
        it back as if just written (this replica cannot tell its age)."""
        self.marks.append((version, now_s))

    def applied(self, version: int, now_s: float) -> None:
        """Every version below ``version`` has been applied by ``now_s``."""
        marks = self.marks
        if not marks or now_s - marks[-1][1] >= self._interval_s:
            marks.append((version, now_s))
            self._pending = None
        else:  # too soon for a mark of its own: kept until the next mark or cleaning
            self._pending = (version, now_s)

    def aged_end(self, now_s: float) -> int:
        """The highest version below which every version was applied here at least
        ``min_compaction_lag_ms`` before ``now_s``."""
        marks = self.marks
        if self._pending is not None:
            marks.append(self._pending)
            self._pending = None
        cutoff_s = now_s - self._lag_s
        while len(marks) > 1 and marks[1][1] <= cutoff_s:
            marks.popleft()  # an older mark than one already aged says nothing new
        return marks[0][0] if marks and marks[0][1] <= cutoff_s else 0


# ---------------------------------------------------------------------- snapshots


def snapshot_due(applied_version: int, snapshot_end: int, wanted_offset: int, every_records: int) -> bool:
    """Whether to snapshot the applied state (a real version; the caller checks): periodically
    every ``every_records`` applied offsets (0: never), and when the core asks for a snapshot
    reaching ``wanted_offset`` (a fetcher must re-bootstrap above the tombstone horizon) that
    the newest local snapshot, ending at ``snapshot_end``, does not reach."""
    due = every_records > 0 and applied_version - snapshot_end >= every_records
    if 0 < wanted_offset <= applied_version and snapshot_end < wanted_offset:
        due = True
    return due and applied_version > snapshot_end


def wanted_snapshot_exists(wanted_offset: int, snapshot_end: int) -> bool:
    """Whether the snapshot the core asked for exists now (its request may be cleared)."""
    return 0 < wanted_offset <= snapshot_end


# ---------------------------------------------------------------------- recovery


class Recovery(enum.Enum):
    """What a starting replica does with the state it found (rule 9, ``recovery_step``)."""

    KEEP = "keep"  # the log continues from it: replay catches up
    START_OVER = "start over"  # an empty log from 0 under a state above 0: empty the state
    LOAD_SNAPSHOT = "load snapshot"  # behind the log's start or its own cleaning: a snapshot may help
    BELOW_LOG_START = "below log start"  # and no snapshot reached the log's start
    REBUILD_FROM_0 = "rebuild from 0"  # behind its own cleaned prefix of a log from 0
    REFUSE = "refuse"  # behind its own cleaned prefix of a log that starts at a snapshot


def recovery_step(applied_version: int, log_start: int, log_end: int, cleaner_end: int,
                  *, snapshot_loaded: bool = False) -> Recovery:
    """The state at ``applied_version`` must never be replayed through a prefix this
    replica's own cleaner compacted (up to ``cleaner_end``) from a version below that
    prefix's end: deletes whose tombstones it dropped would be missed. Before a snapshot was
    tried, such a state asks for one (LOAD_SNAPSHOT); after (``snapshot_loaded``: the newest
    one that reaches, if any, is loaded), it is rebuilt from 0 on a log from 0, else refused.
    An empty log from 0 under a state above 0 starts over: the leader answers a fetch from 0
    with its whole cleaned log, tombstones dropped anywhere."""
    if log_start == 0 and log_end == 0:
        return Recovery.START_OVER if applied_version > 0 else Recovery.KEEP
    if applied_version >= max(log_start, cleaner_end):
        return Recovery.KEEP
    if not snapshot_loaded:
        return Recovery.LOAD_SNAPSHOT
    if applied_version < log_start:
        return Recovery.BELOW_LOG_START
    return Recovery.REFUSE if log_start > 0 else Recovery.REBUILD_FROM_0


def newest_snapshot(*known: SnapshotId | None) -> SnapshotId | None:
    """The newest of the snapshots known (the log's record, the snapshot directory's)."""
    return max((s for s in known if s is not None), key=lambda s: s.end_offset, default=None)


def snapshot_helps(snapshot_id: SnapshotId, applied_version: int, log_start: int) -> bool:
    """Whether loading ``snapshot_id`` moves a state the log cannot continue forward: it
    must reach the log's start and be newer than the state."""
    return snapshot_id.end_offset >= log_start and snapshot_id.end_offset > applied_version


# ---------------------------------------------------------------------- log ranges


def trim_batches(batches: list[Batch], start: int, end: int) -> list[Batch]:
    """Cut batches to offsets [start, end): the log returns whole batches, the first may
    start below the applied version and the last may reach past the high watermark."""
    trimmed: list[Batch] = []
    for batch in batches:
        if batch.next_offset <= start or batch.base_offset >= end:
            continue
        if batch.base_offset < start or batch.next_offset > end:
            low = max(start, batch.base_offset) - batch.base_offset
            high = min(end, batch.next_offset) - batch.base_offset
            batch = Batch(batch.base_offset + low, batch.epoch, batch.timestamp_ms, batch.control,
                          batch.records[low:high])
        trimmed.append(batch)
    return trimmed
