"""replace_prefix: installing a compacted copy of the log prefix, including across crashes."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from raft.types import Batch, ProtocolInvariantError
from storage.cleaned_segments import SWAP_MARKER_NAME
from storage.failpoints import FAILPOINT_CRASH_EXIT_CODE, Failpoints
from storage.repair import main as repair_main
from storage.segment_files import CorruptLogError
from storage.segment_log import LogChangedError, SegmentLog
from tests.storage.helpers import make_batch, power_loss, segment_files

SEGMENT_BYTES = 1024
EVERYTHING = 1 << 40


def thin_out(batches: list[Batch], clean_end: int) -> list[Batch]:
    """A stand-in for the cleaner: below clean_end keep every third record and the last one,
    regrouped into runs of consecutive offsets; offsets never move."""
    kept: list[Batch] = []
    for batch in batches:
        if batch.next_offset > clean_end:
            break
        run: list[bytes] = []
        run_start = -1
        for index, record in enumerate(batch.records):
            offset = batch.base_offset + index
            if offset % 3 == 0 or offset == clean_end - 1:
                if run and offset != run_start + len(run):
                    kept.append(Batch(run_start, batch.epoch, batch.timestamp_ms, batch.control, tuple(run)))
                    run = []
                if not run:
                    run_start = offset
                run.append(record)
        if run:
            kept.append(Batch(run_start, batch.epoch, batch.timestamp_ms, batch.control, tuple(run)))
    return kept


def write_log(log_dir: Path, batch_count: int) -> list[Batch]:
    batches = []
    with SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES, index_interval_bytes=100) as log:
        index = 0
        # At least batch_count batches, and at least three in the active segment.
        while index < batch_count or sum(b.base_offset >= int(log.segment_paths()[-1].stem) for b in batches) < 3:
            batch = make_batch(log.end_offset(), index // 10, 1 + index % 5, fill=index)
            log.append(batch)
            batches.append(batch)
            index += 1
        log.flush()
    return batches


def boundary_in_segment(log_dir: Path, batches: list[Batch], segment_number: int) -> int:
    """A batch boundary strictly inside the given segment (by position in the file list)."""
    base = int(segment_files(log_dir)[segment_number].stem)
    inside = [b.next_offset for b in batches if b.base_offset >= base]
    return inside[1]


@pytest.mark.parametrize("where", ["sealed", "active"])
def test_replace_prefix_keeps_offsets_and_survives_reopen(tmp_path: Path, where: str) -> None:
    log_dir = tmp_path / "log"
    batches = write_log(log_dir, 60)
    segment_number = 2 if where == "sealed" else -1
    clean_end = boundary_in_segment(log_dir, batches, segment_number)
    cleaned = thin_out(batches, clean_end)
    expected = cleaned + [b for b in batches if b.base_offset >= clean_end]
    size_before = sum(p.stat().st_size for p in segment_files(log_dir))
    with SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES, index_interval_bytes=100) as log:
        epochs_before = [log.end_offset_for_epoch(epoch) for epoch in range(8)]
        log.replace_prefix(cleaned, clean_end)
        assert log.read(0, EVERYTHING) == expected
        assert log.start_offset() == 0 and log.end_offset() == batches[-1].next_offset
        assert [log.end_offset_for_epoch(epoch) for epoch in range(8)] == epochs_before
        gap_offset = next(o for o in range(clean_end) if o % 3 != 0)
        first = log.read(gap_offset, 1)[0]
        assert first == next(b for b in expected if b.next_offset > gap_offset)
        log.append(make_batch(log.end_offset(), 9, 2))
        log.flush()
        expected.append(log.read(batches[-1].next_offset, EVERYTHING)[0])
    assert sum(p.stat().st_size for p in segment_files(log_dir)) < size_before
    assert not list(log_dir.glob("*.cleaned")) and not (log_dir / SWAP_MARKER_NAME).exists()
    for verify in (True, False):
        with SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES, verify_sealed_segments=verify) as log:
            assert log.read(0, EVERYTHING) == expected
            assert [log.end_offset_for_epoch(epoch) for epoch in range(8)][:6] == epochs_before[:6]


def test_replace_prefix_rejects_a_cut_inside_a_batch(tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    batches = write_log(log_dir, 20)
    inside = next(b for b in batches if len(b.records) > 2).base_offset + 1
    with SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES) as log:
        with pytest.raises(ProtocolInvariantError):
            log.replace_prefix(thin_out(batches, inside), inside)
        assert log.read(0, EVERYTHING) == batches


def test_a_gap_outside_the_cleaned_prefix_is_still_corruption(tmp_path: Path) -> None:
    """Gaps are allowed only below the cleaned end recorded in the checkpoint."""
    log_dir = tmp_path / "log"
    batches = write_log(log_dir, 60)
    clean_end = boundary_in_segment(log_dir, batches, 1)
    with SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES) as log:
        log.replace_prefix(thin_out(batches, clean_end), clean_end)
    doomed = segment_files(log_dir)[-2]  # a sealed segment above the cleaned prefix
    doomed.unlink()
    with pytest.raises(CorruptLogError, match="the next segment starts"):
        SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES)


@pytest.mark.parametrize("failpoint", ["segment.before_swap=crash", "segment.after_swap=crash"])
def test_crash_during_the_swap_leaves_old_or_new_prefix(tmp_path: Path, failpoint: str) -> None:
    log_dir = tmp_path / "log"
    batches = write_log(log_dir, 60)
    clean_end = boundary_in_segment(log_dir, batches, 3)
    cleaned = thin_out(batches, clean_end)
    new_view = cleaned + [b for b in batches if b.base_offset >= clean_end]
    pid = os.fork()
    if pid == 0:
        try:
            log = SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES, failpoints=Failpoints(failpoint))
            log.replace_prefix(cleaned, clean_end)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == FAILPOINT_CRASH_EXIT_CODE
    assert (log_dir / SWAP_MARKER_NAME).exists()
    with SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES) as log:
        assert log.read(0, EVERYTHING) == new_view  # the marker was written: the swap completes
    assert not (log_dir / SWAP_MARKER_NAME).exists() and not list(log_dir.glob("*.cleaned"))


def test_crash_before_the_marker_keeps_the_old_prefix(tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    batches = write_log(log_dir, 60)
    clean_end = boundary_in_segment(log_dir, batches, 3)
    pid = os.fork()
    if pid == 0:
        try:
            log = SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES,
                             failpoints=Failpoints("segment.before_swap_marker=crash"))
            log.replace_prefix(thin_out(batches, clean_end), clean_end)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == FAILPOINT_CRASH_EXIT_CODE
    assert list(log_dir.glob("*.cleaned"))  # the new files were written, never swapped in
    with SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES) as log:
        assert log.read(0, EVERYTHING) == batches
    assert not list(log_dir.glob("*.cleaned"))


def test_power_loss_after_replace_prefix_keeps_it(tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    batches = write_log(log_dir, 60)
    clean_end = boundary_in_segment(log_dir, batches, -1)
    cleaned = thin_out(batches, clean_end)
    log = SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES)
    log.replace_prefix(cleaned, clean_end)
    assert log.flushed_offset() == log.end_offset()
    power_loss(log)
    with SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES) as reopened:
        assert reopened.read(0, EVERYTHING) == cleaned + [b for b in batches if b.base_offset >= clean_end]


def test_repair_verifies_and_truncates_a_cleaned_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = tmp_path / "data" / "log"
    batches = write_log(log_dir, 60)
    clean_end = boundary_in_segment(log_dir, batches, 3)
    cleaned = thin_out(batches, clean_end)
    with SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES) as log:
        log.replace_prefix(cleaned, clean_end)
    assert repair_main(["--data-dir", str(log_dir.parent), "--verify"]) == 0
    gap_offset = next(o for o in range(clean_end // 2, clean_end) if o % 3 == 2)
    assert repair_main(["--data-dir", str(log_dir.parent), "--truncate-at", str(gap_offset)]) == 0
    with SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES) as log:
        assert log.read(0, EVERYTHING) == [b for b in cleaned if b.base_offset < gap_offset]
        assert log.end_offset() == max(b.next_offset for b in cleaned if b.base_offset < gap_offset)
    capsys.readouterr()


@pytest.mark.parametrize("verify_sealed_segments", [False, True])
def test_epochs_sealed_by_a_cleaning_keep_their_start_across_a_power_loss(
        tmp_path: Path, verify_sealed_segments: bool) -> None:
    """The cleaned copy of the active segment may roll into several segments: an epoch that
    started in the active segment then starts in a sealed one, whose epochs recovery reads
    from the epoch checkpoint (found by hypothesis in test_segment_log_model)."""
    log = SegmentLog(tmp_path, segment_bytes=SEGMENT_BYTES)
    log.append(make_batch(0, 0, 5, fill=1))
    log.append(make_batch(5, 1, 5, fill=2))  # epoch 1 starts at 5
    log.append(make_batch(10, 1, 8, fill=3))
    log.flush()
    assert log.segment_count() == 1  # everything in the active segment so far
    # Cleaned copy: every record its own batch (more headers: the copy outgrows one segment).
    singles = [Batch(b.base_offset + i, b.epoch, b.timestamp_ms, b.control, (r,))
               for b in log.read(0, EVERYTHING) for i, r in enumerate(b.records)]
    log.replace_prefix(singles, 18)
    assert log.segment_count() >= 2 and log.segment_paths()[-1].name > "00000000000000000005"
    assert log.end_offset_for_epoch(0) == (0, 5)
    power_loss(log)
    reopened = SegmentLog(tmp_path, segment_bytes=SEGMENT_BYTES, verify_sealed_segments=verify_sealed_segments)
    try:
        assert reopened.end_offset_for_epoch(0) == (0, 5)
        assert reopened.end_offset_for_epoch(1) == (1, 18)
        assert [r for b in reopened.read(0, EVERYTHING) for r in b.records] == [r for b in singles for r in b.records]
    finally:
        reopened.close()


def _during_the_copy(log: SegmentLog, monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> None:
    """Run ``action`` while replace_prefix writes the cleaned copy (without the log's lock)."""
    original = log._write_cleaned_segments

    def write_then_act(*args: Any, **kwargs: Any) -> int:
        action()
        return original(*args, **kwargs)
    monkeypatch.setattr(log, "_write_cleaned_segments", write_then_act)


def test_appends_during_the_copy_land_after_the_cleaned_prefix_and_are_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log_dir = tmp_path / "log"
    batches = write_log(log_dir, 60)
    clean_end = boundary_in_segment(log_dir, batches, -1)  # the cut lies in the active segment
    cleaned = thin_out(batches, clean_end)
    log = SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES, index_interval_bytes=100)
    appended: list[Batch] = []

    def append_two() -> None:
        for fill in (1, 2):
            appended.append(make_batch(log.end_offset(), batches[-1].epoch, 3, fill=fill))
            log.append(appended[-1])  # not flushed
    _during_the_copy(log, monkeypatch, append_two)
    log.replace_prefix(cleaned, clean_end)
    expected = cleaned + [b for b in batches if b.base_offset >= clean_end] + appended
    assert log.read(0, EVERYTHING) == expected
    assert log.flushed_offset() == log.end_offset()  # the active segment was rewritten and fsynced
    power_loss(log)
    assert not list(log_dir.glob("*.cleaned"))
    with SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES, verify_sealed_segments=True) as reopened:
        assert reopened.read(0, EVERYTHING) == expected


def test_a_truncation_during_the_copy_gives_up_and_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log_dir = tmp_path / "log"
    batches = write_log(log_dir, 60)
    clean_end = boundary_in_segment(log_dir, batches, -1)
    cleaned = thin_out(batches, clean_end)
    log = SegmentLog(log_dir, segment_bytes=SEGMENT_BYTES, index_interval_bytes=100)
    truncate_at = batches[-1].base_offset  # above clean_end, as raft truncates above the high watermark
    _during_the_copy(log, monkeypatch, lambda: log.truncate_to(truncate_at))
    with pytest.raises(LogChangedError):
        log.replace_prefix(cleaned, clean_end)
    assert log.read(0, EVERYTHING) == [b for b in batches if b.next_offset <= truncate_at]
    assert log.cleaned_end() == 0
    assert not list(log_dir.glob("*.cleaned"))
    log.append(make_batch(truncate_at, batches[-1].epoch, 2))  # the log still takes writes
    monkeypatch.undo()
    log.replace_prefix(cleaned, clean_end)  # and cleaning again works
    assert log.cleaned_end() == clean_end
    log.close()
