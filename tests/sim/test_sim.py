"""The seeded simulator as a test: 510 seeds over 1, 3 and 5 voters (with observers).

Each seed runs a fault phase with invariants checked after every event, then a liveness
phase (see tests/sim/scenario.py). A failure message carries the replay command.
"""

from __future__ import annotations

import pytest

from tests.sim.scenario import SimulationFailure, run_seed

SEEDS_PER_CHUNK = 51
CHUNKS = 10  # 510 seeds in all; seed % 3 picks 1, 3 or 5 voters


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_simulated_seeds(chunk: int) -> None:
    for seed in range(chunk * SEEDS_PER_CHUNK, (chunk + 1) * SEEDS_PER_CHUNK):
        try:
            run_seed(seed)
        except SimulationFailure as exc:
            pytest.fail(str(exc), pytrace=False)


def test_failure_names_the_replay_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """A violated invariant surfaces as a SimulationFailure carrying the exact command."""
    from tests.sim.cluster import Cluster, InvariantViolation

    def always_broken(self: Cluster) -> None:
        raise InvariantViolation("injected")

    monkeypatch.setattr(Cluster, "_check_majority_holds", always_broken)
    with pytest.raises(SimulationFailure, match=r"python -m tests\.sim\.run --seed 4 --voters 3"):
        run_seed(4, 3)


def test_same_seed_same_run() -> None:
    first = run_seed(17)
    second = run_seed(17)
    assert (first.events, first.simulated_ms, first.plan) == (second.events, second.simulated_ms, second.plan)
