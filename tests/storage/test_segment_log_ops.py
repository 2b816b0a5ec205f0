"""SegmentLog operations beyond the model test: snapshots, delete_before, concurrent flush,
failpoints that raise, and a full disk."""

from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path

import pytest

import storage.segment_log as segment_log_module
from raft.types import SnapshotId
from storage.failpoints import Failpoints, FailpointSpecError
from storage.log_checkpoints import LOG_START_CHECKPOINT_NAME
from storage.segment_log import LogWriteError, SegmentLog
from tests.storage.helpers import make_batch, power_loss, segment_files

EVERYTHING = 1 << 40


def fill(log: SegmentLog, batch_count: int, epoch: int = 1) -> list:
    batches = []
    for index in range(batch_count):
        batch = make_batch(log.end_offset(), epoch, 1 + index % 4, fill=index)
        log.append(batch)
        batches.append(batch)
    return batches


def test_delete_before_drops_whole_segments_below_the_snapshot(tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    with SegmentLog(log_dir, segment_bytes=1024) as log:
        batches = fill(log, 80)
        log.flush()
        assert log.segment_count() > 4
        with pytest.raises(Exception, match="above the snapshot end"):
            log.delete_before(50)
        log.record_snapshot(SnapshotId(100, 1))
        bases = [int(p.stem) for p in segment_files(log_dir)]
        new_start = log.delete_before(100)
        assert new_start == max(base for base in bases if base <= 100)
        assert log.start_offset() == new_start
        assert [int(p.stem) for p in segment_files(log_dir)][0] == new_start
        held = log.read(0, EVERYTHING)
        assert held == [b for b in batches if b.base_offset >= new_start]
        size_after = log.size_bytes()
    with SegmentLog(log_dir, segment_bytes=1024) as log:
        assert log.start_offset() == new_start and log.latest_snapshot_id() == SnapshotId(100, 1)
        assert log.read(0, EVERYTHING) == held and log.size_bytes() == size_after
        assert log.end_offset_for_epoch(1) == (1, batches[-1].next_offset)


def test_interrupted_delete_before_is_finished_on_open(tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    with SegmentLog(log_dir, segment_bytes=1024) as log:
        batches = fill(log, 80)
        log.flush()
        second_base = int(segment_files(log_dir)[1].stem)
        log.record_snapshot(SnapshotId(second_base, 1))
    # The checkpoint says the log starts at the second segment, the first is still there
    # (a crash between persisting the start offset and deleting files).
    checkpoint = (log_dir / LOG_START_CHECKPOINT_NAME).read_text().replace('"start_offset": 0', f'"start_offset": {second_base}')
    (log_dir / LOG_START_CHECKPOINT_NAME).write_text(checkpoint)
    with SegmentLog(log_dir, segment_bytes=1024) as log:
        assert log.start_offset() == second_base
        assert log.read(0, EVERYTHING) == [b for b in batches if b.base_offset >= second_base]
    assert int(segment_files(log_dir)[0].stem) == second_base


def test_reset_to_snapshot_survives_reopen(tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    with SegmentLog(log_dir, segment_bytes=1024) as log:
        fill(log, 40)
        log.reset_to_snapshot(SnapshotId(500, 7))
        assert (log.start_offset(), log.end_offset(), log.flushed_offset(), log.last_epoch()) == (500, 500, 500, 7)
        log.append(make_batch(500, 8, 2))
        log.flush()
    with SegmentLog(log_dir, segment_bytes=1024) as log:
        assert (log.start_offset(), log.end_offset(), log.last_epoch()) == (500, 502, 8)
        assert log.latest_snapshot_id() == SnapshotId(500, 7)
        assert log.end_offset_for_epoch(7) == (7, 500) and log.end_offset_for_epoch(3) == (0, 0)
        assert [int(p.stem) for p in segment_files(log_dir)] == [500]


def test_flush_on_a_worker_thread_while_appending_and_truncating(tmp_path: Path) -> None:
    """flushed_offset never covers bytes that a power loss would take away."""
    rng = random.Random(7)
    log = SegmentLog(tmp_path / "log", segment_bytes=4096)
    stop = threading.Event()
    flush_errors: list[BaseException] = []

    def flusher() -> None:
        try:
            while not stop.is_set():
                log.flush()
        except BaseException as exc:  # reported to the test below
            flush_errors.append(exc)

    thread = threading.Thread(target=flusher)
    thread.start()
    try:
        for step in range(600):
            if step % 50 == 49:
                log.truncate_to(max(log.start_offset(), log.end_offset() - rng.randint(0, 10)))
            else:
                log.append(make_batch(log.end_offset(), 1 + step // 100, rng.randint(1, 5), fill=step))
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not flush_errors
    flushed = log.flushed_offset()
    before = log.read(0, EVERYTHING)
    assert flushed <= log.end_offset()
    power_loss(log)
    with SegmentLog(tmp_path / "log", segment_bytes=4096) as reopened:
        survived = reopened.read(0, EVERYTHING)
        assert reopened.end_offset() >= flushed
    assert survived == before[: len(survived)]


@pytest.mark.parametrize("point", ["segment.before_write", "segment.after_write"])
def test_write_error_stops_writes_and_keeps_reads(tmp_path: Path, point: str) -> None:
    log_dir = tmp_path / "log"
    with SegmentLog(log_dir, segment_bytes=2048, failpoints=Failpoints(f"{point}=error@11")) as log:
        batches = fill(log, 10)
        log.flush()
        size = log.size_bytes()
        with pytest.raises(LogWriteError, match="refuses writes until it is reopened"):
            log.append(make_batch(log.end_offset(), 1, 2))
        assert log.failed()
        for attempt in (lambda: log.append(make_batch(log.end_offset(), 1, 1)), log.flush,
                        lambda: log.truncate_to(0)):
            with pytest.raises(LogWriteError):
                attempt()
        assert log.read(0, EVERYTHING) == batches
        assert log.end_offset() == batches[-1].next_offset and log.size_bytes() == size
    with SegmentLog(log_dir, segment_bytes=2048, failpoints=Failpoints()) as log:
        assert log.read(0, EVERYTHING) == batches
        log.append(make_batch(log.end_offset(), 1, 1))  # writable again after reopening


def test_fsync_error_does_not_raise_the_flushed_offset(tmp_path: Path) -> None:
    with SegmentLog(tmp_path / "log", failpoints=Failpoints("segment.before_fsync=error@2")) as log:
        fill(log, 3)
        assert log.flush() == log.end_offset()
        durable = log.flushed_offset()
        fill(log, 3)
        with pytest.raises(LogWriteError):
            log.flush()
        assert log.flushed_offset() == durable and log.failed()
        assert len(log.read(0, EVERYTHING)) == 6


def test_disk_full_in_the_middle_of_a_write_leaves_no_partial_batch(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC after part of a batch reached the file: the part is cut, the log stops writing."""
    log_dir = tmp_path / "log"
    log = SegmentLog(log_dir)
    batches = fill(log, 5)
    log.flush()
    size = log.size_bytes()

    def write_half_then_fill_the_disk(fd: int, parts: list[bytes]) -> None:
        data = b"".join(parts)
        os.write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_log_module, "write_all_parts", write_half_then_fill_the_disk)
    with pytest.raises(LogWriteError, match="No space left on device"):
        log.append(make_batch(log.end_offset(), 1, 50))
    monkeypatch.undo()
    assert segment_files(log_dir)[-1].stat().st_size == size
    assert log.read(0, EVERYTHING) == batches
    with pytest.raises(LogWriteError):
        log.append(make_batch(log.end_offset(), 1, 1))
    log.close()
    with SegmentLog(log_dir) as reopened:
        assert reopened.read(0, EVERYTHING) == batches


def test_short_writes_still_write_every_byte_of_a_batch_in_order(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch goes out as header and body with writev; a kernel that writes only part of it
    per call (a signal, a pipe-like file) gets the rest in further calls, in order."""
    real_writev = os.writev
    calls = []

    def short_writev(fd: int, buffers: list[memoryview]) -> int:
        calls.append(sum(len(buffer) for buffer in buffers))
        limit = 7
        taken = []
        for buffer in buffers:
            taken.append(buffer[:limit])
            limit -= len(taken[-1])
            if limit == 0:
                break
        return real_writev(fd, taken)

    batches = [make_batch(0, 1, 3), make_batch(3, 1, 40)]
    with SegmentLog(tmp_path / "log") as log:
        monkeypatch.setattr(segment_log_module.os, "writev", short_writev)
        for batch in batches:
            log.append(batch)
        monkeypatch.undo()
        log.flush()
        assert log.read(0, EVERYTHING) == batches
    assert len(calls) > 10
    with SegmentLog(tmp_path / "log") as reopened:
        assert reopened.read(0, EVERYTHING) == batches


def test_disk_full_inside_writev_is_a_log_write_error_and_appends_go_on_after_reopen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from the kernel after part of a batch went out: the caller sees LogWriteError
    (not an error of the encoder's reused buffer, which the failed write's views still
    held), the part is cut, and the reopened log appends again."""
    log_dir = tmp_path / "log"
    log = SegmentLog(log_dir)
    batches = fill(log, 3)
    log.flush()
    size = log.size_bytes()
    real_writev = os.writev

    def write_some_then_fill_the_disk(fd: int, buffers: list[memoryview]) -> int:
        real_writev(fd, [buffers[0][:5]])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_log_module.os, "writev", write_some_then_fill_the_disk)
    with pytest.raises(LogWriteError, match="No space left on device"):
        log.append(make_batch(log.end_offset(), 1, 40))
    monkeypatch.undo()
    assert segment_files(log_dir)[-1].stat().st_size == size
    log.close()
    with SegmentLog(log_dir) as reopened:
        more = make_batch(reopened.end_offset(), 1, 40)
        reopened.append(more)
        assert reopened.read(0, EVERYTHING) == [*batches, more]


def test_a_write_that_makes_no_progress_fails_the_log_instead_of_spinning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """writev answering 0 for a non-empty batch (no error, no byte written) would otherwise be
    retried forever with the log's lock held, hanging every caller: it is a LogWriteError,
    like a full disk, and the file keeps only whole batches."""
    log_dir = tmp_path / "log"
    log = SegmentLog(log_dir)
    batches = fill(log, 3)
    log.flush()
    size = log.size_bytes()
    calls = []

    def writes_nothing(fd: int, buffers: list[memoryview]) -> int:
        calls.append(fd)
        if len(calls) > 100:
            raise RuntimeError("writev retried 100 times without progress")
        return 0

    monkeypatch.setattr(segment_log_module.os, "writev", writes_nothing)
    with pytest.raises(LogWriteError, match="wrote no bytes"):
        log.append(make_batch(log.end_offset(), 1, 5))
    monkeypatch.undo()
    assert log.failed() and segment_files(log_dir)[-1].stat().st_size == size
    log.close()
    with SegmentLog(log_dir) as reopened:
        assert reopened.read(0, EVERYTHING) == batches


@pytest.mark.parametrize(("failpoint", "survivors"), [
    ("segment.before_write=enospc@2", 6),  # the rewrite never started: the old batch stays whole
    ("segment.after_write=error@2", 3),  # rewritten, then failed: the old batch's tail is torn
    ("segment.after_fsync=error@2", 3),  # rewritten and synced, the file not yet cut after it
])
def test_a_truncation_inside_a_batch_that_fails_keeps_the_records_below_the_cut(
        tmp_path: Path, failpoint: str, survivors: int) -> None:
    """truncate_to inside a flushed batch rewrites the records below the cut as a shorter
    batch. Whatever step fails (a full disk, an I/O error; a crash leaves the same files),
    those records (possibly committed) are still there after reopening; they used to be
    cut away before the rewrite, so a failed rewrite lost them."""
    log_dir = tmp_path / "log"
    batch = make_batch(0, 1, 6)
    with SegmentLog(log_dir, failpoints=Failpoints(failpoint)) as log:
        log.append(batch)  # the failpoints' first hits
        log.flush()
        with pytest.raises(LogWriteError):
            log.truncate_to(3)
    with SegmentLog(log_dir) as reopened:
        (found,) = reopened.read(0, EVERYTHING)
        assert found.records == batch.records[:survivors]
        assert reopened.end_offset() == survivors


def test_disk_full_failpoint(tmp_path: Path) -> None:
    with SegmentLog(tmp_path / "log", failpoints=Failpoints("segment.before_write=enospc")) as log:
        with pytest.raises(LogWriteError, match="disk full"):
            log.append(make_batch(0, 1, 1))
        assert log.end_offset() == 0 and log.read(0, EVERYTHING) == []


def test_bad_failpoint_spec_is_rejected() -> None:
    with pytest.raises(FailpointSpecError, match="segment.fsync=explode"):
        Failpoints("segment.fsync=explode")


def test_failpoints_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("METAKV_FAILPOINTS", "segment.after_write=error@2, segment.before_fsync=sleep(1)")
    with SegmentLog(tmp_path / "log") as log:
        log.append(make_batch(0, 1, 1))
        log.flush()
        with pytest.raises(LogWriteError):
            log.append(make_batch(1, 1, 1))
