"""The chaos harness: real metakv processes, every raft link through a fault proxy, a seeded
nemesis schedule, a recorded workload, a final heal, and the checker's verdict.

    python -m tests.chaos.harness --seed 7 --duration-s 60 --results results/chaos-7

Why this shape: the simulation tests prove the pure core; only real processes with real
sockets, fsyncs, timers and signals prove the node. Each node dials its peers through its
own outbound proxies (its ``--voters`` list names, for every peer, the local port of the
proxy for that directed link), so the harness can cut, delay, stall or reset any link in
either direction without root. One seed chooses the faults, their targets and their
timing; the same seed gives the same schedule (the cluster's own timing still varies).

After the run every fault is healed (network, paused and stopped nodes, failpoints), the
workload keeps going a little so recovery is exercised, and the final checks run: a
linearizable read of every key, then every node lists the whole key space at one common
version. The history, the report and a JSON summary go to the results folder.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.chaos.checker import CheckReport, check_history
from tests.chaos.history import History, Workload, WorkloadConfig, now_ns
from tests.chaos.proxy import ProxyNetwork
from tests.cluster import Cluster, Node

# Faster failure detection than the defaults, so short runs still see several elections;
# not so fast that a loaded 2-core machine elects all the time.
CHAOS_SETTINGS = {
    "election_timeout_ms": 800,
    "fetch_timeout_ms": 1600,
    "fetch_max_wait_ms": 400,
    "request_timeout_ms": 1500,
    "commit_timeout_ms": 4000,
    # Short enough that a short run still cleans (under faults), long enough to exercise it.
    "min_compaction_lag_ms": 2000,
}
# How long the cluster may take to recover after the final heal.
RECOVERY_TIMEOUT_S = 90.0
# How long the workload keeps running after the heal.
POST_HEAL_WORKLOAD_S = 3.0
# A leader paused this long has lost leadership (check-quorum is 1.5 x fetch_timeout_ms).
PAUSE_LEADER_S = 4.0
# Faults hold this long (uniform), with this much quiet time between them.
FAULT_HOLD_S = (2.0, 6.0)
FAULT_GAP_S = (0.5, 2.5)
SLOW_FSYNC_FAILPOINT = "segment.before_fsync=sleep(150)"
FAILING_FSYNC_FAILPOINT = "segment.before_fsync=error@3"

NEMESES = (
    "partition_halves", "isolate_leader", "bridge", "one_way_cut", "kill_restart", "kill_leader",
    "pause_leader", "graceful_restart", "slow_fsync", "failing_fsync", "crash_all", "delay_links",
    "stall_link", "reset_connections", "mute_leader",
)


@dataclass
class Fault:
    """One applied fault and how to heal it."""

    name: str
    detail: str
    heal: Callable[[], None]
    restarts_nodes: list[int]


class ChaosCluster:
    """A Cluster whose raft links all go through proxies."""

    def __init__(self, root: Path, voters: int = 3, settings: dict[str, Any] | None = None) -> None:
        self.cluster = Cluster(root, voters=voters, settings=settings or CHAOS_SETTINGS)
        self.network = ProxyNetwork()
        nodes = self.cluster.nodes
        for node in nodes.values():
            parts = []
            for peer in nodes.values():
                if peer.observer:
                    continue
                if peer.node_id == node.node_id:
                    parts.append(f"{peer.node_id}@127.0.0.1:{peer.raft_port}")
                else:
                    port = self.network.add_link(node.node_id, peer.node_id, "127.0.0.1", peer.raft_port)
                    parts.append(f"{peer.node_id}@127.0.0.1:{port}")
            index = node.command.index("--voters")
            node.command[index + 1] = ",".join(parts)

    def start(self) -> None:
        self.cluster.start()

    def close(self) -> None:
        try:
            self.cluster.close()
        finally:
            self.network.close()

    def urls(self) -> dict[int, str]:
        return {node.node_id: node.url for node in self.cluster.nodes.values()}

    def status(self, node: Node) -> dict[str, Any] | None:
        return self.cluster.status(node)

    def leader(self) -> Node | None:
        """The node that currently says it leads (highest epoch), without waiting."""
        best: tuple[int, Node] | None = None
        for node in self.cluster.nodes.values():
            status = self.status(node)
            if status and status.get("role") == "leader" and (best is None or status["epoch"] > best[0]):
                best = (status["epoch"], node)
        return None if best is None else best[1]


class Nemesis:
    """Chooses and applies faults from a seeded random source."""

    def __init__(self, chaos: ChaosCluster, rng: random.Random, names: tuple[str, ...] = NEMESES) -> None:
        self.chaos = chaos
        self.rng = rng
        self.names = names
        self.cluster = chaos.cluster
        self.network = chaos.network

    def _ids(self) -> list[int]:
        return sorted(self.cluster.nodes)

    def _leader_or_random(self) -> int:
        leader = self.chaos.leader()
        return leader.node_id if leader is not None else self.rng.choice(self._ids())

    def apply(self, name: str) -> Fault:
        return getattr(self, name)()

    # -- network -----------------------------------------------------------------------

    def partition_halves(self) -> Fault:
        ids = self._ids()
        self.rng.shuffle(ids)
        cut = self.rng.randint(1, len(ids) // 2)
        groups = [set(ids[:cut]), set(ids[cut:])]
        self.network.partition(groups)
        return Fault("partition_halves", f"groups {sorted(map(sorted, groups))}", self.network.heal, [])

    def isolate_leader(self) -> Fault:
        leader = self._leader_or_random()
        self.network.partition([{leader}, set(self._ids()) - {leader}])
        return Fault("isolate_leader", f"node {leader} alone", self.network.heal, [])

    def bridge(self) -> Fault:
        ids = self._ids()
        self.rng.shuffle(ids)
        middle, rest = ids[0], ids[1:]
        half = len(rest) // 2
        left, right = set(rest[:half]), set(rest[half:])
        for a in left:
            for b in right:
                self.network.cut_both_ways(a, b)
        return Fault("bridge", f"node {middle} bridges {sorted(left)} and {sorted(right)}", self.network.heal, [])

    def one_way_cut(self) -> Fault:
        src, dst = self.rng.sample(self._ids(), 2)
        if self.rng.random() < 0.5:
            leader = self._leader_or_random()
            others = [i for i in self._ids() if i != leader]
            src, dst = (leader, self.rng.choice(others)) if self.rng.random() < 0.5 else (self.rng.choice(others), leader)
        self.network.cut_one_way(src, dst)
        return Fault("one_way_cut", f"{src} -/-> {dst}", self.network.heal, [])

    def mute_leader(self) -> Fault:
        """The leader's messages reach nobody, but it still hears everyone: its fetches keep
        arriving (check-quorum stays satisfied) while the followers get no answers, give up
        on it and elect another; the old leader must step down on their vote requests."""
        leader = self._leader_or_random()
        for other in self._ids():
            if other != leader:
                self.network.cut_one_way(leader, other)
        return Fault("mute_leader", f"node {leader} -/-> everyone (it still hears them)", self.network.heal, [])

    def delay_links(self) -> Fault:
        delay_ms = self.rng.choice([50, 150, 400, 900])
        victims = self.rng.sample(list(self.network.links), k=self.rng.randint(1, len(self.network.links)))
        for src, dst in victims:
            self.network.delay(src, dst, delay_ms)
        return Fault("delay_links", f"{delay_ms} ms on {sorted(victims)}", self.network.heal, [])

    def stall_link(self) -> Fault:
        src, dst = self.rng.sample(self._ids(), 2)
        self.network.stall(src, dst)
        return Fault("stall_link", f"{src} <-> {dst} held, then delivered late", self.network.heal, [])

    def reset_connections(self) -> Fault:
        node = self.rng.choice(self._ids())
        self.network.reset_node(node)
        return Fault("reset_connections", f"every raft connection of node {node}", lambda: None, [])

    # -- processes ---------------------------------------------------------------------

    def _node(self, node_id: int) -> Node:
        return self.cluster.nodes[node_id]

    def kill_restart(self, node_id: int | None = None, name: str = "kill_restart") -> Fault:
        target = node_id if node_id is not None else self.rng.choice(self._ids())
        node = self._node(target)
        node.kill()

        def heal() -> None:
            node.start()

        return Fault(name, f"SIGKILL node {target}", heal, [target])

    def kill_leader(self) -> Fault:
        return self.kill_restart(self._leader_or_random(), "kill_leader")

    def pause_leader(self) -> Fault:
        target = self._leader_or_random()
        node = self._node(target)
        node.pause()
        time.sleep(PAUSE_LEADER_S)
        return Fault("pause_leader", f"SIGSTOP node {target} for at least {PAUSE_LEADER_S}s", node.resume, [])

    def graceful_restart(self) -> Fault:
        target = self._leader_or_random() if self.rng.random() < 0.5 else self.rng.choice(self._ids())
        node = self._node(target)
        code = node.stop()
        node.start()
        return Fault("graceful_restart", f"SIGTERM node {target} (exit {code}), started again", lambda: None,
                     [target])

    def _restart_with_failpoint(self, name: str, spec: str) -> Fault:
        target = self.rng.choice(self._ids())
        node = self._node(target)
        node.kill()
        node.env["METAKV_FAILPOINTS"] = spec
        node.start()

        def heal() -> None:
            node.env.pop("METAKV_FAILPOINTS", None)
            node.kill()
            node.start()

        return Fault(name, f"node {target} restarted with METAKV_FAILPOINTS={spec}", heal, [target])

    def slow_fsync(self) -> Fault:
        return self._restart_with_failpoint("slow_fsync", SLOW_FSYNC_FAILPOINT)

    def failing_fsync(self) -> Fault:
        return self._restart_with_failpoint("failing_fsync", FAILING_FSYNC_FAILPOINT)

    def crash_all(self) -> Fault:
        for node in self.cluster.nodes.values():
            node.kill()

        def heal() -> None:
            for node in self.cluster.nodes.values():
                node.start()

        return Fault("crash_all", "SIGKILL every node", heal, self._ids())


def heal_everything(chaos: ChaosCluster) -> None:
    """Network healed, nothing paused, no failpoints, every node running."""
    chaos.network.heal()
    for node in chaos.cluster.nodes.values():
        if node.paused:
            node.resume()
        if node.env.pop("METAKV_FAILPOINTS", None) is not None:
            node.kill()
        if not node.running():
            node.start()


@dataclass
class RunResult:
    report: CheckReport
    history_path: Path
    report_path: Path
    faults: list[dict[str, Any]]
    op_counts: dict[str, int]
    workload_errors: list[str]


def run_chaos(seed: int, duration_s: float, results: Path, *, voters: int = 3, keys: int = 4,
              processes: int = 6, nemeses: tuple[str, ...] = NEMESES, log: Callable[[str], None] = print,
              client: str = "httpx") -> RunResult:
    """One whole run; see the module docstring. Always stops every process it started."""
    results.mkdir(parents=True, exist_ok=True)
    # a fresh cluster every run: old data would hold values this history never wrote
    shutil.rmtree(results / "cluster", ignore_errors=True)
    rng = random.Random(seed)
    history = History()
    chaos = ChaosCluster(results / "cluster", voters=voters)
    faults: list[dict[str, Any]] = []
    recovery_failure = ""
    prefix = f"chaos{seed}/"
    config = WorkloadConfig(keys=[f"{prefix}k{index}" for index in range(keys)], process_count=processes,
                            client=client)
    workload = Workload(chaos.urls, config, history, seed, prefix)
    try:
        chaos.start()
        chaos.cluster.wait_for_leader(timeout_s=RECOVERY_TIMEOUT_S)
        log(f"seed {seed}: cluster up, raft links through proxies {chaos.network.describe()}")
        workload.start()
        nemesis = Nemesis(chaos, rng, nemeses)
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(*FAULT_GAP_S))
            name = rng.choice(nemesis.names)
            invoke = now_ns()
            fault = nemesis.apply(name)
            log(f"  fault {fault.name}: {fault.detail}")
            time.sleep(rng.uniform(*FAULT_HOLD_S))
            fault.heal()
            record = {"process": "nemesis", "op": "nemesis", "name": fault.name, "detail": fault.detail,
                      "invoke_ns": invoke, "complete_ns": now_ns(), "outcome": "ok",
                      "restarts_nodes": fault.restarts_nodes}
            history.add(record)
            faults.append({"name": fault.name, "detail": fault.detail})
        heal_start = now_ns()
        heal_everything(chaos)
        history.add({"process": "nemesis", "op": "nemesis", "name": "heal_all", "detail": "final heal",
                     "invoke_ns": heal_start, "complete_ns": now_ns(), "outcome": "ok",
                     "restarts_nodes": []})
        log("  healed everything; waiting for recovery")
        try:
            wait_recovered(chaos)
            time.sleep(POST_HEAL_WORKLOAD_S)
            workload.stop()
            final_reads(chaos, history, config.keys, prefix)
        except AssertionError as exc:
            # the history is still worth checking; the failure to recover is the headline
            recovery_failure = f"CLUSTER DID NOT RECOVER after the final heal: {str(exc)[:6000]}"
            log(recovery_failure[:2000])
    finally:
        workload.stop()
        records = history.records()
        history_path = results / "history.jsonl"
        history.write(history_path)
        chaos.close()
    report = check_history(records)
    if recovery_failure:
        report.ok = False
        report.anomalies.insert(0, recovery_failure)
    op_counts: dict[str, int] = {}
    for record in records:
        label = f"{record['op']}:{record['outcome']}"
        op_counts[label] = op_counts.get(label, 0) + 1
    report_path = results / "report.txt"
    text = render_report(seed, duration_s, faults, op_counts, report, workload.errors)
    report_path.write_text(text)
    (results / "summary.json").write_text(json.dumps({
        "seed": seed, "duration_s": duration_s, "valid": report.ok, "faults": faults, "op_counts": op_counts,
        "checked_register_ops": report.checked_op_count, "check_seconds": round(report.elapsed_s, 3),
        "anomalies": report.anomalies[:200],
        "unexpected_statuses": [r for r in records if (r.get("result") or {}).get("unexpected")][:50],
    }, indent=2))
    log(text)
    return RunResult(report, history_path, report_path, faults, op_counts, workload.errors)


def render_report(seed: int, duration_s: float, faults: list[dict[str, Any]], op_counts: dict[str, int],
                  report: CheckReport, workload_errors: list[str]) -> str:
    lines = [f"chaos run seed={seed} duration={duration_s}s", "faults:"]
    lines += [f"  {fault['name']}: {fault['detail']}" for fault in faults]
    lines.append("operations: " + ", ".join(f"{k}={v}" for k, v in sorted(op_counts.items())))
    if workload_errors:
        lines.append(f"workload errors ({len(workload_errors)}): {workload_errors[:5]}")
    lines.append(report.summary())
    lines.append(f"replay: make chaos SEED={seed} DURATION={int(duration_s)}")
    return "\n".join(lines) + "\n"


def wait_recovered(chaos: ChaosCluster) -> None:
    """A leader every node follows, and every node ready."""
    cluster = chaos.cluster
    cluster.wait_for_leader(timeout_s=RECOVERY_TIMEOUT_S)
    for node in cluster.nodes.values():
        cluster.wait_ready(node, timeout_s=RECOVERY_TIMEOUT_S)


def final_reads(chaos: ChaosCluster, history: History, keys: list[str], prefix: str) -> None:
    """A linearizable read of every key through the leader, then the whole key space from
    every node at one common version (recorded as final_read)."""
    cluster = chaos.cluster
    with httpx.Client(timeout=30.0, follow_redirects=True) as http:
        for key in keys:
            for _attempt in range(20):
                leader = cluster.wait_for_leader(timeout_s=RECOVERY_TIMEOUT_S)
                invoke = now_ns()
                try:
                    response = http.get(f"{leader.url}/v1/kv/{key}", params={"consistency": "linearizable"})
                except httpx.HTTPError:
                    time.sleep(0.2)
                    continue
                if response.status_code in (200, 404):
                    result: dict[str, Any] = {"found": response.status_code == 200,
                                              "node": int(response.headers.get("X-Node-Id", "0") or 0),
                                              "node_version": int(response.headers.get("X-Metadata-Version", "0") or 0)}
                    if response.status_code == 200:
                        result.update(value=response.content.decode(errors="replace"),
                                      mod_version=int(response.headers["ETag"].strip('"')))
                    history.add({"process": "final", "op": "read", "key": key, "consistency": "linearizable",
                                 "min_version": None, "invoke_ns": invoke, "complete_ns": now_ns(),
                                 "outcome": "ok", "result": result})
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"no final linearizable read of {key!r} succeeded\n{cluster.logs()}")
        listings = _common_version_listings(chaos, http, prefix)
    for node_id, (version, items) in listings.items():
        by_key = {item["key"]: item for item in items}
        for key in keys:
            item = by_key.get(key)
            result = {"found": item is not None, "node": node_id, "node_version": version}
            if item is not None:
                result.update(value=item.get("value"), mod_version=item.get("mod_version"))
            history.add({"process": "final", "op": "final_read", "key": key, "invoke_ns": now_ns(),
                         "complete_ns": now_ns(), "outcome": "ok", "result": result})


def _common_version_listings(chaos: ChaosCluster, http: httpx.Client, prefix: str
                             ) -> dict[int, tuple[int, list[dict[str, Any]]]]:
    """Every node's listing of ``prefix`` once all report the same version."""
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    listings: dict[int, tuple[int, list[dict[str, Any]]]] = {}
    while time.monotonic() < deadline:
        listings = {}
        for node in chaos.cluster.nodes.values():
            try:
                response = http.get(f"{node.url}/v1/kv", params={"prefix": prefix, "limit": 1000})
            except httpx.HTTPError:
                break
            if response.status_code != 200:
                break
            body = response.json()
            listings[node.node_id] = (int(body["version"]), body["items"])
        versions = {version for version, _ in listings.values()}
        if len(listings) == len(chaos.cluster.nodes) and len(versions) == 1:
            return listings
        time.sleep(0.2)
    raise AssertionError(f"nodes did not converge on one version: "
                         f"{ {n: v for n, (v, _) in listings.items()} }\n{chaos.cluster.logs()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one chaos test against real metakv processes.")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--results", type=Path, default=None, help="results folder (default results/chaos-SEED)")
    parser.add_argument("--keys", type=int, default=4)
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--nemeses", default=",".join(NEMESES), help="comma-separated subset of " + ",".join(NEMESES))
    parser.add_argument("--client", choices=("httpx", "metakv"), default="httpx",
                        help="the workload's clients: raw HTTP requests, or the Python client (metakv/)")
    args = parser.parse_args(argv)
    names = tuple(name.strip() for name in args.nemeses.split(",") if name.strip())
    unknown = [name for name in names if name not in NEMESES]
    if unknown or args.duration_s <= 0:
        print(f"metakv chaos: unknown nemeses {unknown} or non-positive duration", file=sys.stderr)
        return 2
    results = args.results or Path("results") / f"chaos-{args.seed}"
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    result = run_chaos(args.seed, args.duration_s, results, keys=args.keys, processes=args.processes, nemeses=names,
                       client=args.client)
    print(f"history: {result.history_path}\nreport: {result.report_path}")
    return 0 if result.report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
