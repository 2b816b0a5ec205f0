"""No state machine call does work that grows with the store (issue 19): apply writes
key_heads behind it a slice of the keys per call (storage/state_heads_sweep.py), history
pruning goes a bounded step per call, and what a reopened store reads back (after a close
or a kill) is what was there."""

from __future__ import annotations

import random
import shutil
import sqlite3

from storage.commands import delete, put
from storage.state_heads_sweep import HEADS_SWEEP_KEYS_PER_RECORD, HEADS_SWEEP_MIN_KEYS
from storage.state_machine import StateMachine
from storage.state_writes import APPLY_PRUNE_STEP_VERSIONS
from tests.state_machine.helpers import data_batch

CALL_RECORDS = 100
CALLS = 120
KEYS = 2_000


def _meta(path: str) -> tuple[int, int, int]:
    """(applied_version, oldest_version, heads_version) as committed in the file."""
    connection = sqlite3.connect(path)
    try:
        return connection.execute(
            "SELECT applied_version, oldest_version, heads_version FROM meta").fetchone()
    finally:
        connection.close()


def _key_heads(path: str) -> set[tuple[str, int, int]]:
    connection = sqlite3.connect(path)
    try:
        return set(connection.execute("SELECT key, mod_version, mod_seq FROM key_heads"))
    finally:
        connection.close()


def _churn_call(state: StateMachine, rng: random.Random, records: int) -> set[str]:
    """One call of ``records`` puts and deletes over KEYS keys; the keys it named."""
    offset = state.applied_version
    commands = [put(f"k/{rng.randrange(KEYS):05d}", b"v%d" % index) if rng.random() < 0.8
                else delete(f"k/{rng.randrange(KEYS):05d}") for index in range(records)]
    state.apply([data_batch(offset, commands)])
    return {command.success[0].key for command in commands}


def _everything(state: StateMachine) -> tuple[int, list[object], list[object]]:
    version, entries, _next = state.list("", limit=10_000)
    return version, entries, state.changes("", state.oldest_version, limit=100_000)[1]


def test_apply_writes_a_slice_of_the_heads_per_call_and_catches_up(tmp_path):
    """Once key_heads lags by heads_flush_records, each call writes at most the changed
    heads of its slice of the keys and its own keys (not the heads of a thousand versions
    at once, as before); passes end, so the lag stays bounded; the store opens to the same
    state."""
    path = str(tmp_path / "state.db")
    flush_records = 3_000
    state = StateMachine(path, heads_flush_records=flush_records, background_checkpoint=False)
    rng = random.Random(1)
    rows_written = []
    metas = []
    for _call in range(CALLS):
        before = _key_heads(path)
        _churn_call(state, rng, CALL_RECORDS)
        rows_written.append(len(_key_heads(path) - before))
        metas.append(_meta(path))
    slice_keys = max(HEADS_SWEEP_MIN_KEYS, HEADS_SWEEP_KEYS_PER_RECORD * CALL_RECORDS)
    assert 0 < max(rows_written) <= slice_keys + CALL_RECORDS
    pass_records = KEYS // HEADS_SWEEP_KEYS_PER_RECORD + CALL_RECORDS
    assert len({heads for _applied, _oldest, heads in metas}) > 2  # passes ended, more than once
    assert all(applied - heads < flush_records + pass_records + CALL_RECORDS
               for applied, _oldest, heads in metas)
    expected = _everything(state)
    state.close()
    with StateMachine(path) as reopened:
        assert _everything(reopened) == expected


def test_a_store_killed_at_any_call_opens_to_the_same_heads(tmp_path):
    """The sweep's heads_version: every change key_heads lacks is above it, so a copy of the
    files taken between any two calls (as a kill leaves them) opens to the heads the live
    store holds, through passes, creates, deletes and retention prunes that forget keys."""
    path = str(tmp_path / "state.db")
    state = StateMachine(path, heads_flush_records=200, history_retention_versions=300,
                         background_checkpoint=False)
    rng = random.Random(2)
    named: set[str] = set()
    try:
        for call in range(90):
            named |= _churn_call(state, rng, rng.choice((1, 7, 60, 150)))
            if call % 9 == 4:
                copy = str(tmp_path / f"killed-{call}.db")
                shutil.copy(path, copy)
                shutil.copy(path + "-wal", copy + "-wal")
                with StateMachine(copy) as reopened:
                    assert reopened._index.as_dict() == state._index.as_dict()
                    assert reopened.list("", limit=10_000) == state.list("", limit=10_000)
        live_heads = state._index.as_dict()
        assert named - set(live_heads)  # prunes forgot deleted keys
    finally:
        state.close()
    # Closed: key_heads holds exactly every head (no row of a forgotten key left behind).
    assert {(key, version, seq) for key, (_create, version, seq, _key_version) in live_heads.items()} == _key_heads(path)


def test_retention_prunes_a_step_per_call(tmp_path):
    retention = 4_000
    state = StateMachine(str(tmp_path / "state.db"), history_retention_versions=retention)
    rng = random.Random(2)
    metas = []
    for _call in range(CALLS):
        _churn_call(state, rng, CALL_RECORDS)
        metas.append(_meta(state.db_path))
    steps = [after[1] - before[1] for before, after in zip(metas, metas[1:], strict=False)]
    assert max(steps) == max(APPLY_PRUNE_STEP_VERSIONS, 2 * CALL_RECORDS)
    slack = retention // 4 + 1
    assert all(applied - retention - oldest < slack + CALL_RECORDS
               for applied, oldest, _heads in metas[len(metas) // 2:])
    state.close()


def test_prune_history_deletes_the_rows_of_the_keys_it_forgets(tmp_path):
    """A prune writes no heads of its own; it deletes the key_heads row of every key whose
    delete it drops, whichever change of the key that row still names."""
    path = str(tmp_path / "state.db")
    state = StateMachine(path, heads_flush_records=1)
    state.apply([data_batch(0, [put("a", b"1"), put("b", b"1"), put("c", b"1")])])  # written
    state.apply([data_batch(3, [put("a", b"2"), delete("b"), put("d", b"1")])])
    assert {key for key, _version, _seq in _key_heads(path)} == {"a", "b", "c", "d"}
    state.close()
    state = StateMachine(path, heads_flush_records=100_000)  # the sweep does not run
    state.apply([data_batch(6, [delete("a"), put("c", b"2")])])
    assert ("a", 4, 0) in _key_heads(path)  # a's row still names its put
    state.prune_history(8)
    assert _meta(path)[1:] == (8, 6)
    assert {key for key, _version, _seq in _key_heads(path)} == {"c", "d"}
    assert sorted(state._index.as_dict()) == ["c", "d"]
    state.close()
    with StateMachine(path) as reopened:
        assert [(entry.key, entry.value) for entry in reopened.list("")[1]] == [("c", b"2"), ("d", b"1")]
