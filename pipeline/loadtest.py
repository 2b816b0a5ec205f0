"""The loadtest job: many load-test result folders -> percentile tables per operation and
target (and scenario, churn level and whether the run killed the leader mid-run).

A result folder (written by ``python -m loadtest run``) holds ``run.json`` (scenario,
target, churn, ...) and Locust's ``--csv`` files: ``*_stats.csv`` (one row per operation
with the 50%..100% response-time percentiles) and ``*_stats_history.csv`` (the same over
time). Percentiles of different runs cannot be averaged; they are merged by treating each
run's published percentiles as its distribution: a run with n requests puts n * 0.50 of its
mass at its p50, n * (0.66 - 0.50) at its p66, ..., n * (1 - 0.9999) at its max. The merged
pXX is the smallest value whose cumulative mass reaches XX% of all requests. For one run
this returns exactly its own percentiles; for several it is an upper bound that never
invents a latency no run reported.
"""

from __future__ import annotations

import argparse
import re

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.window import Window

from pipeline.errors import EXIT_OK, PipelineInputError
from pipeline.fs import Entry, HadoopFS, StagedOutput, qualify

LOCUST_QUANTILES = (("50%", 0.50), ("66%", 0.66), ("75%", 0.75), ("80%", 0.80), ("90%", 0.90), ("95%", 0.95),
                    ("98%", 0.98), ("99%", 0.99), ("99.9%", 0.999), ("99.99%", 0.9999), ("100%", 1.0))
REPORTED_QUANTILES = (("p50_ms", 0.50), ("p90_ms", 0.90), ("p95_ms", 0.95), ("p99_ms", 0.99),
                      ("p999_ms", 0.999), ("max_ms", 1.0))
GROUP = ["target", "scenario", "churn", "failover", "operation"]
MASS_TOLERANCE = 1e-9  # cumulative float mass compared against q * requests


def _column_name(header: str) -> str:
    return "q_" + re.sub(r"[^0-9]", "_", header) if header.endswith("%") else re.sub(r"[^a-z0-9]+", "_", header.lower()).strip("_")


def find_result_folders(fs: HadoopFS, inputs: list[str]) -> list[tuple[str, list[Entry]]]:
    """(folder uri, its files) for every folder holding a run.json, at the input or one level down."""
    folders: list[tuple[str, list[Entry]]] = []
    for raw in inputs:
        uri = qualify(raw).rstrip("/")
        if not fs.is_dir(uri):
            raise PipelineInputError(f"{raw}: no such directory")
        entries = fs.list(uri)
        if not entries:
            raise PipelineInputError(f"{raw}: empty directory")
        if any(e.name == "run.json" for e in entries):
            folders.append((uri, entries))
            continue
        children = [(e.uri, fs.list(e.uri)) for e in entries if e.is_dir]
        found = [(u, files) for u, files in children if any(f.name == "run.json" for f in files)]
        if not found:
            raise PipelineInputError(f"{raw}: not a load-test result folder (no run.json here or one level down)")
        folders.extend(found)
    for uri, files in folders:
        if not any(f.name.endswith("_stats.csv") for f in files):
            raise PipelineInputError(f"{uri}: run.json without a Locust *_stats.csv")
    return folders


def read_runs(spark: SparkSession, folders: list[tuple[str, list[Entry]]]) -> DataFrame:
    """One row per (run folder, operation) with the run's labels and Locust figures."""
    stats_paths = [f.uri for _, files in folders for f in files if f.name.endswith("_stats.csv")]
    run_paths = [f.uri for _, files in folders for f in files if f.name == "run.json"]
    stats = spark.read.csv(stats_paths, header=True)
    stats = stats.toDF(*[_column_name(c) for c in stats.columns])
    required = {"type", "name", "request_count", "failure_count", "average_response_time", "requests_s"}
    missing = required - set(stats.columns) | {_column_name(h) for h, _ in LOCUST_QUANTILES} - set(stats.columns)
    if missing:
        raise PipelineInputError(f"Locust stats CSV without the columns {', '.join(sorted(missing))}")
    stats = stats.withColumn("folder", _folder_of_input())
    runs = spark.read.option("multiLine", True).json(run_paths).withColumn("folder", _folder_of_input())
    for label in ("scenario", "target"):
        if label not in runs.columns:
            raise PipelineInputError(f"run.json without \"{label}\"")
    if "_corrupt_record" in runs.columns and runs.filter(F.col("_corrupt_record").isNotNull()).count():
        raise PipelineInputError("a run.json is not a JSON object")
    churn = F.col("churn").cast("string") if "churn" in runs.columns else F.lit(None).cast("string")
    # run.json "failover" is null for a run without one and an object (killed_at, node, ...)
    # when the runner killed the leader: such runs are a population of their own.
    failover = F.col("failover").isNotNull() if "failover" in runs.columns else F.lit(False)
    labels = runs.select("folder", F.col("scenario").cast("string").alias("scenario"),
                         F.col("target").cast("string").alias("target"), churn.alias("churn"),
                         failover.alias("failover"))
    figures = stats.select(
        "folder",
        F.trim(F.concat_ws(" ", F.coalesce(F.col("type"), F.lit("")), F.col("name"))).alias("operation"),
        F.col("request_count").cast("long").alias("requests"),
        F.col("failure_count").cast("long").alias("failures"),
        F.col("average_response_time").cast("double").alias("avg_ms"),
        F.col("requests_s").cast("double").alias("requests_per_s"),
        *[F.col(_column_name(h)).cast("double").alias(_column_name(h)) for h, _ in LOCUST_QUANTILES])
    joined = figures.join(labels, "folder", "left")
    unlabeled = joined.filter(F.col("target").isNull()).select("folder").limit(1).collect()
    if unlabeled:
        raise PipelineInputError(f"{unlabeled[0].folder}: stats without a matching run.json")
    return joined


def _folder_of_input() -> F.Column:
    return F.regexp_replace(F.regexp_replace(F.input_file_name(), r"/[^/]*$", ""), r"^file:/+", "/")


def merge_percentiles(runs: DataFrame) -> DataFrame:
    """Merged percentiles per GROUP (module docstring)."""
    with_requests = runs.filter(F.col("requests") > 0)
    masses = []
    previous = 0.0
    for header, quantile in LOCUST_QUANTILES:
        masses.append(F.struct(F.col(_column_name(header)).alias("value_ms"),
                               (F.col("requests") * F.lit(quantile - previous)).alias("mass")))
        previous = quantile
    points = with_requests.select(*GROUP, F.explode(F.array(*masses)).alias("point")).select(
        *GROUP, "point.value_ms", "point.mass").filter(F.col("value_ms").isNotNull())
    running = Window.partitionBy(*GROUP).orderBy("value_ms").rowsBetween(Window.unboundedPreceding, 0)
    totals = with_requests.groupBy(*GROUP).agg(
        F.count("*").alias("runs"), F.sum("requests").alias("requests"), F.sum("failures").alias("failures"),
        (F.sum(F.col("avg_ms") * F.col("requests")) / F.sum("requests")).alias("avg_ms"),
        F.avg("requests_per_s").alias("requests_per_s_mean"))
    cumulative = points.withColumn("cumulative", F.sum("mass").over(running)).join(totals.select(*GROUP, "requests"), GROUP)
    picks = [F.min(F.when(F.col("cumulative") >= F.col("requests") * F.lit(q) * (1 - MASS_TOLERANCE),
                          F.col("value_ms"))).alias(name) for name, q in REPORTED_QUANTILES]
    merged = cumulative.groupBy(*GROUP).agg(*picks)
    return totals.join(merged, GROUP).withColumn(
        "failure_share", F.col("failures") / (F.col("requests") + F.col("failures")))


def markdown_table(rows: list) -> str:
    lines = ["| target | scenario | churn | failover | operation | runs | requests | failures | avg ms | p50 ms "
             "| p90 ms | p95 ms | p99 ms | p99.9 ms | max ms |",
             "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        figures = " | ".join(f"{getattr(r, name):g}" for name, _ in REPORTED_QUANTILES)
        lines.append(f"| {r.target} | {r.scenario} | {r.churn if r.churn is not None else '-'} "
                     f"| {'yes' if r.failover else 'no'} | {r.operation} "
                     f"| {r.runs} | {r.requests} | {r.failures} | {r.avg_ms:.1f} | {figures} |")
    return "\n".join(lines) + "\n"


def run_loadtest(args: argparse.Namespace, spark: SparkSession, fs: HadoopFS, output: StagedOutput) -> int:
    folders = find_result_folders(fs, args.input)
    runs = read_runs(spark, folders).cache()
    runs.write.parquet(output.path("runs.parquet"))
    merged = merge_percentiles(runs).orderBy(*GROUP)
    merged.write.parquet(output.path("percentiles.parquet"))
    rows = spark.read.parquet(output.path("percentiles.parquet")).orderBy(*GROUP).collect()
    if not rows:
        raise PipelineInputError("no operation with requests in any run")
    table = markdown_table(rows)
    fs.write_bytes(output.path("percentiles.md"), (
        f"# Load-test percentiles over {len(folders)} run(s)\n\nMerged from each run's Locust percentiles "
        "(see docs/pipeline.md: an upper bound for several runs, exact for one).\n\n" + table).encode())
    print(table, end="")
    return EXIT_OK
