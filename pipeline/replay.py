"""Replaying the log exactly as the state machine applies it (storage/evaluator.py), in Spark.

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
from storage.commands import DEFAULT_CONTENT_TYPE, Command, Compare, CompareKind, Op, OpKind
from storage.state_machine import Entry, evaluate_commands

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


def resolve_conditions(spark: SparkSession, ops: DataFrame, base: DataFrame, base_snapshot_end: int) -> DataFrame:
    """(offset, succeeded) for every conditional record in ``ops``, from one collect: the
    conditional records and every write to a compared key. The branch decision is made by
    storage.evaluator.evaluate_commands, the evaluator apply itself uses."""
    compared = ops.select(F.explode("compare_keys").alias("key")).distinct()
    relevant = ops.filter(F.col("compares").isNotNull()).unionByName(
        ops.join(F.broadcast(compared), "key", "left_semi").filter(F.col("operation").isin(*WRITE_OPERATIONS)))
    rows = relevant.filter(F.col("operation").isin(*WRITE_OPERATIONS) | F.col("compares").isNotNull()).select(
        "offset", "op_index", "compares", "branch", "operation", "key", "value", "content_type",
        "create_version").collect()
    compares_by_offset = {r.offset: msgpack.unpackb(r.compares, raw=False) for r in rows if r.compares is not None}
    if not compares_by_offset:
        return spark.createDataFrame([], OUTCOME_SCHEMA)
    compared_keys = sorted({compare[0] for compares in compares_by_offset.values() for compare in compares})
    # evaluate_commands needs every key a command names; only the compared keys' writes are
    # all here, so any other key reads as absent, which is harmless: no compare reads it.
    state: dict[str, Entry | None] = {}
    if base_snapshot_end:
        for row in base.filter(F.col("key").isin(compared_keys)).collect():
            state[row.key] = Entry(row.key, row.value, row.content_type, row.mod_version, row.create_version)
    ops_by_offset: dict[int, dict[int, tuple[str, Op]]] = defaultdict(dict)
    for r in rows:
        if r.operation in WRITE_OPERATIONS:
            kind = OpKind.PUT if r.operation == "put" else OpKind.DELETE
            op = Op(kind, r.key, r.value or b"", r.content_type or DEFAULT_CONTENT_TYPE, r.create_version or 0)
            ops_by_offset[r.offset][r.op_index] = (r.branch, op)
    commands: list[tuple[int, Command | str]] = []
    for offset in sorted(set(compares_by_offset) | set(ops_by_offset)):
        ordered = [ops_by_offset[offset][i] for i in sorted(ops_by_offset.get(offset, {}))]
        compares = tuple(Compare(key, CompareKind(kind), target) for key, kind, target in
                         compares_by_offset.get(offset, ()))
        commands.append((offset, Command(compares, tuple(op for branch, op in ordered if branch == "success"),
                                         tuple(op for branch, op in ordered if branch == "failure"))))
    for _, command in commands:
        for key in {c.key for c in command.compare} | {o.key for o in (*command.success, *command.failure)}:  # type: ignore[union-attr]
            state.setdefault(key, None)
    results = evaluate_commands(commands, state)
    outcomes = [(result.offset, result.succeeded) for result in results if result.offset in compares_by_offset]
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
        (F.col("offset") + 1).alias("mod_version"), F.col("create_version").alias("explicit_create_version"))
    base_rows = base_rows.withColumn("explicit_create_version", F.col("create_version")).drop("create_version")
    rows = base_rows.unionByName(write_rows)
    position = F.struct("offset", "op_index")
    last_delete = F.max(F.when(F.col("operation") == "delete", position)).over(Window.partitionBy("key"))
    since_delete = rows.withColumn("last_delete", last_delete).filter(
        F.col("last_delete").isNull() | (position > F.col("last_delete")))
    explicit = F.when(F.col("explicit_create_version").isNotNull(),
                      F.struct("offset", "op_index", "explicit_create_version"))
    newest = since_delete.groupBy("key").agg(
        F.max(F.struct("offset", "op_index", "value", "content_type", "mod_version")).alias("last"),
        F.min(F.struct("offset", "op_index", "mod_version")).alias("first"),
        F.max(explicit).alias("restored"))
    # create_version: the newest value a cleaned put (or the snapshot) restored since the last
    # delete, else the version of the first put since then (storage/evaluator.py).
    return newest.select(
        "key", F.col("last.value").alias("value"), F.col("last.content_type").alias("content_type"),
        F.col("last.mod_version").alias("mod_version"),
        F.coalesce(F.col("restored.explicit_create_version"), F.col("first.mod_version")).alias("create_version"))


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
