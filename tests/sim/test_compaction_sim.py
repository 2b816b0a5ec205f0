"""The compaction simulation as a test (tests/sim/compaction.py): seeded runs with every
replica cleaning to the announced dirty offset, snapshots, an observer cut off or wiped while
tombstones are dropped, voter crashes; invariants checked after every event."""

from __future__ import annotations

import pytest

from tests.sim.cluster import InvariantViolation
from tests.sim.compaction import run_compaction_seed

# 2003 and 2027: an observer copying a cleaned prefix took the states inside it, past the
# last offset gap, for real versions (caught once the simulator checked every applied batch;
# fixed in raft/node.py _follower_append).
SEEDS = [*range(6), 2003, 2027]


@pytest.mark.parametrize("seed", SEEDS)
def test_compaction_seed(seed: int) -> None:
    try:
        run = run_compaction_seed(seed)
    except InvariantViolation as exc:
        pytest.fail(str(exc), pytrace=False)
    assert run.stats["sim_cleanings"] > 0
    assert run.stats["sim_real_versions_checked"] > 0


def test_the_simulation_catches_a_resurrected_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the re-bootstrap rule (snapshot for a fetcher below the cleaned tombstones), a
    replica that missed a dropped tombstone exposes a state no history produces."""
    from raft.node import RaftNode

    monkeypatch.setattr(RaftNode, "tombstone_unsafe_below", lambda self: 0)
    failures = 0
    for seed in range(4, 8):
        try:
            run_compaction_seed(seed)
        except InvariantViolation:
            failures += 1
    assert failures > 0
