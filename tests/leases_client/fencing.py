"""The lock fencing scenario, shared by the short test (make test) and the long run
(``make chaos-locks``): holder processes (tests/leases_client/holder.py) take one lock in
turn and make fenced writes to a guard key, while the cluster's leader is SIGKILLed and a
holder is SIGSTOPped while it holds the lock (its lease expires, the next holder takes
over; resumed, its writes must be refused by the fence).

    python -m tests.leases_client.fencing --holders 5 --rounds 20 --faults 4 [--partitions]

What is checked (``check``): the guard key's history, read back through a watch, never
interleaves holders (the fencing tokens it holds never go down); every write a holder
reported is in it; no write of the holder stopped while holding comes after its
successor's first write, and its first write after it resumed was refused.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metakv import Client, RetryPolicy
from tests.chaos.harness import ChaosCluster
from tests.chaos.proxy import ProxyNetwork
from tests.cluster import REPO_ROOT, Cluster
from tests.leases_client.holder import GUARD_KEY

FAST = {"election_timeout_ms": 500, "fetch_timeout_ms": 1000, "fetch_max_wait_ms": 200}
PATIENT = RetryPolicy(deadline_s=30.0)
WAIT_S = 60.0


class Holders:
    """Holder processes and the JSON lines they printed, in arrival order."""

    def __init__(self, cluster: Cluster, count: int, rounds: int, writes: int, ttl_s: int) -> None:
        urls = ",".join(node.url for node in cluster.voters)
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
        self.events: list[dict[str, Any]] = []
        self.guard = threading.Lock()
        self.processes = {
            worker: subprocess.Popen(
                [sys.executable, "-m", "tests.leases_client.holder", "--endpoints", urls, "--worker", str(worker),
                 "--rounds", str(rounds), "--writes", str(writes), "--ttl", str(ttl_s)],
                cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for worker in range(1, count + 1)}
        self.readers = [threading.Thread(target=self._read, args=(process,), daemon=True)
                        for process in self.processes.values()]
        for reader in self.readers:
            reader.start()

    def _read(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            with self.guard:
                self.events.append(json.loads(line))

    def seen(self, **members: Any) -> list[dict[str, Any]]:
        with self.guard:
            return [event for event in self.events if all(event.get(k) == v for k, v in members.items())]

    def wait_for(self, what: str, predicate: Any, timeout_s: float = WAIT_S) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (found := predicate()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout_s:g} s; events: {self.events[-20:]}")
            time.sleep(0.02)
        return found

    def wait_done(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for worker, process in self.processes.items():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"holder {worker} still running; events: {self.events[-20:]}") from None
            assert process.returncode == 0, (worker, process.stderr.read() if process.stderr else b"")
        for reader in self.readers:
            reader.join(timeout=5)

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
                process.wait()


@dataclass
class FenceRun:
    events: list[dict[str, Any]]
    history: list[str]  # the guard key's values, in version order
    stopped: list[tuple[int, int, float]] = field(default_factory=list)  # (worker, token, resumed at)


def guard_history(kv: Client, since: int) -> list[str]:
    final = kv.get(GUARD_KEY, consistency="linearizable")
    assert final is not None
    values = []
    for event in kv.watch(GUARD_KEY, since=since):
        if event.key == GUARD_KEY and event.value is not None:
            values.append(event.value.decode())
        if event.mod_version >= final.mod_version:
            return values
    return values


def stop_a_holder(holders: Holders, after: float, ttl_s: int) -> tuple[int, int, float]:
    """SIGSTOP a holder that just acquired; resume it once a successor wrote."""
    acquired = holders.wait_for("an acquisition to pause", lambda: [
        e for e in holders.seen(event="acquired") if e["at"] > after
        and not holders.seen(event="released", worker=e["worker"], token=e["token"])])[0]
    worker, token = acquired["worker"], acquired["token"]
    os.kill(holders.processes[worker].pid, signal.SIGSTOP)
    holders.wait_for(f"a successor writing after holder {worker} (token {token}) stopped", lambda: [
        e for e in holders.seen(event="wrote") if e["token"] > token], timeout_s=WAIT_S + ttl_s)
    resumed_at = time.monotonic()
    os.kill(holders.processes[worker].pid, signal.SIGCONT)
    return worker, token, resumed_at


def isolate_leader(cluster: Cluster, network: ProxyNetwork, seconds: float) -> None:
    """Cut the leader's raft links both ways for ``seconds`` (clients still reach it over
    HTTP: it must stop granting and keeping leases alive), then heal."""
    leader = cluster.wait_for_leader()
    network.partition([{leader.node_id}, set(cluster.nodes) - {leader.node_id}])
    time.sleep(seconds)
    network.heal()


def run_fencing(cluster: Cluster, holders_count: int, rounds: int, faults: int, writes: int = 3,
                ttl_s: int = 2, network: ProxyNetwork | None = None) -> FenceRun:
    urls = [node.url for node in cluster.voters]
    cluster.wait_for_leader()
    with Client(urls, retry=PATIENT) as kv:
        start = kv.put(GUARD_KEY, "0 start").version
        holders = Holders(cluster, holders_count, rounds, writes, ttl_s)
        stopped = []
        try:
            for fault in range(faults):
                writes_before = 2 * (fault + 1)
                holders.wait_for("writes", lambda n=writes_before: len(holders.seen(event="wrote")) >= n)
                leader = cluster.wait_for_leader()
                cluster.kill(leader)
                stopped.append(stop_a_holder(holders, time.monotonic(), ttl_s))
                cluster.restart(leader)
                if network is not None:
                    isolate_leader(cluster, network, 3.0 * ttl_s)
            holders.wait_done(WAIT_S * (1 + rounds * holders_count // 10))
        finally:
            holders.close()
        return FenceRun(list(holders.events), guard_history(kv, start - 1), stopped)


def check(run: FenceRun) -> None:
    tokens = [int(value.split()[0]) for value in run.history]
    assert tokens == sorted(tokens), f"holders interleaved: {run.history}"
    written = {event["text"] for event in run.events if event["event"] == "wrote"}
    in_history = {value.split(" ", 1)[1] for value in run.history[1:]}
    assert written <= in_history, f"acknowledged writes missing: {sorted(written - in_history)}"
    for worker, token, resumed_at in run.stopped:
        # Its writes (one may be reported only after the resume: it was paused mid-write) all
        # precede its successor's in the history; once resumed, its next write was refused.
        texts = {e["text"] for e in run.events if e["event"] == "wrote" and e["worker"] == worker and e["token"] == token}
        successor_at = next(i for i, t in enumerate(tokens) if t > token)
        late_writes = [v for v in run.history[successor_at:] if v.split(" ", 1)[1] in texts]
        assert not late_writes, f"holder {worker} wrote after its successor: {late_writes}"
        late = [e for e in run.events if e["worker"] == worker and e.get("token") == token and e["at"] > resumed_at]
        assert [e for e in late if e["event"] == "fenced"], f"holder {worker} was not refused after resuming: {late}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--holders", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--faults", type=int, default=4)
    parser.add_argument("--partitions", action="store_true",
                        help="raft links through the chaos proxy; each fault also isolates the leader")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="metakv-chaos-locks-") as tmp:
        chaos = ChaosCluster(Path(tmp), voters=3, settings=FAST) if args.partitions else None
        cluster = chaos.cluster if chaos is not None else Cluster(Path(tmp), voters=3, settings=FAST)
        try:
            cluster.start()
            run = run_fencing(cluster, args.holders, args.rounds, args.faults,
                              network=chaos.network if chaos is not None else None)
        finally:
            if chaos is not None:
                chaos.close()
            else:
                cluster.close()
        check(run)
    acquisitions = len([e for e in run.events if e["event"] == "acquired"])
    print(f"ok: {acquisitions} acquisitions, {len(run.history) - 1} fenced writes in order, "
          f"{len(run.stopped)} paused holders refused after resuming, {args.faults} leader kills"
          + (f", {args.faults} leader isolations" if args.partitions else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
