"""The seeded simulator as a test: 1020 seeds over 1, 3 and 5 voters (with observers),
5 % of them changing the voter set (tests/sim/membership.py; make sim: 20 %).

Each seed runs a fault phase with invariants checked after every event, then a liveness
phase (see tests/sim/scenario.py). A failure message carries the replay command.

Seed 49 (and 15 more of 0-509, all with three voters): one voter down for good, the other
downloading a large snapshot slowly, and the leader resigned again and again because
check-quorum counted only Fetch, not FetchSnapshot (liveness; fixed in raft/leader.py).
"""

from __future__ import annotations

import collections

import pytest

from raft.node import Role
from tests.sim.cluster import Cluster
from tests.sim.membership import QUICK_MEMBERSHIP_PROBABILITY, has_membership
from tests.sim.scenario import LIVENESS_KINDS, SimulationFailure, run_seed

SEEDS_PER_CHUNK = 51
CHUNKS = 20  # 1020 seeds in all; seed % 3 picks 1, 3 or 5 voters


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_simulated_seeds(chunk: int) -> None:
    exercised: collections.Counter[str] = collections.Counter()
    for seed in range(chunk * SEEDS_PER_CHUNK, (chunk + 1) * SEEDS_PER_CHUNK):
        try:
            result = run_seed(seed, membership=has_membership(seed, QUICK_MEMBERSHIP_PROBABILITY))
        except SimulationFailure as exc:
            pytest.fail(str(exc), pytrace=False)
        exercised.update(result.stats)
    # The faults really happened: a simulator that stopped injecting them would pass vacuously.
    for what in ("crashes", "became_leader", "became_resigned", "truncations", "reads_done", "reads_failed",
                 "pauses", "long_delays", "slow_snapshot_chunks", "snapshot_installs", "handovers",
                 "shutdowns_in_pre_vote", "restarts_in_pre_vote", "stale_tail_pre_votes",
                 *(f"liveness_{kind}" for kind in LIVENESS_KINDS)):
        assert exercised[what] > 0, f"chunk {chunk} never exercised {what}: {dict(exercised)}"


def test_failure_names_the_replay_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """A violated invariant surfaces as a SimulationFailure carrying the exact command."""
    from tests.sim.cluster import InvariantViolation

    def always_broken(self: Cluster) -> None:
        raise InvariantViolation("injected")

    monkeypatch.setattr(Cluster, "_check_majority_holds", always_broken)
    with pytest.raises(SimulationFailure, match=r"python -m tests\.sim\.run --seed 4 --voters 3"):
        run_seed(4, 3)


def test_same_seed_same_run() -> None:
    first = run_seed(17)
    second = run_seed(17)
    assert (first.events, first.simulated_ms, first.plan) == (second.events, second.simulated_ms, second.plan)


def test_a_paused_leader_resumes_late_with_its_stale_state() -> None:
    """A pause holds every input (messages, timers, flushes) and loses none: the other voters
    elect a new leader meanwhile, and the old one handles all it missed once it resumes."""
    cluster = Cluster(seed=3, voters=3)
    assert cluster.run_until(lambda: cluster.leader() is not None, 5_000)
    paused = cluster.leader()
    assert paused is not None and paused.core is not None
    old_epoch = paused.core.epoch
    paused_at_ms = cluster.now_ms
    cluster.pause(paused.node_id, 1_500)
    assert cluster.propose((b"to a paused leader",), paused) is None  # it answers no client
    assert cluster.run_until(lambda: cluster.leader() not in (None, paused), 1_400)
    assert paused.core.role == Role.LEADER and paused.core.epoch == old_epoch  # stale, untouched
    assert paused.held
    cluster.run_for(paused_at_ms + 1_600 - cluster.now_ms)
    assert not paused.held
    assert paused.core.role == Role.FOLLOWER and paused.core.epoch > old_epoch


def test_a_voter_truncated_to_an_empty_log_is_not_taken_for_a_lost_disk() -> None:
    """Seed 323 (5 voters): voter 5's log was truncated to empty by a divergence, it crashed
    and came back; taken for a lost disk, it refused every vote, and with two voters down for
    good no leader could be elected."""
    result = run_seed(323, 5)
    assert result.liveness_ms < 3000


def test_an_answer_to_an_older_fetch_never_truncates_a_log_grown_back() -> None:
    """Found at seeds 4162 (make sim SEEDS=100000) and 1747: a node whose log was truncated
    and had grown back to the same offset took the answer to an older Fetch (a divergence,
    about its old log) for the answer to the one in flight, and cut below its high
    watermark: the node stopped (ProtocolInvariantError). Fetch answers now echo
    last_fetched_epoch. Seed 4 replays such an older Fetch (stale_fetch_replays) and fails
    with the mutant stale_fetch_answer_taken."""
    result = run_seed(4, 3)
    assert result.stats["stale_fetch_replays"] >= 1 and result.stats["truncations"] > 0
