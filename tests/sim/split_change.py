"""The schedule KIP-853's own-epoch gate exists for (Ongaro's single-server change bug, raft-dev
2015), run once in the liveness phase of some seeds that change the voter set:

1. The committed set C has four voters and a spare replica b is outside it (the scenario
   adds or removes one voter first).
2. The leader L1 and b are cut off from the rest; L1 adds b. C1 = C + b reaches b only:
   not committed (it needs three of five).
3. The other three elect L2. At once one of them, x, is cut off, and L2 tries to remove x
   every millisecond. With the gate, L2 must first commit an entry of its epoch, which it
   cannot (two of four); without it, C2 = C - x is committed by L2 and the third voter.
4. L1, b and x are put together, the others cut off: L1 (or b) can win under C1 with x's
   vote. C1 and C2 are two changes apart, their majorities need not intersect: a leader
   elected under C1 while C2 is committed breaks "a new leader's set is at most one change
   from the committed set" (tests/sim/membership_checks.py), and would drop C2's commits.
5. Instead of 4, in some runs: the three others are put together and elect a leader under
   C; once healed, L1 and b truncate C1 (the change must be undone).

Every step waits at most ``STEP_BOUND_MS``; a step that cannot happen ends the scenario.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from raft.node import Role
from tests.sim.cluster import Cluster, SimNode
from tests.sim.membership import MembershipPlan, is_member

SPLIT_CHANGE_PROBABILITY = 0.5  # of the seeds that change the voter set, with five nodes or more
STEP_BOUND_MS = 1_500
ACT_EVERY_MS = 20  # how often step 1 tries a change
OTHER_SIDE_PROBABILITY = 0.3  # step 5 instead of step 4


def run_split_change(cluster: Cluster, plan: MembershipPlan, rng: random.Random, log: Callable[[str], None]) -> bool:
    """Run the scenario above; False when a step could not be set up (nothing to check)."""
    if len(cluster.nodes) < 5 or rng.random() >= SPLIT_CHANGE_PROBABILITY:
        return False
    scenario = _SplitChange(cluster, plan, rng, log)
    try:
        return scenario.run()
    finally:
        cluster.on_elected = None
        cluster.heal()


class _SplitChange:
    def __init__(self, cluster: Cluster, plan: MembershipPlan, rng: random.Random, log: Callable[[str], None]) -> None:
        self.cluster, self.plan, self.rng, self.log = cluster, plan, rng, log
        self.next_act_ms = 0
        self.second: SimNode | None = None  # L2
        self.cut = -1  # x

    def run(self) -> bool:
        cluster, log = self.cluster, self.log
        if not cluster.run_until(self._four_committed, STEP_BOUND_MS):
            log("split change: no committed set of four voters with a spare outside")
            return False
        first = self.plan.leader()
        assert first is not None and first.core is not None
        voters = first.core.voter_set
        spare = self.rng.choice([n for n in sorted(cluster.nodes) if n not in voters.ids])
        rest = set(cluster.nodes) - {first.node_id, spare}
        log(f"split change: cut off leader {first.node_id} with spare {spare}; it adds {spare}")
        cluster.partition({first.node_id, spare}, rest)
        if self.plan.add_on(first, spare):
            return False
        offset = first.core.pending_voter_change
        if offset is None or not cluster.run_until(lambda: cluster.nodes[spare].log.end_offset() > offset, STEP_BOUND_MS):
            return False
        others = sorted(voters.ids - {first.node_id})
        cluster.on_elected = lambda node: self._elected(node, first, others)
        if not cluster.run_until(lambda: self.second is not None, STEP_BOUND_MS):
            log("split change: no second leader")
            return False
        second = self.second
        assert second is not None
        cut = self.cut
        self.next_act_ms = cluster.now_ms
        if cluster.run_until(lambda: self._remove_at_once(second, cut), STEP_BOUND_MS // 3):
            cluster.run_until(lambda: second.core is None or second.core.pending_voter_change is None, STEP_BOUND_MS // 3)
        cluster.stats["split_changes"] += 1
        side = {first.node_id, spare, cut}
        if self.rng.random() < OTHER_SIDE_PROBABILITY:  # step 5 instead of 4
            side = set(others)
        log(f"split change: {sorted(side)} together, the rest cut off")
        cluster.heal()
        cluster.partition(side, set(cluster.nodes) - side)
        epoch = second.core.epoch if second.core is not None else 0
        cluster.run_until(lambda: any(cluster.nodes[n].core is not None and cluster.nodes[n].core.role == Role.LEADER  # type: ignore[union-attr]
                                      and cluster.nodes[n].core.epoch > epoch for n in side), STEP_BOUND_MS)  # type: ignore[union-attr]
        return True

    def _four_committed(self) -> bool:
        """Step 1: a committed set of four voters and a spare outside it; one change at a time."""
        plan, cluster = self.plan, self.cluster
        leader = plan.leader()
        if leader is None or leader.core is None or cluster.now_ms < self.next_act_ms:
            return False
        self.next_act_ms = cluster.now_ms + ACT_EVERY_MS
        core = leader.core
        voters = core.voter_set
        outside = [n for n in sorted(cluster.nodes) if n not in voters.ids and cluster.nodes[n].core is not None]
        if core.pending_voter_change is not None:
            return False
        if len(voters.ids) == 4 and outside and all(is_member(cluster, voters, n) for n in voters.ids):
            return True
        if len(voters.ids) < 4 and outside:
            plan.add(outside[0], tries=1)
        elif len(voters.ids) > 4:
            plan.remove(max(voters.ids - {leader.node_id}))
        return False

    def _elected(self, node: SimNode, first: SimNode, others: list[int]) -> None:
        """Step 3: the second leader is elected: cut one of the other two off at once."""
        core = node.core
        if self.second is not None or core is None or node.node_id not in others:
            return
        self.second = node
        self.cut = self.rng.choice([n for n in others if n != node.node_id])
        self.log(f"split change: {node.node_id} leads epoch {core.epoch}; cut off {self.cut}, remove it at once")
        self.cluster.partition({self.cut}, set(self.cluster.nodes) - {self.cut})

    def _remove_at_once(self, second: SimNode, cut: int) -> bool:
        """Try to remove ``cut`` every ms; True once appended or refused for good."""
        core = second.core
        if core is None or core.role != Role.LEADER:
            return True
        if self.cluster.now_ms < self.next_act_ms:
            return False
        self.next_act_ms = self.cluster.now_ms + 1
        return self.plan.remove_on(second, cut, what=" right after the election") != "leader-not-ready"
