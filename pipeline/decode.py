"""Pure decoding of segment bytes and snapshot bytes into plain row tuples.

No Spark here: Spark tasks call these functions on the files they were given, and the
benchmark's single-process reader calls the very same functions, so the two paths decode
identically. The batch format itself is storage/batch_codec.py's (shared, never copied);
the application records are storage/commands.py's.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import crc32c
import msgpack
import pyarrow as pa

from pipeline.errors import PipelineInputError
from raft.types import Batch, decode_control_record
from storage.batch_codec import (
    FORMAT_VERSION,
    HEADER_BYTES,
    CorruptBatchError,
    TruncatedBatchError,
    decode_batch,
    decode_header,
)
from storage.commands import CommandDecodeError, OpKind, decode_command_parts
from storage.segment_files import INDEX_ENTRY, SEGMENT_NAME
from storage.snapshot_store import TRAILER as SNAPSHOT_TRAILER
from storage.snapshot_store import TRAILER_MAGIC as SNAPSHOT_MAGIC

RESYNC_MAX_SCAN_BYTES = 64 * 1024 * 1024  # a skip never searches further than one max batch
RESYNC_FIRST_STEP_BYTES = 4096  # a scan for the next batch reads this much first (batches are small),
RESYNC_MAX_STEP_BYTES = 1024 * 1024  # doubling up to this much per read

OPERATION_NAMES = {OpKind.PUT: "put", OpKind.DELETE: "delete", OpKind.GET: "get"}

# One row per operation of every record (a record with no operation still gets one row, so
# every record is counted); control records get operation "control"; a corrupt stretch
# skipped under --skip-corrupt gets one row with operation "skipped".
ENTRY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("node", "string"),
    ("segment", "string"),
    ("batch_position", "long"),
    ("batch_bytes", "long"),
    ("offset", "long"),
    ("epoch", "int"),
    ("timestamp_ms", "long"),
    ("control", "boolean"),
    ("record_bytes", "long"),
    ("record_digest", "string"),
    ("txn", "boolean"),
    ("compares", "binary"),
    ("compare_keys", "array<string>"),
    ("op_index", "int"),
    ("branch", "string"),
    ("operation", "string"),
    ("key", "string"),
    ("value", "binary"),
    ("content_type", "string"),
    ("create_version", "long"),
    ("control_type", "string"),
    ("error", "string"),
)

EntryRow = tuple[Any, ...]

_ARROW_TYPES = {"string": pa.string(), "long": pa.int64(), "int": pa.int32(), "boolean": pa.bool_(),
                "binary": pa.binary(), "array<string>": pa.list_(pa.string())}
ENTRY_ARROW_SCHEMA = pa.schema([pa.field(name, _ARROW_TYPES[kind]) for name, kind in ENTRY_COLUMNS])
CHUNK_ROWS = 65_536  # bound on the rows one chunk (and so one Arrow batch for Spark) holds
_OPERATION_BY_KIND = {int(kind): name for kind, name in OPERATION_NAMES.items()}
_PUT = int(OpKind.PUT)
_SKIPPED_TAIL = (None,) * 11  # offset .. branch of a "skipped" row


def rows_to_arrow(rows: list[EntryRow]) -> pa.RecordBatch:
    """One Arrow batch of a chunk of rows: Arrow moves it to the JVM in bulk, far cheaper
    than pickling one Python tuple per row. Runs with the cyclic collector paused, like the
    decoder (see collector_paused)."""
    with collector_paused():
        columns = [[row[index] for row in rows] for index in range(len(ENTRY_COLUMNS))]
        return pa.RecordBatch.from_arrays(
            [pa.array(column, type=field.type) for column, field in zip(columns, ENTRY_ARROW_SCHEMA, strict=True)],
            schema=ENTRY_ARROW_SCHEMA)


def segment_base_offset(name: str) -> int | None:
    match = SEGMENT_NAME.match(name)
    return int(match.group(1)) if match else None


class _ChunkWriter:
    """Collects rows and hands out chunks of at most CHUNK_ROWS rows."""

    def __init__(self, node: str, segment: str) -> None:
        self.node, self.segment = node, segment
        self.rows: list[EntryRow] = []

    def take(self) -> list[EntryRow]:
        chunk, self.rows = self.rows, []
        return chunk

    def skipped(self, position: int, skipped_bytes: int, reason: str) -> None:
        self.rows.append((self.node, self.segment, position, skipped_bytes, *_SKIPPED_TAIL,
                          "skipped", None, None, None, None, None, reason))

    def batch(self, position: int, batch_bytes: int, batch: Batch) -> None:
        """Every row of one decoded batch (CRC already checked by decode_batch)."""
        node, segment, epoch, timestamp_ms, control = self.node, self.segment, batch.epoch, batch.timestamp_ms, batch.control
        append = self.rows.append
        blake2b = hashlib.blake2b
        offset = batch.base_offset - 1
        for record in batch.records:
            offset += 1
            head = (node, segment, position, batch_bytes, offset, epoch, timestamp_ms, control, len(record),
                    blake2b(record, digest_size=12).hexdigest())
            if control:
                append((*head, False, None, None, 0, None, "control", None, None, None, None,
                        _control_type(node, segment, position, offset, record), None))
                continue
            for tail in _command_rows(node, segment, position, offset, record):
                append(head + tail)


def _control_type(node: str, segment: str, position: int, offset: int, record: bytes) -> str:
    try:
        return str(decode_control_record(record)["type"])
    except Exception as exc:
        raise PipelineInputError(
            f"{node}/log/{segment}: control record at offset {offset} (batch at byte {position}) "
            f"cannot be decoded: {exc}") from exc


def _command_rows(node: str, segment: str, position: int, offset: int, record: bytes) -> list[tuple[Any, ...]]:
    """The per-operation part of a record's rows (txn .. error), from the shared decoder's
    validated lists."""
    try:
        compares, success, failure = decode_command_parts(record)
    except CommandDecodeError as exc:
        raise PipelineInputError(
            f"{node}/log/{segment}: record at offset {offset} (batch at byte {position}): {exc}") from exc
    if compares:
        packed = msgpack.packb([[c[0], int(c[1]), c[2]] for c in compares], use_bin_type=True)
        compare_keys: list[str] | None = sorted({c[0] for c in compares})
        txn = True
    else:
        packed, compare_keys, txn = None, None, len(success) != 1 or bool(failure)
    rows: list[tuple[Any, ...]] = []
    for branch, ops in (("success", success), ("failure", failure)):
        for op in ops:
            kind = int(op[0])
            if kind == _PUT:
                rows.append((txn, packed, compare_keys, len(rows), branch, "put", op[1], op[2], op[3],
                             (op[4] if len(op) > 4 else 0) or None, None, None))
            else:
                rows.append((txn, packed, compare_keys, len(rows), branch, _OPERATION_BY_KIND[kind], op[1], None,
                             None, None, None, None))
    if not rows:
        rows.append((txn, packed, compare_keys, 0, None, "none", None, None, None, None, None, None))
    return rows


# --- reading a byte range of a segment --------------------------------------------------------
#
# Hadoop-style splits: a task owns the batches whose *start* lies in its byte range
# [start, end). It reads past ``end`` to finish its last batch. A range that does not start
# at byte 0 first finds where the batch chain crosses ``start``: from the nearest entry of
# the segment's offset index at or below ``start`` (storage's .index: every entry is a batch
# start) it steps batch by batch, exactly as the decoder does, CRCs included; without a usable
# index it scans forward from ``start`` for the first position where a whole valid batch
# begins (header sanity checks and CRC32C). Corruption is reported by the task owning the
# batch *before* it (it checks the batch at its chain's end even when that lies past
# ``end``), or by the range starting at byte 0 for the first batch of the file, so every
# corrupt region is reported exactly once, wherever the ranges cut.


ReadAt = Callable[[int, int], bytes]  # (position, size) -> at most size bytes of the file


class _Window:
    """The bytes of one segment file a task has read: one contiguous stretch, grown forward
    on demand (a batch crossing the range end, a resync scan)."""

    def __init__(self, read_at: ReadAt, file_bytes: int) -> None:
        self.read_at, self.file_bytes = read_at, file_bytes
        self.origin = 0
        self.data = b""

    def cover(self, position: int, size: int) -> None:
        """Make ``data`` hold [position, position + size) (clipped at the file's end)."""
        stop = min(self.file_bytes, position + size)
        have_stop = self.origin + len(self.data)
        if self.origin <= position and stop <= have_stop:
            return
        if self.origin <= position <= have_stop and self.data:
            self.data += self.read_at(have_stop, stop - have_stop)
        else:
            self.origin, self.data = position, self.read_at(position, stop - position)

    def batch_at(self, position: int) -> tuple[Batch, int]:
        """decode_batch at a file position, reading more of the file when the batch runs past
        what is held; TruncatedBatchError only when the file itself ends inside it."""
        while True:
            self.cover(position, HEADER_BYTES)
            try:
                batch, end = decode_batch(self.data, position - self.origin)
                return batch, end + self.origin
            except TruncatedBatchError:
                held_stop = self.origin + len(self.data)
                if held_stop >= self.file_bytes:
                    raise
                needed = decode_header(self.data, position - self.origin).total_bytes  # raises if insane
                if position + needed <= held_stop:
                    raise
                self.cover(position, needed)
                if self.origin + len(self.data) <= held_stop:  # the file shrank under us
                    raise


@dataclass(frozen=True, slots=True)
class _Step:
    """One decoder step at ``position``: a valid batch, or a corrupt stretch up to ``next_position``."""

    position: int
    next_position: int
    batch: Batch | None
    error: CorruptBatchError | None


def _step(window: _Window, position: int, expected_offset: int) -> _Step:
    try:
        batch, end = window.batch_at(position)
        if batch.base_offset < expected_offset:
            raise CorruptBatchError(position, f"base offset {batch.base_offset} below the expected {expected_offset}")
    except CorruptBatchError as exc:
        return _Step(position, _resync(window, position + 1, expected_offset), None, exc)
    return _Step(position, end, batch, None)


def _resync(window: _Window, start: int, min_base_offset: int) -> int:
    """The next position at or after ``start`` where a whole valid batch begins (base offset
    not below ``min_base_offset``), else the file's end."""
    limit = min(window.file_bytes, start + RESYNC_MAX_SCAN_BYTES)
    magic = bytes([FORMAT_VERSION])
    position = start
    step_bytes = RESYNC_FIRST_STEP_BYTES
    while position < limit:
        stop = min(limit, position + step_bytes)
        step_bytes = min(RESYNC_MAX_STEP_BYTES, step_bytes * 2)
        window.cover(position, stop - position + 4)
        found = window.data.find(magic, position + 4 - window.origin, stop + 4 - window.origin)
        if found < 0:
            position = stop
            continue
        candidate = found + window.origin - 4
        try:
            batch, _ = window.batch_at(candidate)
            if batch.base_offset >= min_base_offset:
                return candidate
        except CorruptBatchError:
            pass
        position = candidate + 1
    return window.file_bytes


def _raise_corrupt(node: str, segment: str, position: int, exc: CorruptBatchError) -> None:
    if "unknown batch format version" in exc.reason:
        raise PipelineInputError(f"{node}/log/{segment}: {exc.reason} at byte {position}") from exc
    kind = "truncated" if isinstance(exc, TruncatedBatchError) else "corrupt"
    raise PipelineInputError(f"{node}/log/{segment}: {kind} batch at byte {position}: {exc.reason} "
                             "(rerun with --skip-corrupt to skip it)") from exc


def _first_owned(window: _Window, start: int, base_offset: int, index_entries: list[tuple[int, int]],
                 ) -> tuple[int, int]:
    """(position, expected base offset) of the first batch start at or after ``start`` that
    the decoder's own chain reaches; a corrupt batch on the way is stepped over exactly as
    the decoder would (its owner reports it)."""
    entry = _index_entry_below(window, start, base_offset, index_entries)
    if entry is None:  # no usable index: scan for the first whole valid batch
        return _resync(window, start, base_offset), base_offset
    position, expected = entry
    while position < start:
        step = _step(window, position, expected)
        if step.batch is not None:
            expected = step.batch.next_offset
        position = step.next_position
    return position, expected


def _index_entry_below(window: _Window, start: int, base_offset: int,
                       index_entries: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The last index entry at or below ``start`` that really is a valid batch start."""
    candidates = [(p, o) for o, p in index_entries if p <= start and p < window.file_bytes and o >= base_offset]
    for position, offset in reversed(candidates[-2:]):
        try:
            batch, _ = window.batch_at(position)
        except CorruptBatchError:
            continue
        if batch.base_offset == offset:
            return position, offset
    return None


def decode_index(data: bytes) -> list[tuple[int, int]]:
    """(offset, position) entries of a storage .index file, in position order; [] when the
    file is not a well-formed index (the reader then scans instead)."""
    if len(data) % INDEX_ENTRY.size:
        return []
    entries = [INDEX_ENTRY.unpack_from(data, at) for at in range(0, len(data), INDEX_ENTRY.size)]
    if any(b[1] <= a[1] or b[0] <= a[0] for a, b in zip(entries, entries[1:], strict=False)):
        return []
    return entries


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a bulk step. Why: decoding allocates
    millions of small acyclic containers (msgpack lists, row tuples), and every automatic
    collection traverses every row a chunk already holds; that work grows with the chunk and
    cost about a third of the decode time (and most of the Arrow conversion). Nothing built
    here forms a cycle, so reference counting frees all of it anyway."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _collector_paused(chunks: Iterator[list[EntryRow]]) -> Iterator[list[EntryRow]]:
    """Run the decoder with the collector paused, and give it back to the caller between chunks."""
    while True:
        with collector_paused():
            chunk = next(chunks, None)
        if chunk is None:
            return
        yield chunk


def decode_range(node: str, segment: str, read_at: ReadAt, file_bytes: int, start: int, end: int,
                 skip_corrupt: bool, index_entries: list[tuple[int, int]] | None = None) -> Iterator[list[EntryRow]]:
    """Chunks of the rows of the batches whose start lies in [start, end) of one segment
    file (see the comment above). Decoding runs with the cyclic collector paused."""
    return _collector_paused(_decode_range(node, segment, read_at, file_bytes, start, end, skip_corrupt,
                                           index_entries or []))


def _decode_range(node: str, segment: str, read_at: ReadAt, file_bytes: int, start: int, end: int,
                  skip_corrupt: bool, index_entries: list[tuple[int, int]]) -> Iterator[list[EntryRow]]:
    """Chunks of the rows of the batches whose start lies in [start, end) of one
    segment file, CRCs verified. A corrupt or truncated batch raises PipelineInputError
    naming the file and byte position, or with ``skip_corrupt`` is skipped up to the next
    valid batch and reported as one "skipped" row (by exactly one range)."""
    base_offset = segment_base_offset(segment)
    if base_offset is None:
        raise PipelineInputError(f"{node}/log/{segment}: not a segment file name (<base_offset:020d>.log)")
    end = min(end, file_bytes)
    window = _Window(read_at, file_bytes)
    if start == 0:
        position, expected = 0, base_offset
    else:
        position, expected = _first_owned(window, start, base_offset, index_entries)
    if position >= end:
        return
    window.cover(position, end - position + HEADER_BYTES)
    out = _ChunkWriter(node, segment)
    last_was_batch = False
    follows_other_range = start > 0  # a corrupt first position is reported by the owner of the batch before it
    while position < file_bytes and (position < end or last_was_batch):
        step = _step(window, position, expected)
        if position >= end and step.error is None:  # the batch after our last one: only its corruption is ours
            break
        if step.error is not None and follows_other_range:
            pass
        elif step.error is not None:
            if not skip_corrupt:
                _raise_corrupt(node, segment, position, step.error)
            out.skipped(position, step.next_position - position, step.error.reason)
            last_was_batch = False
        elif step.batch is not None:
            out.batch(position, step.next_position - position, step.batch)
            expected = step.batch.next_offset
            last_was_batch = True
        position = step.next_position
        follows_other_range = False
        if len(out.rows) >= CHUNK_ROWS:
            yield out.take()
    if out.rows:
        yield out.take()


def decode_segment_chunks(node: str, segment: str, data: bytes, skip_corrupt: bool) -> Iterator[list[EntryRow]]:
    """Row chunks of a whole segment file held in memory (one range over all of it)."""
    return decode_range(node, segment, lambda position, size: data[position:position + size], len(data), 0,
                        len(data), skip_corrupt)


def decode_segment(node: str, segment: str, data: bytes, skip_corrupt: bool) -> Iterator[EntryRow]:
    """Every row of one segment file (ENTRY_COLUMNS order)."""
    for chunk in decode_segment_chunks(node, segment, data, skip_corrupt):
        yield from chunk


# --- snapshots and state.db -----------------------------------------------------------------

def snapshot_database_bytes(name: str, data: bytes) -> bytes:
    """The SQLite bytes inside a snapshot file, after checking its trailer and CRC."""
    if len(data) < SNAPSHOT_TRAILER.size:
        raise PipelineInputError(f"snapshot {name}: truncated ({len(data)} bytes, no trailer)")
    magic, crc, length = SNAPSHOT_TRAILER.unpack_from(data, len(data) - SNAPSHOT_TRAILER.size)
    if magic != SNAPSHOT_MAGIC:
        raise PipelineInputError(f"snapshot {name}: not a metakv snapshot (trailer magic {magic!r})")
    if length != len(data) - SNAPSHOT_TRAILER.size:
        raise PipelineInputError(
            f"snapshot {name}: truncated (trailer says {length} database bytes, file holds "
            f"{len(data) - SNAPSHOT_TRAILER.size})")
    database = data[:length]
    if crc32c.crc32c(database) != crc:
        raise PipelineInputError(f"snapshot {name}: CRC32C mismatch over the database bytes")
    return database


def query_sqlite_bytes(files: dict[str, bytes], query_fn: Any) -> Any:
    """Open a private copy of a SQLite database (``files`` maps suffix "" / "-wal" to bytes),
    run ``query_fn(connection)`` and return its result. A copy, so a live node's database
    is never touched (closing a WAL database checkpoints it)."""
    with tempfile.TemporaryDirectory(prefix="metakv-pipeline-") as directory:
        path = os.path.join(directory, "state.db")
        for suffix, payload in files.items():
            with open(path + suffix, "wb") as handle:
                handle.write(payload)
        connection = sqlite3.connect(path)
        try:
            return query_fn(connection)
        finally:
            connection.close()
