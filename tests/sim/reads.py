"""Linearizable reads from a deposed leader that does not know it yet, drawn per seed.

A leader's links stall (a stalled connection: what is sent waits and arrives when the
network heals), so the other voters elect a successor, which commits, while the old leader
still believes it leads until check-quorum. Clients still reach the old leader and issue
reads through ``read_index`` (raft/roles.py ``PendingRead``); then the network heals, and
the Fetches the followers sent to the old leader before they moved on arrive after those
reads began. The client (tests/sim/scenario.py ``_Load``) checks every completed read: its
read index covers everything committed before the read began, so it sees every write
acknowledged by then. A Fetch sent before a read began says nothing of who leads after it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from raft.node import Role
from tests.sim.cluster import Cluster, SimNode

STALE_LEADER_PROBABILITY = 0.5  # of the seeds with 3 or 5 voters
# Each stall ends when the old leader resigns: its successor commits first only when the
# followers' fetch timeouts and the network are quick. So the plan tries again and again.
RETRY_AFTER_MIN_MS = 100
RETRY_AFTER_MAX_MS = 400
POLL_MS = 2  # how often the plan looks for a successor that committed
GIVE_UP_MS = 800  # the old leader stalled this long at most
MAX_READS = 3  # reads sent to the old leader once its successor committed
HEAL_AFTER_MAX_MS = 10  # the stall ends this soon after those reads


def plan_stale_leader_reads(cluster: Cluster, seed: int, voters: int, fault_phase_ms: int,
                            log: Callable[[str], None], read: Callable[[SimNode], None]) -> None:
    """Sometimes stall the leader's links in the fault phase (its own random stream, so the
    other faults of a seed stay as they were); ``read`` issues one client read at a node."""
    rng = random.Random(seed * 15_485_863 + 29)
    if voters < 3 or rng.random() >= STALE_LEADER_PROBABILITY:
        return
    plan = _StaleLeader(cluster, rng, log, read, fault_phase_ms)
    cluster.at(rng.randint(100, fault_phase_ms // 2), plan.start)


class _StaleLeader:
    def __init__(self, cluster: Cluster, rng: random.Random, log: Callable[[str], None],
                 read: Callable[[SimNode], None], until_ms: int) -> None:
        self.cluster, self.rng, self.log, self.read, self.until_ms = cluster, rng, log, read, until_ms
        self.old: SimNode | None = None
        self.give_up_ms = 0

    def start(self) -> None:
        cluster = self.cluster
        if cluster.now_ms >= self.until_ms:
            return
        leader = cluster.leader()
        if leader is None or leader.core is None or leader.paused:
            self._again()
            return
        self.old, self.give_up_ms = leader, cluster.now_ms + GIVE_UP_MS
        self.log(f"stall leader {leader.node_id}")
        cluster.stall({leader.node_id}, set(cluster.nodes) - {leader.node_id})
        cluster.at(cluster.now_ms + POLL_MS, self.poll)

    def poll(self) -> None:
        cluster, old = self.cluster, self.old
        assert old is not None
        if cluster.now_ms >= self.until_ms:
            return  # the liveness phase healed everything
        core = old.core
        if core is None or core.role != Role.LEADER or cluster.now_ms >= self.give_up_ms:
            self._heal()
            self._again()
            return
        if not self._successor_committed(core.epoch, core.high_watermark):
            cluster.at(cluster.now_ms + POLL_MS, self.poll)
            return
        reads = self.rng.randint(1, MAX_READS)
        self.log(f"{reads} reads from deposed leader {old.node_id}, then heal")
        cluster.stats["deposed_leader_reads"] += reads
        for _ in range(reads):
            self.read(old)
        cluster.at(cluster.now_ms + self.rng.randint(1, HEAL_AFTER_MAX_MS), self._heal)
        self._again()

    def _heal(self) -> None:
        """End the stall; the liveness phase (from ``until_ms``) heals by itself."""
        if self.cluster.now_ms < self.until_ms:
            self.log("heal")
            self.cluster.heal()

    def _again(self) -> None:
        self.cluster.at(self.cluster.now_ms + self.rng.randint(RETRY_AFTER_MIN_MS, RETRY_AFTER_MAX_MS), self.start)

    def _successor_committed(self, epoch: int, high_watermark: int) -> bool:
        """A leader of a later epoch committed past what the old one knows to be committed."""
        successor = self.cluster.leader()
        return (successor is not None and successor.core is not None and successor.core.epoch > epoch
                and self.cluster.max_high_watermark > high_watermark)
