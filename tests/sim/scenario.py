"""One simulated run: the seed picks the cluster shape, the network faults and the fault plan.

Phases:
1. Faults (``fault_phase_ms`` of simulated time): client proposals and linearizable reads
   against whoever leads, while the plan crashes, shuts down, restarts and partitions
   nodes. Invariants are checked after every event (tests/sim/cluster.py).
2. Liveness: heal the network, stop losing messages, restart every node. Within
   ``LIVENESS_BOUND_MS`` a leader must be elected and a new proposal committed, and within
   ``CATCH_UP_BOUND_MS`` more every replica must reach the leader's high watermark.
3. End: every replica holds the same committed records (checked against the oracle of
   everything ever committed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from raft.node import NotLeaderError, ProposalRejectedError, Role
from raft.types import ProtocolInvariantError, SnapshotId
from tests.sim.cluster import Cluster, InvariantViolation, NetworkFaults

LIVENESS_BOUND_MS = 3_000  # heal → leader elected and a new proposal committed (simulated; 30 election timeouts)
CATCH_UP_BOUND_MS = 3_000  # then every replica reaches the leader's high watermark
MAX_FAULT_ACTIONS = 12


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

    def replay_command(self) -> str:
        return replay_command(self.seed, self.voters)


def replay_command(seed: int, voters: int) -> str:
    return f"python -m tests.sim.run --seed {seed} --voters {voters}"


class SimulationFailure(AssertionError):
    """A broken invariant or a liveness miss, with the command that replays it."""


def voters_for_seed(seed: int) -> int:
    return (1, 3, 5)[seed % 3]


def run_seed(seed: int, voters: int | None = None, verbose: bool = False) -> RunResult:
    """Run one seed; raise SimulationFailure naming the replay command on any violation."""
    voters = voters_for_seed(seed) if voters is None else voters
    try:
        return _run(seed, voters, verbose)
    except (InvariantViolation, ProtocolInvariantError) as exc:  # the latter stops a real node
        raise SimulationFailure(f"seed {seed} voters {voters}: {exc}\n  replay: {replay_command(seed, voters)}") from exc


def _run(seed: int, voters: int, verbose: bool) -> RunResult:
    plan_rng = random.Random(seed * 7919 + voters)
    observers = plan_rng.choice((0, 0, 1, 2))
    lossy = plan_rng.random() < 0.7
    faults = NetworkFaults(
        drop_probability=plan_rng.choice((0.0, 0.01, 0.05, 0.15)) if lossy else 0.0,
        duplicate_probability=plan_rng.choice((0.0, 0.02, 0.1)) if lossy else 0.0,
        delay_min_ms=1,
        delay_max_ms=plan_rng.choice((2, 5, 20, 40)),
        flush_min_ms=1,
        flush_max_ms=plan_rng.choice((1, 5, 15)),
    )
    overrides = {
        "append_linger_ms": plan_rng.choice((0, 0, 2)),
        # Small batches make fetches return one batch at a time: more intermediate acks.
        "max_batch_bytes": plan_rng.choice((8 * 1024 * 1024, 256)),
    }
    plan: list[str] = []
    trace = print if verbose else None
    cluster = Cluster(seed, voters, observers, faults, overrides, trace=trace)
    all_ids = sorted(cluster.nodes)
    fault_phase_ms = plan_rng.randint(1_500, 3_000)
    state = _Load(cluster, plan_rng)

    def log(text: str) -> None:
        plan.append(f"t={cluster.now_ms} {text}")
        if verbose:
            print(f"{cluster.now_ms:>6} ** {text}")

    # Client load: proposals and reads at random intervals for the whole fault phase.
    time_ms = 0
    while time_ms < fault_phase_ms:
        time_ms += plan_rng.randint(2, 30)
        cluster.at(time_ms, state.propose if plan_rng.random() < 0.85 else state.read)

    # The fault plan.
    for _ in range(plan_rng.randint(2, MAX_FAULT_ACTIONS)):
        at_ms = plan_rng.randint(100, fault_phase_ms)
        kind = plan_rng.choice(("crash", "crash", "shutdown", "partition", "one_way", "isolate_leader",
                                "kill_all", "snapshot"))
        victim = plan_rng.choice(all_ids)
        back_ms = at_ms + plan_rng.randint(20, 800)
        if kind == "crash":
            cluster.at(at_ms, lambda v=victim: (log(f"crash {v}"), cluster.crash(v)))
            cluster.at(back_ms, lambda v=victim: (log(f"restart {v}"), cluster.restart(v)))
        elif kind == "shutdown":
            cluster.at(at_ms, lambda v=victim: (log(f"shutdown {v}"), cluster.shutdown(v)))
            cluster.at(back_ms, lambda v=victim: (log(f"restart {v}"), cluster.restart(v)))
        elif kind in ("partition", "one_way"):
            side = set(plan_rng.sample(all_ids, plan_rng.randint(1, max(1, len(all_ids) // 2))))
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
            majority = plan_rng.sample(sorted(cluster.voter_ids), cluster.majority)

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
        else:
            cluster.at(at_ms, lambda: _take_snapshot(cluster, log))

    # Hostile elections: a new leader is sometimes cut off or crashed at once, so it leaves
    # a LeaderChange record nobody else has (the setting of Raft's figure 8).
    hostile_probability = plan_rng.choice((0.0, 0.3, 0.6))

    def on_elected(node) -> None:  # type: ignore[no-untyped-def]
        if cluster.now_ms >= fault_phase_ms or plan_rng.random() >= hostile_probability:
            return
        victim, back_ms = node.node_id, cluster.now_ms + plan_rng.randint(20, 400)
        if plan_rng.random() < 0.5:
            cluster.at(cluster.now_ms, lambda: (log(f"crash new leader {victim}"), cluster.crash(victim)))
            cluster.at(back_ms, lambda: (log(f"restart {victim}"), cluster.restart(victim)))
        else:
            others = set(all_ids) - {victim}
            cluster.at(cluster.now_ms, lambda: (log(f"isolate new leader {victim}"),
                                                cluster.partition({victim}, others)))
            cluster.at(back_ms, lambda: (log("heal"), cluster.heal()))
    cluster.on_elected = on_elected

    cluster.run_for(fault_phase_ms)

    # Liveness: heal everything and demand progress within a bound.
    log("liveness: heal, restart all, lossless network")
    cluster.on_elected = None
    cluster.heal()
    cluster.faults.drop_probability = 0.0
    cluster.faults.duplicate_probability = 0.0
    for node_id in all_ids:
        cluster.restart(node_id)
    started_ms = cluster.now_ms
    committed = cluster.run_until(lambda: state.liveness_probe(), LIVENESS_BOUND_MS)
    liveness_ms = cluster.now_ms - started_ms
    if not committed:
        roles = {n.node_id: (n.core.role.value, n.core.epoch) for n in cluster.nodes.values() if n.core}
        raise InvariantViolation(f"liveness: no leader committed a new proposal within {LIVENESS_BOUND_MS} ms "
                                 f"of healing (roles {roles})")
    leader = cluster.leader()
    assert leader is not None and leader.core is not None
    target = leader.core.high_watermark
    caught_up = cluster.run_until(lambda: all(
        n.core is not None and n.core.high_watermark >= target for n in cluster.nodes.values()), CATCH_UP_BOUND_MS)
    if not caught_up:
        hws = {n.node_id: n.core.high_watermark for n in cluster.nodes.values() if n.core}
        raise InvariantViolation(f"catch-up: replicas did not reach high watermark {target} within "
                                 f"{CATCH_UP_BOUND_MS} ms (high watermarks {hws})")
    cluster.check_replicas_agree()
    _check_identical_committed_logs(cluster, target)
    if verbose:
        print(f"liveness ok after {cluster.now_ms - started_ms} ms; committed offsets {len(cluster.committed)}")
    return RunResult(seed, voters, observers, cluster.events_processed, cluster.now_ms, len(cluster.committed), plan,
                     dict(cluster.stats), liveness_ms)


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

    def read(self) -> None:
        cluster = self.cluster
        leader = self._some_leader()
        if leader is None or leader.core is None:
            return
        try:
            token = leader.core.read_index(cluster.now_ms)
        except (NotLeaderError, ProposalRejectedError):
            return
        self.read_floor[(leader.node_id, token)] = cluster.max_high_watermark
        cluster.reads_hook = self.check_read
        cluster._after_input(leader)

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


def _take_snapshot(cluster: Cluster, log) -> None:  # type: ignore[no-untyped-def]
    """Replace a fully committed, flushed log by a snapshot, as compaction will."""
    for node in cluster.nodes.values():
        core = node.core
        if core is None or core.role != Role.LEADER:
            continue
        end = node.log.end_offset()
        if core.high_watermark == end == node.log.flushed_offset() and end > node.log.start_offset():
            snapshot_id = SnapshotId(end, node.log.last_epoch())
            node.snapshots.put(snapshot_id, (b"snapshot-of-%d;" % end) * 20)
            node.log.reset_to_snapshot(snapshot_id)
            node.checked_offset = max(node.checked_offset, end)
            log(f"snapshot on leader {node.node_id} at {end}")


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
