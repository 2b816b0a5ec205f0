"""Storage benchmark: append+fsync throughput and latency next to a raw fsync floor, and
recovery speed when opening a large log.

    python -m loadtest.bench_storage [--log-bytes 1073741824] [--json PATH] [--dir DIR]

For each batch size (1, 10, 100, 1000 records of 256 bytes) it times SegmentLog.append +
flush, and, in the same run and on the same file system, the floor: os.write + os.fsync of
the very same encoded bytes to a plain file. The two alternate fsync by fsync, so that load
from other processes hits both alike. The target is the log's time per fsync within 1.3x of
the floor's (the median ratio is the robust figure on a shared machine).

Recovery: writes a log of --log-bytes (batches of 100 records of 256 bytes, 64 MiB
segments) into a temporary directory, then times opening it with every sealed segment
verified (the default) and with sealed segments trusted through their index; both figures
are stated as MB/s of log. The page cache is warm (the log was just written): this measures
the CPU cost of recovery, not the disk. The directory is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from raft.types import Batch
from storage.batch_codec import encode_batch
from storage.segment_log import DEFAULT_SEGMENT_BYTES, SegmentLog

RECORD_BYTES = 256
BATCH_SIZES = (1, 10, 100, 1000)
FSYNCS_PER_BATCH_SIZE = {1: 400, 10: 400, 100: 300, 1000: 300}
RECOVERY_BATCH_RECORDS = 100
MIB = 1024 * 1024


def make_batch(base_offset: int, record_count: int) -> Batch:
    record = os.urandom(RECORD_BYTES)
    return Batch(base_offset, 1, int(time.time() * 1000), False, (record,) * record_count)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def time_log_fsync(log: SegmentLog, record_count: int) -> float:
    batch = make_batch(log.end_offset(), record_count)
    started = time.perf_counter()
    log.append(batch)
    log.flush()
    return time.perf_counter() - started


def time_floor_fsync(fd: int, encoded: bytes) -> float:
    started = time.perf_counter()
    os.write(fd, encoded)
    os.fsync(fd)
    return time.perf_counter() - started


def summarize(latencies_s: list[float], record_count: int, batch_bytes: int) -> dict[str, float]:
    mean_s = statistics.fmean(latencies_s)
    return {
        "fsyncs": len(latencies_s),
        "latency_ms_mean": mean_s * 1000,
        "latency_ms_p50": percentile(latencies_s, 0.5) * 1000,
        "latency_ms_p99": percentile(latencies_s, 0.99) * 1000,
        "records_per_s": record_count / mean_s,
        "mb_per_s": batch_bytes / mean_s / MIB,
    }


def bench_append(work_dir: Path) -> list[dict[str, object]]:
    results = []
    for record_count in BATCH_SIZES:
        log_dir = work_dir / f"append-{record_count}"
        floor_path = work_dir / f"floor-{record_count}.bin"
        encoded = encode_batch(make_batch(0, record_count))
        log = SegmentLog(log_dir)
        fd = os.open(floor_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        log_latencies: list[float] = []
        floor_latencies: list[float] = []
        try:
            for _ in range(3):  # warm up: file creation, first fsyncs
                time_log_fsync(log, record_count)
                time_floor_fsync(fd, encoded)
            for _ in range(FSYNCS_PER_BATCH_SIZE[record_count]):
                # Interleaved one by one, so that load from other processes hits both alike.
                log_latencies.append(time_log_fsync(log, record_count))
                floor_latencies.append(time_floor_fsync(fd, encoded))
        finally:
            log.close()
            os.close(fd)
            shutil.rmtree(log_dir, ignore_errors=True)
            floor_path.unlink(missing_ok=True)
        log_summary = summarize(log_latencies, record_count, len(encoded))
        floor_summary = summarize(floor_latencies, record_count, len(encoded))
        results.append({
            "records_per_batch": record_count,
            "record_bytes": RECORD_BYTES,
            "batch_bytes": len(encoded),
            "segment_log": log_summary,
            "raw_floor": floor_summary,
            "ratio_to_floor_mean": log_summary["latency_ms_mean"] / floor_summary["latency_ms_mean"],
            "ratio_to_floor_p50": log_summary["latency_ms_p50"] / floor_summary["latency_ms_p50"],
        })
    return results


def write_recovery_log(log_dir: Path, log_bytes: int) -> int:
    with SegmentLog(log_dir, segment_bytes=DEFAULT_SEGMENT_BYTES) as log:
        batch = make_batch(0, RECOVERY_BATCH_RECORDS)
        while log.size_bytes() < log_bytes:
            batch = Batch(log.end_offset(), 1, batch.timestamp_ms, False, batch.records)
            log.append(batch)
        log.flush()
        return log.size_bytes()


def time_open(log_dir: Path, verify: bool) -> float:
    started = time.perf_counter()
    log = SegmentLog(log_dir, verify_sealed_segments=verify)
    elapsed_s = time.perf_counter() - started
    log.close()
    return elapsed_s


def bench_recovery(work_dir: Path, log_bytes: int) -> dict[str, float]:
    log_dir = work_dir / "recovery"
    try:
        size_bytes = write_recovery_log(log_dir, log_bytes)
        verified_s = time_open(log_dir, verify=True)
        indexed_s = time_open(log_dir, verify=False)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return {
        "log_bytes": size_bytes,
        "open_verified_s": verified_s,
        "open_verified_mb_per_s": size_bytes / verified_s / MIB,
        "open_indexed_s": indexed_s,
        "open_indexed_mb_per_s": size_bytes / indexed_s / MIB,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_storage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-bytes", type=int, default=1024 * MIB, help="size of the recovery log (default 1 GiB)")
    parser.add_argument("--json", type=Path, default=Path("loadtest/results/bench_storage.json"),
                        help="where to write the figures")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: the system temp dir)")
    args = parser.parse_args(argv)
    work_dir = Path(tempfile.mkdtemp(prefix="metakv-bench-storage-", dir=args.dir))
    try:
        append_results = bench_append(work_dir)
        print(f"append+fsync, {RECORD_BYTES}-byte records (ms per fsync: mean / p50 / p99; "
              "floor = os.write+os.fsync of the same bytes)")
        for row in append_results:
            log_row, floor_row = row["segment_log"], row["raw_floor"]
            print(f"  {row['records_per_batch']:>5} rec/batch: log {log_row['latency_ms_mean']:6.2f} / "
                  f"{log_row['latency_ms_p50']:6.2f} / {log_row['latency_ms_p99']:6.2f}, "
                  f"{log_row['records_per_s']:>9.0f} rec/s | floor {floor_row['latency_ms_mean']:6.2f} / "
                  f"{floor_row['latency_ms_p50']:6.2f} / {floor_row['latency_ms_p99']:6.2f} | "
                  f"ratio mean {row['ratio_to_floor_mean']:.2f}x, p50 {row['ratio_to_floor_p50']:.2f}x")
        recovery = bench_recovery(work_dir, args.log_bytes)
        print(f"recovery of a {recovery['log_bytes'] / MIB:.0f} MiB log: verified open "
              f"{recovery['open_verified_s']:.2f} s ({recovery['open_verified_mb_per_s']:.0f} MB/s), "
              f"index-trusting open {recovery['open_indexed_s']:.2f} s "
              f"({recovery['open_indexed_mb_per_s']:.0f} MB/s)")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"append": append_results, "recovery": recovery}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
