"""Faults aimed at the commit rules (rules 6, 7 and 12 of raft/roles.py), drawn per seed,
each from its own random stream (the other faults of a seed stay as they were).

- A voter's disk lost: at a random moment, or (``_AheadLoss``) a follower's while it is
  ahead of the high watermark, restarted empty while the same leader keeps counting what
  it acknowledged before. The leader must count it for its new log only (cluster.py checks
  that a majority of voters durably holds every committed offset).
- Raft's figure 8 (``_Figure8``): a leader elected with records of an older epoch that are
  on no majority yet, while another node holds a LeaderChange record of an epoch between
  them at those offsets. Such records are not committed by being on a majority; only the
  new leader's own record commits them. Its followers fetch them a few batches per
  response (small max_batch_bytes), and the leader is lost before they reach its record.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from raft.node import Role
from tests.sim.cluster import Cluster, SimNode

DISK_LOSS_PROBABILITY = 0.15  # of the seeds with 3 or 5 voters: a random voter at a random time
DISK_LOSS_AHEAD_PROBABILITY = 0.25  # of the others: a follower ahead of lagging voters
RETRY_MS = 5  # how often a plan looks again for a leader (with followers)
# How long the laggards' links stall: below the fetch timeout (200 ms), so nobody campaigns.
LAG_MIN_MS = 60
LAG_MAX_MS = 160
FIGURE_8_PROBABILITY = 0.5  # of the seeds with 3 or 5 voters
FIGURE_8_STEP_MAX_MS = 800  # a step of the figure-8 plan that waits longer gives up
B_DOWN_MIN_MS = 500  # how long the figure-8 plan's second leader stays down
B_DOWN_MAX_MS = 1_000


def plan_disk_loss(cluster: Cluster, seed: int, voters: int, fault_phase_ms: int,
                   log: Callable[[str], None]) -> bool:
    """Sometimes one voter loses its disk (log and snapshots; quorum-state kept) and comes
    back empty. At most one per run and never a lone voter: losing more than the quorum
    tolerates loses data whatever the protocol does. Its own random stream, so the plans
    of the other seeds stay as they were. True when a loss is planned."""
    disk_rng = random.Random(seed * 104_729 + 17)
    if voters < 3:
        return False
    if disk_rng.random() < DISK_LOSS_PROBABILITY:
        victim = disk_rng.choice(sorted(cluster.voter_ids))
        at_ms = disk_rng.randint(100, fault_phase_ms)
        back_ms = at_ms + disk_rng.randint(20, 800)
        cluster.at(at_ms, lambda: (log(f"lose disk of {victim}"), cluster.lose_disk(victim)))
        cluster.at(back_ms, lambda: (log(f"restart {victim}"), cluster.restart(victim)))
        return True
    if disk_rng.random() < DISK_LOSS_AHEAD_PROBABILITY:
        at_ms = disk_rng.randint(100, fault_phase_ms * 2 // 3)
        plan = _AheadLoss(cluster, disk_rng, log, at_ms + fault_phase_ms // 3, fault_phase_ms)
        cluster.at(at_ms, plan.start)
        return True
    return False


class _AheadLoss:
    """A follower loses its disk while ahead of the high watermark. The other voters lag:
    all but one are down (crashed), and that one's links to the leader and the victim
    stall for ``lag_ms`` (less than a fetch timeout: nobody campaigns), so the high
    watermark waits. The victim loses its disk meanwhile and restarts empty (its
    quorum-state names the same leader) just before the laggard catches up; the Fetches it
    sent just before the loss are slow and arrive after those from its new log. From then
    on the leader must count it for its new log only, not for what it acknowledged before."""

    def __init__(self, cluster: Cluster, rng: random.Random, log: Callable[[str], None], give_up_ms: int,
                 until_ms: int) -> None:
        self.cluster, self.rng, self.log, self.give_up_ms, self.until_ms = cluster, rng, log, give_up_ms, until_ms
        self.lag_ms = rng.randint(LAG_MIN_MS, LAG_MAX_MS)
        self.lost_ms = rng.randint(self.lag_ms // 3, self.lag_ms * 2 // 3)
        self.back_ms = self.lag_ms - rng.randint(0, 5)
        # What the victim sends its leader just before the loss arrives after its restart.
        self.slow_from_ms = self.lost_ms - rng.randint(5, 30)
        self.slow_by_ms = self.back_ms - self.lost_ms + rng.randint(30, 120)
        self.down_ms = self.lag_ms + rng.randint(50, 300)

    def start(self) -> None:
        cluster, log = self.cluster, self.log
        leader = cluster.leader()
        followers = [] if leader is None else sorted(
            n.node_id for n in cluster.nodes.values()
            if n.node_id in cluster.voter_ids and n.core is not None and n.core.role == Role.FOLLOWER
            and n.core.leader_id == leader.node_id)
        if leader is None or len(followers) < 2:
            if cluster.now_ms < self.give_up_ms:
                cluster.at(cluster.now_ms + RETRY_MS, self.start)
            return
        victim, laggard = self.rng.sample(followers, 2)
        down = sorted(cluster.voter_ids - {leader.node_id, victim, laggard})
        ahead = {leader.node_id, victim}
        now = cluster.now_ms
        log(f"voters {down} down; stall {sorted(ahead)} | the rest for {self.lag_ms} ms; {victim} loses its disk")
        for node_id in down:
            cluster.crash(node_id)
        cluster.stall(ahead, set(cluster.nodes) - ahead)
        link = (victim, leader.node_id)
        cluster.at(now + self.slow_from_ms, lambda: cluster.slow_links.__setitem__(link, self.slow_by_ms))
        cluster.at(now + self.lost_ms, lambda: (cluster.slow_links.pop(link, None), self._lose_disk(victim)))
        cluster.at(now + self.back_ms, lambda: (log(f"restart {victim}"), cluster.restart(victim)))
        cluster.at(now + self.lag_ms, lambda: (log("heal"), cluster.heal()))
        cluster.at(now + self.down_ms, lambda: (log(f"restart {down}"), [cluster.restart(n) for n in down]))

    def _lose_disk(self, victim: int) -> None:
        if self.cluster.now_ms < self.until_ms:  # the liveness phase restarted everything: leave it be
            self.log(f"lose disk of {victim}")
            self.cluster.stats["disks_lost_ahead"] += 1
            self.cluster.lose_disk(victim)


def plan_figure_8(cluster: Cluster, seed: int, voters: int, fault_phase_ms: int, log: Callable[[str], None]) -> None:
    """Sometimes set up Raft's figure 8 once in the fault phase (``_Figure8``)."""
    rng = random.Random(seed * 32_452_843 + 41)
    if voters < 3 or rng.random() >= FIGURE_8_PROBABILITY:
        return
    plan = _Figure8(cluster, rng, log, fault_phase_ms)
    cluster.at(rng.randint(100, fault_phase_ms // 2), plan.start)


class _Figure8:
    """1. The leader and a minority are cut off; clients still write to that leader, so
       its tail of records of its epoch a is on a minority only.
    2. The others elect a leader X (epoch c > a), cut off the moment it is elected, then
       down: its LeaderChange record, where that tail begins, is on X only.
    3. The first cut heals; a leader B of an epoch above c that holds the tail is elected
       (X is down). Its followers fetch the tail a few batches per response (in the seeds
       with a small max_batch_bytes). B crashes once a follower durably holds a record of
       the tail at or past X's record but not yet B's own LeaderChange record.
    4. X comes back; the voters holding only the tail (last epoch a < c) vote for it.
    Each step waits at most FIGURE_8_STEP_MAX_MS; a step that finds no leader gives up."""

    def __init__(self, cluster: Cluster, rng: random.Random, log: Callable[[str], None], until_ms: int) -> None:
        self.cluster, self.rng, self.log, self.until_ms = cluster, rng, log, until_ms
        self.step = "idle"
        self.minority: set[int] = set()
        self.epoch = 0  # the epoch the next leader of the plan must exceed
        self.cut_off = -1  # X
        self.record_offset = -1  # where X's LeaderChange record is
        self.second: SimNode | None = None  # B
        self.give_up_ms = 0
        self.elected_hook: Callable[[SimNode], None] | None = None

    def start(self) -> None:
        cluster = self.cluster
        leader = cluster.leader()
        if cluster.now_ms >= self.until_ms:
            return
        if leader is None or leader.core is None:
            cluster.at(cluster.now_ms + RETRY_MS, self.start)
            return
        if leader.node_id not in cluster.voter_ids or len(cluster.voter_ids) < 3:
            return  # the voter set changed under the plan (tests/sim/membership.py)
        others = sorted(cluster.voter_ids - {leader.node_id})
        self.minority = {leader.node_id, *self.rng.sample(others, len(cluster.voter_ids) // 2 - 1)}
        self.epoch = leader.core.epoch
        self.log(f"figure 8: cut off leader {leader.node_id} with {sorted(self.minority - {leader.node_id})}")
        cluster.partition(self.minority, set(cluster.nodes) - self.minority)
        self.elected_hook, cluster.on_elected = cluster.on_elected, self.elected
        self._next("successor")

    def _next(self, step: str) -> None:
        self.step, self.give_up_ms = step, self.cluster.now_ms + FIGURE_8_STEP_MAX_MS
        self.cluster.at(self.give_up_ms, lambda: self._give_up(step))

    def _give_up(self, step: str) -> None:
        if self.step == step:
            self._end(f"figure 8: gave up at step {step}")

    def _end(self, why: str) -> None:
        self.step = "done"
        cluster = self.cluster
        if cluster.on_elected == self.elected:
            cluster.on_elected = self.elected_hook
        if cluster.now_ms < self.until_ms:  # the liveness phase heals and restarts by itself
            self.log(why)
            cluster.heal()
            if self.cut_off in cluster.nodes:
                cluster.restart(self.cut_off)

    def elected(self, node: SimNode) -> None:
        if self.elected_hook is not None:
            self.elected_hook(node)
        cluster, core = self.cluster, node.core
        if core is None or core.epoch <= self.epoch or cluster.now_ms >= self.until_ms:
            return
        if self.step == "successor" and node.node_id not in self.minority:
            # Cut off at once, then down once its LeaderChange record is flushed: no heal of
            # another fault can bring it back before step 4.
            self.cut_off, self.epoch = node.node_id, core.epoch
            self.log(f"figure 8: cut off new leader {node.node_id} at once, then crash it; heal the first cut")
            cluster.heal()
            cluster.partition({node.node_id}, set(cluster.nodes) - {node.node_id})
            # A flush may wait for one already running: two flush times cover it.
            cluster.at(cluster.now_ms + 2 * cluster.faults.flush_max_ms + 1, lambda: self._crash_cut_off(node, core.epoch))
            self._next("second")
        elif self.step == "second" and node.node_id != self.cut_off and self.record_offset >= 0:
            self.second = node
            self._next("lose")
            self._watch()

    def _crash_cut_off(self, node: SimNode, epoch: int) -> None:
        if self.cluster.now_ms >= self.until_ms:
            return  # the liveness phase restarted everything: leave it be
        self.cluster.crash(node.node_id)
        if node.log.last_epoch() == epoch:  # its LeaderChange record survived the crash
            self.record_offset = node.log.end_offset() - 1

    def _watch(self) -> None:
        """Step 3: crash B once, with B, a majority of voters durably holds the tail past X's
        record but not B's own record (the state of figure 8: on a majority, not committed),
        a network delay or so later (when their Fetches, which acknowledge it, reach B)."""
        cluster, second = self.cluster, self.second
        if self.step != "lose" or second is None or second.core is None or second.core.role != Role.LEADER:
            return
        epoch = second.core.epoch
        holders = sum(1 for n in cluster.nodes.values()
                      if n.node_id in cluster.voter_ids and n.node_id not in (second.node_id, self.cut_off)
                      and n.log.flushed_offset() > self.record_offset and n.log.last_epoch() < epoch)
        if holders + 1 < cluster.majority:
            cluster.at(cluster.now_ms + 1, self._watch)
            return
        self.step = "lost"
        cluster.at(cluster.now_ms + self.rng.randint(0, 2 * cluster.faults.delay_max_ms), self._lose_second)

    def _lose_second(self) -> None:
        cluster, second = self.cluster, self.second
        if second is None or cluster.now_ms >= self.until_ms:
            return
        self.log(f"figure 8: crash leader {second.node_id}; restart {self.cut_off}")
        cluster.stats["figure_8"] += 1
        cluster.crash(second.node_id)
        self._end("heal")
        # Down long enough for X to be elected: B's followers refuse pre-votes for a fetch timeout.
        cluster.at(cluster.now_ms + self.rng.randint(B_DOWN_MIN_MS, B_DOWN_MAX_MS),
                   lambda: (self.log(f"restart {second.node_id}"), cluster.restart(second.node_id)))
