"""Replaying the log exactly as storage/state_machine.py applies it, but in Spark.

Most records are unconditional and their effect on a key depends only on that key's own
earlier writes, so the final state is a per-key "last write wins" over all writes, ordered
by (offset, op_index) — a parallel group-by. Conditional records (txns with compares) are
the exception: which branch ran depends on the state of the compared keys just before the
record. They are resolved first, on the driver, by a sequential replay restricted to the
compared keys (their writes are collected, nothing else), then every record's taken branch
is known and the rest is parallel again. Semantics (docs/state-machine.md):

- the record at offset o produces version o + 1; its puts get mod_version o + 1;
- a put of an absent key creates it (create_version o + 1); a delete of an absent key, a get,
  and a failed command without failure ops change nothing;
- compares are evaluated against the state before the record: MOD_VERSION (0 when absent),
  EXISTS, VALUE (exists and equal); all hold -> success ops, otherwise failure ops.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import msgpack
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, LongType, StructField, StructType
from pyspark.sql.window import Window

from pipeline.errors import PipelineInputError
from pipeline.reader import NodeDir, read_snapshots
from storage.commands import CompareKind

OUTCOME_SCHEMA = StructType([StructField("offset", LongType(), False), StructField("succeeded", BooleanType(), False)])
LIVE_COLUMNS = ["key", "value", "content_type", "mod_version", "create_version"]
WRITE_OPERATIONS = ("put", "delete")


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """Where a replay of one node up to ``version`` takes its data from."""

    node: NodeDir
    version: int
    base_snapshot_end: int  # 0 when replaying from the start of the log
    base: DataFrame  # snapshot rows (SNAPSHOT_SCHEMA), empty when base_snapshot_end == 0


def _compare_holds(kind: int, target: object, present: tuple[bytes, int] | None) -> bool:
    if kind == CompareKind.MOD_VERSION:
        return (present[1] if present else 0) == target
    if kind == CompareKind.EXISTS:
        return (present is not None) == target
    return present is not None and present[0] == target


def resolve_conditions(spark: SparkSession, ops: DataFrame, base: DataFrame, base_snapshot_end: int) -> DataFrame:
    """(offset, succeeded) for every conditional record in ``ops``, from one collect: the
    conditional records and every write to a compared key."""
    compared = ops.select(F.explode("compare_keys").alias("key")).distinct()
    relevant = ops.filter(F.col("compares").isNotNull()).unionByName(
        ops.join(F.broadcast(compared), "key", "left_semi").filter(F.col("operation").isin(*WRITE_OPERATIONS)))
    rows = relevant.select("offset", "op_index", "compares", "branch", "operation", "key", "value").collect()
    compares_by_offset = {r.offset: msgpack.unpackb(r.compares, raw=False) for r in rows if r.compares is not None}
    if not compares_by_offset:
        return spark.createDataFrame([], OUTCOME_SCHEMA)
    compared_keys = sorted({compare[0] for compares in compares_by_offset.values() for compare in compares})
    state: dict[str, tuple[bytes, int]] = {}
    if base_snapshot_end:
        state = {row.key: (row.value, row.mod_version)
                 for row in base.filter(F.col("key").isin(compared_keys)).select("key", "value", "mod_version").collect()}
    keys = set(compared_keys)
    writes_by_offset: dict[int, dict[int, tuple[str, str, str, bytes | None]]] = defaultdict(dict)
    for r in rows:
        if r.key in keys and r.operation in WRITE_OPERATIONS:
            writes_by_offset[r.offset][r.op_index] = (r.branch, r.operation, r.key, r.value)
    outcomes: list[tuple[int, bool]] = []
    for offset in sorted(set(compares_by_offset) | set(writes_by_offset)):
        branch = "success"
        if offset in compares_by_offset:
            succeeded = all(_compare_holds(kind, target, state.get(key))
                            for key, kind, target in compares_by_offset[offset])
            outcomes.append((offset, succeeded))
            branch = "success" if succeeded else "failure"
        writes = writes_by_offset.get(offset, {})
        for op_index in sorted(writes):
            op_branch, operation, key, value = writes[op_index]
            if op_branch != branch:
                continue
            if operation == "put":
                state[key] = (value or b"", offset + 1)
            else:
                state.pop(key, None)
    return spark.createDataFrame(outcomes, OUTCOME_SCHEMA)


def effective_writes(spark: SparkSession, ops: DataFrame, base: DataFrame, base_snapshot_end: int) -> DataFrame:
    """The puts and deletes that actually ran (the taken branch of every record)."""
    outcomes = resolve_conditions(spark, ops, base, base_snapshot_end)
    taken = F.when(F.col("succeeded").isNull() | F.col("succeeded"), F.lit("success")).otherwise(F.lit("failure"))
    return (ops.filter(F.col("operation").isin(*WRITE_OPERATIONS))
            .join(F.broadcast(outcomes), "offset", "left")
            .filter(F.col("branch") == taken)
            .drop("succeeded"))


def live_entries(base: DataFrame, writes: DataFrame, base_snapshot_end: int) -> DataFrame:
    """The live rows (LIVE_COLUMNS) after applying ``writes`` on top of ``base``."""
    base_rows = base.select(
        "key", "value", "content_type",
        F.lit(base_snapshot_end - 1).cast("long").alias("offset"), F.lit(-1).alias("op_index"),
        F.lit("base").alias("operation"), "mod_version", "create_version")
    write_rows = writes.select(
        "key", "value", "content_type", "offset", "op_index", "operation",
        (F.col("offset") + 1).alias("mod_version"), (F.col("offset") + 1).alias("create_version"))
    rows = base_rows.unionByName(write_rows)
    position = F.struct("offset", "op_index")
    last_delete = F.max(F.when(F.col("operation") == "delete", position)).over(Window.partitionBy("key"))
    since_delete = rows.withColumn("last_delete", last_delete).filter(
        F.col("last_delete").isNull() | (position > F.col("last_delete")))
    newest = since_delete.groupBy("key").agg(
        F.max(F.struct("offset", "op_index", "value", "content_type", "mod_version")).alias("last"),
        F.min(F.struct("offset", "op_index", "create_version")).alias("first"))
    return newest.select(
        "key", F.col("last.value").alias("value"), F.col("last.content_type").alias("content_type"),
        F.col("last.mod_version").alias("mod_version"), F.col("first.create_version").alias("create_version"))


def plan_replay(spark: SparkSession, node: NodeDir, version: int, first_offset: int | None,
                last_offset: int | None) -> ReplayPlan:
    """Pick the data that reaches ``version``: the log from 0 when it starts at 0, else the
    newest snapshot at or below ``version`` that the log continues."""
    log_start = min((int(e.name[:20]) for e in node.segments), default=None)
    ids = sorted((node.snapshot_id(e), e) for e in node.snapshots)
    if version == 0:
        return ReplayPlan(node, 0, 0, read_snapshots(spark, []))
    if log_start == 0 and first_offset is not None and (last_offset or 0) + 1 >= version:
        return ReplayPlan(node, version, 0, read_snapshots(spark, []))
    usable = [(sid, e) for sid, e in ids
              if sid[0] <= version and (sid[0] == version or (log_start is not None and log_start <= sid[0]
                                                              and (last_offset or -1) + 1 >= version))]
    if not usable:
        held = (f"log offsets {first_offset}..{last_offset}" if first_offset is not None else "no log records")
        snaps = ", ".join(str(sid[0]) for sid, _ in ids) or "none"
        raise PipelineInputError(
            f"{node.node}: cannot reach version {version}: {held}, snapshot end offsets: {snaps}")
    (end_offset, _epoch), entry = usable[-1]
    return ReplayPlan(node, version, end_offset, read_snapshots(spark, [(node, entry)]))


def ops_for_plan(entries: DataFrame, plan: ReplayPlan) -> DataFrame:
    return entries.filter(
        (F.col("node") == plan.node.node) & F.col("offset").isNotNull()
        & (F.col("offset") >= plan.base_snapshot_end) & (F.col("offset") < plan.version)
        & ~F.col("control"))
