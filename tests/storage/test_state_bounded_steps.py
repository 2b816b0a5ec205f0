"""No state machine call does work that grows with the store (issue 19): the key_heads
writes behind apply and history pruning go a bounded step per call, and what is read back
is the same as when they went in one go."""

from __future__ import annotations

import random
import sqlite3

from storage.commands import delete, put
from storage.state_machine import StateMachine
from storage.state_writes import APPLY_PRUNE_STEP_VERSIONS, HEADS_FLUSH_STEP_VERSIONS
from tests.state_machine.helpers import data_batch

CALL_RECORDS = 100
CALLS = 120


def _meta(path: str) -> tuple[int, int, int]:
    """(applied_version, oldest_version, heads_version) as committed in the file."""
    connection = sqlite3.connect(path)
    try:
        return connection.execute(
            "SELECT applied_version, oldest_version, heads_version FROM meta").fetchone()
    finally:
        connection.close()


def _churn(state: StateMachine, rng: random.Random, calls: int) -> list[tuple[int, int, int]]:
    """Calls of CALL_RECORDS puts and deletes over 2,000 keys; the meta row after each."""
    metas = []
    for _call in range(calls):
        offset = state.applied_version
        commands = [put(f"k/{rng.randrange(2000):05d}", b"v%d" % index) if rng.random() < 0.8
                    else delete(f"k/{rng.randrange(2000):05d}") for index in range(CALL_RECORDS)]
        state.apply([data_batch(offset, commands)])
        metas.append(_meta(state.db_path))
    return metas


def _everything(state: StateMachine) -> tuple[int, list[object], list[object]]:
    version, entries, _next = state.list("", limit=10_000)
    return version, entries, state.changes("", state.oldest_version, limit=100_000)[1]


def test_key_heads_catch_up_a_step_per_call(tmp_path):
    path = str(tmp_path / "state.db")
    state = StateMachine(path, heads_flush_records=3_000)
    metas = _churn(state, random.Random(1), CALLS)
    step = max(HEADS_FLUSH_STEP_VERSIONS, 2 * CALL_RECORDS)
    steps = [after[2] - before[2] for before, after in zip(metas, metas[1:], strict=False)]
    assert max(steps) == step  # key_heads did catch up...
    assert all(applied - heads < 3_000 + CALL_RECORDS for applied, _oldest, heads in metas)
    expected = _everything(state)
    state.close()
    with StateMachine(path) as reopened:  # ...and opens to the same state
        assert _everything(reopened) == expected


def test_retention_prunes_a_step_per_call(tmp_path):
    retention = 4_000
    state = StateMachine(str(tmp_path / "state.db"), history_retention_versions=retention)
    metas = _churn(state, random.Random(2), CALLS)
    steps = [after[1] - before[1] for before, after in zip(metas, metas[1:], strict=False)]
    assert max(steps) == max(APPLY_PRUNE_STEP_VERSIONS, 2 * CALL_RECORDS)
    slack = retention // 4 + 1
    assert all(applied - retention - oldest < slack + CALL_RECORDS
               for applied, oldest, _heads in metas[len(metas) // 2:])
    state.close()


def test_prune_history_writes_heads_through_its_horizon_and_a_step(tmp_path):
    path = str(tmp_path / "state.db")
    state = StateMachine(path, heads_flush_records=100_000)
    _churn(state, random.Random(3), 60)
    before = _everything(state)
    at_horizon = state.list("", limit=10_000, at_version=2_500)
    applied, _oldest, heads = _meta(path)
    assert heads == 0
    state.prune_history(300)
    assert _meta(path)[1:] == (300, HEADS_FLUSH_STEP_VERSIONS)
    state.prune_history(2_500)
    assert _meta(path)[1:] == (2_500, 2_500)
    assert _everything(state)[:2] == before[:2]
    assert state.list("", limit=10_000, at_version=2_500) == at_horizon
    state.close()
    with StateMachine(path) as reopened:
        assert _everything(reopened)[:2] == before[:2] and reopened.applied_version == applied
