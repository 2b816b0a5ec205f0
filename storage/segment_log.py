"""The raft log on disk: segment files of record batches, an offset index, a leader-epoch file.

Layout of ``log_dir`` (normally ``<data-dir>/log``)::

    <base_offset:020d>.log       batches back to back, storage/batch_codec.py format
    <base_offset:020d>.index     sparse offset index: big-endian (offset u64, byte position u64)
                                 entries; a sealed segment's index ends with the entry
                                 (next segment's base offset, segment size)
    leader-epoch-checkpoint      epoch -> start offset (text, replaced atomically)
    log-start-checkpoint         log start offset, latest snapshot id, cleaned end (JSON, atomic)
    cleaner-swap, *.log.cleaned  only while replace_prefix installs a compacted prefix

Durability rules (why the code is ordered the way it is):

- ``append`` writes into the page cache only; ``flush`` fsyncs the active segment (and the
  directory when files were created or deleted) and only then raises ``flushed_offset``.
  ``flush`` runs on a worker thread while the event loop keeps appending, so it captures the
  end offset and a truncation generation under the lock, fsyncs a dup of the file descriptor
  outside it, and raises ``flushed_offset`` only if no truncation happened meanwhile.
- Rolling to a new segment first fsyncs the old one and writes the epoch checkpoint, so every
  sealed segment is durable and complete: only the last segment can have a torn tail.
- ``truncate_to`` is durable when it returns (the cut file is fsynced, deleted files are
  removed from the directory durably, newest first): a truncated record must never come
  back after a crash, and a crash halfway leaves a shorter log, never a gap.
- Any failed write or fsync (ENOSPC, EIO) puts the log in a failed state: appends, truncations
  and flushes raise ``LogWriteError`` until the log is reopened (after an fsync failure the page
  cache can no longer be trusted); reads keep working on what was written before.

Recovery on open (see docs/storage.md): sealed segments are CRC-checked batch by batch (or,
with ``verify_sealed_segments=False``, trusted through their index, rebuilt by a scan when
damaged); the last segment is scanned and a torn or corrupt tail is cut at the last good
batch, with a warning naming the bytes dropped. A bad batch followed by a good one, or a bad
sealed segment, is not a tail: it raises ``CorruptLogError`` naming the file, the byte
position and the repair command.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import logging
import os
import re
import shlex
import struct
import sys
import threading
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import crc32c

from raft.types import Batch, SnapshotId, check
from storage.batch_codec import (
    CRC_START,
    FORMAT_VERSION,
    HEADER_BYTES,
    BatchEncoder,
    BatchHeader,
    CorruptBatchError,
    TruncatedBatchError,
    decode_batch,
    decode_header,
    encode_batch,
)
from storage.durable_files import fsync_directory, write_all_parts, write_file_atomically
from storage.failpoints import Failpoints

logger = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
DEFAULT_INDEX_INTERVAL_BYTES = 4096
READ_CHUNK_BYTES = 256 * 1024  # bound on one pread while reading batches
SCAN_CHUNK_BYTES = 8 * 1024 * 1024  # bound on the buffer recovery scans a segment through
CLEANED_WRITE_BUFFER_BYTES = 1024 * 1024  # bound on bytes replace_prefix buffers before a write
ITERATE_CHUNK_BYTES = 1024 * 1024  # bound on the bytes one iter_batches step holds
LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
EPOCH_CHECKPOINT_NAME = "leader-epoch-checkpoint"
LOG_START_CHECKPOINT_NAME = "log-start-checkpoint"
SWAP_MARKER_NAME = "cleaner-swap"  # present while replace_prefix swaps segment files
CLEANED_SUFFIX = ".cleaned"
EPOCH_CHECKPOINT_HEADER = "metakv-leader-epoch-checkpoint 1"
INDEX_ENTRY = struct.Struct(">QQ")
_SEGMENT_NAME = re.compile(r"^(\d{20})\.log$")
_INDEX_NAME = re.compile(r"^(\d{20})\.index$")


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
    holds this voter's vote, and a voter that forgets it can vote twice in one epoch.
    """
    quoted = shlex.quote(str(data_dir))
    return (f"this file cannot be rebuilt from the segments; with the node stopped, move {quoted}/log, "
            f"{quoted}/snapshots and {quoted}/state.db (with any state.db-wal and state.db-shm) away, "
            f"keep {quoted}/quorum-state (and identity.json), and restart: the node fetches a snapshot and the log from the "
            "leader (do this only while a majority of the other voters is up; a lone node has no leader "
            "to fetch from: restore the directory from a backup instead)")


class LogWriteError(Exception):
    """A write or fsync failed (disk full, I/O error); the log refuses writes until reopened."""


class LogChangedError(Exception):
    """replace_prefix gave up, changing nothing: the log was truncated, reset or had segments
    deleted while the cleaned copy was written. Cleaning again later is safe."""


@dataclass(slots=True)
class _Segment:
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


@dataclass(slots=True)
class _ScanResult:
    valid_bytes: int
    next_offset: int
    index_offsets: array
    index_positions: array
    last_indexed_position: int
    epoch_starts: list[tuple[int, int]]  # (epoch, first offset) at every epoch change
    error_position: int | None = None
    error_reason: str = ""
    # Every batch's (base offset, byte position), kept only to check an existing index against.
    batch_offsets: array | None = None
    batch_positions: array | None = None


def _check_batch(buffer: bytes | memoryview, position: int) -> tuple[BatchHeader, int]:
    """Header sanity and CRC of the batch at ``position``, without decoding its body."""
    header = decode_header(buffer, position)
    end = position + header.total_bytes
    if end > len(buffer):
        raise TruncatedBatchError(position, "file ends inside a batch body")
    (stored_crc,) = struct.unpack_from(">I", buffer, position + 5)
    if crc32c.crc32c(memoryview(buffer)[position + CRC_START : end]) != stored_crc:
        raise CorruptBatchError(position, "CRC32C mismatch")
    return header, end


def _accept_batch(result: _ScanResult, header: BatchHeader, position: int, end: int,
                  index_interval_bytes: int, cleaned_end: int) -> bool:
    """Check one CRC-valid batch against the ones before it and record it; False if it does not fit.

    Offsets continue from the previous batch, except below ``cleaned_end``, where they may
    jump (the cleaner drops records but never moves one); epochs never decrease.
    """
    gap_allowed = result.next_offset < header.base_offset < cleaned_end
    if header.base_offset != result.next_offset and not gap_allowed:
        result.error_position = position
        result.error_reason = f"batch has base offset {header.base_offset}, expected {result.next_offset}"
        return False
    if result.epoch_starts and header.epoch < result.epoch_starts[-1][0]:
        result.error_position = position
        result.error_reason = f"batch epoch {header.epoch} is below the previous batch's {result.epoch_starts[-1][0]}"
        return False
    if result.last_indexed_position < 0 or position - result.last_indexed_position >= index_interval_bytes:
        result.index_offsets.append(header.base_offset)
        result.index_positions.append(position)
        result.last_indexed_position = position
    if result.batch_positions is not None and result.batch_offsets is not None:
        result.batch_offsets.append(header.base_offset)
        result.batch_positions.append(position)
    if not result.epoch_starts or header.epoch != result.epoch_starts[-1][0]:
        result.epoch_starts.append((header.epoch, header.base_offset))
    result.next_offset = header.base_offset + header.count
    result.valid_bytes = end
    return True


def _scan_file(fd: int, size_bytes: int, base_offset: int, index_interval_bytes: int,
               cleaned_end: int = 0, keep_batch_positions: bool = False) -> _ScanResult:
    """Walk every batch of a segment file, checking headers, CRCs and offsets; stop at the first bad one.

    Reads through one reused buffer of at most SCAN_CHUNK_BYTES (a batch larger than that is
    read on its own), so recovery reads the log once without holding a segment in memory.
    """
    result = _ScanResult(0, base_offset, array("Q"), array("Q"), -1, [])
    if keep_batch_positions:
        result.batch_offsets, result.batch_positions = array("Q"), array("Q")
    buffer = memoryview(bytearray(min(SCAN_CHUNK_BYTES, size_bytes)))
    chunk_position = 0
    while chunk_position < size_bytes:
        chunk = buffer[: min(len(buffer), size_bytes - chunk_position)]
        if os.preadv(fd, [chunk], chunk_position) != len(chunk):
            raise OSError(f"short read of {len(chunk)} bytes at byte {chunk_position}")
        at_file_end = chunk_position + len(chunk) == size_bytes
        at = 0
        while at < len(chunk):
            try:
                header, end = _check_batch(chunk, at)
            except TruncatedBatchError as exc:
                if at_file_end:
                    result.error_position, result.error_reason = chunk_position + at, exc.reason
                    return result
                if at > 0:
                    break  # the batch continues past this chunk: read on from its start
                header, end = _check_large_batch(fd, size_bytes, chunk_position, result)
                if header is None:
                    return result
            except CorruptBatchError as exc:
                result.error_position, result.error_reason = chunk_position + at, exc.reason
                return result
            if not _accept_batch(result, header, chunk_position + at, chunk_position + end,
                                 index_interval_bytes, cleaned_end):
                return result
            at = end
        chunk_position += at
    return result


def _check_large_batch(fd: int, size_bytes: int, position: int,
                       result: _ScanResult) -> tuple[BatchHeader | None, int]:
    """Check a batch larger than the scan buffer by reading it whole; (None, 0) records an error."""
    try:
        header = decode_header(_read_exact(fd, HEADER_BYTES, position))
        data = _read_exact(fd, min(header.total_bytes, size_bytes - position), position)
        return _check_batch(data, 0)
    except CorruptBatchError as exc:
        result.error_position, result.error_reason = position, exc.reason
        return None, 0


def _find_good_batch_after(buffer: bytes, position: int, min_base_offset: int) -> int | None:
    """Position of a valid batch (CRC good, base offset >= ``min_base_offset``) after ``position``.

    Tells a torn tail (nothing valid follows) from corruption in the middle (good data
    follows, which must not be cut silently). Candidates are found by the format byte.
    """
    magic = bytes([FORMAT_VERSION])
    candidate = buffer.find(magic, position + 1 + 4)
    while candidate != -1:
        start = candidate - 4
        try:
            header, _end = _check_batch(buffer, start)
        except CorruptBatchError:
            header = None
        if header is not None and header.base_offset >= min_base_offset:
            return start
        candidate = buffer.find(magic, candidate + 1)
    return None


@dataclass(frozen=True, slots=True)
class TornTail:
    """Bytes at the end of the last segment that recovery cuts: a write the crash tore."""

    path: Path
    valid_bytes: int  # the file is cut here, at the end of the last good batch
    dropped_bytes: int
    end_offset: int  # the log's end offset after the cut
    reason: str


def scan_last_segment(fd: int, path: Path, size_bytes: int, base_offset: int,
                      index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES,
                      cleaned_end: int = 0) -> tuple[_ScanResult, TornTail | None]:
    """The recovery rule for the last segment, shared by opening a log and ``metakv repair --verify``.

    At the first bad batch: if no valid batch (good CRC, offset at or above the expected one)
    follows anywhere in the rest of the file, the rest is a torn tail (returned, not cut here);
    otherwise it is corruption in the middle and raises CorruptLogError. Only the last segment
    can have a torn tail: every sealed one was fsynced before the next was created.
    """
    scan = _scan_file(fd, size_bytes, base_offset, index_interval_bytes, cleaned_end)
    if scan.error_position is None:
        return scan, None
    rest = _read_exact(fd, size_bytes - scan.error_position, scan.error_position)
    found = _find_good_batch_after(rest, 0, scan.next_offset)
    if found is not None:
        raise CorruptLogError(
            path, scan.error_position,
            f"{scan.error_reason}, yet a valid batch follows at byte {scan.error_position + found}: "
            "this is not a torn tail", scan.next_offset)
    return scan, TornTail(path, scan.valid_bytes, size_bytes - scan.valid_bytes, scan.next_offset,
                          scan.error_reason)


def _index_entries_not_batch_starts(entries: list[tuple[int, int]], scan: _ScanResult) -> str | None:
    """Why an index does not fit its segment (an entry that is not a batch start), or None.

    Any subset of batch starts is a valid index, whatever interval it was written with.
    """
    offsets, positions = scan.batch_offsets, scan.batch_positions
    check(offsets is not None and positions is not None, "scan kept no batch positions")
    for offset, position in entries:
        slot = bisect.bisect_left(positions, position)
        if slot == len(positions) or positions[slot] != position or offsets[slot] != offset:
            return f"entry ({offset}, {position}) is not the start of a batch"
    return None


def _encode_index(offsets: array, positions: array, sentinel: tuple[int, int] | None) -> bytes:
    entries = array("Q")
    for offset, position in zip(offsets, positions, strict=True):
        entries.append(offset)
        entries.append(position)
    if sentinel is not None:
        entries.extend(sentinel)
    if sys.byteorder == "little":
        entries.byteswap()
    return entries.tobytes()


def _decode_index(data: bytes) -> list[tuple[int, int]] | None:
    if len(data) % INDEX_ENTRY.size:
        return None
    return [INDEX_ENTRY.unpack_from(data, at) for at in range(0, len(data), INDEX_ENTRY.size)]


def _segment_path(log_dir: Path, base_offset: int) -> Path:
    return log_dir / f"{base_offset:020d}{LOG_SUFFIX}"


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


def _read_exact(fd: int, size: int, position: int) -> bytes:
    data = os.pread(fd, size, position)
    if len(data) != size:
        raise OSError(f"short read: {len(data)} of {size} bytes at byte {position}")
    return data


def encode_epoch_checkpoint(entries: list[tuple[int, int]]) -> bytes:
    lines = [EPOCH_CHECKPOINT_HEADER, str(len(entries))]
    lines += [f"{epoch} {start_offset}" for epoch, start_offset in entries]
    return ("\n".join(lines) + "\n").encode()


def decode_epoch_checkpoint(data: bytes) -> list[tuple[int, int]]:
    """Parse the leader-epoch checkpoint; ValueError names the first bad line."""
    lines = data.decode("ascii", errors="replace").split("\n")
    if lines[-1] == "":
        lines.pop()
    if not lines or lines[0] != EPOCH_CHECKPOINT_HEADER:
        raise ValueError("line 1 is not the checkpoint header")
    if len(lines) < 2 or not lines[1].isdigit() or int(lines[1]) != len(lines) - 2:
        raise ValueError("line 2 does not hold the number of entries that follow")
    entries: list[tuple[int, int]] = []
    for number, line in enumerate(lines[2:], start=3):
        parts = line.split(" ")
        if len(parts) != 2 or not all(part.isdigit() for part in parts):
            raise ValueError(f"line {number} is not 'epoch start_offset'")
        epoch, start_offset = int(parts[0]), int(parts[1])
        if entries and (epoch <= entries[-1][0] or start_offset <= entries[-1][1]):
            raise ValueError(f"line {number} does not increase epoch and start offset")
        entries.append((epoch, start_offset))
    return entries


@dataclass(frozen=True, slots=True)
class LogStartCheckpoint:
    """What cannot be derived from the segments: where the log starts, the newest snapshot,
    how far the prefix was compacted (offsets may jump below ``cleaned_end``), and how far
    this replica's own cleaner compacted it (``cleaner_end``; a copy of the leader's cleaned
    prefix raises only ``cleaned_end``)."""

    start_offset: int
    snapshot_id: SnapshotId | None
    cleaned_end: int = 0
    cleaner_end: int = 0


def read_log_start_checkpoint(log_dir: Path) -> LogStartCheckpoint | None:
    """The log start checkpoint, or None when there is none (a log never cut or cleaned)."""
    path = log_dir / LOG_START_CHECKPOINT_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise CorruptLogError(path, exc.start, "not UTF-8 JSON; it holds the log start offset, the snapshot id "
                              "and how far the log was compacted", None, refetch_way_out(log_dir.parent)) from exc
    try:
        value = json.loads(text)
        start_offset = value["start_offset"]
        snapshot = value["snapshot"]
        cleaned_end = value.get("cleaned_end", 0)
        cleaner_end = value.get("cleaner_end", cleaned_end)  # older files: the cautious reading
        check(type(start_offset) is int and start_offset >= 0, "start_offset")
        check(type(cleaned_end) is int and cleaned_end >= 0, "cleaned_end")
        check(type(cleaner_end) is int and 0 <= cleaner_end <= cleaned_end, "cleaner_end")
        snapshot_id = None
        if snapshot is not None:
            snapshot_id = SnapshotId(snapshot["end_offset"], snapshot["epoch"])
            check(type(snapshot_id.end_offset) is int and type(snapshot_id.epoch) is int, "snapshot")
    except json.JSONDecodeError as exc:
        raise CorruptLogError(path, len(text[: exc.pos].encode()), f"not JSON ({exc.msg}); it holds the log start offset, the "
                              "snapshot id and how far the log was compacted", None,
                              refetch_way_out(log_dir.parent)) from exc
    except Exception as exc:
        raise CorruptLogError(path, 0, f"not a log start checkpoint ({exc!r}); it holds the log start "
                              "offset, the snapshot id and how far the log was compacted", None,
                              refetch_way_out(log_dir.parent)) from exc
    return LogStartCheckpoint(start_offset, snapshot_id, cleaned_end, cleaner_end)


def write_log_start_checkpoint(log_dir: Path, checkpoint: LogStartCheckpoint) -> None:
    snapshot_id = checkpoint.snapshot_id
    snapshot = None if snapshot_id is None else {"end_offset": snapshot_id.end_offset, "epoch": snapshot_id.epoch}
    data = json.dumps({"start_offset": checkpoint.start_offset, "snapshot": snapshot,
                       "cleaned_end": checkpoint.cleaned_end, "cleaner_end": checkpoint.cleaner_end}).encode()
    write_file_atomically(log_dir / LOG_START_CHECKPOINT_NAME, data)


def list_segment_bases(log_dir: Path) -> list[int]:
    bases = []
    for entry in os.listdir(log_dir):
        match = _SEGMENT_NAME.match(entry)
        if match:
            bases.append(int(match.group(1)))
    return sorted(bases)


def _cleaned_path(log_dir: Path, base_offset: int) -> Path:
    path = _segment_path(log_dir, base_offset)
    return path.with_name(path.name + CLEANED_SUFFIX)


def _swap_files(log_dir: Path, old_bases: list[int], new_bases: list[int]) -> None:
    """Rename cleaned segment files into place and delete the old ones; repeatable after a crash."""
    for base in new_bases:
        cleaned = _cleaned_path(log_dir, base)
        if cleaned.exists():
            os.replace(cleaned, _segment_path(log_dir, base))
        _segment_path(log_dir, base).with_suffix(INDEX_SUFFIX).unlink(missing_ok=True)
    for base in old_bases:
        if base not in new_bases:
            _segment_path(log_dir, base).unlink(missing_ok=True)
            _segment_path(log_dir, base).with_suffix(INDEX_SUFFIX).unlink(missing_ok=True)
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
        _swap_files(log_dir, old_bases, new_bases)
        marker.unlink()
    for entry in os.listdir(log_dir):
        if entry.endswith(CLEANED_SUFFIX):
            logger.info("deleting %s of a segment swap that never started", entry)
            (log_dir / entry).unlink()
    fsync_directory(log_dir)


class SegmentLog:
    """``raft.log.RaftLog`` on disk. Thread-safe: one lock guards every method."""

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES,
        failpoints: Failpoints | None = None,
        verify_sealed_segments: bool = True,
    ) -> None:
        """Open (recovering) or create the log in ``log_dir``.

        ``verify_sealed_segments`` (default) CRC-checks every sealed segment on open, so that a
        flipped bit anywhere stops startup instead of surfacing when the record is next read;
        opening then reads the whole log once. Without it, sealed segments are trusted through
        their index (rebuilt by a scan when damaged) and only the last segment is scanned.
        """
        check(segment_bytes >= 1024, f"segment_bytes {segment_bytes} below 1024")
        check(index_interval_bytes > 0, "index_interval_bytes must be positive")
        self._log_dir = Path(log_dir)
        self._segment_bytes = segment_bytes
        self._index_interval_bytes = index_interval_bytes
        self._verify_sealed_segments = verify_sealed_segments
        self._failpoints = failpoints if failpoints is not None else Failpoints.from_env()
        self._lock = threading.Lock()
        self._encoder = BatchEncoder()  # used under _lock only
        self._segments: list[_Segment] = []
        self._segment_bases: list[int] = []
        self._epoch_entries: list[tuple[int, int]] = []  # (epoch, start offset), increasing
        self._epoch_checkpoint_dirty = False
        self._start_offset = 0
        self._snapshot_id: SnapshotId | None = None
        self._cleaned_end = 0  # offsets below this were compacted by replace_prefix: gaps allowed
        self._cleaner_end = 0  # ... by this replica's own replace_prefix (not copied)
        self._flushed_offset = 0
        self._truncation_generation = 0
        self._directory_dirty = False
        self._failure: LogWriteError | None = None
        self._closed = False
        self._last_segment_epochs: list[tuple[int, int]] = []  # epoch changes found by recovery's scan
        self._sealed_segment_epochs: list[tuple[int, int]] = []  # the same for verified sealed segments
        self._log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._recover()
        except BaseException:
            self._close_files()
            raise

    # ------------------------------------------------------------------ RaftLog protocol

    def start_offset(self) -> int:
        with self._lock:
            return self._start_offset

    def end_offset(self) -> int:
        with self._lock:
            return self._end_offset()

    def flushed_offset(self) -> int:
        with self._lock:
            return self._flushed_offset

    def last_epoch(self) -> int:
        with self._lock:
            return self._last_epoch()

    def append(self, batch: Batch) -> None:
        with self._lock:
            self._check_writable()
            end_offset = self._end_offset()
            check(batch.base_offset == end_offset
                  or end_offset < batch.base_offset < batch.next_offset <= self._cleaned_end,
                  f"append at {batch.base_offset}, end is {end_offset}")
            check(batch.epoch >= self._last_epoch(), f"append epoch {batch.epoch} below {self._last_epoch()}")
            check(len(batch.records) > 0, "empty batch")
            with self._encoder.parts(batch) as parts:
                size_bytes = len(parts[0]) + len(parts[1])
                active = self._segments[-1]
                if active.size_bytes > 0 and active.size_bytes + size_bytes > self._segment_bytes:
                    self._roll()
                self._append_encoded(batch, parts)

    def truncate_to(self, offset: int) -> None:
        with self._lock:
            self._check_writable()
            check(offset >= self._start_offset, f"truncate to {offset} below start {self._start_offset}")
            if offset >= self._end_offset():
                return
            self._truncation_generation += 1
            try:
                self._truncate_locked(offset)
            except OSError as exc:
                raise self._fail(exc) from exc

    def read(self, offset: int, max_bytes: int) -> list[Batch]:
        with self._lock:
            result: list[Batch] = []
            if offset >= self._end_offset():
                return result
            offset = max(offset, self._start_offset)
            total_bytes = 0
            slot = max(bisect.bisect_right(self._segment_bases, offset) - 1, 0)
            for segment in self._segments[slot:]:
                position = segment.position_for(offset) if not result else 0
                total_bytes, full = self._read_segment(segment, position, offset, max_bytes, total_bytes, result)
                if full:
                    break
            return result

    def end_offset_for_epoch(self, epoch: int) -> tuple[int, int]:
        with self._lock:
            last_epoch = self._last_epoch()
            if epoch >= last_epoch:
                return last_epoch, self._end_offset()
            best = (0, 0)
            if self._snapshot_id is not None and self._snapshot_id.epoch <= epoch:
                best = (self._snapshot_id.epoch, self._snapshot_id.end_offset)
            entries = self._epoch_entries
            for slot, (entry_epoch, _start) in enumerate(entries):
                if entry_epoch > epoch:
                    break
                best = (entry_epoch, entries[slot + 1][1] if slot + 1 < len(entries) else self._end_offset())
            return best

    def flush(self) -> int:
        with self._lock:
            self._check_writable()
            target_offset = self._end_offset()
            if target_offset <= self._flushed_offset and not self._directory_dirty:
                return self._flushed_offset
            generation = self._truncation_generation
            segment = self._segments[-1]
            captured_bytes = segment.size_bytes
            fd = os.dup(segment.fd)
            sync_directory = self._directory_dirty
            self._directory_dirty = False
        try:
            self._failpoints.hit("segment.before_fsync")
            os.fsync(fd)
            self._failpoints.hit("segment.after_fsync")
            if sync_directory:
                fsync_directory(self._log_dir)
        except OSError as exc:
            with self._lock:
                raise self._fail(exc) from exc
        finally:
            os.close(fd)
        with self._lock:
            if generation == self._truncation_generation:
                self._flushed_offset = max(self._flushed_offset, target_offset)
                segment.durable_bytes = max(segment.durable_bytes, captured_bytes)
            return self._flushed_offset

    def latest_snapshot_id(self) -> SnapshotId | None:
        with self._lock:
            return self._snapshot_id

    def reset_to_snapshot(self, snapshot_id: SnapshotId) -> None:
        """Replace the whole log by ``snapshot_id``; durable when it returns.

        Order: delete segments at or above the snapshot's end (a plain suffix truncation),
        persist the new start offset, then delete the rest; recovery deletes any segment
        below the persisted start, so a crash anywhere leaves a consistent log.
        """
        with self._lock:
            self._check_writable()
            self._truncation_generation += 1
            new_start = snapshot_id.end_offset
            try:
                above = [s for s in reversed(self._segments) if s.base_offset >= new_start]
                self._delete_segments(above)  # newest first: a crash leaves no gap
                if above:
                    fsync_directory(self._log_dir)
                cleaner_end = min(self._cleaner_end, new_start)
                self._write_start_checkpoint(start_offset=new_start, snapshot_id=snapshot_id,
                                             cleaner_end=cleaner_end)
                self._delete_segments([s for s in self._segments if s.base_offset < new_start])
                self._segments, self._segment_bases = [], []
                self._create_segment(new_start)
                self._epoch_entries = []
                self._write_epoch_checkpoint()
                fsync_directory(self._log_dir)
            except OSError as exc:
                raise self._fail(exc) from exc
            self._directory_dirty = False
            self._start_offset = new_start
            self._snapshot_id = snapshot_id
            self._flushed_offset = new_start
            self._cleaner_end = cleaner_end

    def cleaned_end(self) -> int:
        with self._lock:
            return self._cleaned_end

    def _write_start_checkpoint(self, **changes: int | SnapshotId | None) -> None:
        """Persist the log-start checkpoint: this log's fields with ``changes`` applied (the
        caller takes them over once the write succeeded)."""
        current = LogStartCheckpoint(self._start_offset, self._snapshot_id, self._cleaned_end, self._cleaner_end)
        write_log_start_checkpoint(self._log_dir, dataclasses.replace(current, **changes))  # type: ignore[arg-type]

    def cleaner_end(self) -> int:
        """Offsets below this were compacted by this replica's own cleaner (replace_prefix).
        A state older than it cannot be replayed through the log (docs/compaction.md rule
        9); one older than a copied cleaned prefix can (the leader kept every tombstone at
        and above the offset the copy started from)."""
        with self._lock:
            return self._cleaner_end

    def allow_gaps_below(self, offset: int) -> None:
        """Durably raise cleaned_end to ``offset`` before appending batches copied from the
        leader's cleaned prefix (offsets jump there), so recovery accepts those gaps."""
        with self._lock:
            self._check_writable()
            if offset <= self._cleaned_end:
                return
            try:
                self._write_start_checkpoint(cleaned_end=offset)
            except OSError as exc:
                raise self._fail(exc) from exc
            self._cleaned_end = offset

    # ------------------------------------------------------------------ beyond the protocol

    def record_snapshot(self, snapshot_id: SnapshotId) -> None:
        """Remember a snapshot taken locally, so latest_snapshot_id() and delete_before see it."""
        with self._lock:
            self._check_writable()
            check(snapshot_id.end_offset >= self._start_offset,
                  f"snapshot end {snapshot_id.end_offset} below log start {self._start_offset}")
            if self._snapshot_id is not None and snapshot_id.end_offset <= self._snapshot_id.end_offset:
                return
            try:
                self._write_start_checkpoint(snapshot_id=snapshot_id)
            except OSError as exc:
                raise self._fail(exc) from exc
            self._snapshot_id = snapshot_id

    def delete_before(self, offset: int) -> int:
        """Drop whole segments holding only offsets below ``offset``; return the new start offset.

        ``offset`` must be covered by the recorded snapshot. The active segment is never
        dropped. The new start offset is persisted before any file is deleted, and recovery
        deletes segments below it, so a crash in between leaves no gap.
        """
        with self._lock:
            self._check_writable()
            snapshot_end = self._snapshot_id.end_offset if self._snapshot_id is not None else 0
            check(offset <= snapshot_end, f"delete_before({offset}) above the snapshot end {snapshot_end}")
            doomed = [s for s in self._segments[:-1] if s.next_offset <= offset]
            if not doomed:
                return self._start_offset
            new_start = self._segments[len(doomed)].base_offset
            try:
                self._write_start_checkpoint(start_offset=new_start)
                self._delete_segments(doomed)
                self._segments = self._segments[len(doomed):]
                self._segment_bases = self._segment_bases[len(doomed):]
                self._start_offset = new_start
                self._clamp_epoch_entries_to_start()
                self._write_epoch_checkpoint()
                fsync_directory(self._log_dir)
            except OSError as exc:
                raise self._fail(exc) from exc
            return new_start

    def replace_prefix(self, batches: Sequence[Batch], clean_end: int) -> None:
        """Replace every batch below ``clean_end`` by ``batches``, a compacted copy of that prefix.

        ``batches`` keep their offsets (records may be missing, never moved), lie in
        [start_offset, clean_end), increase, and the last one ends exactly at ``clean_end``,
        a batch boundary of this log. Offsets below ``clean_end`` may jump from then on.
        Epoch boundaries are kept as they are (the cleaner keeps every control record).

        Crash safety: the new segments are written as ``*.log.cleaned`` and fsynced, a
        ``cleaner-swap`` marker naming old and new files is written atomically, then the new
        files are renamed over the old ones and the old ones deleted, and the marker removed.
        Recovery finishes a swap whose marker exists and deletes ``*.cleaned`` files without
        one, so a crash leaves either the old prefix or the new one, never a mix.

        Appends go on meanwhile: the cleaned copy, with the segment holding ``clean_end`` as
        far as it was written when the call began, is written and fsynced without the lock;
        under the lock are only the few batches appended since then and the swap itself.
        Holding the lock for the whole copy stalled appends (and so the event loop) for
        12-41 ms per cleaning. Raises LogChangedError, changing nothing, when the log was
        truncated, reset or had segments deleted while the copy was written.
        """
        with self._lock:
            self._check_writable()
            check(self._start_offset < clean_end <= self._end_offset(),
                  f"clean_end {clean_end} outside ({self._start_offset}, {self._end_offset()}]")
            check(bool(batches) and batches[-1].next_offset == clean_end,
                  f"the cleaned batches must end at clean_end {clean_end}")
            previous_end = self._start_offset
            for batch in batches:
                check(batch.base_offset >= previous_end and len(batch.records) > 0,
                      f"cleaned batch at {batch.base_offset} overlaps the one before or is empty")
                previous_end = batch.next_offset
            slot = bisect.bisect_right(self._segment_bases, clean_end - 1) - 1
            holder = self._segments[slot]
            try:
                cut_position, partial, _ = self._locate_cut(holder, clean_end)
            except OSError as exc:
                raise self._fail(exc) from exc
            check(partial is None, f"clean_end {clean_end} is not a batch boundary")
            generation = self._truncation_generation
            copied_end = holder.size_bytes
            read_fd = os.dup(holder.fd)  # stays valid even if the segment is deleted meanwhile
        pending: list[_Segment] = []
        try:
            try:
                last_fd = self._write_cleaned_segments(batches, read_fd, holder.path, cut_position, copied_end,
                                                       pending)
            finally:
                os.close(read_fd)
        except (OSError, CorruptLogError) as exc:
            self._remove_cleaned_files(pending)
            with self._lock:
                if self._truncation_generation != generation:
                    raise LogChangedError("the log changed while its cleaned prefix was written") from exc
                if isinstance(exc, OSError):
                    raise self._fail(exc) from exc
                raise
        with self._lock:
            if (self._truncation_generation != generation or slot >= len(self._segments)
                    or self._segments[slot] is not holder):
                os.close(last_fd)
                self._remove_cleaned_files(pending)
                raise LogChangedError("the log changed while its cleaned prefix was written")
            try:
                self._check_writable()
            except BaseException:
                os.close(last_fd)
                self._remove_cleaned_files(pending)
                raise
            self._truncation_generation += 1
            try:
                self._finish_replace_prefix_locked(pending, last_fd, slot, holder, copied_end, clean_end)
            except OSError as exc:
                raise self._fail(exc) from exc

    def _remove_cleaned_files(self, pending: list[_Segment]) -> None:
        for segment in pending:
            with contextlib.suppress(OSError):
                _cleaned_path(self._log_dir, segment.base_offset).unlink(missing_ok=True)

    def iter_batches(self, from_offset: int | None = None,
                     chunk_bytes: int = ITERATE_CHUNK_BYTES) -> Iterator[Batch]:
        """Every batch from ``from_offset`` (default: the start) to the end, in order.

        Reads ``chunk_bytes`` at a time under the lock, so appends continue between steps.
        """
        offset = self.start_offset() if from_offset is None else from_offset
        while True:
            batches = self.read(offset, chunk_bytes)
            if not batches:
                return
            yield from batches
            offset = batches[-1].next_offset

    def size_bytes(self) -> int:
        """Total bytes of all segment files (for metrics)."""
        with self._lock:
            return sum(segment.size_bytes for segment in self._segments)

    def segment_count(self) -> int:
        with self._lock:
            return len(self._segments)

    def segment_paths(self) -> list[Path]:
        """Segment files, oldest first; every one but the last is sealed and immutable."""
        with self._lock:
            return [segment.path for segment in self._segments]

    def durable_sizes(self) -> dict[Path, int]:
        """Bytes of each segment known to be on stable storage; tests use it to model a power loss."""
        with self._lock:
            return {segment.path: segment.durable_bytes for segment in self._segments}

    def failed(self) -> bool:
        with self._lock:
            return self._failure is not None

    def close(self) -> None:
        """Close the files. No flush and no checkpoint write: closing behaves like a crash, so the
        recovery path is the only open path and is exercised on every restart."""
        with self._lock:
            self._close_files()
            self._closed = True

    def __enter__(self) -> SegmentLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals (lock held)

    def _end_offset(self) -> int:
        return self._segments[-1].next_offset

    def _last_epoch(self) -> int:
        if self._epoch_entries:
            return self._epoch_entries[-1][0]
        return self._snapshot_id.epoch if self._snapshot_id is not None else 0

    def _check_writable(self) -> None:
        check(not self._closed, "log is closed")
        if self._failure is not None:
            raise self._failure

    def _fail(self, exc: OSError) -> LogWriteError:
        """Enter the failed state: nothing more is written until the log is reopened."""
        if self._failure is None:
            self._failure = LogWriteError(
                f"writing the log in {self._log_dir} failed ({exc}); the log refuses writes "
                "until it is reopened, reads keep working"
            )
            logger.error("%s", self._failure)
        return self._failure

    def _append_encoded(self, batch: Batch, parts: Sequence[bytes | memoryview]) -> None:
        """Write an encoded batch (its parts, in order) at the end of the active segment."""
        active = self._segments[-1]
        try:
            self._failpoints.hit("segment.before_write")
            write_all_parts(active.fd, parts)
            self._failpoints.hit("segment.after_write")
        except OSError as exc:
            try:  # do not leave half a batch for the next append to follow
                os.ftruncate(active.fd, active.size_bytes)
            except OSError:
                logger.warning("could not cut %s back to %d bytes after a failed write",
                               active.path, active.size_bytes)
            raise self._fail(exc) from exc
        self._note_written(active, batch, active.size_bytes, sum(len(part) for part in parts))

    def _note_written(self, active: _Segment, batch: Batch, position: int, size_bytes: int) -> None:
        """Account for ``batch``, written at ``position`` as the active segment's last batch."""
        active.size_bytes = position + size_bytes
        active.next_offset = batch.next_offset
        # The active segment's index lives in memory until the segment is sealed: recovery
        # rebuilds it by scanning the last segment anyway, and a write to a second file here
        # costs a syscall and most likely makes the fsync commit that file's growth too
        # (ext4 data=ordered); batches of 100+ records wrote one every append (docs/storage.md).
        active.add_index_entry(batch.base_offset, position, self._index_interval_bytes)
        if not self._epoch_entries or batch.epoch > self._epoch_entries[-1][0]:
            # An entry starting here covers no offset (only the entry delete_before clamped
            # to an empty log's start can): drop it, as Kafka's epoch cache does, so that
            # end_offset_for_epoch never answers for an epoch the log does not hold.
            while self._epoch_entries and self._epoch_entries[-1][1] >= batch.base_offset:
                self._epoch_entries.pop()
            self._epoch_entries.append((batch.epoch, batch.base_offset))
            self._epoch_checkpoint_dirty = True

    def _fsync(self, fd: int) -> None:
        self._failpoints.hit("segment.before_fsync")
        os.fsync(fd)
        self._failpoints.hit("segment.after_fsync")

    def _roll(self) -> None:
        """Seal the active segment (durable, indexed) and start a new one at the end offset."""
        old = self._segments[-1]
        try:
            self._fsync(old.fd)
            old.durable_bytes = old.size_bytes
            if self._epoch_checkpoint_dirty:
                self._write_epoch_checkpoint()
            self._create_segment(old.next_offset)
            self._failpoints.hit("segment.after_roll")
            self._write_sealed_index(old, old.next_offset)
            fsync_directory(self._log_dir)
        except OSError as exc:
            raise self._fail(exc) from exc
        self._directory_dirty = False
        # Everything below the old segment's end is now durable, truncations included.
        self._flushed_offset = max(self._flushed_offset, old.next_offset)

    def _write_sealed_index(self, segment: _Segment, next_offset: int) -> None:
        data = _encode_index(segment.index_offsets, segment.index_positions, (next_offset, segment.size_bytes))
        fd = os.open(segment.index_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all_parts(fd, (data,))
            os.fsync(fd)
        finally:
            os.close(fd)

    def _rewrite_active_index(self, segment: _Segment) -> None:
        """Write the index entries known now for the segment becoming active (no end marker).

        Appends do not extend this file (see _append_encoded); it is written whole, with
        its end marker, when the segment is sealed, and rebuilt by the scan on every open.
        Any prefix of batch starts is a valid index, so the file is never wrong, only short.
        """
        fd = os.open(segment.index_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all_parts(fd, (_encode_index(segment.index_offsets, segment.index_positions, None),))
        finally:
            os.close(fd)

    def _create_segment(self, base_offset: int) -> _Segment:
        path = _segment_path(self._log_dir, base_offset)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        segment = _Segment(base_offset, path, fd, 0, base_offset)
        self._segments.append(segment)
        self._segment_bases.append(base_offset)
        self._rewrite_active_index(segment)
        self._directory_dirty = True
        return segment

    def _delete_segments(self, doomed: list[_Segment]) -> None:
        for segment in doomed:
            os.close(segment.fd)
            segment.fd = -1
            segment.path.unlink(missing_ok=True)
            segment.index_path.unlink(missing_ok=True)
        if doomed:
            self._directory_dirty = True

    def _truncate_locked(self, offset: int) -> None:
        slot = max(bisect.bisect_right(self._segment_bases, offset) - 1, 0)
        self._delete_segments(self._segments[:slot:-1])  # newest first: a crash leaves no gap
        del self._segments[slot + 1 :]
        del self._segment_bases[slot + 1 :]
        segment = self._segments[-1]
        position, partial, partial_end = self._locate_cut(segment, offset)
        if partial is None:
            os.ftruncate(segment.fd, position)
        else:  # keep the records of the cut batch that lie below ``offset``
            kept = Batch(partial.base_offset, partial.epoch, partial.timestamp_ms, partial.control,
                         partial.records[: offset - partial.base_offset])
            kept_bytes = rewrite_cut_batch(segment.path, position, partial_end, kept, self._failpoints) - position
        segment.size_bytes = position
        segment.next_offset = partial.base_offset if partial is not None else offset
        segment.cut_index(segment.next_offset)
        self._rewrite_active_index(segment)
        self._epoch_entries = [(e, start) for e, start in self._epoch_entries if start < segment.next_offset]
        if partial is not None:
            self._note_written(segment, kept, position, kept_bytes)
        self._fsync(segment.fd)
        segment.durable_bytes = segment.size_bytes
        self._write_epoch_checkpoint()
        if self._directory_dirty:
            fsync_directory(self._log_dir)
            self._directory_dirty = False
        # Everything below ``offset`` is durable now: sealed segments were synced when sealed.
        self._flushed_offset = offset

    def _locate_cut(self, segment: _Segment, offset: int) -> tuple[int, Batch | None, int]:
        """Byte position where records >= ``offset`` begin, the batch cut in two there (if
        any), and the byte position where that batch ends (else the first position again)."""
        position = segment.position_for(offset)
        while position < segment.size_bytes:
            header = self._read_header(segment, position)
            next_offset = header.base_offset + header.count
            if next_offset > offset:
                if header.base_offset >= offset:
                    return position, None, position
                batch, _ = self._read_batch(segment, position, header.total_bytes)
                return position, batch, position + header.total_bytes
            position += header.total_bytes
        return position, None, position

    def _read_header(self, segment: _Segment, position: int) -> BatchHeader:
        data = _read_exact(segment.fd, HEADER_BYTES, position)
        try:
            return decode_header(data)
        except CorruptBatchError as exc:
            raise CorruptLogError(segment.path, position, exc.reason, self._offset_near(segment, position)) from exc

    def _read_batch(self, segment: _Segment, position: int, total_bytes: int) -> tuple[Batch, int]:
        data = _read_exact(segment.fd, total_bytes, position)
        try:
            batch, _end = decode_batch(data)
        except CorruptBatchError as exc:
            raise CorruptLogError(segment.path, position, exc.reason, self._offset_near(segment, position)) from exc
        return batch, position + total_bytes

    def _offset_near(self, segment: _Segment, position: int) -> int:
        """The offset of the last indexed batch at or before ``position``: safe to truncate at."""
        slot = bisect.bisect_right(segment.index_positions, position) - 1
        return segment.index_offsets[slot] if slot >= 0 else segment.base_offset

    def _read_segment(self, segment: _Segment, position: int, offset: int, max_bytes: int,
                      total_bytes: int, result: list[Batch]) -> tuple[int, bool]:
        """Append to ``result`` the batches of ``segment`` from ``position`` holding offsets >= ``offset``.

        Returns the new byte total and whether ``max_bytes`` was reached.
        """
        while position < segment.size_bytes:
            chunk_bytes = min(segment.size_bytes - position, READ_CHUNK_BYTES)
            chunk = _read_exact(segment.fd, chunk_bytes, position)
            at = 0
            while at < len(chunk):
                try:
                    header = decode_header(chunk, at)
                except TruncatedBatchError:
                    break
                except CorruptBatchError as exc:
                    raise CorruptLogError(segment.path, position + at, exc.reason,
                                          self._offset_near(segment, position + at)) from exc
                if header.base_offset + header.count <= offset:
                    at += header.total_bytes
                    continue
                if result and total_bytes + header.total_bytes > max_bytes:
                    return total_bytes, True
                if at + header.total_bytes > len(chunk):
                    if at == 0:  # a batch larger than the chunk: read it whole
                        batch, _ = self._read_batch(segment, position, header.total_bytes)
                        result.append(batch)
                        total_bytes += header.total_bytes
                        at = header.total_bytes
                    break
                try:
                    batch, _end = decode_batch(chunk, at)
                except CorruptBatchError as exc:
                    raise CorruptLogError(segment.path, position + at, exc.reason,
                                          self._offset_near(segment, position + at)) from exc
                result.append(batch)
                total_bytes += header.total_bytes
                at += header.total_bytes
            position += at
        return total_bytes, False

    def _write_epoch_checkpoint(self) -> None:
        write_file_atomically(self._log_dir / EPOCH_CHECKPOINT_NAME, encode_epoch_checkpoint(self._epoch_entries))
        self._epoch_checkpoint_dirty = False

    def _clamp_epoch_entries_to_start(self) -> None:
        """Entries starting below the log start: keep the newest, moved up to the start."""
        below = [entry for entry in self._epoch_entries if entry[1] < self._start_offset]
        above = [entry for entry in self._epoch_entries if entry[1] >= self._start_offset]
        if below and (not above or above[0][1] > self._start_offset):
            above.insert(0, (below[-1][0], self._start_offset))
        self._epoch_entries = above

    def _close_files(self) -> None:
        for segment in self._segments:
            if segment.fd >= 0:
                try:
                    os.close(segment.fd)
                except OSError:
                    pass
            segment.fd = -1

    def _finish_replace_prefix_locked(self, pending: list[_Segment], last_fd: int, slot: int,
                                      holder: _Segment, copied_end: int, clean_end: int) -> None:
        """Under the lock: append what the holder gained since the copy began to the last
        cleaned file and fsync it, then swap the cleaned files in."""
        holder_is_active = slot == len(self._segments) - 1
        buffer = bytearray()
        try:
            self._copy_tail(holder.fd, holder.path, copied_end, holder.size_bytes, pending[-1], last_fd, buffer)
            finished, last_fd = last_fd, -1
            self._finish_cleaned_file(finished, buffer)
        finally:
            if last_fd >= 0:
                os.close(last_fd)
        pending[-1].next_offset = holder.next_offset
        # The cleaned files may seal epochs that so far lived in the active segment (whose
        # epochs recovery takes from its scan, the sealed ones' from the checkpoint): the
        # checkpoint must hold them before the swap. Cleaning keeps every epoch boundary.
        self._write_epoch_checkpoint()
        new_bases = [segment.base_offset for segment in pending]
        old_bases = self._segment_bases[: slot + 1]
        self._cleaned_end = max(self._cleaned_end, clean_end)
        self._cleaner_end = max(self._cleaner_end, clean_end)
        self._write_start_checkpoint()
        self._failpoints.hit("segment.before_swap_marker")
        write_file_atomically(self._log_dir / SWAP_MARKER_NAME,
                              json.dumps({"old": old_bases, "new": new_bases}).encode())
        self._failpoints.hit("segment.before_swap")
        for segment in self._segments[: slot + 1]:
            if segment.fd >= 0:
                os.close(segment.fd)
            segment.fd = -1
        _swap_files(self._log_dir, old_bases, new_bases)
        self._failpoints.hit("segment.after_swap")
        (self._log_dir / SWAP_MARKER_NAME).unlink()
        fsync_directory(self._log_dir)
        for segment in pending:
            segment.fd = os.open(segment.path, os.O_RDWR | os.O_APPEND)
            segment.durable_bytes = segment.size_bytes
        following = self._segments[slot + 1 :]
        self._segments = pending + following
        self._segment_bases = new_bases + self._segment_bases[slot + 1 :]
        for index, segment in enumerate(self._segments[: len(pending)]):
            if index < len(self._segments) - 1:
                self._write_sealed_index(segment, self._segments[index + 1].base_offset)
        if holder_is_active:  # the active segment was rewritten and fsynced whole
            self._rewrite_active_index(self._segments[-1])
            self._flushed_offset = self._end_offset()

    def _write_cleaned_segments(self, batches: Sequence[Batch], holder_fd: int, holder_path: Path,
                                cut_position: int, copied_end: int, pending: list[_Segment]) -> int:
        """Write the cleaned batches, then the holder's untouched tail up to ``copied_end``, as
        ``*.cleaned`` files rolled at segment_bytes, appending the new segments (indexed, files
        not yet open) to ``pending``; every file is fsynced and closed but the last, whose fd
        is returned (the caller adds what the holder gained meanwhile, then fsyncs it).

        The first new segment is named by the log start offset even if its first record was
        cleaned away, so the log keeps starting where the checkpoint says. Bytes go out
        through a buffer of at most CLEANED_WRITE_BUFFER_BYTES. Runs without the lock: it
        reads only the cleaned batches and bytes of the holder below ``copied_end``.
        """
        buffer = bytearray()
        fd = -1
        start_offset = self._start_offset
        try:
            for batch in batches:
                data = encode_batch(batch)
                if not pending or (pending[-1].size_bytes > 0 and
                                   pending[-1].size_bytes + len(data) > self._segment_bytes):
                    if fd >= 0:
                        finished, fd = fd, -1
                        self._finish_cleaned_file(finished, buffer)
                    base = start_offset if not pending else batch.base_offset
                    pending.append(_Segment(base, _segment_path(self._log_dir, base), -1, 0, base))
                    fd = os.open(_cleaned_path(self._log_dir, base), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                segment = pending[-1]
                segment.add_index_entry(batch.base_offset, segment.size_bytes, self._index_interval_bytes)
                segment.size_bytes += len(data)
                segment.next_offset = batch.next_offset
                buffer += data
                if len(buffer) >= CLEANED_WRITE_BUFFER_BYTES:
                    write_all_parts(fd, (buffer,))
                    buffer.clear()
            self._copy_tail(holder_fd, holder_path, cut_position, copied_end, pending[-1], fd, buffer)
            write_all_parts(fd, (buffer,))
            os.fsync(fd)  # most of the last file: the fsync under the lock covers only the rest
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return fd

    def _copy_tail(self, source_fd: int, source_path: Path, start: int, end: int, segment: _Segment,
                   fd: int, buffer: bytearray) -> None:
        """Append the source segment's batches in [start, end) to ``segment`` (file ``fd``),
        indexing them, in bounded chunks."""
        position = start
        base_size = segment.size_bytes
        while position < end:
            data = _read_exact(source_fd, HEADER_BYTES, position)
            try:
                header = decode_header(data)
            except CorruptBatchError as exc:
                raise CorruptLogError(source_path, position, exc.reason, None) from exc
            segment.add_index_entry(header.base_offset, base_size + position - start, self._index_interval_bytes)
            position += header.total_bytes
        position = start
        while position < end:
            chunk = _read_exact(source_fd, min(READ_CHUNK_BYTES, end - position), position)
            buffer += chunk
            position += len(chunk)
            if len(buffer) >= CLEANED_WRITE_BUFFER_BYTES:
                write_all_parts(fd, (buffer,))
                buffer.clear()
        segment.size_bytes += end - start

    @staticmethod
    def _finish_cleaned_file(fd: int, buffer: bytearray) -> None:
        try:
            write_all_parts(fd, (buffer,))
            buffer.clear()
            os.fsync(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        for entry in os.listdir(self._log_dir):
            if entry.endswith(".tmp"):  # an atomic replace that never happened
                (self._log_dir / entry).unlink()
        finish_or_drop_swap(self._log_dir)
        checkpoint = read_log_start_checkpoint(self._log_dir)
        bases = list_segment_bases(self._log_dir)
        if checkpoint is not None:
            self._start_offset, self._snapshot_id = checkpoint.start_offset, checkpoint.snapshot_id
            self._cleaned_end = checkpoint.cleaned_end
            self._cleaner_end = checkpoint.cleaner_end
            below = [base for base in bases if base < self._start_offset]
            for base in below:  # a delete_before or reset_to_snapshot interrupted by a crash
                logger.info("deleting segment %s below the log start offset %d", base, self._start_offset)
                _segment_path(self._log_dir, base).unlink()
                _segment_path(self._log_dir, base).with_suffix(INDEX_SUFFIX).unlink(missing_ok=True)
                self._directory_dirty = True
            bases = bases[len(below):]
            if bases and bases[0] != self._start_offset:
                raise CorruptLogError(
                    _segment_path(self._log_dir, bases[0]), 0,
                    f"the log start offset is {self._start_offset} ({LOG_START_CHECKPOINT_NAME}) but the "
                    f"first segment starts at offset {bases[0]}: segment files are missing", None,
                    refetch_way_out(self._log_dir.parent))
        elif bases:
            self._start_offset = bases[0]
        self._delete_orphan_indexes(set(bases))
        for slot, base in enumerate(bases):
            is_last = slot == len(bases) - 1
            segment = self._open_segment(base, bases[slot + 1] if not is_last else None)
            self._segments.append(segment)
            self._segment_bases.append(base)
        if not self._segments:
            self._create_segment(self._start_offset)
        self._recover_epoch_entries()
        last = self._segments[-1]
        self._rewrite_active_index(last)
        os.fsync(last.fd)  # what recovery found becomes durable before anyone relies on it
        last.durable_bytes = last.size_bytes
        fsync_directory(self._log_dir)
        self._directory_dirty = False
        self._flushed_offset = self._end_offset()

    def _delete_orphan_indexes(self, bases: set[int]) -> None:
        for entry in os.listdir(self._log_dir):
            match = _INDEX_NAME.match(entry)
            if match and int(match.group(1)) not in bases:
                (self._log_dir / entry).unlink()
                self._directory_dirty = True

    def _open_segment(self, base: int, next_base: int | None) -> _Segment:
        path = _segment_path(self._log_dir, base)
        fd = os.open(path, os.O_RDWR | os.O_APPEND)
        size_bytes = os.fstat(fd).st_size
        segment = _Segment(base, path, fd, size_bytes, base, durable_bytes=size_bytes)
        try:
            if next_base is None:
                self._recover_last_segment(segment)
            else:
                self._open_sealed_segment(segment, next_base)
        except BaseException:
            os.close(fd)
            raise
        return segment

    def _open_sealed_segment(self, segment: _Segment, next_base: int) -> None:
        """Verify a sealed segment (or trust it through its index); rebuild a damaged index."""
        try:
            entries = _decode_index(segment.index_path.read_bytes())
        except FileNotFoundError:
            entries = None
        problem = self._sealed_index_problem(segment, next_base, entries)
        if self._verify_sealed_segments:
            scan = self._scan_sealed_segment(segment, next_base, keep_batch_positions=problem is None)
            for epoch, start_offset in scan.epoch_starts:
                if not self._sealed_segment_epochs or epoch > self._sealed_segment_epochs[-1][0]:
                    self._sealed_segment_epochs.append((epoch, start_offset))
            if problem is None and entries is not None:
                problem = _index_entries_not_batch_starts(entries[:-1], scan)
            self._adopt_scan(segment, scan)  # reads use the scan's index, right by construction
            if problem is not None:
                logger.warning("rebuilding index %s from its segment: %s", segment.index_path, problem)
                self._write_sealed_index(segment, next_base)
            return
        if problem is None and entries is not None:
            for offset, position in entries[:-1]:
                segment.index_offsets.append(offset)
                segment.index_positions.append(position)
            segment.last_indexed_position = entries[-2][1]
            segment.next_offset = next_base
            return
        logger.warning("rebuilding index %s from its segment: %s", segment.index_path, problem)
        self._adopt_scan(segment, self._scan_sealed_segment(segment, next_base))
        self._write_sealed_index(segment, next_base)

    def _scan_sealed_segment(self, segment: _Segment, next_base: int,
                             keep_batch_positions: bool = False) -> _ScanResult:
        """Scan a whole sealed segment; any bad batch is corruption, never a tail to cut."""
        scan = _scan_file(segment.fd, segment.size_bytes, segment.base_offset, self._index_interval_bytes,
                          self._cleaned_end, keep_batch_positions)
        if scan.error_position is not None:
            raise CorruptLogError(segment.path, scan.error_position,
                                  f"{scan.error_reason} (in a sealed segment, not the log's tail)",
                                  scan.next_offset)
        gap_allowed = scan.next_offset < next_base < self._cleaned_end
        if scan.next_offset != next_base and not gap_allowed:
            raise CorruptLogError(segment.path, segment.size_bytes,
                                  f"segment ends at offset {scan.next_offset} but the next segment starts "
                                  f"at offset {next_base}", scan.next_offset)
        return scan

    def _sealed_index_problem(self, segment: _Segment, next_base: int,
                              entries: list[tuple[int, int]] | None) -> str | None:
        if entries is None:
            return "missing, or its size is not a whole number of entries"
        if len(entries) < 2:
            return "fewer than two entries"
        if entries[0] != (segment.base_offset, 0):
            return f"first entry {entries[0]} is not ({segment.base_offset}, 0)"
        if entries[-1] != (next_base, segment.size_bytes):
            return f"last entry {entries[-1]} is not the end marker ({next_base}, {segment.size_bytes})"
        for before, after in zip(entries, entries[1:], strict=False):
            if after[0] <= before[0] or after[1] <= before[1]:
                return f"entries {before} and {after} do not increase"
        return None

    def _recover_last_segment(self, segment: _Segment) -> None:
        """Scan the last segment; cut a torn or corrupt tail, refuse corruption with data after it."""
        scan, tail = scan_last_segment(segment.fd, segment.path, segment.size_bytes, segment.base_offset,
                                       self._index_interval_bytes, self._cleaned_end)
        if tail is not None:
            logger.warning("cutting torn or corrupt tail of %s at byte %d (%s): dropped %d bytes",
                           segment.path, tail.valid_bytes, tail.reason, tail.dropped_bytes)
            os.ftruncate(segment.fd, tail.valid_bytes)
            segment.size_bytes = tail.valid_bytes
        self._adopt_scan(segment, scan)
        self._last_segment_epochs = scan.epoch_starts

    def _adopt_scan(self, segment: _Segment, scan: _ScanResult) -> None:
        segment.index_offsets = scan.index_offsets
        segment.index_positions = scan.index_positions
        segment.last_indexed_position = scan.last_indexed_position
        segment.next_offset = scan.next_offset

    def _recover_epoch_entries(self) -> None:
        """Epochs of sealed segments come from the checkpoint; the last segment's from its scan."""
        path = self._log_dir / EPOCH_CHECKPOINT_NAME
        last = self._segments[-1]
        try:
            entries: list[tuple[int, int]] | None = decode_epoch_checkpoint(path.read_bytes())
        except FileNotFoundError:
            entries = None
            problem = "missing"
        except ValueError as exc:
            entries = None
            problem = f"unreadable: {exc}"
        if self._verify_sealed_segments:
            # The scans saw the first held batch of each epoch. The checkpoint may name an
            # earlier start for an epoch (its first records were cleaned away): keep it then.
            sealed = self._sealed_segment_epochs
            held = [entry for entry in entries or [] if entry[1] < last.base_offset]
            consistent = [epoch for epoch, _ in held] == [epoch for epoch, _ in sealed] and all(
                checkpointed[1] <= scanned[1] for checkpointed, scanned in zip(held, sealed, strict=True))
            if entries is not None and not consistent:
                problem = "out of step with the segments"
            if (entries is None or not consistent) and len(self._segments) > 1:
                logger.warning("%s is %s; rebuilt it from the segments", path, problem)
            recovered = held if entries is not None and consistent else list(sealed)
        else:
            if entries is None:
                if len(self._segments) > 1:
                    logger.warning("%s is %s; rebuilding it from the sealed segments", path, problem)
                entries = self._epochs_of_sealed_segments()
            recovered = [entry for entry in entries if entry[1] < last.base_offset]
        for epoch, start_offset in self._last_segment_epochs:
            if not recovered or epoch > recovered[-1][0]:
                recovered.append((epoch, start_offset))
        self._epoch_entries = recovered
        self._clamp_epoch_entries_to_start()
        if self._epoch_entries != entries:
            self._write_epoch_checkpoint()

    def _epochs_of_sealed_segments(self) -> list[tuple[int, int]]:
        entries: list[tuple[int, int]] = []
        for segment in self._segments[:-1]:
            scan = _scan_file(segment.fd, segment.size_bytes, segment.base_offset, self._index_interval_bytes,
                              self._cleaned_end)
            if scan.error_position is not None:
                raise CorruptLogError(segment.path, scan.error_position, scan.error_reason, scan.next_offset)
            for epoch, start_offset in scan.epoch_starts:
                if not entries or epoch > entries[-1][0]:
                    entries.append((epoch, start_offset))
        return entries
