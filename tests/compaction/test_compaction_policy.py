"""The compaction policy's pure decisions (storage/compaction_policy.py) and one cleaning run
(storage/cleaning_run.py), which the runtime and the compaction simulator share: what to
clean up to, when to snapshot, how a restart recovers its state (docs/compaction.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from raft.types import Batch, SnapshotId
from storage.cleaning_run import run_cleaning
from storage.commands import delete, encode_command, put
from storage.compaction_policy import (
    ArrivalMarks,
    Recovery,
    clean_target_offset,
    newest_snapshot,
    recovery_step,
    select_prefix,
    snapshot_due,
    snapshot_helps,
    tombstone_bound,
    trim_batches,
    wanted_snapshot_exists,
)
from storage.segment_log import SegmentLog
from storage.state_machine import Entry


def _batch(base: int, count: int = 1) -> Batch:
    return Batch(base, 1, 0, False, tuple(b"r%d" % (base + i) for i in range(count)))


def _no_pause() -> None:
    pass


def test_the_clean_target_never_passes_the_applied_or_flushed_offset() -> None:
    assert clean_target_offset(10, 7, 9) == 7
    assert clean_target_offset(10, 12, 9) == 9
    assert clean_target_offset(5, 12, 9) == 5


def test_the_tombstone_bound_keeps_the_retention_below_the_cleaned_end() -> None:
    assert tombstone_bound(100, 50, 10) == 40
    assert tombstone_bound(30, 50, 10) == 30
    assert tombstone_bound(30, 5, 10) == 0


def test_the_prefix_ends_at_the_last_batch_boundary_below_the_dirty_offset() -> None:
    batches = [_batch(0, 2), _batch(2, 3), _batch(5, 2), _batch(7)]
    read: list[int] = []

    def pause() -> None:
        read.append(len(read))

    selection = select_prefix(iter(batches), cleaned_before=2, dirty_offset=6, aged_end=None, pause=pause)
    assert [b.base_offset for b in selection.batches] == [0, 2]
    assert selection.dirty_offset == 6
    assert selection.prefix_bytes == batches[0].size_bytes() + batches[1].size_bytes()
    assert selection.dirty_bytes == batches[1].size_bytes()  # only what lies at or above 2
    assert len(read) == 3  # stops reading at the first batch it does not take


def test_records_younger_than_the_lag_stay_and_lower_the_dirty_offset() -> None:
    batches = [_batch(0, 2), _batch(2, 3), _batch(5, 2)]
    selection = select_prefix(batches, cleaned_before=2, dirty_offset=7, aged_end=4, pause=_no_pause)
    assert [b.base_offset for b in selection.batches] == [0]
    assert selection.dirty_offset == 2
    # below the cleaned end the age does not matter: those records were cleaned before
    old = select_prefix(batches, cleaned_before=5, dirty_offset=7, aged_end=1, pause=_no_pause)
    assert [b.base_offset for b in old.batches] == [0, 2] and old.dirty_offset == 5


def test_arrival_marks_age_versions_on_the_clock_passed_in() -> None:
    marks = ArrivalMarks(min_compaction_lag_ms=10_000)
    marks.restarted(5, now_s=100.0)  # what the log held at the start counts as just arrived
    assert marks.aged_end(now_s=105.0) == 0
    marks.applied(8, now_s=103.0)
    marks.applied(9, now_s=103.001)  # too soon after the last mark: kept aside
    assert marks.aged_end(now_s=110.0) == 5
    assert marks.aged_end(now_s=113.0) == 8
    assert marks.aged_end(now_s=113.5) == 9  # the mark kept aside joined at the last cleaning
    assert list(marks.marks) == [(9, 103.001)]  # older marks than an aged one say nothing new


def test_a_snapshot_is_due_periodically_and_when_a_fetcher_needs_one() -> None:
    assert snapshot_due(applied_version=200, snapshot_end=100, wanted_offset=0, every_records=100)
    assert not snapshot_due(applied_version=199, snapshot_end=100, wanted_offset=0, every_records=100)
    assert not snapshot_due(applied_version=500, snapshot_end=100, wanted_offset=0, every_records=0)
    assert snapshot_due(applied_version=150, snapshot_end=100, wanted_offset=120, every_records=0)
    assert not snapshot_due(applied_version=110, snapshot_end=100, wanted_offset=120, every_records=0)  # not yet
    assert not snapshot_due(applied_version=150, snapshot_end=130, wanted_offset=120, every_records=0)  # exists
    assert wanted_snapshot_exists(120, 130) and not wanted_snapshot_exists(120, 110)
    assert not wanted_snapshot_exists(0, 130)  # nothing asked for


@pytest.mark.parametrize(("applied", "start", "end", "cleaner_end", "loaded", "step"), [
    (0, 0, 0, 0, False, Recovery.KEEP),  # a fresh node
    (3, 0, 0, 0, False, Recovery.START_OVER),  # an empty log under a state above 0
    (4, 0, 10, 4, False, Recovery.KEEP),  # the log continues from the state
    (2, 0, 10, 4, False, Recovery.LOAD_SNAPSHOT),  # behind its own cleaning: try a snapshot
    (2, 0, 10, 4, True, Recovery.REBUILD_FROM_0),  # none reached: a log from 0 rebuilds it
    (5, 3, 10, 6, True, Recovery.REFUSE),  # a log from a snapshot cannot
    (2, 3, 10, 0, True, Recovery.BELOW_LOG_START),
    (6, 3, 10, 6, True, Recovery.KEEP),  # a snapshot reached past the cleaned prefix
])
def test_recovery_steps(applied: int, start: int, end: int, cleaner_end: int, loaded: bool, step: Recovery) -> None:
    assert recovery_step(applied, start, end, cleaner_end, snapshot_loaded=loaded) is step


def test_the_newest_snapshot_that_reaches_the_log_start_helps() -> None:
    assert newest_snapshot(None, SnapshotId(5, 1), SnapshotId(9, 2)) == SnapshotId(9, 2)
    assert newest_snapshot(None, None) is None
    assert snapshot_helps(SnapshotId(9, 2), applied_version=4, log_start=9)
    assert not snapshot_helps(SnapshotId(9, 2), applied_version=9, log_start=3)  # not newer
    assert not snapshot_helps(SnapshotId(9, 2), applied_version=4, log_start=12)  # below the log


def test_trim_batches_cuts_to_the_range() -> None:
    trimmed = trim_batches([_batch(0, 3), _batch(3, 3), _batch(6, 3)], 2, 7)
    assert [(b.base_offset, b.records) for b in trimmed] == [(2, (b"r2",)), (3, (b"r3", b"r4", b"r5")), (6, (b"r6",))]
    assert trim_batches([_batch(0, 3)], 3, 5) == []


class _State:
    """A state machine as a cleaning asks it: durable up to ``synced``; no key existed."""

    def __init__(self, synced: int) -> None:
        self.synced = synced

    def sync(self) -> int:
        return self.synced

    def entries_at(self, keys: Sequence[str], version: int) -> Mapping[str, Entry | None]:
        return dict.fromkeys(keys)


def _log(tmp_path: Path) -> SegmentLog:
    log = SegmentLog(tmp_path / "log")
    for offset in range(10):
        record = encode_command(delete("k0") if offset == 3 else put(f"k{offset % 3}", b"%d" % offset))
        log.append(Batch(offset, 1, 0, False, (record,)))
    log.flush()
    return log


def _run(log: SegmentLog, state: _State, dirty: int, **settings: object) -> dict:
    options: dict = {"force": False, "aged_end": None, "min_dirty_ratio": 0.0, "tombstone_retention_records": 0}
    options.update(settings)
    return run_cleaning(log, state, dirty, dirty, new_pause=lambda: _no_pause, clock=lambda: 0.0, **options).report


def test_a_cleaning_stops_at_the_durable_state_and_installs_the_prefix(tmp_path: Path) -> None:
    log = _log(tmp_path)
    report = _run(log, _State(synced=6), 10)
    assert report["cleaned"] and report["cleaned_end"] == 6 and report["dirty_offset"] == 6, report
    assert log.cleaned_end() == 6 and report["records_in"] == 6 and report["records_out"] < 6
    assert _run(log, _State(synced=6), 10)["reason"] == "nothing new below the dirty offset"
    log.close()


def test_a_cleaning_skips_a_low_dirty_ratio_unless_forced(tmp_path: Path) -> None:
    log = _log(tmp_path)
    skipped = _run(log, _State(synced=10), 5, min_dirty_ratio=0.9)  # about half the log is dirty
    assert not skipped["cleaned"] and "dirty ratio" in skipped["reason"] and log.cleaned_end() == 0
    forced = _run(log, _State(synced=10), 5, min_dirty_ratio=0.9, force=True)
    assert forced["cleaned"] and forced["cleaned_end"] == 5
    log.close()


def test_a_cleaning_leaves_records_younger_than_the_lag(tmp_path: Path) -> None:
    log = _log(tmp_path)
    report = _run(log, _State(synced=10), 10, aged_end=0)
    assert not report["cleaned"] and "younger than min_compaction_lag_ms" in report["reason"], report
    log.close()
