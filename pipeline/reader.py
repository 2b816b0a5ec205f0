"""metakv data directories -> Spark DataFrames.

Inputs are node data directories (``<dir>/log``, ``<dir>/snapshots``, ``<dir>/state.db``;
layout in docs/pipeline.md), or a directory whose children are data directories (the
``./data`` of ``metakv cluster up``). The driver only lists directories (through Hadoop's
FileSystem API); every byte of every file is read by Spark tasks through ``binaryFiles``,
so the same code runs on ``local[*]`` and on a cluster reading a shared file system.

Parallelism is by byte range, Hadoop-style: every segment file is cut into ranges of at
most ``split_bytes`` (a task owns the batches whose start lies in its range, see
pipeline/decode.py), and ranges are packed into Spark partitions of about ``split_bytes``,
so a log of a few big segments still keeps every core busy and a log of many small
segments is not one task per file. Tasks read their byte ranges themselves through
pyarrow's file systems (local or shared paths, HDFS, S3, GCS), every CRC checked.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from pipeline.decode import (
    ENTRY_COLUMNS,
    decode_index,
    decode_range,
    query_sqlite_bytes,
    rows_to_arrow,
    segment_base_offset,
    snapshot_database_bytes,
)
from pipeline.errors import PipelineInputError
from pipeline.fs import Entry, HadoopFS, qualify
from raft.types import check
from storage import state_schema
from storage.snapshot_store import SNAPSHOT_NAME

DATA_DIR_MARKERS = ("log", "snapshots", "state.db", "quorum-state")
STATE_DB = "state.db"
LOG_START_CHECKPOINT = "log-start-checkpoint"
MAX_SPLIT_BYTES = 16 * 1024 * 1024  # largest byte range (and partition) a task decodes
MIN_SPLIT_BYTES = 1024 * 1024  # smaller inputs are not cut finer: a task's start-up costs more
RANGES_PER_CORE = 4  # aim for this many partitions per core, so one slow task does not idle the rest

_TYPES: dict[str, DataType] = {
    "string": StringType(), "long": LongType(), "int": IntegerType(),
    "boolean": BooleanType(), "binary": BinaryType(), "array<string>": ArrayType(StringType()),
}
ENTRY_SCHEMA = StructType([StructField(name, _TYPES[kind], True) for name, kind in ENTRY_COLUMNS])
SNAPSHOT_SCHEMA = StructType([
    StructField("node", StringType(), False),
    StructField("snapshot_end_offset", LongType(), False),
    StructField("snapshot_epoch", IntegerType(), False),
    StructField("key", StringType(), False),
    StructField("value", BinaryType(), True),
    StructField("content_type", StringType(), True),
    StructField("mod_version", LongType(), False),
    StructField("create_version", LongType(), False),
])


@dataclass(frozen=True, slots=True)
class NodeDir:
    """One node's data directory as the driver listed it."""

    node: str
    uri: str
    segments: tuple[Entry, ...]
    snapshots: tuple[Entry, ...]  # newest last
    state_files: tuple[Entry, ...]  # state.db and, when present, state.db-wal
    indexes: tuple[Entry, ...] = ()  # log/<base>.index files (offset index of the segment of that name)
    log_start_checkpoint: Entry | None = None  # log/log-start-checkpoint (start offset, cleaned end)

    def snapshot_id(self, entry: Entry) -> tuple[int, int]:
        match = SNAPSHOT_NAME.match(entry.name)
        if match is None:
            raise PipelineInputError(f"{self.node}: snapshot file name {entry.name} is not <end>-<epoch>.snapshot")
        return int(match.group(1)), int(match.group(2))


def _looks_like_data_dir(entries: list[Entry]) -> bool:
    return any(e.name in DATA_DIR_MARKERS for e in entries)


def _node_dir(fs: HadoopFS, node: str, uri: str, entries: list[Entry]) -> NodeDir:
    names = {e.name: e for e in entries}
    segments: list[Entry] = []
    indexes: list[Entry] = []
    checkpoint: Entry | None = None
    if "log" in names and names["log"].is_dir:
        for entry in fs.list(names["log"].uri):
            if entry.name.endswith(".log"):
                if segment_base_offset(entry.name) is None:
                    raise PipelineInputError(f"{node}: {entry.name} in log/ is not named <base_offset:020d>.log")
                segments.append(entry)
            elif entry.name.endswith(".index") and not entry.is_dir:
                indexes.append(entry)
            elif entry.name == LOG_START_CHECKPOINT and not entry.is_dir:
                checkpoint = entry
    snapshots: list[Entry] = []
    if "snapshots" in names and names["snapshots"].is_dir:
        snapshots = [e for e in fs.list(names["snapshots"].uri) if e.name.endswith(".snapshot")]
    state_files = tuple(names[n] for n in (STATE_DB, STATE_DB + "-wal") if n in names and not names[n].is_dir)
    found = NodeDir(node, uri, tuple(segments), tuple(snapshots), state_files, tuple(indexes), checkpoint)
    if not segments and not snapshots and not state_files:
        raise PipelineInputError(f"{uri}: metakv data dir without log segments, snapshots or state.db")
    return found


def discover(fs: HadoopFS, inputs: Iterable[str]) -> list[NodeDir]:
    """Every node data directory under ``inputs``; PipelineInputError when there is none."""
    nodes: list[NodeDir] = []
    for raw in inputs:
        uri = qualify(raw).rstrip("/")
        if not fs.exists(uri):
            raise PipelineInputError(f"{raw}: no such directory")
        if not fs.is_dir(uri):
            raise PipelineInputError(f"{raw}: not a directory")
        entries = fs.list(uri)
        if not entries:
            raise PipelineInputError(f"{raw}: empty directory")
        if _looks_like_data_dir(entries):
            nodes.append(_node_dir(fs, uri.rsplit("/", 1)[1], uri, entries))
            continue
        children = [e for e in entries if e.is_dir and _looks_like_data_dir(fs.list(e.uri))]
        if not children:
            raise PipelineInputError(
                f"{raw}: not a metakv data dir (no log/, snapshots/ or state.db, here or one level down)")
        nodes.extend(_node_dir(fs, e.name, e.uri, fs.list(e.uri)) for e in children)
    names = [n.node for n in nodes]
    if len(set(names)) != len(names):
        nodes = [NodeDir(n.uri, n.uri, n.segments, n.snapshots, n.state_files, n.indexes, n.log_start_checkpoint)
                 for n in nodes]
    return nodes


def _normalized(uri: str) -> str:
    """binaryFiles may spell a URI differently from the listing (file:/x vs file:///x)."""
    return "/" + uri.split(":", 1)[-1].lstrip("/") if ":" in uri else uri


def _lookup(owners: dict[str, Any], path: str) -> Any:
    found = owners.get(_normalized(path))
    if found is None:
        raise PipelineInputError(f"{path}: read by Spark but not listed by the driver")
    return found


@dataclass(frozen=True, slots=True)
class SegmentRange:
    """Bytes [start, end) of one segment file: the unit of work of the log reader."""

    node: str
    segment: str  # file name
    uri: str
    index_uri: str | None  # the segment's .index, when the node has one
    file_bytes: int  # as listed by the driver: a live node's active segment may grow later
    start: int
    end: int


def split_bytes_for(total_bytes: int, parallelism: int, max_split_bytes: int = MAX_SPLIT_BYTES) -> int:
    """Spark's own rule for file splits, in small: enough ranges for every core a few times
    over, never ranges so small that task start-up dominates, never more than the maximum."""
    per_task = -(-total_bytes // max(1, parallelism * RANGES_PER_CORE))
    return min(max_split_bytes, max(MIN_SPLIT_BYTES, per_task))


def plan_ranges(nodes: list[NodeDir], split_bytes: int) -> list[list[SegmentRange]]:
    """Every segment cut into ranges of at most ``split_bytes``, packed in order into
    partitions of at most ``split_bytes`` (a small file shares a partition with its
    neighbours; a big one is spread over several)."""
    check(split_bytes > 0, "split_bytes must be positive")
    partitions: list[list[SegmentRange]] = []
    current: list[SegmentRange] = []
    current_bytes = 0
    for node in nodes:
        indexes = {e.name[: -len(".index")]: e.uri for e in node.indexes}
        for segment in sorted(node.segments, key=lambda e: e.name):
            stem = segment.name[: -len(".log")]
            for start in range(0, segment.length_bytes, split_bytes):
                end = min(segment.length_bytes, start + split_bytes)
                if current and current_bytes + (end - start) > split_bytes:
                    partitions.append(current)
                    current, current_bytes = [], 0
                current.append(SegmentRange(node.node, segment.name, segment.uri, indexes.get(stem),
                                            segment.length_bytes, start, end))
                current_bytes += end - start
    if current:
        partitions.append(current)
    return partitions


def _read_whole(filesystem: pafs.FileSystem, path: str) -> bytes:
    with filesystem.open_input_file(path) as handle:
        return handle.read()


def decode_segment_range(task: SegmentRange, skip_corrupt: bool) -> Iterator[list[tuple[Any, ...]]]:
    """Row chunks of one range, read by the task itself (pyarrow file system of its URI)."""
    name = f"{task.node}/log/{task.segment}"
    try:
        filesystem, path = pafs.FileSystem.from_uri(task.uri)
        index_entries: list[tuple[int, int]] = []
        if task.index_uri is not None and task.start > 0:
            index_fs, index_path = pafs.FileSystem.from_uri(task.index_uri)
            try:
                index_entries = decode_index(_read_whole(index_fs, index_path))
            except (OSError, pa.ArrowException):
                index_entries = []  # an index that vanished or cannot be read: scan instead
        with filesystem.open_input_file(path) as handle:
            def read_at(position: int, size: int) -> bytes:
                return handle.read_at(size, position) if size > 0 else b""

            yield from decode_range(task.node, task.segment, read_at, task.file_bytes, task.start, task.end,
                                    skip_corrupt, index_entries)
    except (OSError, pa.ArrowException) as exc:
        raise PipelineInputError(f"{name}: cannot read bytes {task.start}-{task.end}: {exc}") from exc


def read_entries(spark: SparkSession, nodes: list[NodeDir], skip_corrupt: bool = False,
                 split_bytes: int | None = None) -> DataFrame:
    """One row per operation of every record in every segment (ENTRY_COLUMNS).

    ``split_bytes``: the byte-range size (default: derived from the input size and the
    cluster's parallelism, at most MAX_SPLIT_BYTES)."""
    segments = [e for n in nodes for e in n.segments]
    if not segments:
        return spark.createDataFrame([], ENTRY_SCHEMA)
    if split_bytes is None:
        split_bytes = split_bytes_for(sum(e.length_bytes for e in segments), spark.sparkContext.defaultParallelism)
    partitions = plan_ranges(nodes, split_bytes)
    if not partitions:
        return spark.createDataFrame([], ENTRY_SCHEMA)
    encoded = [json.dumps([asdict(r) for r in partition]) for partition in partitions]
    tasks = spark.createDataFrame(
        spark.sparkContext.parallelize([(item,) for item in encoded], len(encoded)), "ranges string")

    def decode_partitions(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for item in batch.column(0).to_pylist():
                for fields in json.loads(item):
                    for chunk in decode_segment_range(SegmentRange(**fields), skip_corrupt):
                        yield rows_to_arrow(chunk)

    return tasks.mapInArrow(decode_partitions, ENTRY_SCHEMA)


CHECKPOINT_MAX_BYTES = 64 * 1024  # a log-start checkpoint is a few dozen bytes of JSON


@dataclass(frozen=True, slots=True)
class LogLayout:
    """What a node's log-start checkpoint says: where its log starts and how far its prefix
    was compacted (offsets below ``cleaned_end`` hold the cleaner's output, not the records
    as written)."""

    start_offset: int
    cleaned_end: int


def read_log_layout(fs: HadoopFS, node: NodeDir) -> LogLayout:
    """The node's log layout; a log never cut nor cleaned has no checkpoint: (0, 0)."""
    entry = node.log_start_checkpoint
    if entry is None:
        return LogLayout(0, 0)
    name = f"{node.node}/log/{LOG_START_CHECKPOINT}"
    try:
        value = json.loads(fs.read_bytes(entry.uri, CHECKPOINT_MAX_BYTES))
        start_offset, cleaned_end = value["start_offset"], value.get("cleaned_end", 0)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise PipelineInputError(f"{name}: not a log start checkpoint ({exc})") from exc
    if type(start_offset) is not int or type(cleaned_end) is not int or start_offset < 0 or cleaned_end < 0:
        raise PipelineInputError(f"{name}: start_offset and cleaned_end must be non-negative integers")
    return LogLayout(start_offset, cleaned_end)


def _check_schema(connection: sqlite3.Connection) -> tuple[int, int]:
    """(applied_version, applied_epoch), after checking this is a state database we understand."""
    meta = state_schema.meta
    row = connection.execute(
        f"SELECT {meta.c.schema_version.name}, {meta.c.applied_version.name}, {meta.c.applied_epoch.name} "
        f"FROM {meta.name} WHERE {meta.c.id.name} = 1").fetchone()
    if row is None:
        return 0, 0
    if row[0] not in state_schema.READABLE_SCHEMA_VERSIONS:  # the entries view reads the same in both
        raise PipelineInputError(f"unknown state schema version {row[0]} (this pipeline reads "
                                 f"{state_schema.SCHEMA_VERSION})")
    return int(row[1]), int(row[2])


def _snapshot_rows(connection: sqlite3.Connection) -> list[tuple[Any, ...]]:
    _check_schema(connection)
    table = state_schema.entries
    columns = ", ".join(table.c[name].name for name in ("key", "value", "content_type", "mod_version",
                                                        "create_version"))
    return connection.execute(f"SELECT {columns} FROM {table.name} ORDER BY {table.c.key.name}").fetchall()


def read_snapshots(spark: SparkSession, chosen: list[tuple[NodeDir, Entry]]) -> DataFrame:
    """The rows of the given snapshot files, each checked (trailer, length, CRC32C)."""
    if not chosen:
        return spark.createDataFrame([], SNAPSHOT_SCHEMA)
    owners = {_normalized(entry.uri): (node.node, *node.snapshot_id(entry)) for node, entry in chosen}
    uris = sorted(entry.uri for _, entry in chosen)
    files = spark.sparkContext.binaryFiles(",".join(uris), minPartitions=len(uris))

    def rows(pairs: Iterator[tuple[str, bytes]]) -> Iterator[tuple[Any, ...]]:
        for path, data in pairs:
            node, end_offset, epoch = _lookup(owners, path)
            name = f"{node}/snapshots/{path.rsplit('/', 1)[1]}"
            database = snapshot_database_bytes(name, data)
            try:
                found = query_sqlite_bytes({"": database}, _snapshot_rows)
            except sqlite3.DatabaseError as exc:
                raise PipelineInputError(f"snapshot {name}: not a readable state database: {exc}") from exc
            for key, value, content_type, mod_version, create_version in found:
                yield (node, end_offset, epoch, key, value, content_type, mod_version, create_version)

    return spark.createDataFrame(files.mapPartitions(rows), SNAPSHOT_SCHEMA)


def _meta(connection: sqlite3.Connection) -> tuple[int, int]:
    return _check_schema(connection)


def read_applied_versions(spark: SparkSession, nodes: list[NodeDir]) -> dict[str, int]:
    """Each node's applied version from its state.db (with its WAL), read by a Spark task
    from a private copy. Only committed records are ever applied, so this is a version
    known to be committed."""
    with_state = [n for n in nodes if n.state_files]
    if not with_state:
        return {}
    owners = {_normalized(e.uri): n.node for n in with_state for e in n.state_files}
    uris = sorted(e.uri for n in with_state for e in n.state_files)
    files = spark.sparkContext.binaryFiles(",".join(uris), minPartitions=1)

    def per_node(pairs: Iterator[tuple[str, bytes]]) -> Iterator[tuple[str, str, bytes]]:
        for path, data in pairs:
            suffix = "-wal" if path.endswith("-wal") else ""
            yield _lookup(owners, path), suffix, data

    def applied(item: tuple[str, Iterable[tuple[str, bytes]]]) -> tuple[str, int]:
        node, parts = item
        payload = dict(parts)
        if "" not in payload:
            raise PipelineInputError(f"{node}: state.db-wal without state.db")
        try:
            version, _epoch = query_sqlite_bytes(payload, _meta)
        except sqlite3.DatabaseError as exc:
            raise PipelineInputError(f"{node}/state.db: not a readable state database: {exc}") from exc
        return node, version

    grouped = files.mapPartitions(per_node).map(lambda t: (t[0], (t[1], t[2]))).groupByKey()
    return dict(grouped.map(applied).collect())
