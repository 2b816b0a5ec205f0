"""The churn job: how metadata changes per key prefix and time window, and what compaction
saves (log bytes written vs live bytes held) over time.

Definitions (docs/pipeline.md has the same list; tests recompute them in plain Python):
- only the operations that actually ran count (the taken branch of every txn);
- create: a put of an absent key; update: a put of a present key; delete: a delete of a
  present key; tombstone: every delete that ran (a delete of an absent key writes one too);
- tombstone_share = tombstones / (puts + tombstones);
- a key lifetime ends at a delete of a present key: delete timestamp - timestamp of the put
  that created that incarnation (keys that came from a snapshot have no known birth);
- entry bytes = UTF-8 key bytes + value bytes; written_bytes sums them over every put and
  delete that ran, live_bytes is the sum over the live entries at the end of the window;
- log_bytes is the on-disk size of every batch (control batches included) up to the window.
"""

from __future__ import annotations

import argparse
import io
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.window import Window

from pipeline.errors import EXIT_OK, PipelineInputError
from pipeline.fs import HadoopFS, StagedOutput
from pipeline.jobs import committed_versions, decode_all, skipped_note, write_json
from pipeline.reader import discover
from pipeline.replay import effective_writes, ops_for_plan, plan_replay


def prefix_column(depth: int) -> Any:
    return F.array_join(F.slice(F.split(F.col("key"), "/"), 1, depth), "/")


def classify(base: DataFrame, writes: DataFrame, base_snapshot_end: int, depth: int, window_ms: int) -> DataFrame:
    """One row per write that ran, with its kind, its effect on live bytes and, for deletes
    of present keys, the lifetime that ended."""
    entry_bytes = F.length(F.encode(F.col("key"), "UTF-8")) + F.coalesce(F.length("value"), F.lit(0))
    base_rows = base.select(
        "key", F.lit(base_snapshot_end - 1).cast("long").alias("offset"), F.lit(-1).alias("op_index"),
        F.lit("base").alias("operation"), F.lit(None).cast("long").alias("timestamp_ms"),
        entry_bytes.alias("entry_bytes"))
    write_rows = writes.select("key", "offset", "op_index", "operation", "timestamp_ms",
                               entry_bytes.alias("entry_bytes"))
    per_key = Window.partitionBy("key").orderBy("offset", "op_index")
    rows = base_rows.unionByName(write_rows)
    previous = F.lag("operation").over(per_key)
    previous_bytes = F.lag("entry_bytes").over(per_key)
    rows = rows.withColumn("existed", previous.isNotNull() & (previous != "delete")).withColumn(
        "previous_bytes", previous_bytes)
    rows = rows.withColumn(
        "kind",
        F.when(F.col("operation") == "base", F.lit("base"))
        .when((F.col("operation") == "put") & ~F.col("existed"), F.lit("create"))
        .when(F.col("operation") == "put", F.lit("update"))
        .when(F.col("existed"), F.lit("delete"))
        .otherwise(F.lit("delete_absent")))
    born = F.last(F.when(F.col("kind") == "create", F.col("timestamp_ms")), ignorenulls=True).over(
        per_key.rowsBetween(Window.unboundedPreceding, -1))
    last_birth_kind = F.last(F.when(F.col("kind").isin("create", "base"), F.col("kind")), ignorenulls=True).over(
        per_key.rowsBetween(Window.unboundedPreceding, -1))
    rows = rows.withColumn(
        "lifetime_ms",
        F.when((F.col("kind") == "delete") & (last_birth_kind == "create"), F.col("timestamp_ms") - born))
    rows = rows.withColumn(
        "live_bytes_delta",
        F.when(F.col("operation").isin("put", "base"), F.col("entry_bytes")).otherwise(F.lit(0))
        - F.when(F.col("existed"), F.col("previous_bytes")).otherwise(F.lit(0)))
    return rows.withColumn("prefix", prefix_column(depth)).withColumn(
        "window_start_ms", F.floor(F.col("timestamp_ms") / window_ms).cast("long") * window_ms)


def churn_table(classified: DataFrame) -> DataFrame:
    changes = classified.filter(F.col("kind") != "base")
    table = changes.groupBy("prefix", "window_start_ms").agg(
        F.sum((F.col("kind") == "create").cast("long")).alias("creates"),
        F.sum((F.col("kind") == "update").cast("long")).alias("updates"),
        F.sum((F.col("kind") == "delete").cast("long")).alias("deletes"),
        F.sum((F.col("operation") == "delete").cast("long")).alias("tombstones"),
        F.sum((F.col("operation") == "put").cast("long")).alias("puts"),
        F.count("lifetime_ms").alias("lifetimes_ended"),
        F.avg("lifetime_ms").alias("lifetime_ms_mean"),
        F.max("lifetime_ms").alias("lifetime_ms_max"),
        F.sum("entry_bytes").alias("written_bytes"),
        F.sum("live_bytes_delta").alias("live_bytes_delta"),
    )
    initial = classified.filter(F.col("kind") == "base").groupBy("prefix").agg(
        F.sum("entry_bytes").alias("base_bytes"))
    running = Window.partitionBy("prefix").orderBy("window_start_ms").rowsBetween(Window.unboundedPreceding, 0)
    return (table.join(initial, "prefix", "left")
            .withColumn("tombstone_share", F.col("tombstones") / (F.col("puts") + F.col("tombstones")))
            .withColumn("live_bytes", F.coalesce("base_bytes", F.lit(0)) + F.sum("live_bytes_delta").over(running))
            .drop("base_bytes", "live_bytes_delta"))


def bytes_over_time(entries: DataFrame, classified: DataFrame, node: str, version: int, window_ms: int) -> DataFrame:
    batches = (entries.filter((F.col("node") == node) & F.col("offset").isNotNull() & (F.col("offset") < version))
               .select("segment", "batch_position", "batch_bytes", "timestamp_ms").dropDuplicates(["segment", "batch_position"])
               .withColumn("window_start_ms", F.floor(F.col("timestamp_ms") / window_ms).cast("long") * window_ms)
               .groupBy("window_start_ms").agg(F.sum("batch_bytes").alias("log_bytes_added")))
    changes = classified.filter(F.col("kind") != "base").groupBy("window_start_ms").agg(
        F.sum("entry_bytes").alias("written_bytes_added"), F.sum("live_bytes_delta").alias("live_bytes_delta"))
    base_bytes = classified.filter(F.col("kind") == "base").agg(F.coalesce(F.sum("entry_bytes"), F.lit(0))).first()[0]
    running = Window.orderBy("window_start_ms").rowsBetween(Window.unboundedPreceding, 0)
    return (batches.join(changes, "window_start_ms", "full")
            .fillna(0, ["log_bytes_added", "written_bytes_added", "live_bytes_delta"])
            .withColumn("log_bytes", F.sum("log_bytes_added").over(running))
            .withColumn("written_bytes", F.sum("written_bytes_added").over(running))
            .withColumn("live_bytes", F.lit(int(base_bytes)) + F.sum("live_bytes_delta").over(running))
            .withColumn("live_share_of_log", F.col("live_bytes") / F.col("log_bytes"))
            .select("window_start_ms", "log_bytes", "written_bytes", "live_bytes", "live_share_of_log"))


def _plot_png(rows: list[Any], columns: list[str], title: str, ylabel: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.5))
    x = [r.window_start_ms / 1000.0 for r in rows]
    for column in columns:
        axes.plot(x, [getattr(r, column) for r in rows], marker="o", markersize=3, label=column)
    axes.set_title(title)
    axes.set_xlabel("window start (s since the Unix epoch)")
    axes.set_ylabel(ylabel)
    axes.legend()
    axes.grid(True, alpha=0.3)
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()


def summary_markdown(node: str, version: int, window_ms: int, per_prefix: list[Any], last_bytes: Any) -> str:
    lines = [f"# metakv churn: node {node}, versions 1..{version}, windows of {window_ms} ms", "",
             "| prefix | creates | updates | deletes | tombstone share | lifetimes ended | mean lifetime ms | live bytes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in per_prefix:
        share = f"{r.tombstone_share:.3f}" if r.tombstone_share is not None else "-"
        mean = f"{r.lifetime_ms_mean:.0f}" if r.lifetime_ms_mean is not None else "-"
        lines.append(f"| {r.prefix} | {r.creates} | {r.updates} | {r.deletes} | {share} | {r.lifetimes_ended} "
                     f"| {mean} | {r.live_bytes} |")
    if last_bytes is not None:
        saved = 1 - last_bytes.live_share_of_log if last_bytes.log_bytes else 0.0
        lines += ["", f"Log bytes written: {last_bytes.log_bytes}; entry bytes written: {last_bytes.written_bytes}; "
                      f"live bytes: {last_bytes.live_bytes}. A fully compacted log would drop about "
                      f"{saved:.1%} of the log bytes.", "",
                  "Plots: `churn.png` (changes per window), `bytes.png` (log vs live bytes)."]
    return "\n".join(lines) + "\n"


def run_churn(args: argparse.Namespace, spark: SparkSession, fs: HadoopFS, output: StagedOutput) -> int:
    nodes = discover(fs, args.input)
    if args.node is not None:
        nodes = [n for n in nodes if n.node == args.node]
        if not nodes:
            raise PipelineInputError(f"no node {args.node} in the input")
    elif len(nodes) != 1:
        raise PipelineInputError(f"churn reads one node; pass --node (one of {', '.join(n.node for n in nodes)})")
    node = nodes[0]
    entries, stats = decode_all(spark, [node], args.skip_corrupt, args.split_bytes)
    log = stats[node.node]
    if args.version is not None:
        version = args.version
    else:
        version = committed_versions(spark, [node]).get(node.node, (log.last_offset or -1) + 1)
    plan = plan_replay(spark, node, version, log.first_offset, log.last_offset)
    writes = effective_writes(spark, ops_for_plan(entries, plan), plan.base, plan.base_snapshot_end)
    classified = classify(plan.base, writes, plan.base_snapshot_end, args.prefix_depth, args.window_ms).cache()
    table = churn_table(classified)
    table.orderBy("prefix", "window_start_ms").write.parquet(output.path("churn.parquet"))
    over_time = bytes_over_time(entries, classified, node.node, version, args.window_ms)
    over_time.orderBy("window_start_ms").write.parquet(output.path("bytes_over_time.parquet"))
    written = spark.read.parquet(output.path("churn.parquet"))
    per_prefix = (written.groupBy("prefix").agg(
        F.sum("creates").alias("creates"), F.sum("updates").alias("updates"), F.sum("deletes").alias("deletes"),
        (F.sum("tombstones") / (F.sum("puts") + F.sum("tombstones"))).alias("tombstone_share"),
        F.sum("lifetimes_ended").alias("lifetimes_ended"),
        (F.sum(F.col("lifetime_ms_mean") * F.col("lifetimes_ended")) / F.sum("lifetimes_ended")).alias("lifetime_ms_mean"),
        F.max_by("live_bytes", "window_start_ms").alias("live_bytes"))
        .orderBy("prefix").collect())
    time_rows = spark.read.parquet(output.path("bytes_over_time.parquet")).orderBy("window_start_ms").collect()
    per_window = (written.groupBy("window_start_ms").agg(
        F.sum("creates").alias("creates"), F.sum("updates").alias("updates"), F.sum("deletes").alias("deletes"))
        .orderBy("window_start_ms").collect())
    fs.write_bytes(output.path("summary.md"), summary_markdown(
        node.node, version, args.window_ms, per_prefix, time_rows[-1] if time_rows else None).encode())
    fs.write_bytes(output.path("churn.png"), _plot_png(per_window, ["creates", "updates", "deletes"],
                                                        "metadata churn per window", "changes"))
    fs.write_bytes(output.path("bytes.png"), _plot_png(time_rows, ["log_bytes", "written_bytes", "live_bytes"],
                                                        "log bytes vs live bytes", "bytes"))
    write_json(fs, output, "summary.json", {"job": "churn", "node": node.node, "version": version,
                                             "window_ms": args.window_ms, "prefix_depth": args.prefix_depth,
                                             "skipped_regions": log.skipped_regions})
    print(f"churn: node {node.node} versions 1..{version}: {len(per_prefix)} prefixes, {len(per_window)} windows")
    note = skipped_note(stats)
    if note:
        print(f"churn: {note}")
    return EXIT_OK
