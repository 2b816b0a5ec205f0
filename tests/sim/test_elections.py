"""The election-time scenarios run, and every election ends within the simulator's
liveness bound (timings themselves are reported by ``python -m tests.sim.elections``)."""

from __future__ import annotations

import pytest

from tests.sim.elections import SCENARIOS
from tests.sim.scenario import LIVENESS_BOUND_MS

SEEDS = 100


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_elections_complete_within_the_liveness_bound(name: str) -> None:
    for seed in range(SEEDS):
        election = SCENARIOS[name](seed)
        assert election.epochs >= 1, f"{name} seed {seed}: no new leader"
        assert election.election_ms <= LIVENESS_BOUND_MS, (
            f"{name} seed {seed}: election took {election.election_ms} ms "
            f"(replay: python -m tests.sim.elections --scenario {name} --first {seed} --seeds 1)")
