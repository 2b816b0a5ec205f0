"""The log jobs: materialize and audit. Each takes parsed arguments, a session and a staged
output, writes its results into the staging area and returns an exit code."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.window import Window

from pipeline.errors import EXIT_DIVERGED, EXIT_OK, PipelineInputError
from pipeline.fs import HadoopFS, StagedOutput
from pipeline.reader import (
    LogLayout,
    NodeDir,
    discover,
    read_applied_versions,
    read_entries,
    read_log_layout,
)
from pipeline.replay import effective_writes, live_entries, ops_for_plan, plan_replay


@dataclass(frozen=True, slots=True)
class LogStats:
    """What a full decode pass found, per node."""

    first_offset: int | None
    last_offset: int | None
    records: int
    skipped_regions: int
    skipped_bytes: int


def decode_all(spark: SparkSession, nodes: list[NodeDir], skip_corrupt: bool,
               split_bytes: int | None = None) -> tuple[DataFrame, dict[str, LogStats]]:
    """Decode every segment once (kept for the later stages) and surface any corruption now,
    before anything is written."""
    entries = read_entries(spark, nodes, skip_corrupt, split_bytes).persist(StorageLevel.MEMORY_AND_DISK)
    per_node = entries.groupBy("node").agg(
        F.min("offset").alias("first_offset"), F.max("offset").alias("last_offset"),
        F.count(F.when(F.col("op_index") == 0, True)).alias("records"),
        F.count(F.when(F.col("operation") == "skipped", True)).alias("skipped_regions"),
        F.coalesce(F.sum(F.when(F.col("operation") == "skipped", F.col("batch_bytes"))), F.lit(0)).alias("skipped_bytes"),
    ).collect()
    stats = {n.node: LogStats(None, None, 0, 0, 0) for n in nodes}
    for row in per_node:
        stats[row.node] = LogStats(row.first_offset, row.last_offset, row.records, row.skipped_regions,
                                   int(row.skipped_bytes))
    return entries, stats


def skipped_note(stats: dict[str, LogStats]) -> str | None:
    regions = sum(s.skipped_regions for s in stats.values())
    if not regions:
        return None
    skipped_bytes = sum(s.skipped_bytes for s in stats.values())
    return f"skipped {regions} corrupt region(s), {skipped_bytes} bytes (--skip-corrupt)"


def committed_versions(spark: SparkSession, nodes: list[NodeDir]) -> dict[str, int]:
    """Per node, a version known committed: its applied version (only committed records are
    applied) or its newest snapshot's end offset, whichever is higher."""
    applied = read_applied_versions(spark, nodes)
    known: dict[str, int] = {}
    for node in nodes:
        candidates = [node.snapshot_id(e)[0] for e in node.snapshots]
        if node.node in applied:
            candidates.append(applied[node.node])
        if candidates:
            known[node.node] = max(candidates)
    return known


def write_json(fs: HadoopFS, output: StagedOutput, name: str, payload: object) -> None:
    fs.write_bytes(output.path(name), (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())


def run_materialize(args: argparse.Namespace, spark: SparkSession, fs: HadoopFS, output: StagedOutput) -> int:
    nodes = discover(fs, args.input)
    if args.node is not None:
        nodes = [n for n in nodes if n.node == args.node] or _no_such_node(args.node, nodes)
    elif len(nodes) != 1:
        raise PipelineInputError(
            f"materialize reads one node; pass --node (one of {', '.join(n.node for n in nodes)})")
    node = nodes[0]
    entries, stats = decode_all(spark, [node], args.skip_corrupt, args.split_bytes)
    if args.version is not None:
        version = args.version
    else:
        committed = committed_versions(spark, [node])
        if node.node not in committed:
            raise PipelineInputError(
                f"{node.node}: no state.db or snapshot tells the committed version; pass --version N")
        version = committed[node.node]
    log = stats[node.node]
    plan = plan_replay(spark, node, version, log.first_offset, log.last_offset)
    ops = ops_for_plan(entries, plan)
    live = live_entries(plan.base, effective_writes(spark, ops, plan.base, plan.base_snapshot_end), plan.base_snapshot_end)
    live = live.persist(StorageLevel.MEMORY_AND_DISK)
    count = live.count()
    live.sortWithinPartitions("key").write.parquet(output.path("entries.parquet"))
    summary = {"job": "materialize", "node": node.node, "version": version, "live_entries": count,
               "base_snapshot_end_offset": plan.base_snapshot_end,
               "log_records": log.records, "skipped_regions": log.skipped_regions,
               "skipped_bytes": log.skipped_bytes}
    write_json(fs, output, "summary.json", summary)
    print(f"materialize: node {node.node} version {version}: {count} live entries")
    note = skipped_note(stats)
    if note:
        print(f"materialize: {note}")
    return EXIT_OK


def _no_such_node(name: str, nodes: list[NodeDir]) -> list[NodeDir]:
    raise PipelineInputError(f"no node {name} in the input (found {', '.join(n.node for n in nodes)})")


def run_audit(args: argparse.Namespace, spark: SparkSession, fs: HadoopFS, output: StagedOutput) -> int:
    nodes = discover(fs, args.input)
    if len(nodes) < 2:
        raise PipelineInputError(f"audit compares replicas: found {len(nodes)} data dir(s), need at least 2")
    layouts = {n.node: read_log_layout(fs, n) for n in nodes}
    entries, stats = decode_all(spark, nodes, args.skip_corrupt, args.split_bytes)
    if args.version is not None:
        committed = args.version
    else:
        known = committed_versions(spark, nodes)
        if not known:
            raise PipelineInputError("no node has a state.db or snapshot telling the committed version; pass --version N")
        committed = max(known.values())  # committed anywhere means committed for all
    divergences = find_divergences(entries, committed, layouts, spark).persist(StorageLevel.MEMORY_AND_DISK)
    divergences.sortWithinPartitions("offset", "node").write.parquet(output.path("divergences.parquet"))
    found = sorted(divergences.collect(), key=lambda r: (r.offset, r.node))
    node_rows = [{"node": n, "first_offset": s.first_offset, "last_offset": s.last_offset, "records": s.records,
                  "skipped_regions": s.skipped_regions, "cleaned_end": layouts[n].cleaned_end}
                 for n, s in sorted(stats.items())]
    summary: dict[str, object] = {"job": "audit", "committed_version": committed, "nodes": node_rows,
                                  "divergent_records": len(found), "cleaned_groups": cleaned_groups(layouts)}
    if found:
        first = found[0]
        summary["first_divergence"] = {"node": first.node, "offset": first.offset, "epoch": first.epoch,
                                       "reason": first.reason}
    write_json(fs, output, "summary.json", summary)
    fs.write_bytes(output.path("summary.md"), audit_markdown(summary).encode())
    for line in cleaned_notes(layouts):
        print(f"audit: {line}")
    if found:
        first = found[0]
        print(f"audit: DIVERGED: first divergence at node {first.node} offset {first.offset} "
              f"epoch {first.epoch}: {first.reason} ({len(found)} divergent record(s) below version {committed})")
        return EXIT_DIVERGED
    print(f"audit: OK: {len(nodes)} replicas identical record for record below version {committed}")
    return EXIT_OK


def cleaned_groups(layouts: dict[str, LogLayout]) -> dict[str, list[str]]:
    """Nodes by the offset their prefix was cleaned to (only nodes that cleaned)."""
    groups: dict[str, list[str]] = {}
    for node, layout in sorted(layouts.items()):
        if layout.cleaned_end:
            groups.setdefault(str(layout.cleaned_end), []).append(node)
    return groups


def cleaned_notes(layouts: dict[str, LogLayout]) -> list[str]:
    """What the audit could not compare: a cleaned prefix no other node cleaned to the same offset."""
    return [f"node {nodes[0]}: prefix cleaned below offset {end} compared with no other node (none cleaned "
            "to exactly that offset)" for end, nodes in cleaned_groups(layouts).items() if len(nodes) == 1]


RAW = -1  # comparison class of the offsets a node holds as written (not cleaned)


def find_divergences(entries: DataFrame, committed: int, layouts: dict[str, LogLayout],
                     spark: SparkSession) -> DataFrame:
    """Every (node, offset) below ``committed`` where a node holds a different record than
    the majority of the nodes it is compared with there, or lacks the offset inside the range
    it is expected to hold. Columns: node, offset, epoch, reason, expected_epoch.

    Who is compared with whom at an offset (docs/compaction.md): the cleaner rewrites the
    prefix below a node's cleaned end, deterministically, so
    - where a node holds records as written (offset >= its cleaned end), it is compared with
      every node that also holds that offset as written: class RAW;
    - below its cleaned end, only with nodes that cleaned to exactly the same offset, whose
      cleaned prefixes must then be identical, holes included: class = that cleaned end.
    A node cleaned further than another is therefore never a divergence by itself."""
    records = (entries.filter((F.col("op_index") == 0) & F.col("offset").isNotNull() & (F.col("offset") < committed))
               .select("node", "offset", "epoch", "control", "record_digest"))
    layout_rows = [(node, layout.start_offset, layout.cleaned_end) for node, layout in layouts.items()]
    layout_frame = spark.createDataFrame(layout_rows, "node string, log_start long, cleaned_end long")
    held_span = records.groupBy("node").agg(F.min("offset").alias("first"), F.max("offset").alias("last"))
    nodes = F.broadcast(held_span.join(layout_frame, "node"))
    raw_spans = nodes.select("node", F.lit(RAW).cast("long").alias("class"),
                             F.greatest("first", "cleaned_end").alias("start"), F.col("last").alias("end"))
    cleaned_spans = nodes.filter(F.col("cleaned_end") > 0).select(
        "node", F.col("cleaned_end").alias("class"), F.greatest("log_start", F.lit(0)).alias("start"),
        F.least(F.col("cleaned_end") - 1, F.col("last")).alias("end"))
    spans = F.broadcast(raw_spans.unionByName(cleaned_spans).filter(F.col("start") <= F.col("end")))
    classified = records.join(F.broadcast(layout_frame.select("node", "cleaned_end")), "node").withColumn(
        "class", F.when(F.col("offset") < F.col("cleaned_end"), F.col("cleaned_end")).otherwise(F.lit(RAW)))
    offsets = classified.select("offset", "class").distinct()
    expected = offsets.join(spans, (offsets["class"] == spans["class"]) & (offsets["offset"] >= spans["start"])
                            & (offsets["offset"] <= spans["end"])).select("node", "offset", offsets["class"])
    held = expected.join(classified.drop("class", "cleaned_end"), ["node", "offset"], "left").withColumn(
        "signature", F.when(F.col("record_digest").isNotNull(),
                            F.concat_ws(":", F.col("epoch").cast("string"), F.col("control").cast("string"),
                                        F.col("record_digest"))))
    votes = held.groupBy("offset", "class", "signature").agg(F.count("*").alias("votes"),
                                                              F.min("node").alias("first_node"))
    ranked = votes.withColumn("rank", F.row_number().over(
        Window.partitionBy("offset", "class").orderBy(F.col("votes").desc(), F.col("signature").isNull(),
                                                      F.col("first_node"))))
    majority = ranked.filter(F.col("rank") == 1).select(
        "offset", "class", F.col("signature").alias("majority_signature"))
    expected_epoch = records.groupBy("offset", "epoch").count().withColumn(
        "rank", F.row_number().over(Window.partitionBy("offset").orderBy(F.col("count").desc(), "epoch"))
    ).filter(F.col("rank") == 1).select("offset", F.col("epoch").alias("expected_epoch"))
    diverged = held.join(majority, ["offset", "class"]).filter(
        ~F.col("signature").eqNullSafe(F.col("majority_signature")))
    return diverged.join(expected_epoch, "offset", "left").select(
        "node", "offset", F.coalesce("epoch", "expected_epoch").alias("epoch"),
        F.when(F.col("signature").isNull(), F.lit("record missing"))
        .when(F.col("majority_signature").isNull(), F.lit("record not held by the majority"))
        .otherwise(F.lit("record differs from the majority")).alias("reason"),
        "expected_epoch")


def audit_markdown(summary: dict[str, object]) -> str:
    lines = ["# metakv log audit", "", f"Committed version compared: {summary['committed_version']}", "",
             "| node | first offset | last offset | records | skipped regions |", "| --- | --- | --- | --- | --- |"]
    for row in summary["nodes"]:  # type: ignore[attr-defined]
        lines.append(f"| {row['node']} | {row['first_offset']} | {row['last_offset']} | {row['records']} "
                     f"| {row['skipped_regions']} |")
    first = summary.get("first_divergence")
    lines.append("")
    if first:
        lines.append(f"**Diverged**: first at node {first['node']}, offset {first['offset']}, "  # type: ignore[index]
                     f"epoch {first['epoch']} ({first['reason']}); "  # type: ignore[index]
                     f"{summary['divergent_records']} divergent record(s).")
    else:
        lines.append("**Identical**: every committed record matches on every replica.")
    return "\n".join(lines) + "\n"
