"""Scanning a segment file batch by batch: what recovery on open and ``metakv repair
--verify`` both judge the log by, and the checks of an offset index against its segment.

Every batch is checked (header, CRC32C, offsets continuing from the previous batch except
for jumps below the cleaned end, epochs not decreasing); the scan stops at the first bad
one. Only the last segment may end in a torn tail (``scan_last_segment``): every sealed
one was fsynced before the next was created.
"""

from __future__ import annotations

import bisect
import os
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path

import crc32c

from raft.types import check
from storage.batch_codec import (
    CRC_START,
    FORMAT_VERSION,
    HEADER_BYTES,
    BatchHeader,
    CorruptBatchError,
    TruncatedBatchError,
    decode_header,
)
from storage.segment_files import DEFAULT_INDEX_INTERVAL_BYTES, CorruptLogError, read_exact

SCAN_CHUNK_BYTES = 8 * 1024 * 1024  # bound on the buffer recovery scans a segment through


@dataclass(slots=True)
class ScanResult:
    """What a scan found: the valid prefix, its index and epoch changes, the first bad batch."""

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


def _accept_batch(result: ScanResult, header: BatchHeader, position: int, end: int,
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


def scan_segment_file(fd: int, size_bytes: int, base_offset: int, index_interval_bytes: int,
               cleaned_end: int = 0, keep_batch_positions: bool = False) -> ScanResult:
    """Walk every batch of a segment file, checking headers, CRCs and offsets; stop at the first bad one.

    Reads through one reused buffer of at most SCAN_CHUNK_BYTES (a batch larger than that is
    read on its own), so recovery reads the log once without holding a segment in memory.
    """
    result = ScanResult(0, base_offset, array("Q"), array("Q"), -1, [])
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
                       result: ScanResult) -> tuple[BatchHeader | None, int]:
    """Check a batch larger than the scan buffer by reading it whole; (None, 0) records an error."""
    try:
        header = decode_header(read_exact(fd, HEADER_BYTES, position))
        data = read_exact(fd, min(header.total_bytes, size_bytes - position), position)
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
                      cleaned_end: int = 0) -> tuple[ScanResult, TornTail | None]:
    """The recovery rule for the last segment, shared by opening a log and ``metakv repair --verify``.

    At the first bad batch: if no valid batch (good CRC, offset at or above the expected one)
    follows anywhere in the rest of the file, the rest is a torn tail (returned, not cut here);
    otherwise it is corruption in the middle and raises CorruptLogError. Only the last segment
    can have a torn tail: every sealed one was fsynced before the next was created.
    """
    scan = scan_segment_file(fd, size_bytes, base_offset, index_interval_bytes, cleaned_end)
    if scan.error_position is None:
        return scan, None
    rest = read_exact(fd, size_bytes - scan.error_position, scan.error_position)
    found = _find_good_batch_after(rest, 0, scan.next_offset)
    if found is not None:
        raise CorruptLogError(
            path, scan.error_position,
            f"{scan.error_reason}, yet a valid batch follows at byte {scan.error_position + found}: "
            "this is not a torn tail", scan.next_offset)
    return scan, TornTail(path, scan.valid_bytes, size_bytes - scan.valid_bytes, scan.next_offset,
                          scan.error_reason)


def index_entries_not_batch_starts(entries: list[tuple[int, int]], scan: ScanResult) -> str | None:
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


def sealed_index_problem(base_offset: int, size_bytes: int, next_base: int,
                         entries: list[tuple[int, int]] | None) -> str | None:
    """Why a sealed segment's index file cannot be trusted without a scan, or None."""
    if entries is None:
        return "missing, or its size is not a whole number of entries"
    if len(entries) < 2:
        return "fewer than two entries"
    if entries[0] != (base_offset, 0):
        return f"first entry {entries[0]} is not ({base_offset}, 0)"
    if entries[-1] != (next_base, size_bytes):
        return f"last entry {entries[-1]} is not the end marker ({next_base}, {size_bytes})"
    for before, after in zip(entries, entries[1:], strict=False):
        if after[0] <= before[0] or after[1] <= before[1]:
            return f"entries {before} and {after} do not increase"
    return None
