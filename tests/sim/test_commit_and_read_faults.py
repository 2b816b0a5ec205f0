"""The simulator's faults aimed at the commit and read rules (tests/sim/commit_faults.py,
tests/sim/reads.py) and the stalled link they use (tests/sim/cluster.py ``stall``)."""

from __future__ import annotations

import collections

from raft.messages import FetchRequest
from raft.node import Role
from tests.sim.cluster import Cluster
from tests.sim.scenario import run_seed

SEEDS = range(1, 61)  # 40 of them with 3 or 5 voters


def test_a_stalled_link_delivers_what_it_held_on_heal() -> None:
    """A stalled leader hears nothing while its successor is elected; on heal it receives,
    in order, the Fetches its followers sent before they moved on, then the new epoch."""
    cluster = Cluster(seed=5, voters=3)
    assert cluster.run_until(lambda: cluster.leader() is not None, 5_000)
    cluster.run_for(300)  # its followers fetch from it
    old = cluster.leader()
    assert old is not None and old.core is not None
    old_epoch = old.core.epoch
    cluster.stall({old.node_id}, set(cluster.nodes) - {old.node_id})
    assert cluster.run_until(lambda: any(n.core is not None and n.core.role == Role.LEADER and n.core.epoch > old_epoch
                                         for n in cluster.nodes.values()), 1_000)
    held_fetches = [e for e in cluster.stalled
                    if isinstance(e.payload.message, FetchRequest) and e.payload.dst == old.node_id]
    assert held_fetches and all(e.payload.message.epoch == old_epoch for e in held_fetches)
    cluster.heal()
    assert not cluster.stalled
    cluster.run_for(50)
    assert old.core.epoch > old_epoch and old.core.role != Role.LEADER


def test_the_plans_run() -> None:
    """Over a few seeds each plan reaches its point: reads sent to a deposed leader, a
    figure-8 leader crashed with its tail on a majority, a disk lost ahead of the high
    watermark (a plan that stopped doing so would let its mutants through unseen)."""
    exercised: collections.Counter[str] = collections.Counter()
    for seed in SEEDS:
        exercised.update(run_seed(seed).stats)
    for what in ("deposed_leader_reads", "figure_8", "disks_lost_ahead"):
        assert exercised[what] > 0, f"seeds {SEEDS} never exercised {what}: {dict(exercised)}"
