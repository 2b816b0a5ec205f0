"""Opening a log directory: finish or drop interrupted writes, check every segment, cut a
torn tail, and rebuild what is derived (indexes, the epoch checkpoint).

Steps (docs/storage.md, Recovery on open): temp files of interrupted atomic writes are
deleted and an interrupted replace_prefix is finished or dropped; segments below the log
start offset are deleted (an interrupted delete_before or reset_to_snapshot); sealed
segments are CRC-checked batch by batch (or, with ``verify_sealed_segments=False``,
trusted through their index, rebuilt by a scan when damaged); the last segment is scanned
and a torn or corrupt tail is cut at the last good batch, with a warning naming the bytes
dropped. A bad batch followed by a good one, or a bad sealed segment, is not a tail: it
raises ``CorruptLogError`` naming the file, the byte position and the repair command.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from raft.types import SnapshotId
from storage.cleaned_segments import finish_or_drop_swap
from storage.durable_files import fsync_directory
from storage.log_checkpoints import (
    EPOCH_CHECKPOINT_NAME,
    LOG_START_CHECKPOINT_NAME,
    clamp_epoch_entries,
    decode_epoch_checkpoint,
    read_log_start_checkpoint,
    write_epoch_checkpoint,
)
from storage.segment_files import (
    INDEX_NAME,
    INDEX_SUFFIX,
    CorruptLogError,
    Segment,
    create_segment,
    decode_index,
    list_segment_bases,
    refetch_way_out,
    segment_path,
    write_index,
)
from storage.segment_scan import (
    ScanResult,
    index_entries_not_batch_starts,
    scan_last_segment,
    scan_segment_file,
    sealed_index_problem,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RecoveredLog:
    """What the open found, durable on disk: at least one segment, the last one active."""

    segments: list[Segment]
    start_offset: int
    snapshot_id: SnapshotId | None
    cleaned_end: int  # offsets below this were compacted: gaps allowed
    cleaner_end: int  # ... by this replica's own replace_prefix (not copied)
    epoch_entries: list[tuple[int, int]]  # (epoch, start offset), increasing


def recover_log_dir(log_dir: Path, index_interval_bytes: int, verify_sealed_segments: bool) -> RecoveredLog:
    """Recover the log in ``log_dir`` (creating its first segment if it has none); every
    segment file in the result is open, and closed again if recovery fails."""
    recovery = _Recovery(log_dir, index_interval_bytes, verify_sealed_segments)
    try:
        recovery.run()
    except BaseException:
        for segment in recovery.segments:
            try:
                os.close(segment.fd)
            except OSError:
                pass
        raise
    return RecoveredLog(recovery.segments, recovery.start_offset, recovery.snapshot_id, recovery.cleaned_end,
                        recovery.cleaner_end, recovery.epoch_entries)


def _extend_epochs(entries: list[tuple[int, int]], epoch_starts: list[tuple[int, int]]) -> None:
    """Add the epoch changes a later scan saw to ``entries`` (its first start of each new epoch)."""
    for epoch, start_offset in epoch_starts:
        if not entries or epoch > entries[-1][0]:
            entries.append((epoch, start_offset))


def _adopt_scan(segment: Segment, scan: ScanResult) -> None:
    segment.index_offsets = scan.index_offsets
    segment.index_positions = scan.index_positions
    segment.last_indexed_position = scan.last_indexed_position
    segment.next_offset = scan.next_offset


@dataclass(slots=True)
class _Recovery:
    log_dir: Path
    index_interval_bytes: int
    verify_sealed_segments: bool
    segments: list[Segment] = field(default_factory=list)
    start_offset: int = 0
    snapshot_id: SnapshotId | None = None
    cleaned_end: int = 0
    cleaner_end: int = 0
    epoch_entries: list[tuple[int, int]] = field(default_factory=list)
    last_segment_epochs: list[tuple[int, int]] = field(default_factory=list)  # epoch changes the last scan saw
    sealed_segment_epochs: list[tuple[int, int]] = field(default_factory=list)  # the same for verified sealed ones

    def run(self) -> None:
        for entry in os.listdir(self.log_dir):
            if entry.endswith(".tmp"):  # an atomic replace that never happened
                (self.log_dir / entry).unlink()
        finish_or_drop_swap(self.log_dir)
        checkpoint = read_log_start_checkpoint(self.log_dir)
        bases = list_segment_bases(self.log_dir)
        if checkpoint is not None:
            self.start_offset, self.snapshot_id = checkpoint.start_offset, checkpoint.snapshot_id
            self.cleaned_end = checkpoint.cleaned_end
            self.cleaner_end = checkpoint.cleaner_end
            below = [base for base in bases if base < self.start_offset]
            for base in below:  # a delete_before or reset_to_snapshot interrupted by a crash
                logger.info("deleting segment %s below the log start offset %d", base, self.start_offset)
                segment_path(self.log_dir, base).unlink()
                segment_path(self.log_dir, base).with_suffix(INDEX_SUFFIX).unlink(missing_ok=True)
            bases = bases[len(below):]
            if bases and bases[0] != self.start_offset:
                raise CorruptLogError(
                    segment_path(self.log_dir, bases[0]), 0,
                    f"the log start offset is {self.start_offset} ({LOG_START_CHECKPOINT_NAME}) but the "
                    f"first segment starts at offset {bases[0]}: segment files are missing", None,
                    refetch_way_out(self.log_dir.parent))
        elif bases:
            self.start_offset = bases[0]
        self._delete_orphan_indexes(set(bases))
        for slot, base in enumerate(bases):
            is_last = slot == len(bases) - 1
            self.segments.append(self._open_segment(base, bases[slot + 1] if not is_last else None))
        if not self.segments:
            self.segments.append(create_segment(self.log_dir, self.start_offset))
        self._recover_epoch_entries()
        last = self.segments[-1]
        write_index(last, None)
        os.fsync(last.fd)  # what recovery found becomes durable before anyone relies on it
        last.durable_bytes = last.size_bytes
        fsync_directory(self.log_dir)  # and the deletions above

    def _delete_orphan_indexes(self, bases: set[int]) -> None:
        for entry in os.listdir(self.log_dir):
            match = INDEX_NAME.match(entry)
            if match and int(match.group(1)) not in bases:
                (self.log_dir / entry).unlink()

    def _open_segment(self, base: int, next_base: int | None) -> Segment:
        path = segment_path(self.log_dir, base)
        fd = os.open(path, os.O_RDWR | os.O_APPEND)
        size_bytes = os.fstat(fd).st_size
        segment = Segment(base, path, fd, size_bytes, base, durable_bytes=size_bytes)
        try:
            if next_base is None:
                self._recover_last_segment(segment)
            else:
                self._open_sealed_segment(segment, next_base)
        except BaseException:
            os.close(fd)
            raise
        return segment

    def _open_sealed_segment(self, segment: Segment, next_base: int) -> None:
        """Verify a sealed segment (or trust it through its index); rebuild a damaged index."""
        try:
            entries = decode_index(segment.index_path.read_bytes())
        except FileNotFoundError:
            entries = None
        problem = sealed_index_problem(segment.base_offset, segment.size_bytes, next_base, entries)
        if self.verify_sealed_segments:
            scan = self._scan_sealed_segment(segment, next_base, keep_batch_positions=problem is None)
            _extend_epochs(self.sealed_segment_epochs, scan.epoch_starts)
            if problem is None and entries is not None:
                problem = index_entries_not_batch_starts(entries[:-1], scan)
            _adopt_scan(segment, scan)  # reads use the scan's index, right by construction
            if problem is not None:
                logger.warning("rebuilding index %s from its segment: %s", segment.index_path, problem)
                write_index(segment, next_base)
            return
        if problem is None and entries is not None:
            for offset, position in entries[:-1]:
                segment.index_offsets.append(offset)
                segment.index_positions.append(position)
            segment.last_indexed_position = entries[-2][1]
            segment.next_offset = next_base
            return
        logger.warning("rebuilding index %s from its segment: %s", segment.index_path, problem)
        _adopt_scan(segment, self._scan_sealed_segment(segment, next_base))
        write_index(segment, next_base)

    def _scan_sealed_segment(self, segment: Segment, next_base: int,
                             keep_batch_positions: bool = False) -> ScanResult:
        """Scan a whole sealed segment; any bad batch is corruption, never a tail to cut."""
        scan = scan_segment_file(segment.fd, segment.size_bytes, segment.base_offset, self.index_interval_bytes,
                                 self.cleaned_end, keep_batch_positions)
        if scan.error_position is not None:
            raise CorruptLogError(segment.path, scan.error_position,
                                  f"{scan.error_reason} (in a sealed segment, not the log's tail)",
                                  scan.next_offset)
        gap_allowed = scan.next_offset < next_base < self.cleaned_end
        if scan.next_offset != next_base and not gap_allowed:
            raise CorruptLogError(segment.path, segment.size_bytes,
                                  f"segment ends at offset {scan.next_offset} but the next segment starts "
                                  f"at offset {next_base}", scan.next_offset)
        return scan

    def _recover_last_segment(self, segment: Segment) -> None:
        """Scan the last segment; cut a torn or corrupt tail, refuse corruption with data after it."""
        scan, tail = scan_last_segment(segment.fd, segment.path, segment.size_bytes, segment.base_offset,
                                       self.index_interval_bytes, self.cleaned_end)
        if tail is not None:
            logger.warning("cutting torn or corrupt tail of %s at byte %d (%s): dropped %d bytes",
                           segment.path, tail.valid_bytes, tail.reason, tail.dropped_bytes)
            os.ftruncate(segment.fd, tail.valid_bytes)
            segment.size_bytes = tail.valid_bytes
        _adopt_scan(segment, scan)
        self.last_segment_epochs = scan.epoch_starts

    def _recover_epoch_entries(self) -> None:
        """Epochs of sealed segments come from the checkpoint; the last segment's from its scan."""
        path = self.log_dir / EPOCH_CHECKPOINT_NAME
        last = self.segments[-1]
        try:
            entries: list[tuple[int, int]] | None = decode_epoch_checkpoint(path.read_bytes())
        except FileNotFoundError:
            entries = None
            problem = "missing"
        except ValueError as exc:
            entries = None
            problem = f"unreadable: {exc}"
        if self.verify_sealed_segments:
            # The scans saw the first held batch of each epoch. The checkpoint may name an
            # earlier start for an epoch (its first records were cleaned away): keep it then.
            sealed = self.sealed_segment_epochs
            held = [entry for entry in entries or [] if entry[1] < last.base_offset]
            consistent = [epoch for epoch, _ in held] == [epoch for epoch, _ in sealed] and all(
                checkpointed[1] <= scanned[1] for checkpointed, scanned in zip(held, sealed, strict=True))
            if entries is not None and not consistent:
                problem = "out of step with the segments"
            if (entries is None or not consistent) and len(self.segments) > 1:
                logger.warning("%s is %s; rebuilt it from the segments", path, problem)
            recovered = held if entries is not None and consistent else list(sealed)
        else:
            if entries is None:
                if len(self.segments) > 1:
                    logger.warning("%s is %s; rebuilding it from the sealed segments", path, problem)
                entries = self._epochs_of_sealed_segments()
            recovered = [entry for entry in entries if entry[1] < last.base_offset]
        _extend_epochs(recovered, self.last_segment_epochs)
        self.epoch_entries = clamp_epoch_entries(recovered, self.start_offset)
        if self.epoch_entries != entries:
            write_epoch_checkpoint(self.log_dir, self.epoch_entries)

    def _epochs_of_sealed_segments(self) -> list[tuple[int, int]]:
        entries: list[tuple[int, int]] = []
        for segment in self.segments[:-1]:
            scan = scan_segment_file(segment.fd, segment.size_bytes, segment.base_offset, self.index_interval_bytes,
                                     self.cleaned_end)
            if scan.error_position is not None:
                raise CorruptLogError(segment.path, scan.error_position, scan.error_reason, scan.next_offset)
            _extend_epochs(entries, scan.epoch_starts)
        return entries
