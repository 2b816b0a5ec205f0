"""The compaction simulation as a test (tests/sim/compaction.py): seeded runs with every
replica cleaning to the announced dirty offset, multi-op transactions over 50-500 keys,
gap-free cleaned logs, deletes landing exactly at the re-bootstrap bound of a returning
observer, restarts inside a copy and right after a cleaning, a late voter copying the
cleaned log from 0 (some with another retention), snapshots, voter crashes; invariants
checked after every event.

The self-tests break one rule each and check the simulation catches it. They pick their
seeds by plan (``draw_plan`` draws a seed's plan without running it): the first seeds whose
plan sets up the edge the rule guards, so a change of the plan's other draws moves them
along instead of leaving a test on a seed that no longer reaches its edge.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from raft.messages import FetchRequest, FetchResponse
from tests.sim.cluster import InvariantViolation
from tests.sim.compaction import Plan, draw_plan, run_compaction_seed

# Found with the plans of their time (they run other scenarios now): 2003 and 2027: an
# observer copying a cleaned prefix took the states inside it, past the last offset gap, for
# real versions. 82 and 2055: an observer restarted on a log that starts at a snapshot
# rebuilt its state through its cleaned prefix (rule 9). 2207: an observer restarted with a
# state older than a copied cleaned prefix. 58 and 242: a gap-free copy of a cleaned prefix
# applied as history. 7: a late voter with another tombstone retention followed.
# With today's plan: 42 and 72: a re-bootstrapped observer's cleaned log ended the
# snapshot's epoch at the snapshot, not where the next epoch starts.
# 5163, 5989 and 6228: a copy that stopped inside a leader's cleaned prefix counted as
# cleaned only up to where it stopped (5163: then completed with raw records from a leader
# cleaned less; 5989, 6228: a log from 0 whose cleaned range did not replay to its end).
REGRESSIONS = [7, 42, 58, 72, 82, 242, 2003, 2027, 2055, 2207, 5163, 5989, 6228]
SEEDS = sorted({*range(45), *REGRESSIONS})


@pytest.mark.parametrize("seed", SEEDS)
def test_compaction_seed(seed: int) -> None:
    try:
        run = run_compaction_seed(seed)
    except InvariantViolation as exc:
        pytest.fail(str(exc), pytrace=False)
    assert run.stats["sim_real_versions_checked"] > 0
    # A voter refusing a leader with another retention holds the dirty offset at 0.
    assert run.stats.get("sim_cleanings", 0) > 0 or run.stats["sim_nodes_refusing_a_leader"] > 0


def test_the_simulation_catches_a_resurrected_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the re-bootstrap rule (snapshot for a fetcher below the cleaned tombstones), the
    observer that missed the delete one offset below the bound serves the deleted key."""
    from raft.node import RaftNode

    monkeypatch.setattr(RaftNode, "tombstone_unsafe_below", lambda self: 0)
    assert _failures(_seeds(lambda plan: plan.bound_case == "below", 3), "deleted keys reappeared") >= 2


def test_the_simulation_catches_cleaning_past_the_durable_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without rule 9's bound (clean only below the version SQLite made durable), power lost
    right after a cleaning leaves a replica whose state is older than its cleaned prefix on
    a log that starts at a snapshot: it could only rebuild by bringing deleted keys back."""
    from tests.sim.compaction import CompactionSim

    monkeypatch.setattr(CompactionSim, "_clean_bound", lambda self, model: model.applied)
    seeds = _seeds(lambda plan: plan.restart_after_cleaning_ms > 0 and plan.restart_on_snapshot_log, 4)
    assert _failures(seeds, "behind the cleaned prefix") >= 2


def test_the_simulation_catches_gap_free_copies_taken_for_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy rule before the leader announced its cleaned end: a copy only at an offset
    gap or when continuing one (docs/compaction.md rule 5). Gap-free cleaned logs, and an
    observer returning at the bound of a retention window wide enough to hold superseded ops."""
    from raft.follower import FollowerHandlers

    original = FollowerHandlers._follower_append

    def gap_rule(self: Any, response: FetchResponse) -> None:
        log = self._log
        end = log.end_offset()
        copying = end <= log.cleaned_end()
        for batch in response.records:
            if batch.next_offset > response.dirty_offset:
                break
            copying = copying or batch.base_offset > end
            end = max(end, batch.next_offset)
        original(self, dataclasses.replace(response, cleaned_end=end if copying else 0))

    monkeypatch.setattr(FollowerHandlers, "_follower_append", gap_rule)
    seeds = _seeds(lambda plan: plan.gap_free and plan.bound_case == "at" and plan.retention >= 13, 4)
    assert _failures(seeds, "no committed history produces") >= 2


def test_the_simulation_catches_unequal_retentions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the refusal, a late voter with another tombstone retention follows, copies
    and cleans to other bytes than its peers (rule 3)."""
    from raft import node

    original = node._HANDLERS[FetchResponse]

    def no_check(self: Any, now_ms: int, src: int, response: FetchResponse) -> None:
        mine = self.config.tombstone_retention_records
        original(self, now_ms, src, dataclasses.replace(response, tombstone_retention_records=mine))

    monkeypatch.setitem(node._HANDLERS, FetchResponse, no_check)  # every answer looks equal
    seeds = _seeds(lambda plan: plan.late_voter is not None and plan.late_retention != plan.retention, 3)
    assert _failures(seeds, "to different bytes") >= 2


def test_the_simulation_catches_a_partial_copy_completed_from_a_leader_cleaned_less(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the copy-target rule (rule 5: a fetcher inside a copy cleaned to C takes
    nothing below C from a leader cleaned less; that leader sends a snapshot at or above C),
    seed 5163's observer, which copied [499, 515) of a prefix cleaned to 519, takes the raw
    [515, 519) from the next leader (cleaned to 444): at 519 k40's create_version is wrong."""
    from raft import node
    from raft.follower import FollowerHandlers

    original_fetch = node._HANDLERS[FetchRequest]
    original_append = FollowerHandlers._follower_append

    def fetch_without_target(self: Any, now_ms: int, src: int, request: FetchRequest) -> None:
        original_fetch(self, now_ms, src, dataclasses.replace(request, cleaned_end=0))

    def append_anything(self: Any, response: FetchResponse) -> None:
        log = self._log
        if log.end_offset() < log.cleaned_end():
            response = dataclasses.replace(response, cleaned_end=max(response.cleaned_end, log.cleaned_end()))
        original_append(self, response)

    monkeypatch.setitem(node._HANDLERS, FetchRequest, fetch_without_target)
    monkeypatch.setattr(FollowerHandlers, "_follower_append", append_anything)
    assert _failures([5163], "no committed history produces") == 1


def _seeds(wanted: Callable[[Plan], bool], count: int) -> list[int]:
    """The first ``count`` seeds whose plan is ``wanted``."""
    return list(itertools.islice((seed for seed in itertools.count() if wanted(draw_plan(seed, voters=3))), count))


def _failures(seeds: Iterable[int], invariant: str) -> int:
    failures = 0
    for seed in seeds:
        try:
            run_compaction_seed(seed)
        except InvariantViolation as exc:
            assert invariant in str(exc), str(exc)
            failures += 1
    return failures
