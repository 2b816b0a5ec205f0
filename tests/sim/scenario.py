"""One simulated run: the seed picks the cluster shape, the network faults and the fault plan.

Phases:
1. Faults (``fault_phase_ms`` of simulated time): client proposals and linearizable reads
   against whoever leads, while the plan crashes, shuts down, restarts, partitions and
   pauses nodes, delays a few messages past an election timeout and takes snapshots (large
   and slowly transferred in half the seeds). Invariants are checked after every event
   (tests/sim/cluster.py, tests/sim/election_checks.py).
2. Liveness: stop losing messages, heal the network and restart every node; with 3 or 5
   voters the seed may then keep a minority of voters down for good (``LIVENESS_KINDS``).
   Within ``LIVENESS_BOUND_MS`` a leader must commit a new proposal, within
   ``CATCH_UP_BOUND_MS`` more every reachable replica must reach its high watermark, and for
   ``STABLE_WINDOW_MS`` of fault-free load the leader must keep leading with no epoch raised.
   A minority kept down then comes back and catches up.
3. With 3 or 5 voters: a follower cut off alone for a few election timeouts comes back
   without deposing the leader or raising the epoch (KIP-996), and a leader shut down
   gracefully has a successor committing within ``FAILOVER_BOUND_MS``. Then the seed's
   election scenario (tests/sim/election_scenarios.py), and everything heals and catches up.
4. End: every replica holds the same committed records (checked against the oracle of
   everything ever committed).

In the seeds that change the voter set (tests/sim/membership.py) phase 1 mixes voter
changes into the faults, phase 2 first lets the set settle (the later phases count the
final set's members as the voters), and the split change (tests/sim/split_change.py) may
run before the end.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from raft.node import NotLeaderError, ProposalRejectedError, Role
from raft.types import ProtocolInvariantError, SnapshotId
from tests.sim.cluster import Cluster, InvariantViolation, NetworkFaults, SimNode, sim_config
from tests.sim.commit_faults import plan_disk_loss, plan_figure_8
from tests.sim.election_checks import ElectionChecks
from tests.sim.election_scenarios import run_election_scenario
from tests.sim.membership import MembershipPlan, has_membership, spares_for
from tests.sim.membership_checks import MembershipChecks
from tests.sim.reads import plan_stale_leader_reads
from tests.sim.split_change import run_split_change

LIVENESS_BOUND_MS = 3_000  # heal → leader elected and a new proposal committed (simulated; 30 election timeouts)
CATCH_UP_BOUND_MS = 3_000  # then every replica reaches the leader's high watermark
STABLE_WINDOW_MS = 1_000  # fault-free: the leader keeps leading, no epoch rises
FAILOVER_BOUND_MS = LIVENESS_BOUND_MS  # a leader shut down gracefully -> a successor commits
MAX_FAULT_ACTIONS = 12
SNAPSHOT_WAIT_MS = 300  # a snapshot fault waits this long for a leader whose log is all committed
ELECTION_TIMEOUT_MS = sim_config(1, frozenset({1})).election_timeout_ms  # pauses, long delays count in these
FETCH_TIMEOUT_MS = sim_config(1, frozenset({1})).fetch_timeout_ms
# The liveness phase heals everything, or keeps a minority of voters down for good (and in
# "lagging_voter" one more follower must first download a snapshot to rejoin).
LIVENESS_KINDS = ("heal_all", "minority_down", "lagging_voter")


@dataclass
class RunResult:
    seed: int
    voters: int
    observers: int
    events: int
    simulated_ms: int
    committed_offsets: int
    plan: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    liveness_ms: int = 0  # heal → leader elected and a new proposal committed
    failover_ms: int = 0  # the leader shut down gracefully → a successor committed
    membership: bool | None = None  # as run_seed was told (None: the seed's own draw)

    def replay_command(self) -> str:
        return replay_command(self.seed, self.voters, self.membership)


def replay_command(seed: int, voters: int, membership: bool | None = None) -> str:
    """The command that replays a seed; it names the voter changes only when the run was told
    otherwise than the seed draws (tests/sim/test_sim.py turns some off)."""
    flag = "" if membership is None or membership == has_membership(seed) else f" --membership {'on' if membership else 'off'}"
    return f"python -m tests.sim.run --seed {seed} --voters {voters}{flag}"


class SimulationFailure(AssertionError):
    """A broken invariant or a liveness miss, with the command that replays it."""


def voters_for_seed(seed: int) -> int:
    return (1, 3, 5)[seed % 3]


def run_seed(seed: int, voters: int | None = None, verbose: bool = False, membership: bool | None = None) -> RunResult:
    """Run one seed; raise SimulationFailure naming the replay command on any violation.
    ``membership``: change the voter set or not (default: as the seed draws)."""
    voters = voters_for_seed(seed) if voters is None else voters
    try:
        return _run(seed, voters, verbose, membership)
    except (InvariantViolation, ProtocolInvariantError) as exc:  # the latter stops a real node
        replay = replay_command(seed, voters, membership)
        raise SimulationFailure(f"seed {seed} voters {voters}: {exc}\n  replay: {replay}") from exc


def _run(seed: int, voters: int, verbose: bool, membership: bool | None) -> RunResult:
    scenario = _Scenario(seed, voters, verbose, has_membership(seed) if membership is None else membership)
    scenario.fault_phase()
    scenario.liveness_phase()
    cluster = scenario.cluster
    return RunResult(seed, voters, scenario.observers, cluster.events_processed, cluster.now_ms,
                     len(cluster.committed), scenario.plan, dict(cluster.stats), scenario.liveness_ms,
                     scenario.failover_ms, membership)


class _Scenario:
    """One seed's run: the shape it picks, the fault phase and the liveness phase."""

    def __init__(self, seed: int, voters: int, verbose: bool, membership: bool) -> None:
        rng = self.rng = random.Random(seed * 7919 + voters)
        self.seed, self.voters = seed, voters
        self.verbose = verbose
        self.observers = rng.choice((0, 0, 1, 2))
        lossy = rng.random() < 0.7
        faults = NetworkFaults(
            drop_probability=rng.choice((0.0, 0.01, 0.05, 0.15)) if lossy else 0.0,
            duplicate_probability=rng.choice((0.0, 0.02, 0.1)) if lossy else 0.0,
            delay_min_ms=1,
            delay_max_ms=rng.choice((2, 5, 20, 40)),
            flush_min_ms=1,
            flush_max_ms=rng.choice((1, 5, 15)),
        )
        faults.replay_stale_fetches = lossy  # no draw from rng: the seed's other draws stay
        overrides = {
            "append_linger_ms": rng.choice((0, 0, 2)),
            # Small batches make fetches return one batch at a time: more intermediate acks.
            "max_batch_bytes": rng.choice((8 * 1024 * 1024, 256)),
        }
        # Messages delayed past an election timeout: an old Fetch arrives after a new commit.
        faults.long_delay_probability = rng.choice((0.0, 0.002, 0.01, 0.03))
        faults.long_delay_min_ms = ELECTION_TIMEOUT_MS
        faults.long_delay_max_ms = 3 * ELECTION_TIMEOUT_MS
        # Large snapshots moved slowly, chunk by chunk: a download may outlast the leader's
        # check-quorum period (1.5 x fetch_timeout_ms), up to ~1.2 simulated s on average.
        self.snapshot_bytes = 0  # 0: the small default snapshot
        if rng.random() < 0.5:
            self.snapshot_bytes = rng.randint(10_000, 200_000)
            faults.snapshot_chunk_delay_ms = rng.randint(2, 20)
            download_ms = rng.randint(100, 1_200)
            round_trip_ms = faults.snapshot_chunk_delay_ms + faults.delay_max_ms + 1
            chunks = max(4, download_ms // round_trip_ms)
            overrides["snapshot_chunk_bytes"] = max(64, self.snapshot_bytes // chunks)
        self.liveness_kind = rng.choice(LIVENESS_KINDS) if voters >= 3 else "heal_all"
        self.plan: list[str] = []
        # Seeds that change the voter set hold spare replicas that may be added.
        self.membership = membership
        if self.membership:
            self.observers += spares_for(seed)
        self.cluster = Cluster(seed, voters, self.observers, faults, overrides, trace=print if verbose else None,
                               directory_ids=self.membership)
        ElectionChecks(self.cluster)
        if self.membership:
            MembershipChecks(self.cluster)
        self.membership_plan: MembershipPlan | None = None
        self.all_ids = sorted(self.cluster.nodes)
        self.fault_phase_ms = rng.randint(1_500, 3_000)
        self.load = _Load(self.cluster, rng)
        self.liveness_ms = 0
        self.failover_ms = 0  # a graceful shutdown of the leader -> a successor committed

    def log(self, text: str) -> None:
        self.plan.append(f"t={self.cluster.now_ms} {text}")
        if self.verbose:
            print(f"{self.cluster.now_ms:>6} ** {text}")

    def schedule_load(self, from_ms: int, until_ms: int) -> None:
        """Client proposals and reads at random intervals."""
        time_ms = from_ms
        while time_ms < until_ms:
            time_ms += self.rng.randint(2, 30)
            self.cluster.at(time_ms, self.load.propose if self.rng.random() < 0.85 else self.load.read)

    # ------------------------------------------------------------------ phase 1: faults

    def fault_phase(self) -> None:
        self.schedule_load(0, self.fault_phase_ms)
        for _ in range(self.rng.randint(2, MAX_FAULT_ACTIONS)):
            self._schedule_fault()
        disk_loss = plan_disk_loss(self.cluster, self.seed, self.voters, self.fault_phase_ms, self.log)
        if disk_loss:
            # A lost voter votes for nobody until it caught up: with another voter down for
            # good, no majority could elect a leader, so every node comes back.
            self.liveness_kind = "heal_all"
        plan_stale_leader_reads(self.cluster, self.seed, self.voters, self.fault_phase_ms, self.log, self.load.read)
        self._hostile_elections()
        if self.membership:
            self.membership_plan = MembershipPlan(self.cluster, self.seed, self.log, self.fault_phase_ms, disk_loss)
            self.membership_plan.schedule()
            if self.membership_plan.loses_added_disk:
                self.liveness_kind = "heal_all"  # as for any lost disk (above)
        plan_figure_8(self.cluster, self.seed, self.voters, self.fault_phase_ms, self.log)
        self.cluster.run_for(self.fault_phase_ms)

    def _schedule_fault(self) -> None:
        cluster, rng, log, all_ids = self.cluster, self.rng, self.log, self.all_ids
        at_ms = rng.randint(100, self.fault_phase_ms)
        kind = rng.choice(("crash", "crash", "shutdown", "partition", "one_way", "isolate_leader",
                           "kill_all", "snapshot", "pause", "pause_leader"))
        victim = rng.choice(all_ids)
        back_ms = at_ms + rng.randint(20, 800)
        if kind == "crash":
            cluster.at(at_ms, lambda v=victim: (log(f"crash {v}"), cluster.crash(v)))
            cluster.at(back_ms, lambda v=victim: (log(f"restart {v}"), cluster.restart(v)))
        elif kind == "shutdown":
            cluster.at(at_ms, lambda v=victim: (log(f"shutdown {v}"), cluster.shutdown(v)))
            cluster.at(back_ms, lambda v=victim: (log(f"restart {v}"), cluster.restart(v)))
        elif kind in ("partition", "one_way"):
            side = set(rng.sample(all_ids, rng.randint(1, max(1, len(all_ids) // 2))))
            rest = set(all_ids) - side
            one_way = kind == "one_way"
            cluster.at(at_ms, lambda s=side, r=rest, o=one_way: (
                log(f"partition {sorted(s)} {'->' if o else '|'} {sorted(r)}"), cluster.partition(s, r, o)))
            cluster.at(back_ms, lambda: (log("heal"), cluster.heal()))
        elif kind == "isolate_leader":
            def isolate() -> None:
                leader = cluster.leader()
                if leader is not None:
                    log(f"isolate leader {leader.node_id}")
                    cluster.partition({leader.node_id}, set(all_ids) - {leader.node_id})
            cluster.at(at_ms, isolate)
            cluster.at(back_ms, lambda: (log("heal"), cluster.heal()))
        elif kind == "kill_all":
            majority = rng.sample(sorted(cluster.voter_ids), cluster.majority)

            def kill_all() -> None:
                log("kill all")
                for node_id in all_ids:
                    cluster.crash(node_id)

            def restart_majority(m: list[int] = majority) -> None:
                log(f"restart majority {sorted(m)}")
                for node_id in m:
                    cluster.restart(node_id)
            cluster.at(at_ms, kill_all)
            cluster.at(at_ms + 10, restart_majority)
            cluster.at(back_ms + 200, lambda: (log("restart all"), [cluster.restart(n) for n in all_ids]))
        elif kind in ("pause", "pause_leader"):
            # A process pause of 0.5-3 election timeouts; it resumes with its stale state.
            pause_ms = rng.randint(ELECTION_TIMEOUT_MS // 2, 3 * ELECTION_TIMEOUT_MS)

            def pause(v: int = victim, leader_only: bool = kind == "pause_leader", ms: int = pause_ms) -> None:
                leader = cluster.leader()
                target = leader.node_id if leader_only and leader is not None else v
                log(f"pause {target} for {ms} ms")
                cluster.pause(target, ms)
            cluster.at(at_ms, pause)
        else:
            cluster.at(at_ms, lambda: self._snapshot_soon(cluster.now_ms + SNAPSHOT_WAIT_MS))

    def _snapshot_soon(self, give_up_ms: int) -> None:
        """Under load a leader's log is seldom all committed and flushed: retry a while."""
        if not _take_snapshot(self.cluster, self.log, self.snapshot_bytes) and self.cluster.now_ms < give_up_ms:
            self.cluster.at(self.cluster.now_ms + 5, lambda: self._snapshot_soon(give_up_ms))

    def _hostile_elections(self) -> None:
        """A new leader is sometimes cut off or crashed at once, so it leaves a LeaderChange
        record nobody else has (the setting of Raft's figure 8)."""
        cluster, rng, log = self.cluster, self.rng, self.log
        hostile_probability = rng.choice((0.0, 0.3, 0.6))

        def on_elected(node: SimNode) -> None:
            if cluster.now_ms >= self.fault_phase_ms or rng.random() >= hostile_probability:
                return
            victim, back_ms = node.node_id, cluster.now_ms + rng.randint(20, 400)
            if rng.random() < 0.5:
                cluster.at(cluster.now_ms, lambda: (log(f"crash new leader {victim}"), cluster.crash(victim)))
                cluster.at(back_ms, lambda: (log(f"restart {victim}"), cluster.restart(victim)))
            else:
                others = set(self.all_ids) - {victim}
                cluster.at(cluster.now_ms, lambda: (log(f"isolate new leader {victim}"),
                                                    cluster.partition({victim}, others)))
                cluster.at(back_ms, lambda: (log("heal"), cluster.heal()))
        cluster.on_elected = on_elected

    # ------------------------------------------------------------------ phase 2: liveness

    def liveness_phase(self) -> None:
        """Heal everything, or keep a minority of voters down for good (then let it back):
        the side with a majority must commit, its replicas catch up, and a fault-free window
        must keep its leader; at the end all replicas hold the same committed records."""
        cluster = self.cluster
        cluster.on_elected = None
        cluster.cancel_scheduled_actions()  # the fault phase's late heals and restarts
        self._heal_everything()
        if self.membership_plan is not None:
            self._settle_voters(self.membership_plan)
        cluster.stats[f"liveness_{self.liveness_kind}"] += 1
        if self.liveness_kind == "heal_all":
            self._await_commit("healing everything")
            target = self._await_catch_up(set(self.all_ids))
            self._stable_window()
        else:
            if self.liveness_kind == "lagging_voter":
                self._await_commit("healing everything")
            down, behind = self._minority_down()
            what = f"voters {sorted(down & cluster.voter_ids)} down for good"
            if behind is not None:
                what += f", voter {behind} behind a snapshot"
            self._await_commit(what)
            self._await_catch_up(set(self.all_ids) - down)
            self._stable_window()
            self.log(f"minority {sorted(down)} back")
            self._heal_everything()
            target = self._await_catch_up(set(self.all_ids))
        if len(cluster.voter_ids) >= 3:
            self._rejoin_window()
            self._graceful_failover()
            name = run_election_scenario(cluster, self.seed, self.log)
            self._heal_everything()
            self._await_commit(f"healing everything after election scenario {name}")
            target = self._await_catch_up(set(self.all_ids))
        plan = self.membership_plan
        if plan is not None and run_split_change(cluster, plan, plan.rng, self.log):
            self._heal_everything()
            self._await_commit("healing everything after the split change")
            target = self._await_catch_up(set(self.all_ids))
        cluster.check_replicas_agree()
        _check_identical_committed_logs(cluster, target)
        if self.verbose:
            print(f"liveness ok; slowest {self.liveness_ms} ms; committed offsets {len(cluster.committed)}")

    def _settle_voters(self, plan: MembershipPlan) -> None:
        """The pending change commits and replacements complete; from now on the final set's
        members are the voters (a smaller set than three keeps every node up)."""
        final = plan.settle(self._await_commit)
        cluster = self.cluster
        cluster.voter_ids = frozenset(final.ids)
        cluster.majority = final.majority
        if len(final.ids) < 3:
            self.liveness_kind = "heal_all"

    def _heal_everything(self) -> None:
        self.log("heal, restart all, lossless network")
        cluster = self.cluster
        cluster.heal()
        faults = cluster.faults
        faults.drop_probability = faults.duplicate_probability = faults.long_delay_probability = 0.0
        for node_id in self.all_ids:
            cluster.resume(node_id)
            cluster.restart(node_id)

    def _minority_down(self) -> tuple[set[int], int | None]:
        """Cut off or crash a minority of voters (and maybe observers) for good. For
        ``lagging_voter``, first crash another follower while the leader commits and takes a
        snapshot, then restart it: it must download the snapshot with the minority gone."""
        cluster, rng = self.cluster, self.rng
        leader = cluster.leader()
        voters = sorted(cluster.voter_ids)
        behind = None
        if self.liveness_kind == "lagging_voter" and leader is not None:
            behind = rng.choice([v for v in voters if v != leader.node_id])
            self.log(f"crash {behind}; the leader commits and takes a snapshot")
            cluster.crash(behind)
            self.load.propose()
            if not cluster.run_until(lambda: _snapshot_ready(leader), LIVENESS_BOUND_MS):
                raise InvariantViolation(f"liveness (voter {behind} down): leader {leader.node_id} did not commit "
                                         f"its log within {LIVENESS_BOUND_MS} ms (roles {_roles(cluster)})")
            _take_snapshot(cluster, self.log, self.snapshot_bytes)
        # minority_down may cut off the leader itself; lagging_voter keeps it and the laggard.
        keep = {behind, leader.node_id} if behind is not None and leader is not None else set()
        candidates = [v for v in voters if v not in keep]
        down = set(rng.sample(candidates, rng.randint(1, (len(voters) - 1) // 2)))
        down |= {n for n in self.all_ids if n not in cluster.voter_ids and rng.random() < 0.3}
        if rng.random() < 0.5:
            self.log(f"crash {sorted(down)} for good")
            for node_id in sorted(down):
                cluster.crash(node_id)
        else:
            self.log(f"partition {sorted(down)} | the rest, for good")
            cluster.partition(down, set(self.all_ids) - down)
        if behind is not None:
            self.log(f"restart {behind}")
            cluster.restart(behind)
        return down, behind

    def _await_commit(self, what: str) -> None:
        """Within LIVENESS_BOUND_MS a leader commits a new proposal."""
        cluster = self.cluster
        started_ms, resigned_before = cluster.now_ms, cluster.stats["became_resigned"]
        self.load.liveness_proposal = None
        committed = cluster.run_until(self.load.liveness_probe, LIVENESS_BOUND_MS)
        self.liveness_ms = max(self.liveness_ms, cluster.now_ms - started_ms)
        if not committed:
            raise InvariantViolation(f"liveness ({what}): no leader committed a new proposal within "
                                     f"{LIVENESS_BOUND_MS} ms (roles {_roles(cluster)}; "
                                     f"{cluster.stats['became_resigned'] - resigned_before} resignations)")

    def _await_catch_up(self, node_ids: set[int]) -> int:
        """Within CATCH_UP_BOUND_MS these replicas reach the leader's high watermark (returned)."""
        cluster = self.cluster
        leader = cluster.leader()
        assert leader is not None and leader.core is not None
        target = leader.core.high_watermark
        caught_up = cluster.run_until(lambda: all(
            cluster.nodes[n].core is not None and cluster.nodes[n].core.high_watermark >= target  # type: ignore[union-attr]
            for n in node_ids), CATCH_UP_BOUND_MS)
        if not caught_up:
            hws = {n.node_id: n.core.high_watermark for n in cluster.nodes.values() if n.core}
            raise InvariantViolation(f"catch-up: replicas {sorted(node_ids)} did not reach high watermark "
                                     f"{target} within {CATCH_UP_BOUND_MS} ms (high watermarks {hws})")
        return target

    def _stable_window(self) -> None:
        """No fault for STABLE_WINDOW_MS under client load: the leader must keep leading and
        no node may raise its epoch (a healthy leader is never deposed)."""
        cluster = self.cluster
        leader = cluster.leader()
        assert leader is not None
        self.log(f"fault-free window: leader {leader.node_id} must stay")
        cluster.expect_stable_leader(leader.node_id)
        self.schedule_load(cluster.now_ms, cluster.now_ms + STABLE_WINDOW_MS)
        cluster.run_for(STABLE_WINDOW_MS)
        cluster.end_stable_window()

    def _rejoin_window(self) -> None:
        """KIP-996's promise: a follower cut off alone for a few election timeouts comes back
        without deposing the healthy leader or raising the epoch. It is healed just as it
        starts a pre-vote round, so its pre-votes reach voters that fetched recently and a
        leader: both must refuse. The cluster is idle while it is cut off (else its log falls
        behind and the pre-votes are refused for that alone), under load once they are answered."""
        cluster, rng = self.cluster, self.rng
        cluster.run_for(100)  # let the last proposals commit: every log ends alike
        leader = cluster.leader()
        if leader is None:
            return
        follower = rng.choice(sorted(cluster.voter_ids - {leader.node_id}))
        self.log(f"cut off follower {follower} alone; leader {leader.node_id} must stay")
        cluster.expect_stable_leader(leader.node_id)
        cluster.partition({follower}, set(self.all_ids) - {follower})
        cluster.run_for(rng.randint(FETCH_TIMEOUT_MS + ELECTION_TIMEOUT_MS, 3 * FETCH_TIMEOUT_MS))
        core = cluster.nodes[follower].core
        cluster.run_until(lambda: core is not None and core.role == Role.PROSPECTIVE, 4 * FETCH_TIMEOUT_MS)
        self.log(f"heal: follower {follower} back")
        cluster.heal()
        self.schedule_load(cluster.now_ms + ELECTION_TIMEOUT_MS, cluster.now_ms + STABLE_WINDOW_MS)
        cluster.run_for(STABLE_WINDOW_MS)
        cluster.end_stable_window()
    def _graceful_failover(self) -> None:
        """The leader shuts down gracefully (rule 8's EndQuorumEpoch names its successors):
        a successor must lead and commit within FAILOVER_BOUND_MS. Then the old leader comes
        back and catches up."""
        cluster = self.cluster
        leader = cluster.leader()
        if leader is None:
            return
        self.log(f"shutdown leader {leader.node_id}: a successor must commit within {FAILOVER_BOUND_MS} ms")
        cluster.shutdown(leader.node_id)
        started_ms = cluster.now_ms
        self.load.liveness_proposal = None
        committed = cluster.run_until(self.load.liveness_probe, FAILOVER_BOUND_MS)
        self.failover_ms = cluster.now_ms - started_ms
        if not committed:
            raise InvariantViolation(f"failover: no successor of gracefully stopped leader {leader.node_id} committed "
                                     f"within {FAILOVER_BOUND_MS} ms (roles {_roles(cluster)})")
        cluster.restart(leader.node_id)
        self._await_catch_up(set(self.all_ids))


class _Load:
    """The client: proposals to whoever leads, linearizable reads checked against commits."""

    def __init__(self, cluster: Cluster, rng: random.Random) -> None:
        self.cluster = cluster
        self.rng = rng
        self.counter = 0
        self.read_floor: dict[tuple[int, int], int] = {}  # (node, token) -> committed when asked
        self.liveness_proposal = None

    def propose(self) -> None:
        self.counter += 1
        count = self.rng.randint(1, 5)
        self.cluster.propose(tuple(f"r{self.counter}.{i}".encode() for i in range(count)), self._some_leader())

    def _some_leader(self):  # type: ignore[no-untyped-def]
        """Any node that believes it leads: clients do reach deposed leaders."""
        leaders = self.cluster.leaders()
        return self.rng.choice(leaders) if leaders else None

    def read(self, leader: SimNode | None = None) -> None:
        """A linearizable read at ``leader`` (default: any node that believes it leads)."""
        cluster = self.cluster
        leader = leader or self._some_leader()
        if leader is None or leader.core is None or leader.paused:
            return
        try:
            token = leader.core.read_index(cluster.now_ms)
        except (NotLeaderError, ProposalRejectedError):
            return
        self.read_floor[(leader.node_id, token)] = cluster.max_high_watermark
        cluster.reads_hook = self.check_read
        cluster.after_input(leader)

    def check_read(self, node_id: int, token: int, offset: int) -> None:
        floor = self.read_floor.pop((node_id, token), None)
        if floor is not None and offset < floor:
            raise InvariantViolation(f"t={self.cluster.now_ms} stale read on node {node_id}: read index {offset} "
                                     f"below {floor}, committed before the read began")

    def liveness_probe(self) -> bool:
        cluster = self.cluster
        leader = cluster.leader()
        if leader is None or leader.core is None or leader.core.role != Role.LEADER:
            return False
        if self.liveness_proposal is None or self.liveness_proposal.epoch != leader.core.epoch:
            self.liveness_proposal = cluster.propose((b"liveness",))
            return False
        return cluster.is_committed(self.liveness_proposal)


def _roles(cluster: Cluster) -> dict[int, tuple[str, int]]:
    """Each live node's role and epoch, for failure messages."""
    return {n.node_id: (n.core.role.value, n.core.epoch) for n in cluster.nodes.values() if n.core}


def _snapshot_ready(node: SimNode) -> bool:
    """The node leads and its whole log is committed and flushed: it may take a snapshot."""
    core, log = node.core, node.log
    return (core is not None and core.role == Role.LEADER
            and core.high_watermark == log.end_offset() == log.flushed_offset() > log.start_offset())


def _take_snapshot(cluster: Cluster, log, snapshot_bytes: int = 0) -> bool:  # type: ignore[no-untyped-def]
    """Replace a fully committed, flushed log by a snapshot, as compaction will; the state is
    padded to ``snapshot_bytes`` (0: a few hundred bytes). False: no leader was ready."""
    taken = False
    for node in cluster.nodes.values():
        if not _snapshot_ready(node) or node.paused:
            continue
        end = node.log.end_offset()
        snapshot_id = SnapshotId(end, node.log.last_epoch())
        state = (b"snapshot-of-%d;" % end) * 20
        node.snapshots.put(snapshot_id, state.ljust(snapshot_bytes, b"."))
        node.log.reset_to_snapshot(snapshot_id)
        node.checked_offset = max(node.checked_offset, end)
        log(f"snapshot on leader {node.node_id} at {end} ({max(len(state), snapshot_bytes)} bytes)")
        taken = True
    return taken


def _check_identical_committed_logs(cluster: Cluster, target: int) -> None:
    """All replicas hold identical records below ``target`` (where they still hold a log)."""
    expected = cluster.committed
    for node in cluster.nodes.values():
        start = node.log.start_offset()
        for batch in node.log.read(start, 1 << 30):
            for index, record in enumerate(batch.records):
                at = batch.base_offset + index
                if at < start or at >= target:
                    continue
                if expected.get(at) != (batch.epoch, batch.control, record):
                    raise InvariantViolation(f"end: node {node.node_id} differs from the committed record at {at}")
