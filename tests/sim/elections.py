"""Election time in the simulator: ``python -m tests.sim.elections [--seeds N]``.

Measures, in simulated ms, how long a cluster is without a leader after a fault, over many
seeds, and prints median, p90 and max per scenario (issue 20, defect 5: the pre-vote rule
must cost at most one round). The cluster runs the simulator's default network (1-5 ms
delays, no loss) with its timeouts (fetch 200 ms, election 100-200 ms).

Scenarios, each after the first leader has been idle for a while (its followers' fetches
are parked and answered together, so their fetch timeouts are in step):
- ``idle-3``, ``idle-5``: the leader of a 3- or 5-voter cluster crashes;
- ``cut-link-5``: in a 5-voter cluster the leader and one more voter crash, and the link
  between the lowest and the highest surviving id is cut, so only the middle survivor
  reaches a majority and must win.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

from tests.sim.cluster import Cluster
from tests.sim.scenario import LIVENESS_BOUND_MS

IDLE_MS = 1_000  # the first leader's idle time before the fault
GIVE_UP_MS = 30_000  # a run with no leader after this long counts as this long


@dataclass(frozen=True, slots=True)
class Election:
    """One measured failover: simulated ms from the fault to a leader of a higher epoch."""

    seed: int
    election_ms: int
    epochs: int  # epochs the failover used (1: the first election won)


def _first_leader(cluster: Cluster) -> int:
    if not cluster.run_until(lambda: cluster.leader() is not None, GIVE_UP_MS):
        raise AssertionError(f"seed {cluster.seed}: no first leader")
    cluster.run_for(IDLE_MS)
    leader = cluster.leader()
    assert leader is not None
    return leader.node_id


def _measure(cluster: Cluster, fault: Callable[[int], set[int]]) -> Election:
    """Apply ``fault`` to the idle leader (it returns the nodes it killed) and time the
    election of a new leader among the survivors."""
    old_leader = _first_leader(cluster)
    old_epoch = cluster.nodes[old_leader].core.epoch  # type: ignore[union-attr]
    killed = fault(old_leader)
    started_ms = cluster.now_ms

    def new_leader() -> bool:
        leader = cluster.leader()
        return leader is not None and leader.node_id not in killed and leader.core.epoch > old_epoch  # type: ignore[union-attr]

    elected = cluster.run_until(new_leader, GIVE_UP_MS)
    leader = cluster.leader()
    epochs = leader.core.epoch - old_epoch if elected and leader is not None and leader.core is not None else 0
    return Election(cluster.seed, cluster.now_ms - started_ms, epochs)


def idle_failover(seed: int, voters: int) -> Election:
    """The leader of an idle ``voters``-voter cluster crashes."""
    cluster = Cluster(seed, voters)

    def crash_leader(leader_id: int) -> set[int]:
        cluster.crash(leader_id)
        return {leader_id}
    return _measure(cluster, crash_leader)


def cut_link_failover(seed: int) -> Election:
    """Five voters: the idle leader and one other voter crash, and the link between the
    lowest and the highest surviving id is cut (only the middle one can win)."""
    cluster = Cluster(seed, 5)
    rng = random.Random(seed)

    def crash_two_cut_one(leader_id: int) -> set[int]:
        other = rng.choice(sorted(cluster.voter_ids - {leader_id}))
        for node_id in (leader_id, other):
            cluster.crash(node_id)
        survivors = sorted(cluster.voter_ids - {leader_id, other})
        cluster.partition({survivors[0]}, {survivors[-1]})
        return {leader_id, other}
    return _measure(cluster, crash_two_cut_one)


SCENARIOS: dict[str, Callable[[int], Election]] = {
    "idle-3": lambda seed: idle_failover(seed, 3),
    "idle-5": lambda seed: idle_failover(seed, 5),
    "cut-link-5": cut_link_failover,
}


def percentile(values: list[int], fraction: float) -> int:
    """The nearest-rank percentile of ``values`` (non-empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered) + 0.5) - 1))]


def summary(name: str, elections: list[Election]) -> str:
    times = [e.election_ms for e in elections]
    slow = sum(1 for t in times if t > LIVENESS_BOUND_MS)
    extra_rounds = sum(1 for e in elections if e.epochs > 1)
    return (f"{name:<11} n={len(times):<4} median={statistics.median(times):>6.0f} ms  "
            f"p90={percentile(times, 0.9):>5} ms  max={max(times):>5} ms  "
            f">{LIVENESS_BOUND_MS} ms: {slow}  more than one epoch: {extra_rounds}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.elections", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=200, help="seeds per scenario")
    parser.add_argument("--first", type=int, default=0, help="first seed")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append",
                        help="only this scenario (repeatable; default: all)")
    args = parser.parse_args(argv)
    for name in args.scenario or list(SCENARIOS):
        elections = [SCENARIOS[name](seed) for seed in range(args.first, args.first + args.seeds)]
        print(summary(name, elections), flush=True)
        slowest = max(elections, key=lambda e: e.election_ms)
        print(f"{'':<11} slowest: seed {slowest.seed} ({slowest.election_ms} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
