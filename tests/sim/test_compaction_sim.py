"""The compaction simulation as a test (tests/sim/compaction.py): seeded runs with every
replica cleaning to the announced dirty offset, snapshots, an observer cut off or wiped while
tombstones are dropped, voter crashes; invariants checked after every event."""

from __future__ import annotations

import pytest

from tests.sim.cluster import InvariantViolation
from tests.sim.compaction import run_compaction_seed

# 2003 and 2027: an observer copying a cleaned prefix took the states inside it, past the
# last offset gap, for real versions (caught once the simulator checked every applied batch;
# fixed in raft/node.py _follower_append). 82 and 2055: an observer restarted on a log that
# starts at a snapshot rebuilt its state from it through its cleaned prefix, whose cleaner had
# dropped the tombstone of a key alive in the snapshot (docs/compaction.md rule 9). 2207: an
# observer restarted with a state older than a copied (not its own) cleaned prefix, which it
# can replay.
SEEDS = [*range(6), 82, 2003, 2027, 2055, 2207]


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


def test_the_simulation_catches_cleaning_past_the_durable_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without rule 9's bound (clean only below the version SQLite made durable), a crash
    leaves a replica whose state is older than its cleaned prefix on a log that starts at a
    snapshot: it could only rebuild by bringing deleted keys back."""
    from tests.sim.compaction import CompactionSim

    monkeypatch.setattr(CompactionSim, "_clean_bound", lambda self, model: model.applied)
    with pytest.raises(InvariantViolation, match="behind the cleaned prefix"):
        run_compaction_seed(79)
