"""The way out of a CorruptLogError: discard the log from a record offset on, explicitly.

    metakv repair --data-dir D --verify
    metakv repair --data-dir D --truncate-at OFFSET [--dry-run]

(``metakv repair`` is app/cli.py's front end to this module; ``python -m storage.repair``
runs it too, but only from the repository root.)

Opening a log never repairs corruption below its tail by itself: that would silently drop
records a quorum may have committed. An operator runs this instead, with the node stopped,
after reading the error. Every record at OFFSET and above is removed (whole segments above
it are deleted, the segment holding it is cut, a batch straddling OFFSET keeps its records
below OFFSET); records below OFFSET must all be valid, else the command refuses and names the
lower offset to use. The node then re-fetches the discarded records from the leader.

Dropping records that a majority of voters also lost loses committed data: repair one
voter at a time, and only while the others hold the records.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from raft.types import Batch
from storage.batch_codec import CorruptBatchError, decode_batch
from storage.cleaned_segments import finish_or_drop_swap
from storage.data_dir import DataDirError, DataDirLock
from storage.durable_files import fsync_directory
from storage.log_checkpoints import (
    EPOCH_CHECKPOINT_NAME,
    decode_epoch_checkpoint,
    read_log_start_checkpoint,
    write_epoch_checkpoint,
)
from storage.segment_files import (
    INDEX_SUFFIX,
    CorruptLogError,
    list_segment_bases,
    rewrite_cut_batch,
    segment_path,
)
from storage.segment_scan import TornTail, scan_last_segment

EXIT_USAGE = 2


class RepairError(Exception):
    """The repair cannot be done as asked; the message says what to do instead."""


@dataclass(frozen=True, slots=True)
class RepairReport:
    truncate_at: int
    deleted_files: list[Path]
    cut_file: Path | None
    cut_at_byte: int
    dropped_bytes: int


@dataclass(frozen=True, slots=True)
class VerifyReport:
    batch_count: int
    total_bytes: int
    torn_tail: TornTail | None  # what the next start will cut from the last segment


def verify_log(log_dir: Path) -> VerifyReport:
    """Check every batch of every segment (CRC, body, offset continuity).

    Raises CorruptLogError at the first bad batch, naming file, byte and the offset to truncate at.
    Offsets may jump only below the cleaned end recorded in the log start checkpoint. The last
    segment's tail is judged by the rule startup recovery applies (``scan_last_segment``): a
    torn tail is reported, not raised, since the next start cuts it as normal recovery.
    """
    finish_or_drop_swap(log_dir)
    checkpoint = read_log_start_checkpoint(log_dir)
    cleaned_end = checkpoint.cleaned_end if checkpoint is not None else 0
    batch_count = total_bytes = 0
    torn_tail: TornTail | None = None
    expected_offset: int | None = None
    bases = list_segment_bases(log_dir)
    for slot, base in enumerate(bases):
        path = segment_path(log_dir, base)
        data = path.read_bytes()
        if expected_offset is not None and base != expected_offset and not expected_offset < base < cleaned_end:
            raise CorruptLogError(path, 0, f"segment starts at offset {base}, the previous one ends at "
                                  f"{expected_offset}", expected_offset)
        expected_offset = base
        checked_bytes = len(data)
        if slot == len(bases) - 1:
            fd = os.open(path, os.O_RDONLY)
            try:
                _scan, torn_tail = scan_last_segment(fd, path, len(data), base, cleaned_end=cleaned_end)
            finally:
                os.close(fd)
            if torn_tail is not None:
                checked_bytes = torn_tail.valid_bytes
        position = 0
        while position < checked_bytes:
            try:
                batch, end = decode_batch(data, position)
            except CorruptBatchError as exc:
                raise CorruptLogError(path, position, exc.reason, expected_offset) from exc
            if batch.base_offset != expected_offset and not expected_offset < batch.base_offset < cleaned_end:
                raise CorruptLogError(path, position, f"batch has base offset {batch.base_offset}, expected "
                                      f"{expected_offset}", expected_offset)
            expected_offset = batch.next_offset
            batch_count += 1
            position = end
        total_bytes += len(data)
    return VerifyReport(batch_count, total_bytes, torn_tail)


def truncate_log_at(log_dir: Path, truncate_at: int, dry_run: bool = False) -> RepairReport:
    """Remove every record at ``truncate_at`` and above from the log in ``log_dir``."""
    if not dry_run:
        finish_or_drop_swap(log_dir)
    checkpoint = read_log_start_checkpoint(log_dir)
    bases = list_segment_bases(log_dir)
    start_offset = checkpoint.start_offset if checkpoint is not None else (bases[0] if bases else 0)
    if truncate_at < start_offset:
        raise RepairError(f"--truncate-at {truncate_at} is below the log start offset {start_offset}")
    if not bases:
        raise RepairError(f"no segment files in {log_dir}: nothing to truncate")
    doomed = [base for base in bases if base >= truncate_at and base != bases[0]]
    holder = [base for base in bases if base not in doomed][-1]
    holder_path = segment_path(log_dir, holder)
    cleaned_end = checkpoint.cleaned_end if checkpoint is not None else 0
    cut_at_byte, kept_partial, partial_end = _locate_cut(holder_path, holder, truncate_at, cleaned_end,
                                                         last=not doomed)
    holder_size = holder_path.stat().st_size
    deleted = [segment_path(log_dir, base) for base in doomed]
    dropped_bytes = sum(path.stat().st_size for path in deleted) + holder_size - cut_at_byte
    report = RepairReport(truncate_at, deleted, holder_path, cut_at_byte, dropped_bytes)
    if dry_run:
        return report
    for path in reversed(deleted):  # newest first, so a crash midway leaves a log without gaps
        path.with_suffix(INDEX_SUFFIX).unlink(missing_ok=True)
        path.unlink()
    if kept_partial is not None:  # the segment log's own way: the kept records never leave the file
        rewrite_cut_batch(holder_path, cut_at_byte, partial_end, kept_partial)
    fd = os.open(holder_path, os.O_RDWR)
    try:
        if kept_partial is None:
            os.ftruncate(fd, cut_at_byte)
        os.fsync(fd)
    finally:
        os.close(fd)
    holder_path.with_suffix(INDEX_SUFFIX).unlink(missing_ok=True)  # rebuilt by the next open
    _cut_epoch_checkpoint(log_dir, truncate_at)
    fsync_directory(log_dir)
    return report


def _locate_cut(path: Path, base: int, truncate_at: int, cleaned_end: int, last: bool
                ) -> tuple[int, Batch | None, int]:
    """Byte position in segment ``path`` where offset ``truncate_at`` begins; every batch before
    it must be valid. Returns the cut position, the part of a straddling batch to keep, and
    where that batch ends (else the cut position again)."""
    data = path.read_bytes()
    position, expected_offset = 0, base
    while position < len(data):
        try:
            batch, end = decode_batch(data, position)
        except CorruptBatchError as exc:
            if expected_offset >= truncate_at:
                return position, None, position  # the bad batch is itself at or above the cut
            raise RepairError(
                f"{path} is corrupt at byte {position} ({exc.reason}), below --truncate-at {truncate_at}: "
                f"use --truncate-at {expected_offset}") from exc
        if batch.base_offset != expected_offset and not expected_offset < batch.base_offset < cleaned_end:
            raise RepairError(f"{path} at byte {position}: batch has base offset {batch.base_offset}, "
                              f"expected {expected_offset}: use --truncate-at {expected_offset}")
        if batch.base_offset >= truncate_at:
            return position, None, position
        if batch.next_offset > truncate_at:
            kept = Batch(batch.base_offset, batch.epoch, batch.timestamp_ms, batch.control,
                         batch.records[: truncate_at - batch.base_offset])
            return position, kept, end
        expected_offset = batch.next_offset
        position = end
    if last:
        raise RepairError(f"the log ends at offset {expected_offset}, at or below --truncate-at {truncate_at}: "
                          "nothing to truncate")
    return position, None, position


def _cut_epoch_checkpoint(log_dir: Path, truncate_at: int) -> None:
    path = log_dir / EPOCH_CHECKPOINT_NAME
    try:
        entries = decode_epoch_checkpoint(path.read_bytes())
    except FileNotFoundError:
        return
    except ValueError:
        path.unlink()  # rebuilt from the segments by the next open
        return
    write_epoch_checkpoint(log_dir, [e for e in entries if e[1] < truncate_at])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="metakv repair", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, type=Path, help="the node's data directory (holds log/)")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--truncate-at", type=int, metavar="OFFSET",
                        help="remove every record at OFFSET and above")
    action.add_argument("--verify", action="store_true",
                        help="check every batch of every segment (exit 1 on corruption; a torn tail of the "
                        "last segment, which the next start cuts, is reported with exit 0)")
    parser.add_argument("--dry-run", action="store_true", help="say what --truncate-at would remove")
    args = parser.parse_args(argv)
    log_dir = args.data_dir / "log"
    if not log_dir.is_dir():
        print(f"error: {log_dir} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    try:
        lock = DataDirLock(args.data_dir)  # never under a running node
    except DataDirError as exc:  # not corruption (exit 1): the request cannot be done now
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.verify:
            verified = verify_log(log_dir)
            print(f"ok: {verified.batch_count} batches, {verified.total_bytes} bytes in {log_dir}")
            tail = verified.torn_tail
            if tail is not None:
                print(f"torn tail: {tail.dropped_bytes} bytes after byte {tail.valid_bytes} of {tail.path} "
                      f"({tail.reason}) will be cut at the next start; the log then ends at offset "
                      f"{tail.end_offset} (normal crash recovery, nothing to repair)")
            return 0
        report = truncate_log_at(log_dir, args.truncate_at, dry_run=args.dry_run)
    except (RepairError, CorruptLogError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, CorruptLogError) else EXIT_USAGE
    finally:
        lock.close()
    verb = "would remove" if args.dry_run else "removed"
    files = ", ".join(path.name for path in report.deleted_files) or "no whole segment"
    print(f"{verb} every record at offset {report.truncate_at} and above: {report.dropped_bytes} bytes; "
          f"cut {report.cut_file.name if report.cut_file else '-'} at byte {report.cut_at_byte}; deleted {files}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
