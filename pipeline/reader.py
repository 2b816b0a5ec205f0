"""metakv data directories -> Spark DataFrames.

Inputs are node data directories (``<dir>/log``, ``<dir>/snapshots``, ``<dir>/state.db``;
layout in docs/pipeline.md), or a directory whose children are data directories (the
``./data`` of ``metakv cluster up``). The driver only lists directories (through Hadoop's
FileSystem API); every byte of every file is read by Spark tasks through ``binaryFiles``,
so the same code runs on ``local[*]`` and on a cluster reading a shared file system.

Parallelism is per file: each segment file is one task (segment_bytes bounds a file, 64 MiB
by default), decoded with storage/batch_codec.py, every CRC checked.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
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
    SNAPSHOT_NAME,
    decode_segment,
    query_sqlite_bytes,
    rows_to_arrow,
    segment_base_offset,
    snapshot_database_bytes,
)
from pipeline.errors import PipelineInputError
from pipeline.fs import Entry, HadoopFS, qualify
from storage import state_schema

DATA_DIR_MARKERS = ("log", "snapshots", "state.db", "quorum-state")
STATE_DB = "state.db"

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
    if "log" in names and names["log"].is_dir:
        for entry in fs.list(names["log"].uri):
            if entry.name.endswith(".log"):
                if segment_base_offset(entry.name) is None:
                    raise PipelineInputError(f"{node}: {entry.name} in log/ is not named <base_offset:020d>.log")
                segments.append(entry)
    snapshots: list[Entry] = []
    if "snapshots" in names and names["snapshots"].is_dir:
        snapshots = [e for e in fs.list(names["snapshots"].uri) if e.name.endswith(".snapshot")]
    state_files = tuple(names[n] for n in (STATE_DB, STATE_DB + "-wal") if n in names and not names[n].is_dir)
    found = NodeDir(node, uri, tuple(segments), tuple(snapshots), state_files)
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
        nodes = [NodeDir(n.uri, n.uri, n.segments, n.snapshots, n.state_files) for n in nodes]
    return nodes


def _normalized(uri: str) -> str:
    """binaryFiles may spell a URI differently from the listing (file:/x vs file:///x)."""
    return "/" + uri.split(":", 1)[-1].lstrip("/") if ":" in uri else uri


def _lookup(owners: dict[str, Any], path: str) -> Any:
    found = owners.get(_normalized(path))
    if found is None:
        raise PipelineInputError(f"{path}: read by Spark but not listed by the driver")
    return found


def read_entries(spark: SparkSession, nodes: list[NodeDir], skip_corrupt: bool = False) -> DataFrame:
    """One row per operation of every record in every segment (ENTRY_COLUMNS)."""
    owners = {_normalized(e.uri): n.node for n in nodes for e in n.segments}
    if not owners:
        return spark.createDataFrame([], ENTRY_SCHEMA)
    uris = sorted(e.uri for n in nodes for e in n.segments)
    files = spark.read.format("binaryFile").load(uris).select("path", "content")

    def decode_files(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            paths = batch.column(0).to_pylist()
            contents = batch.column(1)
            for index, path in enumerate(paths):
                node = _lookup(owners, path)
                data = contents[index].as_py()
                yield from rows_to_arrow(decode_segment(node, path.rsplit("/", 1)[1], data, skip_corrupt))

    return files.mapInArrow(decode_files, ENTRY_SCHEMA)


def _check_schema(connection: sqlite3.Connection) -> tuple[int, int]:
    """(applied_version, applied_epoch), after checking this is a state database we understand."""
    meta = state_schema.meta
    row = connection.execute(
        f"SELECT {meta.c.schema_version.name}, {meta.c.applied_version.name}, {meta.c.applied_epoch.name} "
        f"FROM {meta.name} WHERE {meta.c.id.name} = 1").fetchone()
    if row is None:
        return 0, 0
    if row[0] != state_schema.SCHEMA_VERSION:
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
