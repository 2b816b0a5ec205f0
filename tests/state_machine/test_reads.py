"""Versioned reads: get/list at one version, at_version down to the horizon, changes."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from storage.commands import Command, Op, OpKind, delete, put
from storage.key_index import prefix_upper_bound
from storage.state_machine import (
    StateMachine,
    VersionCompactedError,
    VersionNotAppliedError,
)
from tests.state_machine.helpers import data_batch


@pytest.fixture()
def state(tmp_path):
    machine = StateMachine(str(tmp_path / "state.db"))
    yield machine
    machine.close()


def test_list_by_prefix_in_key_order_with_pages(state):
    keys = ["app/b", "app/a", "app/c/d", "apple", "ap", "b/x", "app/é", "app/\U0001f600"]
    state.apply([data_batch(0, [put(key, key.encode()) for key in keys])])
    version, page, next_key = state.list("app/", limit=2)
    assert version == len(keys)
    assert [e.key for e in page] == ["app/a", "app/b"] and next_key == "app/b"
    _, page, next_key = state.list("app/", after=next_key, limit=2)
    assert [e.key for e in page] == ["app/c/d", "app/é"] and next_key == "app/é"
    _, page, next_key = state.list("app/", after=next_key, limit=2)
    assert [e.key for e in page] == ["app/\U0001f600"] and next_key is None
    assert [e.key for e in state.list("")[1]] == sorted(keys)
    with pytest.raises(ValueError):
        state.list("", limit=0)


def test_prefix_upper_bound_covers_edge_code_points():
    assert prefix_upper_bound("") is None
    assert prefix_upper_bound("ab") == "ac"
    assert prefix_upper_bound("a\U0010ffff") == "b"
    assert prefix_upper_bound("\ud7ff") == "\ue000"
    assert prefix_upper_bound("\U0010ffff") is None


def test_list_prefix_with_max_code_point(state):
    keys = ["x\U0010ffff", "x\U0010ffffz", "y"]
    state.apply([data_batch(0, [put(key, b"") for key in keys])])
    assert [e.key for e in state.list("x\U0010ffff")[1]] == keys[:2]


def test_at_version_get_and_list(state):
    state.apply([data_batch(0, [put("a", b"1"), put("b", b"1"), delete("a"), put("b", b"2"),
                                put("c", b"1"), put("a", b"3")])])
    expected = {
        0: {},
        1: {"a": b"1"},
        2: {"a": b"1", "b": b"1"},
        3: {"b": b"1"},
        4: {"b": b"2"},
        5: {"b": b"2", "c": b"1"},
        6: {"a": b"3", "b": b"2", "c": b"1"},
    }
    for version, contents in expected.items():
        answered, listed, _ = state.list("", at_version=version)
        assert answered == version
        assert {e.key: e.value for e in listed} == contents
        for key in "abc":
            got = state.get(key, at_version=version)
            assert got[0] == version
            assert (got[1].value if got[1] else None) == contents.get(key)
    assert state.get("a", at_version=6)[1].create_version == 6


def test_at_version_back_to_the_horizon_and_410_below(state):
    state.apply([data_batch(0, [put("a", b"1"), put("b", b"1"), put("a", b"2"), delete("b"),
                                put("c", b"1"), put("a", b"3"), put("d", b"1")])])
    full = {v: {e.key: e.value for e in state.list("", at_version=v)[1]} for v in range(8)}
    state.prune_history(4)
    assert state.oldest_version == 4
    for version in range(4, 8):
        assert {e.key: e.value for e in state.list("", at_version=version)[1]} == full[version]
        for key in "abcd":
            entry = state.get(key, at_version=version)[1]
            assert (entry.value if entry else None) == full[version].get(key)
    with pytest.raises(VersionCompactedError) as raised:
        state.get("a", at_version=3)
    assert raised.value.oldest_version == 4
    with pytest.raises(VersionCompactedError):
        state.list("", at_version=0)
    with pytest.raises(VersionCompactedError):
        state.changes("", 3)
    with pytest.raises(VersionNotAppliedError) as ahead:
        state.get("a", at_version=8)
    assert ahead.value.applied_version == 7
    # The horizon never moves back, nor past the applied version.
    state.prune_history(2)
    assert state.oldest_version == 4
    state.prune_history(100)
    assert state.oldest_version == 7
    assert state.get("a", at_version=7)[1].value == b"3"


def test_at_version_follows_a_key_through_deletes_and_recreates(state):
    state.apply([data_batch(0, [put("a", b"1"), put("a", b"2"), delete("a"), put("b", b"1"),
                                put("a", b"3"), delete("a"), put("a", b"4")])])
    expected = {0: None, 1: (b"1", 1, 1), 2: (b"2", 2, 1), 3: None, 4: None, 5: (b"3", 5, 5),
                6: None, 7: (b"4", 7, 7)}

    def a_at(version: int) -> tuple[bytes, int, int] | None:
        entry = state.get("a", at_version=version)[1]
        return None if entry is None else (entry.value, entry.mod_version, entry.create_version)

    assert {version: a_at(version) for version in expected} == expected
    assert state.list("", at_version=3)[1] == []
    assert [e.key for e in state.list("", at_version=5)[1]] == ["a", "b"]
    for horizon in (2, 4, 6, 7):
        state.prune_history(horizon)
        assert {version: a_at(version) for version in range(horizon, 8)} == {
            version: expected[version] for version in range(horizon, 8)}
    # Fully pruned: one row per live key, its current value.
    assert [(e.type, e.key) for e in state.changes("", 7)[1]] == []
    assert [(e.key, e.value) for e in state.list("")[1]] == [("a", b"4"), ("b", b"1")]


def test_a_deleted_key_is_forgotten_once_its_delete_is_below_the_horizon(state, tmp_path):
    state.apply([data_batch(0, [put("a", b"1"), put("b", b"1"), delete("a"), put("b", b"2")])])
    state.prune_history(3)
    assert state.get("a", at_version=3)[1] is None
    state.close()
    connection = sqlite3.connect(str(tmp_path / "state.db"))
    try:
        heads = connection.execute("SELECT key, mod_version FROM key_heads ORDER BY key").fetchall()
        history = connection.execute("SELECT version, key, op FROM history ORDER BY version").fetchall()
    finally:
        connection.close()
    assert heads == [("b", 4)]
    assert history == [(2, "b", 1), (4, "b", 1)]  # b at the horizon, and b's change above it


def test_history_retention_prunes_during_apply(tmp_path):
    with StateMachine(str(tmp_path / "state.db"), history_retention_versions=10) as state:
        for offset in range(100):
            state.apply([data_batch(offset, [put(f"k{offset % 3}", b"%d" % offset)])])
        assert 100 - 10 - (10 // 4 + 1) <= state.oldest_version <= 90
        assert state.get("k0", at_version=state.oldest_version)[1] is not None
        with pytest.raises(VersionCompactedError):
            state.changes("", state.oldest_version - 1)


def test_changes_are_ordered_filtered_and_include_deletes(state):
    state.apply([data_batch(0, [put("w/a", b"1"), put("x/a", b"1"), delete("w/a"),
                                put("w/b", b"2")])])
    version, events = state.changes("w/", 0)
    assert version == 4
    assert [(e.type, e.key, e.mod_version, e.value) for e in events] == [
        ("put", "w/a", 1, b"1"), ("delete", "w/a", 3, None), ("put", "w/b", 4, b"2")]
    assert state.changes("w/", 3)[1][0].key == "w/b"
    assert state.changes("w/", 4) == (4, [])


def test_changes_limit_never_splits_a_version(state):
    txn = Command((), tuple(Op(OpKind.PUT, f"t{i}", b"x") for i in range(5)))
    state.apply([data_batch(0, [put("a", b"1"), txn, put("b", b"1")])])
    version, events = state.changes("", 0, limit=2)
    assert version == 2
    assert [e.mod_version for e in events] == [1, 2, 2, 2, 2, 2]
    version, events = state.changes("", version, limit=2)
    assert (version, [e.key for e in events]) == (3, ["b"])


def test_reads_from_another_thread_see_one_version_while_apply_runs(state):
    """Each apply writes every key with the same value; a read must never mix two applies."""
    keys = [f"k{i:02d}" for i in range(20)]
    applies = 150

    def writer():
        for offset in range(applies):
            txn = Command((), tuple(Op(OpKind.PUT, key, b"%d" % offset) for key in keys))
            state.apply([data_batch(offset, [txn])])

    thread = threading.Thread(target=writer)
    thread.start()
    mixed: list[object] = []
    reads = 0
    try:
        while thread.is_alive() or reads < 20:
            version, page, next_key = state.list("k", limit=10)
            values = {e.value for e in page}
            if len(values) > 1 or any(e.mod_version > version for e in page):
                mixed.append((version, values))
            get_version, entry = state.get("k05")
            if entry is not None and entry.mod_version > get_version:
                mixed.append((get_version, entry))
            reads += 1
    finally:
        thread.join()
    assert mixed == []
    assert state.applied_version == applies
    assert {e.value for e in state.list("k", limit=100)[1]} == {b"%d" % (applies - 1)}


def test_reads_during_apply_with_prunes_and_key_heads_written_behind_match_the_model(tmp_path):
    """While one thread applies puts and deletes, with history pruned inside apply and
    key_heads written every few records, another thread's gets and lists (current and at
    an older version) always answer exactly the state of the version they name, or 410."""
    keys = [f"k{i}" for i in range(7)]
    applies = 400

    def command(offset):
        key = keys[offset % len(keys)]
        return delete(key) if offset % 5 == 0 else put(key, b"%d" % offset)

    states: list[dict[str, bytes]] = [{}]
    for offset in range(applies):
        state = dict(states[-1])
        op = command(offset).success[0]
        if op.kind == OpKind.DELETE:
            state.pop(op.key, None)
        else:
            state[op.key] = op.value
        states.append(state)

    machine = StateMachine(str(tmp_path / "state.db"), history_retention_versions=6, heads_flush_records=3)

    def writer():
        for offset in range(applies):
            machine.apply([data_batch(offset, [command(offset)])])

    thread = threading.Thread(target=writer)
    thread.start()
    wrong: list[object] = []
    reads = compacted = 0
    try:
        while thread.is_alive() or reads < 50:
            version, entries, _next = machine.list("k", limit=100)
            if {e.key: e.value for e in entries} != states[version]:
                wrong.append(("list", version))
            key = keys[reads % len(keys)]
            version, entry = machine.get(key)
            if (entry and entry.value) != states[version].get(key):
                wrong.append(("get", version, key))
            older = max(0, version - 4)
            try:
                _v, entry = machine.get(key, at_version=older)
                if (entry and entry.value) != states[older].get(key):
                    wrong.append(("get at", older, key))
                _v, entries, _next = machine.list("", limit=3, at_version=older)
                if [(e.key, e.value) for e in entries] != sorted(states[older].items())[:3]:
                    wrong.append(("list at", older))
            except VersionCompactedError:
                compacted += 1
            reads += 1
    finally:
        thread.join()
        machine.close()
    assert wrong == []
    assert reads >= 50


class _CursorThatRunsFirst:
    """A read cursor that runs ``action`` just before the first BEGIN it is given: between
    a read taking its heads from memory and its read transaction."""

    def __init__(self, cursor: sqlite3.Cursor, action) -> None:
        self._cursor = cursor
        self._action = action

    def execute(self, sql, *args):
        if sql == "BEGIN" and self._action is not None:
            action, self._action = self._action, None
            action()
        return self._cursor.execute(sql, *args)


@pytest.mark.parametrize("read", ["get", "list", "entries_at"])
def test_a_read_at_a_version_across_a_clear_is_not_answered_from_the_emptied_state(state, monkeypatch, read):
    """clear() (the runtime rebuilding from offset 0) between a read at version 2 taking its
    heads and reading the rows: the state at version 2 is no longer there, so the read says
    so (version not applied), as it would had it started after the clear, instead of
    answering "absent" for keys that existed at version 2."""
    state.apply([data_batch(0, [put("a", b"1"), put("b", b"2")])])
    real = state._reader_cursor()
    monkeypatch.setattr(state, "_reader_cursor", lambda: _CursorThatRunsFirst(real, state.clear))
    with pytest.raises(VersionNotAppliedError):
        if read == "get":
            state.get("a", at_version=2)
        elif read == "list":
            state.list("", at_version=2)
        else:
            state.entries_at(["a", "b"], 2)


class _CursorWithAWriterBetween:
    """A read cursor before each of whose row reads (``trigger``: the statement that starts
    one) a writer call supersedes and prunes the rows a read's heads name, unless this
    thread holds the publish lock: a call that removes rows holds that lock through its
    COMMIT, so the real writer would wait for the read then."""

    def __init__(self, state: StateMachine, cursor: sqlite3.Cursor, trigger, write) -> None:
        self._state = state
        self._cursor = cursor
        self._trigger = trigger
        self._write = write
        self.writes = 0

    def execute(self, sql, *args):
        if self._trigger(sql) and not self._state._publish_lock._is_owned():
            self._write()
            self.writes += 1
        return self._cursor.execute(sql, *args)


@pytest.mark.parametrize("read", ["get", "list"])
def test_a_read_whose_rows_are_pruned_before_every_read_still_answers(tmp_path, monkeypatch, read):
    """Keys updated and pruned (retention 0) faster than a read can read their rows: each
    time the read takes the heads again its rows are gone again. It must still answer the
    state of the version it names, not give up as if the database were damaged."""
    with StateMachine(str(tmp_path / "state.db"), history_retention_versions=0) as state:
        state.apply([data_batch(0, [put("a", b"0"), put("b", b"0")])])
        offset = 2

        def write():
            nonlocal offset
            state.apply([data_batch(offset, [put("a", b"%d" % offset), put("b", b"%d" % offset)])])
            offset += 2

        if read == "get":
            trigger = lambda sql: sql == state._sql_row  # noqa: E731
        else:
            trigger = lambda sql: sql == "BEGIN"  # noqa: E731
        cursor = _CursorWithAWriterBetween(state, state._reader_cursor(), trigger, write)
        monkeypatch.setattr(state, "_reader_cursor", lambda: cursor)
        if read == "get":
            version, entry = state.get("a")
            answered = {"a": entry.value}
        else:
            version, entries, _next = state.list("")
            answered = {e.key: e.value for e in entries}
        assert cursor.writes >= 1
        written = b"%d" % (version - 2)
        assert answered == ({"a": written} if read == "get" else {"a": written, "b": written})
