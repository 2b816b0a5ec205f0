"""Dynamic voters (KIP-853) timed with real processes (docs/benchmarks.md, "Dynamic voters").

    python -m loadtest.bench_voters [--keys 100000] [--rate 50] [--out results/bench_voters.json]

A --standalone node is loaded with ``--keys`` keys (128-put txns), then a new node starts as
its observer: the time from its process start to the add answering 200 is "catch up and
add" (the add is retried while the leader says not-caught-up). Meanwhile one writer puts a
key every 1/``--rate`` s through the leader (following redirects, moving to another node on
errors) and records when each was acknowledged; for each change (add the second and third
voter, remove a follower, remove the leader) the longest gap between two acknowledgements
from 1 s before the change to 2 s after it is its write unavailability, set beside the
longest gap of a quiet window of the same length in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.local_cluster import Cluster, Node

TXN_PUTS = 128  # the API's most ops per txn branch
SETTINGS = {"cleaner_interval_ms": 0}
WINDOW_BEFORE_S, WINDOW_AFTER_S = 1.0, 2.0
CHANGE_TIMEOUT_S = 300.0


class RateWriter:
    """One sequential writer at a fixed rate; ``acked`` holds each acknowledgement's time."""

    def __init__(self, cluster: Cluster, rate: float) -> None:
        self.cluster, self.interval_s = cluster, 1.0 / rate
        self.acked: list[float] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30.0)

    def _run(self) -> None:
        sequence, turn = 0, 0
        with httpx.Client(timeout=5.0, follow_redirects=True) as http:
            while not self._stop.is_set():
                started = time.monotonic()
                nodes = [node for node in self.cluster.nodes.values() if node.running()]
                node = nodes[turn % len(nodes)]
                try:
                    response = http.put(f"{node.url}/v1/kv/rate/{sequence}", content=b"x")
                    ok = response.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    self.acked.append(time.monotonic())
                    sequence += 1
                else:
                    self.errors += 1
                    turn += 1
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def longest_gap(self, start: float, end: float) -> float:
        inside = [t for t in self.acked if start <= t <= end]
        edges = [start, *inside, end]
        return max(b - a for a, b in zip(edges, edges[1:], strict=False))


def _load(node: Node, keys: int) -> None:
    with httpx.Client(timeout=60.0, follow_redirects=True) as http:
        for base in range(0, keys, TXN_PUTS):
            puts = [{"op": "put", "key": f"load/{i:07d}", "value": "v" * 100} for i in range(base, min(keys, base + TXN_PUTS))]
            response = http.post(f"{node.url}/v1/txn", json={"success": puts})
            response.raise_for_status()


def _change(cluster: Cluster, method: str, path: str, body: dict[str, Any] | None) -> None:
    deadline = time.monotonic() + CHANGE_TIMEOUT_S
    with httpx.Client(timeout=30.0, follow_redirects=True) as http:
        while time.monotonic() < deadline:
            leader = cluster.wait_for_leader()
            try:
                response = http.request(method, f"{leader.url}{path}", json=body)
            except httpx.HTTPError:
                continue
            if response.status_code == 200:
                return
            if response.status_code not in (307, 409, 503) or "already-voter" in response.text:
                raise RuntimeError(f"{method} {path}: {response.status_code} {response.text}")
            time.sleep(0.05)
    raise RuntimeError(f"{method} {path} did not succeed within {CHANGE_TIMEOUT_S} s")


def _add(cluster: Cluster, node: Node) -> None:
    _change(cluster, "POST", "/v1/admin/voters", {"id": node.node_id, "raft_endpoint": f"127.0.0.1:{node.raft_port}"})


def run(root: Path, keys: int, rate: float) -> dict[str, Any]:
    shutil.rmtree(root, ignore_errors=True)  # a fresh store of exactly --keys keys
    cluster = Cluster(root, voters=1, observers=2, settings=SETTINGS)
    command = cluster.nodes[1].command
    at = command.index("--voters")
    command[at:at + 2] = ["--standalone"]  # a formatted cluster: its voters can change
    first, second, third = cluster.nodes[1], cluster.nodes[2], cluster.nodes[3]
    results: dict[str, Any] = {"keys": keys, "writer_rate_per_s": rate}
    try:
        first.start()
        cluster.nodes = {1: first}
        cluster.wait_for_leader()
        loaded = time.monotonic()
        _load(first, keys)
        results["load_s"] = round(time.monotonic() - loaded, 2)
        writer = RateWriter(cluster, rate)
        writer.start()
        time.sleep(WINDOW_BEFORE_S + WINDOW_AFTER_S)
        quiet_end = time.monotonic()
        results["quiet_longest_gap_ms"] = round(writer.longest_gap(quiet_end - WINDOW_BEFORE_S - WINDOW_AFTER_S,
                                                                     quiet_end) * 1000)
        gaps: dict[str, float] = {}
        for name, node in (("add second voter", second), ("add third voter", third)):
            started = time.monotonic()
            node.start()
            cluster.nodes[node.node_id] = node
            _add(cluster, node)
            if name == "add second voter":
                results["catch_up_and_add_s"] = round(time.monotonic() - started, 2)
            else:
                started = time.monotonic()  # the third node's start is not part of its gap window
            time.sleep(WINDOW_AFTER_S)
            gaps[name] = writer.longest_gap(started - WINDOW_BEFORE_S, time.monotonic())
        removed_follower = 0
        for name in ("remove a follower", "remove the leader"):
            if removed_follower:
                _add(cluster, cluster.nodes[removed_follower])  # back to three: removing the leader leaves two
                time.sleep(WINDOW_AFTER_S)
            started = time.monotonic()
            leader = cluster.wait_for_leader()
            target = leader.node_id
            if name == "remove a follower":
                target = removed_follower = next(n for n in (1, 2, 3) if n != leader.node_id)
            _change(cluster, "DELETE", f"/v1/admin/voters/{target}", None)
            time.sleep(WINDOW_AFTER_S)
            gaps[name] = writer.longest_gap(started - WINDOW_BEFORE_S, time.monotonic())
        writer.stop()
        results["longest_gap_ms"] = {name: round(gap * 1000) for name, gap in gaps.items()}
        results["writer_errors"] = writer.errors
        results["writes_acknowledged"] = len(writer.acked)
    finally:
        cluster.nodes = {1: first, 2: second, 3: third}
        cluster.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=50.0, help="writer puts per second")
    parser.add_argument("--root", type=Path, default=Path("results/bench_voters"))
    parser.add_argument("--out", type=Path, default=Path("results/bench_voters.json"))
    args = parser.parse_args(argv)
    results = run(args.root, args.keys, args.rate)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
