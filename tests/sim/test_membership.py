"""Voter changes in the simulator (tests/sim/membership.py): the seeds test_sim.py runs check
every invariant; these pin two seeds that reach the plans' points, so a plan that stopped
reaching them cannot pass unnoticed."""

from __future__ import annotations

from tests.sim.scenario import run_seed


def test_changes_right_after_an_election_and_the_split_change() -> None:
    """Seed 143 (5 voters): a change lands the moment the new leader's own-epoch gate opens
    (refused until then), a second one is refused while the first is pending, and the split
    change (tests/sim/split_change.py) runs."""
    stats = run_seed(143).stats
    assert stats["voter_changes_right_after_election"] >= 1
    assert stats["voter_change_refused_leader-not-ready"] > 0
    assert stats["voter_change_refused_change-pending"] > 0
    assert stats["split_changes"] == 1
    assert stats["voter_changes_committed"] >= 2


def test_a_replaced_disk_is_a_new_replica_swapped_in() -> None:
    """Seed 154 (3 voters): voter 1's disk is replaced (a new directory id); its old replica
    is removed and the new one added once it caught up (refused as not caught up before)."""
    result = run_seed(154)
    assert result.stats["disks_replaced"] == 1
    assert result.stats["voter_change_refused_not-caught-up"] > 0
    assert any("replacement of 1 committed" in line for line in result.plan)
