"""The compaction simulation as a test (tests/sim/compaction.py): seeded runs with every
replica cleaning to the announced dirty offset, multi-op transactions over 50-500 keys,
copies spanning several small Fetch answers, fetchers returning around the re-bootstrap
bound, a late voter copying the cleaned log from 0 (some with another retention),
snapshots, an observer cut off or wiped while tombstones are dropped, voter crashes;
invariants checked after every event."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from raft.messages import FetchResponse
from tests.sim.cluster import InvariantViolation
from tests.sim.compaction import run_compaction_seed

# Found with the plan of their time (it changed since, so they now run other scenarios):
# 2003 and 2027: an observer copying a cleaned prefix took the states inside it, past the
# last offset gap, for real versions. 82 and 2055: an observer restarted on a log that
# starts at a snapshot rebuilt its state through its cleaned prefix (rule 9). 2207: an
# observer restarted with a state older than a copied cleaned prefix.
# With today's plan: 58 (242 before the fetch timeouts were jittered): a gap-free copy of
# a cleaned prefix applied as history (a delete riding in a record that kept another op, so
# no offset was missing). 7: a late voter with
# another tombstone retention followed and cleaned to other bytes.
REGRESSIONS = [7, 58, 82, 242, 2003, 2027, 2055, 2207]
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
    """Without the re-bootstrap rule (snapshot for a fetcher below the cleaned tombstones), a
    replica that missed a dropped tombstone exposes a state no history produces."""
    from raft.node import RaftNode

    monkeypatch.setattr(RaftNode, "tombstone_unsafe_below", lambda self: 0)
    assert _failures(range(4, 8), "no committed history produces") > 0


def test_the_simulation_catches_cleaning_past_the_durable_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without rule 9's bound (clean only below the version SQLite made durable), a crash
    leaves a replica whose state is older than its cleaned prefix on a log that starts at a
    snapshot: it could only rebuild by bringing deleted keys back."""
    from tests.sim.compaction import CompactionSim

    monkeypatch.setattr(CompactionSim, "_clean_bound", lambda self, model: model.applied)
    assert _failures([1, 23], "behind the cleaned prefix") == 2


def test_the_simulation_catches_gap_free_copies_taken_for_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy rule before the leader announced its cleaned end: a copy only at an offset
    gap or when continuing one (docs/compaction.md rule 5)."""
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
    assert _failures([58], "no committed history produces") == 1


def test_the_simulation_catches_unequal_retentions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the refusal, a late voter with another tombstone retention follows, copies
    and cleans to other bytes than its peers (rule 3)."""
    from raft import node

    original = node._HANDLERS[FetchResponse]

    def no_check(self: Any, now_ms: int, src: int, response: FetchResponse) -> None:
        mine = self.config.tombstone_retention_records
        original(self, now_ms, src, dataclasses.replace(response, tombstone_retention_records=mine))

    monkeypatch.setitem(node._HANDLERS, FetchResponse, no_check)  # every answer looks equal
    assert _failures([7], "to different bytes") == 1


def _failures(seeds: Any, invariant: str) -> int:
    failures = 0
    for seed in seeds:
        try:
            run_compaction_seed(seed)
        except InvariantViolation as exc:
            assert invariant in str(exc), str(exc)
            failures += 1
    return failures
