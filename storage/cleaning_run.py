"""One cleaning over a log and a state machine, blocking: read the prefix, clean it, install it.

Why apart from the runtime: the compaction simulator runs this same code over its in-memory
log and state model, so it cleans exactly as a node does. ``run_cleaning`` and
``prune_history`` read no clock and never sleep on their own: the caller passes the pause
(the simulator's does nothing; the runtime's is a ``Throttle``, the one part of this module
that reads the CPU clock and sleeps) and the clock durations are reported with (the runtime
calls this on its cleaner thread; docs/compaction.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NotRequired, Protocol, TypedDict

from raft.types import Batch, check
from storage.cleaner import CleanerInputError, CleanResult, clean_prefix, prefix_digest
from storage.compaction_policy import select_prefix, tombstone_bound
from storage.segment_log import LogChangedError
from storage.state_machine import Entry, VersionCompactedError, VersionNotAppliedError

# Background work (cleaning, pruning the history it frees) yields the CPU: after each
# CLEANER_SLICE_S of work its thread sleeps long enough to use at most CLEANER_BUSY_SHARE of
# a core (docs/compaction.md "Throttle").
CLEANER_BUSY_SHARE = 0.25
CLEANER_SLICE_S = 0.002
# History versions pruned per write transaction after a cleaning: at a million keys each
# superseded row sits on a page of its own, and 500 versions held the write lock ~10-20 ms.
PRUNE_STEP_VERSIONS = 100


class CleanableLog(Protocol):
    """What a cleaning needs of a log (storage.segment_log.SegmentLog)."""

    def start_offset(self) -> int: ...

    def cleaned_end(self) -> int: ...

    def size_bytes(self) -> int: ...

    def iter_batches(self, from_offset: int | None = None) -> Iterator[Batch]: ...

    def replace_prefix(self, batches: Sequence[Batch], clean_end: int) -> None: ...


class CleaningBase(Protocol):
    """What a cleaning needs of the state machine (storage.state_machine.StateMachine)."""

    def sync(self) -> int: ...

    def entries_at(self, keys: Sequence[str], version: int) -> Mapping[str, Entry | None]: ...


class HistoryState(Protocol):
    """What pruning the history needs of the state machine."""

    @property
    def applied_version(self) -> int: ...

    @property
    def oldest_version(self) -> int: ...

    def prune_history(self, below_version: int) -> None: ...


class Throttle:
    """Caps a background thread's CPU: ``pause()``, called between small steps of work,
    sleeps after every ``slice_s`` of work for as long as keeps the thread busy at most
    ``busy_share`` of the time. Why: cleaning is Python holding the GIL; unthrottled, the
    three nodes of a cluster clean at about the same moment and a burst of a few hundred
    milliseconds of CPU each (on a shared two-core machine) showed up as 100-300 ms in
    every write's p99 (etcd throttles its compaction the same way: batches with sleeps)."""

    __slots__ = ("busy_share", "slice_s", "_since")

    def __init__(self, busy_share: float, slice_s: float) -> None:
        check(0 < busy_share <= 1 and slice_s > 0, "throttle needs 0 < busy_share <= 1 and slice_s > 0")
        self.busy_share = busy_share
        self.slice_s = slice_s
        self._since = time.perf_counter()

    def pause(self) -> None:
        busy_s = time.perf_counter() - self._since
        if busy_s >= self.slice_s:
            time.sleep(busy_s * (1 / self.busy_share - 1))
            self._since = time.perf_counter()


class CleaningReport(TypedDict):
    """What one cleaning did: the report an admin compaction answers, and a node's status
    shows as its last cleaning (docs/compaction.md "Admin endpoints"). The first five
    members are always there; ``reason`` says why nothing was installed, ``dirty_ratio``
    comes once a prefix was selected, and the members from ``records_in`` on only when a
    cleaned prefix was installed."""

    cleaned: bool
    dirty_offset: int
    tombstone_horizon: int
    cleaned_end: int
    log_start_offset: int
    reason: NotRequired[str]
    dirty_ratio: NotRequired[float]
    records_in: NotRequired[int]
    records_out: NotRequired[int]
    tombstones_dropped: NotRequired[int]
    tombstone_horizon_used: NotRequired[int]
    bytes_in: NotRequired[int]
    bytes_out: NotRequired[int]
    evaluated_from: NotRequired[int]
    prefix_digest: NotRequired[str]
    duration_ms: NotRequired[float]


@dataclass(slots=True)
class CleaningRun:
    """What one cleaning did: ``report`` as an admin compaction answers it; ``result`` and
    ``digest`` (log start, cleaned end, sha256 of that range) only when a cleaned prefix was
    installed; ``base_state_error`` when the state at the evaluation point could not be read."""

    report: CleaningReport
    result: CleanResult | None = None
    digest: tuple[int, int, str] | None = None
    base_state_error: Exception | None = None


def run_cleaning(log: CleanableLog, state: CleaningBase, dirty: int, horizon: int, *, force: bool,
                 aged_end: int | None, min_dirty_ratio: float, tombstone_retention_records: int,
                 new_pause: Callable[[], Callable[[], None]], clock: Callable[[], float]) -> CleaningRun:
    """Read the log from its start, clean it up to ``dirty`` (see
    storage.compaction_policy.clean_target_offset) with tombstones dropped below
    ``horizon`` (lowered by the retention), install it with ``replace_prefix``, whose log
    lock makes the swap atomic against appends and flushes made meanwhile.

    A log that starts at a snapshot is cleaned from its start offset like a log from 0;
    the state machine answers the state at the version where evaluation starts (the
    cleaner needs it only for keys the records before that point do not name). ``force``
    (an admin compaction) ignores ``min_dirty_ratio``. ``new_pause`` makes the pause called
    between steps (a throttle's), once the state is synced: the wait for the disk is no CPU."""
    start = log.start_offset()
    cleaned_end = log.cleaned_end()  # read once: the report names the range this run saw
    cleaned_before = max(start, cleaned_end)
    if dirty > cleaned_before:
        # Never past what the state holds durably: a power loss may take back its unsynced
        # versions, and startup could not replay them from a cleaned prefix (rule 9).
        dirty = min(dirty, state.sync())
    report: CleaningReport = {"cleaned": False, "dirty_offset": dirty, "tombstone_horizon": horizon,
                               "cleaned_end": cleaned_end, "log_start_offset": start}
    if dirty <= cleaned_before:
        report["reason"] = "nothing new below the dirty offset"
        return CleaningRun(report)
    pause = new_pause()
    selection = select_prefix(log.iter_batches(start), cleaned_before, dirty, aged_end, pause)
    dirty = report["dirty_offset"] = selection.dirty_offset
    if dirty <= cleaned_before:
        report["reason"] = "the records above the cleaned end are younger than min_compaction_lag_ms"
        return CleaningRun(report)
    batches = selection.batches
    total_bytes = max(1, log.size_bytes())
    report["dirty_ratio"] = round(selection.dirty_bytes / total_bytes, 4)
    if not batches or (not force and selection.dirty_bytes / total_bytes < min_dirty_ratio):
        report["reason"] = "dirty ratio below cleaner_min_dirty_ratio"
        return CleaningRun(report)
    started_s = clock()
    clean_end_guess = batches[-1].next_offset
    # Deterministic on every replica: tombstones go below the cleaned end minus the
    # retention (always <= the announced horizon, which never trails the dirty offset).
    effective_horizon = tombstone_bound(horizon, clean_end_guess, tombstone_retention_records)
    try:
        result = clean_prefix(batches, dirty, effective_horizon, start_offset=start,
                              base_state=state.entries_at, pause=pause)
    except (CleanerInputError, VersionCompactedError, VersionNotAppliedError) as exc:
        report["reason"] = f"no base state to clean from: {exc}"
        return CleaningRun(report, base_state_error=exc)
    check(result.clean_end == clean_end_guess, "cleaner stopped at another batch boundary")
    if result.clean_end <= cleaned_before or not result.batches:
        report["reason"] = "nothing new below the dirty offset"
        return CleaningRun(report)
    if log.start_offset() != start:
        report["reason"] = "the log was replaced by a snapshot meanwhile"
        return CleaningRun(report)
    # Hashed before the swap (the throttle may sleep in it), so the new cleaned end is never
    # shown beside the old digest for longer than the caller takes to store this one.
    digest = prefix_digest(result.batches, result.clean_end, pause)
    try:
        log.replace_prefix(result.batches, result.clean_end)
    except LogChangedError:  # truncated or reset meanwhile: nothing changed, clean later
        report["reason"] = "the log changed while the cleaned prefix was written"
        return CleaningRun(report)
    elapsed_s = clock() - started_s
    report.update(cleaned=True, cleaned_end=result.clean_end, records_in=result.records_in,
                  records_out=result.records_out, tombstones_dropped=result.tombstones_dropped,
                  tombstone_horizon_used=effective_horizon, bytes_in=selection.prefix_bytes,
                  bytes_out=sum(b.size_bytes() for b in result.batches),
                  evaluated_from=result.evaluated_from,
                  prefix_digest=digest, duration_ms=round(elapsed_s * 1000, 1))
    return CleaningRun(report, result, (start, result.clean_end, digest))


def prune_history(state: HistoryState, below_version: int, *, step_versions: int,
                  pause: Callable[[], None], stopping: Callable[[], bool]) -> None:
    """Raise the history horizon to ``below_version`` (at most the applied version) in steps
    of ``step_versions``, one short write transaction each, pausing between steps. In one
    step on the loop, pruning what a cleaning freed stalled every request for tens of
    milliseconds; now an apply waits for the write lock at most one step. Pruning in steps
    leaves the same rows as pruning at once (tests/state_machine prune in steps)."""
    target = min(below_version, state.applied_version)
    while state.oldest_version < target and not stopping():
        state.prune_history(min(target, state.oldest_version + step_versions))
        pause()


def read_prefix_digest(log: CleanableLog) -> tuple[int, int, str]:
    """The digest of the cleaned range [log start, cleaned end) as it is on disk (after a
    restart): (log start, cleaned end, sha256)."""
    start = log.start_offset()
    cleaned_end = log.cleaned_end()
    if cleaned_end <= start:
        return (start, start, prefix_digest([], 0))
    # Streamed: prefix_digest stops at cleaned_end, so the prefix is never held whole.
    return (start, cleaned_end, prefix_digest(log.iter_batches(start), cleaned_end))
