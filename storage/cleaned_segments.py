"""The files of ``SegmentLog.replace_prefix``: a compacted prefix written as
``*.log.cleaned`` segment files, and the ``cleaner-swap`` marker that makes swapping them
in crash safe.

While the marker exists the swap is decided: recovery finishes it (renaming is
repeatable). Without it, ``*.cleaned`` files are leftovers of a swap that never started and
are deleted. A crash therefore leaves the old prefix or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from raft.types import Batch, check
from storage.batch_codec import HEADER_BYTES, CorruptBatchError, decode_header, encode_batch
from storage.durable_files import fsync_directory, write_all_parts, write_file_atomically
from storage.segment_files import (
    INDEX_SUFFIX,
    READ_CHUNK_BYTES,
    CorruptLogError,
    Segment,
    read_exact,
    refetch_way_out,
    segment_path,
)

logger = logging.getLogger(__name__)

SWAP_MARKER_NAME = "cleaner-swap"  # present while replace_prefix swaps segment files
CLEANED_SUFFIX = ".cleaned"
CLEANED_WRITE_BUFFER_BYTES = 1024 * 1024  # bound on bytes replace_prefix buffers before a write


def cleaned_path(log_dir: Path, base_offset: int) -> Path:
    path = segment_path(log_dir, base_offset)
    return path.with_name(path.name + CLEANED_SUFFIX)


def write_cleaned_segments(log_dir: Path, batches: Sequence[Batch], *, start_offset: int, segment_bytes: int,
                           index_interval_bytes: int, holder_fd: int, holder_path: Path, cut_position: int,
                           copied_end: int, pending: list[Segment]) -> int:
    """Write the cleaned batches, then the holder's untouched tail up to ``copied_end``, as
    ``*.cleaned`` files rolled at ``segment_bytes``, appending the new segments (indexed,
    files not yet open) to ``pending``; every file is fsynced and closed but the last, whose
    fd is returned (the caller adds what the holder gained meanwhile, then fsyncs it).

    The first new segment is named by the log start offset even if its first record was
    cleaned away, so the log keeps starting where the checkpoint says. Bytes go out
    through a buffer of at most CLEANED_WRITE_BUFFER_BYTES. The segment log runs it without
    its lock: it reads only the cleaned batches and bytes of the holder below ``copied_end``.
    """
    buffer = bytearray()
    fd = -1
    try:
        for batch in batches:
            data = encode_batch(batch)
            if not pending or (pending[-1].size_bytes > 0 and
                               pending[-1].size_bytes + len(data) > segment_bytes):
                if fd >= 0:
                    finished, fd = fd, -1
                    finish_cleaned_file(finished, buffer)
                base = start_offset if not pending else batch.base_offset
                pending.append(Segment(base, segment_path(log_dir, base), -1, 0, base))
                fd = os.open(cleaned_path(log_dir, base), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            segment = pending[-1]
            segment.add_index_entry(batch.base_offset, segment.size_bytes, index_interval_bytes)
            segment.size_bytes += len(data)
            segment.next_offset = batch.next_offset
            buffer += data
            _write_when_full(fd, buffer)
        copy_segment_tail(holder_fd, holder_path, cut_position, copied_end, pending[-1], fd, buffer,
                          index_interval_bytes)
        write_all_parts(fd, (buffer,))
        os.fsync(fd)  # most of the last file: the fsync under the lock covers only the rest
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd


def copy_segment_tail(source_fd: int, source_path: Path, start: int, end: int, segment: Segment,
                      fd: int, buffer: bytearray, index_interval_bytes: int) -> None:
    """Append the source segment's batches in [start, end) to ``segment`` (file ``fd``, whose
    unwritten bytes ``buffer`` holds), indexing them, in bounded chunks."""
    position = start
    base_size = segment.size_bytes
    while position < end:
        data = read_exact(source_fd, HEADER_BYTES, position)
        try:
            header = decode_header(data)
        except CorruptBatchError as exc:
            raise CorruptLogError(source_path, position, exc.reason, None) from exc
        segment.add_index_entry(header.base_offset, base_size + position - start, index_interval_bytes)
        position += header.total_bytes
    position = start
    while position < end:
        chunk = read_exact(source_fd, min(READ_CHUNK_BYTES, end - position), position)
        buffer += chunk
        position += len(chunk)
        _write_when_full(fd, buffer)
    segment.size_bytes += end - start


def _write_when_full(fd: int, buffer: bytearray) -> None:
    if len(buffer) >= CLEANED_WRITE_BUFFER_BYTES:
        write_all_parts(fd, (buffer,))
        buffer.clear()


def finish_cleaned_file(fd: int, buffer: bytearray) -> None:
    """Write what ``buffer`` holds, fsync and close the cleaned file ``fd``."""
    try:
        write_all_parts(fd, (buffer,))
        buffer.clear()
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_cleaned_files(log_dir: Path, pending: list[Segment]) -> None:
    """Best effort: drop the cleaned files of a replace_prefix that gave up."""
    for segment in pending:
        with contextlib.suppress(OSError):
            cleaned_path(log_dir, segment.base_offset).unlink(missing_ok=True)


def write_swap_marker(log_dir: Path, old_bases: list[int], new_bases: list[int]) -> None:
    """Decide the swap: from here on recovery finishes it instead of dropping the cleaned files."""
    write_file_atomically(log_dir / SWAP_MARKER_NAME, json.dumps({"old": old_bases, "new": new_bases}).encode())


def swap_cleaned_files(log_dir: Path, old_bases: list[int], new_bases: list[int]) -> None:
    """Rename cleaned segment files into place and delete the old ones; repeatable after a crash."""
    for base in new_bases:
        cleaned = cleaned_path(log_dir, base)
        if cleaned.exists():
            os.replace(cleaned, segment_path(log_dir, base))
        segment_path(log_dir, base).with_suffix(INDEX_SUFFIX).unlink(missing_ok=True)
    for base in old_bases:
        if base not in new_bases:
            segment_path(log_dir, base).unlink(missing_ok=True)
            segment_path(log_dir, base).with_suffix(INDEX_SUFFIX).unlink(missing_ok=True)
    fsync_directory(log_dir)


def finish_or_drop_swap(log_dir: Path) -> None:
    """Finish a replace_prefix whose swap marker was written; drop cleaned files of one that was not."""
    marker = log_dir / SWAP_MARKER_NAME
    if marker.exists():
        try:
            value = json.loads(marker.read_bytes())
            old_bases, new_bases = value["old"], value["new"]
            check(all(type(base) is int for base in old_bases + new_bases), "bases")
        except Exception as exc:
            raise CorruptLogError(marker, 0, f"unreadable segment swap marker ({exc!r})", None,
                                  refetch_way_out(log_dir.parent)) from exc
        logger.warning("finishing a segment swap interrupted by a crash: %s replace %s", new_bases, old_bases)
        swap_cleaned_files(log_dir, old_bases, new_bases)
        marker.unlink()
    for entry in os.listdir(log_dir):
        if entry.endswith(CLEANED_SUFFIX):
            logger.info("deleting %s of a segment swap that never started", entry)
            (log_dir / entry).unlink()
    fsync_directory(log_dir)

