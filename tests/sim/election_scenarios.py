"""Election scenarios of the raft simulator: faults timed against an election, one per seed.

The liveness phase (tests/sim/scenario.py) runs one of these on a settled cluster of 3 or 5
voters, drawn from the seed's own stream (the other phases draw as before), then heals and
restarts everything. Each sets up the moment an election rule exists for and states the
promise it keeps; tests/sim/election_checks.py's invariants watch every event meanwhile.

- ``handover``: a voter fewer than a majority can spare is down and the leader shuts down
  gracefully: the resigned leader grants its successor a pre-vote and a vote while it
  drains, so a successor is elected (rules 3, 8, 11).
- ``shutdown_in_pre_vote``: the leader crashes; the first voter to start a pre-vote round
  begins a graceful shutdown right then and drains for a while: its round must never turn
  into a candidacy (rule 11, checked by election_checks).
- ``restart_in_pre_vote``: a follower cut off from the leader alone starts a pre-vote round;
  right then a majority of followers restart (so they grant it) and the leader commits new
  records with them. A restarted voter that holds those records refuses the real vote:
  otherwise a leader lacking committed records is elected (rule 5; leader completeness).
- ``stale_tail``: the leader, cut off, appends records nobody else has; the others elect a
  new leader, and a majority-less-one of them pause at once, before fetching its first
  record. The old leader follows the new one but gets no answers (a one-way cut), times
  out and pre-votes with its longer log of an older epoch; the paused voters resume, grant
  it, and then commit the new leader's record. The old leader's real vote requests must
  carry its true log, and those voters must refuse them (rules 4, 5; leader completeness).
- ``observer_tail`` (seeds with observers): the leader, cut off from the other voters,
  appends one record only the observers get; the others elect a new leader, whose vote
  request deposes the old one, so the observers learn the new epoch but not its leader and
  probe; only the new leader is reachable. Its answer to a probe makes an observer follow it
  and fetch again at the same offset; the answer to that Fetch, a divergence about the log
  before the truncation, must not cut the log grown back to that offset (rule 7).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from raft.node import Role
from tests.sim.cluster import Cluster, InvariantViolation, SimNode, sim_config

_CONFIG = sim_config(1, frozenset({1}))
ELECTION_TIMEOUT_MS = _CONFIG.election_timeout_ms
FETCH_TIMEOUT_MS = _CONFIG.fetch_timeout_ms
# A leader shutting down waits for a successor while it drains (app/runtime.py, bounded by
# shutdown_grace_ms); scenario.py's failover bound, so that split votes never fail a seed.
HANDOVER_BOUND_MS = 3_000
SETTLE_MS = 1_000  # a leader's followers reach its log end, the log flushed everywhere
SCENARIO_SEED_SALT = 48_271  # the scenario's own random stream: other draws stay as they were


def run_election_scenario(cluster: Cluster, seed: int, log: Callable[[str], None]) -> str:
    """Run the seed's election scenario on a settled cluster; returns its name."""
    rng = random.Random(seed * SCENARIO_SEED_SALT + len(cluster.voter_ids))
    has_observers = len(cluster.nodes) > len(cluster.voter_ids)
    name = rng.choice([name for name in sorted(SCENARIOS) if has_observers or name != "observer_tail"])
    leader = _settled_leader(cluster)
    cluster.stats[f"election_scenario_{name}"] += 1
    SCENARIOS[name](cluster, rng, log, leader)
    return name


def _settled_leader(cluster: Cluster) -> SimNode:
    """The leader, once every live voter holds its whole log durably (no load runs now)."""
    def settled() -> bool:
        leader = cluster.leader()
        if leader is None:
            return False
        end = leader.log.end_offset()
        return all(node.log.flushed_offset() == end for node in _live_voters(cluster))
    if not cluster.run_until(settled, SETTLE_MS):
        raise InvariantViolation(f"t={cluster.now_ms} election scenario: the cluster did not settle "
                                 f"within {SETTLE_MS} ms")
    leader = cluster.leader()
    assert leader is not None
    return leader


def _live_voters(cluster: Cluster) -> list[SimNode]:
    return [cluster.nodes[v] for v in sorted(cluster.voter_ids) if cluster.nodes[v].core is not None]


def _role(node: SimNode) -> Role | None:
    return node.core.role if node.core is not None else None


def _propose(cluster: Cluster, node: SimNode, count: int, tag: str) -> None:
    for index in range(count):
        cluster.propose((f"{tag}.{index}".encode(),), node)


# ---------------------------------------------------------------------- the scenarios


def handover(cluster: Cluster, rng: random.Random, log: Callable[[str], None], leader: SimNode) -> None:
    """Rules 3, 8, 11: a leader shutting down gracefully with every spare voter down still
    hands over, since it grants its successor a pre-vote and a vote while it drains."""
    followers = sorted(cluster.voter_ids - {leader.node_id})
    down = rng.sample(followers, (len(cluster.voter_ids) - 1) // 2)
    log(f"crash {down}; leader {leader.node_id} shuts down gracefully: a successor within "
        f"{HANDOVER_BOUND_MS} ms")
    for node_id in down:
        cluster.crash(node_id)
    cluster.begin_shutdown(leader.node_id)

    def successor_known() -> bool:
        core = leader.core
        return core is not None and core.leader_id not in (-1, leader.node_id)
    if not cluster.run_until(successor_known, HANDOVER_BOUND_MS):
        raise InvariantViolation(f"t={cluster.now_ms} handover: leader {leader.node_id} began a graceful shutdown "
                                 f"with voters {down} down, and no successor was elected within "
                                 f"{HANDOVER_BOUND_MS} ms")
    cluster.stats["handovers"] += 1
    cluster.shutdown(leader.node_id)


def shutdown_in_pre_vote(cluster: Cluster, rng: random.Random, log: Callable[[str], None],
                         leader: SimNode) -> None:
    """Rule 11: a node whose shutdown begins during its pre-vote round never stands; the
    grants of that round arrive while it drains."""
    log(f"crash leader {leader.node_id}; the first voter to pre-vote shuts down gracefully")
    cluster.crash(leader.node_id)
    others = [cluster.nodes[v] for v in sorted(cluster.voter_ids - {leader.node_id})]
    if not cluster.run_until(lambda: any(_role(n) == Role.PROSPECTIVE for n in others), 4 * FETCH_TIMEOUT_MS):
        return
    stopping = next(n for n in others if _role(n) == Role.PROSPECTIVE)
    drain_ms = rng.randint(ELECTION_TIMEOUT_MS, 3 * ELECTION_TIMEOUT_MS)
    log(f"shutdown of {stopping.node_id} begins in its pre-vote round; it drains {drain_ms} ms")
    cluster.begin_shutdown(stopping.node_id)
    cluster.stats["shutdowns_in_pre_vote"] += 1
    cluster.run_for(drain_ms)
    cluster.shutdown(stopping.node_id)


def restart_in_pre_vote(cluster: Cluster, rng: random.Random, log: Callable[[str], None],
                        leader: SimNode) -> None:
    """Rule 5: voters that granted a pre-vote, then committed newer records with the leader,
    refuse the real vote."""
    follower = cluster.nodes[rng.choice(sorted(cluster.voter_ids - {leader.node_id}))]
    log(f"cut follower {follower.node_id} from leader {leader.node_id} only")
    cluster.partition({follower.node_id}, {leader.node_id})
    if not cluster.run_until(lambda: _role(follower) == Role.PROSPECTIVE, 4 * FETCH_TIMEOUT_MS):
        return
    restarted = rng.sample(sorted(cluster.voter_ids - {leader.node_id, follower.node_id}), cluster.majority - 1)
    log(f"{follower.node_id} pre-votes: restart {restarted}, the leader commits new records")
    for node_id in restarted:
        cluster.crash(node_id)
        cluster.restart(node_id)
    cluster.stats["restarts_in_pre_vote"] += 1
    _propose(cluster, leader, rng.randint(1, 3), f"restart-in-pre-vote-{cluster.now_ms}")
    cluster.run_for(3 * ELECTION_TIMEOUT_MS)


def stale_tail(cluster: Cluster, rng: random.Random, log: Callable[[str], None], leader: SimNode) -> None:
    """Rules 4 and 5: a deposed leader with a longer log of an older epoch cannot win
    against voters that hold the new leader's committed first record."""
    old = leader
    everyone = set(cluster.nodes)
    log(f"isolate leader {old.node_id}; it appends records nobody else gets")
    cluster.partition({old.node_id}, everyone - {old.node_id})
    _propose(cluster, old, rng.randint(2, 6), f"stale-tail-{cluster.now_ms}")
    old_epoch = old.core.epoch if old.core is not None else 0

    def new_leader() -> SimNode | None:
        return next((n for n in _live_voters(cluster) if n is not old and _role(n) == Role.LEADER
                     and n.core is not None and n.core.epoch > old_epoch), None)
    if not cluster.run_until(lambda: new_leader() is not None, 6 * FETCH_TIMEOUT_MS):
        return
    new = new_leader()
    assert new is not None and new.core is not None
    epoch = new.core.epoch
    # A majority with the old leader, none holding the new leader's first record; the rest
    # and the old leader's (diverging) Fetches keep the new leader's check-quorum.
    others = rng.sample(sorted(cluster.voter_ids - {old.node_id, new.node_id}), len(cluster.voter_ids) - 2)
    paused = others[:cluster.majority - 1]
    log(f"{new.node_id} leads epoch {epoch}; {paused} pause at once; heal {old.node_id}")
    for node_id in paused:
        cluster.pause(node_id, 10 * FETCH_TIMEOUT_MS)  # resumed below
    cluster.heal()
    def following() -> bool:
        return old.core is not None and old.core.role == Role.FOLLOWER and old.core.epoch == epoch
    if cluster.run_until(following, 2 * FETCH_TIMEOUT_MS):
        log(f"{old.node_id} follows {new.node_id}; cut {new.node_id} -> {old.node_id}")
        cluster.partition({new.node_id}, {old.node_id}, one_way=True)
        if cluster.run_until(lambda: _role(old) == Role.PROSPECTIVE, 2 * FETCH_TIMEOUT_MS):
            log(f"{old.node_id} pre-votes; cut {old.node_id} -> {new.node_id} too")
            cluster.partition({old.node_id}, {new.node_id})
            cluster.stats["stale_tail_pre_votes"] += 1
            cluster.run_for(cluster.faults.delay_max_ms + 1)  # its pre-votes reach the paused voters
    log(f"resume {paused}")
    for node_id in paused:
        cluster.resume(node_id)
    cluster.run_for(3 * ELECTION_TIMEOUT_MS)


def observer_tail(cluster: Cluster, rng: random.Random, log: Callable[[str], None], leader: SimNode) -> None:
    """Rule 7: a Fetch answer about the log before a truncation never applies to the log
    grown back to the same offset."""
    old = leader
    voters = cluster.voter_ids - {old.node_id}
    observers = [node for node in cluster.nodes.values() if node.node_id not in cluster.voter_ids]
    log(f"cut leader {old.node_id} from the voters; it appends a record only the observers get")
    cluster.partition({old.node_id}, voters)
    _propose(cluster, old, 1, f"observer-tail-{cluster.now_ms}")
    end = old.log.end_offset()
    old_epoch = old.core.epoch if old.core is not None else 0

    def candidate() -> SimNode | None:
        return next((cluster.nodes[v] for v in sorted(voters) if _role(cluster.nodes[v]) == Role.CANDIDATE), None)
    if not cluster.run_until(lambda: candidate() is not None
                             and all(o.log.end_offset() == end for o in observers), 6 * FETCH_TIMEOUT_MS):
        return
    new = candidate()
    assert new is not None
    log(f"{new.node_id} stands; its vote request deposes {old.node_id}, then {old.node_id} is cut off again")
    cluster.heal()
    cluster.partition({old.node_id}, voters - {new.node_id})
    if not cluster.run_until(lambda: old.core is None or old.core.epoch > old_epoch, 2 * ELECTION_TIMEOUT_MS):
        return
    cluster.partition({old.node_id}, voters)  # it must not learn who leads
    cluster.partition({old.node_id}, voters - {new.node_id})

    def probing() -> bool:
        return all(o.core is not None and o.core.role == Role.UNATTACHED and o.core.epoch > old_epoch
                   for o in observers)
    if not cluster.run_until(probing, 2 * FETCH_TIMEOUT_MS):
        return
    log(f"observers probe; only {new.node_id} is reachable")
    cluster.partition({o.node_id for o in observers}, set(cluster.voter_ids) - {new.node_id})
    cluster.stats["observer_tail_probes"] += 1
    cluster.run_for(3 * ELECTION_TIMEOUT_MS)


SCENARIOS: dict[str, Callable[[Cluster, random.Random, Callable[[str], None], SimNode], None]] = {
    "handover": handover,
    "shutdown_in_pre_vote": shutdown_in_pre_vote,
    "restart_in_pre_vote": restart_in_pre_vote,
    "stale_tail": stale_tail,
    "observer_tail": observer_tail,
}
