"""Benchmark of the raft core alone: ``python -m loadtest.bench_core [--seconds S] [--json PATH]``.

Three voters in one process over MemoryLogs, messages delivered in FIFO order, every
flush completing at once: no I/O, no sockets, so the figures are the core's own cost
(one CPU core; the Python interpreter is single-threaded). Modes:

- ``batched``: proposals of 100 records, up to ``--in-flight`` uncommitted proposals at a
  time, so group commit folds several proposals into one log batch.
- ``batch100_serial``: proposals of 100 records, each waits for its commit.
- ``unbatched``: proposals of 1 record, each waits for its commit (one batch, one flush
  and one replication round trip per record).

Prints records committed per second and core events (message handled, tick, flush
notice) per second per mode, by wall clock and per CPU second of this process (the fair
figure on a shared machine), and writes them as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import random
import time
from pathlib import Path

from raft.log import MemoryLog
from raft.messages import Envelope
from raft.node import RaftConfig, RaftNode, Role
from raft.snapshots import MemorySnapshotStore

RECORD_BYTES = 100
MAX_QUEUE_EVENTS = 1_000_000  # bound on the in-process message queue


class Bench:
    def __init__(self) -> None:
        voters = frozenset({1, 2, 3})
        self.logs = {i: MemoryLog() for i in voters}
        self.nodes = {
            i: RaftNode(RaftConfig(node_id=i, voters=voters, endpoint=f"bench://{i}", max_pending_records=100_000),
                        self.logs[i], None, random.Random(i), MemorySnapshotStore(), 0)
            for i in voters
        }
        self.queue: collections.deque[tuple[int, Envelope | None]] = collections.deque()
        self.now_ms = 0
        self.events = 0
        self.flushing: set[int] = set()
        for node_id in self.nodes:
            self._drain(node_id)
        while not any(n.role == Role.LEADER for n in self.nodes.values()):
            self.now_ms += 50
            for node_id, node in self.nodes.items():
                if node.next_deadline_ms() <= self.now_ms:
                    node.tick(self.now_ms)
                    self._drain(node_id)
            self.run_queue()
        self.leader_id = next(i for i, n in self.nodes.items() if n.role == Role.LEADER)
        self.leader = self.nodes[self.leader_id]

    def _drain(self, node_id: int) -> None:
        ready = self.nodes[node_id].take_ready()
        for envelope in ready.messages:
            self.queue.append((envelope.dst, envelope))
        if ready.flush and node_id not in self.flushing:
            self.flushing.add(node_id)
            self.queue.append((node_id, None))
        if len(self.queue) > MAX_QUEUE_EVENTS:
            raise RuntimeError("bench queue overflow")

    def run_queue(self, until=None) -> None:  # type: ignore[no-untyped-def]
        queue = self.queue
        nodes = self.nodes
        while queue and (until is None or not until()):
            node_id, envelope = queue.popleft()
            node = nodes[node_id]
            if envelope is None:
                self.flushing.discard(node_id)
                self.logs[node_id].flush()
                node.on_flushed(self.now_ms)
            else:
                node.handle(self.now_ms, envelope)
            self.events += 1
            self._drain(node_id)

    def propose(self, records: list[bytes]) -> int:
        proposal = self.leader.propose(self.now_ms, records)
        self._drain(self.leader_id)
        return proposal.last_offset


def run_mode(mode: str, seconds: float, in_flight: int) -> dict[str, float]:
    bench = Bench()
    leader = bench.leader
    record = b"x" * RECORD_BYTES
    per_proposal = 1 if mode == "unbatched" else 100
    records = [record] * per_proposal
    committed_start = leader.high_watermark
    events_start = bench.events
    batches_start = len(bench.logs[bench.leader_id].read(0, 1 << 40))
    started = time.perf_counter()
    cpu_started = time.process_time()
    deadline = started + seconds
    last_offsets: collections.deque[int] = collections.deque()
    depth = in_flight if mode == "batched" else 1
    while time.perf_counter() < deadline:
        for _ in range(200):
            while len(last_offsets) < depth:
                last_offsets.append(bench.propose(records))
            target = last_offsets[0]
            bench.run_queue(until=lambda t=target: leader.high_watermark > t)
            while last_offsets and leader.high_watermark > last_offsets[0]:
                last_offsets.popleft()
    elapsed = time.perf_counter() - started
    cpu_s = max(time.process_time() - cpu_started, 1e-9)
    committed = leader.high_watermark - committed_start
    batches = len(bench.logs[bench.leader_id].read(0, 1 << 40)) - batches_start
    return {
        "records_per_proposal": per_proposal,
        "proposals_in_flight": depth,
        "seconds": round(elapsed, 3),
        "records_committed": committed,
        "cpu_seconds": round(cpu_s, 3),
        "records_committed_per_s": round(committed / elapsed),
        "events_per_s": round((bench.events - events_start) / elapsed),
        "records_committed_per_cpu_s": round(committed / cpu_s),
        "events_per_cpu_s": round((bench.events - events_start) / cpu_s),
        "records_per_log_batch": round(committed / max(1, batches), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_core", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="run time per mode")
    parser.add_argument("--in-flight", type=int, default=16, help="uncommitted proposals in the batched mode")
    parser.add_argument("--json", type=Path, default=Path("loadtest/results/bench_core.json"))
    args = parser.parse_args(argv)
    results = {mode: run_mode(mode, args.seconds, args.in_flight)
               for mode in ("batched", "batch100_serial", "unbatched")}
    for mode, figures in results.items():
        print(f"{mode:<16} {figures['records_committed_per_s']:>10,} records committed/s "
              f"{figures['events_per_s']:>9,} events/s  "
              f"(per CPU second: {figures['records_committed_per_cpu_s']:,} records, "
              f"{figures['events_per_cpu_s']:,} events; "
              f"{figures['records_per_log_batch']} records per log batch)")
    report = {"benchmark": "bench_core", "python": platform.python_version(), "voters": 3,
              "record_bytes": RECORD_BYTES, "modes": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
