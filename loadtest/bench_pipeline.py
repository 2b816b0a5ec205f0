"""Benchmark: records decoded per second by the pipeline's reader on Spark local[1] and
local[2], against a plain single-process Python reader of the same files, in one run.

    python -m loadtest.bench_pipeline --records 10000000 [--sizes 10000,100000,1000000]
        [--json-out results/bench_pipeline.json] [--data-dir DIR] [--keep]

All three paths decode with the same functions (pipeline/decode.py over
storage/batch_codec.py): every batch CRC-checked, every record decoded to its operations.
Spark's cost is a fixed start-up (JVM, session, Python workers) plus a per-record cost; the
plain reader has no start-up. For each log size the benchmark times both, and from the
largest size it derives the log size from which Spark (start-up included) wins, if it does.
Prints the figures and writes them as JSON. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.decode import ENTRY_COLUMNS, decode_segment_chunks
from pipeline.synthetic import workload, write_segments
from raft.types import Batch

BENCH_SEGMENT_BYTES = 16 * 1024 * 1024  # several files per large log, so local[2] has two to read at once
SEED = 20_260_101
OP_INDEX_COLUMN = [name for name, _ in ENTRY_COLUMNS].index("op_index")


@dataclass
class Measurement:
    records: int
    log_bytes: int
    segments: int
    reader: str
    startup_s: float
    decode_s: float

    @property
    def records_per_s(self) -> float:
        return self.records / self.decode_s if self.decode_s else 0.0


POOL_RECORDS = 200_000  # distinct generated records; larger logs repeat them at new offsets


def _repeated_workload(records: int) -> Iterator[Batch]:
    """The seeded workload, its first POOL_RECORDS records repeated at increasing offsets,
    epochs and timestamps: the same mix of puts, deletes and txns, generated once, so a
    10-million-record log is written in seconds rather than spending minutes in the generator."""
    pool = list(workload(SEED, min(records, POOL_RECORDS)))
    span_ms = pool[-1].timestamp_ms - pool[0].timestamp_ms + 1
    round_index = 0
    offset = 0
    while offset < records:
        for batch in pool:
            if offset >= records:
                return
            kept = batch.records[: records - offset]
            yield Batch(offset, batch.epoch + round_index * pool[-1].epoch, batch.timestamp_ms + round_index * span_ms,
                        batch.control, kept)
            offset += len(kept)
        round_index += 1


def make_log(directory: Path, records: int) -> None:
    write_segments(str(directory / "bench" / "log"), _repeated_workload(records), BENCH_SEGMENT_BYTES)


def log_size(directory: Path) -> tuple[int, int]:
    files = list((directory / "bench" / "log").glob("*.log"))
    return sum(f.stat().st_size for f in files), len(files)


def plain_python(directory: Path) -> tuple[int, float]:
    """Single process: read each file, decode every batch and record, count records."""
    started = time.perf_counter()
    records = 0
    for path in sorted((directory / "bench" / "log").glob("*.log")):
        for chunk in decode_segment_chunks("bench", path.name, path.read_bytes(), False):
            records += sum(1 for row in chunk if row[OP_INDEX_COLUMN] == 0)  # one row per record has op_index 0
    return records, time.perf_counter() - started


def spark_run(master: str, directories: list[Path]) -> list[tuple[int, float, float]]:
    """(records, startup seconds, decode seconds) per directory, one session for them all.
    Start-up counts the session, the Python workers and one warm-up pass over the smallest
    log (JVM class loading and code generation): the fixed cost any first job pays."""
    from pyspark.sql import functions as F

    from pipeline.fs import HadoopFS
    from pipeline.reader import discover, read_entries
    from pipeline.session import SparkSettings, build_session

    started = time.perf_counter()
    spark = build_session(SparkSettings(master=master, driver_memory="2g"))
    results = []
    try:
        fs = HadoopFS(spark)
        read_entries(spark, discover(fs, [str(directories[0] / "bench")])).filter(F.col("op_index") == 0).count()
        startup_s = time.perf_counter() - started
        for directory in directories:
            started = time.perf_counter()
            nodes = discover(fs, [str(directory / "bench")])
            records = read_entries(spark, nodes).filter(F.col("op_index") == 0).count()
            results.append((records, startup_s, time.perf_counter() - started))
    finally:
        spark.stop()
    return results


def spark_in_subprocess(master: str, directories: list[Path]) -> list[tuple[int, float, float]]:
    """Each master in its own process, so neither inherits the other's warm JVM."""
    command = [sys.executable, "-m", "loadtest.bench_pipeline", "--spark-worker", master,
               *[str(d) for d in directories]]
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    return [tuple(item) for item in json.loads(done.stdout.strip().splitlines()[-1])]  # type: ignore[misc]


def crossover_records(plain: Measurement, spark: Measurement) -> int | None:
    """The log size from which Spark, start-up included, beats the plain reader (linear model
    fitted at the largest size); None when Spark's per-record rate is not higher."""
    plain_s_per_record = plain.decode_s / plain.records
    spark_s_per_record = spark.decode_s / spark.records
    if spark_s_per_record >= plain_s_per_record:
        return None
    return int(spark.startup_s / (plain_s_per_record - spark_s_per_record)) + 1


def measured_crossover(measurements: list[Measurement], master: str) -> int | None:
    """The smallest measured log size at which ``master`` (start-up plus decode) took less
    time than the plain reader, or None."""
    plain = {m.records: m.decode_s for m in measurements if m.reader == "python"}
    wins = [m.records for m in measurements
            if m.reader == master and m.records in plain and m.startup_s + m.decode_s < plain[m.records]]
    return min(wins) if wins else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--sizes", default="10000,100000,1000000",
                        help="smaller log sizes measured too (comma-separated); --records is always measured")
    parser.add_argument("--json-out", default="results/bench_pipeline.json")
    parser.add_argument("--data-dir", default=None, help="where to write the logs (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the generated logs")
    parser.add_argument("--spark-worker", nargs="+", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.spark_worker:
        master, *paths = args.spark_worker
        print(json.dumps(spark_run(master, [Path(p) for p in paths])))
        return 0
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()} | {args.records})
    if any(s <= 0 for s in sizes):
        print("bench_pipeline: error: sizes must be positive", file=sys.stderr)
        return 2
    root = Path(args.data_dir or tempfile.mkdtemp(prefix="metakv-bench-pipeline-"))
    directories = []
    try:
        for size in sizes:
            directory = root / f"records-{size}"
            if not (directory / "bench" / "log").exists():
                started = time.perf_counter()
                make_log(directory, size)
                print(f"generated {size} records in {time.perf_counter() - started:.1f}s", flush=True)
            directories.append(directory)
        load_before = os.getloadavg()
        print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} "
              f"({os.cpu_count()} cores)", flush=True)
        measurements: list[Measurement] = []
        for directory in directories:
            records, decode_s = plain_python(directory)
            log_bytes, segments = log_size(directory)
            measurements.append(Measurement(records, log_bytes, segments, "python", 0.0, decode_s))
            print(f"python     {records:>10} records {log_bytes / 2**20:8.1f} MiB: {decode_s:8.2f}s "
                  f"{records / decode_s:12.0f} records/s", flush=True)
        for master in ("local[1]", "local[2]"):
            for (records, startup_s, decode_s), directory in zip(spark_in_subprocess(master, directories), directories,
                                                                   strict=True):
                log_bytes, segments = log_size(directory)
                measurements.append(Measurement(records, log_bytes, segments, master, startup_s, decode_s))
                print(f"{master:10} {records:>10} records {log_bytes / 2**20:8.1f} MiB: {decode_s:8.2f}s "
                      f"{records / decode_s:12.0f} records/s (session start-up {startup_s:.1f}s)", flush=True)
        largest = {m.reader: m for m in measurements if m.records == max(x.records for x in measurements)}
        crossover = {master: crossover_records(largest["python"], largest[master]) for master in ("local[1]", "local[2]")}
        measured = {master: measured_crossover(measurements, master) for master in ("local[1]", "local[2]")}
        for master, records in crossover.items():
            verdict = (f"wins from about {records} records (start-up included, fitted at the largest size)" if records
                       else "does not beat the plain reader at any size on this machine")
            smallest = (f"smallest measured size it won at: {measured[master]}" if measured[master]
                        else "won at no measured size")
            print(f"{master}: {verdict}; {smallest}")
        load_after = os.getloadavg()
        print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
        document = {
            "benchmark": "pipeline_decode", "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
            "load_average_before": list(load_before), "load_average_after": list(load_after),
            "measurements": [dict(asdict(m), records_per_s=m.records_per_s) for m in measurements],
            "crossover_records": crossover, "smallest_measured_win_records": measured,
        }
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {out}")
    finally:
        if not args.keep and args.data_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
