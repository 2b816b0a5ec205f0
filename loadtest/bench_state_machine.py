"""Benchmark of the SQLite state machine: apply rate per batch size, point-read rate.

    python -m loadtest.bench_state_machine [--records 50000] [--small-records 5000]
        [--reads 200000] [--small-only] [--out FILE]
    python -m loadtest.bench_state_machine --keys 10k,100k,1M [--out FILE]

Targets (issue 3): apply >= 50,000 records/s for batches of 100 and 1000 records, and
>= 30,000 point reads/s on one thread. Prints the figures and writes them as JSON. Each
apply call gets one batch, the way the runtime applies what one commit advance covers.

The machine this runs on may be shared: besides wall-clock rates, each figure is also given
per CPU-second of this process (all its threads), and the 1-minute load average at start is
recorded; each apply case runs ``--repeat`` times and the best run is reported (all runs'
wall rates are kept in the JSON); ``records_per_apply_thread_cpu_s`` counts only the calling
thread (WAL checkpoints run on a background thread). Apply cost depends on key locality
(SQLite writes whole 4 KiB pages per commit), so three key patterns are measured:
``new_keys`` (every record creates the next key, metadata churn), ``hot_updates`` (puts over
1,000 keys) and ``uniform_updates`` (puts spread uniformly over 50,000 keys: a page of
``key_heads`` per record, were it written in every call; once it lags by
HEADS_FLUSH_RECORDS, each call writes the changed heads of a slice of the keys in key
order, storage/state_heads_sweep.py). The history rows are appended in version order.

Next to each apply case, ``sqlite_floor`` measures what SQLite alone costs for the same
rows: per batch, one transaction that inserts its history rows (values and links to each
key's previous change) and updates the meta row, and once ``key_heads`` lags by
HEADS_FLUSH_RECORDS records, writes the heads apply's sweep writes, with the statement apply
uses (storage/state_schema.py KEY_HEADS_UPSERT_SQL); executemany over precomputed parameters
(no decode, no evaluation, no in-memory index), on the same schema with the same pragmas and a
background checkpoint thread like the state machine's. Apply cannot beat it; the gap
between the two is the state machine's own work.

Small batches (1 and 10 records per apply call, ``--small-records`` records per case) show
the fixed cost of one apply call: on a lightly loaded cluster the leader applies about one
record per commit, on the path before the client is answered. For them the figures that
matter are the call latency (``apply_call_us_p50``) and the CPU per call of the applying
thread (``apply_thread_cpu_us_per_call``). ``--small-only`` runs just these cases.

``--keys`` (issue 19) runs only the scale stages: one store grown to each live key count
in turn (new keys in calls of 1000), and at each stage the cost per operation of apply
(calls of 100 plain PUTs updating existing keys; calls of 100 churn records: updates,
deletes and creates), a point read, a list page of 100, a watch read (``changes`` of the
newest 100 changes) and ``get(at_version=)``, each next to its ratio to the first stage;
the longest single apply call and prune step (history pruned as the runtime does, in
steps of PRUNE_STEP_VERSIONS, down to ``--retain`` versions), and the snapshot copy time.
The last stage also measures the open's CPU time as a kill leaves the store (key_heads
behind) and as a close does, and what the key index holds per key (tracemalloc over
opening the store, which loads it). The store freezes the garbage collector's objects when
created, as a node does once started.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from typing import Any

from raft.types import Batch
from storage.cleaning_run import PRUNE_STEP_VERSIONS
from storage.commands import delete, encode_command, put
from storage.key_index import Head, HeadIndex
from storage.state_heads_sweep import HeadsSweep
from storage.state_machine import (
    CHECKPOINT_EVERY_RECORDS,
    HEADS_FLUSH_RECORDS,
    SQLITE_CACHE_KIB,
    WAL_BACKSTOP_PAGES,
    StateMachine,
    decode_compact,
)
from storage.state_schema import KEY_HEADS_UPSERT_SQL

VALUE_BYTES = 256
APPLY_BATCH_SIZES = (100, 1000)
SMALL_APPLY_BATCH_SIZES = (1, 10)


KEY_PATTERNS = {"new_keys": None, "hot_updates": 1_000, "uniform_updates": 50_000}


def _records(count: int, key_space: int | None, rng: random.Random) -> list[bytes]:
    """``count`` put commands of VALUE_BYTES values; ``key_space`` None means every key new."""
    value = bytes(rng.getrandbits(8) for _ in range(VALUE_BYTES))
    if key_space is None:
        return [encode_command(put(f"bench/key-{index:010d}", value)) for index in range(count)]
    return [encode_command(put(f"bench/key-{rng.randrange(key_space):010d}", value))
            for _ in range(count)]


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def bench_apply(directory: str, pattern: str, batch_records: int, total_records: int,
                run: int = 0) -> dict[str, Any]:
    rng = random.Random(batch_records)
    key_space = KEY_PATTERNS[pattern]
    records = _records(total_records, key_space, rng)
    batches = [Batch(offset, 1, 0, False, tuple(records[offset:offset + batch_records]))
               for offset in range(0, total_records, batch_records)]
    path = os.path.join(directory, f"apply-{pattern}-{batch_records}-{run}.db")
    call_ms: list[float] = []
    with StateMachine(path) as state:
        started = time.perf_counter()
        cpu_started = time.process_time()
        thread_cpu_started = time.thread_time()
        for batch in batches:
            call_started = time.perf_counter()
            state.apply([batch])
            call_ms.append((time.perf_counter() - call_started) * 1000)
        elapsed_s = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
        thread_cpu_s = time.thread_time() - thread_cpu_started
        applied = state.applied_version
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.unlink(path + suffix)
    return {
        "key_pattern": pattern,
        "batch_records": batch_records,
        "records": applied,
        "value_bytes": VALUE_BYTES,
        "key_space": key_space,
        "elapsed_s": round(elapsed_s, 3),
        "records_per_s": round(applied / elapsed_s),
        "cpu_s": round(cpu_s, 3),
        "records_per_cpu_s": round(applied / cpu_s),
        "apply_thread_cpu_s": round(thread_cpu_s, 3),
        "records_per_apply_thread_cpu_s": round(applied / thread_cpu_s),
        "apply_call_ms_p50": round(statistics.median(call_ms), 3),
        "apply_call_ms_p99": round(_percentile(call_ms, 0.99), 3),
        "apply_calls": len(call_ms),
        "apply_call_us_p50": round(statistics.median(call_ms) * 1000, 1),
        "apply_thread_cpu_us_per_call": round(thread_cpu_s / len(call_ms) * 1e6, 1),
    }


# Per batch of the SQL-only floor: its history rows, the key_heads rows apply's sweep writes
# in its call, and the heads_version after it.
FloorBatch = tuple[list[tuple[Any, ...]], list[tuple[str, int, int]], int]


def _floor_rows(records: list[bytes], batch_records: int) -> list[FloorBatch]:
    """Per batch: its history rows linked to each key's previous change, and the key_heads
    rows, as apply writes them (the sweep run on an index of the same heads)."""
    batches: list[FloorBatch] = []
    index = HeadIndex()
    sweep = HeadsSweep()
    heads_version = 0
    for start in range(0, len(records), batch_records):
        history_rows = []
        new_heads: dict[str, Head] = {}
        for offset in range(start, min(start + batch_records, len(records))):
            _compares, ((_kind, key, value, content_type, _create),), _failure = decode_compact(records[offset])
            version = offset + 1
            previous = new_heads.get(key) or index.get(key)
            create_version = previous[0] if previous else version
            history_rows.append((version, 0, key, 1, value, content_type, create_version,
                                 *(previous[1:] if previous else (None, None))))
            new_heads[key] = (create_version, version, 0)
        end_version = history_rows[-1][0]
        step = None
        if end_version - heads_version >= HEADS_FLUSH_RECORDS:
            step = sweep.step(index, new_heads, len(history_rows), start, end_version)
            heads_version = step.heads_version if step.heads_version is not None else heads_version
        sweep.commit(step, new_heads)
        index.update(new_heads)
        batches.append((history_rows, step.rows if step else [], heads_version))
    return batches


def bench_sqlite_floor(directory: str, pattern: str, batch_records: int, total_records: int,
                       run: int = 0) -> dict[str, Any]:
    rng = random.Random(batch_records)  # the very records bench_apply applies
    records = _records(total_records, KEY_PATTERNS[pattern], rng)
    batches = _floor_rows(records, batch_records)
    path = os.path.join(directory, f"floor-{pattern}-{batch_records}-{run}.db")
    StateMachine(path, background_checkpoint=False).close()  # the schema, nothing applied
    connections = [sqlite3.connect(path, isolation_level=None, check_same_thread=False) for _ in range(2)]
    for connection in connections:
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", f"cache_size=-{SQLITE_CACHE_KIB}",
                       "temp_store=MEMORY", f"wal_autocheckpoint={WAL_BACKSTOP_PAGES}"):
            connection.execute(f"PRAGMA {pragma}")
    writer, checkpointer = connections
    wake = threading.Event()
    stopping = False

    def checkpoint_loop() -> None:
        while True:
            wake.wait()
            wake.clear()
            if stopping:
                return
            checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")

    thread = threading.Thread(target=checkpoint_loop, daemon=True)
    thread.start()
    insert_history = ("INSERT INTO history (version, seq, key, op, value, content_type, create_version, "
                      "prev_version, prev_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")
    since_checkpoint = 0
    try:
        started = time.perf_counter()
        cpu_started = time.process_time()
        for history_rows, heads_rows, heads_version in batches:
            end_version = history_rows[-1][0]
            writer.execute("BEGIN IMMEDIATE")
            writer.executemany(insert_history, history_rows)
            if heads_rows:
                writer.executemany(KEY_HEADS_UPSERT_SQL, heads_rows)
            writer.execute("UPDATE meta SET applied_version = ?, heads_version = ? WHERE id = 1",
                           (end_version, heads_version))
            writer.execute("COMMIT")
            since_checkpoint += len(history_rows)
            if since_checkpoint >= CHECKPOINT_EVERY_RECORDS:
                since_checkpoint = 0
                wake.set()
        elapsed_s = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
    finally:
        stopping = True
        wake.set()
        thread.join()
        for connection in connections:
            connection.close()
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.unlink(path + suffix)
    return {"records_per_s": round(total_records / elapsed_s), "records_per_cpu_s": round(total_records / cpu_s)}


def bench_reads(directory: str, key_count: int, reads: int) -> dict[str, Any]:
    rng = random.Random(7)
    path = os.path.join(directory, "reads.db")
    value = b"x" * VALUE_BYTES
    keys = [f"bench/key-{index:010d}" for index in range(key_count)]
    with StateMachine(path) as state:
        for start in range(0, key_count, 1000):
            state.apply([Batch(start, 1, 0, False, tuple(
                encode_command(put(key, value)) for key in keys[start:start + 1000]))])
        lookups = [rng.choice(keys) for _ in range(reads)]
        found = 0
        started = time.perf_counter()
        cpu_started = time.process_time()
        for key in lookups:
            if state.get(key)[1] is not None:
                found += 1
        elapsed_s = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
        misses = [f"missing/{index}" for index in range(reads // 10)]
        miss_started = time.perf_counter()
        for key in misses:
            state.get(key)
        miss_elapsed_s = time.perf_counter() - miss_started
        at_version_reads = reads // 10
        at_started = time.perf_counter()
        for key in lookups[:at_version_reads]:
            state.get(key, at_version=state.applied_version // 2)
        at_elapsed_s = time.perf_counter() - at_started
    return {
        "keys": key_count,
        "reads": reads,
        "found": found,
        "reads_per_s": round(reads / elapsed_s),
        "reads_per_cpu_s": round(reads / cpu_s),
        "miss_reads_per_s": round(len(misses) / miss_elapsed_s),
        "at_version_reads_per_s": round(at_version_reads / at_elapsed_s),
    }


SCALE_BATCH_RECORDS = 100
SCALE_BUILD_BATCH_RECORDS = 1000


def parse_key_counts(text: str) -> list[int]:
    """"10k,100k,1M" -> [10000, 100000, 1000000]."""
    counts = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = {"k": 1_000, "m": 1_000_000}.get(part[-1:], 1)
        counts.append(int(float(part[:-1] if scale > 1 else part) * scale))
    if counts != sorted(counts) or not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError("--keys: growing positive counts, e.g. 10k,100k,1M")
    return counts


def _scale_key(index: int) -> str:
    return f"bench/key-{index:010d}"


class _ScaleStore:
    """One store grown through the stages; it applies at ``offset`` and knows its live keys
    (``live``: key numbers, ``next_key``: the next new one)."""

    def __init__(self, path: str, heads_flush_records: int) -> None:
        self.path = path
        self.heads_flush_records = heads_flush_records
        self.state = StateMachine(path, heads_flush_records=heads_flush_records)
        self.offset = 0
        self.live: list[int] = []
        self.next_key = 0
        self.value = b"v" * VALUE_BYTES
        self.cpu_ms: list[float] = []
        # As a node does once started (app/cli.py): what exists now is out of the collector's
        # reach, so a full collection walks only what the store grew since (as on a node).
        gc.collect()
        gc.freeze()

    def apply(self, records: list[bytes]) -> float:
        """Apply one call; its wall time in ms (its CPU time goes to ``cpu_ms``)."""
        started = time.perf_counter()
        cpu_started = time.thread_time()
        self.state.apply([Batch(self.offset, 1, 0, False, tuple(records))])
        self.cpu_ms.append((time.thread_time() - cpu_started) * 1000)
        self.offset += len(records)
        return (time.perf_counter() - started) * 1000

    def grow_to(self, keys: int) -> float:
        """Create keys until ``keys`` are live; the longest call in ms."""
        longest = 0.0
        while len(self.live) < keys:
            count = min(SCALE_BUILD_BATCH_RECORDS, keys - len(self.live))
            numbers = range(self.next_key, self.next_key + count)
            longest = max(longest, self.apply([encode_command(put(_scale_key(n), self.value)) for n in numbers]))
            self.live.extend(numbers)
            self.next_key += count
        return longest

    def churn_records(self, rng: random.Random, count: int) -> list[bytes]:
        """60 % updates of live keys, 20 % deletes of live keys, 20 % creates."""
        records = []
        for _ in range(count):
            roll = rng.random()
            if roll < 0.6:
                records.append(encode_command(put(_scale_key(rng.choice(self.live)), self.value)))
            elif roll < 0.8:
                position = rng.randrange(len(self.live))
                self.live[position], self.live[-1] = self.live[-1], self.live[position]
                records.append(encode_command(delete(_scale_key(self.live.pop()))))
            else:
                records.append(encode_command(put(_scale_key(self.next_key), self.value)))
                self.live.append(self.next_key)
                self.next_key += 1
        return records


def _timed_calls(calls: int, call: Any) -> tuple[float, float]:
    """(mean wall us, mean CPU us of this thread) per call of ``calls`` calls of ``call(index)``."""
    started = time.perf_counter()
    cpu_started = time.thread_time()
    for index in range(calls):
        call(index)
    return ((time.perf_counter() - started) / calls * 1e6,
            (time.thread_time() - cpu_started) / calls * 1e6)


def bench_scale_stage(store: _ScaleStore, keys: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(keys)
    state = store.state
    build_started = time.perf_counter()
    longest_build_ms = store.grow_to(keys)
    figures: dict[str, Any] = {"keys": keys, "build_s": round(time.perf_counter() - build_started, 1),
                               "longest_build_call_ms": round(longest_build_ms, 1)}
    calls = args.scale_records // SCALE_BATCH_RECORDS
    update_batches = [[encode_command(put(_scale_key(rng.choice(store.live)), store.value))
                       for _ in range(SCALE_BATCH_RECORDS)] for _ in range(calls)]
    for kind, batches in (("update", update_batches), ("churn", None)):
        if batches is None:  # churn records depend on the keys live after the updates
            batches = [store.churn_records(rng, SCALE_BATCH_RECORDS) for _ in range(calls)]
        store.cpu_ms = []
        call_ms = [store.apply(records) for records in batches]
        figures[f"{kind}_us_per_record"] = round(sum(call_ms) * 1000 / args.scale_records, 2)
        figures[f"{kind}_cpu_us_per_record"] = round(sum(store.cpu_ms) * 1000 / args.scale_records, 2)
        figures[f"{kind}_call_ms_p99"] = round(_percentile(call_ms, 0.99), 1)
        figures[f"{kind}_call_ms_max"] = round(max(call_ms), 1)
        figures[f"{kind}_call_cpu_ms_max"] = round(max(store.cpu_ms), 1)
    reads = [_scale_key(rng.choice(store.live)) for _ in range(args.scale_reads)]
    starts = [_scale_key(rng.choice(store.live)) for _ in range(args.scale_reads // 20)]
    since = state.applied_version - 100
    older = state.applied_version - args.scale_records
    for name, calls, call in (
            ("get", len(reads), lambda i: state.get(reads[i])),
            ("list_100", len(starts), lambda i: state.list("bench/", after=starts[i], limit=100)),
            ("changes_100", len(starts), lambda i: state.changes("", since, limit=100)),
            ("get_at_version", len(reads) // 4, lambda i: state.get(reads[i], at_version=older))):
        figures[f"{name}_us"], figures[f"{name}_cpu_us"] = _timed_calls(calls, call)
    target = state.applied_version - args.retain
    prune_ms = []
    prune_cpu_ms = []
    while state.oldest_version < target:
        call_started = time.perf_counter()
        cpu_started = time.thread_time()
        state.prune_history(min(target, state.oldest_version + PRUNE_STEP_VERSIONS))
        prune_cpu_ms.append((time.thread_time() - cpu_started) * 1000)
        prune_ms.append((time.perf_counter() - call_started) * 1000)
    figures["prune_steps"] = len(prune_ms)
    figures["prune_step_ms_p99"] = round(_percentile(prune_ms, 0.99), 1) if prune_ms else 0.0
    figures["prune_step_ms_max"] = round(max(prune_ms, default=0.0), 1)
    figures["prune_step_cpu_ms_max"] = round(max(prune_cpu_ms, default=0.0), 1)
    snapshot_started = time.perf_counter()
    state.create_snapshot(os.path.join(os.path.dirname(store.path), "snapshots"))
    figures["snapshot_s"] = round(time.perf_counter() - snapshot_started, 2)
    for name in ("get", "list_100", "changes_100", "get_at_version"):
        figures[f"{name}_us"] = round(figures[f"{name}_us"], 2)
        figures[f"{name}_cpu_us"] = round(figures[f"{name}_cpu_us"], 2)
    figures["history_rows"] = _count_rows(store.path, "history")
    figures["db_bytes"] = sum(os.path.getsize(store.path + suffix) for suffix in ("", "-wal")
                              if os.path.exists(store.path + suffix))
    return figures


def key_index_bytes_per_key(store: _ScaleStore) -> dict[str, Any]:
    """Python memory the key index takes per key, measured over reopening the store (the
    open loads the index): tracemalloc's count and the RSS growth (which includes
    SQLite's page cache, up to SQLITE_CACHE_KIB)."""
    store.state.close()
    keys = _count_rows(store.path, "key_heads")  # complete once closed: every head
    gc.collect()
    rss_before = _rss_bytes()
    tracemalloc.start()
    state = StateMachine(store.path, heads_flush_records=store.heads_flush_records)
    gc.collect()
    traced, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_after = _rss_bytes()
    store.state = state
    return {"keys": keys, "traced_bytes_per_key": round(traced / keys, 1),
            "rss_bytes_per_key": round((rss_after - rss_before) / keys, 1)}


def cold_open_seconds(store: _ScaleStore) -> dict[str, Any]:
    """CPU seconds of opening the store as a kill leaves it (key_heads behind: the open
    reads the history above heads_version back) and as a close leaves it (key_heads
    complete). The killed copy is taken with SQLite's backup, between two apply calls."""
    killed_path = store.path + ".killed"
    source = sqlite3.connect(store.path)
    target = sqlite3.connect(killed_path)
    try:
        source.backup(target)
        applied, heads = target.execute("SELECT applied_version, heads_version FROM meta").fetchone()
    finally:
        source.close()
        target.close()
    figures: dict[str, Any] = {"tail_versions_after_kill": applied - heads}
    for name, path in (("after_kill", killed_path), ("after_close", None)):
        if path is None:
            store.state.close()
            path = store.path
        cpu_started = time.process_time()
        started = time.perf_counter()
        state = StateMachine(path, heads_flush_records=store.heads_flush_records)
        figures[f"open_{name}_cpu_s"] = round(time.process_time() - cpu_started, 2)
        figures[f"open_{name}_s"] = round(time.perf_counter() - started, 2)
        if path == killed_path:
            state.close()
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(killed_path + suffix):
                    os.unlink(killed_path + suffix)
        else:
            store.state = state
    return figures


def _count_rows(db_path: str, table: str) -> int:
    connection = sqlite3.connect(db_path)
    try:
        return connection.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        connection.close()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


SCALE_RATIO_FIELDS = ("update_us_per_record", "update_cpu_us_per_record", "churn_us_per_record",
                      "churn_cpu_us_per_record", "get_us", "get_cpu_us", "list_100_us", "list_100_cpu_us",
                      "changes_100_us", "changes_100_cpu_us", "get_at_version_us", "get_at_version_cpu_us")


def bench_scale(directory: str, key_counts: list[int], args: argparse.Namespace) -> dict[str, Any]:
    store = _ScaleStore(os.path.join(directory, "scale.db"), args.heads_flush_records)
    stages = []
    try:
        for keys in key_counts:
            figures = bench_scale_stage(store, keys, args)
            if stages:
                figures["ratio_to_first"] = {name: round(figures[name] / stages[0][name], 2)
                                             for name in SCALE_RATIO_FIELDS}
            stages.append(figures)
            _print_scale_stage(figures)
        opens = cold_open_seconds(store)
        print(f"open at {stages[-1]['keys']:,} keys: after a kill {opens['open_after_kill_cpu_s']} CPU-s"
              f" ({opens['tail_versions_after_kill']:,} versions of history read back),"
              f" after a close {opens['open_after_close_cpu_s']} CPU-s")
        memory = key_index_bytes_per_key(store)
        print(f"key index at {memory['keys']:,} keys: {memory['traced_bytes_per_key']} bytes/key (tracemalloc),"
              f" {memory['rss_bytes_per_key']} bytes/key (RSS growth over the open)")
    finally:
        store.state.close()
    return {"stages": stages, "key_index": memory, "open": opens, "retain_versions": args.retain,
            "heads_flush_records": args.heads_flush_records,
            "records_per_stage": args.scale_records, "batch_records": SCALE_BATCH_RECORDS}


def _print_scale_stage(figures: dict[str, Any]) -> None:
    ratios = figures.get("ratio_to_first", {})

    def cell(name: str, unit: str) -> str:  # per record for apply, per call for reads
        ratio = f" ({ratios[name]:.2f}x)" if name in ratios else ""
        label = name.removesuffix("_us_per_record").removesuffix("_us").removesuffix("_cpu")
        return f"{label} {figures[name]} {unit}{ratio}"

    print(f"keys {figures['keys']:>9,} (history {figures['history_rows']:,} rows,"
          f" {figures['db_bytes'] / 2**20:,.0f} MiB): "
          + "; ".join([cell(name, "CPU-us" if "cpu" in name else "us") for name in SCALE_RATIO_FIELDS])
          + "; call ms p99/max (max CPU): " + ", ".join(
              f"{kind} {figures[f'{kind}_call_ms_p99']}/{figures[f'{kind}_call_ms_max']}"
              f" ({figures[f'{kind}_call_cpu_ms_max']})" for kind in ("update", "churn"))
          + f", prune step {figures['prune_step_ms_p99']}/{figures['prune_step_ms_max']}"
            f" ({figures['prune_step_cpu_ms_max']}) in {figures['prune_steps']} steps;"
            f" build call max {figures['longest_build_call_ms']} ms; snapshot {figures['snapshot_s']} s")


# The scale stages' integer options: (flag, default, help).
SCALE_OPTIONS = (
    ("--scale-records", 20_000, "records applied per stage, per kind (updates, churn)"),
    ("--scale-reads", 20_000, "point reads per stage"),
    ("--retain", 50_000, "versions of history each stage keeps when it prunes"),
    ("--heads-flush-records", HEADS_FLUSH_RECORDS,
     "the scale store's heads_flush_records (a huge value: what apply costs without key_heads writes)"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per apply case; the best run is reported, all are recorded")
    parser.add_argument("--records", type=int, default=50_000,
                        help="records applied per key pattern and batch size")
    parser.add_argument("--small-records", type=int, default=5_000,
                        help="records applied per key pattern in batches of 1 and 10")
    parser.add_argument("--small-only", action="store_true",
                        help="run only the batches of 1 and 10 (no large batches, no reads)")
    parser.add_argument("--read-keys", type=int, default=50_000, help="keys present for the read test")
    parser.add_argument("--reads", type=int, default=200_000, help="point reads")
    parser.add_argument("--keys", type=parse_key_counts, default=None,
                        help="run only the scale stages at these live key counts, e.g. 10k,100k,1M")
    for flag, default, help_text in SCALE_OPTIONS:
        parser.add_argument(flag, type=int, default=default, help=help_text)
    parser.add_argument("--out", default="results/bench_state_machine.json")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "benchmark": "state_machine",
        "command": "python -m loadtest.bench_state_machine " + " ".join(argv if argv is not None else sys.argv[1:]),
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "apply": [],
        "small_apply": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-sm-") as directory:
        if args.keys is not None:
            report["scale"] = bench_scale(directory, args.keys, args)
            _write_report(report, args.out)
            return 0
        for pattern in KEY_PATTERNS:
            for batch_records in SMALL_APPLY_BATCH_SIZES:
                report["small_apply"].append(_bench_small(directory, pattern, batch_records, args))
        if args.small_only:
            _write_report(report, args.out)
            return 0
        for pattern in KEY_PATTERNS:
            for batch_records in APPLY_BATCH_SIZES:
                runs = [bench_apply(directory, pattern, batch_records, args.records, run)
                        for run in range(args.repeat)]
                figures = max(runs, key=lambda figures: figures["records_per_s"])
                figures["runs"] = args.repeat
                figures["records_per_s_all_runs"] = [r["records_per_s"] for r in runs]
                floors = [bench_sqlite_floor(directory, pattern, batch_records, args.records, run)
                          for run in range(args.repeat)]
                figures["sqlite_floor"] = max(floors, key=lambda floor: floor["records_per_s"])
                figures["sqlite_floor"]["records_per_s_all_runs"] = [f["records_per_s"] for f in floors]
                report["apply"].append(figures)
                floor = figures["sqlite_floor"]
                print(f"apply  {pattern:<16} batch={batch_records:>5}: {figures['records_per_s']:>9,}"
                      f" records/s, {figures['records_per_cpu_s']:>9,} per CPU-s"
                      f" (call p50 {figures['apply_call_ms_p50']} ms,"
                      f" p99 {figures['apply_call_ms_p99']} ms; target >= 50,000)"
                      f" | SQL-only floor {floor['records_per_s']:>9,} records/s,"
                      f" {floor['records_per_cpu_s']:>9,} per CPU-s")
        report["reads"] = bench_reads(directory, args.read_keys, args.reads)
    reads = report["reads"]
    print(f"get    single thread: {reads['reads_per_s']:>9,} reads/s, {reads['reads_per_cpu_s']:,} per CPU-s"
          f" (target >= 30,000);"
          f" misses {reads['miss_reads_per_s']:,}/s; at_version {reads['at_version_reads_per_s']:,}/s")
    _write_report(report, args.out)
    return 0


def _bench_small(directory: str, pattern: str, batch_records: int, args: argparse.Namespace) -> dict[str, Any]:
    """Best of ``--repeat`` runs (by call latency p50) of one small-batch case, printed."""
    runs = [bench_apply(directory, pattern, batch_records, args.small_records, run)
            for run in range(args.repeat)]
    figures = min(runs, key=lambda figures: figures["apply_call_us_p50"])
    figures["runs"] = args.repeat
    figures["apply_call_us_p50_all_runs"] = [r["apply_call_us_p50"] for r in runs]
    print(f"apply  {pattern:<16} batch={batch_records:>5}: call p50 {figures['apply_call_us_p50']:>7,.1f} us,"
          f" {figures['apply_thread_cpu_us_per_call']:>7,.1f} us CPU per call (apply thread),"
          f" {figures['records_per_s']:>7,} records/s, {figures['records_per_cpu_s']:>7,} per CPU-s")
    return figures


def _write_report(report: dict[str, Any], out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as handle:
        json.dump(report, handle, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
