"""Pure decoding of segment bytes and snapshot bytes into plain row tuples.

No Spark here: Spark tasks call these functions on the files they were given, and the
benchmark's single-process reader calls the very same functions, so the two paths decode
identically. The batch format itself is storage/batch_codec.py's (shared, never copied);
the application records are storage/commands.py's.
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

import crc32c
import msgpack
import pyarrow as pa

from pipeline.errors import PipelineInputError
from raft.types import check, decode_control_record
from storage.batch_codec import (
    FORMAT_VERSION,
    CorruptBatchError,
    TruncatedBatchError,
    decode_batch,
)
from storage.commands import CommandDecodeError, OpKind, decode_command

SEGMENT_NAME = re.compile(r"^(\d{20})\.log$")
SNAPSHOT_NAME = re.compile(r"^(\d{20})-(\d{10})\.snapshot$")
SNAPSHOT_TRAILER = struct.Struct(">8sIQ")
SNAPSHOT_MAGIC = b"MKVSNAP1"
RESYNC_MAX_SCAN_BYTES = 64 * 1024 * 1024  # a skip never searches further than one max batch

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
ARROW_BATCH_ROWS = 65_536  # bound on the rows one Arrow batch handed back to Spark holds


def rows_to_arrow(rows: Iterator[EntryRow], batch_rows: int = ARROW_BATCH_ROWS) -> Iterator[pa.RecordBatch]:
    """Column batches of at most ``batch_rows`` rows: Arrow moves them to the JVM in bulk,
    far cheaper than pickling one Python tuple per row."""
    width = len(ENTRY_COLUMNS)
    while True:
        chunk = []
        for row in rows:
            chunk.append(row)
            if len(chunk) == batch_rows:
                break
        if not chunk:
            return
        columns = list(zip(*chunk, strict=True)) if chunk else [()] * width
        yield pa.RecordBatch.from_arrays(
            [pa.array(column, type=field.type) for column, field in zip(columns, ENTRY_ARROW_SCHEMA, strict=True)],
            schema=ENTRY_ARROW_SCHEMA)
        if len(chunk) < batch_rows:
            return


def segment_base_offset(name: str) -> int | None:
    match = SEGMENT_NAME.match(name)
    return int(match.group(1)) if match else None


def _record_rows(node: str, segment: str, position: int, batch_bytes: int, offset: int, epoch: int,
                 timestamp_ms: int, control: bool, record: bytes) -> list[EntryRow]:
    digest = hashlib.blake2b(record, digest_size=12).hexdigest()
    head = (node, segment, position, batch_bytes, offset, epoch, timestamp_ms, control, len(record), digest)
    if control:
        try:
            control_type = str(decode_control_record(record)["type"])
        except Exception as exc:
            raise PipelineInputError(
                f"{node}/log/{segment}: control record at offset {offset} (batch at byte {position}) "
                f"cannot be decoded: {exc}") from exc
        return [(*head, False, None, None, 0, None, "control", None, None, None, None, control_type, None)]
    try:
        command = decode_command(record)
    except CommandDecodeError as exc:
        raise PipelineInputError(
            f"{node}/log/{segment}: record at offset {offset} (batch at byte {position}): {exc}") from exc
    compares = (msgpack.packb([[c.key, int(c.kind), c.target] for c in command.compare], use_bin_type=True)
                if command.compare else None)
    compare_keys = sorted({c.key for c in command.compare}) if command.compare else None
    txn = bool(command.compare) or len(command.success) != 1 or bool(command.failure)
    rows: list[EntryRow] = []
    for branch, ops in (("success", command.success), ("failure", command.failure)):
        for op in ops:
            value = op.value if op.kind == OpKind.PUT else None
            content_type = op.content_type if op.kind == OpKind.PUT else None
            rows.append((*head, txn, compares, compare_keys, len(rows), branch, OPERATION_NAMES[op.kind], op.key, value,
                         content_type, op.create_version or None, None, None))
    if not rows:
        rows.append((*head, txn, compares, compare_keys, 0, None, "none", None, None, None, None, None, None))
    return rows


def _resync(data: bytes, start: int, min_base_offset: int) -> int:
    """The next position at or after ``start`` where a whole valid batch begins, else len(data)."""
    limit = min(len(data), start + RESYNC_MAX_SCAN_BYTES)
    position = start
    while position < limit:
        position = data.find(bytes([FORMAT_VERSION]), position + 4, limit) - 4
        if position < start:
            return len(data)
        try:
            batch, _ = decode_batch(data, position)
            if batch.base_offset >= min_base_offset:
                return position
        except CorruptBatchError:
            pass
        position += 1
    return len(data)


def decode_segment(node: str, segment: str, data: bytes, skip_corrupt: bool) -> Iterator[EntryRow]:
    """Every row of one segment file, CRCs verified. A corrupt or truncated batch raises
    PipelineInputError naming the file and byte position, or with ``skip_corrupt`` is
    skipped up to the next valid batch and reported as one "skipped" row."""
    base_offset = segment_base_offset(segment)
    check(base_offset is not None, f"not a segment file name: {segment}")
    expected_offset = base_offset or 0
    position = 0
    while position < len(data):
        try:
            batch, end = decode_batch(data, position)
            if batch.base_offset < expected_offset:
                raise CorruptBatchError(
                    position, f"base offset {batch.base_offset} below the expected {expected_offset}")
        except CorruptBatchError as exc:
            if "unknown batch format version" in exc.reason and not skip_corrupt:
                raise PipelineInputError(f"{node}/log/{segment}: {exc.reason} at byte {position}") from exc
            if not skip_corrupt:
                kind = "truncated" if isinstance(exc, TruncatedBatchError) else "corrupt"
                raise PipelineInputError(
                    f"{node}/log/{segment}: {kind} batch at byte {position}: {exc.reason} "
                    f"(rerun with --skip-corrupt to skip it)") from exc
            next_position = _resync(data, position + 1, expected_offset)
            yield (node, segment, position, next_position - position, None, None, None, None, None, None,
                   None, None, None, None, None, "skipped", None, None, None, None, None, exc.reason)
            position = next_position
            continue
        batch_bytes = end - position
        for index, record in enumerate(batch.records):
            yield from _record_rows(node, segment, position, batch_bytes, batch.base_offset + index, batch.epoch,
                                    batch.timestamp_ms, batch.control, record)
        expected_offset = batch.next_offset
        position = end


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
