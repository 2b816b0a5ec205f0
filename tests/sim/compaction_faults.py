"""Targeted plans of the compaction simulator (tests/sim/compaction.py): the edges where the
compaction rules are easiest to get wrong by one, set up exactly rather than hoped for.

- ``TombstoneAtBound``: the observer holds a key; the delete of that key is the first record
  it lacks (offset V); every voter then cleans to a batch boundary B chosen so that the
  leader's re-bootstrap bound min(tombstone horizon, B - retention) is exactly V (the
  observer is just inside the retention window: the tombstone at V must survive and reach
  it) or V + 1 (one below: it must get a snapshot), and the observer comes back. Writes
  pause at B until it caught up, so its last Fetch answer, the one that brings it to the
  dirty offset (and its states to real versions), holds the end of the cleaned range.
- ``MidCopyRestart``: a replica copying the leader's cleaned log from 0 restarts gracefully
  inside the copy (after the first Fetch answer: the next fetch, from above 0 and below the
  leader's re-bootstrap bound, is sent a snapshot), its state kept at the copied end: no
  state inside the copy may count as real before it heard a leader again
  (docs/compaction.md rule 7).
- ``CopyHandover``: the leader crashes while a replica copies its cleaned log from 0; the
  copy goes on from the next leader, which may be cleaned less (it must then send a
  snapshot at or above the first leader's cleaned end, never raw records inside that end:
  docs/compaction.md rule 5), or more.
- ``restart_after_cleaning``: right after a cleaning, a replica loses power; on a log from 0
  its state.db comes back restored from an older copy, behind its own cleaned prefix (rule
  9): recovery must not replay that state through the prefix whose tombstones were dropped.

Each runs on the simulated clock through ``CompactionSim.at``; each counts in the run's
statistics whether it set up its edge (``sim_*``), so a test can tell a plan that never
reached its edge from one that passed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from raft.node import Proposal
from storage import compaction_policy as policy
from storage.commands import Command, Op, OpKind, encode_command

if TYPE_CHECKING:
    from tests.sim.cluster import SimNode
    from tests.sim.compaction import CompactionSim

POLL_MS = 2


class TombstoneAtBound:
    """See the module docstring. ``one_below``: the observer lags one offset below the bound
    (else exactly at it); ``then`` runs once the observer is back (or the plan gave up)."""

    def __init__(self, sim: CompactionSim, observer: int, one_below: bool, give_up_ms: int,
                 then: Callable[[], None]) -> None:
        self.sim, self.observer, self.one_below = sim, observer, one_below
        self.give_up_ms, self.then = give_up_ms, then
        self.victim = "victim"  # a key no other record names: nothing re-creates it
        self.put: Proposal | None = None
        self.delete_offset = -1
        self.boundary = -1
        self.done = False
        self.give_up_stat = "sim_bound_plans_missed"  # counted when the plan runs out of time

    def start(self) -> None:
        self.sim.proposals_held = self.sim.voter_cleaning_held = True
        self._poll(self._put_victim)

    def _poll(self, step: Callable[[], bool]) -> None:
        """Run ``step`` now and every POLL_MS until it reports progress (True)."""
        sim = self.sim
        if self.done:
            return
        if sim.cluster.now_ms > self.give_up_ms:
            self._finish(self.give_up_stat)
            return
        if not step():
            sim.cluster.at(sim.cluster.now_ms + POLL_MS, lambda: self._poll(step))

    def _put_victim(self) -> bool:
        put = self.sim.propose_records((encode_command(Command((), (Op(OpKind.PUT, self.victim, b"old"),))),))
        if put is None:
            return False
        self.put = put
        self._poll(self._delete_when_synced)
        return True

    def _delete_when_synced(self) -> bool:
        """Once the observer holds everything the leader has (the put committed and applied),
        delete the victim and cut the observer off before the delete reaches it."""
        sim, cluster = self.sim, self.sim.cluster
        leader, node = cluster.leader(), cluster.nodes[self.observer]
        put = self.put
        if leader is None or leader.core is None or node.core is None or put is None:
            return False
        if leader.core.epoch != put.epoch:
            return self._restart_plan()
        end = leader.log.end_offset()
        if (end <= put.last_offset or node.log.end_offset() != end or node.log.flushed_offset() != end
                or sim.models[self.observer].applied <= put.last_offset or leader.core.high_watermark != end):
            return False
        delete = sim.propose_records((encode_command(Command((), (Op(OpKind.DELETE, self.victim),))),))
        if delete is None or delete.base_offset != end:
            return self._restart_plan()
        cluster.partition({self.observer}, set(cluster.voter_ids))  # the delete's answer never arrives
        self.delete_offset = end
        self.boundary = end + leader.config.tombstone_retention_records + (1 if self.one_below else 0)
        sim.boundary = self.boundary
        sim.proposals_held = False
        self._poll(self._clean_at_boundary)
        return True

    def _restart_plan(self) -> bool:
        """The leader changed meanwhile: put the victim again under the new one."""
        self._poll(self._put_victim)
        return True

    def _clean_at_boundary(self) -> bool:
        """Once every live voter may clean to the boundary, each cleans exactly to it (as a
        replica whose min_compaction_lag_ms holds the rest back would), and the observer
        comes back."""
        sim, cluster = self.sim, self.sim.cluster
        leader = cluster.leader()
        if leader is None or leader.core is None:
            return False
        if sim.boundary is not None and leader.log.end_offset() >= self.boundary:
            sim.boundary, sim.proposals_held = None, True  # reached: writes pause there
        if sim.boundary is not None:
            return False
        voters = [cluster.nodes[v] for v in sorted(cluster.voter_ids) if cluster.nodes[v].core is not None]
        for voter in voters:
            core = voter.core
            assert core is not None
            if policy.clean_target_offset(core.dirty_offset, sim.models[voter.node_id].applied,
                                          voter.log.flushed_offset()) < self.boundary:
                return False
        if not any(batch.next_offset == self.boundary for batch in leader.log.batches()):
            self._finish("sim_bound_plans_missed")  # a leader change moved the offsets
            return True
        for voter in voters:
            sim.clean(voter.node_id, up_to=self.boundary)
        expected = self.delete_offset + (1 if self.one_below else 0)
        reached = leader.core.tombstone_unsafe_below() == expected and sim.history_record_is(
            self.delete_offset, self.victim)
        cluster.stats[("sim_lagged_one_below_bound" if self.one_below else "sim_lagged_at_bound")
                      if reached else "sim_bound_plans_missed"] += 1
        cluster.heal()
        self.give_up_ms, self.give_up_stat = cluster.now_ms + 500, ""
        self._poll(self._resume_when_caught_up)
        return True

    def _resume_when_caught_up(self) -> bool:
        node = self.sim.cluster.nodes[self.observer]
        if node.log.end_offset() < self.boundary:
            return False
        self._finish("")
        return True

    def _finish(self, stat: str) -> None:
        sim = self.sim
        self.done = True
        if stat:
            sim.cluster.stats[stat] += 1
        sim.boundary = None
        sim.proposals_held = sim.voter_cleaning_held = False
        sim.cluster.heal()
        self.then()


class MidCopyRestart:
    """See the module docstring: watches ``node_id`` from ``from_ms`` on and restarts it once
    it copied (and applied) part of the leader's cleaned prefix."""

    def __init__(self, sim: CompactionSim, node_id: int, down_ms: int, give_up_ms: int) -> None:
        self.sim, self.node_id = sim, node_id
        self.down_ms, self.give_up_ms = down_ms, give_up_ms

    def watch(self) -> None:
        sim, cluster = self.sim, self.sim.cluster
        if cluster.now_ms > self.give_up_ms:
            cluster.stats["sim_mid_copy_restarts_missed"] += 1
            return
        node, leader = cluster.nodes[self.node_id], cluster.leader()
        model = sim.models.get(self.node_id)
        if (node.core is not None and leader is not None and model is not None
                and model.incarnation == node.incarnation):
            if inside_copy(node, leader) and model.applied >= node.log.end_offset():
                cluster.stats["sim_mid_copy_restarts"] += 1
                sim.graceful_restart(self.node_id, self.down_ms)
                return
        cluster.at(cluster.now_ms + POLL_MS, self.watch)


def inside_copy(node: SimNode, leader: SimNode) -> bool:
    """Whether ``node`` is inside a copy of ``leader``'s cleaned prefix: everything it holds
    was copied, and the prefix goes on past it (so its state lacks ops the rest of the copy
    supersedes)."""
    end = node.log.end_offset()
    return 0 < end <= node.log.cleaned_end() and end < leader.log.cleaned_end()


class CopyHandover:
    """See the module docstring: watches ``node_id`` from its restart on and, once it copied
    part of the leader's cleaned prefix, cleans the leader to its dirty offset (so that the
    other voters are likely cleaned less) and crashes it; it comes back 150-400 ms later."""

    def __init__(self, sim: CompactionSim, node_id: int, give_up_ms: int) -> None:
        self.sim, self.node_id, self.give_up_ms = sim, node_id, give_up_ms

    def watch(self) -> None:
        sim, cluster = self.sim, self.sim.cluster
        if cluster.now_ms > self.give_up_ms:
            cluster.stats["sim_copy_handovers_missed"] += 1
            return
        node, leader = cluster.nodes[self.node_id], cluster.leader()
        if node.core is not None and leader is not None and inside_copy(node, leader):
            sim.clean(leader.node_id)
            cleaned_end = leader.log.cleaned_end()
            cluster.crash(leader.node_id)
            cluster.stats["sim_copy_handovers"] += 1
            cluster.at(cluster.now_ms + POLL_MS, lambda: self._next_leader(cleaned_end, cluster.now_ms + 1000))
            cluster.at(cluster.now_ms + sim.rng.randrange(150, 400), lambda: cluster.restart(leader.node_id))
            return
        cluster.at(cluster.now_ms + POLL_MS, self.watch)

    def _next_leader(self, cleaned_end: int, give_up_ms: int) -> None:
        """Count whether the copy went on from a leader cleaned less than the first."""
        cluster = self.sim.cluster
        leader = cluster.leader()
        if leader is not None and leader.core is not None:
            less = leader.log.cleaned_end() < cleaned_end
            cluster.stats["sim_copy_handovers_to_less_cleaned" if less else "sim_copy_handovers_to_cleaned"] += 1
        elif cluster.now_ms < give_up_ms:
            cluster.at(cluster.now_ms + POLL_MS, lambda: self._next_leader(cleaned_end, give_up_ms))


def restart_after_cleaning(sim: CompactionSim, node_id: int, down_ms: int) -> None:
    """Clean ``node_id`` now and cut its power at once. On a log from 0, state.db comes back
    restored from the newest copy synced before its cleaned prefix ends (the runtime must
    rebuild, never replay that state through the prefix); on a log that starts at a
    snapshot, where the runtime would refuse such a copy by design, the state is what its
    last sync kept (the cleaning synced first, rule 9)."""
    cluster = sim.cluster
    node = cluster.nodes[node_id]
    if node.core is None:
        return
    sim.clean(node_id)
    model = sim.models[node_id]
    cluster.crash(node_id)
    older = [copy for copy in model.synced if 0 < copy[0] < node.log.cleaner_end()]
    if node.log.start_offset() == 0 and older:
        sim.restored[node_id] = older[-1]
        cluster.stats["sim_state_copies_restored"] += 1
    else:
        cluster.stats["sim_power_losses_after_cleaning"] += 1
    cluster.at(cluster.now_ms + down_ms, lambda: cluster.restart(node_id))
