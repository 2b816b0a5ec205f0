"""Dynamic voters in the simulator (KIP-853): the seeds that change the voter set.

In ``MEMBERSHIP_PROBABILITY`` of the seeds (drawn from their own stream, so the other seeds
run as before) every replica has a directory id, the cluster holds spare replicas
(observers that may be added), and the fault phase mixes in changes issued on whichever
node leads at that moment, through ``RaftNode.add_voter`` / ``remove_voter``:

- ``add``: a replica outside the set (a spare, or a voter removed before) joins; refusals
  (not caught up, a change pending, the leader not ready) are retried a few times.
- ``remove``, ``remove_leader``, ``remove_crashed``: a follower, the leader itself, or a
  voter crashed just before.
- ``replace``: a voter's disk is replaced (``Cluster.replace_disk``: an empty, unformatted
  directory with a new directory id, so a new replica under the same node id, which joins
  through the other voters); once it runs, the old replica is removed and the new one
  added, retried until both are committed.
- After an election, in some seeds, a change is tried at once and retried every
  millisecond, so it lands right when the new leader's gate opens.

A refusal (``VoterChangeError``) is fine and counted in the stats. The liveness phase
finishes any replacement, then the rest of the run treats the final set as the voters.
The invariants are in tests/sim/membership_checks.py.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from raft.node import Role
from raft.voters import Voter, VoterChangeError, VoterSet
from tests.sim.cluster import Cluster, InvariantViolation, SimNode

MEMBERSHIP_PROBABILITY = 0.2  # make sim and make mutants
QUICK_MEMBERSHIP_PROBABILITY = 0.05  # make test's share (tests/sim/test_sim.py): a subset of the above
MAX_SPARES = 2
RETRY_MS = 20  # how often a refused change is tried again
ADD_TRIES = 10
AFTER_ELECTION_PROBABILITY = 0.5  # of membership seeds: a change tried the moment a leader is elected
AFTER_ELECTION_TRIES = 100  # one per simulated ms
REPAIR_BOUND_MS = 3_000  # liveness: a pending change commits and replacements complete
MIN_CHANGES, MAX_CHANGES = 2, 6  # scheduled in the fault phase
KINDS = ("add", "add", "remove", "remove_leader", "remove_crashed", "replace")
LOSE_ADDED_PROBABILITY = 0.3  # of membership seeds without another disk loss planned


def membership_rng(seed: int) -> random.Random:
    return random.Random(seed * 49_979_687 + 29)


def has_membership(seed: int, probability: float = MEMBERSHIP_PROBABILITY) -> bool:
    """Whether this seed changes the voter set (the first draw of its own stream)."""
    return membership_rng(seed).random() < probability


def spares_for(seed: int) -> int:
    rng = membership_rng(seed)
    rng.random()
    return rng.randint(1, MAX_SPARES)


def members(voter_set: VoterSet) -> set[tuple[int, str]]:
    return {(voter.replica_id, voter.directory_id) for voter in voter_set.voters}


def is_member(cluster: Cluster, voter_set: VoterSet, node_id: int) -> bool:
    """The replica now running as ``node_id`` is in the set (a static "" directory matches any)."""
    return voter_set.contains(node_id, cluster.nodes[node_id].directory_id)


def voter_of(node: SimNode) -> Voter:
    return Voter(node.node_id, node.directory_id, node.config.endpoint)


class MembershipPlan:
    """The seed's voter changes in the fault phase (``schedule``) and their completion in
    the liveness phase (``settle``)."""

    def __init__(self, cluster: Cluster, seed: int, log: Callable[[str], None], fault_phase_ms: int,
                 disk_loss_planned: bool) -> None:
        self.cluster, self.log, self.fault_phase_ms = cluster, log, fault_phase_ms
        self.rng = membership_rng(seed)
        self.rng.random()
        self.rng.randint(1, MAX_SPARES)  # the draws of has_membership and spares_for
        # A replaced disk and a lost one in the same run may leave no majority that can vote;
        # so may a lost disk in a set of two (its voter votes for nobody until it caught up).
        self.replace_allowed = not disk_loss_planned
        self.min_voters = 3 if disk_loss_planned else 1  # removals keep at least this many
        self.replaced: set[int] = set()  # nodes whose disk was replaced: their old replica goes, the new one comes
        self.after_election = self.rng.random() < AFTER_ELECTION_PROBABILITY
        self.next_repair_ms = 0  # the liveness phase's repair acts at most every RETRY_MS
        # Rule 12 for a voter the log added (not in the bootstrap set): its log is lost, its
        # quorum state kept. Its own stream, so the other draws stay as they were.
        lose_rng = random.Random(seed * 15_485_863 + 31)
        self.loses_added_disk = not disk_loss_planned and lose_rng.random() < LOSE_ADDED_PROBABILITY
        self.lose_added_at_ms = lose_rng.randint(fault_phase_ms // 4, fault_phase_ms // 2)
        self.lose_added_back_ms = lose_rng.randint(20, 800)
        self.lose_added_pick = lose_rng.random()
        if self.loses_added_disk:
            self.replace_allowed = False  # as with any lost disk (above)

    # ------------------------------------------------------------------ issuing a change

    def leader(self) -> SimNode | None:
        leader = self.cluster.leader()
        if leader is None or leader.core is None or leader.paused:
            return None
        return leader

    def issue(self, leader: SimNode, what: str, change: Callable[[], int]) -> str:
        """Run one add/remove on the leader; the refusal code, or "" once appended."""
        cluster = self.cluster
        try:
            offset = change()
        except VoterChangeError as exc:
            cluster.stats[f"voter_change_refused_{exc.code}"] += 1
            return exc.code
        cluster.stats["voter_changes_appended"] += 1
        self.log(f"{what} on leader {leader.node_id} at offset {offset}")
        cluster.after_input(leader)
        return ""

    def add(self, node_id: int, tries: int = ADD_TRIES) -> None:
        """Add the replica now running as ``node_id``; retry refusals a few times."""
        leader = self.leader()
        if leader is None or leader.core is None:
            self.cluster.stats["voter_change_no_leader"] += 1
            code = "no-leader"
        elif is_member(self.cluster, leader.core.voter_set, node_id):
            return
        else:
            code = self.add_on(leader, node_id)
        if code and tries > 1 and code not in ("already-voter", "kraft-version-0"):
            self.cluster.at(self.cluster.now_ms + RETRY_MS, lambda: self.add(node_id, tries - 1))

    def add_on(self, leader: SimNode, node_id: int, what: str = "") -> str:
        core, voter = leader.core, voter_of(self.cluster.nodes[node_id])
        assert core is not None
        return self.issue(leader, f"add voter {node_id} ({voter.directory_id[:6]}){what}",
                          lambda: core.add_voter(voter, self.cluster.now_ms))

    def remove(self, node_id: int, directory_id: str | None = None) -> str:
        leader = self.leader()
        if leader is None or leader.core is None:
            self.cluster.stats["voter_change_no_leader"] += 1
            return "no-leader"
        return self.remove_on(leader, node_id, directory_id)

    def remove_on(self, leader: SimNode, node_id: int, directory_id: str | None = None, what: str = "") -> str:
        assert leader.core is not None
        if directory_id is None:
            found = [v for v in leader.core.voter_set.voters if v.replica_id == node_id]
            directory_id = found[0].directory_id if found else self.cluster.nodes[node_id].directory_id
        core, directory = leader.core, directory_id
        return self.issue(leader, f"remove voter {node_id} ({directory[:6]}){what}",
                          lambda: core.remove_voter(node_id, directory, self.cluster.now_ms))

    # ------------------------------------------------------------------ the fault phase

    def schedule(self) -> None:
        cluster = self.cluster
        for _ in range(self.rng.randint(MIN_CHANGES, MAX_CHANGES)):
            at_ms = self.rng.randint(100, self.fault_phase_ms)
            kind = self.rng.choice(KINDS)
            pick = self.rng.random()  # which replica, among those that fit when it runs
            cluster.at(at_ms, lambda k=kind, p=pick: self._run(k, p))
        if self.loses_added_disk:
            cluster.at(self.lose_added_at_ms, self._lose_added_disk)
        if self.after_election:
            previous = cluster.on_elected

            def on_elected(node: SimNode) -> None:
                if previous is not None:
                    previous(node)
                if cluster.now_ms < self.fault_phase_ms and self.rng.random() < 0.5:
                    self._right_after_election(node, self.rng.random(), AFTER_ELECTION_TRIES)
            cluster.on_elected = on_elected

    def _run(self, kind: str, pick: float) -> None:
        cluster = self.cluster
        leader = self.leader()
        if leader is None or leader.core is None:
            cluster.stats["voter_change_no_leader"] += 1
            return
        voter_set = leader.core.voter_set
        inside = sorted(v.replica_id for v in voter_set.voters)
        outside = [n for n in sorted(cluster.nodes) if n not in voter_set.ids and n not in self.replaced]
        followers = [n for n in inside if n != leader.node_id]
        if kind.startswith("remove") and not self._may_remove(voter_set):
            cluster.stats["voter_change_skipped"] += 1
        elif kind == "add" and outside:
            self.add(outside[int(pick * len(outside))])
        elif kind == "remove" and followers:
            self.remove(followers[int(pick * len(followers))])
        elif kind == "remove_leader":
            self.remove(leader.node_id)
        elif kind == "remove_crashed" and len(inside) >= 3 and followers:
            victim = followers[int(pick * len(followers))]
            self.log(f"crash voter {victim}, then remove it")
            cluster.crash(victim)
            cluster.at(cluster.now_ms + self.rng.randint(0, 50), lambda: self.remove(victim))
            cluster.at(cluster.now_ms + self.rng.randint(100, 800),
                       lambda: (self.log(f"restart {victim}"), cluster.restart(victim)))
        elif (kind == "replace" and self.replace_allowed and not self.replaced and len(inside) >= 3
              and leader.core.pending_voter_change is None  # else the committed set may be two: no majority left
              and all(v.directory_id for v in voter_set.voters)):  # a static set matches any directory
            self._replace(inside[int(pick * len(inside))], voter_set)

    def _lose_added_disk(self) -> None:
        """An added voter of a set of at least three loses its log (quorum state kept) and
        comes back empty: it must grant no votes until caught up (rule 12), although its
        re-formatted log's set no longer names it. Removals keep three voters from now on."""
        cluster = self.cluster
        if cluster.now_ms >= self.fault_phase_ms:
            cluster.stats["voter_disk_loss_not_done"] += 1
            return
        leader = self.leader()
        voter_set = leader.core.voter_set if leader is not None and leader.core is not None else None
        added = [] if leader is None or voter_set is None else [
            n for n in sorted(voter_set.ids) if n not in cluster.voter_ids and n != leader.node_id
            and n not in self.replaced and cluster.nodes[n].core is not None]
        if voter_set is None or len(voter_set.ids) < 3 or not added or leader is None:
            cluster.at(cluster.now_ms + RETRY_MS, self._lose_added_disk)  # no leader, or none added yet
            return
        victim = added[int(self.lose_added_pick * len(added))]
        self.min_voters = 3
        self.log(f"lose disk of added voter {victim}")
        cluster.lose_disk(victim)
        cluster.stats["voter_disks_lost_after_add"] += 1
        back_ms = cluster.now_ms + self.lose_added_back_ms
        cluster.at(back_ms, lambda: (self.log(f"restart {victim}"), cluster.restart(victim)))
        # An election while it catches up: the one moment its vote must be withheld.
        crash_ms = back_ms + int(self.lose_added_pick * 50)
        cluster.at(crash_ms, lambda: self._crash_leader_for(self.lose_added_back_ms // 2 + 100))

    def _crash_leader_for(self, down_ms: int) -> None:
        leader = self.leader()
        if leader is None:
            return
        node_id = leader.node_id
        self.log(f"crash leader {node_id} while a lost disk catches up")
        self.cluster.crash(node_id)
        self.cluster.at(self.cluster.now_ms + down_ms,
                        lambda: (self.log(f"restart {node_id}"), self.cluster.restart(node_id)))

    def _may_remove(self, voter_set: VoterSet) -> bool:
        """Removals keep ``min_voters``, and wait while a replaced disk's old replica is in
        the set: it never votes again, so a smaller set could be left without a majority
        (removing the old replica itself is the repair's job)."""
        return (len(voter_set.ids) > self.min_voters
                and all(is_member(self.cluster, voter_set, n) for n in voter_set.ids))

    def _replace(self, victim: int, voter_set: VoterSet) -> None:
        """The new disk is not formatted: the node joins through the other voters (as with
        ``--bootstrap-servers``), an observer until it is added."""
        cluster = self.cluster
        node = cluster.nodes[victim]
        old = node.directory_id
        self.log(f"replace disk of {victim}")
        cluster.replace_disk(victim)
        node.config = dataclasses.replace(node.config, initial_voters=None, voters=voter_set.ids - {victim})
        self.replaced.add(victim)
        back_ms = cluster.now_ms + self.rng.randint(20, 400)
        cluster.at(back_ms, lambda: (self.log(f"restart {victim} on its new disk"), cluster.restart(victim)))
        cluster.at(back_ms + RETRY_MS, lambda: self._repair(victim, old))

    def _repair(self, victim: int, old: str) -> None:
        """Remove the replaced disk's old replica, then add the new one; retried until done
        (the liveness phase finishes it otherwise)."""
        cluster = self.cluster
        if cluster.now_ms >= self.fault_phase_ms:
            return
        leader = self.leader()
        if leader is not None and leader.core is not None:
            voter_set = leader.core.voter_set
            if leader.core.pending_voter_change is not None:
                pass
            elif (victim, old) in members(voter_set):
                self.remove(victim, old)
            elif not is_member(cluster, voter_set, victim):
                self.add(victim, tries=1)
            elif voter_set == _committed_set(leader):
                self.replaced.discard(victim)
                self.log(f"replacement of {victim} committed")
                return
        cluster.at(cluster.now_ms + RETRY_MS, lambda: self._repair(victim, old))

    def _right_after_election(self, leader: SimNode, pick: float, tries: int) -> None:
        """Try a change every ms from the moment ``leader`` is elected until its gate lets one
        through (or something else refuses it)."""
        core = self.cluster.nodes[leader.node_id].core
        if core is None or core.role != Role.LEADER or leader.paused or tries == 0:
            return
        voter_set = core.voter_set
        outside = [n for n in sorted(self.cluster.nodes) if n not in voter_set.ids and n not in self.replaced]
        followers = sorted(voter_set.ids - {leader.node_id}) if self._may_remove(voter_set) else []
        if outside and (pick < 0.5 or not followers):
            code = self.add_on(leader, outside[int(pick * len(outside))], " right after the election")
        elif followers:
            code = self.remove_on(leader, followers[int(pick * len(followers))], what=" right after the election")
        else:
            return
        if code == "leader-not-ready":
            self.cluster.at(self.cluster.now_ms + 1, lambda: self._right_after_election(leader, pick, tries - 1))
        elif not code:
            self.cluster.stats["voter_changes_right_after_election"] += 1

    # ------------------------------------------------------------------ the liveness phase

    def settle(self, await_commit: Callable[[str], None]) -> VoterSet:
        """Everything healed: the pending change commits, every replaced disk's replica is
        swapped in, and a leader of the final set commits. Returns the final set."""
        cluster = self.cluster
        done = cluster.run_until(self._settled, REPAIR_BOUND_MS)
        leader = self.leader()
        if not done or leader is None or leader.core is None:
            raise InvariantViolation(f"t={cluster.now_ms} liveness: the voter set did not settle within "
                                     f"{REPAIR_BOUND_MS} ms (leader {leader and leader.node_id}, replaced "
                                     f"{sorted(self.replaced)})")
        await_commit("the voter set settled")
        leader = self.leader()
        assert leader is not None and leader.core is not None
        final = leader.core.voter_set
        if not is_member(cluster, final, leader.node_id):
            raise InvariantViolation(f"t={cluster.now_ms} liveness: leader {leader.node_id} is not in the final "
                                     f"voter set {sorted(final.ids)}")
        self.log(f"final voter set {sorted(final.ids)}")
        return final

    def _settled(self) -> bool:
        """One step of the repair, run between events: True once nothing is left to do."""
        leader = self.leader()
        if leader is None or leader.core is None or self.cluster.now_ms < self.next_repair_ms:
            return False
        self.next_repair_ms = self.cluster.now_ms + RETRY_MS
        core = leader.core
        if core.pending_voter_change is not None:
            return False
        stale = [(v.replica_id, v.directory_id) for v in core.voter_set.voters
                 if v.directory_id and v.directory_id != self.cluster.nodes[v.replica_id].directory_id]
        if stale:
            self.remove(*stale[0])
            return False
        missing = [n for n in sorted(self.replaced) if not is_member(self.cluster, core.voter_set, n)]
        if missing:
            self.add(missing[0], tries=1)
            return False
        self.replaced.clear()
        return True


def _committed_set(leader: SimNode) -> VoterSet | None:
    """The set in force at the leader's high watermark (that of its last committed record)."""
    core = leader.core
    assert core is not None
    return core.voter_set_at(core.high_watermark)
