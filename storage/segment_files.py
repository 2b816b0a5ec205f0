"""The segment files of a log directory: names, the offset index of an open segment and
its file, error reporting, and the byte-level reads and cuts the log and repair share.

Layout of ``log_dir`` (the other files are storage/log_checkpoints.py's and
storage/cleaned_segments.py's)::

    <base_offset:020d>.log       batches back to back, storage/batch_codec.py format
    <base_offset:020d>.index     sparse offset index: big-endian (offset u64, byte position u64)
                                 entries; a sealed segment's index ends with the entry
                                 (next segment's base offset, segment size)
"""

from __future__ import annotations

import bisect
import os
import re
import shlex
import struct
import sys
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from raft.types import Batch
from storage.batch_codec import encode_batch
from storage.data_dir import refetch_from_leader
from storage.durable_files import write_all_parts
from storage.failpoints import Failpoints

DEFAULT_INDEX_INTERVAL_BYTES = 4096
READ_CHUNK_BYTES = 256 * 1024  # bound on one pread while reading batches
LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
INDEX_ENTRY = struct.Struct(">QQ")
SEGMENT_NAME = re.compile(r"^(\d{20})\.log$")
INDEX_NAME = re.compile(r"^(\d{20})\.index$")


class CorruptLogError(Exception):
    """The log holds bad bytes that are not a torn tail; startup must stop, nothing is repaired.

    ``truncate_at_offset`` is the first record offset that cannot be trusted: discarding it and
    everything after it (``metakv repair``) lets the node re-fetch from the leader. The message
    prints the ``metakv`` console script, not ``python -m storage.repair``: the module form only
    works from the repository root, the console script from anywhere.
    """

    def __init__(self, path: Path, position: int, reason: str, truncate_at_offset: int | None,
                 way_out: str | None = None) -> None:
        self.path = path
        self.position = position
        self.reason = reason
        self.truncate_at_offset = truncate_at_offset
        data_dir = path.parent.parent
        if way_out is None and truncate_at_offset is not None:
            way_out = (f"to discard offset {truncate_at_offset} and everything after it (this node then "
                       f"re-fetches them from the leader) run: metakv repair --data-dir "
                       f"{shlex.quote(str(data_dir))} --truncate-at {truncate_at_offset}")
        self.way_out = way_out
        super().__init__(f"corrupt log file {path} at byte {position}: {reason}"
                         + (f"; {way_out}" if way_out else ""))


def refetch_way_out(data_dir: Path) -> str:
    """The way out when the damaged file cannot be rebuilt from what is left on this node.

    The log start checkpoint (start offset, snapshot id, cleaned_end, cleaner_end) and the
    segment swap marker say things the segments do not: guessing them could replay a state
    through a prefix this node's cleaner compacted (deleted keys come back) or accept a gap as
    compaction. Starting over from the leader is the only safe answer. quorum-state stays: it
    holds this voter's vote (a voter that forgets it can vote twice in one epoch) and tells it
    that its log was lost (it must not vote until it caught up).
    """
    return "this file cannot be rebuilt from the segments; " + refetch_from_leader(data_dir)


@dataclass(slots=True)
class Segment:
    """An open segment file and its offset index (the whole index, in memory)."""

    base_offset: int
    path: Path
    fd: int
    size_bytes: int
    next_offset: int
    index_offsets: array = field(default_factory=lambda: array("Q"))
    index_positions: array = field(default_factory=lambda: array("Q"))
    last_indexed_position: int = -1
    durable_bytes: int = 0  # size at the last fsync: what a power loss cannot take away

    @property
    def index_path(self) -> Path:
        return self.path.with_suffix(INDEX_SUFFIX)

    def position_for(self, offset: int) -> int:
        """Byte position of the last indexed batch starting at or below ``offset``."""
        slot = bisect.bisect_right(self.index_offsets, offset) - 1
        return self.index_positions[slot] if slot >= 0 else 0

    def add_index_entry(self, offset: int, position: int, interval_bytes: int) -> bool:
        if self.last_indexed_position >= 0 and position - self.last_indexed_position < interval_bytes:
            return False
        self.index_offsets.append(offset)
        self.index_positions.append(position)
        self.last_indexed_position = position
        return True

    def cut_index(self, offset: int) -> None:
        """Drop index entries for batches starting at or above ``offset``."""
        keep = bisect.bisect_left(self.index_offsets, offset)
        del self.index_offsets[keep:]
        del self.index_positions[keep:]
        self.last_indexed_position = self.index_positions[-1] if keep else -1


def encode_index(offsets: array, positions: array, sentinel: tuple[int, int] | None) -> bytes:
    entries = array("Q")
    for offset, position in zip(offsets, positions, strict=True):
        entries.append(offset)
        entries.append(position)
    if sentinel is not None:
        entries.extend(sentinel)
    if sys.byteorder == "little":
        entries.byteswap()
    return entries.tobytes()


def decode_index(data: bytes) -> list[tuple[int, int]] | None:
    """The entries of an index file, or None when its size is not a whole number of entries."""
    if len(data) % INDEX_ENTRY.size:
        return None
    return [INDEX_ENTRY.unpack_from(data, at) for at in range(0, len(data), INDEX_ENTRY.size)]


def segment_path(log_dir: Path, base_offset: int) -> Path:
    return log_dir / f"{base_offset:020d}{LOG_SUFFIX}"


def write_index(segment: Segment, next_offset: int | None) -> None:
    """Write ``segment``'s index file whole: sealed (``next_offset`` given) with its end
    marker and fsynced; else the entries known now for the segment becoming active.

    Appends do not extend an active segment's file (SegmentLog._note_written says why); it
    is written again with its end marker when the segment is sealed, and rebuilt by the
    scan on every open. Any prefix of batch starts is a valid index, so the file is never
    wrong, only short.
    """
    end_marker = None if next_offset is None else (next_offset, segment.size_bytes)
    fd = os.open(segment.index_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all_parts(fd, (encode_index(segment.index_offsets, segment.index_positions, end_marker),))
        if next_offset is not None:
            os.fsync(fd)
    finally:
        os.close(fd)


def create_segment(log_dir: Path, base_offset: int) -> Segment:
    """A new, empty active segment starting at ``base_offset`` (with its empty index file)."""
    path = segment_path(log_dir, base_offset)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    segment = Segment(base_offset, path, fd, 0, base_offset)
    try:
        write_index(segment, None)
    except BaseException:
        os.close(fd)  # a roll retried later (out of descriptors) opens it again
        raise
    return segment


def rewrite_cut_batch(path: Path, position: int, batch_end: int, kept: Batch,
                      failpoints: Failpoints | None = None) -> int:
    """Cut segment ``path`` inside the batch at byte ``position`` (ending at ``batch_end``),
    keeping the records ``kept`` holds (they may be committed); return the new file size.
    The caller fsyncs the file afterwards (and the segment log and ``metakv repair`` both do).

    Order: the file is cut after the old batch, the kept records are rewritten over its start
    as a shorter batch and fsynced, and only then is the file cut after them. At no moment
    is the file without them: a crash or a failed write leaves the whole old batch, or the
    kept batch followed by a torn tail that recovery cuts. (Cutting first and writing the
    kept batch after lost them to a full disk, and to a crash before the fsync.) Its own
    descriptor: a segment's is O_APPEND, and Linux appends a pwrite on such a descriptor at
    the end of the file whatever the position."""
    points = failpoints if failpoints is not None else Failpoints()
    data = encode_batch(kept)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, batch_end)
        points.hit("segment.before_write")
        write_all_parts(fd, (data,), position)
        points.hit("segment.after_write")
        points.hit("segment.before_fsync")
        os.fsync(fd)
        points.hit("segment.after_fsync")
        os.ftruncate(fd, position + len(data))
    finally:
        os.close(fd)
    return position + len(data)


def read_exact(fd: int, size: int, position: int) -> bytes:
    data = os.pread(fd, size, position)
    if len(data) != size:
        raise OSError(f"short read: {len(data)} of {size} bytes at byte {position}")
    return data


def list_segment_bases(log_dir: Path) -> list[int]:
    """Base offsets of the segment files in ``log_dir``, increasing."""
    bases = []
    for entry in os.listdir(log_dir):
        match = SEGMENT_NAME.match(entry)
        if match:
            bases.append(int(match.group(1)))
    return sorted(bases)

