"""fsync against fdatasync of small writes, on the file system the log lives on: which layout
of a segment file makes a 300-byte commit cheapest to make durable.

    python -m loadtest.bench_fsync [--writes 300] [--write-bytes 300] [--dir DIR] [--json PATH]

Three layouts, each written ``--write-bytes`` at a time, sequentially, and synced after every
write:

- ``growing``: appended to (every write grows the file: its size, so its inode, changes);
- ``fallocated``: preallocated with ``posix_fallocate`` (unwritten extents), overwritten in place;
- ``zero-filled``: preallocated by writing zeros (a page per write) and fsyncing once,
  overwritten in place;

each synced with ``fsync`` and with ``fdatasync`` (six files). The six take turns write by
write, so load from other processes hits them alike, in three arrival patterns:

- ``back-to-back``: the next write right after the previous sync returned;
- ``random-gaps``: a uniform 0-4 ms pause before each write (requests arriving at random);
- ``beside-2-syncers``: random gaps, while two other processes append and fsync their own
  files in a loop (the two other nodes of a local cluster, SQLite commits);
- ``beside-a-napper``: back to back, while another process sleeps 50 µs in a loop, so a CPU
  never stays idle for long (on a VM, an idle vCPU may only see the disk's completion at the
  next timer tick: this pattern tells that wait from the disk's own).

Prints median and p99 in ms, each median as a ratio to ``growing + fsync`` of the same
pattern (what the segment log does), and the bytes each write+sync sent to storage (this
process's /proc/self/io; the journal's own writes are the kernel's, not counted). ``--dir`` defaults to the temporary directory, the one
tests and benchmarks put their data directories in.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path

MIB = 1024 * 1024
PAGE_BYTES = 4096
LAYOUTS = ("growing", "fallocated", "zero-filled")
SYNCS: dict[str, Callable[[int], None]] = {"fsync": os.fsync, "fdatasync": os.fdatasync}
PATTERNS = ("back-to-back", "random-gaps", "beside-2-syncers", "beside-a-napper")
MAX_GAP_S = 0.004


@dataclass(slots=True)
class Target:
    """One file under test: its layout and sync call, and where the next write goes."""

    name: str  # "<layout> + <sync>"
    sync: Callable[[int], None]
    fd: int
    position: int = 0
    bytes_written: int = 0  # what its writes sent to the disk (page cache writeback included)


def open_target(directory: Path, layout: str, sync: str, file_bytes: int) -> Target:
    fd = os.open(directory / f"{layout}-{sync}.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    if layout == "fallocated":
        os.posix_fallocate(fd, 0, file_bytes)
    elif layout == "zero-filled":
        # Page by page: on kernels with large page-cache folios (6.18 here), zeros written in
        # 1 MiB writes land in 1 MiB folios, and every later 300-byte write dirties, and
        # every fdatasync then writes back, a whole MiB.
        zeros = bytes(PAGE_BYTES)
        for position in range(0, file_bytes, PAGE_BYTES):
            os.pwrite(fd, zeros, position)
    os.fsync(fd)
    return Target(f"{layout} + {sync}", SYNCS[sync], fd)


def bytes_written() -> int:
    """Bytes this process has caused to be written to storage (/proc/self/io write_bytes)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def append_and_fsync_until(path: Path, stop: Event) -> None:
    """A neighbour on the same disk: appends 300 bytes and fsyncs, at random gaps, until stopped."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    payload = os.urandom(300)
    try:
        while not stop.is_set():
            os.write(fd, payload)
            os.fsync(fd)
            time.sleep(random.uniform(0, MAX_GAP_S))
    finally:
        os.close(fd)


def nap_until(stop: Event) -> None:
    """A neighbour that keeps a CPU from idling long: 50 µs sleeps in a loop, until stopped."""
    while not stop.is_set():
        time.sleep(0.00005)


def start_neighbours(directory: Path, pattern: str, stop: Event) -> list[multiprocessing.Process]:
    if pattern == "beside-2-syncers":
        neighbours = [multiprocessing.Process(target=append_and_fsync_until, args=(directory / f"neighbour-{n}", stop))
                      for n in range(2)]
    elif pattern == "beside-a-napper":
        neighbours = [multiprocessing.Process(target=nap_until, args=(stop,))]
    else:
        neighbours = []
    for neighbour in neighbours:
        neighbour.start()
    return neighbours


def measure_pattern(directory: Path, pattern: str, writes: int,
                    write_bytes: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per file: each write+sync's ms, and the bytes written to storage per write."""
    file_bytes = max(MIB, (writes * write_bytes // MIB + 1) * MIB)
    targets = [open_target(directory, layout, sync, file_bytes) for layout in LAYOUTS for sync in SYNCS]
    directory_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)
    stop = multiprocessing.Event()
    neighbours = start_neighbours(directory, pattern, stop)
    payload = os.urandom(write_bytes)
    samples: dict[str, list[float]] = {target.name: [] for target in targets}
    try:
        for _ in range(writes):
            for target in targets:
                if pattern in ("random-gaps", "beside-2-syncers"):
                    time.sleep(random.uniform(0, MAX_GAP_S))
                written_before = bytes_written()
                started = time.perf_counter()
                os.pwrite(target.fd, payload, target.position)
                target.sync(target.fd)
                samples[target.name].append((time.perf_counter() - started) * 1000)
                target.bytes_written += bytes_written() - written_before
                target.position += write_bytes
    finally:
        stop.set()
        for neighbour in neighbours:
            neighbour.join(timeout=10)
        for target in targets:
            os.close(target.fd)
    return samples, {target.name: target.bytes_written / writes for target in targets}


def summarize(samples: dict[str, list[float]], bytes_per_write: dict[str, float]) -> dict[str, dict[str, float]]:
    baseline = statistics.median(samples["growing + fsync"])
    return {name: {"p50_ms": statistics.median(values), "p99_ms": percentile(values, 0.99),
                   "p50_ratio_to_growing_fsync": statistics.median(values) / baseline,
                   "bytes_written_per_write": bytes_per_write[name]}
            for name, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_fsync", description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=300, help="writes (and syncs) per file and pattern")
    parser.add_argument("--write-bytes", type=int, default=300)
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: the temp dir)")
    parser.add_argument("--json", type=Path, default=Path("results/bench_fsync.json"))
    args = parser.parse_args(argv)
    if args.writes <= 0 or args.write_bytes <= 0:
        parser.error("--writes and --write-bytes must be positive")
    report: dict[str, object] = {"writes": args.writes, "write_bytes": args.write_bytes,
                                 "load_before": os.getloadavg()[0], "patterns": {}}
    with tempfile.TemporaryDirectory(prefix="metakv-fsync-", dir=args.dir) as directory:
        print(f"{args.writes} writes of {args.write_bytes} B per file and pattern, in {directory} "
              f"(st_dev {os.stat(directory).st_dev}), load {os.getloadavg()[0]:.1f}")
        print(f"{'pattern':17} {'file + sync':24} {'p50 ms':>7} {'p99 ms':>7} {'p50 ÷ growing+fsync':>20} "
              f"{'bytes written':>13}")
        for pattern in PATTERNS:
            pattern_dir = Path(directory) / pattern
            pattern_dir.mkdir()
            results = summarize(*measure_pattern(pattern_dir, pattern, args.writes, args.write_bytes))
            report["patterns"][pattern] = results  # type: ignore[index]
            for name, figures in results.items():
                print(f"{pattern:17} {name:24} {figures['p50_ms']:7.3f} {figures['p99_ms']:7.3f} "
                      f"{figures['p50_ratio_to_growing_fsync']:20.2f} {figures['bytes_written_per_write']:13.0f}",
                      flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
