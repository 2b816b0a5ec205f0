"""Compaction benchmark: ``python -m loadtest.bench_compaction [--keys N] [--out FILE]``.

Measures, in one run on this machine:

1. cleaner throughput (MB/s of log cleaned: read the prefix, storage/cleaner.py's
   clean_prefix, SegmentLog.replace_prefix) next to the raw sequential read speed of the same
   segment files (plain ``read`` calls, page cache warm, as the cleaner sees them): a first
   pass over a raw log (with clean_prefix's CPU time per record, every record evaluated),
   then incremental passes (10% new records over a cleaned log);
2. log bytes per live-data byte after a long churn run over a fixed key set, with the
   cleaner run between rounds, and without it;
3. the time a fresh observer needs to bootstrap ``--keys`` keys by snapshot (copy the
   snapshot chunk by chunk through the real SnapshotStore, verify, load) vs by replaying the
   full log into an empty state machine.

Prints the figures and writes them as JSON (default results/bench_compaction.json).
Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from raft.types import Batch, check
from storage.cleaner import clean_prefix
from storage.commands import Command, Op, OpKind, decode_command, encode_command, put
from storage.segment_log import SegmentLog
from storage.snapshot_store import SnapshotStore
from storage.state_machine import StateMachine

RECORDS_PER_BATCH = 500
READ_CHUNK_BYTES = 1024 * 1024
SNAPSHOT_CHUNK_BYTES = 1024 * 1024


def _write_log(log: SegmentLog, commands: list[bytes], epoch: int = 1) -> None:
    for start in range(0, len(commands), RECORDS_PER_BATCH):
        records = tuple(commands[start:start + RECORDS_PER_BATCH])
        log.append(Batch(log.end_offset(), epoch, 0, False, records))
    log.flush()


def _churn_commands(rng: random.Random, keys: int, records: int, value_bytes: int) -> list[bytes]:
    """create/update/delete over k0..k{keys-1}: 1 in 8 writes is a delete."""
    commands = []
    for _ in range(records):
        key = f"key/{rng.randrange(keys):08d}"
        if rng.random() < 0.125:
            commands.append(encode_command(Command((), (Op(OpKind.DELETE, key),))))
        else:
            commands.append(encode_command(put(key, rng.randbytes(value_bytes))))
    return commands


def _raw_read_mb_s(paths: list[Path]) -> tuple[float, int]:
    total = 0
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb") as handle:
            while chunk := handle.read(READ_CHUNK_BYTES):
                total += len(chunk)
    elapsed = time.perf_counter() - started
    return total / elapsed / 1e6, total


def _clean(log: SegmentLog, retention: int = 0) -> dict[str, Any]:
    """One cleaning pass as the runtime does it: read the log from its start, clean it to
    its end, install the result. The range below the previous cleaned end is read directly
    (its records are state-independent); only the dirty section above it is evaluated."""
    started = time.perf_counter()
    end = log.end_offset()
    cleaned_before = log.cleaned_end()
    batches = list(log.iter_batches(0))
    bytes_in = sum(b.size_bytes() for b in batches)
    dirty_bytes = sum(b.size_bytes() for b in batches if b.base_offset >= cleaned_before)
    read_s = time.perf_counter() - started
    cpu_started = time.process_time()  # CPU, not wall: the machine may be shared
    result = clean_prefix(batches, end, max(0, end - retention))
    clean_cpu_s = time.process_time() - cpu_started
    clean_s = time.perf_counter() - started - read_s
    log.replace_prefix(result.batches, result.clean_end)
    total_s = time.perf_counter() - started
    return {"bytes_in": bytes_in, "dirty_bytes_in": dirty_bytes,
            "bytes_out": sum(b.size_bytes() for b in result.batches),
            "records_in": result.records_in, "records_out": result.records_out,
            "evaluated_from": result.evaluated_from, "cleaned_before": cleaned_before,
            "read_s": read_s, "clean_s": clean_s, "install_s": total_s - read_s - clean_s, "total_s": total_s,
            "mb_per_s": bytes_in / total_s / 1e6,
            "clean_cpu_us_per_record": clean_cpu_s / max(1, result.records_in) * 1e6}


def _live_bytes(log: SegmentLog) -> int:
    live: dict[str, int] = {}
    for batch in log.iter_batches(0):
        for record in batch.records:
            for op in decode_command(record).success:
                if op.kind == OpKind.PUT:
                    live[op.key] = len(op.key.encode()) + len(op.value)
                elif op.kind == OpKind.DELETE:
                    live.pop(op.key, None)
    return sum(live.values())


def bench_cleaner(work: Path, keys: int, records: int, value_bytes: int, seed: int) -> dict[str, Any]:
    """A first pass over a raw log (every record evaluated), then incremental passes: 10% new
    records each, cleaned together with the already-cleaned section before them."""
    rng = random.Random(seed)
    log = SegmentLog(work / "clean-log", segment_bytes=16 * 1024 * 1024)
    _write_log(log, _churn_commands(rng, keys, records, value_bytes))
    raw_mb_s, raw_bytes = _raw_read_mb_s(log.segment_paths())
    raw_mb_s_second, _ = _raw_read_mb_s(log.segment_paths())
    cleaned = _clean(log)
    passes = []
    for _ in range(3):
        _write_log(log, _churn_commands(rng, keys, records // 10, value_bytes))
        step = _clean(log)
        passes.append({"bytes_in": step["bytes_in"], "dirty_bytes_in": step["dirty_bytes_in"],
                       "records_in": step["records_in"], "evaluated_from": step["evaluated_from"],
                       "cleaned_before": step["cleaned_before"],
                       "breakdown_s": {k: round(step[k], 3) for k in ("read_s", "clean_s", "install_s", "total_s")},
                       "total_s": round(step["total_s"], 3),
                       "mb_per_s": round(step["mb_per_s"], 1),
                       "dirty_mb_per_s": round(step["dirty_bytes_in"] / step["total_s"] / 1e6, 1)})
    log.close()
    return {"keys": keys, "records": records, "value_bytes": value_bytes, "log_bytes": raw_bytes,
            "raw_read_mb_per_s": round(max(raw_mb_s, raw_mb_s_second), 1),
            "cleaner_mb_per_s": round(cleaned["mb_per_s"], 1),
            "cleaner_breakdown_s": {k: round(cleaned[k], 3) for k in ("read_s", "clean_s", "install_s", "total_s")},
            "cleaner_cpu_us_per_record": round(cleaned["clean_cpu_us_per_record"], 2),
            "records_out": cleaned["records_out"], "bytes_out": cleaned["bytes_out"],
            "incremental_passes": passes}


def bench_churn(work: Path, keys: int, rounds: int, records_per_round: int, value_bytes: int,
                seed: int) -> dict[str, Any]:
    rng_a, rng_b = random.Random(seed), random.Random(seed)
    cleaned_log = SegmentLog(work / "churn-cleaned", segment_bytes=8 * 1024 * 1024)
    raw_log = SegmentLog(work / "churn-raw", segment_bytes=8 * 1024 * 1024)
    ratios = []
    for _ in range(rounds):
        _write_log(cleaned_log, _churn_commands(rng_a, keys, records_per_round, value_bytes))
        _write_log(raw_log, _churn_commands(rng_b, keys, records_per_round, value_bytes))
        _clean(cleaned_log)
        live = _live_bytes(cleaned_log)
        ratios.append({"records": cleaned_log.end_offset(), "live_bytes": live,
                       "cleaned_log_per_live": round(cleaned_log.size_bytes() / live, 2),
                       "uncleaned_log_per_live": round(raw_log.size_bytes() / live, 2)})
    cleaned_log.close()
    raw_log.close()
    return {"keys": keys, "rounds": rounds, "records_per_round": records_per_round, "value_bytes": value_bytes,
            "by_round": ratios, "final": ratios[-1]}


def _replay(log: SegmentLog, state: StateMachine, records: int) -> None:
    """Apply the whole log from offset 0, 8 MiB of batches per state machine transaction."""
    offset = 0
    while offset < records:
        batches = log.read(offset, 8 * 1024 * 1024)
        state.apply(batches)
        offset = batches[-1].next_offset


def bench_bootstrap(work: Path, keys: int, value_bytes: int, update_fraction: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    log = SegmentLog(work / "boot-log", segment_bytes=64 * 1024 * 1024)
    commands = [encode_command(put(f"key/{index:08d}", rng.randbytes(value_bytes))) for index in range(keys)]
    commands += [encode_command(put(f"key/{rng.randrange(keys):08d}", rng.randbytes(value_bytes)))
                 for _ in range(int(keys * update_fraction))]
    _write_log(log, commands)
    records = log.end_offset()

    leader_state = StateMachine(str(work / "leader.db"))
    _replay(log, leader_state, records)
    check_applied = leader_state.applied_version
    leader_store = SnapshotStore(str(work / "leader-snapshots"))
    snapshot_started = time.perf_counter()
    snapshot_id = leader_state.create_snapshot(leader_store)
    snapshot_take_s = time.perf_counter() - snapshot_started
    leader_state.close()

    # By snapshot: chunked copy through the observer's store (verify size, CRC, id), load.
    started = time.perf_counter()
    observer_store = SnapshotStore(str(work / "observer-snapshots"))
    size = leader_store.size_bytes(snapshot_id)
    observer_store.begin_download(snapshot_id, size)
    position = 0
    while position < size:
        chunk = leader_store.read_chunk(snapshot_id, position, SNAPSHOT_CHUNK_BYTES)
        observer_store.write_chunk(snapshot_id, position, chunk)
        position += len(chunk)
    observer_store.finish_download(snapshot_id)
    by_snapshot = StateMachine(str(work / "observer-snap.db"))
    by_snapshot.load_snapshot(observer_store.path_for(snapshot_id))
    snapshot_s = time.perf_counter() - started
    check(by_snapshot.applied_version == check_applied, "snapshot bootstrap reached another version")
    by_snapshot.close()

    # By replaying the full log from offset 0 (read + apply every record).
    started = time.perf_counter()
    by_replay = StateMachine(str(work / "observer-replay.db"))
    _replay(log, by_replay, records)
    replay_s = time.perf_counter() - started
    check(by_replay.applied_version == check_applied, "replay reached another version")
    by_replay.close()
    log_bytes = log.size_bytes()
    log.close()
    return {"keys": keys, "log_records": records, "log_bytes": log_bytes, "snapshot_bytes": size,
            "snapshot_take_s": round(snapshot_take_s, 2), "bootstrap_by_snapshot_s": round(snapshot_s, 2),
            "bootstrap_by_replay_s": round(replay_s, 2), "replay_over_snapshot": round(replay_s / snapshot_s, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_compaction", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000, help="keys for the bootstrap comparison")
    parser.add_argument("--cleaner-records", type=int, default=400_000, help="records in the cleaner throughput log")
    parser.add_argument("--churn-rounds", type=int, default=10)
    parser.add_argument("--churn-records", type=int, default=50_000, help="records per churn round")
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--work-dir", default=None, help="scratch directory (default: a temp dir, removed)")
    parser.add_argument("--out", default="results/bench_compaction.json")
    args = parser.parse_args(argv)
    if args.keys < 1 or args.cleaner_records < 1 or args.churn_rounds < 1 or args.churn_records < 1:
        parser.error("--keys, --cleaner-records, --churn-rounds and --churn-records must be positive")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-compaction-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        cleaner = bench_cleaner(work, 20_000, args.cleaner_records, args.value_bytes, args.seed)
        print(f"cleaner: {cleaner['cleaner_mb_per_s']} MB/s over {cleaner['log_bytes'] / 1e6:.1f} MB "
              f"({cleaner['records']} records -> {cleaner['records_out']}); raw sequential read of the same "
              f"files: {cleaner['raw_read_mb_per_s']} MB/s; breakdown {cleaner['cleaner_breakdown_s']}; "
              f"clean_prefix CPU {cleaner['cleaner_cpu_us_per_record']} µs per record", flush=True)
        for step in cleaner["incremental_passes"]:
            print(f"incremental pass: {step['dirty_bytes_in'] / 1e6:.1f} MB new + "
                  f"{(step['bytes_in'] - step['dirty_bytes_in']) / 1e6:.1f} MB cleaned before, "
                  f"evaluated from offset {step['evaluated_from']} (cleaned end was {step['cleaned_before']}): "
                  f"{step['total_s']} s, {step['mb_per_s']} MB/s of log, {step['dirty_mb_per_s']} MB/s of new "
                  f"records; breakdown {step['breakdown_s']}", flush=True)
        churn = bench_churn(work, 5_000, args.churn_rounds, args.churn_records, args.value_bytes, args.seed)
        final = churn["final"]
        print(f"churn: after {final['records']} records over {churn['keys']} keys: cleaned log "
              f"{final['cleaned_log_per_live']} bytes per live byte, uncleaned {final['uncleaned_log_per_live']}",
              flush=True)
        boot = bench_bootstrap(work, args.keys, args.value_bytes, 0.5, args.seed)
        print(f"bootstrap {boot['keys']} keys: by snapshot {boot['bootstrap_by_snapshot_s']} s "
              f"({boot['snapshot_bytes'] / 1e6:.0f} MB), by replaying {boot['log_records']} records "
              f"({boot['log_bytes'] / 1e6:.0f} MB) {boot['bootstrap_by_replay_s']} s "
              f"({boot['replay_over_snapshot']}x)", flush=True)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    shown = sys.argv[1:] if argv is None else argv
    results = {"command": " ".join(["python -m loadtest.bench_compaction", *shown]),
               "cpu_count": os.cpu_count(), "cleaner": cleaner, "churn": churn, "bootstrap": boot}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
